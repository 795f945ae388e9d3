// The FA3 forward's mainloop: the producer's loads and the consumers' key-tile walk.
//
// Producer (one thread): per item, publishes the item in the Q buffer's slot and loads its Q
// with TMA, then K and V of each key tile into a ring of kStages buffers guarded by mbarriers
// (CUTLASS's PipelineTmaAsync), last key tile first. In a cluster each CTA loads 1 / kClusterM
// of every K / V tile and multicasts it to all.
//
// Consumer warpgroup c (64 query rows of the item) per key tile n:
//   S = Q K[n]^T        SS WGMMA from shared memory
//   score mod, mask, online softmax (common/: the same conventions as FA2; fa3_softmax.h adds
//                       the lazy step of the overlapped schedule)
//   O += P V[n]         RS WGMMA, P from registers, V read MN-major from shared memory
// serially, or overlapped: S[n] is issued before P[n+1] V[n+1] and its softmax runs while that
// P V is on the tensor cores.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/fragment.h"
#include "common/mask.h"
#include "common/mma.cuh"
#include "common/params.h"
#include "common/score_mod.h"
#include "common/seqinfo.h"
#include "fa3/fa3_fwd_fp8.h"
#include "fa3/fa3_fwd_paged.h"
#include "fa3/fa3_item.h"
#include "fa3/fa3_scheduler.h"
#include "fa3/fa3_softmax.h"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

using namespace cute;

template <class Tr>
struct FwdMainloop {
  using Element = typename Tr::Element;
  using Pipeline = typename Tr::Pipeline;
  using PipelineState = typename Tr::PipelineState;
  using SharedStorage = typename Tr::SharedStorage;
  using RowSoftmax = typename Tr::RowSoftmax;
  using Paged = PagedKV<Tr>;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  static constexpr int kQBufs = Tr::kQBufs;
  static constexpr bool kStageO = Tr::kStageO;
  // Q (and the item index) are done with once the item's last S GEMM has retired. With one Q
  // buffer the consumers release it there (keys walk downwards: tile begin's S), so the next Q
  // loads under the last P V; with two, after the last P V (testing for the last tile in every
  // step spilled at hdim 128).
  static constexpr bool kEarlyRelease = kQBufs == 1;

  SharedStorage& shared;
  Pipeline pipe_k, pipe_v;

  static __device__ typename Pipeline::Params pipe_params(int wg) {
    typename Pipeline::Params params;
    params.role = warp_role(wg) == WarpRole::Producer ? Pipeline::ThreadCategory::Producer
                                                      : Pipeline::ThreadCategory::Consumer;
    params.is_leader = threadIdx.x == 0;
    params.num_consumers = 128 * Tr::kConsumers;
    params.transaction_bytes = Tr::kTmaBytesKV;
    return params;
  }

  // Initialises the barriers (thread 0); the kernel syncs the CTA or cluster before their use.
  __device__ FwdMainloop(SharedStorage& shared_, int wg)
      : shared(shared_),
        pipe_k(shared_.pipe_k, pipe_params(wg), typename Tr::ClusterShape{}),
        pipe_v(shared_.pipe_v, pipe_params(wg), typename Tr::ClusterShape{}) {
    if (threadIdx.x == 0) {
      for (int b = 0; b < kQBufs; ++b) {
        cutlass::arch::ClusterTransactionBarrier::init(&shared.q_full[b], 1);
        cutlass::arch::ClusterBarrier::init(&shared.q_empty[b], 128 * Tr::kConsumers);
      }
      Paged::init(shared);
      cutlass::arch::fence_barrier_init();
    }
  }

  // ---- producer -----------------------------------------------------------------------------

  // Warps 1-3 of the producer warpgroup (lane 0) where a paged call has helpers
  // (fa3_fwd_paged.h).
  template <class Tma>
  __device__ __forceinline__ void help_paged(const FwdParams& p, const Tma& tma, int warp) {
    Paged::help(p, tma, shared, pipe_k, pipe_v, warp);
  }

