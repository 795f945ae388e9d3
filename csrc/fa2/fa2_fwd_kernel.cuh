// FA2 forward (Dao, "FlashAttention-2", Algorithm 1): one thread block per (query tile,
// batch, head). The block keeps its O tile in registers across the whole key loop; each warp
// owns 16-row slices of the query tile, so the softmax statistics never cross warps.
//
// Per key tile n (walked from the last to the first, so the tiles that need a mask come first),
// with two K/V stages (FwdTile::kStages, where the device's shared memory allows):
//   wait K[n], V[n]; start loading K[n-1], V[n-1] into the other stage
//   S = Q K[n]^T                                        (tensor cores)
//   score mod (softcap, ALiBi), mask; m, l, O rescale, P = exp2(S - m)
//   O += P V[n]                                         (tensor cores)
// so each load has a whole step to land and a step has one barrier. With one stage (large
// head dims on GPUs where two stages do not fit in shared memory) K and V alternate in their single buffers:
// V[n] loads under S = Q K[n]^T, K[n-1] under O += P V[n]; the first V tile loads with Q and K,
// so that the first step does not wait for it. Once at
// the end: O /= l, lse = m + log l.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/philox.cuh"
#include "fa2/fa2_dropout.h"
#include "common/mask.h"
#include "common/score_mod.h"
#include "common/seqinfo.h"
#include "common/softmax.h"
#include "common/tile_order.h"
#include "fa2/fa2_tiles.h"
#include "fa2/fa2_utils.h"

namespace flash::fa2 {

template <typename T, int kHeadDim_, int kStages_, bool kDropout_, bool kScoreMod_>
struct FwdTraits {
  using Element = typename CuteType<T>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStages = kStages_;  // FwdTile's, or 1 where two do not fit the device
  static constexpr bool kDropout = kDropout_;
  static constexpr bool kScoreMod = kScoreMod_;  // softcap or ALiBi may be on (runtime fields)
  static constexpr int kBlockM = FwdTile<kHeadDim>::kBlockM;
  static constexpr int kBlockN = FwdTile<kHeadDim>::kBlockN;
  static constexpr int kWarps = FwdTile<kHeadDim>::kWarps;
  static constexpr int kThreads = kWarps * 32;

  using L = Layouts<Element, kHeadDim>;
  using TiledMma = typename L::template TiledMma<kWarps>;
  using SmemQ = typename L::template Smem<kBlockM>;    // (kBlockM, hdim); reused for O
  using SmemKV = typename L::template Smem<kBlockN>;   // (kBlockN, hdim)
  using SmemVt = typename L::template SmemTransposed<kBlockN>;
  using SmemVtNoSwizzle = typename L::template SmemTransposedNoSwizzle<kBlockN>;
  using GmemLoad = typename L::template GmemLoad<kThreads>;
  using GmemStore = typename L::template GmemStore<kThreads>;

  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (cosize_v<SmemQ> + 2 * kStages * cosize_v<SmemKV>);
  static constexpr int kRowsPerThread = 2 * kBlockM / (16 * kWarps);  // rowcol rows per thread
};

// Split s of `splits`' share of a sequence's n key tiles, cut from t (the tiles the rows see).
__device__ __forceinline__ KeyTiles split_share(KeyTiles t, int s, int splits, int n) {
  const int per = (n + splits - 1) / splits;
  t.begin = max(t.begin, s * per);
  t.end = min(t.end, (s + 1) * per);
  if (t.end <= t.begin) return KeyTiles{};
  t.unmasked_begin = min(max(t.unmasked_begin, t.begin), t.end);
  t.unmasked_end = min(max(t.unmasked_end, t.unmasked_begin), t.end);
  return t;
}

template <class Tr, bool kKvCache>
__device__ __forceinline__ void fwd_tile(const FwdParams& p, char* smem, int m_block,
                                         const SeqInfo& seq, int head, int head_k, int split) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  const int tid = threadIdx.x;
  const int row0 = m_block * kBlockM;

  const Mask mask(p, seq);
  // Variable-length: a tile past the sequence's used rows (seqused_q) sees no key.
  KeyTiles tiles = row0 < seq.seqlen_q(p) ? mask.key_tiles<kBlockM, kBlockN>(row0) : KeyTiles{};
  if (kKvCache && p.num_splits > 1) {
    tiles = split_share(tiles, split, p.num_splits, (mask.seqlen_k + kBlockN - 1) / kBlockN);
  }

