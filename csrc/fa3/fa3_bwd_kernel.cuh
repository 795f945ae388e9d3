// The FA3 backward kernel: a CTA an SM taking items (key tile, KV head, batch) in turn
// (fa3_bwd_items.h; at head dim 192 a CTA an item), three warpgroups:
//   warpgroup 0, the producer: one thread claims each item and loads its K and V once, then
//     each step's Q and dO tiles (TMA) with their rows' lse and D (bulk copies) into
//     pipelines that run on from item to item; its second warp, the dQ writer, adds each
//     step's staged dQ tile to the accumulator, which its last two warps zero meanwhile
//     (BwdPlan::zero_chunks);
//   warpgroups 1-2, the consumers, per step (kBlockM query rows of one head); at head dims up
//   to 128, 64 keys each:
//     S^T = K Q^T, dP^T = V dO^T           SS WGMMA
//     P^T = exp2(S^T scale - lse), dS^T = P^T o (dP^T - D)
//     dV += P^T dO, dK += dS^T Q           RS WGMMA, P^T / dS^T from registers
//     dS^T to shared memory; dQ[:, half c] = dS K[:, half c]   SS WGMMA (dQ^T at 96
//     rows a step, fa3_bwd_traits.h), staged in shared memory (two buffers) for the dQ
//     writer's bulk reduce-add
//   and at 192 / 256 half the rows of S^T / dP^T each and dK / dV of half the head dim, from
//   P^T / dS^T in shared memory (fa3_bwd_wide.h; fa3_bwd_traits.h says why);
//   and at the end write dK (times softmax_scale) and dV.
// The roles' code: fa3_bwd_mainloop.h (the producer's loads, the narrow tile's consumer
// steps and the pieces both tiles share), fa3_bwd_wide.h (the wide tile's consumer steps),
// fa3_bwd_epilogue.h (the dQ writer, the dK / dV stores).
// The steps walk every query head of the KV head's group, so dK / dV of a group are summed in
// registers. Dense or variable-length; causal, window, softcap and ALiBi (fa3_bwd_score.h);
// deterministic (below); no dropout.
//
// Deterministic mode (p.deterministic): the same kernel with dQ added in int32 fixed point
// (fa3_bwd_prep.cuh), whose sums do not depend on the order of the adds; each step's rows'
// scales come with Q. A split item's fp32 dK / dV adds do, so the plan splits none there.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/mask.h"
#include "common/params.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_epilogue.h"
#include "fa3/fa3_bwd_items.h"
#include "fa3/fa3_bwd_mainloop.h"
#include "fa3/fa3_bwd_prep.cuh"
#include "fa3/fa3_bwd_traits.h"
#include "fa3/fa3_bwd_wide.h"

