// The FA3 backward's consumer steps at head dims 192 and 256 (the wide tile of
// fa3_bwd_traits.h; the kernel's diagram is in fa3_bwd_kernel.cuh). 64 keys a CTA; consumer c:
//   S^T, dP^T of the step's rows [32 c, 32 c + 32)   SS WGMMA (all 64 keys)
//   P^T, dS^T of those rows (fa3_bwd_mainloop.h's softmax_grad) into shared memory
//   dV[:, half c] += P^T dO[:, half c], dK[:, half c] += dS^T Q[:, half c]   SS WGMMA, all rows
//   dQ[:, half c] = dS K[:, half c]   two SS WGMMAs of a quarter of the head dim each
// and stages dQ for the writer in two handoffs: the first quarters (the staging's upper half)
// under the second GEMMs, the second quarters over P^T / dS^T once both consumers' GEMMs have
// read them (BwdEpilogue::write_dq).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/fragment.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/score_mod.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_mainloop.h"
#include "fa3/fa3_bwd_score.h"
#include "fa3/fa3_bwd_traits.h"
#include "fa3/fa3_plan.h"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

template <class Tr>
struct BwdWideConsumer {
  using Element = typename Tr::Element;
  using Mainloop = BwdMainloop<Tr>;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  static constexpr int kRows = Tr::kStRows, kCols = Tr::kKVCols;  // consumer c's part
  static_assert(Tr::kWide && kBlockN == 64 && Tr::kdQBuffers == 1);

  // Consumer cw: the steps (if any), summing dK and dV of its head-dim half into acc_dk /
  // acc_dv and handing each step's dQ tile to the dQ writer. The pipelines' states go on from
  // the CTA's previous item; kv_phase: kv_full's phase of this item.
  template <bool kScoreMod, bool kFixed, class StateQ, class StatedO, class Acc>
  static __device__ __forceinline__ void mma(const BwdParams& p, typename Tr::SharedStorage& shared,
                                             typename Tr::PipelineQ& pipe_q,
                                             typename Tr::PipelinedO& pipe_do, StateQ& state_q,
                                             StatedO& state_do, int kv_phase,
                                             const SeqInfo& seq,
                                             const Mask& mask, const BwdSteps<Tr>& steps,
                                             int n_block, int head_k, int cw, Acc& acc_dk,
                                             Acc& acc_dv) {
    static_assert(Tr::kKVSlots == 1);
    const typename Tr::Tiles t(shared, 0);
    const int wg_tid = threadIdx.x % 128;
    typename Tr::MmaSt mma_st;
    typename Tr::MmaKV mma_kv;
    typename Tr::MmadQ mma_dq;
    auto thr_st = mma_st.get_thread_slice(wg_tid);
    auto thr_kv = mma_kv.get_thread_slice(wg_tid);
    auto thr_dq = mma_dq.get_thread_slice(wg_tid);

    // S^T / dP^T: K / V by the consumer's rows of Q / dO.
    Tensor sQ_c = local_tile(t.q, Shape<Int<kRows>, Int<kHeadDim>, Int<Tr::kStagesQ>>{},
                             make_coord(cw, 0, 0));
    Tensor sdO_c = local_tile(t.dout, Shape<Int<kRows>, Int<kHeadDim>, Int<Tr::kStagesdO>>{},
                              make_coord(cw, 0, 0));
    Tensor tSrK = thr_st.partition_fragment_A(t.k);      // (MMA, M, K)
    Tensor tSrQ = thr_st.partition_fragment_B(sQ_c);    // (MMA, N, K, stage)
    Tensor tdPrV = thr_st.partition_fragment_A(t.v);
    Tensor tdPrdO = thr_st.partition_fragment_B(sdO_c);
    // dV / dK: P^T / dS^T (keys, rows) by the half's dO / Q seen as (head_dim, rows).
    Tensor sdOt_c = local_tile(t.doutt, Shape<Int<kCols>, Int<kBlockM>, Int<Tr::kStagesdO>>{},
                               make_coord(cw, 0, 0));
    Tensor sQt_c = local_tile(t.qt, Shape<Int<kCols>, Int<kBlockM>, Int<Tr::kStagesQ>>{},
                              make_coord(cw, 0, 0));
    Tensor tdVrP = thr_kv.partition_fragment_A(t.pt);
    Tensor tdVrdO = thr_kv.partition_fragment_B(sdOt_c);  // (MMA, N, K, stage)
    Tensor tdKrdS = thr_kv.partition_fragment_A(t.dst);
    Tensor tdKrQ = thr_kv.partition_fragment_B(sQt_c);
    // dQ: dS (rows, keys) by the quarters 2 cw, 2 cw + 1 of K seen as (head_dim, keys);
    // tdQrK's last mode is the quarter.
    Tensor tdQrdS = thr_dq.partition_fragment_A(t.ds);
    Tensor tdQrK = thr_dq.partition_fragment_B(
        local_tile(t.kt, Shape<Int<Tr::kdQCols>, Int<kBlockN>>{}, make_coord(_, 0)));
    // P^T / dS^T columns [32 cw, 32 cw + 32) from registers by stmatrix.
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_st);
    auto r2s_thr = r2s.get_thread_slice(wg_tid);
    Tensor tPsP = r2s_thr.partition_D(local_tile(t.pt, Shape<_64, Int<kRows>>{},
                                                 make_coord(0, cw)));
    Tensor tdSsdS = r2s_thr.partition_D(local_tile(t.dst, Shape<_64, Int<kRows>>{},
                                                   make_coord(0, cw)));

