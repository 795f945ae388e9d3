// FA3 forward (issue 4; plan and measurements in benchmarks/results/fa3_notes.md): a
// persistent grid of CTAs that take (query tile, head, batch) items from a scheduler
// (fa3_scheduler.h), three or four warpgroups each. Warpgroup 0 produces: one thread issues TMA
// loads of each tile's Q and of K and V into a ring of kStages buffers guarded by mbarriers
// (CUTLASS's PipelineTmaAsync). The other two or three consume, 64 query rows each (the WGMMA
// M; the query tile is 128 or 192 rows):
//   S = Q K[n]^T        SS WGMMA from shared memory
//   score mod, mask, online softmax (FA2's ScoreMod, Mask and Softmax: the same conventions;
//                       fa3_softmax.h adds the lazy step of the overlapped schedules)
//   O += P V[n]         RS WGMMA, P from registers, V read MN-major from shared memory
// Schedules (Traits): serial (each GEMM waited for at once), intra-warpgroup overlap (S[n+1]
// is issued before P[n] V[n], and the softmax of S[n+1] runs while P[n] V[n] does), and
// ping-pong on top of it (named barriers make the two consumers take turns issuing GEMMs, so
// that one's softmax runs under the other's GEMMs).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/mma.cuh"
#include "common/params.h"
#include "fa2/fa2_mask.h"
#include "fa2/fa2_score_mod.h"
#include "fa3/fa3_softmax.h"
#include "fa2/fa2_tile_order.h"
#include "fa2/fa2_utils.h"
#include "fa3/fa3_scheduler.h"
#include "fa3/fa3_trace.h"

namespace flash::fa3 {

using namespace cute;

// How a consumer orders its GEMMs and its softmax (see the header comment).
enum class Schedule { kSerial, kOverlap, kPingPong };

template <typename T, int kHeadDim_, int kBlockN_, int kStages_, bool kScoreMod_,
          Schedule kSchedule_, int kConsumers_ = 2, int kClusterM_ = 1, bool kStreamK_ = false>
struct FwdTraits {
  using Element = typename flash::fa2::CuteType<T>::type;
  using Raw = T;  // __half / __nv_bfloat16, for pack2
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr bool kScoreMod = kScoreMod_;  // softcap or ALiBi may be on (runtime fields)
  static constexpr Schedule kSchedule = kSchedule_;
  static constexpr int kConsumers = kConsumers_;  // warpgroups, 64 rows each
  // CTAs per cluster: a cluster's CTAs take neighbouring query tiles of one (head, batch) and
  // the same key tiles; each CTA's producer loads 1 / kClusterM of every K / V tile and
  // multicasts it to all of them (half the L2 reads at 2; fa3_tiles.h says where it runs).
  // Full attention only (the CTAs must see the same key tiles). The clusters take items at a
  // static stride: unmasked items cost the same, and the claim would have to be shared.
  static constexpr int kClusterM = kClusterM_;
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
  static_assert(kClusterM == 1 || kClusterM == 2);
  // Stream-K (fa3_scheduler.h): full attention only, items taken on the static stride's
  // lattice and the remainder cut into pieces of key tiles, merged by the last to finish. A
  // template flag: as a runtime switch its code made the other kernels spill (fa3_notes.md,
  // session 20).
  static constexpr bool kStreamK = kStreamK_;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // setmaxnreg: the producer needs a few registers, the consumers all they can get, and the
  // split must add up to what the launch bound gives the CTA (64K registers: 168 per thread of
  // 384, 128 of 512): 128 x 24 + 256 x 240 and 128 x 32 + 384 x 160. With 32 for the producer
  // of two consumers the consumers' setmaxnreg waited forever.
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kConsumers == 2 || kConsumers == 3);
  static_assert(kConsumers == 2 || kSchedule_ != Schedule::kPingPong,
                "ping-pong takes turns between two consumers");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0);

  using ShapeS = Shape<_64, Int<kBlockN>, Int<kHeadDim>>;   // one warpgroup's S = Q K^T
  using ShapeO = Shape<_64, Int<kHeadDim>, Int<kBlockN>>;   // one warpgroup's O += P V
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, ShapeS>()));
  using MmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, ShapeO, GMMA::Major::K, GMMA::Major::MN>()));

  // Q, K, V in shared memory as they are in global: rows of hdim, swizzled by the widest
  // pattern a row divides into (128 bytes, or 64 at hdim 96). V viewed as (hdim, keys) is the
  // MN-major B operand of P V, so no transpose is needed.
  using SwizzleAtom = std::conditional_t<kHeadDim % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                         GMMA::Layout_K_SW64_Atom<Element>>;
  // Q is double-buffered where shared memory has room (hdim <= 128), so that the producer loads
  // the next item's Q while the consumers still run this one's GEMMs: each consumer goes on to
  // the next item as soon as it has packed its O (whose stores then follow under the next
  // item's first S GEMM), without waiting for the others or for a load.
  static constexpr int kSmemLimit = 227 * 1024;  // per block, H100 / H200
  static constexpr int kQBufs =
      (2 * kBlockM + 2 * kStages * kBlockN) * kHeadDim * int(sizeof(Element)) + 1024 <= kSmemLimit
          ? 2 : 1;
  // At hdim 256 (one Q buffer) O leaves through shared memory: each consumer writes its 64
  // rows into the item's last K / V stage (consumer 0 into K, 1 into V; a stage holds at least
  // 64 rows) with stmatrix, and one of its threads stores them with TMA in 64 x 64 boxes and
  // hands the stage back to the producer once the store has read it. With the first V after Q
  // (producer), over 16-byte stores from registers (harness, H200): causal 2k +1.0..1.4%, 1k
  // +2%, 512 +1.1..1.5%; full 2k 0 (one CTA) / +0.5% (clusters), 1k -0.6%, 4k level. hdim 192
  // (the other one-buffer tile) was not measured and keeps them (fa3_notes.md, session 19).
  // Taking the wait for the store's read off the consumers (the producer warpgroup issues the
  // store and releases the stage) ran 0.3..3% slower (session 20; not profiled: the read
  // then runs beside the next item's first GEMMs, which read shared memory too). Running the
  // next item's first key tile under the store's read lost 0.6% (one CTA) to 3% (clusters),
  // and gained nothing with the K stage free either: the tensor cores' idle time is not what
  // sets the item boundary's length (session 24, branches exp/carry, exp/carry2).
  static constexpr bool kStageO = kQBufs == 1 && kSchedule == Schedule::kOverlap &&
                                  kConsumers == 2 && kHeadDim == 256 && kBlockN >= 64;
  using SmemOBox = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<_64, _64>{}));
  using SmemQ = decltype(tile_to_shape(SwizzleAtom{},
                                       Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQBufs>>{}));
  using SmemKV = decltype(tile_to_shape(SwizzleAtom{},
                                        Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemVt = decltype(composition(
      SmemKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                    Step<_2, _1, _3>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemKV>> v;
    typename Pipeline::SharedStorage pipe_k, pipe_v;
    // Per Q buffer:
    alignas(8) uint64_t q_full[kQBufs];   // item published and its Q loaded (producer's tx)
    alignas(8) uint64_t q_empty[kQBufs];  // every consumer thread done with the index and Q
    int item[kQBufs];                     // the item in the buffer, -1: none left
    int2 piece[kQBufs];                   // stream-K: the item's key tiles [x, y) in this piece
    int split_old[kConsumers];            // stream-K: the item's pieces finished before this
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);
};

// The TMA descriptors, built by the launcher over (seqlen, head_dim, heads, batch) views.
template <class TmaQ, class TmaK, class TmaV, class TmaO>
struct FwdTma {
  TmaQ q;
  TmaK k;
  TmaV v;
  TmaO o;  // the store of O from shared memory (FwdTraits::kStageO), else NoTma
};
struct NoTma {};

// An SM90 accumulator ((2 cols, 2 rows, N / 8), MMA_M, MMA_N) seen as (rows, cols).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol(Layout const& acc) {
  static_assert(rank(Layout{}) == 3);
  auto atom = get<0>(acc);
  return make_layout(make_layout(get<1>(atom), get<1>(acc)),
                     make_layout(get<0>(atom), get<2>(atom), get<2>(acc)));
}

// The S accumulator converted to 16 bits, as the A operand of the RS WGMMA: each k16 slice
// is two adjacent n8 blocks. ((2, 2, N/8), M, N) -> ((2, 2, 2), M, (N/16, N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_operand_a(Layout const& acc) {
  auto split = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(acc),
                     make_layout(get<2, 1>(split), get<2>(acc)));
}

