// The FA3 forward kernel: who does what. A persistent grid of CTAs that take (query tile, head,
// batch) items from a scheduler (fa3_scheduler.h), three or four warpgroups each:
//   warpgroup 0, the producer: one thread loads each item's Q and K / V tiles with TMA
//     (FwdMainloop::load) into shared memory, publishing the item with its Q; over a paged
//     cache with many boxes a tile the other warps' lane 0 issue a share of them (help_paged);
//   warpgroups 1.., the consumers, 64 query rows of the item each: take the item
//     (FwdMainloop::take), walk its key tiles with WGMMA and the online softmax
//     (FwdMainloop::mma), then write O and the lse (FwdEpilogue), for stream-K after merging
//     the item's pieces.
// With two Q buffers the producer runs an item ahead of the consumers, and each consumer goes
// on to the next item as soon as it has packed its O; with one, the next Q loads under the last
// P V and the epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/params.h"
#include "common/seqinfo.h"
#include "fa3/fa3_fwd_epilogue.h"
#include "fa3/fa3_fwd_mainloop.h"
#include "fa3/fa3_fwd_paged.h"
#include "fa3/fa3_fwd_traits.h"
#include "fa3/fa3_item.h"
#include "fa3/fa3_scheduler.h"

namespace flash::fa3 {

template <class Tr, class Scheduler, class Tma>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ Tma tma,
               const Scheduler sched) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Tr::SharedStorage*>(smem_raw);
  // The warpgroup index through a shuffle from lane 0 (canonical_warp_group_idx), so that
  // ptxas knows it is warp-uniform: values it cannot prove uniform take per-thread registers,
  // which the three-consumer kernels (160 per thread) lack.
  const int wg = cutlass::canonical_warp_group_idx();
  const int rank = Tr::kClusterM > 1 ? int(cute::block_rank_in_cluster()) : 0;
  FwdMainloop<Tr> mainloop(shared, wg);
  // Barriers initialised before anyone waits on them, and in a cluster before the other CTAs
  // arrive on them or multicast into this one.
  if constexpr (Tr::kClusterM > 1) {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }

  if (warp_role(wg) == WarpRole::Producer) {
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    // No dropout: the call's rng_state (the Philox state it drew from) is zeros, written here
    // so that the call needs no fill kernel of its own (csrc/api/flash_api.cpp, fwd).
    if (blockIdx.x == 0 && threadIdx.x == 0 && p.rng_state != nullptr) {
      p.rng_state[0] = 0;
      p.rng_state[1] = 0;
    }
    if (threadIdx.x == 0) {
      mainloop.load(p, tma, sched, rank);
    } else if (threadIdx.x % 32 == 0 && PagedKV<Tr>::helpers(p, tma)) {
      mainloop.help_paged(p, tma, threadIdx.x / 32);  // warps 1-3 of the producer warpgroup
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of each item
  Tensor acc_o = partition_fragment_C(typename Tr::MmaO{}, Shape<_64, Int<Tr::kHeadDim>>{});
  typename Tr::PipelineState state;  // runs on across items, as the producer's
  typename Tr::PipelineState o_state;  // the item's last K / V stage (the staged epilogue's)
  FwdEpilogue<Tr> epilogue(cw);
  for (int taken = 0;; ++taken) {
    const int i = mainloop.take(taken);
    if (i < 0) break;
    const int qb = taken % Tr::kQBufs;
    Item it = item_at<Tr>(p, sched, i, rank, &shared.lengths[qb]);
    if constexpr (Scheduler::kPieces) {
      const int2 piece = shared.piece[qb];
      it.tiles.begin = piece.x;
      it.tiles.end = piece.y;
    }
    const flash::SeqInfo seq(p, it.batch);
    const flash::Mask mask(p, it.seqlen_q, it.seqlen_k);
    const int wg_row0 = it.row0 + 64 * cw;
    const flash::KeyTiles tiles = mainloop.consumer_tiles(mask, it.tiles, wg_row0, state);
    typename Tr::RowSoftmax softmax;
    bool output = true;  // stream-K: false where another piece of the item writes its O
    if (!tiles.empty()) {
      mainloop.mma(p, seq, mask, it, tiles, qb, cw, wg_row0, state, o_state, acc_o, softmax,
                   epilogue);
      if (!FwdMainloop<Tr>::kEarlyRelease) mainloop.release_q(qb);
      if constexpr (Tr::kStreamK) output = epilogue.merge(p, mainloop, sched, i, acc_o, softmax);
    } else {
      mainloop.release_q(qb);  // only the index was read
      epilogue.no_keys(p, it, acc_o, softmax);
    }
    if (!output) {
      epilogue.skip(mainloop, o_state);
      continue;
    }
    epilogue.store(p, tma, mainloop, it, !tiles.empty(), wg_row0, o_state, acc_o, softmax);
  }
  epilogue.flush(p);  // the last item's
#endif
}

}  // namespace flash::fa3
