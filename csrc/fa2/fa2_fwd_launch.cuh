// FA2 forward launcher: grid shape, the dropout variant and the shared-memory opt-in. Included
// by the generated instantiation files only.
#pragma once

#include <algorithm>
#include <stdexcept>

#include "common/check.h"
#include "fa2/fa2.h"
#include "fa2/fa2_fwd_kernel.cuh"

namespace flash::fa2 {

template <class Tr>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  const int m_blocks = int((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
  const int64_t batch_heads = int64_t(p.batch) * p.heads;
  const dim3 grid(m_blocks, unsigned(std::min<int64_t>(batch_heads, 65535)));
  auto kernel = fwd_kernel<Tr>;
  if (Tr::kSmemBytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tr::kSmemBytes));
  }
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  FLASH_CHECK_LAUNCH();
}

template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  // Dropout is a template flag: its Philox state and draws cost registers the plain kernel
  // should not carry. Everything else (mask, window, softcap, ALiBi) is a runtime field.
  if (params.dropout_p > 0.f) {
    launch_fwd<FwdTraits<T, kHeadDim, true>>(params, stream);
  } else {
    launch_fwd<FwdTraits<T, kHeadDim, false>>(params, stream);
  }
}

}  // namespace flash::fa2
