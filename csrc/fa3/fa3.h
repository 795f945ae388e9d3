// FA3 entry points: what the API layer calls, the same host interface as every family's:
//   fwd_unsupported(params) / bwd_unsupported   why this family cannot run the call, nullptr
//                                               if it can
//   plan_fwd(params, hdim, tuning) / plan_bwd   the call's plan, with its workspace_bytes
//   run_fwd<T, hdim>(params, plan, s) / run_bwd the launch; params.workspace holds the plan's
// The forward: every FwdParams feature but dropout. The backward: the same head dims, dense
// and variable-length, every feature but dropout (build_matrix's fa3 entry); the
// frontend gives other gradients of its forward to FA2's backward, which shares the O and
// LSE conventions. sm_90a machine code: the kernels are empty in any other compilation.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "fa3/fa3_plan.h"

namespace flash::fa3 {

// Paged pools arrive as TMA boxes of a multiple of 8 rows within a page (fa3_fwd_paged.h:
// a box's rows start at a swizzle atom's), so pages must be a multiple of this many rows. The
// frontend's feature "paged_kv_unaligned" is the same rule (build_matrix.PAGE_ROWS).
constexpr int kPageRows = 8;

inline const char* fwd_unsupported(const FwdParams& p) {
  if (p.fp8) {
    if (p.cu_seqlens_q != nullptr || p.kv_cache || p.block_table != nullptr) {
      return "fa3's FP8 forward takes dense calls only so far (not variable-length or KV-cache "
             "calls)";
    }
    if (p.softcap > 0.f || p.alibi_slopes != nullptr || p.dropout_p > 0.f) {
      return "fa3's FP8 forward supports neither softcap, ALiBi nor dropout so far";
    }
    if (p.head_dim % 16 != 0) {
      return "fa3's FP8 forward needs a head dim that is a multiple of 16 (16-byte rows)";
    }
  }
  if (p.block_table != nullptr && p.page_size % kPageRows != 0) {
    return "fa3 reads paged K/V in boxes of 8 rows or more within a page: its page_block_size "
           "must be a multiple of 8; fa2 runs other pages";
  }
  return p.dropout_p > 0.f ? "fa3 does not support dropout; fa2 runs it" : nullptr;
}

// Throws std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream);

// The backward (fa3_bwd_kernel.cuh): dense and variable-length calls; causal, window,
// softcap, ALiBi; GQA; deterministic.
inline const char* bwd_unsupported(const BwdParams& p) {
  if (p.kv_cache) return "a KV-cache call has no backward";
  if (p.dropout_p > 0.f) return "fa3 does not support dropout; fa2 runs it";
  return nullptr;
}

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream);

}  // namespace flash::fa3