namespace flash::fa3 {

// The Q or dO pipeline's parameters: the tiles are the same size, each with its rows' lse or D
// (and, extra_rows, the rows' dQ scales).
template <class Tr, class Pipeline>
__device__ __forceinline__ typename Pipeline::Params bwd_pipe_params(int wg, int extra_rows) {
  typename Pipeline::Params params;
  params.role = wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = 128 * Tr::kConsumers;
  params.transaction_bytes = Tr::kTmaBytesQ + (1 + extra_rows) * Tr::kRowBytes;
  return params;
}

// kScoreMod: softcap or ALiBi may be on (BwdMainloop::softmax_grad); kVRegs: the narrow
// tile's dP^T reads V from registers (BwdTraits::kVRegs); kPersistent: a CTA an SM taking
// items in turn (fa3_plan.h: bwd_persistent), else a CTA an item; kFixed: deterministic mode.
template <class Tr, class Tma, bool kScoreMod, bool kVRegs, bool kPersistent, bool kFixed>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ Tma tma,
               const BwdScratch s) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using PipelineQ = typename Tr::PipelineQ;
  using PipelinedO = typename Tr::PipelinedO;
  constexpr int kBlockN = Tr::kBlockN, kKVCols = Tr::kKVCols;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Tr::SharedStorage*>(smem_raw);
  using Items = BwdItems<Tr, kPersistent>;
  const int wg = cutlass::canonical_warp_group_idx();

  PipelineQ pipe_q(shared.pipe_q, bwd_pipe_params<Tr, PipelineQ>(wg, kFixed),
                   Shape<_1, _1, _1>{});
  PipelinedO pipe_do(shared.pipe_do, bwd_pipe_params<Tr, PipelinedO>(wg, 0), Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    for (int k = 0; k < Tr::kKVSlots; ++k) {
      cutlass::arch::ClusterTransactionBarrier::init(&shared.kv_full[k], 1);
      cutlass::arch::ClusterBarrier::init(&shared.kv_empty[k], 256 + 32);  // consumers, writer
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (threadIdx.x / 32 == 1) {
      BwdEpilogue<Tr>::template write_dq<kPersistent, kFixed>(p, s, shared);
      return;
    }
    if (threadIdx.x / 32 >= 2) {
      if (s.zero_chunks > 0) BwdEpilogue<Tr>::zero_dq(p, s);
      return;
    }
    if (threadIdx.x != 0) return;
    auto state_q = cutlass::make_producer_start_state<PipelineQ>();
    auto state_do = cutlass::make_producer_start_state<PipelinedO>();
    int item = Items::first();
    #pragma unroll 1
    for (int published = 0;; ++published) {
      Items::publish(shared, published, item < s.items ? item : -1);
      uint64_t* const kv_full = &shared.kv_full[Items::slot(published)];
      if (item >= s.items) {  // persistent only: a CTA an item has blockIdx.x < items
        cutlass::arch::ClusterBarrier::arrive(kv_full);
        break;
      }
      const BwdWork<Tr, kPersistent> w(p, s, item);
      if (w.steps.count() == 0) {
        cutlass::arch::ClusterBarrier::arrive(kv_full);  // dK = dV = 0, no loads
      } else {
        BwdMainloop<Tr>::template load<kFixed>(p, tma, s, shared, Items::slot(published),
                                               pipe_q, pipe_do, state_q, state_do, w.seq,
                                               w.steps, w.it.n_block, w.it.head_k, w.it.batch);
      }
      // A CTA of one item publishes no end: an arrive now would land in the item's own
      // phase of kv_full, before its bytes.
      if constexpr (!kPersistent) break;
      // Claimed only once this item's loads are issued, about two steps before the
      // consumers finish it: claimed earlier, a long item would hold back its successor from
      // CTAs that free up meanwhile.
      item = Items::next(s);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int cw = wg - 1;
  typename Tr::MmaKV mma_kv;
  Tensor acc_dk = partition_fragment_C(mma_kv, Shape<_64, Int<kKVCols>>{});
  Tensor acc_dv = partition_fragment_C(mma_kv, Shape<_64, Int<kKVCols>>{});
  // The store's thread index pinned (an empty asm; ptxas's choices, measured) in a persistent
  // CTA, or the store's coordinates are computed before the item loop and spilled across the
  // steps. Not in a CTA of one item (192): there the steps' masking went from predicated
  // instructions to 32 branches a step (one-item kernels at 96 -2..-4.5%, at 128 -1.3..0%).
  constexpr bool kPinTid = kPersistent;
  cutlass::PipelineState<Tr::kStagesQ> state_q;
  cutlass::PipelineState<Tr::kStagesdO> state_do;
  int buf = 0;  // the narrow tile's dQ staging buffer of the next step
  #pragma unroll 1
  for (int taken = 0;; ++taken) {
    const int item = Items::take(shared, taken);
    if (item < 0) break;
    const BwdWork<Tr, kPersistent> w(p, s, item);
    clear(acc_dk);
    clear(acc_dv);
    if constexpr (Tr::kWide) {  // all keys of the tile, head-dim half cw
      BwdWideConsumer<Tr>::template mma<kScoreMod, kFixed>(p, shared, pipe_q, pipe_do, state_q,
                                                           state_do, Items::phase(taken), w.seq,
                                                           w.mask, w.steps, w.it.n_block,
                                                           w.it.head_k, cw, acc_dk, acc_dv);
    } else {  // keys [64 cw, 64 cw + 64) of the tile, all the head dim
      BwdMainloop<Tr>::template mma<kScoreMod, kVRegs, kFixed>(
          p, shared, pipe_q, pipe_do, state_q, buf, Items::slot(taken), Items::phase(taken),
          w.seq, w.mask, w.steps, w.it.n_block, w.it.head_k, cw, acc_dk, acc_dv);
    }
    // The item again for the stores: kept through the steps, its coordinates spilled.
    const int current = Items::current(shared, taken, item);
    const BwdItem<Tr, kPersistent> done(p, s, current);
    const flash::SeqInfo done_seq(p, done.batch);
    Items::release(shared, taken);  // K and V read: a next item's may come in
    // A split item's part stores only if it is the item's last (the others' sums with its own).
    if constexpr (kPersistent) {
      if (done.parts > 1 &&
          !BwdEpilogue<Tr>::add_split_part(s, current, cw, acc_dk, acc_dv)) {
        continue;
      }
    }
    const int key0 = done.n_block * kBlockN + (Tr::kWide ? 0 : 64 * cw);
    const int col0 = Tr::kWide ? kKVCols * cw : 0;
    BwdEpilogue<Tr>::template store_dkdv<kPinTid>(p, done_seq, done.head_k, key0, col0,
                                                  acc_dk, acc_dv);
  }
  // The dQ writer's arrives for the steps after the CTA's last (BwdEpilogue::write_dq).
  for (int h = 0; h < Tr::kdQHandoffs; ++h) {
    cutlass::arch::NamedBarrier::sync(kdQBarrierThreads, uint32_t(BwdBarrier::dQEmpty) + h);
  }
#endif
}

}  // namespace flash::fa3
