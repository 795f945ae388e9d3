// FA2 entry points: what the API layer calls, the same host interface as every family's:
//   fwd_unsupported(params) / bwd_unsupported   nullptr: FA2 runs every FwdParams feature
//   plan_fwd(params, hdim, tuning) / plan_bwd    the call's plan, with its workspace_bytes
//   run_fwd<T, hdim>(params, plan, stream) / run_bwd
// Instantiated per (element type, head dim) by the generated files in csrc/generated/.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "common/tuning.h"

namespace flash::fa2 {

inline const char* fwd_unsupported(const FwdParams&) { return nullptr; }
inline const char* bwd_unsupported(const BwdParams&) { return nullptr; }

// Rows of the per-row backward scratch (D, dQ accumulator) are padded to this.
constexpr int kRowPad = 128;

__host__ __device__ inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The most dynamic shared memory a block may opt into: sm80 (A100) and sm86/sm89. A tile
// larger than the smaller also gets a variant with fewer buffers, chosen at launch.
constexpr int kSm80SmemBytes = 163 * 1024;
constexpr int kSm86SmemBytes = 99 * 1024;

// The backward kernels' query tiles are at least this tall (the deterministic mode keeps one
// counter per tile of this height, enough for any of them).
constexpr int kBwdMinBlockM = 64;

struct FwdPlan {
  int64_t workspace_bytes = 0;  // none
  int head_group = 0;           // the tile order's heads per group; 0: automatic
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

inline FwdPlan plan_fwd(const FwdParams&, int, const Tuning& tuning = {}) {
  return {0, tuning.head_group};
}

inline BwdPlan plan_bwd(const BwdParams& p, int kernel_hdim, const Tuning& tuning = {}) {
  const int64_t rows = int64_t(p.batch) * p.heads * round_up(p.seqlen_q, kRowPad);
  const int64_t counters = p.deterministic ? rows / kBwdMinBlockM : 0;
  BwdPlan plan;
  plan.workspace_bytes = rows * kernel_hdim * 4 + counters * 4 + rows * 4;
  plan.dq_bulk = p.arch >= 90 && !p.deterministic && tuning.fa2_dq_bulk != 0;
  plan.dq_defer = !p.deterministic && tuning.fa2_dq_defer != 0;
  plan.pdl = p.arch >= 90 && tuning.fa2_pdl != 0;
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
