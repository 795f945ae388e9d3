// FA2 decode: attention over a KV cache for a short query (fa2.h, decode_fits). The forward's
// kernel gives each query head its own 64-128-row tile, so one decode token per head wastes
// all but one row of every MMA and reads the KV head's K / V once per query head: compute-
// bound at a third of the memory bandwidth. Here one warp owns one (sequence, KV head, split):
// the query rows of all heads that share the KV head are packed into the 16 rows of one MMA
// tile, row R = (token R / G, query head head_k * G + R % G) with G = heads / heads_k, and the
// split's share of the keys streams through kDecodeStages buffers. Each K / V byte is
// read once per (sequence, KV head); the tensor cores idle, as they may: this is a copy with
// arithmetic on the side. Split-KV writes fp32 partials that combine_splits_kernel merges.
// More than 16 rows (up to kDecodeMaxRows: a few speculative tokens at G = 8) take one warp
// per group of 16 (tile row r is R = row0 + r), neighbouring blocks that read the same K / V,
// all but one mostly from L2.
// On sm90 the K / V tiles come by the TMA unit onto one mbarrier per stage, at a head dim that
// is a multiple of 64 as boxes (a contiguous cache, pages of a multiple of 8 rows), otherwise
// as one bulk copy per row; elsewhere by cp.async. A warp is bound by what it issues: the
// per-row copies were 60% of the instructions executed (ncu, H100, batch 128, 8k cache: 211M,
// 84M with the boxes) and held the kernel at 2.9 TB/s; the boxes reach 3.1, 92% of the HBM
// peak and cuDNN's decode rate (docs/fa2_decisions.md).
//
// Fragments follow common/mma.cuh (m16n8k16, g = lane / 4, t = lane % 4): a lane holds rows
// g and g + 8 of S and O, columns 2t, 2t + 1 of each 8-wide slice.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/mask.h"
#include "common/mma.cuh"
#include "common/pdl.h"
#include "common/params.h"
#include "common/seqinfo.h"
#include "fa2/fa2.h"

