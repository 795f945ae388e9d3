// FA2 backward (Dao, "FlashAttention-2", Algorithm 2): one thread block per (key tile, batch,
// KV head). The block keeps dK and dV of its kBlockN keys in fp32 registers and walks every
// (query head of the KV head's group, query tile) that sees the keys; dQ is the only output
// shared between blocks and goes to an fp32 accumulator (fa2_bwd_dq.h).
//
// Per query tile m (walked from the last to the first, masked tiles split from unmasked ones):
//                                        | dropout keep bits (Philox)
//   wait Q[m], dO[m]; start Q[m-1]       | S = Q K^T, dP = dO V^T           (tensor cores)
//   (two dO buffers: and dO[m-1])        | Z, dS from S, dP, lse, D, keep    (fa2_bwd_dscore.h)
//   Z, dS -> shared memory               | dV += Z^T dO                      (tensor cores)
//   (one dO buffer: start dO[m-1])       | dQ_m += dS K -> fp32 reds, dK += dS^T Q
//                                        |   (sm90 bulk dQ: dQ_m -> shared memory, added by
//                                        |   one bulk reduction after the next barrier)
// Q has two shared-memory buffers (kQStages = 2), so its next tile loads during the whole step.
// dO has two where BwdTile asks for them (then a step has two barriers), else one, free once dV
// is done, so its next tile loads under the dQ and dK GEMMs behind a third barrier. Where two Q
// buffers do not fit (hdim 256 on sm80), kQStages = 1: the next Q and dO load after dK. The
// rows' lse and D travel with Q (cp.async into shared memory), so no per-row value holds a
// register across the GEMMs.
// The transposed operands (Z^T, dS^T, dO^T, Q^T, K^T) are read from shared memory with
// ldmatrix.trans; S and dP keep the forward's row = query layout, which the dropout draws use.
//
// GQA: the block loops over the heads / heads_k query heads of its KV head, so dK and dV sum
// over them in registers and are written once. dK = softmax_scale * sum dS^T Q, dV = sum Z^T dO.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/pdl.h"
#include "common/philox.cuh"
#include "fa2/fa2.h"
#include "fa2/fa2_bwd_dq.h"
#include "fa2/fa2_bwd_dscore.h"
#include "common/mask.h"
#include "common/query_tiles.h"
#include "common/seqinfo.h"
#include "common/tile_order.h"
#include "fa2/fa2_tiles.h"
#include "fa2/fa2_utils.h"

namespace flash::fa2 {

template <typename T, int kHeadDim_, int kQStages_, bool kDropout_, bool kScoreMod_>
struct BwdTraits {
  using Element = typename CuteType<T>::type;
  using Table = BwdTile<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kQStages = kQStages_;  // buffers of Q (with its rows' lse, D)
  static constexpr int kdOStages = kQStages == 2 ? Table::kdOStages : 1;
  static constexpr bool kDropout = kDropout_;
  static constexpr bool kScoreMod = kScoreMod_;  // softcap or ALiBi may be on (runtime fields)
  static constexpr int kBlockM = Table::kBlockM;
  static constexpr int kBlockN = Table::kBlockN;
  static constexpr int kWarps = Table::kWarps;
  static constexpr int kThreads = kWarps * 32;
  static_assert((kQStages == 1 || kQStages == 2) && (kdOStages == 1 || kdOStages == 2));
  static_assert(kBlockM >= kBwdMinBlockM && kBlockM % kBwdMinBlockM == 0 && kRowPad % kBlockM == 0);

