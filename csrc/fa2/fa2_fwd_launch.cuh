// FA2 forward launcher: grid shape, the stage, dropout and score-mod variants and the
// shared-memory opt-in. Included by the generated instantiation files only.
#pragma once

#include <algorithm>
#include <stdexcept>

#include "common/check.h"
#include "fa2/fa2.h"
#include "fa2/fa2_fwd_kernel.cuh"

namespace flash::fa2 {

template <class Tr>
void launch_fwd(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  const int m_blocks = int((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
  // A query tile reads its KV head's K and V, shared by heads_per_kv query heads.
  const int heads_per_kv = p.heads / p.heads_k;
  const int64_t kv_bytes = int64_t(p.seqlen_k) * Tr::kHeadDim * 2 * sizeof(typename Tr::Element);
  auto kernel = fwd_kernel<Tr>;
  if (Tr::kSmemBytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tr::kSmemBytes));
  }
  const TileOrder order =
      tile_order(m_blocks, p.batch, p.heads, heads_per_kv, kv_bytes / heads_per_kv, p.l2_bytes,
                 resident_blocks(kernel, Tr::kThreads, Tr::kSmemBytes, p.num_sms),
                 plan.head_group);
  kernel<<<order.grid(), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, order);
  FLASH_CHECK_LAUNCH();
}

// Two K/V stages where the device's shared memory holds them, else one (FwdTile).
template <typename T, int kHeadDim, bool kDropout, bool kScoreMod>
void launch_fwd_stages(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  constexpr int kStages = FwdTile<kHeadDim>::kStages;
  using Table = FwdTraits<T, kHeadDim, kStages, kDropout, kScoreMod>;
  if constexpr (kStages == 2 && Table::kSmemBytes > kSm86SmemBytes) {
    int device = 0, max_smem = 0;
    FLASH_CHECK_CUDA(cudaGetDevice(&device));
    FLASH_CHECK_CUDA(
        cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (Table::kSmemBytes > max_smem) {
      launch_fwd<FwdTraits<T, kHeadDim, 1, kDropout, kScoreMod>>(p, plan, stream);
      return;
    }
  }
  launch_fwd<Table>(p, plan, stream);
}

template <typename T, int kHeadDim, bool kDropout>
void launch_fwd_variant(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  if (p.softcap > 0.f || p.alibi_slopes != nullptr) {
    launch_fwd_stages<T, kHeadDim, kDropout, true>(p, plan, stream);
  } else {
    launch_fwd_stages<T, kHeadDim, kDropout, false>(p, plan, stream);
  }
}

template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream) {
  // Dropout and the score mods (softcap, ALiBi) are template flags: their state and code cost
  // registers, and the loop's instruction footprint, that the plain kernel should not carry.
  // Masks and windows are runtime fields.
  if (params.dropout_p > 0.f) {
    launch_fwd_variant<T, kHeadDim, true>(params, plan, stream);
  } else {
    launch_fwd_variant<T, kHeadDim, false>(params, plan, stream);
  }
}

}  // namespace flash::fa2
