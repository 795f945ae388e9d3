// FA3 entry points: what the API layer calls, the same host interface as every family's:
//   fwd_unsupported(params) / bwd_unsupported   why this family cannot run the call, nullptr
//                                               if it can
//   plan_fwd(params, hdim, tuning) / plan_bwd   the call's plan, with its workspace_bytes
//   run_fwd<T, hdim>(params, plan, s) / run_bwd the launch; params.workspace holds the plan's
// The forward: every FwdParams feature but dropout. The backward: head dims 64 and 128, dense
// and variable-length, every feature but dropout (build_matrix's fa3 entry);
// the frontend gives other gradients of its forward to FA2's backward, which shares the O and
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

struct BwdPlan {
  int64_t workspace_bytes = 0;  // dQ accumulators (fp32), lse in base 2, D, dQ turns
  int dq_copies = 1;            // dQ accumulators (deterministic mode, fa3_bwd_kernel.cuh)
};

// Deterministic calls whose key tiles all walk the same query tiles (no right bound on the
// keys a row sees) add into this many dQ accumulators, summed in order at the conversion: the
// chain of turns a dQ tile waits through is a quarter as long (fa3_bwd_kernel.cuh).
constexpr int kBwdDqCopies = 4;

inline BwdPlan plan_bwd(const BwdParams& p, int kernel_hdim, const Tuning& = {}) {
  constexpr int64_t kRowPad = 64, kBlockN = 128;  // fa3_bwd_prep.cuh, fa3_bwd_traits.h
  const int64_t rows_pad = (p.seqlen_q + kRowPad - 1) / kRowPad * kRowPad;
  const int64_t rows = int64_t(p.batch) * p.heads * rows_pad;
  const int64_t key_tiles = (p.seqlen_k + kBlockN - 1) / kBlockN;
  BwdPlan plan;
  if (p.deterministic && !p.causal && p.window_right < 0) {
    plan.dq_copies = int(key_tiles < kBwdDqCopies ? key_tiles : kBwdDqCopies);
  }
  const int64_t turns = p.deterministic ? plan.dq_copies * rows / kRowPad : 0;
  plan.workspace_bytes = rows * (kernel_hdim * plan.dq_copies + 2) * 4 + turns * 4;
  return plan;
}

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream);

}  // namespace flash::fa3