  // ---- global tensors of this sequence and head --------------------------------------------
  auto rows = [](auto* base, int64_t offset, const Strides& s, int seqlen) {
    return make_tensor(make_gmem_ptr(base + offset), make_shape(seqlen, Int<kHeadDim>{}),
                       make_stride(s.row, _1{}));
  };
  Tensor mQ = rows(static_cast<const Element*>(p.q), seq.q_offset(p, head), p.q_strides,
                   seq.seqlen_q(p));  // (seqlen_q, hdim)
  Tensor mK = rows(static_cast<const Element*>(p.k), seq.k_offset(p, head_k), p.k_strides,
                   seq.seqlen_k(p));  // (seqlen_k, hdim)
  Tensor mV = rows(static_cast<const Element*>(p.v), seq.v_offset(p, head_k), p.v_strides,
                   seq.seqlen_k(p));  // (seqlen_k, hdim)
  Tensor mO = rows(static_cast<Element*>(p.o), seq.o_offset(p, head), p.o_strides,
                   seq.rows_q(p));  // (rows_q, hdim)
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));  // (BM, hdim)
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));  // (BM, hdim)
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (BN, hdim, n)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (BN, hdim, n)
  float* lse_row = p.lse + seq.lse_offset(p, head);

  // ---- shared memory: Q (later O), kStages K buffers, kStages V buffers ----------------------
  // The tensors below view stage 0; stage s is the same view kKV elements further on (a
  // multiple of the swizzle period, so the swizzle pattern is unchanged).
  constexpr int kKV = cosize_v<typename Tr::SmemKV>;
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Tr::SmemQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Tr::SmemKV{});
  Tensor sV = make_tensor(sK.data() + Tr::kStages * kKV, typename Tr::SmemKV{});
  Tensor sVt = make_tensor(sV.data(), typename Tr::SmemVt{});                    // (hdim, BN)
  Tensor sVtNoSwizzle = make_tensor(sV.data(), typename Tr::SmemVtNoSwizzle{});  // (hdim, BN)

  // ---- global -> shared copies (cp.async), with (row, col) of every vector for predicates ---
  typename Tr::GmemLoad gmem_load;
  auto gmem_thr = gmem_load.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);  // (CPY, CPY_M, CPY_K)
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n)
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // The loop reads the lengths the mask holds: re-reading a variable-length batch's from
  // cu_seqlens would put a global load before every tile's copies. A paged K / V (kKvCache
  // kernels only) gathers each row through the block table (x: p.k or p.v, with its strides).
  auto load_kv = [&](auto& tG, auto& tS, int n, const void* x, const Strides& xs)
      __attribute__((always_inline)) {
    const int valid = mask.seqlen_k - n * kBlockN;
    if (kKvCache && p.block_table != nullptr) {
      const Element* base = static_cast<const Element*>(x);
      auto row_ptr = [&](int r) { return base + seq.paged_row(p, xs, head_k, n * kBlockN + r); };
      copy_rows(gmem_load, tG(_, _, _, n), tS, tKcK, row_ptr, valid, p.head_dim);
    } else if (valid < kBlockN) {
      copy_tile<true>(gmem_load, tG(_, _, _, n), tS, tKcK, valid, p.head_dim);
    } else {
      copy_tile<false>(gmem_load, tG(_, _, _, n), tS, tKcK, kBlockN, p.head_dim);
    }
  };

  // ---- MMA partitions -----------------------------------------------------------------------
  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);             // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);             // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);  // (MMA, MMA_K, MMA_N)

  auto ldsm_q = make_tiled_copy_A(typename Tr::L::LdsmAtom{}, mma);
  Tensor tSsQ = ldsm_q.get_thread_slice(tid).partition_S(sQ);
  auto ldsm_k = make_tiled_copy_B(typename Tr::L::LdsmAtom{}, mma);
  Tensor tSsK = ldsm_k.get_thread_slice(tid).partition_S(sK);
  auto ldsm_vt = make_tiled_copy_B(typename Tr::L::LdsmTransposedAtom{}, mma);
  Tensor tOsVt = ldsm_vt.get_thread_slice(tid).partition_S(sVt);

  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_K)
  clear(acc_o);
  // (row, col) within a (BM, BN) tile of each score this thread holds.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), rowcol(tScS.layout()));
  Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol(acc_o.layout()));

  Softmax<Tr::kRowsPerThread> softmax;
  const ScoreMod score_mod(p, seq, head);
  PhiloxKey philox{};
  const uint32_t bh = uint32_t(seq.batch) * p.heads + head;
  if constexpr (Tr::kDropout) philox = philox_key(p.philox);

  if (!tiles.empty()) {
    // Stage s of a partitioned shared-memory view.
    auto stage = [](auto const& t, int s) { return make_tensor(t.data() + s * kKV, t.layout()); };
    // Prologue: Q and the first K tile (two stages: and V) in flight, in tile end-1's stage.
    copy_tile<true>(gmem_load, tQgQ, tQsQ, tQcQ, mask.seqlen_q - row0, p.head_dim);
    const int first_stage = Tr::kStages == 2 ? (tiles.end - 1) & 1 : 0;
    Tensor tKsK_first = stage(tKsK, first_stage);
    load_kv(tKgK, tKsK_first, tiles.end - 1, p.k, p.k_strides);
    if constexpr (Tr::kStages == 2) {
      Tensor tVsV_first = stage(tVsV, first_stage);
      load_kv(tVgV, tVsV_first, tiles.end - 1, p.v, p.v_strides);
    }
    cp_async_fence();
    if (Tr::kStages == 1) {  // a group of its own: the first QK^T waits for Q, K only
      load_kv(tVgV, tVsV, tiles.end - 1, p.v, p.v_strides);
      cp_async_fence();
    }

    auto step = [&](int n, auto first, auto masked) __attribute__((always_inline)) {
      Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
      clear(acc_s);
      const int cur = Tr::kStages == 2 ? n & 1 : 0;
      if constexpr (Tr::kStages == 2) {
        cp_async_wait<0>();
        __syncthreads();  // K[n], V[n] landed; every warp is done with step n+1's buffers
        if (n > tiles.begin) {
          Tensor tKsK_next = stage(tKsK, cur ^ 1);
          Tensor tVsV_next = stage(tVsV, cur ^ 1);
          load_kv(tKgK, tKsK_next, n - 1, p.k, p.k_strides);
          load_kv(tVgV, tVsV_next, n - 1, p.v, p.v_strides);
          cp_async_fence();
        }
      } else if (decltype(first)::value) {
        cp_async_wait<1>();
        __syncthreads();  // Q, K[n] landed (V[n] may still be loading)
      } else {
        cp_async_wait<0>();
        __syncthreads();  // K[n] landed; every warp is done with V[n+1]
        load_kv(tVgV, tVsV, n, p.v, p.v_strides);
        cp_async_fence();
      }

      gemm_ss(acc_s, tSrQ, tSrK, tSsQ, stage(tSsK, cur), mma, ldsm_q, ldsm_k);
      Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
      if constexpr (Tr::kScoreMod) score_mod.apply(s_rc, tScS_rc, row0, n * kBlockN);
      if constexpr (decltype(masked)::value) mask.apply(s_rc, tScS_rc, row0, n * kBlockN);

      if constexpr (Tr::kStages == 1) {
        cp_async_wait<0>();
        __syncthreads();  // V[n] landed; every warp is done with K[n]
        if (n > tiles.begin) {
          load_kv(tKgK, tKsK, n - 1, p.k, p.k_strides);
          cp_async_fence();
        }
      }

      softmax.template update<decltype(first)::value>(s_rc, acc_o_rc, p.softmax_scale_log2);
      if constexpr (Tr::kDropout) {
        for_each_dropout_decision(tScS, philox, p.keep_threshold, bh, row0, n * kBlockN,
                                  [&](int v, int m, int j, bool kept) __attribute__((always_inline)) {
                                    if (!kept) acc_s(v, m, j) = 0.f;
                                  });
      }
      Tensor rP = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
      gemm_rs(acc_o, tOrP, tOrVt, stage(tOsVt, cur), mma, ldsm_vt);
    };

    walk_key_tiles(tiles, step);
  } else {
    // No row of this tile sees a key: O = 0, lse = +inf, like a row masked entirely.
    for (int mi = 0; mi < Tr::kRowsPerThread; ++mi) softmax.row_sum[mi] = 0.f;
  }

  // ---- epilogue: O /= l, write O through shared memory, and the lse -------------------------
  float lse[Tr::kRowsPerThread];
  softmax.finalize(acc_o_rc, p.softmax_scale_log2, Tr::kDropout ? p.rp_keep : 1.f, lse);
  if (tiles.empty()) clear(acc_o);
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
  if (p.seqused_q != nullptr) {
    // Rows past seqused_q take no part: O = 0, lse = +inf, like a row that sees no key.
#pragma unroll
    for (int mi = 0; mi < Tr::kRowsPerThread; ++mi) {
      if (row0 + get<0>(tOcO_rc(mi, 0)) >= mask.seqlen_q) {
        lse[mi] = INFINITY;
#pragma unroll
        for (int ni = 0; ni < size<1>(acc_o_rc); ++ni) acc_o_rc(mi, ni) = 0.f;
      }
    }
  }

  if (kKvCache && p.num_splits > 1) {
    // Split-KV: this split's O / l and lse in fp32, -inf for a row that saw no key here (the
    // combine kernel weighs the splits by their lse).
    const int64_t row_base =
        ((int64_t(split) * p.batch + seq.batch) * p.heads + head) * int64_t(p.seqlen_q);
#pragma unroll
    for (int mi = 0; mi < Tr::kRowsPerThread; ++mi) {
      const int row = row0 + get<0>(tOcO_rc(mi, 0));
      if (row >= mask.seqlen_q) continue;
      float* o = p.o_accum + (row_base + row) * p.head_dim;
#pragma unroll
      for (int ni = 0; ni < size<1>(acc_o_rc); ++ni) {
        const int col = get<1>(tOcO_rc(mi, ni));
        if (col < p.head_dim) o[col] = acc_o_rc(mi, ni);
      }
      if (get<1>(tOcO(0)) == 0) p.lse_accum[row_base + row] = lse[mi] == INFINITY ? -INFINITY : lse[mi];
    }
    return;
  }

  Tensor rO = convert_fragment<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Tr::SmemQ{});  // (BM, hdim)
  auto smem_store = make_tiled_copy_C(typename Tr::L::AccStoreAtom{}, mma);
  auto smem_store_thr = smem_store.get_thread_slice(tid);
  Tensor taccOrO = smem_store_thr.retile_S(rO);
  Tensor taccOsO = smem_store_thr.partition_D(sO);
  // No block barrier: a warp writes here the rows of O it holds, which are the rows of Q that
  // it, and no other warp, read (the MMA's warps split M). Within the warp the lanes that
  // gave ldmatrix a row's address are not the lanes that store that row of O: __syncwarp
  // orders the two (racecheck reports the pair as a hazard without it).
  __syncwarp();
  copy(smem_store, taccOrO, taccOsO);

  const int rows_q = seq.rows_q(p);
  if (get<1>(tOcO(0)) == 0) {  // the lane holding column 0 of its rows writes their lse
#pragma unroll
    for (int mi = 0; mi < Tr::kRowsPerThread; ++mi) {
      const int row = row0 + get<0>(tOcO_rc(mi, 0));
      if (row < rows_q) lse_row[row] = lse[mi];
    }
  }
  __syncthreads();

  typename Tr::GmemStore gmem_store;
  auto gmem_store_thr = gmem_store.get_thread_slice(tid);
  Tensor tOsO = gmem_store_thr.partition_S(sO);  // (CPY, CPY_M, CPY_K)
  Tensor tOgO = gmem_store_thr.partition_D(gO);
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(gmem_store, tOsO, tOrO);
  Tensor tOcO_store = gmem_store_thr.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  store_tile(gmem_store, tOrO, tOgO, tOcO_store, rows_q - row0, p.head_dim);
}