namespace flash::fa2 {

// sm90, kHeadDim a multiple of 64, a contiguous cache or pages of a multiple of 8 rows: K / V
// tiles by TMA boxes of 64 columns x box_rows rows (kBlockN for a contiguous cache; for a paged
// one the largest that divides both the page and kBlockN, so that a box never crosses a page),
// from 4-D tensor maps (head_dim, rows, heads_k, caches or pages) the launcher builds.
struct DecodeTmaMaps {
  CUtensorMap k, v;
  int box_rows;
};

template <typename T, int kHeadDim>
struct DecodeTraits {
  static constexpr int kRows = kDecodeRows;
  static constexpr int kBlockN = decode_block_n(kHeadDim);
  static constexpr int kStages = kDecodeStages;
  static constexpr int kPitch = kHeadDim + 8;  // elements per shared-memory row (fa2.h)
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte vectors per row
  // K / V copies: two lanes per row and instruction (one 32-byte sector), 16 rows at a time.
  static constexpr int kRowsPerLane = kBlockN / 16;
  static constexpr int kTileBytes = (kRows + 2 * kStages * kBlockN) * kPitch * int(sizeof(T));
  static constexpr int kSmemBytes = decode_smem_bytes(kHeadDim);
  static_assert(kBlockN % 16 == 0 && kChunks % 2 == 0);
  static_assert(kSmemBytes == kTileBytes + 8 * kStages && kTileBytes % 16 == 0);
};

// kHalves: how many of the tile's two 8-row halves hold query rows (1: rows <= 8, the usual
// one-token decode with up to 8 query heads per KV head). A lane holds rows g and g + 8; with
// one half the second row's score mods, mask, softmax and P are skipped (its P is 0): half the
// per-score work of a tile.
//
// kTma (DecodeTmaMaps): K / V tiles land as TMA boxes in the 128-byte swizzle (a row of a
// 64-column part is 128 bytes, its 16-byte chunk c at c ^ (row % 8)) instead of padded rows.
template <typename T, int kHeadDim, int kHalves, bool kTma>
__global__ void __launch_bounds__(32) decode_kernel(const __grid_constant__ FwdParams p,
                                                    const __grid_constant__ DecodeTmaMaps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Tr = DecodeTraits<T, kHeadDim>;
  constexpr int kBlockN = Tr::kBlockN, kPitch = Tr::kPitch, kChunks = Tr::kChunks;
  constexpr int kStages = Tr::kStages, kRows = Tr::kRows;
  // K / V rows: kPitch elements padded, or kHeadDim in TMA parts of 64 columns.
  constexpr int kKvRow = kTma ? kHeadDim : kPitch;
  static_assert(!kTma || (kHeadDim % 64 == 0 && kBlockN % 8 == 0));
  // Its own name: an extern shared array is one symbol per translation unit, and the
  // forward's (fa2_fwd_kernel.cuh, same files) is declared 128-byte aligned.
  extern __shared__ __align__(1024) char decode_smem[];
  char* smem = decode_smem;
  // TMA: K and V first, at the 1024-byte alignment their swizzle needs.
  T* sK = reinterpret_cast<T*>(smem) + (kTma ? 0 : Tr::kRows * kPitch);  // kStages x (kBlockN, kKvRow)
  T* sV = sK + kStages * kBlockN * kKvRow;                                 // kStages x (kBlockN, kKvRow)
  T* sQ = kTma ? sV + kStages * kBlockN * kKvRow : reinterpret_cast<T*>(smem);  // (kRows, kPitch)
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + Tr::kTileBytes);  // sm90: one per stage
  // Byte offset of element (r, c) in a K / V tile.
  auto kv_offset = [](int r, int c) -> uint32_t {
    if constexpr (kTma) {
      return (c / 64) * (kBlockN * 128) + r * 128 + (((c % 64) / 8) ^ (r % 8)) * 16;
    } else {
      return (r * kPitch + c) * sizeof(T);
    }
  };

  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  // blockIdx.x: (sequence, KV head, row group), the row group fastest (fa2.h, kDecodeMaxRows).
  const int group = p.heads / p.heads_k;
  const int rows_all = p.seqlen_q * group;  // <= kDecodeMaxRows
  const unsigned row_groups = unsigned(rows_all + kRows - 1) / kRows;
  const int row0 = int(blockIdx.x % row_groups) * kRows;
  const int rows = min(kRows, rows_all - row0);  // this warp's: tile row r is row row0 + r
  const unsigned item = blockIdx.x / row_groups;
  const int head_k = int(item % unsigned(p.heads_k));
  const SeqInfo seq(p, int(item / unsigned(p.heads_k)));
  const int split = blockIdx.y;
  const Mask mask(p, seq);

  // ---- this split's key tiles: its share of the tiles some row sees -------------------------
  const int token_first = row0 / group, token_last = (row0 + rows - 1) / group;
  const int lo = mask.key_begin(token_first), hi = mask.key_end(token_last);
  const int all_begin = lo / kBlockN, all_end = hi > lo ? (hi + kBlockN - 1) / kBlockN : all_begin;
  const int per = (all_end - all_begin + p.num_splits - 1) / p.num_splits;
  const int tile_begin = all_begin + split * per;
  const int tiles = max(0, min(all_end, tile_begin + per) - tile_begin);

  // The keys every query row sees (rows see more keys as their token grows).
  const int seen_by_all_begin = mask.key_begin(token_last);
  const int seen_by_all_end = mask.key_end(token_first);
  const bool alibi = p.alibi_slopes != nullptr;

  // ---- the two rows of each lane: token, head, visible keys, ALiBi slope --------------------
  int row_token[2], row_head[2], key_lo[2], key_hi[2];
  float slope[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = g + 8 * i;
    row_token[i] = (row0 + r) / group;
    row_head[i] = head_k * group + (row0 + r) % group;
    key_lo[i] = mask.key_begin(row_token[i]);
    key_hi[i] = r < rows ? mask.key_end(row_token[i]) : 0;  // padding rows: no key
    slope[i] = 0.f;
    if (alibi && r < rows) {
      const float logit_per_score = p.softcap > 0.f ? p.softcap : p.softmax_scale;
      slope[i] = p.alibi_slopes[seq.batch * p.alibi_batch_stride + row_head[i]] / logit_per_score;
    }
  }