// Keeps the compiler from moving shared-memory accesses across CUTLASS's mbarrier waits and
// arrives, whose asm has no memory clobber (the hardware ordering is the mbarriers').
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

// One warpgroup's GEMM, issued and committed (not waited for). zero: C = A B (C's registers
// are not read), else C += A B.
template <class Mma, class A, class B, class C>
__device__ __forceinline__ void wgmma(Mma& mma, A const& a, B const& b, C& c, bool zero) {
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
}

// Ends the life of a float fragment's values for the compiler: an empty asm that writes each
// register without reading it. The first P V of an item overwrites O's accumulator (ScaleOut
// Zero), but its asm reads the registers all the same, which would keep the item before's O
// alive into this item's first key tile, next to the O being stored (measured on the dropped
// hdim 256 variant that deferred its stores too: 640 B of spills without forget, 300 B with);
// forgetting O before that P V frees the registers in between.
template <class Fragment>
__device__ __forceinline__ void forget(Fragment& f) {
  CUTE_UNROLL
  for (int k = 0; k < size(f); ++k) asm volatile("" : "=f"(f(k)));
}

// A 4 x 4 transpose of 32-bit words across the four lanes of a quad (lane = quad index):
// w[j] of lane i becomes w[i] of lane j. Two xor shuffles, each swapping half of the words; every
// lane of the warp must call it.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int quad) {
  CUTE_UNROLL
  for (int bit = 1; bit <= 2; bit *= 2) {
    const bool upper = quad & bit;
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) {
      if (k & bit) continue;  // the pair (k, k + bit)
      const uint32_t recv = __shfl_xor_sync(0xffffffff, upper ? w[k] : w[k + bit], bit);
      (upper ? w[k] : w[k + bit]) = recv;
    }
  }
}

// Four 8 x 8 matrices of 16-bit pairs from an accumulator fragment into shared memory
// (stmatrix): register j goes to matrix j, whose eight row addresses lanes 8j..8j+7 give.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Named barriers (CUTLASS's user ids; ping-pong's turns take 0 and 1): for the staged O
// (kStageO) consumer 1's last S GEMM has read K (kKFree) and consumer 0's last P V has read V
// (kVFree); kOwn + cw is consumer cw's own (128 threads: its staged O).
enum NamedBarrierId : uint32_t { kKFree = 2, kVFree = 3, kOwn = 4 };

// True, in a way the compilers cannot see (the lane index is below 32): a branch on it ends a
// basic block, below which ptxas does not hoist a wait.
__device__ __forceinline__ bool opaque_true() {
  uint32_t lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane < 32;
}

// The scores q_row[r] . k_row[c] of kRows rows and kCols keys (fp32 sums of the 16-bit
// products, into score[r * kCols + c]), with CUDA cores from global memory: the lazy softmax
// step's rare fallback (fa3_softmax.h's settle). Not inlined, so that its registers and loads
// stay out of the kernel's loop: inline, it added spills to the 2-CTA kernel at hdim 256 and
// cost it 1-2% (fa3_notes.md, session 25).
// head_dim, the row strides and the bases are multiples of 8 elements (the API checks, TMA
// needs them), so each step is a 16-byte load of either row. A null q_row is a row past
// seqlen_q, whose Q TMA fills with zeros.
template <class Element, int kRows, int kCols>
__device__ __noinline__ void rescore_rows(const Element* const (&q_row)[kRows],
                                          const Element* const (&k_row)[kCols], int head_dim,
                                          float (&score)[kRows * kCols]) {
  #pragma unroll 1
  for (int r = 0; r < kRows; ++r) {
    #pragma unroll 1
    for (int c = 0; c < kCols; ++c) {
      float acc = 0.f;
      #pragma unroll 1
      for (int d = 0; q_row[r] != nullptr && d < head_dim; d += 8) {
        const uint4 qa = *reinterpret_cast<const uint4*>(q_row[r] + d);
        const uint4 ka = *reinterpret_cast<const uint4*>(k_row[c] + d);
        const Element* qe = reinterpret_cast<const Element*>(&qa);
        const Element* ke = reinterpret_cast<const Element*>(&ka);
        CUTE_UNROLL
        for (int j = 0; j < 8; ++j) acc = fmaf(float(qe[j]), float(ke[j]), acc);
      }
      score[r * kCols + c] = acc;
    }
  }
}