// kKvCache: the kernels of calls over a KV cache or a paged K / V (params.kv_cache,
// block_table), with the page gather and split-KV's epilogue: a template flag, as their code
// cost the dense kernels (ptxas, sm_90a, hdim 128: the gather +36% instructions in the hot
// loop; the split epilogue 88 / 160 -> 92 / 284 B of spills and +5% in the loop).
template <class Tr, bool kKvCache>
__global__ void __launch_bounds__(Tr::kThreads) fwd_kernel(const __grid_constant__ FwdParams p,
                                                           const TileOrder order) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) char smem[];
  for (int64_t item = blockIdx.x; item < order.items(); item += gridDim.x) {
    const WorkItem w = order.decode(item);
    // Tile 0 is the last query tile: under a causal mask, the one with the most keys.
    const int m_block = order.tiles - 1 - w.tile;
    const SeqInfo seq(p, w.batch);
    // Variable-length: the grid covers the longest sequence; a shorter one ends earlier.
    if (m_block * Tr::kBlockM >= seq.rows_q(p)) continue;
    fwd_tile<Tr, kKvCache>(p, smem, m_block, seq, w.head, w.head_k, int(blockIdx.y));
    __syncthreads();  // the next tile's loads overwrite shared memory
  }
  if constexpr (Tr::kDropout) {
    if (p.rng_state != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
      p.rng_state[0] = int64_t(philox_seed(p.philox));
      p.rng_state[1] = int64_t(philox_offset(p.philox));
    }
  }
#endif
}

}  // namespace flash::fa2
