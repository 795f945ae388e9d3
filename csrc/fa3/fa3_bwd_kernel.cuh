// The FA3 backward kernel: one CTA per (key tile, KV head, batch), three warpgroups:
//   warpgroup 0, the producer: one thread loads the CTA's K and V once, then each step's Q and
//     dO tiles (TMA) with their rows' lse and D (bulk copies) into pipelines; its second warp,
//     the dQ writer, adds each step's staged dQ tile to the accumulator;
//   warpgroups 1-2, the consumers, per step (kBlockM query rows of one head); at head dims up
//   to 128, 64 keys each:
//     S^T = K Q^T, dP^T = V dO^T           SS WGMMA
//     P^T = exp2(S^T scale - lse), dS^T = P^T o (dP^T - D)
//     dV += P^T dO, dK += dS^T Q           RS WGMMA, P^T / dS^T from registers
//     dS^T to shared memory; dQ[:, half c] = dS K[:, half c]   SS WGMMA, staged in shared
//     memory (two buffers) for the dQ writer's bulk reduce-add
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
// Deterministic mode (p.deterministic): the adds into one dQ tile happen in a fixed order, from
// the last key tile that walks it down. A counter per (batch, head, query tile) in the scratch
// says how many key tiles have added; the CTA of key tile n waits for its turn (the number of
// later key tiles that walk the query tile, common/query_tiles.h), adds, waits for the add to
// complete and passes the turn on. The grid then puts a head's last key tile first, so the
// turn always comes from an earlier CTA, which never waits on a later one: the waits end. With
// a causal or windowed mask a later key tile starts its walk kBlockN / kBlockM query tiles
// further on (2; 1 in the wide tile), so it reaches each dQ tile that many steps before this
// one and the turns seldom wait. Without one
// every key tile walks the same tiles in the same order, and a dQ tile's turns form a chain
// through all of them: there the key tiles add into s.dq_copies accumulators by n modulo the
// copies, which the conversion sums in order, and the chains are that many times shorter.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/mask.h"
#include "common/params.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_epilogue.h"
#include "fa3/fa3_bwd_mainloop.h"
#include "fa3/fa3_bwd_prep.cuh"
#include "fa3/fa3_bwd_traits.h"
#include "fa3/fa3_bwd_wide.h"

namespace flash::fa3 {

// The Q or dO pipeline's parameters: the tiles are the same size, each with its rows' lse or D.
template <class Tr, class Pipeline>
__device__ __forceinline__ typename Pipeline::Params bwd_pipe_params(int wg) {
  typename Pipeline::Params params;
  params.role = wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = 128 * Tr::kConsumers;
  params.transaction_bytes = Tr::kTmaBytesQ + Tr::kRowBytes;
  return params;
}

// kScoreMod: softcap or ALiBi may be on (BwdMainloop::softmax_grad); kVRegs: the narrow
// tile's dP^T reads V from registers (BwdTraits::kVRegs).
template <class Tr, class Tma, bool kScoreMod, bool kVRegs>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ Tma tma,
               const BwdScratch s) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using PipelineQ = typename Tr::PipelineQ;
  using PipelinedO = typename Tr::PipelinedO;
  constexpr int kBlockN = Tr::kBlockN, kKVCols = Tr::kKVCols;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Tr::SharedStorage*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  // A 1-D grid (batch x heads_k may pass 65535, a grid's y / z limit), key tiles fastest:
  // neighbouring CTAs read the same Q and dO.
  const int n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  const int n_block = p.deterministic ? n_blocks - 1 - int(blockIdx.x % n_blocks)
                                      : int(blockIdx.x % n_blocks);
  const int head_k = int(blockIdx.x / n_blocks % p.heads_k);
  const int batch = int(blockIdx.x / n_blocks / p.heads_k);
  const flash::SeqInfo seq(p, batch);
  const int seqlen_q = seq.seqlen_q(p), seqlen_k = seq.seqlen_k(p);
  const Mask mask(p, seqlen_q, seqlen_k);
  const BwdSteps<Tr> steps(p, mask, n_block);

  PipelineQ pipe_q(shared.pipe_q, bwd_pipe_params<Tr, PipelineQ>(wg), Shape<_1, _1, _1>{});
  PipelinedO pipe_do(shared.pipe_do, bwd_pipe_params<Tr, PipelinedO>(wg), Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&shared.kv_full, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (steps.count() == 0) return;
    if (threadIdx.x / 32 == 1) {
      BwdEpilogue<Tr>::write_dq(p, s, shared, steps, n_block, head_k, batch, seqlen_q,
                                seqlen_k);
      return;
    }
    if (threadIdx.x != 0) return;
    BwdMainloop<Tr>::load(p, tma, s, shared, pipe_q, pipe_do, seq, steps, n_block, head_k,
                          batch);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int cw = wg - 1;
  typename Tr::MmaKV mma_kv;
  Tensor acc_dk = partition_fragment_C(mma_kv, Shape<_64, Int<kKVCols>>{});
  Tensor acc_dv = partition_fragment_C(mma_kv, Shape<_64, Int<kKVCols>>{});
  clear(acc_dk);
  clear(acc_dv);
  if constexpr (Tr::kWide) {  // all keys of the tile, head-dim half cw
    BwdWideConsumer<Tr>::template mma<kScoreMod>(p, shared, pipe_q, pipe_do, seq, mask, steps,
                                                 n_block, head_k, cw, acc_dk, acc_dv);
    BwdEpilogue<Tr>::store_dkdv(p, seq, head_k, n_block * kBlockN, kKVCols * cw, acc_dk,
                                acc_dv);
  } else {  // keys [64 cw, 64 cw + 64) of the tile, all the head dim
    BwdMainloop<Tr>::template mma<kScoreMod, kVRegs>(p, shared, pipe_q, pipe_do, seq, mask,
                                                     steps, n_block, head_k, cw, acc_dk, acc_dv);
    BwdEpilogue<Tr>::store_dkdv(p, seq, head_k, n_block * kBlockN + 64 * cw, 0, acc_dk,
                                acc_dv);
  }
#endif
}

}  // namespace flash::fa3