  using L = Layouts<Element, kHeadDim>;
  // S and dP: each warp's key columns come in 16-wide blocks (the permutation puts its two n8
  // MMA tiles side by side), so a lane holds whole 16x16 dropout blocks (common/philox.cuh).
  static constexpr int kSdPWarpsM = Table::kSdPWarpsM, kSdPWarpsN = kWarps / kSdPWarpsM;
  using TiledMmaSdP = TiledMMA<
      MMA_Atom<typename L::MmaOp>, Layout<Shape<Int<kSdPWarpsM>, Int<kSdPWarpsN>, _1>>,
      Tile<Int<16 * kSdPWarpsM>, Layout<Shape<_8, Int<kSdPWarpsN>, _2>, Stride<_1, _16, _8>>, _16>>;
  using TiledMmadKV = typename L::template TiledMma<Table::kdKVWarpsN, kWarps / Table::kdKVWarpsN>;
  using TiledMmadQ = typename L::template TiledMma<Table::kdQWarpsM, kWarps / Table::kdQWarpsM>;
  // dQ = dS K in kdQChunks column chunks of kdQCols, one accumulator live at a time. A chunk of
  // K^T is the (kdQCols, kBlockN) layout of that head dim at an offset: both tile 64-column
  // swizzle atoms the same way, and the offset (a multiple of kBlockN * 64) leaves the
  // swizzled address bits alone.
  static constexpr int kdQChunks = Table::kdQChunks;
  static constexpr int kdQCols = kHeadDim / kdQChunks;
  using LdQ = Layouts<Element, kdQCols>;
  static_assert(kdQChunks == 1 || (LdQ::kBlockK == 64 && L::kBlockK == 64));
  using SmemKVtdQ = typename LdQ::template SmemTransposed<kBlockN>;
  using SmemKVtdQNoSwizzle = typename LdQ::template SmemTransposedNoSwizzle<kBlockN>;