  // The producer thread. Two copies of its item loop: the one without helpers (dense calls,
  // paged calls with few boxes a tile) is the loop as it was before the helpers, in registers
  // and instructions; one loop testing for helpers spilled more in the two-consumer kernels'
  // 24-register producer (16 -> 56 B at hdim 128).
  template <class Tma, class Scheduler>
  __device__ __forceinline__ void load(const FwdParams& p, const Tma& tma, const Scheduler& sched,
                                       int rank) {
    if constexpr (Paged::kEnabled) {
      if (Paged::helpers(p, tma)) return load_items<true>(p, tma, sched, rank);
    }
    load_items<false>(p, tma, sched, rank);
  }

  template <bool kHelped, class Tma, class Scheduler>
  __device__ __forceinline__ void load_items(const FwdParams& p, const Tma& tma,
                                             const Scheduler& sched, int rank) {
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Tr::SmemQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Tr::SmemKV{});
    using flash::SeqInfo;
    const int batches = SeqInfo::view_batch(p);
    Tensor mQ = tma.q.get_tma_tensor(
        make_shape(SeqInfo::view_rows_q(p), p.head_dim, p.heads, batches));
    const int batches_k = SeqInfo::view_batch_k(p);
    Tensor mK = tma.k.get_tma_tensor(
        make_shape(SeqInfo::view_rows_k(p), p.head_dim, p.heads_k, batches_k));
    // FP8: V^T (head_dim, keys, heads_k, batch), fwd_fp8_vt's (dense calls only).
    Tensor mV = [&] {
      if constexpr (Tr::kFp8) {
        return tma.v.get_tma_tensor(
            make_shape(p.head_dim, int(fp8_vt_keys(p.seqlen_k)), p.heads_k, p.batch));
      } else {
        return tma.v.get_tma_tensor(
            make_shape(SeqInfo::view_rows_k(p), p.head_dim, p.heads_k, batches_k));
      }
    }();
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Tr::SmemV{});
    auto state = cutlass::make_producer_start_state<Pipeline>();
    auto kv_tma = [](auto const& tma_kv, uint64_t& full) {
      if constexpr (Tr::kClusterM > 1) {
        return tma_kv.with(full, uint16_t((1 << Tr::kClusterM) - 1));
      } else {
        return tma_kv.with(full);
      }
    };
    const int items = sched.items();  // fits (fa3_plan.h)
    Work work = sched.first();
    for (int published = 0;; ++published, work = sched.next(work)) {
      const int qb = published % kQBufs;
      uint64_t* q_full = &shared.q_full[qb];
      // Everything about the item that does not touch the Q buffer comes before the wait for
      // it: with one Q buffer the consumers wait for this load (decoding after the wait took
      // this thread 1300 cycles).
      const int i = work.item;
      const bool done = i >= items;
      Item it = item_at<Tr>(p, sched, done ? 0 : i, rank);
      if constexpr (Scheduler::kPieces) {
        it.tiles.begin = work.key_begin;
        it.tiles.end = work.key_end;
      }
      // The empty asm keeps ptxas from sinking the decode below the wait (+0.3..2.6% at hdim
      // 256).
      auto pin = [](int& x) { asm volatile("" : "+r"(x)); };
      pin(it.m_block), pin(it.head), pin(it.batch), pin(it.head_k);
      pin(it.tiles.begin), pin(it.tiles.end);
      const flash::SeqInfo seq(p, it.batch);
      // Variable-length: the tiles reach past the sequence into the next one's rows (a KV
      // cache's: into its unused rows); the consumers zero Q and V there (zero_tails) and mask
      // K.
      Tensor gQ = local_tile(seq.q_rows(p, mQ, it.head), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(it.m_block, 0));
      Tensor gK = local_tile(seq.k_rows(p, mK, it.head_k),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
      Tensor gV = [&] {
        if constexpr (Tr::kFp8) {
          return local_tile(mV(_, _, it.head_k, it.batch), Shape<Int<kHeadDim>, Int<kBlockN>>{},
                            make_coord(0, _));
        } else {
          return local_tile(seq.k_rows(p, mV, it.head_k), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                            make_coord(_, 0));
        }
      }();
      auto [tQg, tQs] = tma_partition(tma.q, Int<0>{}, Layout<_1>{},
                                      group_modes<0, 2>(sQ(_, _, qb)), group_modes<0, 2>(gQ));
      // (global, shared) pairs, not structured bindings: the loaders' lambdas capture them.
      auto tK = tma_partition(tma.k, rank, Layout<Int<Tr::kClusterM>>{}, group_modes<0, 2>(sK),
                              group_modes<0, 2>(gK));
      auto tV = tma_partition(tma.v, rank, Layout<Int<Tr::kClusterM>>{}, group_modes<0, 2>(sV),
                              group_modes<0, 2>(gV));
      if (published >= kQBufs) {
        cutlass::arch::ClusterBarrier::wait(&shared.q_empty[qb], (published / kQBufs - 1) & 1);
      }
      compiler_fence();  // the wait (asm without a memory clobber) before the write
      shared.item[qb] = done ? -1 : i;
      shared.lengths[qb] = make_int2(it.seqlen_q, it.seqlen_k);
      if constexpr (Scheduler::kPieces) {
        shared.piece[qb] = make_int2(it.tiles.begin, it.tiles.end);
      }
      compiler_fence();
      // Paged with helpers: every item goes to the helper warps too (help_paged), after its Q;
      // the end as end = -1.
      const bool paged = Paged::kEnabled && p.block_table != nullptr;
      if (done) {
        cutlass::arch::ClusterBarrier::arrive(q_full);
        if (kHelped) Paged::publish(shared, published, 0, 0, 0, 0, -1);
        break;
      }
      if (it.tiles.empty()) {
        cutlass::arch::ClusterBarrier::arrive(q_full);
        if (kHelped) Paged::publish(shared, published, 0, 0, 0, 0, 0);
        continue;
      }
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(q_full, Tr::kTmaBytesQ);
      copy(tma.q.with(*q_full), tQg, tQs);
      // The key tiles, last first. A paged call walks them in a loop of its own, so that the
      // dense loop keeps the registers it had (one loop with a per-tile branch spilled 68 bytes
      // in the two-consumer kernels: the page walk's state was hoisted out of it).
      auto walk = [&](auto load_k, auto load_v) {
        #pragma unroll 1  // unrolled, it spilled in the producer's 24 registers
        for (int n = it.tiles.end - 1; n >= it.tiles.begin; --n) {
          pipe_k.producer_acquire(state);
          load_k(n, state.index(), pipe_k.producer_get_barrier(state));
          // With one Q buffer the consumers wait for this Q and the first K: the first V
          // follows once Q has landed, so that it does not share the SM's intake with them
          // (+0.6..1.6%).
          if (kStageO && n == it.tiles.end - 1) {
            cutlass::arch::ClusterBarrier::wait(q_full, (published / kQBufs) & 1);
          }
          pipe_v.producer_acquire(state);
          load_v(n, state.index(), pipe_v.producer_get_barrier(state));
          ++state;
        }
      };
      if (kHelped) {
        Paged::publish(shared, published, seq.batch, it.head_k, it.seqlen_k, it.tiles.begin,
                       it.tiles.end);
        walk([&](int n, int stage, uint64_t* bar) {
               Paged::load_group(p, &tma.paged_k, tma.box_rows, shared.k.data(), seq.batch,
                                 it.head_k, it.seqlen_k, n, stage, bar, 0);
             },
             [&](int n, int stage, uint64_t* bar) {
               if (kStageO && n == it.tiles.end - 1) {  // after Q, by this thread alone (help)
                 Paged::load(p, &tma.paged_v, tma.box_rows, shared.v.data(), seq.batch,
                             it.head_k, it.seqlen_k, n, stage, bar);
               } else {
                 Paged::load_group(p, &tma.paged_v, tma.box_rows, shared.v.data(), seq.batch,
                                   it.head_k, it.seqlen_k, n, stage, bar, 0);
               }
             });
      } else if (paged) {
        walk([&](int n, int stage, uint64_t* bar) {
               Paged::load(p, &tma.paged_k, tma.box_rows, shared.k.data(), seq.batch, it.head_k,
                           it.seqlen_k, n, stage, bar);
             },
             [&](int n, int stage, uint64_t* bar) {
               Paged::load(p, &tma.paged_v, tma.box_rows, shared.v.data(), seq.batch, it.head_k,
                           it.seqlen_k, n, stage, bar);
             });
      } else {
        walk([&](int n, int stage, uint64_t* bar) {
               copy(kv_tma(tma.k, *bar), get<0>(tK)(_, n), get<1>(tK)(_, stage));
             },
             [&](int n, int stage, uint64_t* bar) {
               copy(kv_tma(tma.v, *bar), get<0>(tV)(_, n), get<1>(tV)(_, stage));
             });
      }
      // The loop's next() claims the next item only now, about kStages key tiles before the
      // consumers finish this one: claimed earlier, a long item's CTA held it back from CTAs
      // that freed up meanwhile (hdim 256 16k causal: 650 against 765 TFLOP/s).
    }
    // In a cluster, the other CTAs' consumers arrive on this CTA's empty barriers: wait for the
    // last of them before this CTA (and its shared memory) may go.
    if constexpr (Tr::kClusterM > 1) {
      pipe_k.producer_tail(state);
      pipe_v.producer_tail(state);
    }
  }

  // ---- consumers ----------------------------------------------------------------------------

  // The next item published in Q buffer qb (-1: none left), once its Q has landed.
  __device__ __forceinline__ int take(int taken) {
    const int qb = taken % kQBufs;
    cutlass::arch::ClusterBarrier::wait(&shared.q_full[qb], (taken / kQBufs) & 1);
    compiler_fence();
    return shared.item[qb];
  }
  __device__ __forceinline__ void release_q(int qb) {
    compiler_fence();
    cutlass::arch::ClusterBarrier::arrive(&shared.q_empty[qb]);
  }

  // The key tiles this consumer's 64 rows (from wg_row0) see, of the CTA's (which the producer
  // loads for all kBlockM rows): under a causal mask the CTA's top tiles may lie above these
  // rows' diagonal, and in the last query tile the rows may all lie past seqlen_q. The consumer
  // skips those tiles' GEMMs and softmax, leaving the tensor cores to the others (+9% causal
  // 2k, +18% causal 1k at hdim 128). It keeps the CTA's bottom tile (a window's lower edge;
  // masked there) so that nothing but the walk is live through it.
  __device__ __forceinline__ flash::KeyTiles consumer_tiles(const flash::Mask& mask,
                                                            flash::KeyTiles tiles, int wg_row0,
                                                            PipelineState& state) {
    if (tiles.empty()) return tiles;
    const flash::KeyTiles own = mask.key_tiles<64, kBlockN>(wg_row0);
    const int end =
        wg_row0 >= mask.seqlen_q || own.empty() ? tiles.begin : min(own.end, tiles.end);
    // A skipped stage is still waited for before it is released: an arrival on its empty
    // barrier must follow its fill, or this consumer's next wait on the same full barrier could
    // see the skipped phase's parity and pass before its own fill.
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
      // A piece's unmasked tiles within it: the walk steps down to unmasked_begin without
      // looking at begin.
      tiles.unmasked_begin = max(tiles.unmasked_begin, tiles.begin);
      tiles.unmasked_end = max(min(tiles.unmasked_end, tiles.end), tiles.unmasked_begin);
    }
    // The lazy step needs every row to have a max. The rows past the masked tiles on top get
    // one there unless the first of them (the latest diagonal) sees no key above the unmasked
    // tiles: then the first unmasked tile takes the masked step (its mask changes nothing)
    // rather than a recompute in settle().
    if (Tr::kLazySteps && tiles.end > tiles.unmasked_end &&
        tiles.unmasked_end > tiles.unmasked_begin &&
        mask.key_end(wg_row0) <= tiles.unmasked_end * kBlockN) {
      --tiles.unmasked_end;
    }
    return tiles;
  }

  // Variable-length and KV caches: the tiles read rows past the sequence (the next sequence's, what
  // lies past seqused, a cache's rows past its length), where a dense call's TMA fills zeros.
  // Before its walk, a consumer zeroes them in shared memory: its own Q rows past the used rows,
  // and the V rows of the walk's first tile (the sequence's last) past its keys, which P = 0 does
  // not cancel where they are inf or NaN. The rows past the used ones then vote as in a dense call
  // (the lazy softmax's rescale is a warp's vote), so a packed batch of equal lengths gives the
  // dense result. K rows past the keys are masked. Both consumers write the same zeros into V; the
  // stage is not refilled before both release it.
  __device__ __forceinline__ void zero_tails(const FwdParams& p, const flash::Mask& mask,
                                             int n, PipelineState& st, int wg_row0, int qb,
                                             int cw) {
    if (Tr::kFp8 || (p.cu_seqlens_q == nullptr && !p.kv_cache)) return;  // FP8: dense only
    const int q_valid = max(mask.seqlen_q - wg_row0, 0), v_valid = mask.seqlen_k - n * kBlockN;
    if (q_valid >= 64 && v_valid >= kBlockN) return;
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of a row: contiguous under the swizzle
    const int wg_tid = threadIdx.x % 128;
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Tr::SmemQ{});
    #pragma unroll 1
    for (int i = wg_tid; i < (64 - q_valid) * kChunks; i += 128) {
      *reinterpret_cast<uint4*>(&sQ(64 * cw + q_valid + i / kChunks, i % kChunks * 8, qb)) =
          make_uint4(0, 0, 0, 0);
    }
    if (v_valid < kBlockN) {
      pipe_v.consumer_wait(st);
      Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Tr::SmemKV{});
      #pragma unroll 1
      for (int i = wg_tid; i < (kBlockN - v_valid) * kChunks; i += 128) {
        *reinterpret_cast<uint4*>(&sV(v_valid + i / kChunks, i % kChunks * 8, st.index())) =
            make_uint4(0, 0, 0, 0);
      }
    }
    cutlass::arch::fence_view_async_shared();  // the writes, before WGMMA's async proxy reads
    barrier_sync(128, FwdBarrier::ConsumerOwn, cw);
  }

  // ---- consumers: P as the A operand of P V ---------------------------------------------------

  // Its registers: 16 bits in the S accumulator's layout, FP8 as PFragmentFp8's words
  // (fa3_fwd_fp8.h); convert_p writes P there, p_operand views them as the operand.
  template <class AccS>
  static __device__ __forceinline__ auto p_registers(const AccS& acc_s) {
    if constexpr (Tr::kFp8) {
      return make_tensor<uint32_t>(PWordsFp8<kBlockN>{});
    } else {
      return make_tensor<Element>(acc_s.layout());
    }
  }
  template <class AccS, class P>
  static __device__ __forceinline__ void convert_p(const AccS& acc_s, P& rP) {
    if constexpr (Tr::kFp8) {
      convert_p_fp8(acc_s, rP);
    } else {
      copy(flash::convert_fragment<Element>(acc_s), rP);
    }
  }
  template <class P>
  static __device__ __forceinline__ auto p_operand(P& rP) {
    if constexpr (Tr::kFp8) {
      return p_operand_fp8<Element, kBlockN>(rP);
    } else {
      return make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
    }
  }

  // ---- consumers: the key-tile walk -----------------------------------------------------------

  // Consumer cw's walk over one item's key tiles (non-empty), from the last to the first:
  // leaves the unnormalised O in acc_o and the row statistics in softmax. o_state: the item's
  // last K / V stage, which the staged epilogue borrows. epi.flush() runs under the item's first
  // S GEMM (the previous item's deferred stores, fa3_fwd_epilogue.h).
  template <class AccO, class Epilogue>
  __device__ __forceinline__ void mma(const FwdParams& p, const flash::SeqInfo& seq,
                                      const flash::Mask& mask, const Item& it,
                                      const flash::KeyTiles& tiles, int qb, int cw, int wg_row0,
                                      PipelineState& state, PipelineState& o_state, AccO& acc_o,
                                      RowSoftmax& softmax, Epilogue& epi) {
    const int wg_tid = threadIdx.x % 128;
    typename Tr::MmaS mma_s;
    typename Tr::MmaO mma_o;
    auto thr_s = mma_s.get_thread_slice(wg_tid);
    auto thr_o = mma_o.get_thread_slice(wg_tid);
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Tr::SmemQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Tr::SmemKV{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Tr::SmemVt{});
    Tensor sQ_wg = local_tile(sQ, Shape<_64, Int<kHeadDim>>{}, make_coord(cw, 0));  // (64, d, buf)
    Tensor tSrQ = thr_s.partition_fragment_A(sQ_wg)(_, _, _, qb);  // descriptors (MMA, M, K)
    Tensor tSrK = thr_s.partition_fragment_B(sK);                  // (MMA, N, K, stage)
    Tensor tOrVt = thr_o.partition_fragment_B(sVt);                // (MMA, N, K, stage)
    Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
    Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
    Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));
    const flash::ScoreMod score_mod(p, seq, it.head);
    // The softmax scale: FP8's folds the item's q and k descales (fa3_fwd_fp8.h).
    float fp8_scale_log2 = 0.f;
    if constexpr (Tr::kFp8) fp8_scale_log2 = fp8_scales(p, it.batch, it.head_k).scale_log2;
    auto scale_log2 = [&]() __attribute__((always_inline)) {
      if constexpr (Tr::kFp8) {
        return fp8_scale_log2;
      } else {
        return p.softmax_scale_log2;
      }
    };

    Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, Int<kBlockN>>{});  // (MMA, M, N)
    Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));          // (rows, cols)
    // Score mod and mask of key tile n, in place in acc_s.
    auto scores = [&](int n, auto masked) __attribute__((always_inline)) {
      if constexpr (Tr::kScoreMod) score_mod.apply(s_rc, cS_rc, wg_row0, n * kBlockN);
      if constexpr (decltype(masked)::value) mask.apply(s_rc, cS_rc, wg_row0, n * kBlockN);
    };
    // The scores of unmasked key tile n again, from global memory with CUDA cores, into s:
    // settle()'s rare case, where the lazy step's P went past 2^120 or to inf. Q and K stay in
    // global memory for the whole launch, so no shared-memory stage is held for it. Rows past
    // seqlen_q have zero Q (TMA fills them so); an unmasked tile's keys are below seqlen_k.
    auto rescore = [&](auto& s, int n) {
      constexpr int kRows = decltype(size<0>(s))::value, kCols = decltype(size<1>(s))::value;
      const Element* q = static_cast<const Element*>(p.q) + seq.q_offset(p, it.head);
      const Element* k = static_cast<const Element*>(p.k) + seq.k_offset(p, it.head_k);
      const Element* q_row[kRows];
      const Element* k_row[kCols];
      float score[kRows * kCols];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int row = wg_row0 + get<0>(cS_rc(mi, 0));
        q_row[mi] = row < seq.seqlen_q(p) ? q + int64_t(row) * p.q_strides.row : nullptr;
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

    // Before the walk, while no accumulator is live.
    zero_tails(p, mask, tiles.end - 1, state, wg_row0, qb, cw);
    if constexpr (Tr::kSchedule == Schedule::kSerial) {
      auto step = [&](int n, auto first, auto masked) __attribute__((always_inline)) {
        pipe_k.consumer_wait(state);
        wgmma(mma_s, tSrQ, tSrK(_, _, _, state.index()), acc_s, true);
        if constexpr (decltype(first)::value) epi.flush(p);  // under the S GEMM
        warpgroup_wait<0>();
        pipe_k.consumer_release(state);
        if (kEarlyRelease && n == tiles.begin) release_q(qb);
        scores(n, masked);
        softmax.template update<decltype(first)::value>(s_rc, acc_o_rc, scale_log2());
        // 16 bits: the converted fragment itself (declared, then copied into, it compiled
        // differently).
        Tensor rP = [&] {
          if constexpr (Tr::kFp8) {
            Tensor r = p_registers(acc_s);
            convert_p(acc_s, r);
            return r;
          } else {
            return flash::convert_fragment<Element>(acc_s);
          }
        }();
        Tensor tOrP = p_operand(rP);
        pipe_v.consumer_wait(state);
        if constexpr (decltype(first)::value) forget(acc_o);
        wgmma(mma_o, tOrP, tOrVt(_, _, _, state.index()), acc_o, decltype(first)::value);
        warpgroup_wait<0>();
        pipe_v.consumer_release(state);
        ++state;
      };
      flash::walk_key_tiles(tiles, step);
      return;
    }
    // Overlap: tile n's step issues S[n] = Q K[n]^T, then P[n+1] V[n+1] (the tile before: keys
    // walk downwards, its P kept in 16 bits in rP), and runs the softmax of S[n] while
    // P[n+1] V[n+1] is on the tensor cores. Then it waits for P[n+1] V[n+1], rescales O for
    // tile n's max if the max grew (lazily, as FA2) and converts P[n] into rP.
    //
    // ptxas moves a wait above any ALU work of its basic block, so a wait after the softmax in
    // the same block ran before it. The O rescale's branch, after the exponentials, ends the
    // block, so the wait comes after the softmax. (Keeping P V in flight across the step made
    // ptxas serialise every WGMMA or reuse the registers it reads.)
    //
    // Staged epilogue (kStageO): consumer 1 holds its release of the item's last K stage and
    // consumer 0 of the last V stage; the epilogue writes O there (fa3_fwd_epilogue.h).
    Tensor rP = p_registers(acc_s);
    Tensor tOrP = p_operand(rP);
    PipelineState prev;
    bool o_zero = true;  // the item's first P V
    auto step = [&](int n, auto first, auto masked) __attribute__((always_inline)) {
      constexpr bool kFirst = decltype(first)::value;
      pipe_k.consumer_wait(state);
      wgmma(mma_s, tSrQ, tSrK(_, _, _, state.index()), acc_s, true);
      if constexpr (!kFirst) {
        pipe_v.consumer_wait(prev);
        wgmma(mma_o, tOrP, tOrVt(_, _, _, prev.index()), acc_o, o_zero);
        o_zero = false;
      }
      if constexpr (kFirst) epi.flush(p);  // under the S GEMM
      warpgroup_wait<kFirst ? 0 : 1>();  // S[n]; P[n+1] V[n+1] runs on
      if (!kStageO || n != tiles.begin || cw == 1) pipe_k.consumer_release(state);
      if (kStageO && n == tiles.begin && cw == 1) {
        barrier_arrive(256, FwdBarrier::KFree);  // consumer 0 may write this K stage
      }
      if (kEarlyRelease && n == tiles.begin) release_q(qb);
      scores(n, masked);
      // Unmasked tiles after the first take the lazy step (no max before the exponentials,
      // fa3_softmax.h); the first and masked ones FA2's.
      constexpr bool kLazy = Tr::kLazySteps && !kFirst && !decltype(masked)::value;
      float correction[2], tile_sum[2];
      bool fix;  // a vote of the warp: rescale O (FA2's step) or settle (the lazy one)
      if constexpr (kLazy) {
        fix = softmax.exponentiate(s_rc, scale_log2(), tile_sum);
      } else {
        fix = softmax.template online<kFirst, /*kBranch=*/false>(s_rc, scale_log2(),
                                                                  correction);
      }
      if constexpr (!kFirst) {
        // The wait must be one instruction for the whole warpgroup (wgmma.wait_group is
        // .aligned), so not in the rescale's branch, whose condition is a vote of the warp
        // (synccheck found the warps at two different waits). A branch that every thread takes
        // ends the basic block after the exponentials all the same.
        if (opaque_true()) {
          warpgroup_wait<0>();
          if constexpr (kLazy) {
            if (fix) {
              softmax.settle(s_rc, acc_o_rc, scale_log2(), tile_sum,
                             [&](auto& s) { rescore(s, n); });
            }
            softmax.accumulate(tile_sum);
          } else {
            if (fix) softmax.rescale(acc_o_rc, correction);
          }
        }
        pipe_v.consumer_release(prev);
      }
      convert_p(acc_s, rP);
      if constexpr (kFirst) forget(acc_o);  // the next P V is the item's first (o_zero)
      prev = state;
      ++state;
    };
    flash::walk_key_tiles(tiles, step);
    // The last tile's P V.
    pipe_v.consumer_wait(prev);
    wgmma(mma_o, tOrP, tOrVt(_, _, _, prev.index()), acc_o, o_zero);
    warpgroup_wait<0>();
    o_state = prev;
    if (!kStageO || cw == 0) pipe_v.consumer_release(prev);
    if (kStageO && cw == 0) {
      barrier_sync(256, FwdBarrier::KFree);      // consumer 1's last S read K
      barrier_arrive(256, FwdBarrier::VFree);    // consumer 1 may write this V stage
    }
  }
};

}  // namespace flash::fa3
