// FA1 entry points: what the API layer and the C++ harness call. Instantiated per
// (element type, head dim) by the generated files in csrc/generated/.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace flash::fa1 {

// Rows of the per-row scratch are padded to this, so no kernel needs a bounds check there.
constexpr int kRowPad = 128;

__host__ __device__ inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Forward scratch: the running O (fp32, kernel head dim) then the running max and sum per row.
inline int64_t fwd_workspace_bytes(int batch, int heads, int seqlen_q, int kernel_hdim) {
  const int64_t rows = int64_t(batch) * heads * round_up(seqlen_q, kRowPad);
  return rows * kernel_hdim * 4 + rows * 2 * 4;
}

// Backward scratch: dQ accumulated in fp32 (kernel head dim), then D = rowsum(dO * O) per row.
inline int64_t bwd_workspace_bytes(int batch, int heads, int seqlen_q, int kernel_hdim) {
  const int64_t rows = int64_t(batch) * heads * round_up(seqlen_q, kRowPad);
  return rows * kernel_hdim * 4 + rows * 4;
}

// params.workspace must hold fwd_workspace_bytes(...) / bwd_workspace_bytes(...) bytes; it needs
// no initialisation. Throws std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, cudaStream_t stream);

}  // namespace flash::fa1
