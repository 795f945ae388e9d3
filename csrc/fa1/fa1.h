// FA1 entry points: what the API layer and the C++ harness call, the same host interface as
// every family's:
//   fwd_unsupported(params) / bwd_unsupported   why FA1 cannot run a call, nullptr if it can
//   plan_fwd(params, hdim, tuning) / plan_bwd    the call's plan, with its workspace_bytes
//   run_fwd<T, hdim>(params, plan, stream) / run_bwd
// Instantiated per (element type, head dim) by the generated files in csrc/generated/.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "common/tuning.h"

namespace flash::fa1 {

// Rows of the per-row scratch are padded to this, so no kernel needs a bounds check there.
constexpr int kRowPad = 128;

__host__ __device__ inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// FA1 knows causal attention and GQA only.
inline const char* fwd_unsupported(const FwdParams& p) {
  const bool local = p.window_left >= 0 || (p.window_right >= 0 && !p.causal);
  if (local || p.softcap > 0.f || p.alibi_slopes != nullptr || p.dropout_p > 0.f) {
    return "fa1 supports causal and GQA only, not a window, softcap, ALiBi or dropout; fa2 "
           "runs them";
  }
  if (p.cu_seqlens_q != nullptr) return "fa1 has no variable-length batches; fa2 runs them";
  if (p.kv_cache) return "fa1 has no KV-cache kernels; fa2 runs them";
  return nullptr;
}
inline const char* bwd_unsupported(const BwdParams& p) { return fwd_unsupported(p); }

struct FwdPlan {
  // Scratch: the running O (fp32, kernel head dim) then the running max and sum per row.
  int64_t workspace_bytes = 0;
  int q_tiles_per_block = 0;  // 0: the launcher's rule (fa1_fwd_launch.cuh)
};
struct BwdPlan {
  // Scratch: dQ accumulated in fp32 (kernel head dim), then D = rowsum(dO * O) per row.
  int64_t workspace_bytes = 0;
};

inline FwdPlan plan_fwd(const FwdParams& p, int kernel_hdim, const Tuning& tuning = {}) {
  const int64_t rows = int64_t(p.batch) * p.heads * round_up(p.seqlen_q, kRowPad);
  return {rows * kernel_hdim * 4 + rows * 2 * 4, tuning.fa1_q_tiles};
}
inline BwdPlan plan_bwd(const BwdParams& p, int kernel_hdim, const Tuning& = {}) {
  const int64_t rows = int64_t(p.batch) * p.heads * round_up(p.seqlen_q, kRowPad);
  return {rows * kernel_hdim * 4 + rows * 4};
}

// params.workspace must hold the plan's workspace_bytes; it needs no initialisation. Throws
// std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream);

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream);

}  // namespace flash::fa1
