// The FA3 backward's walk (fa3_bwd_kernel.cuh) over the query tiles that see the CTA's keys:
// the producer thread's loads of K / V and of each step's Q, dO, lse and D; the narrow tile's
// consumer steps (S^T, dP^T, P^T, dS^T, dV, dK, dQ staged for the dQ writer,
// fa3_bwd_epilogue.h); and the pieces the wide tile's steps (fa3_bwd_wide.h) share with them.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/fragment.h"
#include "common/mask.h"
#include "common/mma.cuh"
#include "common/params.h"
#include "common/query_tiles.h"
#include "common/score_mod.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_items.h"
#include "fa3/fa3_bwd_prep.cuh"
#include "fa3/fa3_bwd_score.h"
#include "fa3/fa3_bwd_traits.h"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

// Rows [from, rows) of a (rows, kHeadDim) shared-memory tile set to 0 by the 256 consumer
// threads: a variable-length sequence's tile runs into the next sequence's rows, or into rows
// past seqused that may hold anything (NaN times a zero P is NaN).
template <class Tensor>
__device__ __forceinline__ void zero_tail_rows(Tensor&& t, int from, int tid) {
  constexpr int kCols = decltype(size<1>(t))::value, kRows = decltype(size<0>(t))::value;
  using Element = typename std::decay_t<Tensor>::value_type;
  for (int i = max(from, 0) * kCols + tid; i < kRows * kCols; i += 256) {
    t(i / kCols, i % kCols) = Element(0.f);
  }
}

template <class Tr>
struct BwdMainloop {
  using Element = typename Tr::Element;
  using PipelineQ = typename Tr::PipelineQ;
  using PipelinedO = typename Tr::PipelinedO;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;