  using SmemQ = typename L::template Smem<kBlockM>;  // (kBlockM, hdim): Q, dO
  using SmemQt = typename L::template SmemTransposed<kBlockM>;
  using SmemQtNoSwizzle = typename L::template SmemTransposedNoSwizzle<kBlockM>;
  using SmemKV = typename L::template Smem<kBlockN>;  // (kBlockN, hdim): K, V; later dK, dV
  using SmemKVt = typename L::template SmemTransposed<kBlockN>;
  using SmemKVtNoSwizzle = typename L::template SmemTransposedNoSwizzle<kBlockN>;
  // (kBlockM, kBlockN): Z and dS, row-major in 64-key chunks, and their transposes.
  using SmemPdSAtom = decltype(composition(Swizzle<3, 3, 3>{},
                                           Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemPdS = decltype(tile_to_shape(SmemPdSAtom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemPdSt = decltype(composition(
      SmemPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemPdSt{}));

  using GmemLoad = typename L::template GmemLoad<kThreads>;
  using GmemStore = typename L::template GmemStore<kThreads>;

  static constexpr int kQSize = cosize_v<SmemQ>;
  static constexpr int kKVSize = cosize_v<SmemKV>;
  static constexpr int kPdSSize = cosize_v<SmemPdS>;
  // Dropout keep bits of the S elements a thread holds, one bit each.
  static constexpr int kKeepWords = (kBlockM * kBlockN / kThreads + 31) / 32;
  // lse and D of the tile's rows travel with Q: kQStages x (lse, D) x kBlockM fp32.
  static constexpr int kStatsSize = 2 * kBlockM;
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * ((kQStages + kdOStages) * kQSize + 2 * kKVSize + 2 * kPdSSize) +
      kQStages * kStatsSize * int(sizeof(float));
  // sm90 bulk dQ (fa2_bwd_dq.h): a (kBlockM, hdim) fp32 staging tile after the rest, added to
  // kSmemBytes by the launcher when it takes that path. The tile is one contiguous range of
  // dq_accum only when dQ is not chunked.
  static constexpr bool kBulkdQ = Table::kdQBulk == 1;
  static_assert(!kBulkdQ || kdQChunks == 1);
  static constexpr int kdQStageBytes = kBulkdQ ? kBlockM * kHeadDim * int(sizeof(float)) : 0;
};

// 4-byte cp.async; src_bytes = 0 writes a zero instead of reading.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, int src_bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}

// acc += A * B^T from shared memory like gemm_ss, without loading slice k + 1 ahead: while S
// and dP are formed, dK, dV, S and dP already hold most registers, and a second slice of
// operands would spill. ptxas may still hoist loads where registers allow.
template <class Acc, class RA, class RB, class SA, class SB, class TiledMma, class CopyA,
          class CopyB>
__device__ __forceinline__ void gemm_ss_unbuffered(Acc& acc, RA& tCrA, RB& tCrB, SA const& tCsA,
                                                   SB const& tCsB, TiledMma const& mma,
                                                   CopyA const& copy_a, CopyB const& copy_b) {
  Tensor tCrA_view = copy_a.get_thread_slice(threadIdx.x).retile_D(tCrA);
  Tensor tCrB_view = copy_b.get_thread_slice(threadIdx.x).retile_D(tCrB);
#pragma unroll
  for (int k = 0; k < size<2>(tCrA); ++k) {
    copy(copy_a, tCsA(_, _, k), tCrA_view(_, _, k));
    copy(copy_b, tCsB(_, _, k), tCrB_view(_, _, k));
    gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// Counters of the deterministic mode: int32 (batch, heads, rows_pad / kBwdMinBlockM), after
// dq_accum in the workspace (see bwd_workspace_bytes in fa2.h).
template <int kHeadDim>
__host__ __device__ inline int* bwd_dq_counters(const BwdParams& p) {
  const int64_t rows = int64_t(p.batch) * p.heads * round_up(p.seqlen_q, kRowPad);
  return reinterpret_cast<int*>(p.dq_accum + rows * kHeadDim);
}

template <class Tr>
__device__ __forceinline__ void bwd_key_tile(const BwdParams& p, char* smem, int n_block,
                                             const SeqInfo& seq, int head_k) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  const int tid = threadIdx.x;
  const int group = p.heads / p.heads_k;
  const int head_begin = head_k * group, head_end = head_begin + group;
  const int col0 = n_block * kBlockN;

  Mask mask(p, seq);
  mask.seqlen_q = warp_uniform(mask.seqlen_q);
  mask.seqlen_k = warp_uniform(mask.seqlen_k);
  const QueryTiles tiles = query_tiles<kBlockM, kBlockN>(mask, n_block);
  // Row 0 of the sequence in head 0 of q, dO and the lse, read once: a variable-length batch's
  // start and length live in cu_seqlens / seqused, and the query loop below would otherwise
  // re-read them (a branch and global loads) before every tile's copies. Head h's rows are
  // h strides further on; the length is the mask's. All warp-uniform (warp_uniform).
  const int64_t q_row0 = warp_uniform(seq.q_offset(p, 0));
  const int64_t do_row0 = warp_uniform(seq.do_offset(p, 0));
  const int64_t lse_row0 = warp_uniform(seq.lse_offset(p, 0));
  const int64_t lse_head = warp_uniform(seq.lse_head_stride(p));

  // ---- shared memory: Q (kQStages buffers), dO (kdOStages), K, V, Z, dS ------------------
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_do = smem_q + Tr::kQStages * Tr::kQSize;
  Element* smem_k = smem_do + Tr::kdOStages * Tr::kQSize;
  Element* smem_v = smem_k + Tr::kKVSize;
  Element* smem_p = smem_v + Tr::kKVSize;
  Element* smem_ds = smem_p + Tr::kPdSSize;
  float* smem_stats = reinterpret_cast<float*>(smem_ds + Tr::kPdSSize);  // kQStages x (lse, D)
  float* smem_dq = smem_stats + Tr::kQStages * Tr::kStatsSize;  // bulk dQ staging, if taken
  // Bulk dQ: the tile staged in the last step, added by thread 0 after the next barrier (the
  // step's first, or the epilogue's). Only thread 0 reads or writes it.
  __shared__ float* dq_pending;
  const bool bulk_dq = kHasBulkReduce && Tr::kBulkdQ && p.dq_bulk;
  if (bulk_dq && tid == 0) dq_pending = nullptr;
  // Stage 0 of dO: the layouts the register fragments are shaped from (each step partitions
  // its own stage).
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Tr::SmemQ{});       // (BM, hdim)
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Tr::SmemQt{});     // (hdim, BM)
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Tr::SmemKV{});        // (BN, hdim)
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Tr::SmemKVt{});      // (hdim, BN)
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Tr::SmemKV{});        // (BN, hdim)
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Tr::SmemPdS{});       // (BM, BN)
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Tr::SmemPdSt{});     // (BN, BM)
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Tr::SmemPdS{});     // (BM, BN)
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Tr::SmemPdSt{});   // (BN, BM)
  auto q_buffer = [&](int stage) { return smem_q + stage * Tr::kQSize; };
  auto do_buffer = [&](int stage) { return smem_do + (Tr::kdOStages == 2 ? stage : 0) * Tr::kQSize; };
  auto lse_buffer = [&](int stage) { return smem_stats + stage * Tr::kStatsSize; };
  auto dsum_buffer = [&](int stage) { return smem_stats + stage * Tr::kStatsSize + kBlockM; };

  // ---- global -> shared copies (cp.async), zero-filling rows past the sequence ---------
  typename Tr::GmemLoad gmem_load;
  auto gmem_thr = gmem_load.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // (BM, hdim) tile m_block of the sequence's rows (at offset, row stride s.row) into dst.
  auto load_q_tile = [&](const void* base, int64_t offset, const Strides& s, int m_block,
                         Element* dst) {
    const Element* ptr = static_cast<const Element*>(base) + offset +
                         int64_t(m_block) * kBlockM * s.row;
    Tensor gX = make_tensor(make_gmem_ptr(ptr), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                            make_stride(s.row, _1{}));                             // (BM, hdim)
    Tensor sX = make_tensor(make_smem_ptr(dst), typename Tr::SmemQ{});             // (BM, hdim)
    Tensor tXgX = gmem_thr.partition_S(gX);  // (CPY, CPY_M, CPY_K)
    Tensor tXsX = gmem_thr.partition_D(sX);
    const int valid = mask.seqlen_q - m_block * kBlockM;
    if (valid < kBlockM) {
      copy_tile<true>(gmem_load, tXgX, tXsX, tQcQ, valid, p.head_dim);
    } else {
      copy_tile<false>(gmem_load, tXgX, tXsX, tQcQ, kBlockM, p.head_dim);
    }
  };
  // lse and D of query tile m_block of one head, one row per thread. lse is not padded: rows
  // past seqlen_q are zero-filled, and dscore treats them as lse = +inf.
  auto load_row_stats = [&](int head, int m_block, int stage) {
    if (tid < kBlockM) {
      const int row = m_block * kBlockM + tid;
      const bool in_range = row < mask.seqlen_q;
      cp_async_4(lse_buffer(stage) + tid, p.lse + lse_row0 + head * lse_head + (in_range ? row : 0),
                 in_range ? 4 : 0);
      cp_async_4(dsum_buffer(stage) + tid, p.dsum + seq.scratch_row0<kRowPad>(p, head) + row, 4);
    }
  };
  // The (BN, hdim) tile of this block in the sequence's rows (at offset, row stride s.row).
  auto kv_tile = [&](auto* base, int64_t offset, const Strides& s) {
    auto ptr = base + offset + int64_t(col0) * s.row;
    return make_tensor(make_gmem_ptr(ptr), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                       make_stride(s.row, _1{}));                                  // (BN, hdim)
  };
  const int keys_valid = seq.seqlen_k(p) - col0;

  // ---- MMA partitions ----------------------------------------------------------------------
  typename Tr::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sdO);   // (MMA, MMA_M, MMA_K); Q and dO alike
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K)
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto ldsm_sdp_a = make_tiled_copy_A(typename Tr::L::LdsmAtom{}, mma_sdp);
  auto ldsm_sdp_b = make_tiled_copy_B(typename Tr::L::LdsmAtom{}, mma_sdp);
  auto ldsm_sdp_a_thr = ldsm_sdp_a.get_thread_slice(tid);
  auto ldsm_sdp_b_thr = ldsm_sdp_b.get_thread_slice(tid);
  Tensor tSsK = ldsm_sdp_b_thr.partition_S(sK);
  Tensor tdPsV = ldsm_sdp_b_thr.partition_S(sV);
  // (row, col) within a (BM, BN) tile of each S / dP element this thread holds.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  auto smem_store_sdp = make_tiled_copy_C(typename Tr::L::AccStoreAtom{}, mma_sdp);
  auto smem_store_sdp_thr = smem_store_sdp.get_thread_slice(tid);
  Tensor tPsP = smem_store_sdp_thr.partition_D(sP);      // (CPY, CPY_M, CPY_N)
  Tensor tdSsdS = smem_store_sdp_thr.partition_D(sdS);

  typename Tr::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(
      make_tensor(sPt.data(), typename Tr::SmemPdStNoSwizzle{}));     // (MMA, MMA_N, MMA_K)
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(
      make_tensor(sdOt.data(), typename Tr::SmemQtNoSwizzle{}));      // (MMA, MMA_D, MMA_K)
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(
      make_tensor(sdSt.data(), typename Tr::SmemPdStNoSwizzle{}));
  Tensor tdKrQt = thr_dkv.partition_fragment_B(
      make_tensor(sdOt.data(), typename Tr::SmemQtNoSwizzle{}));
  auto ldsm_dkv_a = make_tiled_copy_A(typename Tr::L::LdsmTransposedAtom{}, mma_dkv);
  auto ldsm_dkv_b = make_tiled_copy_B(typename Tr::L::LdsmTransposedAtom{}, mma_dkv);
  auto ldsm_dkv_b_thr = ldsm_dkv_b.get_thread_slice(tid);
  Tensor tdVsPt = ldsm_dkv_a.get_thread_slice(tid).partition_S(sPt);
  Tensor tdKsdSt = ldsm_dkv_a.get_thread_slice(tid).partition_S(sdSt);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA, MMA_N, MMA_D)
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  typename Tr::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);                   // (MMA, MMA_M, MMA_K)
  Tensor tdQrKt = thr_dq.partition_fragment_B(
      make_tensor(sKt.data(), typename Tr::SmemKVtdQNoSwizzle{}));    // (MMA, MMA_D, MMA_K)
  auto ldsm_dq_a = make_tiled_copy_A(typename Tr::L::LdsmAtom{}, mma_dq);
  auto ldsm_dq_b = make_tiled_copy_B(typename Tr::L::LdsmTransposedAtom{}, mma_dq);
  Tensor tdQsdS = ldsm_dq_a.get_thread_slice(tid).partition_S(sdS);
  auto ldsm_dq_b_thr = ldsm_dq_b.get_thread_slice(tid);
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<Tr::kdQCols>>{}));

  PhiloxKey philox{};
  if constexpr (Tr::kDropout) philox = philox_key(p.philox);
  int* const dq_counters = p.deterministic ? bwd_dq_counters<kHeadDim>(p) : nullptr;

  if (!tiles.empty()) {
    // Prologue: K, V and the first step's Q and dO in flight.
    {
      Tensor tKgK = gmem_thr.partition_S(kv_tile(static_cast<const Element*>(p.k), seq.k_offset(p, head_k), p.k_strides));
      Tensor tKsK = gmem_thr.partition_D(sK);
      Tensor tVgV = gmem_thr.partition_S(kv_tile(static_cast<const Element*>(p.v), seq.v_offset(p, head_k), p.v_strides));
      Tensor tVsV = gmem_thr.partition_D(sV);
      copy_tile<true>(gmem_load, tKgK, tKsK, tKcK, keys_valid, p.head_dim);
      copy_tile<true>(gmem_load, tVgV, tVsV, tKcK, keys_valid, p.head_dim);
      load_q_tile(p.q, q_row0 + head_begin * p.q_strides.head, p.q_strides, tiles.end - 1,
                  q_buffer(0));
      load_q_tile(p.dout, do_row0 + head_begin * p.do_strides.head, p.do_strides, tiles.end - 1,
                  do_buffer(0));
      // K, V, Q and dO are not the preprocess's outputs, so they may load while it finishes;
      // D (next) and dq_accum (zeroed by it) wait for it to complete.
      pdl_wait();
      load_row_stats(head_begin, tiles.end - 1, 0);
      cp_async_fence();
    }
    int stage = 0;

    for (int head = head_begin; head < head_end; ++head) {
      const DScore<Tr::kDropout> dscore(p, seq, mask, head, philox);
      const int64_t scratch_row0 = seq.scratch_row0<kRowPad>(p, head);
      float* dq_head = p.dq_accum + scratch_row0 * kHeadDim;

      auto step = [&](int m_block, auto masked) __attribute__((always_inline)) {
        const int row0 = m_block * kBlockM;
        // The next step's tiles: the query tile below, or the next head's first one.
        const int next_head = m_block > tiles.begin ? head : head + 1;
        const int next_m = m_block > tiles.begin ? m_block - 1 : tiles.end - 1;
        const bool has_next = next_head < head_end;

        // The keep mask first: its Philox rounds overlap the loads in flight.
        uint32_t keep[Tr::kKeepWords] = {};
        if constexpr (Tr::kDropout) dscore.keep_bits(keep, tScS, row0, col0);

        cp_async_wait<0>();
        __syncthreads();  // Q[m], dO[m] landed; every warp is done with the last step's Z, dS
                          // (bulk dQ: and has staged and fenced the last step's dQ)
        if (bulk_dq && tid == 0 && dq_pending != nullptr) {
          bulk_reduce_add(dq_pending, smem_dq, Tr::kdQStageBytes);
        }
        auto load_next_q = [&](int next_stage) {
          load_q_tile(p.q, q_row0 + next_head * p.q_strides.head, p.q_strides, next_m,
                      q_buffer(next_stage));
          load_row_stats(next_head, next_m, next_stage);
        };
        auto load_next_do = [&](int next_stage) {
          load_q_tile(p.dout, do_row0 + next_head * p.do_strides.head, p.do_strides, next_m,
                      do_buffer(next_stage));
        };
        if (Tr::kQStages == 2 && has_next) {
          load_next_q(stage ^ 1);
          if (Tr::kdOStages == 2) load_next_do(stage ^ 1);
          cp_async_fence();
        }

        // S = Q K^T, dP = dO V^T.
        Tensor sQ = make_tensor(make_smem_ptr(q_buffer(stage)), typename Tr::SmemQ{});  // (BM, hdim)
        Tensor tSsQ = ldsm_sdp_a_thr.partition_S(sQ);
        Tensor sdO_m = make_tensor(make_smem_ptr(do_buffer(stage)), typename Tr::SmemQ{});   // (BM, hdim)
        Tensor tdPsdO_m = ldsm_sdp_a_thr.partition_S(sdO_m);
        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        clear(acc_s);
        gemm_ss_unbuffered(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma_sdp, ldsm_sdp_a, ldsm_sdp_b);
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
        clear(acc_dp);
        gemm_ss_unbuffered(acc_dp, tdPrdO, tdPrV, tdPsdO_m, tdPsV, mma_sdp, ldsm_sdp_a, ldsm_sdp_b);

        // S -> Z, dP -> dS; both to shared memory for the transposed GEMMs.
        dscore.template apply<decltype(masked)::value, Tr::kScoreMod>(acc_s, acc_dp, tScS, keep,
                                                       lse_buffer(stage), dsum_buffer(stage),
                                                       row0, col0);
        Tensor rZ = convert_fragment<Element>(acc_s);
        Tensor rdS = convert_fragment<Element>(acc_dp);
        copy(smem_store_sdp, smem_store_sdp_thr.retile_S(rZ), tPsP);
        copy(smem_store_sdp, smem_store_sdp_thr.retile_S(rdS), tdSsdS);
        // Bulk dQ: the staging tile is written after this barrier; the reduction issued at the
        // step's start has had the S and dP GEMMs to read it.
        if (bulk_dq && tid == 0) bulk_wait_read();
        __syncthreads();  // Z, dS complete

        // dV += Z^T dO.
        Tensor sdOt_m = make_tensor(make_smem_ptr(do_buffer(stage)), typename Tr::SmemQt{});  // (hdim, BM)
        Tensor tdVsdOt_m = ldsm_dkv_b_thr.partition_S(sdOt_m);
        gemm_ss(acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt_m, mma_dkv, ldsm_dkv_a, ldsm_dkv_b);
        if (Tr::kQStages == 2 && Tr::kdOStages == 1 && has_next) {
          __syncthreads();  // every warp is done with dO[m], the only dO buffer
          load_next_do(0);
          cp_async_fence();
        }

        // dQ_m += dS K (softmax_scale applied at conversion). A red holds its source registers
        // until the LSU has taken them; issued all at once (8 x 512 B per warp) right before
        // dK's GEMM, they kept that GEMM's first ldmatrix waiting for registers ptxas had given
        // it from the reds' sources (ncu, hdim 256 full 4k: 4.3% of all stall samples on that
        // one instruction; hdim 64: ~5%). Issuing all of them after dK's GEMM only moved the
        // wait to the next barrier. So (p.dq_defer) the last chunk's reds are spread over dK's
        // GEMM, a share after each k-slice: the LSU drains a few while the tensor cores work,
        // and acc_dq stays live across that GEMM instead. Measured on an H100 against the reds
        // issued together (A/B in one process, bf16, 1k-16k, both masks): hdim 128 +5-7%, 256
        // +4-5%; ptxas spills of the plain kernels went down (hdim 128 16/24 B -> 0, 256 32/56
        // -> 20/20 B). The deterministic mode keeps them together, between its turn's wait
        // and pass.
        int* counter = nullptr;
        const bool defer = !bulk_dq && p.dq_defer;
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<Tr::kdQCols>>{});  // (MMA, MMA_M, MMA_D)
#pragma unroll
        for (int c = 0; c < Tr::kdQChunks; ++c) {
          Tensor sKt_c = make_tensor(make_smem_ptr(smem_k + c * kBlockN * Tr::kdQCols),
                                     typename Tr::SmemKVtdQ{});  // (kdQCols, BN)
          Tensor tdQsKt = ldsm_dq_b_thr.partition_S(sKt_c);
          clear(acc_dq);
          gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, ldsm_dq_a, ldsm_dq_b);
          if (bulk_dq) {
            dq_stage<kHeadDim>(smem_dq, acc_dq, tdQcdQ);
            fence_proxy_async();
            if (tid == 0) dq_pending = dq_head + int64_t(row0) * kHeadDim;  // the tile's range
            continue;
          }
          if (c == 0 && dq_counters != nullptr) {
            counter = dq_counters + scratch_row0 / kBwdMinBlockM + m_block;
            DqTurn::wait(counter, n_block - first_key_tile_of<kBlockM, kBlockN>(mask, m_block, n_block));
          }
          if (c + 1 < Tr::kdQChunks || !defer) {
            dq_atomic_add<kHeadDim>(dq_head, acc_dq, tdQcdQ, row0, c * Tr::kdQCols);
          }
        }
        if (counter != nullptr) DqTurn::pass(counter);

        // dK += dS^T Q.
        Tensor sQt = make_tensor(make_smem_ptr(q_buffer(stage)), typename Tr::SmemQt{});  // (hdim, BM)
        Tensor tdKsQt = ldsm_dkv_b_thr.partition_S(sQt);
        gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt, mma_dkv, ldsm_dkv_a, ldsm_dkv_b,
                [&](int k, int slices) {
                  if (defer) {
                    dq_atomic_add<kHeadDim>(dq_head, acc_dq, tdQcdQ, row0,
                                            (Tr::kdQChunks - 1) * Tr::kdQCols, k, slices);
                  }
                });
        if (Tr::kQStages == 1 && has_next) {
          __syncthreads();  // every warp is done with Q[m] and dO[m], the only buffers
          load_next_q(0);
          load_next_do(0);
          cp_async_fence();
        }
        if (Tr::kQStages == 2) stage ^= 1;
      };

      // Tiles from the top: masked ones past the band, unmasked, masked ones before it.
      int m = tiles.end - 1;
      for (; m >= tiles.unmasked_end; --m) step(m, std::true_type{});
      for (; m >= tiles.unmasked_begin; --m) step(m, std::false_type{});
      for (; m >= tiles.begin; --m) step(m, std::true_type{});
    }
  }

  // ---- epilogue: dK, dV through shared memory (K, V are dead) into the output ---------------
  __syncthreads();  // every warp is done with K, V (and has staged the last dQ tile)
  if (bulk_dq && tid == 0 && dq_pending != nullptr) {
    // The last tile's add; the staging buffer must be read before the next work item writes
    // it. (Its writes to global memory complete before the grid does.)
    bulk_reduce_add(dq_pending, smem_dq, Tr::kdQStageBytes);
    bulk_wait_read();
  }
