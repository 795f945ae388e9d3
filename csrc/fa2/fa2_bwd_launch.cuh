// FA2 backward launcher: the workspace layout, D = rowsum(dO o O), the main kernel (its Q
// buffering chosen by the device's shared memory, dropout and score mods as template flags),
// and the dQ conversion. Included by the generated instantiation files only.
// On sm90 the main kernel and the conversion are launched with programmatic dependent launch
// (common/pdl.h): each may be scheduled before the kernel ahead of it completes, and waits for
// it before reading its output.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "common/pdl.h"
#include "fa2/fa2.h"
#include "fa2/fa2_bwd_dq.h"
#include "fa2/fa2_bwd_kernel.cuh"
#include "fa2/fa2_bwd_preprocess.cuh"

namespace flash::fa2 {

template <class Tr>
void launch_bwd_main(const BwdParams& params, const BwdPlan& plan, int max_smem,
                     cudaStream_t stream) {
  BwdParams p = params;
  const int n_blocks = int((p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN);
  // A key tile walks Q, dO (and adds into dQ, fp32) of every query head of its KV head.
  const int64_t q_bytes = int64_t(p.seqlen_q) * Tr::kHeadDim *
                          (2 * sizeof(typename Tr::Element) + sizeof(float)) *
                          (p.heads / p.heads_k);
  p.dq_bulk = plan.dq_bulk && Tr::kBulkdQ && Tr::kSmemBytes + Tr::kdQStageBytes <= max_smem;
  p.dq_defer = plan.dq_defer;
  const int smem_bytes = Tr::kSmemBytes + (p.dq_bulk ? Tr::kdQStageBytes : 0);
  auto kernel = bwd_kernel<Tr>;
  FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        smem_bytes));
  const TileOrder order =
      tile_order(n_blocks, p.batch, p.heads_k, 1, q_bytes, p.l2_bytes,
                 resident_blocks(kernel, Tr::kThreads, smem_bytes, p.num_sms), plan.head_group);
  launch(kernel, dim3(order.grid()), dim3(Tr::kThreads), smem_bytes, stream, plan.pdl, p, order);
}

// Dropout and the score mods (softcap, ALiBi) are template flags: their state and code cost
// registers, and the loop's instruction footprint, that the plain kernel should not carry.
// Everything else (mask, window, GQA, determinism) is a runtime field.
template <typename T, int kHeadDim, int kQStages, bool kDropout>
void launch_bwd_mod_variant(const BwdParams& p, const BwdPlan& plan, int max_smem,
                            cudaStream_t stream) {
  if (p.softcap > 0.f || p.alibi_slopes != nullptr) {
    launch_bwd_main<BwdTraits<T, kHeadDim, kQStages, kDropout, true>>(p, plan, max_smem, stream);
  } else {
    launch_bwd_main<BwdTraits<T, kHeadDim, kQStages, kDropout, false>>(p, plan, max_smem, stream);
  }
}

template <typename T, int kHeadDim, int kQStages>
void launch_bwd_variant(const BwdParams& p, const BwdPlan& plan, int max_smem,
                        cudaStream_t stream) {
  if (p.dropout_p > 0.f) {
    launch_bwd_mod_variant<T, kHeadDim, kQStages, true>(p, plan, max_smem, stream);
  } else {
    launch_bwd_mod_variant<T, kHeadDim, kQStages, false>(p, plan, max_smem, stream);
  }
}

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream) {
  BwdParams p = params;
  if (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes) {
    throw std::runtime_error("flash_attn fa2: backward workspace missing or too small");
  }
  // Workspace: dq_accum | counters (deterministic) | dsum, as bwd_workspace_bytes sizes it.
  const int64_t rows_pad = round_up(p.seqlen_q, kRowPad);
  const int64_t batch_heads = int64_t(p.batch) * p.heads;
  const int64_t rows = batch_heads * rows_pad;
  const int64_t counters = p.deterministic ? rows / kBwdMinBlockM : 0;
  p.dq_accum = static_cast<float*>(p.workspace);
  p.dsum = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + rows * kHeadDim * 4 +
                                    counters * 4);

  // The preprocess follows whatever wrote dO and O: a plain launch.
  const int64_t dot_blocks = (rows + DotTile<kHeadDim>::kRowsPerStep - 1) / DotTile<kHeadDim>::kRowsPerStep;
  const int64_t max_blocks = int64_t(std::max(p.num_sms, 1)) * 16;
  bwd_dot_do_o_kernel<T, kHeadDim><<<unsigned(std::min(dot_blocks, max_blocks)), kDotThreads,
                                     0, stream>>>(p);
  FLASH_CHECK_LAUNCH();

  int device = 0, max_smem = 0;
  FLASH_CHECK_CUDA(cudaGetDevice(&device));
  FLASH_CHECK_CUDA(
      cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  constexpr int kSmemTwo = BwdTraits<T, kHeadDim, 2, false, false>::kSmemBytes;
  constexpr int kSmemOne = BwdTraits<T, kHeadDim, 1, false, false>::kSmemBytes;
  static_assert((kSmemTwo > kSm80SmemBytes ? kSmemOne : kSmemTwo) == bwd_min_smem_bytes(kHeadDim),
                "fa2.h's kBwdMinSmem: the least shared memory this launcher runs with");
  if (kSmemTwo <= max_smem) {
    launch_bwd_variant<T, kHeadDim, 2>(p, plan, max_smem, stream);
  } else if constexpr (kSmemTwo > kSm80SmemBytes) {
    if (kSmemOne > max_smem) {
      throw std::runtime_error("flash_attn fa2: the backward for head dim " +
                               std::to_string(kHeadDim) + " needs " + std::to_string(kSmemOne) +
                               " bytes of shared memory per block; this GPU allows " +
                               std::to_string(max_smem));
    }
    launch_bwd_variant<T, kHeadDim, 1>(p, plan, max_smem, stream);
  } else {
    throw std::runtime_error("flash_attn fa2: the backward for head dim " +
                             std::to_string(kHeadDim) + " needs " + std::to_string(kSmemTwo) +
                             " bytes of shared memory per block; this GPU allows " +
                             std::to_string(max_smem));
  }

  const dim3 convert_grid(unsigned(rows_pad / kDqConvertRows),
                          unsigned(std::min<int64_t>(batch_heads, 65535)));
  launch(bwd_convert_dq_kernel<T, kHeadDim>, convert_grid, dim3(kDqConvertThreads), 0, stream,
         plan.pdl, p);
}

}  // namespace flash::fa2