  // The producer thread, for one item with steps: K and V of key tile n_block into item slot
  // `slot` (completing its kv_full phase), then the steps' tiles, the pipelines' states going
  // on from the CTA's previous item. kFixed (deterministic mode): the rows' dQ scales with Q.
  template <bool kFixed, class Tma, class StateQ, class StatedO>
  static __device__ __forceinline__ void load(const BwdParams& p, const Tma& tma,
                                              const BwdScratch& s,
                                              typename Tr::SharedStorage& shared, int slot,
                                              PipelineQ& pipe_q, PipelinedO& pipe_do,
                                              StateQ& state_q, StatedO& state_do,
                                              const SeqInfo& seq, const BwdSteps<Tr>& steps,
                                              int n_block, int head_k, int batch) {
    const typename Tr::Tiles t(shared, slot);
    const int64_t rows_q = s.rows_pad;
    const int batches = SeqInfo::view_batch(p), batches_k = SeqInfo::view_batch_k(p);
    Tensor mQ = tma.q.get_tma_tensor(
        make_shape(SeqInfo::view_rows_q(p), p.head_dim, p.heads, batches));
    Tensor mdO = tma.dout.get_tma_tensor(
        make_shape(SeqInfo::view_rows_q(p), p.head_dim, p.heads, batches));
    Tensor mK = tma.k.get_tma_tensor(
        make_shape(SeqInfo::view_rows_k(p), p.head_dim, p.heads_k, batches_k));
    Tensor mV = tma.v.get_tma_tensor(
        make_shape(SeqInfo::view_rows_k(p), p.head_dim, p.heads_k, batches_k));
    Tensor gK = local_tile(seq.k_rows(p, mK, head_k), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(n_block, 0));
    Tensor gV = local_tile(seq.k_rows(p, mV, head_k), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(n_block, 0));
    auto [tKg, tKs] = tma_partition(tma.k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(t.k),
                                    group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(tma.v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(t.v),
                                    group_modes<0, 2>(gV));
    uint64_t* const kv_full = &shared.kv_full[slot];
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(kv_full, 2 * Tr::kTmaBytesKV);
    copy(tma.k.with(*kv_full), tKg, tKs);
    copy(tma.v.with(*kv_full), tVg, tVs);
    #pragma unroll 1
    for (int hq = 0; hq < steps.heads_per_kv; ++hq) {
      const int head = head_k * steps.heads_per_kv + hq;
      Tensor gQ = local_tile(seq.q_rows(p, mQ, head), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(_, 0));
      Tensor gdO = local_tile(seq.q_rows(p, mdO, head), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                              make_coord(_, 0));
      auto [tQg, tQs] = tma_partition(tma.q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(t.q),
                                      group_modes<0, 2>(gQ));
      auto [tdOg, tdOs] = tma_partition(tma.dout, Int<0>{}, Layout<_1>{},
                                        group_modes<0, 2>(t.dout), group_modes<0, 2>(gdO));
      const int64_t row0 = (int64_t(batch) * p.heads + head) * rows_q;
      #pragma unroll 1
      for (int m = steps.m_begin; m < steps.m_end; ++m) {
        pipe_q.producer_acquire(state_q);
        uint64_t* bar_q = pipe_q.producer_get_barrier(state_q);
        copy(tma.q.with(*bar_q), tQg(_, m), tQs(_, state_q.index()));
        bulk_copy(shared.lse[state_q.index()], s.lse2 + row0 + m * kBlockM, Tr::kRowBytes,
                  bar_q);
        if constexpr (kFixed) {
          bulk_copy(shared.dq_scale[state_q.index()], s.dq_scale + row0 + m * kBlockM,
                    Tr::kRowBytes, bar_q);
        }
        pipe_do.producer_acquire(state_do);
        uint64_t* bar_do = pipe_do.producer_get_barrier(state_do);
        copy(tma.dout.with(*bar_do), tdOg(_, m), tdOs(_, state_do.index()));
        bulk_copy(shared.dsum[state_do.index()], s.dsum + row0 + m * kBlockM, Tr::kRowBytes,
                  bar_do);
        ++state_q;
        ++state_do;
      }
    }
  }

  // P^T into acc_s and dS^T into acc_dp, element by element, as the S^T and dP^T GEMMs (the
  // last two issued) complete; cS: the (key, row) of each element, less (key0, row0 - rows0);
  // lse / dsum: the step's rows from rows0. kScoreMod: softcap or ALiBi may be on (uniform
  // runtime tests); P and dS then come in one pass after both GEMMs, so no fragment of tanh
  // values stays live.
  template <bool kScoreMod, class Frag, class Coord>
  static __device__ __forceinline__ void softmax_grad(const BwdScore& score, const ScoreMod& mod,
                                                      Frag& acc_s, Frag& acc_dp, const Coord& cS,
                                                      int key0, int row0, int rows0,
                                                      const float* lse, const float* dsum,
                                                      bool masked) {
    if constexpr (!kScoreMod) {
      // P while dP's GEMM runs, then dS.
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_s);  // no read of S above the wait
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        const int r = rows0 + get<1>(cS(i));
        acc_s(i) = score.prob(acc_s(i), key0 + get<0>(cS(i)), row0 + r, lse[r], masked);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dp);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dp); ++i) {
        acc_dp(i) = acc_s(i) * (acc_dp(i) - dsum[rows0 + get<1>(cS(i))]);
      }
    } else {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        const int r = rows0 + get<1>(cS(i));
        float dtanh;
        const float pv = score.prob(acc_s(i), key0 + get<0>(cS(i)), row0 + r, lse[r], masked,
                                    mod, dtanh);
        acc_s(i) = pv;
        acc_dp(i) = pv * (acc_dp(i) - dsum[r]) * dtanh;
      }
    }
  }

  // The consumers' wait for the item's K and V in slot `slot` (phase: the slot's items before
  // it, BwdItems). Dense tiles read zeros past the sequence (TMA fills rows out of bounds);
  // variable-length ones read other rows, which the consumers zero in shared memory.
  static __device__ __forceinline__ void wait_kv(typename Tr::SharedStorage& shared,
                                                 const typename Tr::Tiles& t, int slot,
                                                 int phase, bool varlen, int n_block,
                                                 int seqlen_k) {
    cutlass::arch::ClusterTransactionBarrier::wait(&shared.kv_full[slot], phase);
    if (varlen && (n_block + 1) * kBlockN > seqlen_k) {
      const int tid = threadIdx.x - 128;
      zero_tail_rows(t.k, seqlen_k - n_block * kBlockN, tid);
      zero_tail_rows(t.v, seqlen_k - n_block * kBlockN, tid);
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(256, uint32_t(BwdBarrier::Tails));
    }
  }
  // The wait for step m's Q; a variable-length last tile waits for dO too and zeroes both
  // past seqlen_q.
  template <class StateQ, class StatedO>
  static __device__ __forceinline__ void wait_q(const typename Tr::Tiles& t, PipelineQ& pipe_q,
                                                PipelinedO& pipe_do, const StateQ& state_q,
                                                const StatedO& state_do, bool varlen, int m,
                                                int seqlen_q) {
    pipe_q.consumer_wait(state_q);
    if (varlen && (m + 1) * kBlockM > seqlen_q) {
      const int tid = threadIdx.x - 128;
      pipe_do.consumer_wait(state_do);
      zero_tail_rows(t.q(_, _, state_q.index()), seqlen_q - m * kBlockM, tid);
      zero_tail_rows(t.dout(_, _, state_do.index()), seqlen_q - m * kBlockM, tid);
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(256, uint32_t(BwdBarrier::Tails));
    }
  }

  // Deterministic mode: dQ part `part`'s values times their rows' fixed-point scales
  // (fa3_bwd_prep.cuh), rounded to int32s, in place (their bits); scale(dr): the scale of the
  // row dr rows past the thread's first.
  template <class Acc, class Scale>
  static __device__ __forceinline__ void to_fixed(Acc& acc_dq, int part, const Scale& scale) {
    typename Tr::MmadQ mma_dq;
    Tensor cdQ = mma_dq.get_thread_slice(threadIdx.x % 128)
                     .partition_C(make_identity_tensor(typename Tr::ShapedQAcc{}));
    auto row = [&](int i) {  // of value i in the tile (dQ^T: its column)
      return Tr::kdQT ? Tr::dq_part_row0(part) + get<1>(cdQ(i)) : get<0>(cdQ(i));
    };
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); ++i) {
      acc_dq(i) = __int_as_float(__float2int_rn(acc_dq(i) * scale(row(i) - row(0), row(i))));
    }
  }

  // Column block `part` of a step's dQ tile into a staging buffer, in the accumulator's order
  // (Tr::dq_slot), which the global accumulator keeps (the conversion, fa3_bwd_prep.cuh,
  // undoes it): one bulk add of the whole tile, by the dQ writer. The caller fences the
  // stores for the writer's bulk read (fence_view_async_shared) once, after all its parts.
  template <class Acc>
  static __device__ __forceinline__ void stage_dq(float* buffer, const Acc& acc_dq, int part) {
    static_assert(decltype(size(acc_dq))::value == 4 * Tr::kdQPartVecs);
    float4* dq_s = reinterpret_cast<float4*>(buffer) + Tr::dq_slot(part) * Tr::kdQPartVecs * 128;
    CUTE_UNROLL
    for (int j = 0; j < Tr::kdQPartVecs; ++j) {
      dq_s[j * 128 + threadIdx.x % 128] =
          make_float4(acc_dq(4 * j), acc_dq(4 * j + 1), acc_dq(4 * j + 2), acc_dq(4 * j + 3));
    }
  }

  // Consumer cw (keys [64 cw, 64 cw + 64) of the tile): the steps (if any), summing dK and
  // dV into acc_dk / acc_dv and handing each step's dQ tile to the dQ writer in staging
  // buffer buf, 1 - buf, ... The pipelines' state and buf go on from the CTA's previous item;
  // slot, kv_phase: the item's K / V slot and its kv_full phase (BwdItems). kVRegs: dP^T's V
  // from registers (Tr::kVRegs); kFixed: deterministic mode's fixed-point dQ (to_fixed).
  // The wait for K and V comes after the steps' setup: waited for before it (when the item
  // is taken), the setup's descriptors left uniform registers and spilled in the steps.
  template <bool kScoreMod, bool kVRegs, bool kFixed, class State, class Acc>
  static __device__ __forceinline__ void mma(const BwdParams& p, typename Tr::SharedStorage& shared,
                                             PipelineQ& pipe_q, PipelinedO& pipe_do,
                                             State& state, int& buf, int slot, int kv_phase,
                                             const SeqInfo& seq,
                                             const Mask& mask, const BwdSteps<Tr>& steps,
                                             int n_block, int head_k, int cw, Acc& acc_dk,
                                             Acc& acc_dv) {
    const int seqlen_q = mask.seqlen_q, seqlen_k = mask.seqlen_k;
    const typename Tr::Tiles t(shared, slot);
    const int wg_tid = threadIdx.x % 128;
    static_assert(!kVRegs || Tr::kVRegs);
    typename Tr::MmaSt mma_st;
    std::conditional_t<kVRegs, typename Tr::MmaStRS, typename Tr::MmaSt> mma_dp;  // dP^T's
    typename Tr::MmaKV mma_kv;
    typename Tr::MmadQ mma_dq;
    auto thr_st = mma_st.get_thread_slice(wg_tid);
    auto thr_dp = mma_dp.get_thread_slice(wg_tid);
    auto thr_kv = mma_kv.get_thread_slice(wg_tid);
    auto thr_dq = mma_dq.get_thread_slice(wg_tid);

    Tensor sK_wg = local_tile(t.k, Shape<_64, Int<kHeadDim>>{}, make_coord(cw, 0));
    Tensor sV_wg = local_tile(t.v, Shape<_64, Int<kHeadDim>>{}, make_coord(cw, 0));
    Tensor tSrK = thr_st.partition_fragment_A(sK_wg);    // (MMA, M, K)
    Tensor tSrQ = thr_st.partition_fragment_B(t.q);       // (MMA, N, K, stage)
    Tensor tdPrV = thr_dp.partition_fragment_A(sV_wg);   // registers if kVRegs
    Tensor tdPrdO = thr_dp.partition_fragment_B(t.dout);
    Tensor tdVrdO = thr_kv.partition_fragment_B(t.doutt);   // (MMA, N, K, stage)
    Tensor tdKrQ = thr_kv.partition_fragment_B(t.qt);
    // K^T's columns and dS's rows of this consumer's dQ part: half the columns, all rows; all
    // columns, half the rows with Tr::kdQT.
    constexpr bool kT = Tr::kdQT;
    Tensor sKt_c = local_tile(t.kt, Shape<Int<kT ? kHeadDim : Tr::kdQCols>, Int<kBlockN>>{},
                              make_coord(kT ? 0 : cw, 0));
    Tensor sdS_c = local_tile(t.ds, Shape<Int<kT ? kBlockM / 2 : kBlockM>, Int<kBlockN>>{},
                              make_coord(kT ? cw : 0, 0));
    // dQ = dS K: dS the A operand, K^T's part the B one; dQ^T = K^T dS^T: the other way.
    Tensor tdQrA = thr_dq.partition_fragment_A([&] {
      if constexpr (kT) return sKt_c; else return sdS_c;
    }());
    Tensor tdQrB = thr_dq.partition_fragment_B([&] {
      if constexpr (kT) return sdS_c; else return sKt_c;
    }());
    Tensor sdSt_wg = local_tile(t.dst, Shape<_64, Int<kBlockM>>{}, make_coord(cw, 0));
    // dS^T from registers by stmatrix (four 8 x 8 blocks an instruction).
    auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_st);
    auto r2s_thr = r2s_ds.get_thread_slice(wg_tid);
    Tensor tdSsdS = r2s_thr.partition_D(sdSt_wg);

    Tensor cS = thr_st.partition_C(make_identity_tensor(Shape<_64, Int<kBlockM>>{}));  // (key, row)
    const int key0 = n_block * kBlockN + 64 * cw;
    const BwdScore score(p, mask);
    const bool varlen = p.cu_seqlens_q != nullptr;

    if (steps.count() == 0) return;  // dK = dV = 0
    wait_kv(shared, t, slot, kv_phase, varlen, n_block, seqlen_k);
    if constexpr (kVRegs) {  // V into registers, once
      auto s2r = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_dp);
      auto s2r_thr = s2r.get_thread_slice(wg_tid);
      copy(s2r, s2r_thr.partition_S(sV_wg), s2r_thr.retile_D(tdPrV));
    }
    static_assert(Tr::kStagesQ == Tr::kStagesdO);  // one state for both pipelines
    #pragma unroll 1
    for (int hq = 0; hq < steps.heads_per_kv; ++hq) {
      const int head = head_k * steps.heads_per_kv + hq;
      ScoreMod mod;
      if constexpr (kScoreMod) mod = ScoreMod(p, seq, head);
      #pragma unroll 1
      for (int m = steps.m_begin; m < steps.m_end; ++m) {
        const int stage = state.index();
        // Each step derives the k-blocks' descriptors again, next to their GEMMs: the
        // persistent kernels' item loop would hoist them (fa3_utils.h); in the kernels of one
        // item it measured level (128) or better (96 +1.3..+2%, H200).
        hide_desc_base(tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ, tdQrA, tdQrB);
        Tensor acc_s = partition_fragment_C(mma_st, Shape<_64, Int<kBlockM>>{});
        Tensor acc_dp = partition_fragment_C(mma_st, Shape<_64, Int<kBlockM>>{});
        wait_q(t, pipe_q, pipe_do, state, state, varlen, m, seqlen_q);
        wgmma(mma_st, tSrK, tSrQ(_, _, _, stage), acc_s, true);
        pipe_do.consumer_wait(state);
        wgmma(mma_dp, tdPrV, tdPrdO(_, _, _, stage), acc_dp, true);
        softmax_grad<kScoreMod>(score, mod, acc_s, acc_dp, cS, key0, m * kBlockM, 0,
                                shared.lse[stage], shared.dsum[stage],
                                score.masked<kBlockM>(key0, m * kBlockM));
        // dV's GEMM under dS^T's store; then dQ before dK, so that dQ's staging below runs
        // under dK's GEMM (WGMMA groups complete in order).
        Tensor rP = flash::convert_fragment<Element>(acc_s);
        Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
        wgmma(mma_kv, tdVrP, tdVrdO(_, _, _, stage), acc_dv, false);
        Tensor rdS = flash::convert_fragment<Element>(acc_dp);
        // dS^T into shared memory once both consumers' last dQ GEMMs have read it.
        cutlass::arch::NamedBarrier::sync(256, uint32_t(BwdBarrier::dSFree));
        copy(r2s_ds, r2s_thr.retile_S(rdS), tdSsdS);
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(256, uint32_t(BwdBarrier::dSFull));
        Tensor acc_dq = partition_fragment_C(mma_dq, typename Tr::ShapedQAcc{});
        wgmma(mma_dq, tdQrA, tdQrB, acc_dq, true);
        Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(rdS.layout()));
        wgmma(mma_kv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk, false);
        warpgroup_wait<1>();  // dV and dQ
        // rP is read by dV's WGMMA until this wait: its registers must not be reused before
        // it (the compiler does not know the asynchronous reads); likewise rdS below.
        warpgroup_fence_operand(rP);
        warpgroup_fence_operand(acc_dq);
        pipe_do.consumer_release(state);
        // This step's dQ into buffer buf once the writer has read what it held.
        if constexpr (kFixed) {
          const float* scale = shared.dq_scale[stage];  // Q's stage: not yet released
          to_fixed(acc_dq, cw, [&](int, int r) { return scale[r]; });
        }
        cutlass::arch::NamedBarrier::sync(kdQBarrierThreads, uint32_t(BwdBarrier::dQEmpty) + buf);
        stage_dq(shared.dq(buf), acc_dq, cw);
        cutlass::arch::fence_view_async_shared();  // before the writer's bulk read
        cutlass::arch::NamedBarrier::arrive(kdQBarrierThreads, uint32_t(BwdBarrier::dQFull) + buf);
        buf ^= 1;
        warpgroup_wait<0>();  // dK
        warpgroup_fence_operand(rdS);
        pipe_q.consumer_release(state);
        ++state;
      }
    }

  }
};

}  // namespace flash::fa3
