// FA1 forward launcher: grid shape and shared-memory opt-in. Included by the generated
// instantiation files only.
#pragma once

#include <algorithm>

#include "common/check.h"
#include "fa1/fa1.h"
#include "fa1/fa1_fwd_kernel.cuh"

namespace flash::fa1 {

// Q tiles per block. One block per (batch, head) walking all Tr tiles is the paper's grid; when
// batch * heads is small (long sequences) that leaves most SMs idle, so the Q tiles are split
// into slices until there are about kTargetBlocksPerSm resident blocks per SM, while keeping each
// slice long enough that a K/V tile in shared memory serves several Q tiles.
inline int fwd_q_tiles_per_block(int q_tiles, int64_t batch_heads, int num_sms) {
  constexpr int kTargetBlocksPerSm = 4;
  constexpr int kMaxTilesPerBlock = 8;
  const int64_t target_blocks = int64_t(std::max(num_sms, 1)) * kTargetBlocksPerSm;
  const int64_t slices_wanted = (target_blocks + batch_heads - 1) / batch_heads;
  int tiles = int((q_tiles + slices_wanted - 1) / slices_wanted);
  return std::clamp(tiles, 1, std::min(q_tiles, kMaxTilesPerBlock));
}

template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDim>;
  FwdParams p = params;
  const int q_tiles = cdiv(p.seqlen_q, Tile::Br);
  const int64_t batch_heads = int64_t(p.batch) * p.heads;
  if (p.q_tiles_per_block <= 0) {
    p.q_tiles_per_block = fwd_q_tiles_per_block(q_tiles, batch_heads, p.num_sms);
  }
  p.q_tiles_per_block = std::min(p.q_tiles_per_block, q_tiles);
  const int64_t blocks = batch_heads * cdiv(q_tiles, p.q_tiles_per_block);
  if (blocks > int64_t(INT32_MAX)) throw std::runtime_error("flash_attn fa1: grid too large");

  auto kernel = fwd_kernel<T, kHeadDim>;
  if (Tile::kSmemBytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tile::kSmemBytes));
  }
  kernel<<<unsigned(blocks), kNumThreads, Tile::kSmemBytes, stream>>>(p);
  FLASH_CHECK_LAUNCH();
}

}  // namespace flash::fa1