template <class Tr, class Tma>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ Tma tma,
               const TileScheduler sched) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Tr::Element;
  using Raw = typename Tr::Raw;
  using Pipeline = typename Tr::Pipeline;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Tr::SharedStorage*>(smem_raw);

  // Persistent: the CTAs (as many as the GPU holds, launcher) take work items from the
  // scheduler in FA2's order, heaviest first (tile 0 = the last query tile, which has the most
  // keys under a causal mask). The producer takes the next item and publishes it in shared
  // memory with the arrival on its Q buffer's q_full (whose release / acquire orders the write
  // before the consumers' read), together with its Q load; it may do so once every consumer
  // has read the item that buffer last held and finished with its Q (q_empty). With two Q
  // buffers the next item's Q and first K / V are in shared memory before the consumers finish
  // this one, and the consumers do not wait for each other between items; with one, the next
  // Q loads under the last P V and the epilogue. A tile that sees no key loads nothing (its
  // rows are written as zeros, lse +inf); the item -1 ends the CTA.
  const flash::fa2::TileOrder& order = sched.order;
  struct Item {
    int m_block, head, batch, head_k, row0;
    flash::fa2::KeyTiles tiles;
  };
  const flash::fa2::Mask mask(p);
  // In a cluster the order's tiles are groups of kClusterM query tiles; the CTA of rank r takes
  // the r-th, and the key tiles are those of the whole group, the same in every CTA.
  const int rank = Tr::kClusterM > 1 ? int(cute::block_rank_in_cluster()) : 0;
  auto item_at = [&](int i) {
    const flash::fa2::WorkItem w = order.decode_fast(i);  // items fit in int32 (launcher)
    Item it;
    const int group = order.tiles - 1 - w.tile;
    it.m_block = group * Tr::kClusterM + rank;
    it.head = w.head;
    it.batch = w.batch;
    it.head_k = w.head_k;
    it.row0 = it.m_block * kBlockM;
    it.tiles =
        mask.key_tiles<kBlockM * Tr::kClusterM, kBlockN>(group * Tr::kClusterM * kBlockM);
    return it;
  };
  auto first_item = [&] {
    return Tr::kClusterM > 1 ? int(blockIdx.x) / Tr::kClusterM : sched.first();
  };
  auto next_item = [&](int i) {
    return Tr::kClusterM > 1 ? i + int(gridDim.x) / Tr::kClusterM : sched.next();
  };
  // The warpgroup index through a shuffle from lane 0, so that ptxas knows it is warp-uniform:
  // each consumer's key range (and so its pipeline state and WGMMA descriptors) depends on it,
  // and values ptxas cannot prove uniform take per-thread registers, which the wide kernels
  // (160 per thread) lack: with threadIdx.x / 128 the per-consumer walk spilled 12 B at hdim 128
  // (session 14), with the shuffle 4 B (one load per masked key tile).
  const int wg = cutlass::canonical_warp_group_idx(), wg_tid = threadIdx.x % 128;

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Tr::SmemQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Tr::SmemKV{});
  Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Tr::SmemVt{});

  typename Pipeline::Params pipe_params;
  pipe_params.role = wg == 0 ? Pipeline::ThreadCategory::Producer
                             : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = 128 * Tr::kConsumers;
  pipe_params.transaction_bytes = Tr::kTmaBytesKV;
  Pipeline pipe_k(shared.pipe_k, pipe_params, typename Tr::ClusterShape{});
  Pipeline pipe_v(shared.pipe_v, pipe_params, typename Tr::ClusterShape{});
  if (threadIdx.x == 0) {
    for (int b = 0; b < Tr::kQBufs; ++b) {
      cutlass::arch::ClusterTransactionBarrier::init(&shared.q_full[b], 1);
      cutlass::arch::ClusterBarrier::init(&shared.q_empty[b], 128 * Tr::kConsumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  // Barriers initialised before anyone waits on them, and in a cluster before the other CTAs
  // arrive on them or multicast into this one.
  if constexpr (Tr::kClusterM > 1) {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    // ---- producer ----------------------------------------------------------------------
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    // No dropout: the call's rng_state (the Philox state it drew from) is zeros, written here
    // so that the call needs no fill kernel of its own (csrc/api/flash_api.cpp, fwd).
    if (blockIdx.x == 0 && threadIdx.x == 0 && p.rng_state != nullptr) {
      p.rng_state[0] = 0;
      p.rng_state[1] = 0;
    }
    if (wg_tid == 0) {
      Tensor mQ = tma.q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads, p.batch));
      Tensor mK = tma.k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_k, p.batch));
      Tensor mV = tma.v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_k, p.batch));
      Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Tr::SmemKV{});
      auto state = cutlass::make_producer_start_state<Pipeline>();
      auto kv_tma = [](auto const& tma_kv, uint64_t& full) {
        if constexpr (Tr::kClusterM > 1) {
          return tma_kv.with(full, uint16_t((1 << Tr::kClusterM) - 1));
        } else {
          return tma_kv.with(full);
        }
      };
      const int items = int(order.items());  // fits (launcher)
      int i = first_item();
      int segment = 0;  // stream-K: this worker's next piece
      for (int published = 0;; ++published) {
        const int qb = published % Tr::kQBufs;
        uint64_t* q_full = &shared.q_full[qb];
        // Everything about the claimed item that does not touch the Q buffer comes before the
        // wait for it: with one Q buffer (hdim 256) the consumers wait for this load, and
        // decoding the item and partitioning its tensors took this thread 1300 cycles after
        // the wait (trace, fa3_notes.md, session 16).
        int kb = 0, ke = 0;  // stream-K: the piece's key tiles
        if constexpr (Tr::kStreamK) {
          do {
            i = sched.segment(int(blockIdx.x) / Tr::kClusterM, segment++, kb, ke);
          } while (i < 0);
        }
        const bool done = i >= items;
        Item it = item_at(done ? 0 : i);
        if constexpr (Tr::kStreamK) {
          it.tiles.begin = kb;
          it.tiles.end = ke;
        }
        // The empty asm keeps ptxas from sinking the decode below the wait, which it did (to
        // shorten the values' lives). Harness, H100, hdim 256: +0.3% 2k, +1% 1k, +2.6% causal
        // 512 (fa3_notes.md, session 17).
        auto pin = [](int& x) { asm volatile("" : "+r"(x)); };
        pin(it.m_block), pin(it.head), pin(it.batch), pin(it.head_k);
        pin(it.tiles.begin), pin(it.tiles.end);
        Tensor gQ = local_tile(mQ(_, _, it.head, it.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                               make_coord(it.m_block, 0));
        Tensor gK = local_tile(mK(_, _, it.head_k, it.batch),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
        Tensor gV = local_tile(mV(_, _, it.head_k, it.batch),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
        auto [tQg, tQs] = tma_partition(tma.q, Int<0>{}, Layout<_1>{},
                                        group_modes<0, 2>(sQ(_, _, qb)), group_modes<0, 2>(gQ));
        // Each CTA of a cluster loads its 1 / kClusterM slice of every K / V tile into all.
        auto [tKg, tKs] = tma_partition(tma.k, rank, Layout<Int<Tr::kClusterM>>{},
                                        group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVg, tVs] = tma_partition(tma.v, rank, Layout<Int<Tr::kClusterM>>{},
                                        group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        FA3_MARK(published, 15, clock64());
        if (published >= Tr::kQBufs) {
          cutlass::arch::ClusterBarrier::wait(&shared.q_empty[qb],
                                              (published / Tr::kQBufs - 1) & 1);
        }
        compiler_fence();  // the wait (asm without a memory clobber) before the write
        shared.item[qb] = done ? -1 : i;
        if constexpr (Tr::kStreamK) shared.piece[qb] = make_int2(it.tiles.begin, it.tiles.end);
        compiler_fence();
        if (done) {
          cutlass::arch::ClusterBarrier::arrive(q_full);
          break;
        }
        if (it.tiles.empty()) {
          cutlass::arch::ClusterBarrier::arrive(q_full);
          if constexpr (!Tr::kStreamK) i = next_item(i);
          continue;
        }
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(q_full, Tr::kTmaBytesQ);
        copy(tma.q.with(*q_full), tQg, tQs);
        FA3_MARK(published, 16, clock64());
        #pragma unroll 1  // unrolled, it spilled in the producer's 24 registers
        for (int n = it.tiles.end - 1; n >= it.tiles.begin; --n) {
          pipe_k.producer_acquire(state);
          copy(kv_tma(tma.k, *pipe_k.producer_get_barrier(state)), tKg(_, n),
               tKs(_, state.index()));
          // With one Q buffer the consumers wait for this Q and the first K: the first V
          // follows once Q has landed, so that it does not share the SM's intake with them
          // (harness, H200, hdim 256 with the staged O: causal 2k +0.6%, 512 +1.6%, full 2k 0;
          // hdim 192 not measured).
          if (Tr::kStageO && n == it.tiles.end - 1) {
            cutlass::arch::ClusterBarrier::wait(q_full, (published / Tr::kQBufs) & 1);
          }
          pipe_v.producer_acquire(state);
          copy(kv_tma(tma.v, *pipe_v.producer_get_barrier(state)), tVg(_, n),
               tVs(_, state.index()));
          ++state;
        }
        // Claim the next item only now, about kStages key tiles before the consumers finish
        // this one: a CTA that claimed it when starting a long item held it back from CTAs that
        // freed up meanwhile (hdim 256 16k causal: 650 against 765 TFLOP/s for one CTA per item).
        if constexpr (!Tr::kStreamK) i = next_item(i);
      }
      // In a cluster, the other CTAs' consumers arrive on this CTA's empty barriers: wait for
      // the last of them before this CTA (and its shared memory) may go.
      if constexpr (Tr::kClusterM > 1) {
        pipe_k.producer_tail(state);
        pipe_v.producer_tail(state);
      }
    }
#ifdef FA3_TRACE
    if (wg_tid == 32) {  // when each Q lands (slot 18), whether or not a consumer waits for it
      for (int k = 0;; ++k) {
        const int qb = k % Tr::kQBufs;
        cutlass::arch::ClusterBarrier::wait(&shared.q_full[qb], (k / Tr::kQBufs) & 1);
        FA3_MARK(k, 18, clock64());
        compiler_fence();
        if (shared.item[qb] < 0) break;
      }
    }
#endif
    return;
  }

  // ---- consumers: warpgroup wg - 1 owns rows [64 (wg - 1), +64) of the tile ---------------
  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  if (threadIdx.x == 128) FA3_MARK(0, 52, globaltimer());
  const int cw = wg - 1;
  typename Tr::MmaS mma_s;
  typename Tr::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(wg_tid);
  auto thr_o = mma_o.get_thread_slice(wg_tid);
  Tensor sQ_wg = local_tile(sQ, Shape<_64, Int<kHeadDim>>{}, make_coord(cw, 0));  // (64, d, buf)
  Tensor tSrQ_bufs = thr_s.partition_fragment_A(sQ_wg);  // descriptors (MMA, M, K, buf)
  Tensor tSrK = thr_s.partition_fragment_B(sK);     // (MMA, N, K, stage)
  Tensor tOrVt = thr_o.partition_fragment_B(sVt);   // (MMA, N, K, stage)

  Tensor acc_o = partition_fragment_C(mma_o, Shape<_64, Int<kHeadDim>>{});
  Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
  static_assert(decltype(size<0>(acc_o_rc))::value == 2, "two rows per thread");
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), rowcol(cO.layout()));
  cutlass::PipelineState<Tr::kStages> state;  // runs on across tiles, as the producer's

  // The epilogue comes in two halves. After an item's last P V its O is finalized, converted
  // to 16 bits and transposed within quads (each lane then holds 8 adjacent columns of a block)
  // into o_pack; store_o writes o_pack and the lse. With two Q buffers the stores wait
  // (pending) until the next item's first S GEMM is on the tensor cores (its Q has landed by
  // then): harness, H100, +2.5% hdim 128 causal 512, +0.8% hdim 64 causal 512 / 1k, the rest
  // within 0.5%. With one (hdim 192) they follow at once: under the S GEMM they spilled and
  // made the first key tile 3000 cycles longer, -1.5% at hdim 256 2k (fa3_notes.md, session
  // 17); hdim 256 stages O in shared memory instead (stage_o below). O's accumulator is not
  // live across items: an item's first P V writes it without reading it.
  constexpr bool kDeferStores = Tr::kQBufs == 2;
  const int quad = wg_tid % 4;
  uint32_t o_pack[2][kHeadDim / 32][4];
  Element* o_dst[2];   // this lane's first column in each of its rows; nullptr: past seqlen_q
  float* lse_dst[2];   // nullptr: past seqlen_q, or not quad 0 (which writes the row's lse)
  float lse_val[2];
  bool pending = false;
  auto store_o = [&] {
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      CUTE_UNROLL
      for (int g = 0; g < kHeadDim / 32; ++g) {
        if (o_dst[mi] != nullptr && 32 * g + 8 * quad < p.head_dim) {
          *reinterpret_cast<uint4*>(o_dst[mi] + 32 * g) =
              make_uint4(o_pack[mi][g][0], o_pack[mi][g][1], o_pack[mi][g][2], o_pack[mi][g][3]);
        }
      }
      if (lse_dst[mi] != nullptr) *lse_dst[mi] = lse_val[mi];
    }
    pending = false;
  };

  // The staged epilogue (kStageO, see FwdTraits): O / l in 16 bits into the item's last K
  // (consumer 0) or V (consumer 1) stage as 64 x 64 boxes of swizzled 128-byte rows (SmemOBox),
  // written with stmatrix straight from the accumulator's fragments (no quad transpose), then
  // stored by one thread with TMA. Consumer 0 may write the K stage once consumer 1's last S
  // GEMM has read it (kKFree), consumer 1 the V stage once consumer 0's last P V has (kVFree);
  // each holds back its release of that stage until the stores have read it. Consumer 1 arrives
  // on kKFree before it waits on kVFree, consumer 0 on kVFree after it has waited on kKFree, so
  // neither barrier can see an item's arrival before the item before has passed it.
  constexpr bool kStageO = Tr::kStageO;
  cutlass::PipelineState<Tr::kStages> o_state;  // the item's last K / V stage
  // Which kernels take the lazy softmax step on unmasked tiles (fa3_softmax.h): the overlapped
  // schedules, whose softmax runs beside the GEMMs (hdim 192 / 256: +4..6% on the harness,
  // fa3_notes.md, session 25). Not the stream-K kernels, whose merge leaves no registers for
  // its rare path (their loop spilled, -15..19%); not yet the serial schedule.
  constexpr bool kLazySteps = Tr::kSchedule != Schedule::kSerial && !Tr::kStreamK;
