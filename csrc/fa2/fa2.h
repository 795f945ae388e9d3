// FA2 entry points: what the API layer calls, the same host interface as every family's:
//   fwd_unsupported(params) / bwd_unsupported   nullptr: FA2 runs every FwdParams feature but
//                                               paged K/V with dropout
//   plan_fwd(params, hdim, tuning) / plan_bwd    the call's plan, with its workspace_bytes
//   run_fwd<T, hdim>(params, plan, stream) / run_bwd
// Instantiated per (element type, head dim) by the generated files in csrc/generated/.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/params.h"
#include "common/tuning.h"

namespace flash::fa2 {

inline const char* fwd_unsupported(const FwdParams& p) {
  return p.block_table != nullptr && p.dropout_p > 0.f
             ? "fa2 has no paged K/V kernels with dropout (paged K/V is an inference layout)"
             : nullptr;
}
inline const char* bwd_unsupported(const BwdParams&) { return nullptr; }

// Rows of the per-row backward scratch (D, dQ accumulator) are padded to this.
constexpr int kRowPad = 128;

__host__ __device__ inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The most dynamic shared memory a block may opt into: sm80 (A100) and sm86/sm89. A tile
// larger than the smaller also gets a variant with fewer buffers, chosen at launch.
constexpr int kSm80SmemBytes = 163 * 1024;
constexpr int kSm86SmemBytes = 99 * 1024;

// The backward's least shared memory per block (bytes) at each kernel head dim: the smallest
// variant its launcher runs (two Q buffers, or one where two are past sm80's 163 KB: head dim
// 256). Every entry is past sm86 / sm89's 99 KB, so those GPUs run no fa2 backward, and the
// dispatcher trains there on fa1 where it can (build_matrix.py's fa2 entry states the same
// table, a test keeps them equal; fa2_bwd_launch.cuh checks it against BwdTraits).
constexpr int kBwdMinSmem[][2] = {{32, 108544}, {64, 149504}, {96, 132096},
                                  {128, 164864}, {192, 140288}, {256, 147968}};
constexpr int bwd_min_smem_bytes(int kernel_hdim) {
  for (const auto& entry : kBwdMinSmem) {
    if (entry[0] == kernel_hdim) return entry[1];
  }
  return 0;
}

// The backward kernels' query tiles are at least this tall (the deterministic mode keeps one
// counter per tile of this height, enough for any of them).
constexpr int kBwdMinBlockM = 64;

// The forward's tile (query rows, keys) per kernel head dim: fa2_tiles.h's FwdTile asserts it;
// the plan sizes split-KV with it.
constexpr int fwd_block_m(int kernel_hdim) { return kernel_hdim == 256 ? 64 : 128; }
constexpr int fwd_block_n(int kernel_hdim) { return kernel_hdim <= 64 ? 128 : 64; }

// The decode kernel (fa2_decode_kernel.cuh), for KV-cache calls with a short query: one warp
// per (sequence, KV head, split, row group) holds 16 of the query rows of every query head of
// that KV head, packed into the rows of one MMA tile, and streams K / V through kDecodeStages
// buffers of decode_block_n keys (K and V about 16 KB a stage at any head dim). Rows are padded
// by 16 bytes in shared memory (no swizzle: the padding alone spreads the 8 rows of an ldmatrix
// over all banks, for any head dim).
constexpr int kDecodeRows = 16;
// Up to this many query rows per KV head take the decode kernel, in groups of kDecodeRows, one
// warp each: the groups of a (sequence, KV head) are neighbouring blocks, so that all but the
// first mostly read K / V from L2. More rows fill the forward's tiles well enough.
constexpr int kDecodeMaxRows = 64;
// The query rows of one KV head: seqlen_q tokens x the query heads that share it.
inline int64_t decode_rows(const FwdParams& p) {
  return int64_t(p.seqlen_q) * (p.heads / p.heads_k);
}
inline int decode_row_groups(const FwdParams& p) {
  return int((decode_rows(p) + kDecodeRows - 1) / kDecodeRows);
}
constexpr int kDecodeStages = 3;
constexpr int decode_block_n(int kernel_hdim) {
  return kernel_hdim <= 64 ? 64 : kernel_hdim <= 128 ? 32 : 16;
}
constexpr int decode_smem_bytes(int kernel_hdim) {  // tiles, then one mbarrier per stage
  return (kDecodeRows + 2 * kDecodeStages * decode_block_n(kernel_hdim)) * (kernel_hdim + 8) * 2 +
         8 * kDecodeStages;
}
// Calls over a KV cache (not variable-length, no dropout) with few query rows per KV head:
// seqlen_q * heads / heads_k <= 64 (one-token decode, speculative decoding with a few tokens).
inline bool decode_fits(const FwdParams& p) {
  return p.kv_cache && p.cu_seqlens_q == nullptr && p.dropout_p == 0.f &&
         decode_rows(p) <= kDecodeMaxRows;
}

struct FwdPlan {
  int64_t workspace_bytes = 0;  // split-KV's accumulators (params.o_accum, lse_accum), else 0
  int head_group = 0;           // the tile order's heads per group; 0: automatic
  int num_splits = 1;
  bool decode = false;          // the decode kernel (decode_fits), else the forward's
  // sm90, decode after kvcache_prep: the decode kernel and the combine with programmatic
  // launch (common/pdl.h), scheduled while the kernel ahead (kvcache_prep, the decode kernel)
  // finishes. Only after kvcache_prep: the decode kernel reads the lengths, the block table
  // and the cached keys before its wait (it waits only for the rotated q or a tile of new
  // keys), safe when the kernel ahead is one that never writes them and began after all that
  // did.
  // sm90 code only (FwdParams::code_arch): the compute_80 PTX has no waits.
  bool pdl = false;
};

// Backward scratch, laid out by the launcher (fa2_bwd_launch.cuh), rows_pad = round_up(seqlen_q,
// kRowPad) (variable-length: of the longest sequence; each sequence has its rows_pad):
//   dq_accum: fp32 (batch, heads, rows_pad, kernel_hdim) in m16n8 fragment order (fa2_bwd_dq.h)
//   counters: int32 (batch, heads, rows_pad / kBwdMinBlockM), deterministic mode only: whose
//             turn it is to add into each query tile of dq_accum
//   dsum:     fp32 (batch, heads, rows_pad), D = rowsum(dO o O)
// The preprocess zeroes dq_accum and the counters and writes dsum whole.
struct BwdPlan {
  int64_t workspace_bytes = 0;
  // sm90: dQ tiles added by bulk reductions (where the kernel's tile has them and shared
  // memory holds their staging), not per-fragment reds; never deterministic, whose turns need
  // each add complete before the next block's.
  bool dq_bulk = false;
  bool dq_defer = false;  // the last dQ chunk's reds spread over dK's GEMM (not deterministic)
  bool pdl = false;       // sm90: the main kernel and the conversion with programmatic launch
  int head_group = 0;
};

// Split-KV, for calls over a KV cache (dense calls keep their kernels as they are): the
// call's num_splits, or automatically enough splits to fill the SMs once when the items do
// not, each with four key tiles or more; at most 128 and the cache's key tiles.
inline int fwd_splits(const FwdParams& p, int kernel_hdim) {
  if (!p.kv_cache || p.cu_seqlens_q != nullptr || p.dropout_p > 0.f) return 1;
  const int64_t items = (p.seqlen_q + fwd_block_m(kernel_hdim) - 1) / fwd_block_m(kernel_hdim) *
                        p.batch * p.heads;
  const int64_t tiles = (p.seqlen_k + fwd_block_n(kernel_hdim) - 1) / fwd_block_n(kernel_hdim);
  int64_t splits = p.splits_requested;
  if (splits <= 0) {
    splits = items >= p.num_sms ? 1 : std::min<int64_t>((p.num_sms + items - 1) / items, tiles / 4);
  }
  return int(std::max<int64_t>(1, std::min<int64_t>({splits, tiles, 128})));
}

// The decode kernel's split-KV: the call's num_splits, or as many splits as one wave of
// blocks holds (every SM with as many of them as fit), each with four key tiles or more; at
// most 128 and the cache's key tiles. Where that wave would take more than 8 splits (a few
// sequences), only two blocks per SM: H100, hdim 128 (4 blocks fit per SM), one run, batch 1 /
// 2 x 8k ran 1.13 / 1.09x faster at 33 / 16 splits than at 66 / 33 (each split's first loads
// and partials cost more than its share of the bandwidth), while batch 8-32 ran 1-2% faster
// with the full wave's 8-2 splits than with half. Rounded down: a wave and a fraction of one
// ran at the speed of two (H200, batch 8 and 32 at 8k, 9 and 3 splits: 1.09 and 1.45 waves,
// 1.6 and 2.2 TB/s where batch 128, one split, read 3.1). Shared memory per SM: sm90 228 KB,
// sm80 / sm87 164 KB, sm86 / sm89 100 KB, less 1 KB per block.
// Pages that cut a key tile into several pieces take three blocks per SM there instead: a
// warp issues its own copies, twice as many TMA boxes a tile at page 16, and with two warps
// per SM that ran at 0.78-0.89x the contiguous call's speed, with three at 0.95-0.98 (H200,
// hdim 128, batch 1-4, 8k / 32k; a contiguous cache loses 1-7% at three).
inline int decode_splits(const FwdParams& p, int kernel_hdim) {
  const int64_t items = int64_t(p.batch) * p.heads_k * decode_row_groups(p);
  const int block_n = decode_block_n(kernel_hdim);
  const int64_t tiles = (p.seqlen_k + block_n - 1) / block_n;
  int64_t splits = p.splits_requested;
  if (splits <= 0) {
    const int64_t sm_bytes = (p.arch == 90 ? 228 : p.arch == 80 || p.arch == 87 ? 164 : 100) * 1024;
    const int64_t per_sm = std::max<int64_t>(1, sm_bytes / (decode_smem_bytes(kernel_hdim) + 1024));
    const int64_t sms = std::max(p.num_sms, 1);
    const bool cut_tiles = p.block_table != nullptr && p.page_size % block_n != 0;
    splits = per_sm * sms / items;
    if (splits > 8) splits = std::min<int64_t>(per_sm, cut_tiles ? 3 : 2) * sms / items;
    splits = std::min(splits, tiles / 4);
  }
  return int(std::max<int64_t>(1, std::min<int64_t>({splits, tiles, 128})));
}

inline FwdPlan plan_fwd(const FwdParams& p, int kernel_hdim, const Tuning& tuning = {}) {
  FwdPlan plan;
  plan.head_group = tuning.head_group;
  plan.decode = tuning.fa2_decode != 0 && decode_fits(p);
  plan.num_splits = plan.decode ? decode_splits(p, kernel_hdim) : fwd_splits(p, kernel_hdim);
  plan.pdl = plan.decode && p.after_prep && p.code_arch == 90 && tuning.fa2_pdl != 0;
  if (plan.num_splits > 1) {
    const int64_t rows = int64_t(plan.num_splits) * p.batch * p.heads * p.seqlen_q;
    plan.workspace_bytes = (round_up(rows, 4) + rows * p.head_dim) * 4;  // lse, then O (16 B aligned)
  }
  return plan;
}

inline BwdPlan plan_bwd(const BwdParams& p, int kernel_hdim, const Tuning& tuning = {}) {
  const int64_t rows = int64_t(p.batch) * p.heads * round_up(p.seqlen_q, kRowPad);
  const int64_t counters = p.deterministic ? rows / kBwdMinBlockM : 0;
  BwdPlan plan;
  plan.workspace_bytes = rows * kernel_hdim * 4 + counters * 4 + rows * 4;
  plan.dq_bulk = p.code_arch >= 90 && !p.deterministic && tuning.fa2_dq_bulk != 0;
  plan.dq_defer = !p.deterministic && tuning.fa2_dq_defer != 0;
  // sm90 code only: other GPUs run the wheel's compute_80 PTX (as does an H100 with a build
  // of 80+PTX), where common/pdl.h's waits compile away, and a programmatic launch without
  // them would read what the kernel ahead still writes.
  plan.pdl = p.code_arch == 90 && tuning.fa2_pdl != 0;
  plan.head_group = tuning.head_group;
  return plan;
}

// params.workspace must hold the plan's workspace_bytes (no initialisation needed). Throws
// std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream);

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream);

}  // namespace flash::fa2