    // (key, row) of each S^T element, less (key0, rows0 + the step's first row).
    Tensor cS = thr_st.partition_C(make_identity_tensor(Shape<_64, Int<kRows>>{}));
    const int key0 = n_block * kBlockN, rows0 = kRows * cw;
    // The thread's first row of its dQ values (the others 8 rows on: to_fixed).
    const int dq_row0 = get<0>(thr_dq.partition_C(
        make_identity_tensor(typename Tr::ShapedQAcc{}))(0));
    const BwdScore score(p, mask);
    const bool varlen = p.cu_seqlens_q != nullptr;

    if (steps.count() == 0) return;  // dK = dV = 0
    Mainloop::wait_kv(shared, t, 0, kv_phase, varlen, n_block, mask.seqlen_k);
    #pragma unroll 1
    for (int hq = 0; hq < steps.heads_per_kv; ++hq) {
      const int head = head_k * steps.heads_per_kv + hq;
      ScoreMod mod;
      if constexpr (kScoreMod) mod = ScoreMod(p, seq, head);
      #pragma unroll 1
      for (int m = steps.m_begin; m < steps.m_end; ++m) {
        const int sq = state_q.index(), sdo = state_do.index();
        // Each step derives the k-blocks' descriptors again, next to their GEMMs, at the head
        // dim whose kernel loops over items (bwd_persistent), which would otherwise hoist them
        // out of it. At 192, with no item loop, it cost 0.8-1.6% (H200).
        if constexpr (bwd_persistent(Tr::kHeadDim)) {
          hide_desc_base(tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO, tdKrdS, tdKrQ, tdQrdS, tdQrK);
        }
        Tensor acc_s = partition_fragment_C(mma_st, Shape<_64, Int<kRows>>{});
        Tensor acc_dp = partition_fragment_C(mma_st, Shape<_64, Int<kRows>>{});
        Mainloop::wait_q(t, pipe_q, pipe_do, state_q, state_do, varlen, m, mask.seqlen_q);
        wgmma(mma_st, tSrK, tSrQ(_, _, _, sq), acc_s, true);
        pipe_do.consumer_wait(state_do);
        wgmma(mma_st, tdPrV, tdPrdO(_, _, _, sdo), acc_dp, true);
        Mainloop::template softmax_grad<kScoreMod>(
            score, mod, acc_s, acc_dp, cS, key0, m * kBlockM, rows0, shared.lse[sq],
            shared.dsum[sdo], score.masked<kRows>(key0, m * kBlockM + rows0));
        Tensor rP = flash::convert_fragment<Element>(acc_s);
        Tensor rdS = flash::convert_fragment<Element>(acc_dp);
        // P^T / dS^T overlay the staging's lower half: the writer has read the last step's.
        cutlass::arch::NamedBarrier::sync(kdQBarrierThreads, uint32_t(BwdBarrier::dQEmpty));
        copy(r2s, r2s_thr.retile_S(rP), tPsP);
        copy(r2s, r2s_thr.retile_S(rdS), tdSsdS);
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(256, uint32_t(BwdBarrier::dSFull));
        wgmma(mma_kv, tdVrP, tdVrdO(_, _, _, sdo), acc_dv, false);
        wgmma(mma_kv, tdKrdS, tdKrQ(_, _, _, sq), acc_dk, false);
        Tensor acc_dq0 = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<Tr::kdQCols>>{});
        wgmma(mma_dq, tdQrdS, tdQrK(_, _, _, 2 * cw), acc_dq0, true);
        warpgroup_wait<2>();  // dV
        pipe_do.consumer_release(state_do);
        warpgroup_wait<1>();  // dK
        // Deterministic mode: the thread's two rows' dQ scales (its values' rows r, r + 8),
        // read before Q's stage, which holds them, is released.
        float scale0 = 0.f, scale8 = 0.f;
        if constexpr (kFixed) {
          scale0 = shared.dq_scale[sq][dq_row0];
          scale8 = shared.dq_scale[sq][dq_row0 + 8];
          compiler_fence();  // the reads before the release (its asm has no memory clobber)
        }
        auto scale = [&](int dr, int) { return dr == 0 ? scale0 : scale8; };
        pipe_q.consumer_release(state_q);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dq0);
        Tensor acc_dq1 = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<Tr::kdQCols>>{});
        wgmma(mma_dq, tdQrdS, tdQrK(_, _, _, 2 * cw + 1), acc_dq1, true);
        // The upper half, clear of P^T / dS^T: free once the writer has read the last step's.
        if constexpr (kFixed) Mainloop::to_fixed(acc_dq0, 2 * cw, scale);
        cutlass::arch::NamedBarrier::sync(kdQBarrierThreads, uint32_t(BwdBarrier::dQEmpty) + 1);
        Mainloop::stage_dq(shared.dq(0), acc_dq0, 2 * cw);
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::arrive(kdQBarrierThreads, uint32_t(BwdBarrier::dQFull) + 1);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dq1);
        // Both consumers' GEMMs have read P^T / dS^T: the staging may overwrite them.
        if constexpr (kFixed) Mainloop::to_fixed(acc_dq1, 2 * cw + 1, scale);
        cutlass::arch::NamedBarrier::sync(256, uint32_t(BwdBarrier::dSFree));
        Mainloop::stage_dq(shared.dq(0), acc_dq1, 2 * cw + 1);
        cutlass::arch::fence_view_async_shared();  // before the writer's bulk read
        cutlass::arch::NamedBarrier::arrive(kdQBarrierThreads, uint32_t(BwdBarrier::dQFull));
        ++state_q;
        ++state_do;
      }
    }
  }
};

}  // namespace flash::fa3