  // ---- copies ---------------------------------------------------------------------------------
  // Launched with pdl (sm90, after kvcache_prep: fa2.h's FwdPlan), the block may run while
  // kvcache_prep still writes the new keys into the cache and the rotated q. It waits for that
  // grid (pdl_wait) only before it reads either: the rotated q, or a key tile that holds new
  // keys (the sequence's last one or two, in one split). Lengths, slopes, the block table and
  // the cached keys it reads before: kvcache_prep does not write them.
  const int new_begin = mask.seqlen_k - p.seqlen_new;  // the sequence's new keys: [new_begin, seqlen_k)
  bool prep_done = false;
  auto wait_for_prep = [&] {
    if (!prep_done) pdl_wait();
    prep_done = true;
  };
  if (p.q_from_prep) wait_for_prep();
  // Q: rows past `rows` and columns past head_dim are zero.
  {
    const T* q = static_cast<const T*>(p.q);
    for (int c = lane; c < Tr::kRows * kChunks; c += 32) {
      const int r = c / kChunks, col = c % kChunks * 8;
      const bool ok = r < rows && col < p.head_dim;
      const T* src = ok ? q + seq.q_offset(p, head_k * group + (row0 + r) % group) +
                              int64_t((row0 + r) / group) * p.q_strides.row + col
                        : q;
      copy16_async(sQ + r * kPitch + col, src, ok);
    }
  }
  // K / V rows: element offsets of key `key` of the sequence in k and v.
  const T* k_base = static_cast<const T*>(p.k);
  const T* v_base = static_cast<const T*>(p.v);
  const bool paged = p.block_table != nullptr;
  const int64_t k_off = paged ? head_k * p.k_strides.head : seq.k_offset(p, head_k);
  const int64_t v_off = paged ? head_k * p.v_strides.head : seq.v_offset(p, head_k);
  auto row_offsets = [&](int key, int64_t& k_row, int64_t& v_row) {
    k_row = k_off;
    v_row = v_off;
    if (paged) {
      const SeqInfo::PagedKey at = seq.paged_key(p, key);
      k_row += at.page * p.k_strides.batch + at.row * p.k_strides.row;
      v_row += at.page * p.v_strides.batch + at.row * p.v_strides.row;
    } else {
      k_row += int64_t(key) * p.k_strides.row;
      v_row += int64_t(key) * p.v_strides.row;
    }
  };
#if __CUDA_ARCH__ >= 900
  // One bulk copy per K or V row of the tile, lanes taking K rows then V rows; rows past the
  // sequence are not copied. Their buffers (and columns past head_dim) hold zeros written
  // here once, or an earlier tile's finite rows: K's are masked, V's meet P = 0. TMA boxes
  // need no zeros: they fill whole rows, and the rows past the sequence are fixed per tile.
  if constexpr (!kTma) {
    for (int i = lane; i < 2 * kStages * kBlockN * kKvRow / 8; i += 32) {
      reinterpret_cast<uint4*>(sK)[i] = make_uint4(0, 0, 0, 0);
    }
  }
  if (lane < kStages) bulk_barrier_init(bar + lane);
  fence_proxy_async();
  __syncwarp();
  auto load_tile = [&](int n, int stage) {
    if (p.seqlen_new > 0 && (n + 1) * kBlockN > new_begin) wait_for_prep();  // warp-uniform
    if constexpr (kTma) {
      // Whole boxes: rows past the sequence come with the last one (past a contiguous cache's
      // end, like columns past head_dim, as zeros), and count; boxes wholly past the sequence
      // are not requested (their block-table entries may be anything). A box's rows start at a
      // 1024-byte multiple (box_rows % 8 == 0), so the boxes of a part lay out as one box of
      // kBlockN rows would.
      constexpr int kParts = kHeadDim / 64;
      static_assert(2 * kParts * (kBlockN / 8) <= 32, "a lane per box");
      const int box_rows = maps.box_rows;
      const int live =
          min(kBlockN / box_rows, (mask.seqlen_k - n * kBlockN + box_rows - 1) / box_rows);
      if (lane == 0) bulk_expect(bar + stage, 2 * kParts * live * box_rows * 64 * sizeof(T));
      __syncwarp();
      if (lane < 2 * kParts * live) {
        const int box = lane % live, part = lane / live % kParts;
        const bool is_v = lane >= kParts * live;
        const int key = n * kBlockN + box * box_rows;
        int row = seq.k_start(p) + key, batch = seq.k_batch(p);
        if (paged) {
          const SeqInfo::PagedKey at = seq.paged_key(p, key);
          row = at.row;
          batch = at.page;
        }
        T* dst = (is_v ? sV : sK) + stage * kBlockN * kKvRow + part * kBlockN * 64 +
                 box * box_rows * 64;
        tma_load_4d(dst, is_v ? &maps.v : &maps.k, 64 * part, row, head_k, batch, bar + stage);
      }
      return;
    }
    const int valid = min(kBlockN, mask.seqlen_k - n * kBlockN);
    const uint32_t row_bytes = uint32_t(p.head_dim) * sizeof(T);
    if (lane == 0) bulk_expect(bar + stage, 2 * valid * row_bytes);
#pragma unroll
    for (int j = 0; j < 2 * kBlockN / 32; ++j) {
      const int i = lane + 32 * j, r = i % kBlockN;
      if (r < valid) {
        int64_t k_row, v_row;
        row_offsets(n * kBlockN + r, k_row, v_row);
        if (i < kBlockN) {
          bulk_copy(sK + (stage * kBlockN + r) * kPitch, k_base + k_row, row_bytes, bar + stage);
        } else {
          bulk_copy(sV + (stage * kBlockN + r) * kPitch, v_base + v_row, row_bytes, bar + stage);
        }
      }
    }
  };
#else
  if constexpr (kTma) __trap();  // launched on sm90 only (launch_decode)
  // Lane pair (2m, 2m + 1) copies row m + 16 j of a tile, the pair's two 16-byte columns per
  // instruction (one 32-byte sector). Keys past the sequence are zero (finite under the mask).
  auto load_tile = [&](int n, int stage) {
#pragma unroll
    for (int j = 0; j < Tr::kRowsPerLane; ++j) {
      const int r = lane / 2 + 16 * j, key = n * kBlockN + r;
      const bool ok = key < mask.seqlen_k;
      int64_t k_row = 0, v_row = 0;
      if (ok) row_offsets(key, k_row, v_row);
      T* k_dst = sK + (stage * kBlockN + r) * kPitch;
      T* v_dst = sV + (stage * kBlockN + r) * kPitch;
#pragma unroll
      for (int cc = 0; cc < kChunks / 2; ++cc) {
        const int c = 2 * cc + lane % 2;
        const bool in = ok && c * 8 < p.head_dim;
        copy16_async(k_dst + c * 8, in ? k_base + k_row + c * 8 : k_base, in);
        copy16_async(v_dst + c * 8, in ? v_base + v_row + c * 8 : v_base, in);
      }
    }
  };
#endif

