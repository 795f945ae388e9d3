// FA3 entry point: what the API layer calls. Instantiated per (element type, head dim) by the
// generated files in csrc/generated/. Forward only (its gradient is FA2's backward, which
// shares the O and LSE conventions); every FwdParams feature but dropout (window, softcap,
// ALiBi, GQA). sm_90a machine code: the kernels are empty in any other compilation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace flash::fa3 {

// Scratch in global memory: the counter of the tile scheduler (fa3_scheduler.h), which the
// launcher zeroes on the stream. Every call needs it.
inline int64_t fwd_workspace_bytes(const FwdParams&) { return int64_t(sizeof(unsigned)); }

// params.workspace must hold fwd_workspace_bytes(params) bytes, aligned for an unsigned.
// Throws std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);

}  // namespace flash::fa3
