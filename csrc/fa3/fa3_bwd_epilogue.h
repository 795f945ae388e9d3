// The FA3 backward's gradients out (fa3_bwd_kernel.cuh): the dQ writer warp's bulk reduce-adds
// of the consumers' staged dQ tiles into the accumulator (fp32, or int32 fixed point in
// deterministic mode: fa3_bwd_prep.cuh), and the consumers' dK / dV stores.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/mask.h"
#include "common/mma.cuh"
#include "common/params.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_items.h"
#include "fa3/fa3_bwd_prep.cuh"
#include "fa3/fa3_bwd_traits.h"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

// `bytes` of a staged dQ tile added into the accumulator at dst, one bulk group: fp32, or
// kFixed (deterministic mode) the int32 fixed point the consumers staged (BwdMainloop::to_fixed).
template <bool kFixed>
__device__ __forceinline__ void add_dq(float* dst, const float* src, int bytes) {
  if constexpr (kFixed) {
    bulk_reduce_add_s32(reinterpret_cast<int*>(dst), reinterpret_cast<const int*>(src), bytes);
  } else {
    bulk_reduce_add(dst, src, bytes);
  }
}

template <class Tr>
struct BwdEpilogue {
  static constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;

  // The dQ writer (the producer warpgroup's second warp): the steps' tiles of the CTA's items
  // (BwdItems). Narrow tile: from buffers 0, 1, 0, ...; buffer b is free for the consumers'
  // step i once the add of step i - 2 has read it. Wide tile: its one buffer in two halves,
  // the upper one (the first dQ GEMMs' parts) added as soon as it is staged, under the
  // consumers' last GEMMs, the lower one over P^T / dS^T once they are read: the next step's
  // P^T / dS^T wait for half a tile's read, not a whole one's. All free at the start; the
  // arrives past the last step are the consumers' to match (bwd_kernel).
  template <bool kPersistent, bool kFixed>
  static __device__ __forceinline__ void write_dq(const BwdParams& p, const BwdScratch& s,
                                                  typename Tr::SharedStorage& shared) {
    using cutlass::arch::NamedBarrier;
    constexpr uint32_t kFull = uint32_t(BwdBarrier::dQFull);
    constexpr uint32_t kEmpty = uint32_t(BwdBarrier::dQEmpty);
    const int64_t rows_q = s.rows_pad;
    const bool leader = threadIdx.x == 32;
    for (int h = 0; h < Tr::kdQHandoffs; ++h) NamedBarrier::arrive(kdQBarrierThreads, kEmpty + h);
    int b = 0;
    bool zeroed = false;  // the whole accumulator seen zeroed (wait_zeroed): no more waits
    #pragma unroll 1
    for (int taken = 0;; ++taken) {
      using Items = BwdItems<Tr, kPersistent>;
      const int item = Items::take(shared, taken);
      Items::release(shared, taken);  // the writer reads nothing else of the slot or K / V
      if (item < 0) break;
      const BwdWork<Tr, kPersistent> w(p, s, item);
      if (w.steps.count() == 0) continue;
      if (s.zero_chunks > 0 && !zeroed) {  // the pair's accumulator zeroed, before the adds
        int all = 0;
        if (leader) all = wait_zeroed(p, s, w.it.batch * p.heads_k + w.it.head_k);
        zeroed = __shfl_sync(0xffffffffu, all, 0) != 0;
      }
      // The scratch row of the group's first head, then of each next one.
      int64_t head_row =
          (int64_t(w.it.batch) * p.heads + w.it.head_k * w.steps.heads_per_kv) * rows_q;
      #pragma unroll 1
      for (int hq = 0; hq < w.steps.heads_per_kv; ++hq, head_row += rows_q) {
        #pragma unroll 1
        for (int m = w.steps.m_begin; m < w.steps.m_end; ++m) {
          float* const dst = s.dq + (head_row + m * kBlockM) * kHeadDim;
          if constexpr (Tr::kWide) {
            constexpr int kHalf = Tr::kdQBytes / 2;
            const float* tile = shared.dq(0);
            NamedBarrier::sync(kdQBarrierThreads, kFull + 1);
            if (leader) add_dq<kFixed>(dst + kHalf / 4, tile + kHalf / 4, kHalf);
            __syncwarp();
            NamedBarrier::sync(kdQBarrierThreads, kFull);
            if (leader) {
              add_dq<kFixed>(dst, tile, kHalf);
              bulk_wait_read<1>();
            }
            __syncwarp();
            NamedBarrier::arrive(kdQBarrierThreads, kEmpty + 1);
            if (leader) bulk_wait_read<0>();
            __syncwarp();  // converged at the next named barrier (bar.sync is .aligned)
            NamedBarrier::arrive(kdQBarrierThreads, kEmpty);
          } else {
            NamedBarrier::sync(kdQBarrierThreads, kFull + b);
            if (leader) {
              add_dq<kFixed>(dst, shared.dq(b), Tr::kdQBytes);
              bulk_wait_read();
            }
            __syncwarp();
            NamedBarrier::arrive(kdQBarrierThreads, kEmpty + b);
            b ^= 1;
          }
        }
      }
    }
    if (leader) bulk_wait_complete();  // done before the CTA's shared memory goes
  }

