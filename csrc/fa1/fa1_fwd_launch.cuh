// FA1 forward launcher: grid shape and shared-memory opt-in. Included by the generated
// instantiation files only.
#pragma once

#include <algorithm>

#include "common/check.h"
#include "fa1/fa1.h"
#include "fa1/fa1_fwd_kernel.cuh"

namespace flash::fa1 {

// Q tiles per block. The paper's grid is one block per (batch, head) walking all Tr tiles, which
// leaves most SMs idle when batch * heads is small (long sequences), and whose running O per
// block (Tr x 64 rows x d fp32) is far too large to stay in L2. Two tiles per block let K_j, V_j
// in shared memory serve two Q tiles while the running O of all resident blocks still fits in
// L2; more tiles spill it to HBM, which every step then reads and writes (the sweep is in
// benchmarks/results/fa1_q_tiles_*.md). One tile only when the grid would not fill the GPU.
inline int fwd_q_tiles_per_block(int q_tiles, int64_t batch_heads, int num_sms) {
  constexpr int kTilesPerBlock = 2;
  const int64_t blocks_if_two = batch_heads * ((q_tiles + kTilesPerBlock - 1) / kTilesPerBlock);
  if (blocks_if_two < 2 * int64_t(std::max(num_sms, 1))) return 1;
  return std::min(q_tiles, kTilesPerBlock);
}

template <typename T, int kHeadDim, bool kWide>
void launch_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDim, kWide>;
  FwdParams p = params;
  if (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes) {
    throw std::runtime_error("flash_attn fa1: forward workspace missing or too small");
  }
  const int q_tiles = cdiv(p.seqlen_q, Tile::Br);
  const int64_t batch_heads = int64_t(p.batch) * p.heads;
  p.q_tiles_per_block = plan.q_tiles_per_block > 0
                            ? plan.q_tiles_per_block
                            : fwd_q_tiles_per_block(q_tiles, batch_heads, p.num_sms);
  p.q_tiles_per_block = std::min(p.q_tiles_per_block, q_tiles);
  const int64_t blocks = batch_heads * cdiv(q_tiles, p.q_tiles_per_block);
  if (blocks > int64_t(INT32_MAX)) throw std::runtime_error("flash_attn fa1: grid too large");

  auto kernel = fwd_kernel<T, kHeadDim, kWide>;
  if (Tile::kSmemBytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tile::kSmemBytes));
  }
  kernel<<<unsigned(blocks), kNumThreads, Tile::kSmemBytes, stream>>>(p);
  FLASH_CHECK_LAUNCH();
}

template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream) {
  // Only d > 64 has a wide variant (FwdTile); sm75 cannot give a block more than 64 KB.
  if constexpr (kHeadDim > 64) {
    if (params.code_arch >= 80) return launch_fwd<T, kHeadDim, true>(params, plan, stream);
  }
  launch_fwd<T, kHeadDim, false>(params, plan, stream);
}

}  // namespace flash::fa1
