// FA1 backward launcher: D = rowsum(dO o O), the main kernel, dQ conversion. Included by the
// generated instantiation files only.
#pragma once

#include <algorithm>

#include "common/check.h"
#include "fa1/fa1.h"
#include "fa1/fa1_bwd_kernel.cuh"

namespace flash::fa1 {

// Grid for the element-wise helper kernels: enough blocks to fill the GPU, grid-stride beyond.
inline unsigned helper_blocks(int64_t threads_needed, int num_sms) {
  const int64_t blocks = (threads_needed + kNumThreads - 1) / kNumThreads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(std::max(num_sms, 1)) * 16)));
}

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream) {
  using Tile = BwdTile<kHeadDim>;
  BwdParams p = params;
  if (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes) {
    throw std::runtime_error("flash_attn fa1: backward workspace missing or too small");
  }
  const int64_t rows_pad = round_up(p.seqlen_q, kRowPad);
  const int64_t q_rows = int64_t(p.batch) * p.heads * rows_pad;
  // Scratch layout: dQ accumulator (fragment order), then D.
  p.dq_accum = static_cast<float*>(p.workspace);
  p.dsum = p.dq_accum + q_rows * kHeadDim;

  FLASH_CHECK_CUDA(cudaMemsetAsync(p.dq_accum, 0, q_rows * kHeadDim * sizeof(float), stream));
  bwd_dot_do_o_kernel<T, kHeadDim>
      <<<helper_blocks(q_rows * 16, p.num_sms), kNumThreads, 0, stream>>>(p);
  FLASH_CHECK_LAUNCH();

  const int kv_tiles = cdiv(p.seqlen_k, Tile::Bc);
  // Deterministic: one block per (batch, KV head) walks every K/V tile in order.
  const int kv_tiles_per_block = p.deterministic ? kv_tiles : 1;
  const int64_t blocks =
      int64_t(p.batch) * p.heads_k * cdiv(kv_tiles, kv_tiles_per_block);
  if (blocks > int64_t(INT32_MAX)) throw std::runtime_error("flash_attn fa1: grid too large");
  auto kernel = bwd_kernel<T, kHeadDim>;
  if (Tile::kSmemBytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tile::kSmemBytes));
  }
  kernel<<<unsigned(blocks), kNumThreads, Tile::kSmemBytes, stream>>>(p, kv_tiles_per_block);
  FLASH_CHECK_LAUNCH();

  bwd_convert_dq_kernel<T, kHeadDim>
      <<<helper_blocks(q_rows / 16 * (kHeadDim / 8) * 32, p.num_sms), kNumThreads, 0, stream>>>(p);
  FLASH_CHECK_LAUNCH();
}

}  // namespace flash::fa1