  // ---- the key loop -----------------------------------------------------------------------------
  float o[kHeadDim / 8][4];
#pragma unroll
  for (int f = 0; f < kHeadDim / 8; ++f) o[f][0] = o[f][1] = o[f][2] = o[f][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale_log2;
  const int shift = mask.seqlen_k - mask.seqlen_q;  // row token i's diagonal key: i + shift

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {  // Q goes with the first tile's group
    if (s < tiles) load_tile(tile_begin + s, s);
    copy_async_commit();
  }
  for (int it = 0; it < tiles; ++it) {
    copy_async_wait<kStages - 2>();  // sm90: Q's group only
#if __CUDA_ARCH__ >= 900
    bulk_wait(bar + it % kStages, (it / kStages) % 2);
#endif
    const int stage = it % kStages, n = tile_begin + it;
    const T* k_s = sK + stage * kBlockN * kKvRow;
    const T* v_s = sV + stage * kBlockN * kKvRow;
    if constexpr (kTma) {
      // The sequence's last tile: its rows past the sequence hold what the box read past it
      // (stale, possibly NaN) or, for boxes not requested, whatever the buffer held (never
      // initialised). Their V rows become zeros before P V; their K rows are masked (the
      // tile takes the mask branch). The fence orders these writes before any later async
      // write into the buffer (a later tile of this split: none today).
      const int valid = mask.seqlen_k - n * kBlockN;
      if (valid < kBlockN) {
        __syncwarp();
        for (int q = lane; q < (kBlockN - valid) * (kHeadDim / 8); q += 32) {
          const int r = valid + q / (kHeadDim / 8), c = q % (kHeadDim / 8) * 8;
          *reinterpret_cast<uint4*>(reinterpret_cast<char*>(const_cast<T*>(v_s)) + kv_offset(r, c)) =
              make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();
      }
    }
    __syncwarp();  // tile it landed for every lane; every lane is done with tile it - 1
    if (it + kStages - 1 < tiles) load_tile(tile_begin + it + kStages - 1, (it + kStages - 1) % kStages);
    copy_async_commit();

    // S = Q K^T: per 16-column step of the head dim, one ldmatrix of Q, one per 16 keys of K.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int f = 0; f < kBlockN / 8; ++f) s[f][0] = s[f][1] = s[f][2] = s[f][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim; kk += 16) {
      uint32_t a[4];
      ldmatrix_x4(a, sQ + (lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + kk + 8 * (lane / 16));
#pragma unroll
      for (int f = 0; f < kBlockN / 8; f += 2) {
        uint32_t b[4];  // keys 8f.. : b[0], b[1]; keys 8f + 8.. : b[2], b[3]
        ldmatrix_x4(b, reinterpret_cast<const char*>(k_s) +
                           kv_offset(8 * f + lane % 8 + 8 * (lane / 16), kk + 8 * ((lane / 8) % 2)));
        mma_16816<T>(s[f], a, b[0], b[1]);
        mma_16816<T>(s[f + 1], a, b[2], b[3]);
      }
    }

    // Score mods and the mask, each behind a warp-uniform branch: the mask only on tiles that
    // some query row does not see whole (padding rows are left unmasked: their Q is zero, so
    // their scores are finite, and they are never stored).
    if (p.softcap > 0.f) {
#pragma unroll
      for (int f = 0; f < kBlockN / 8; ++f) {
#pragma unroll
        for (int e = 0; e < 2 * kHalves; ++e) s[f][e] = tanhf(s[f][e] * p.softcap_prescale);
      }
    }
    if (alibi) {
#pragma unroll
      for (int f = 0; f < kBlockN / 8; ++f) {
#pragma unroll
        for (int e = 0; e < 2 * kHalves; ++e) {
          const int i = e / 2, key = n * kBlockN + 8 * f + 2 * t + e % 2;
          s[f][e] -= slope[i] * fabsf(float(row_token[i] + shift - key));
        }
      }
    }
    if (n * kBlockN < seen_by_all_begin || (n + 1) * kBlockN > seen_by_all_end) {
#pragma unroll
      for (int f = 0; f < kBlockN / 8; ++f) {
#pragma unroll
        for (int e = 0; e < 2 * kHalves; ++e) {
          const int i = e / 2, key = n * kBlockN + 8 * f + 2 * t + e % 2;
          if (key < key_lo[i] || key >= key_hi[i]) s[f][e] = -INFINITY;
        }
      }
    }

    // Online softmax over the tile, per row (the quad of lanes that holds it), with the lazy
    // rescale of common/softmax.h: while no row's max grows by more than 2^8, P is taken
    // against the old max (P <= 2^8) and O is left alone, which is most tiles of a long cache.
    float tile_max[2];
    bool grow = false;
#pragma unroll
    for (int i = 0; i < kHalves; ++i) {
      float m = row_max[i];
#pragma unroll
      for (int f = 0; f < kBlockN / 8; ++f) m = fmaxf(m, fmaxf(s[f][2 * i], s[f][2 * i + 1]));
      tile_max[i] = quad_max(m);
      grow |= (tile_max[i] - row_max[i]) * scale_log2 > 8.f;  // -inf - -inf: NaN, no growth
    }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int i = 0; i < kHalves; ++i) {
        // A row with no visible key yet keeps max -inf and is exponentiated against 0. Its
        // correction is exp2(-inf) = 0 (O and l are still 0), never exp2(0 - next): with ALiBi
        // a far tile's max can be -1000 (log2), and 0 * inf is NaN.
        const float next = tile_max[i] == -INFINITY ? 0.f : tile_max[i] * scale_log2;
        const float correction = exp2f(row_max[i] * scale_log2 - next);
        row_max[i] = tile_max[i];
        row_sum[i] *= correction;
#pragma unroll
        for (int f = 0; f < kHeadDim / 8; ++f) {
          o[f][2 * i] *= correction;
          o[f][2 * i + 1] *= correction;
        }
      }
    }
    float scaled_max[2];
#pragma unroll
    for (int i = 0; i < kHalves; ++i) scaled_max[i] = row_max[i] == -INFINITY ? 0.f : row_max[i] * scale_log2;
    uint32_t pa[kBlockN / 16][4];  // P as the A operand, 16 keys per MMA step
#pragma unroll
    for (int f = 0; f < kBlockN / 8; ++f) {
      float e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int k = 0; k < 2 * kHalves; ++k) e[k] = exp2f(s[f][k] * scale_log2 - scaled_max[k / 2]);
      row_sum[0] += e[0] + e[1];
      if (kHalves == 2) row_sum[1] += e[2] + e[3];
      pa[f / 2][2 * (f % 2)] = pack2<T>(e[0], e[1]);
      pa[f / 2][2 * (f % 2) + 1] = kHalves == 2 ? pack2<T>(e[2], e[3]) : 0u;
    }