#pragma unroll
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  auto smem_store_dkv = make_tiled_copy_C(typename Tr::L::AccStoreAtom{}, mma_dkv);
  auto smem_store_dkv_thr = smem_store_dkv.get_thread_slice(tid);
  copy(smem_store_dkv, smem_store_dkv_thr.retile_S(rdK), smem_store_dkv_thr.partition_D(sK));
  copy(smem_store_dkv, smem_store_dkv_thr.retile_S(rdV), smem_store_dkv_thr.partition_D(sV));
  __syncthreads();

  typename Tr::GmemStore gmem_store;
  auto gmem_store_thr = gmem_store.get_thread_slice(tid);
  Tensor tdKcdK = gmem_store_thr.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  auto store_rows = [&](auto const& sX, void* base, int64_t offset, const Strides& s) {
    Tensor gX = kv_tile(static_cast<Element*>(base), offset, s);  // (BN, hdim)
    Tensor tXsX = gmem_store_thr.partition_S(sX);         // (CPY, CPY_N, CPY_K)
    Tensor tXgX = gmem_store_thr.partition_D(gX);
    Tensor tXrX = make_tensor<Element>(shape(tXgX));
    copy(gmem_store, tXsX, tXrX);
    // Rows past seqused_k (variable-length) saw no query: their zeros are written too.
    store_tile(gmem_store, tXrX, tXgX, tdKcdK, seq.rows_k(p) - col0, p.head_dim);
  };
  store_rows(sK, p.dk, seq.dk_offset(p, head_k), p.dk_strides);
  store_rows(sV, p.dv, seq.dv_offset(p, head_k), p.dv_strides);
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) bwd_kernel(const __grid_constant__ BwdParams p,
                                                              const TileOrder order) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) char smem[];
  // The dQ conversion may be scheduled once every block has started (it waits for the grid to
  // complete before it reads): its launch and first blocks fill the SMs this grid's tail frees.
  pdl_launch_dependents();
  // Items over (key tile, batch * heads_k). Tile t is key tile t: under a causal mask the
  // first key tiles have the most query tiles. The deterministic dQ order relies on key tile
  // n - 1 of a head starting before key tile n (fa2_bwd_dq.h), which TileOrder keeps.
  for (int64_t item = blockIdx.x; item < order.items(); item += gridDim.x) {
    const WorkItem w = order.decode(item);  // its heads are KV heads
    const SeqInfo seq(p, w.batch);
    // Variable-length: the grid covers the longest sequence; a shorter one ends earlier (its
    // last key tiles, so no deterministic turn waits for them).
    if (w.tile * Tr::kBlockN >= seq.rows_k(p)) continue;
    bwd_key_tile<Tr>(p, smem, w.tile, seq, w.head);
    __syncthreads();  // the next tile's loads overwrite shared memory
  }
#endif
}

}  // namespace flash::fa2