#ifdef FA3_TRACE
  int trace_item = 0;  // the item's index among this CTA's, for stage_o's marks
#endif
  auto stage_o = [&](const auto& tma_o, const Item& it, int wg_row0, const float (&lse)[2]) {
    uint32_t pk[2][kHeadDim / 8];  // this lane's column pair of each 8-column block, per row
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      CUTE_UNROLL
      for (int b = 0; b < kHeadDim / 8; ++b) {
        pk[mi][b] = pack2<Raw>(acc_o_rc(mi, 2 * b), acc_o_rc(mi, 2 * b + 1));
      }
    }
    if (cw == 1) cutlass::arch::NamedBarrier::sync(256, kVFree);
    if (wg_tid == 0) FA3_MARK(trace_item, 50 + cw, clock64());
    Element* region = (cw == 0 ? shared.k.data() : shared.v.data()) +
                      o_state.index() * kBlockN * kHeadDim;
    const uint32_t base = cute::cast_smem_ptr_to_uint(region);
    // stmatrix x4: matrices (row half 0, block 2c), (1, 2c), (0, 2c + 1), (1, 2c + 1); lane l
    // gives row l % 8 of matrix l / 8. Swizzle: 16-byte chunk k of row r at chunk k ^ (r % 8).
    const int lane = wg_tid % 32, half = lane / 16;
    const int row = 16 * (wg_tid / 32) + 8 * ((lane / 8) % 2) + lane % 8;
    CUTE_UNROLL
    for (int c = 0; c < kHeadDim / 16; ++c) {
      const int blk = 2 * c + half;
      stmatrix_x4(base + (blk / 8) * 8192 + row * 128 + (((blk % 8) ^ (row % 8)) << 4),
                  pk[0][2 * c], pk[1][2 * c], pk[0][2 * c + 1], pk[1][2 * c + 1]);
    }
    cutlass::arch::fence_view_async_shared();  // the writes, before the async proxy reads them
    if (wg_tid == 0) FA3_MARK(trace_item, 42 + cw, clock64());
    cutlass::arch::NamedBarrier::sync(128, kOwn + cw);
    if (wg_tid == 0) FA3_MARK(trace_item, 44 + cw, clock64());
    if (wg_tid == 0) {
      // (tma_o is tma.o, a parameter so that this generic lambda compiles only where staged)
      Tensor mO = tma_o.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads, p.batch));
      auto cta_o = tma_o.get_slice(Int<0>{});
      CUTE_UNROLL
      for (int j = 0; j < kHeadDim / 64; ++j) {  // rows past seqlen_q, columns past head_dim clip
        Tensor sO = make_tensor(make_smem_ptr(region + 64 * 64 * j), typename Tr::SmemOBox{});
        Tensor gO = local_tile(mO(_, _, it.head, it.batch), Shape<_64, _64>{},
                               make_coord(wg_row0 / 64, j));
        copy(tma_o, cta_o.partition_S(sO), cta_o.partition_D(gO));
      }
      tma_store_arrive();
      tma_store_wait<0>();  // read out of shared memory (the writes to out complete on their own)
      FA3_MARK(trace_item, 46 + cw, clock64());
    }
    if (quad == 0) {
      CUTE_UNROLL
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wg_row0 + get<0>(cO_rc(mi, 0));
        if (r < p.seqlen_q) {
          p.lse[(int64_t(it.batch) * p.heads + it.head) * p.seqlen_q + r] = lse[mi];
        }
      }
    }
    cutlass::arch::NamedBarrier::sync(128, kOwn + cw);  // the stores have read the stage
    if (wg_tid == 0) FA3_MARK(trace_item, 48 + cw, clock64());
    if (cw == 0) {  // (not a ternary of the two pipelines: that put them on the stack)
      pipe_k.consumer_release(o_state);
    } else {
      pipe_v.consumer_release(o_state);
    }
  };

  // Stream-K: after a piece's last P V, each consumer counts its piece among the item's (per
  // consumer and CTA rank: their rows are their own); all but the last to count publish their
  // O (unnormalised, fp32, in fragment order: the same thread of the last one reads its own
  // elements) with the rows' max and sum, and the last merges them into its registers and
  // writes the item. It waits only for pieces that have counted, so for no CTA that is not
  // running. Returns whether this consumer writes the item's O.
  auto merge_pieces = [&](int i, Softmax<2>& softmax) {
    if (i < sched.lattice) return true;  // a whole item
    const int kt = sched.key_tiles, first_unit = (i - sched.lattice) * kt;
    const int w_lo = sched.worker_of(first_unit), w_hi = sched.worker_of(first_unit + kt - 1);
    if (w_lo == w_hi) return true;
    const int worker = int(blockIdx.x) / Tr::kClusterM;
    // A worker's first piece in its range is its slot 0, a second one (the item after) slot 1.
    auto slot_of = [&](int w) {
      const int slot = sched.range_begin(w) >= first_unit ? 0 : 1;
      return ((2 * w + slot) * Tr::kClusterM + rank) * Tr::kConsumers + cw;
    };
    if (wg_tid == 0) {
      shared.split_old[cw] =
          atomicAdd(sched.split_count + (w_hi * Tr::kClusterM + rank) * Tr::kConsumers + cw, 1);
    }
    cutlass::arch::NamedBarrier::sync(128, kOwn + cw);
    constexpr int kVecs = decltype(size(acc_o))::value / 4;
    if (shared.split_old[cw] < w_hi - w_lo) {  // not the last: publish
      const int slot = slot_of(worker);
      float4* part = sched.split_part + int64_t(slot) * (kVecs + 1) * 128;
      CUTE_UNROLL
      for (int k = 0; k < kVecs; ++k) {
        __stcg(part + k * 128 + wg_tid,
               make_float4(acc_o(4 * k), acc_o(4 * k + 1), acc_o(4 * k + 2), acc_o(4 * k + 3)));
      }
      __stcg(part + kVecs * 128 + wg_tid, make_float4(softmax.row_max[0], softmax.row_max[1],
                                                      softmax.row_sum[0], softmax.row_sum[1]));
      __threadfence();
      cutlass::arch::NamedBarrier::sync(128, kOwn + cw);
      if (wg_tid == 0) atomicExch(sched.split_flag + slot, 1);
      return false;
    }
    // The last: wait for every other piece's flag at once (thread t for worker w_lo + t), then
    // merge them one after another, with no barrier or flag between them, so that one piece's
    // loads are in flight while the one before is added (~16 pieces an item at 8 items x 103
    // key tiles: a wait, a barrier and three dependent loads a piece made the merge most of
    // the call, fa3_notes.md, session 21).
    for (int t = wg_tid; t <= w_hi - w_lo; t += 128) {
      if (w_lo + t == worker) continue;
      const int* flag = sched.split_flag + slot_of(w_lo + t);
      int up = 0;
      do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(up) : "l"(flag) : "memory");
      } while (up == 0);
    }
    cutlass::arch::NamedBarrier::sync(128, kOwn + cw);
    #pragma unroll 1
    for (int w = w_lo; w <= w_hi; ++w) {
      if (w == worker) continue;
      const float4* part = sched.split_part + int64_t(slot_of(w)) * (kVecs + 1) * 128;
      const float4 ml = __ldcg(part + kVecs * 128 + wg_tid);
      const float other_max[2] = {ml.x, ml.y}, other_sum[2] = {ml.z, ml.w};
      float mine[2], theirs[2];
      CUTE_UNROLL
      for (int mi = 0; mi < 2; ++mi) {
        const float m = fmaxf(softmax.row_max[mi], other_max[mi]);
        mine[mi] = softmax.row_max[mi] == -INFINITY
                       ? 0.f : exp2f((softmax.row_max[mi] - m) * p.softmax_scale_log2);
        theirs[mi] = other_max[mi] == -INFINITY
                         ? 0.f : exp2f((other_max[mi] - m) * p.softmax_scale_log2);
        softmax.row_max[mi] = m;
        softmax.row_sum[mi] = softmax.row_sum[mi] * mine[mi] + other_sum[mi] * theirs[mi];
      }
      // acc_o's fragment ((2 cols, 2 rows, n8), 1, 1): element k is in row (k / 2) % 2.
      CUTE_UNROLL
      for (int k = 0; k < kVecs; ++k) {
        const float4 v = __ldcg(part + k * 128 + wg_tid);
        acc_o(4 * k) = acc_o(4 * k) * mine[0] + v.x * theirs[0];
        acc_o(4 * k + 1) = acc_o(4 * k + 1) * mine[0] + v.y * theirs[0];
        acc_o(4 * k + 2) = acc_o(4 * k + 2) * mine[1] + v.z * theirs[1];
        acc_o(4 * k + 3) = acc_o(4 * k + 3) * mine[1] + v.w * theirs[1];
      }
    }
    return true;
  };

  for (int taken = 0;; ++taken) {
    const int qb = taken % Tr::kQBufs;
#ifdef FA3_TRACE
    trace_item = taken;
#endif
    if (wg_tid == 0) FA3_MARK(taken, 5 * cw + 0, clock64());
    cutlass::arch::ClusterBarrier::wait(&shared.q_full[qb], (taken / Tr::kQBufs) & 1);
    if (wg_tid == 0) FA3_MARK(taken, 5 * cw + 1, clock64());
    if (threadIdx.x == 128) FA3_MARK(taken, 53, globaltimer());
    compiler_fence();
    const int i = shared.item[qb];
    if (i < 0) break;
    Tensor tSrQ = tSrQ_bufs(_, _, _, qb);
    Item it = item_at(i);
    if constexpr (Tr::kStreamK) {
      const int2 piece = shared.piece[qb];
      it.tiles.begin = piece.x;
      it.tiles.end = piece.y;
    }
    const int wg_row0 = it.row0 + 64 * cw;
    // The key tiles this consumer's 64 rows see, of the CTA's (which the producer loads for
    // all kBlockM rows): under a causal mask the CTA's top tiles may lie above these rows'
    // diagonal, and in the last query tile the rows may all lie past seqlen_q. The consumer
    // skips those tiles' GEMMs and softmax, leaving the tensor cores to the other consumers
    // (hdim 128, 192-row tiles: 10% of the GEMMs at causal 2k, 3% at full 2k; harness, H100:
    // +9% causal 2k, +18% causal 1k, +1% full 2k, fa3_notes.md session 15). It keeps the
    // CTA's bottom tile (a window's lower edge; masked there) so that nothing but the walk is
    // live through it. Not under ping-pong, whose turns need both consumers on the same tiles.
    flash::fa2::KeyTiles tiles = it.tiles;
    if constexpr (Tr::kSchedule != Schedule::kPingPong) {
      if (!tiles.empty()) {
        const flash::fa2::KeyTiles own = mask.key_tiles<64, kBlockN>(wg_row0);
        const int end =
            wg_row0 >= p.seqlen_q || own.empty() ? tiles.begin : min(own.end, tiles.end);
        // A skipped stage is still waited for before it is released: an arrival on its empty
        // barrier must follow its fill, or this consumer's next wait on the same full barrier
        // could see the skipped phase's parity and pass before its own fill.
        #pragma unroll 1
        for (int n = tiles.end; n > end; --n) {
          pipe_k.consumer_wait(state);
          pipe_k.consumer_release(state);
          pipe_v.consumer_wait(state);
          pipe_v.consumer_release(state);
          ++state;
        }
        tiles.end = end;  // empty if end == begin, and then the unmasked range is not read
        tiles.unmasked_begin = own.unmasked_begin;
        tiles.unmasked_end = own.unmasked_end;
        if constexpr (Tr::kStreamK) {
          // A piece's unmasked tiles within it: the walk (fa2's walk_key_tiles) steps down to
          // unmasked_begin without looking at begin.
          tiles.unmasked_begin = max(tiles.unmasked_begin, tiles.begin);
          tiles.unmasked_end = max(min(tiles.unmasked_end, tiles.end), tiles.unmasked_begin);
        }
        // The lazy step (fa3_softmax.h) needs every row to have a max. The rows past the masked
        // tiles on top get one there unless the first of them (the latest diagonal) sees no key
        // above the unmasked tiles: then the first unmasked tile takes the masked step (its
        // mask changes nothing) rather than a recompute in settle().
        if (kLazySteps && tiles.end > tiles.unmasked_end &&
            tiles.unmasked_end > tiles.unmasked_begin &&
            mask.key_end(wg_row0) <= tiles.unmasked_end * kBlockN) {
          --tiles.unmasked_end;
        }
      }
    }
    // Q (and the item index) are done with once the item's last S GEMM has retired. With one
    // Q buffer that is where the consumers release it (keys walk downwards: tile begin's S), so
    // the next Q loads under the last P V; with two, after the last P V (the next item's Q is
    // loaded by then anyway, and testing for the last tile in every step spilled at hdim 128).
    auto release_q = [&] {
      compiler_fence();
      cutlass::arch::ClusterBarrier::arrive(&shared.q_empty[qb]);
      if (wg_tid == 0) FA3_MARK(taken, 19 + cw, clock64());
    };
    constexpr bool kEarlyRelease = Tr::kQBufs == 1;
    const int head = it.head, batch = it.batch;
    const flash::fa2::ScoreMod score_mod(p, batch, head);

    Softmax<2> softmax;
    bool output = true;  // stream-K: false where another piece of the item writes its O
    if (!tiles.empty()) {
      Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, Int<kBlockN>>{});
      Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
      // Score mod and mask of key tile n, in place in acc_s.
      auto scores = [&](int n, auto masked) __attribute__((always_inline)) {
        if constexpr (Tr::kScoreMod) score_mod.apply(s_rc, cS_rc, wg_row0, n * kBlockN);
        if constexpr (decltype(masked)::value) mask.apply(s_rc, cS_rc, wg_row0, n * kBlockN);
      };
      // The scores of unmasked key tile n again, from global memory with CUDA cores, into s
      // (s_rc): settle()'s rare case, where the lazy step's P went past 2^120 or to inf (a
      // logit that far above the row's running max, in log2 units). Q and K stay in global
      // memory for the whole launch, so no shared-memory stage is held for it. Rows past
      // seqlen_q have zero Q (TMA fills them so); an unmasked tile's keys are all below
      // seqlen_k.
      auto rescore = [&](auto& s, int n) {
        constexpr int kRows = decltype(size<0>(s))::value, kCols = decltype(size<1>(s))::value;
        const Element* q = static_cast<const Element*>(p.q) + batch * p.q_strides.batch +
                           head * p.q_strides.head;
        const Element* k = static_cast<const Element*>(p.k) + batch * p.k_strides.batch +
                           it.head_k * p.k_strides.head;
        const Element* q_row[kRows];
        const Element* k_row[kCols];
        float score[kRows * kCols];
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int row = wg_row0 + get<0>(cS_rc(mi, 0));
          q_row[mi] = row < p.seqlen_q ? q + int64_t(row) * p.q_strides.row : nullptr;
        }
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          k_row[ni] = k + int64_t(n * kBlockN + get<1>(cS_rc(0, ni))) * p.k_strides.row;
        }
        rescore_rows(q_row, k_row, p.head_dim, score);
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < kCols; ++ni) s(mi, ni) = score[mi * kCols + ni];
        }
        if constexpr (Tr::kScoreMod) score_mod.apply(s, cS_rc, wg_row0, n * kBlockN);
      };
      if constexpr (Tr::kSchedule == Schedule::kSerial) {
        auto step = [&](int n, auto first, auto masked) __attribute__((always_inline)) {
          pipe_k.consumer_wait(state);
          wgmma(mma_s, tSrQ, tSrK(_, _, _, state.index()), acc_s, true);
          if (decltype(first)::value && pending) store_o();  // under the S GEMM
          warpgroup_wait<0>();
          pipe_k.consumer_release(state);
          if (kEarlyRelease && n == tiles.begin) release_q();
          scores(n, masked);
          softmax.template update<decltype(first)::value>(s_rc, acc_o_rc, p.softmax_scale_log2);
          Tensor rP = flash::fa2::convert_fragment<Element>(acc_s);
          Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
          pipe_v.consumer_wait(state);
          if constexpr (decltype(first)::value) forget(acc_o);
          wgmma(mma_o, tOrP, tOrVt(_, _, _, state.index()), acc_o, decltype(first)::value);
          warpgroup_wait<0>();
          pipe_v.consumer_release(state);
          if (decltype(first)::value && wg_tid == 0) FA3_MARK(taken, 5 * cw + 2, clock64());
          ++state;
        };
        flash::fa2::walk_key_tiles(tiles, step);
      } else {
        // Tile n's step issues S[n] = Q K[n]^T, then P[n+1] V[n+1] (the tile before: keys walk
        // downwards, its P kept in 16 bits in rP), and runs the softmax of S[n] while
        // P[n+1] V[n+1] is on the tensor cores. Then it waits for P[n+1] V[n+1], rescales O for
        // tile n's max if the max grew (lazily, as FA2) and converts P[n] into rP.
        //
        // Where the wait for P[n+1] V[n+1] lands is up to ptxas, which moves a wait above any
        // ALU work of its basic block (fa3_notes.md, session 11): a wait after the softmax in
        // the same block ran before it. The O rescale's branch, after the exponentials, ends
        // the block, so the wait comes after the softmax. (Keeping P V in flight across the
        // step instead made ptxas serialise every WGMMA or reuse the registers it reads.)
        //
        // Ping-pong: the consumers take turns issuing their GEMMs (turn barrier = the named
        // barrier of 256 threads a consumer syncs on before issuing; the other consumer arrives
        // on it once it has issued its own). Consumer 1 gives consumer 0 the first turn and
        // skips its last arrive, so every barrier sees as many arrives as syncs.
        constexpr bool kPingPong = Tr::kSchedule == Schedule::kPingPong;
        auto take_turn = [&] {
          if constexpr (kPingPong) cutlass::arch::NamedBarrier::sync(256, cw);
        };
        auto pass_turn = [&] {
          if constexpr (kPingPong) cutlass::arch::NamedBarrier::arrive(256, 1 - cw);
        };
        if constexpr (kPingPong) {
          if (cw == 1) cutlass::arch::NamedBarrier::arrive(256, 0);
        }
        Tensor rP = make_tensor<Element>(acc_s.layout());
        Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
        cutlass::PipelineState<Tr::kStages> prev;
        bool o_zero = true;  // the item's first P V
#if defined(FA3_TRACE) && !defined(FA3_TRACE_NO_STEPS)
        long long tr_acc[4] = {0, 0, 0, 0};
#endif
        auto step = [&](int n, auto first, auto masked) __attribute__((always_inline)) {
          constexpr bool kFirst = decltype(first)::value;
#if defined(FA3_TRACE) && !defined(FA3_TRACE_NO_STEPS)
          const long long tr_t0 = clock64();
#endif
          pipe_k.consumer_wait(state);
          take_turn();
          wgmma(mma_s, tSrQ, tSrK(_, _, _, state.index()), acc_s, true);
          if constexpr (!kFirst) {
            pipe_v.consumer_wait(prev);
            wgmma(mma_o, tOrP, tOrVt(_, _, _, prev.index()), acc_o, o_zero);
            o_zero = false;
          }
          pass_turn();
          if (kFirst && pending) store_o();  // under the S GEMM
          warpgroup_wait<kFirst ? 0 : 1>();  // S[n]; P[n+1] V[n+1] runs on
          if (!kStageO || n != tiles.begin || cw == 1) pipe_k.consumer_release(state);
          if (kStageO && n == tiles.begin && cw == 1) {
            cutlass::arch::NamedBarrier::arrive(256, kKFree);  // consumer 0 may write this K stage
          }
          if (kEarlyRelease && n == tiles.begin) release_q();
          scores(n, masked);
          // Unmasked tiles after the first take the lazy step (no max before the exponentials,
          // fa3_softmax.h); the first and masked ones FA2's.
          constexpr bool kLazy = kLazySteps && !kFirst && !decltype(masked)::value;
          float correction[2], tile_sum[2];
          bool fix;  // a vote of the warp: rescale O (FA2's step) or settle (the lazy one)
          if constexpr (kLazy) {
            fix = softmax.exponentiate(s_rc, p.softmax_scale_log2, tile_sum);
          } else {
            fix = softmax.template online<kFirst, /*kBranch=*/false>(s_rc, p.softmax_scale_log2,
                                                                      correction);
          }
          if constexpr (!kFirst) {
            // The wait must be one instruction for the whole warpgroup (wgmma.wait_group is
            // .aligned), so not in the rescale's branch: the fix is a vote of the warp, and
            // synccheck found the warps of a warpgroup at two different waits. A branch that
            // every thread takes ends the basic block after the exponentials all the same.
            // (A vote of the four warps cost ~0.5% at hdim 256; with an empty branch or
            // __syncwarp ptxas put the wait among the exponentials: fa3_notes.md, session 19.)
            if (opaque_true()) {
              warpgroup_wait<0>();
              if constexpr (kLazy) {
                if (fix) {
                  softmax.settle(s_rc, acc_o_rc, p.softmax_scale_log2, tile_sum,
                                 [&](auto& s) { rescore(s, n); });
                }
                softmax.accumulate(tile_sum);
              } else {
                if (fix) softmax.rescale(acc_o_rc, correction);
              }
            }
            pipe_v.consumer_release(prev);
          }
          copy(flash::fa2::convert_fragment<Element>(acc_s), rP);
          if constexpr (kFirst) forget(acc_o);  // the next P V is the item's first (o_zero)
          if (kFirst && wg_tid == 0) FA3_MARK(taken, 5 * cw + 2, clock64());
#if defined(FA3_TRACE) && !defined(FA3_TRACE_NO_STEPS)
          if constexpr (!kFirst) {
            constexpr int kSlot = decltype(masked)::value ? 0 : 2;
            tr_acc[kSlot] += clock64() - tr_t0;
            tr_acc[kSlot + 1] += 1;
          }
#endif
          prev = state;
          ++state;
        };
        flash::fa2::walk_key_tiles(tiles, step);
#if defined(FA3_TRACE) && !defined(FA3_TRACE_NO_STEPS)
        if (wg_tid == 0) {
          for (int k = 0; k < 4; ++k) FA3_MARK(taken, 24 + 4 * cw + k, tr_acc[k]);
        }
#endif
        // The last tile's P V.
        if (wg_tid == 0) FA3_MARK(taken, 32 + cw, clock64());
        pipe_v.consumer_wait(prev);
        if (wg_tid == 0) FA3_MARK(taken, 34 + cw, clock64());
        take_turn();
        wgmma(mma_o, tOrP, tOrVt(_, _, _, prev.index()), acc_o, o_zero);
        if (cw == 0) pass_turn();
        warpgroup_wait<0>();
        o_state = prev;
        if (!kStageO || cw == 0) pipe_v.consumer_release(prev);
        if (kStageO && cw == 0) {
          cutlass::arch::NamedBarrier::sync(256, kKFree);    // consumer 1's last S read K
          cutlass::arch::NamedBarrier::arrive(256, kVFree);  // consumer 1 may write this V stage
        }
      }
      if (wg_tid == 0) FA3_MARK(taken, 5 * cw + 3, clock64());
      if (wg_tid == 0 && cw == 0) FA3_MARK(taken, 17, tiles.end - tiles.begin);
      if (!kEarlyRelease) release_q();
      if (threadIdx.x == 128) FA3_MARK(taken, 54, globaltimer());
      if constexpr (Tr::kStreamK) output = merge_pieces(i, softmax);
      if (threadIdx.x == 128) FA3_MARK(taken, 55, globaltimer());
    } else {
      release_q();  // only the index was read
      if (pending) store_o();
      clear(acc_o);
      for (int mi = 0; mi < 2; ++mi) softmax.row_sum[mi] = 0.f;
      // This consumer's rows see no key (its O is zeros or past seqlen_q, stored below) while
      // the other's may stage O: keep the barriers' turns (see the staged epilogue).
      if (kStageO && !it.tiles.empty()) {
        if (cw == 0) {
          cutlass::arch::NamedBarrier::sync(256, kKFree);
          cutlass::arch::NamedBarrier::arrive(256, kVFree);
        } else {
          cutlass::arch::NamedBarrier::arrive(256, kKFree);
          cutlass::arch::NamedBarrier::sync(256, kVFree);
        }
      }
    }

    if (!output) {  // stream-K: the last piece to finish writes O; keep the staged O's turns
      if constexpr (kStageO) {
        if (cw == 1) cutlass::arch::NamedBarrier::sync(256, kVFree);
        if (cw == 0) {
          pipe_k.consumer_release(o_state);
        } else {
          pipe_v.consumer_release(o_state);
        }
      }
      continue;
    }

    // ---- epilogue, first half: O /= l, in 16 bits, transposed within quads (store_o) ------
    // Each lane of a quad holds two adjacent columns of every 8-column block of its two rows; a
    // 4 x 4 transpose of those column pairs across the quad gives each lane all 8 columns of
    // one block in four. So each store is 16 bytes, a quarter of the instructions and L2
    // requests of 4-byte stores, which took 8000 cycles of an 85000-cycle item at hdim 256 2k
    // (clock64 trace, H100; fa3_notes.md, session 16). head_dim and out's strides are multiples
    // of 8 and out is 16-byte aligned (the API checks), so a block is all in or all out.
    float lse[2];
    softmax.finalize(acc_o_rc, p.softmax_scale_log2, 1.f, lse);  // O stays 0 if no key
    if (wg_tid == 0 && cw < 2) FA3_MARK(taken, 40 + cw, clock64());
    if constexpr (kStageO) {
      if (!tiles.empty()) {
        stage_o(tma.o, it, wg_row0, lse);
        if (wg_tid == 0) FA3_MARK(taken, 5 * cw + 4, clock64());
        continue;
      }
    }
    Element* o = static_cast<Element*>(p.o) + batch * p.o_strides.batch + head * p.o_strides.head;
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      const int row = wg_row0 + get<0>(cO_rc(mi, 0));
      CUTE_UNROLL
      for (int g = 0; g < kHeadDim / 32; ++g) {  // groups of four 8-column blocks
        uint32_t(&w)[4] = o_pack[mi][g];  // w[j]: this lane's column pair of block 4g + j
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          w[j] = pack2<Raw>(acc_o_rc(mi, 8 * g + 2 * j), acc_o_rc(mi, 8 * g + 2 * j + 1));
        }
        quad_transpose(w, quad);  // now w[j]: lane j's column pair of block 4g + quad
      }
      const bool in = row < p.seqlen_q;
      o_dst[mi] = in ? o + int64_t(row) * p.o_strides.row + 8 * quad : nullptr;
      lse_dst[mi] =
          in && quad == 0 ? p.lse + (int64_t(batch) * p.heads + head) * p.seqlen_q + row : nullptr;
      lse_val[mi] = lse[mi];
    }
    pending = true;
    if constexpr (!kDeferStores) store_o();
    if (wg_tid == 0) FA3_MARK(taken, 5 * cw + 4, clock64());
    if (threadIdx.x == 128) FA3_MARK(taken, 56, globaltimer());
  }  // items
  if (pending) store_o();  // the last item's
#endif
}

}  // namespace flash::fa3
