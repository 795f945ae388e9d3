// FA3 backward launcher: the scratch in the workspace, its counters zeroed, the
// preprocess (lse in base 2, D), the main kernel over (key tile, KV head, batch) and the dQ
// conversion. Included by the generated instantiation files only.
#pragma once

#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#include <cute/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "common/seqinfo.h"
#include "fa3/fa3.h"
#include "fa3/fa3_bwd_kernel.cuh"

namespace flash::fa3 {

template <class Q, class DO, class K, class V>
struct BwdTma {
  Q q;
  DO dout;
  K k;
  V v;
};

inline BwdScratch bwd_scratch(const BwdParams& p, const BwdPlan& plan, int kernel_hdim) {
  BwdScratch s;
  s.rows_pad = (int64_t(p.seqlen_q) + plan.block_m - 1) / plan.block_m * plan.block_m;
  const int64_t rows = int64_t(p.batch) * p.heads * s.rows_pad;
  s.dq = static_cast<float*>(p.workspace);
  float* const after_dq = s.dq + rows * kernel_hdim;
  s.next_item = reinterpret_cast<unsigned*>(after_dq);
  s.items = plan.items;
  s.tail_pairs = plan.tail_pairs;
  s.split_parts = plan.split_parts;
  s.split_first = plan.items - plan.split_items * plan.split_parts;
  s.split_count = reinterpret_cast<unsigned*>(after_dq + kBwdCounterBytes / sizeof(float));
  s.split_acc = after_dq + (kBwdCounterBytes + bwd_split_counter_bytes(plan.split_items)) / 4;
  float* const after_split =
      after_dq + (kBwdCounterBytes + bwd_split_bytes(plan.split_items, kernel_hdim)) / 4;
  const int64_t pairs = int64_t(p.batch) * p.heads_k;
  s.zero_chunks = plan.zero_chunks;
  s.zero_next = s.next_item + 1;
  s.zero_all = s.next_item + 2;
  s.zero_done = reinterpret_cast<unsigned*>(after_split);
  float* const after_zero =
      after_split + (plan.zero_chunks > 0 ? bwd_zero_counter_bytes(pairs) / 4 : 0);
  s.kv_bound = p.deterministic ? after_zero : nullptr;
  s.lse2 = after_zero + (p.deterministic ? bwd_kv_bound_bytes(pairs) / 4 : 0);
  s.dsum = s.lse2 + rows;
  s.dq_scale = p.deterministic ? s.dsum + rows : nullptr;
  return s;
}

// The backward with the tile Tr (its rows a step: the plan's block_m).
template <class Tr>
void run_bwd_tile(const BwdParams& p, const BwdPlan& plan, cudaStream_t stream) {
  using T = typename Tr::Raw;
  using Element = typename Tr::Element;
  constexpr int kHeadDim = Tr::kHeadDim;
  // The plain calls' tile (bwd_plain) has their kernels only (no mask, no score mod).
  constexpr bool kPlainOnly = Tr::kBlockM != bwd_block_m(kHeadDim, false);
  const BwdScratch s = bwd_scratch(p, plan, kHeadDim);
  const int64_t rows = int64_t(p.batch) * p.heads * s.rows_pad;
  // The accumulator (unless the main kernel zeroes it: BwdPlan::zero_chunks), the counters,
  // the split items' region and deterministic mode's K / V bounds (all before lse2,
  // bwd_scratch): a memset writes at the memory's rate, which the preprocess's stores,
  // interleaved with its loads, did not reach.
  char* const begin = s.zero_chunks > 0 ? reinterpret_cast<char*>(s.next_item)
                                         : reinterpret_cast<char*>(s.dq);
  FLASH_CHECK_CUDA(
      cudaMemsetAsync(begin, 0, size_t(reinterpret_cast<char*>(s.lse2) - begin), stream));
  if (p.deterministic) {  // the K / V bounds of the dQ scales, before the preprocess
    const int chunks = (p.seqlen_k + kBwdBoundRows - 1) / kBwdBoundRows;
    const int64_t blocks = int64_t(chunks) * p.heads_k * p.batch;
    if (blocks > 0) {
      bwd_kv_bound_kernel<T, kHeadDim>
          <<<unsigned(blocks), kBwdPrepThreads, 0, stream>>>(p, s, chunks);
      FLASH_CHECK_LAUNCH();
    }
  }
  constexpr int kRowsPerStep = kBwdPrepThreads / bwd_prep_lanes<kHeadDim>();
  const int64_t prep_blocks = std::min<int64_t>((rows + kRowsPerStep - 1) / kRowsPerStep,
                                                int64_t(std::max(p.num_sms, 1)) * 16);
  auto prep = p.deterministic ? bwd_prep_kernel<T, kHeadDim, true>
                              : bwd_prep_kernel<T, kHeadDim, false>;
  prep<<<unsigned(prep_blocks), kBwdPrepThreads, 0, stream>>>(p, s);
  FLASH_CHECK_LAUNCH();

  // TMA views of the tensors (fa3_utils.h: tma_view).
  auto tensor = [&](auto* ptr, const Strides& st, int seqlen, int heads, int batches) {
    return tma_view(ptr, st, p.head_dim, seqlen, heads, batches);
  };
  const int rows_q = SeqInfo::view_rows_q(p), rows_k = SeqInfo::view_rows_k(p);
  const int batches = SeqInfo::view_batch(p), batches_k = SeqInfo::view_batch_k(p);
  auto q_view = take<0, 2>(typename Tr::SmemQ{});  // dO's tiles too (SmemdO: other stages)
  auto kv_view = typename Tr::SmemKV{};
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{},
                             tensor(static_cast<const Element*>(p.q), p.q_strides, rows_q,
                                    p.heads, batches), q_view);
  auto tma_do = make_tma_copy(SM90_TMA_LOAD{},
                              tensor(static_cast<const Element*>(p.dout), p.do_strides,
                                     rows_q, p.heads, batches), q_view);
  auto tma_k = make_tma_copy(SM90_TMA_LOAD{},
                             tensor(static_cast<const Element*>(p.k), p.k_strides, rows_k,
                                    p.heads_k, batches_k), kv_view);
  auto tma_v = make_tma_copy(SM90_TMA_LOAD{},
                             tensor(static_cast<const Element*>(p.v), p.v_strides, rows_k,
                                    p.heads_k, batches_k), kv_view);
  using Tma = BwdTma<decltype(tma_q), decltype(tma_do), decltype(tma_k), decltype(tma_v)>;
  const Tma tma{tma_q, tma_do, tma_k, tma_v};
  // Persistent where the plan says so (bwd_persistent's head dims); deterministic mode's
  // kernels add dQ in fixed point.
  constexpr bool kV = Tr::kVRegs, kP = bwd_persistent(kHeadDim);
  const bool mod = p.softcap > 0.f || p.alibi_slopes != nullptr, det = p.deterministic;
  if (plan.persistent != kP || (kPlainOnly && !bwd_plain(p))) {
    throw std::runtime_error("flash_attn: fa3 backward: the plan is not this head dim's");
  }
  auto kernel = det ? bwd_kernel<Tr, Tma, false, kV, kP, true>
                    : bwd_kernel<Tr, Tma, false, kV, kP, false>;
  if constexpr (!kPlainOnly) {
    if (mod) {
      kernel = det ? bwd_kernel<Tr, Tma, true, kV, kP, true>
                   : bwd_kernel<Tr, Tma, true, kV, kP, false>;
    }
  }
  FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Tr::kSmemBytes));
  if (plan.ctas > 0) {
    kernel<<<unsigned(plan.ctas), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, tma, s);
    FLASH_CHECK_LAUNCH();
  }
  const int64_t tiles = rows / Tr::kBlockM;
  const unsigned convert_blocks =
      unsigned(std::min<int64_t>(tiles, int64_t(std::max(p.num_sms, 1)) * 16));
  auto convert = p.deterministic ? bwd_convert_dq_kernel<Tr, true>
                                 : bwd_convert_dq_kernel<Tr, false>;
  convert<<<convert_blocks, kBwdPrepThreads, 0, stream>>>(p, s);
  FLASH_CHECK_LAUNCH();
}

template <typename T, int kHeadDim>
void run_bwd(const BwdParams& p, const BwdPlan& plan, cudaStream_t stream) {
  if (const char* error = plan_error(plan)) {
    throw std::runtime_error(std::string("flash_attn: fa3 backward: ") + error);
  }
  if (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes ||
      reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) {
    // 16-byte alignment: the dQ accumulator takes bulk reduce-adds.
    throw std::runtime_error("flash_attn: fa3 backward: the workspace must hold the plan's "
                             "workspace_bytes, 16-byte aligned");
  }
  constexpr int kM = bwd_block_m(kHeadDim, false), kPlainM = bwd_block_m(kHeadDim, true);
  if constexpr (kPlainM != kM) {
    using Plain = BwdTraits<T, kHeadDim, kPlainM>;
    if (plan.block_m == kPlainM) return run_bwd_tile<Plain>(p, plan, stream);
  }
  if (plan.block_m != kM) {
    throw std::runtime_error("flash_attn: fa3 backward: the plan is not this head dim's");
  }
  run_bwd_tile<BwdTraits<T, kHeadDim, kM>>(p, plan, stream);
}

}  // namespace flash::fa3
