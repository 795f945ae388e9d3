// FA3 entry points: what the API layer calls, the same host interface as every family's:
//   fwd_unsupported(params)            why this family cannot run the call, nullptr if it can
//   plan_fwd(params, hdim, tuning)     the call's plan (fa3_plan.h), with its workspace_bytes
//   run_fwd<T, hdim>(params, plan, s)  the launch; params.workspace holds the plan's bytes
// Forward only (its gradient is FA2's backward, which shares the O and LSE conventions); every
// FwdParams feature but dropout. sm_90a machine code: the kernels are empty in any other
// compilation.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "fa3/fa3_plan.h"

namespace flash::fa3 {

inline const char* fwd_unsupported(const FwdParams& p) {
  if (p.block_table != nullptr) return "fa3 has no paged K/V kernels yet; fa2 runs them";
  return p.dropout_p > 0.f ? "fa3 does not support dropout; fa2 runs it" : nullptr;
}

// Throws std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream);

}  // namespace flash::fa3