  // The dQ writer's wait for pair `pair`'s accumulator (zero_dq), then a proxy fence: the
  // zeroes (generic proxy) before its bulk adds. Returns whether every pair's was zeroed, after
  // which the writer waits no more (one fence covers them all).
  static __device__ __forceinline__ bool wait_zeroed(const BwdParams& p, const BwdScratch& s,
                                                     int pair) {
    const bool all = ld_acquire_gpu(s.zero_all) >= zero_total(p, s);
    if (!all) {
      while (ld_acquire_gpu(s.zero_done + pair) < unsigned(s.zero_chunks)) __nanosleep(64);
    }
    fence_proxy_async_global();
    return all;
  }

  // The accumulator's chunks in all (below 2^31: bwd_zero_chunks).
  static __device__ __forceinline__ unsigned zero_total(const BwdParams& p, const BwdScratch& s) {
    return unsigned(p.batch * p.heads_k) * unsigned(s.zero_chunks);
  }

  // The producer warpgroup's warps 2-3, otherwise idle, with BwdPlan::zero_chunks: the dQ
  // accumulator zeroed chunk by chunk, each warp taking chunks from s.zero_next in order (the
  // first pairs' first: the pairs of the first items) and counting each done in its pair's
  // s.zero_done and in s.zero_all (the stores, a fence, release adds; write_dq acquires the
  // counts: wait_zeroed). Every CTA's warps take chunks until none is left, so the zeroing
  // finishes whichever CTAs are resident: a writer never waits on a CTA that has not started.
  static __device__ __forceinline__ void zero_dq(const BwdParams& p, const BwdScratch& s) {
    const int lane = threadIdx.x % 32;
    const unsigned chunks = unsigned(s.zero_chunks), total = zero_total(p, s);
    const int64_t pair_vecs = int64_t(p.heads / p.heads_k) * s.rows_pad * (kHeadDim / 4);
    float4* const dq = reinterpret_cast<float4*>(s.dq);
    #pragma unroll 1
    for (;;) {
      unsigned c = 0;
      if (lane == 0) c = atomicAdd(s.zero_next, 1u);
      c = __shfl_sync(0xffffffffu, c, 0);
      if (c >= total) break;
      const unsigned pair = c / chunks, part = c % chunks;
      float4* const chunk = dq + int64_t(pair) * pair_vecs;
      const int64_t end = (part + 1) * pair_vecs / chunks;
      #pragma unroll 4
      for (int64_t i = part * pair_vecs / chunks + lane; i < end; i += 32) {
        chunk[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      __threadfence();
      __syncwarp();
      if (lane == 0) {
        red_release_gpu_add(s.zero_done + pair, 1u);
        red_release_gpu_add(s.zero_all, 1u);
      }
    }
  }

  // A split item's part (BwdPlan::split_items; item: the part's), consumer cw: its dK / dV added
  // into the split item's fp32 sums, in the accumulators' order. Returns whether this part was
  // the item's last to add; its acc_dk / acc_dv then hold the sums, for store_dkdv. The adds,
  // a fence and the barrier come before thread 128 counts the part, so the last count sees
  // every part's adds (the CUDA guide's last-block pattern).
  template <class Acc>
  static __device__ __forceinline__ bool add_split_part(const BwdScratch& s, int item, int cw,
                                                        Acc& acc_dk, Acc& acc_dv) {
    constexpr int kVecs = decltype(size(acc_dk))::value / 4;  // a thread's float4s of dK (of dV)
    const int index = (item - s.split_first) / s.split_parts;  // the split item's
    float4* const sums = reinterpret_cast<float4*>(s.split_acc) +
                         (int64_t(index) * 2 + cw) * 2 * kVecs * 128 + threadIdx.x % 128;
    CUTE_UNROLL
    for (int j = 0; j < kVecs; ++j) {
      red_add_v4(&sums[j * 128].x, acc_dk(4 * j), acc_dk(4 * j + 1), acc_dk(4 * j + 2),
                 acc_dk(4 * j + 3));
      red_add_v4(&sums[(kVecs + j) * 128].x, acc_dv(4 * j), acc_dv(4 * j + 1),
                 acc_dv(4 * j + 2), acc_dv(4 * j + 3));
    }
    __threadfence();
    cutlass::arch::NamedBarrier::sync(256, uint32_t(BwdBarrier::Parts));
    bool last = false;
    if (threadIdx.x == 128) {
      last = atomicAdd(s.split_count + index, 1u) == unsigned(s.split_parts - 1);
    }
    __syncwarp();  // converged at the barrier (bar.red is .aligned)
    // The OR is the same in every thread; the shuffle tells the compiler so. Without it the
    // consumers' item loop counts as divergent after the caller's branch on it, and the steps'
    // descriptors, barrier addresses and masks left the uniform registers (-8% a step at 128).
    last = barrier_or(256, uint32_t(BwdBarrier::Parts), last);
    if (!__shfl_sync(0xffffffffu, int(last), 0)) return false;
    __threadfence();
    CUTE_UNROLL
    for (int j = 0; j < kVecs; ++j) {
      const float4 k = __ldcg(sums + j * 128), v = __ldcg(sums + (kVecs + j) * 128);
      acc_dk(4 * j) = k.x, acc_dk(4 * j + 1) = k.y, acc_dk(4 * j + 2) = k.z;
      acc_dk(4 * j + 3) = k.w;
      acc_dv(4 * j) = v.x, acc_dv(4 * j + 1) = v.y, acc_dv(4 * j + 2) = v.z;
      acc_dv(4 * j + 3) = v.w;
    }
    return true;
  }

  // dK (times softmax_scale) and dV of a consumer's 64 keys from key0 and kKVCols columns
  // from col0, below the sequence's rows and head_dim, in 16 bits: transposed within quads so
  // that each lane holds 8 adjacent columns of a block (pack_quad_block), written with 16-byte
  // stores, as the forward's register store writes O (head_dim and the strides are multiples
  // of 8, flash_api.cpp). With 4-byte stores the store took 11% of head dim 128's backward at 1k
  // tokens (H200). kPinTid: the thread index pinned (bwd_kernel says where).
  template <bool kPinTid, class Acc>
  static __device__ __forceinline__ void store_dkdv(const BwdParams& p, const SeqInfo& seq,
                                                    int head_k, int key0, int col0,
                                                    const Acc& acc_dk, const Acc& acc_dv) {
    int tid = threadIdx.x % 128;
    if constexpr (kPinTid) asm volatile("" : "+r"(tid));
    const int quad = tid % 4;
    typename Tr::MmaKV mma_kv;
    Tensor cKV = mma_kv.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<_64, Int<Tr::kKVCols>>{}));
    Tensor cKV_rc = make_tensor(cKV.data(), rowcol(cKV.layout()));
    Tensor dk_rc = make_tensor(acc_dk.data(), rowcol(acc_dk.layout()));
    Tensor dv_rc = make_tensor(acc_dv.data(), rowcol(acc_dv.layout()));
    static_assert(decltype(size<0>(dk_rc))::value == 2);  // a thread's rows r and r + 8
    using Raw = typename Tr::Raw;
    Raw* dk = static_cast<Raw*>(p.dk) + seq.dk_offset(p, head_k) + col0 + 8 * quad;
    Raw* dv = static_cast<Raw*>(p.dv) + seq.dv_offset(p, head_k) + col0 + 8 * quad;
    const int rows = seq.rows_k(p);  // read once: the stores may alias it for the compiler
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      const int key = key0 + get<0>(cKV_rc(mi, 0));
      CUTE_UNROLL
      for (int g = 0; g < Tr::kKVCols / 32; ++g) {  // groups of four 8-column blocks
        uint32_t wk[4], wv[4];  // [j]: lane j's column pair of block 4g + quad
        pack_quad_block<Raw>(wk, dk_rc, mi, g, quad, p.softmax_scale);
        pack_quad_block<Raw>(wv, dv_rc, mi, g, quad);
        if (key < rows && col0 + 32 * g + 8 * quad < p.head_dim) {
          *reinterpret_cast<uint4*>(dk + int64_t(key) * p.dk_strides.row + 32 * g) =
              make_uint4(wk[0], wk[1], wk[2], wk[3]);
          *reinterpret_cast<uint4*>(dv + int64_t(key) * p.dv_strides.row + 32 * g) =
              make_uint4(wv[0], wv[1], wv[2], wv[3]);
        }
      }
    }
  }
};

}  // namespace flash::fa3