    // O += P V: V's rows are keys, so its fragments come through ldmatrix.trans.
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
#pragma unroll
      for (int f = 0; f < kHeadDim / 8; f += 2) {
        uint32_t b[4];  // columns 8f.. : b[0], b[1]; columns 8f + 8.. : b[2], b[3]
        ldmatrix_x4_trans(b, reinterpret_cast<const char*>(v_s) +
                                 kv_offset(16 * ks + lane % 8 + 8 * ((lane / 8) % 2), 8 * f + 8 * (lane / 16)));
        mma_16816<T>(o[f], pa[ks], b[0], b[1]);
        mma_16816<T>(o[f + 1], pa[ks], b[2], b[3]);
      }
    }
  }
  copy_async_wait<0>();  // no copy outlives the block (sm90: the loop waited for every tile)

  // The combine (launched with pdl) may be scheduled once every block is this far; it waits
  // for the whole grid before it reads a partial.
  pdl_launch_dependents();

  // ---- epilogue: O / l and the lse of each row; partials in fp32 when the keys are split ------
  const bool partial = p.num_splits > 1;
#pragma unroll
  for (int i = 0; i < kHalves; ++i) {
    const int r = g + 8 * i;
    const float sum = quad_sum(row_sum[i]);
    if (r >= rows) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    // Natural-log lse; a row that saw no key: +inf, or -inf in a partial (the combine's weight).
    const float lse = sum > 0.f ? (row_max[i] * scale_log2 + log2f(sum)) * float(M_LN2)
                                : (partial ? -INFINITY : INFINITY);
    const int token = row_token[i], head = row_head[i];
    if (partial) {
      const int64_t row = ((int64_t(split) * p.batch + seq.batch) * p.heads + head) * p.seqlen_q + token;
      float* dst = p.o_accum + row * p.head_dim;
#pragma unroll
      for (int f = 0; f < kHeadDim / 8; ++f) {
        const int col = 8 * f + 2 * t;
        if (col < p.head_dim) {
          *reinterpret_cast<float2*>(dst + col) = make_float2(o[f][2 * i] * inv, o[f][2 * i + 1] * inv);
        }
      }
      if (t == 0) p.lse_accum[row] = lse;
    } else {
      T* dst = static_cast<T*>(p.o) + seq.o_offset(p, head) + int64_t(token) * p.o_strides.row;
#pragma unroll
      for (int f = 0; f < kHeadDim / 8; ++f) {
        const int col = 8 * f + 2 * t;
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(dst + col) = pack2<T>(o[f][2 * i] * inv, o[f][2 * i + 1] * inv);
        }
      }
      if (t == 0) p.lse[seq.lse_offset(p, head) + token] = lse;
    }
  }
#endif
}

}  // namespace flash::fa2
