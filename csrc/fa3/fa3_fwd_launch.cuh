// FA3 forward launcher (v0): TMA descriptors over (seqlen, head_dim, heads, batch) views of
// Q, K, V, one CTA per (query tile, head, batch).
#pragma once

#include <cute/tensor.hpp>

#include "common/check.h"
#include "fa3/fa3_fwd_kernel.cuh"

namespace flash::fa3 {

template <class Tr>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Element = typename Tr::Element;
  // The TMA boxes are kHeadDim wide; columns past head_dim (<= kHeadDim) are zero-filled.
  auto rows = [&](const void* ptr, const Strides& s, int seqlen, int heads) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       make_shape(seqlen, p.head_dim, heads, p.batch),
                       make_stride(s.row, _1{}, s.head, s.batch));
  };
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, rows(p.q, p.q_strides, p.seqlen_q, p.heads),
                             typename Tr::SmemQ{});
  auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, rows(p.k, p.k_strides, p.seqlen_k, p.heads_k),
                             take<0, 2>(typename Tr::SmemKV{}));
  auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, rows(p.v, p.v_strides, p.seqlen_k, p.heads_k),
                             take<0, 2>(typename Tr::SmemKV{}));
  using Tma = FwdTma<decltype(tma_q), decltype(tma_k), decltype(tma_v)>;
  const Tma tma{tma_q, tma_k, tma_v};
  auto kernel = fwd_kernel<Tr, Tma>;
  FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Tr::kSmemBytes));
  const dim3 grid((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, p.heads, p.batch);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p, tma);
  FLASH_CHECK_LAUNCH();
}

}  // namespace flash::fa3
