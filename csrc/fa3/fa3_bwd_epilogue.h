// The FA3 backward's gradients out (fa3_bwd_kernel.cuh): the dQ writer warp's bulk reduce-adds
// of the consumers' staged dQ tiles into the fp32 accumulator (in turn in deterministic mode),
// and the consumers' dK / dV stores.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/mask.h"
#include "common/mma.cuh"
#include "common/params.h"
#include "common/query_tiles.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_items.h"
#include "fa3/fa3_bwd_prep.cuh"
#include "fa3/fa3_bwd_traits.h"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

// The deterministic mode's turns (the dQ writer's first thread). The proxy fences order the
// bulk adds (the async proxy) after the acquire and before the release.
__device__ __forceinline__ void dq_turn_wait(const int* counter, int turn) {
  int seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    if (seen == turn) break;
    __nanosleep(32);
  }
  fence_proxy_async_global();
}
__device__ __forceinline__ void dq_turn_pass(int* counter) {
  bulk_wait_complete();
  fence_proxy_async_global();
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// The dQ writer's add of the staged tile at `offset` floats (query tile m_tile of its (batch,
// head)) into the accumulator: tile t = offset / (kBlockM kHeadDim) of the scratch's kBlockM-row
// tiles, in copy n_block % dq_copies, whose turn counter is that copy's dq_turns[t].
// Deterministic mode waits for its turn first, and the first turn stores, over an accumulator
// that no memset zeroed. Returns once the add is issued, with the turn counter (nullptr in
// default mode), whose turn the caller passes once the add is complete (dq_turn_pass).
template <class Tr>
__device__ __forceinline__ int* add_dq_tile(const BwdParams& p, const BwdScratch& s,
                                            int n_block, const Mask& mask, int m_tile,
                                            int64_t offset, const float* tile) {
  constexpr int kTile = Tr::kBlockM * Tr::kHeadDim;
  const int dq_copy = n_block % s.dq_copies;
  int* turns = nullptr;
  int turn = -1;
  if (s.dq_turns != nullptr) {
    turns = s.dq_turns + dq_copy * (s.dq_copy_stride / kTile) + offset / kTile;
    const int last = last_key_tile_of<Tr::kBlockM, Tr::kBlockN>(mask, m_tile, n_block);
    turn = (last - n_block) / s.dq_copies;
    dq_turn_wait(turns, turn);
  }
  float* const dst = s.dq + dq_copy * s.dq_copy_stride + offset;
  if (turn == 0) {
    bulk_store(dst, tile, Tr::kdQBytes);
  } else {
    bulk_reduce_add(dst, tile, Tr::kdQBytes);
  }
  return turns;
}
// The same add in parts (the wide tile's halves): dq_target waits for the turn as
// add_dq_tile does, then DqTarget::add issues each part. (Kept apart from add_dq_tile:
// sharing it changed the narrow kernels' writer code.)
struct DqTarget {
  float* dst;
  int* turns;  // nullptr in default mode
  bool store;
  // Floats [begin, begin + bytes / 4) of the staged tile into the target, one bulk group.
  __device__ __forceinline__ void add(const float* tile, int begin, int bytes) const {
    if (store) {
      bulk_store(dst + begin, tile + begin, bytes);
    } else {
      bulk_reduce_add(dst + begin, tile + begin, bytes);
    }
  }
};
template <class Tr>
__device__ __forceinline__ DqTarget dq_target(const BwdParams& p, const BwdScratch& s,
                                              int n_block, const Mask& mask, int m_tile,
                                              int64_t offset) {
  constexpr int kTile = Tr::kBlockM * Tr::kHeadDim;
  const int dq_copy = n_block % s.dq_copies;
  DqTarget t{nullptr, nullptr, false};
  if (s.dq_turns != nullptr) {
    t.turns = s.dq_turns + dq_copy * (s.dq_copy_stride / kTile) + offset / kTile;
    const int last = last_key_tile_of<Tr::kBlockM, Tr::kBlockN>(mask, m_tile, n_block);
    const int turn = (last - n_block) / s.dq_copies;
    dq_turn_wait(t.turns, turn);
    t.store = turn == 0;
  }
  t.dst = s.dq + dq_copy * s.dq_copy_stride + offset;
  return t;
}

// The narrow tile's dQ conversion in the main kernel (BwdPlan::fused_dq). The dQ writer counts
// each of its adds in the query tile's arrival counter once the add is complete (a step late,
// when it is: the wait costs nothing); the key tile whose count is the tile's last posts the
// tile to the converter, the producer warpgroup's idle warps 2-3, through a queue of
// kConvQueue mbarrier pairs, or leaves it to the conversion pass when the queue is full, so
// that a slow converter never holds back the writer and, through its staging buffers, the
// steps. (In full attention the CTA that started a head's walk last adds last into every tile
// it walks.) The converter reads the tile from L2 in bulk copies of kConvChunkBytes and stores
// dQ as the pass does (fa3_bwd_prep.cuh: times softmax_scale, in the output dtype).
template <class Tr>
struct BwdConverter {
  using Shared = typename Tr::SharedStorage;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kQueue = Tr::kConvQueue;
  static constexpr int kThreads = 64;  // warps 2-3
  static constexpr int kChunkFloats = Tr::kConvChunkBytes / 4;
  static constexpr int kChunkRows = kChunkFloats / 512;  // rows of 128 float4 (dq_slot's order)

  static __device__ __forceinline__ void init(Shared& shared) {  // thread 0, before the sync
    for (int k = 0; k < kQueue; ++k) {
      cutlass::arch::ClusterBarrier::init(&shared.conv_full[k], 1);
      cutlass::arch::ClusterBarrier::init(&shared.conv_empty[k], 1);
    }
    for (int k = 0; k < Tr::kConvStages; ++k) bulk_barrier_init(&shared.chunk_full[k]);
  }

  // The key tiles that add into query tile m of the mask's sequence, n_block one of them: in
  // full attention all the sequence's key tiles; else from the first to the last walking it.
  static __device__ __forceinline__ int adders(const Mask& mask, int m, int n_block) {
    if (mask.left < 0 && mask.right < 0) return div_up(mask.seqlen_k, kBlockN);
    return last_key_tile_of<kBlockM, kBlockN>(mask, m, n_block) -
           first_key_tile_of<kBlockM, kBlockN>(mask, m, n_block) + 1;
  }

  // The dQ writer's leader's side.
  struct Writer {
    int pending = -1, pending_adders = 0;  // the tile of its newest add, not yet counted
    int posted = 0;                        // tiles posted to the queue

    // An add into tile `tile` issued (the newest bulk group): the add before it is complete
    // once all but the newest group are, and is counted.
    __device__ __forceinline__ void added(const BwdScratch& s, Shared& shared, int tile,
                                          int adders) {
      if (pending >= 0) {
        bulk_wait_complete<1>();
        count(s, shared);
      }
      pending = tile;
      pending_adders = adders;
    }
    // After the CTA's last add: count it and end the converter's queue.
    __device__ __forceinline__ void finish(const BwdScratch& s, Shared& shared) {
      if (pending >= 0) {
        bulk_wait_complete();
        count(s, shared);
      }
      post(shared, -1, true);
    }
    // The proxy fence orders the complete bulk add (the async proxy) before the count; the
    // count's acquire makes the other adders' adds visible to the last one.
    __device__ __forceinline__ void count(const BwdScratch& s, Shared& shared) {
      fence_proxy_async_global();
      int before;
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                   : "=r"(before)
                   : "l"(s.dq_arrivals + pending)
                   : "memory");
      if (before == pending_adders - 1 && post(shared, pending, false)) {
        s.dq_arrivals[pending] = -1;  // the pass skips it
      }
    }
    // Tile into the queue (-1: the end), if a slot is free or `wait`.
    __device__ __forceinline__ bool post(Shared& shared, int tile, bool wait) {
      const int k = posted % kQueue;
      const uint32_t free_parity = ((posted / kQueue) & 1) ^ 1;  // all free at the start
      if (wait) {
        cutlass::arch::ClusterBarrier::wait(&shared.conv_empty[k], free_parity);
      } else if (!cutlass::arch::ClusterBarrier::test_wait(&shared.conv_empty[k], free_parity, 1)) {
        return false;
      }
      compiler_fence();
      shared.conv_tile[k] = tile;
      compiler_fence();
      cutlass::arch::ClusterBarrier::arrive(&shared.conv_full[k]);
      ++posted;
      return true;
    }
  };

  // The converter (threads 64-127) until the writer's end of the queue.
  static __device__ __forceinline__ void run(const BwdParams& p, const BwdScratch& s,
                                             Shared& shared) {
    const int u = threadIdx.x - 64;
    int chunks = 0;  // chunks read so far: the next one's stage and phase
    #pragma unroll 1
    for (int k = 0;; ++k) {
      cutlass::arch::ClusterBarrier::wait(&shared.conv_full[k % kQueue], (k / kQueue) & 1);
      compiler_fence();
      const int tile = shared.conv_tile[k % kQueue];
      if (tile < 0) break;
      convert(p, s, shared, tile, chunks, u);
      chunks += Tr::kConvChunks;
      if (u == 0) cutlass::arch::ClusterBarrier::arrive(&shared.conv_empty[k % kQueue]);
    }
  }

  // Tile `tile` of the accumulator: chunk c through stage (chunks + c) % 2, two in flight.
  static __device__ __forceinline__ void convert(const BwdParams& p, const BwdScratch& s,
                                                 Shared& shared, int tile, int chunks, int u) {
    static_assert(Tr::kConverter && kChunkFloats % 512 == 0);
    using T = typename Tr::Raw;
    constexpr int kStages = Tr::kConvStages, kChunks = Tr::kConvChunks;
    const int tiles_per_head = int(s.rows_pad / kBlockM);
    const int bh = tile / tiles_per_head, m_tile = tile % tiles_per_head;
    const int h = bh % p.heads;
    const SeqInfo seq(p, bh / p.heads);
    const int rows = seq.rows_q(p) - m_tile * kBlockM;  // of the tile's
    T* const dq = static_cast<T*>(p.dq) + seq.dq_offset(p, h) +
                  int64_t(m_tile) * kBlockM * p.dq_strides.row;
    const float* const src = s.dq + int64_t(tile) * kBlockM * Tr::kHeadDim;
    auto issue = [&](int c) {
      const int stage = (chunks + c) % kStages;
      fence_proxy_async();  // the stage's reads, before the barrier, ahead of the copy's writes
      bulk_expect(&shared.chunk_full[stage], Tr::kConvChunkBytes);
      bulk_copy(shared.conv + stage * kChunkFloats, src + c * kChunkFloats,
                Tr::kConvChunkBytes, &shared.chunk_full[stage]);
    };
    if (u == 0) {
      // The writer's acquire of the adds (handed over by conv_full) before the bulk reads.
      fence_proxy_async_global();
      CUTE_UNROLL
      for (int c = 0; c < kStages && c < kChunks; ++c) issue(c);
    }
    // Float4 j of the dQ MMA's thread t holds (m, n) = (l / 4 + 16 w + 8 (k / 2), 8 j + 2 (l % 4)
    // + k % 2) for its values k (lane l, warp w; the layout the pass reads through CuTe):
    // (row, column) of dQ, or (column, row) for dQ^T. This thread takes t = u and u + 64.
    const int m0 = u % 32 / 4 + 16 * (u / 32), n0 = 2 * (u % 4);
    const float scale = p.softmax_scale;
    const int64_t stride = p.dq_strides.row;
    #pragma unroll 1
    for (int c = 0; c < kChunks; ++c) {
      const int stage = (chunks + c) % kStages;
      bulk_wait(&shared.chunk_full[stage], ((chunks + c) / kStages) & 1);
      const float4* buf = reinterpret_cast<const float4*>(shared.conv + stage * kChunkFloats);
      #pragma unroll 1
      for (int rr = 0; rr < kChunkRows; ++rr) {
        const int row = c * kChunkRows + rr;  // slot row / kVecs (narrow: the part), j
        const int part = row / Tr::kdQPartVecs, j = row % Tr::kdQPartVecs;
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
          const float4 v = buf[rr * 128 + u + 64 * half];
          const int m = m0 + 32 * half, n = 8 * j + n0;
          if constexpr (Tr::kdQT) {  // m: the column, n: the row within the part's rows
            const int r = Tr::dq_part_row0(part) + n;
            T* const d = dq + int64_t(r) * stride + m;
            if (r < rows && m < p.head_dim) store1(d, v.x * scale);
            if (r + 1 < rows && m < p.head_dim) store1(d + stride, v.y * scale);
            if (r < rows && m + 8 < p.head_dim) store1(d + 8, v.z * scale);
            if (r + 1 < rows && m + 8 < p.head_dim) store1(d + stride + 8, v.w * scale);
          } else {  // m: the row, n: the column within the part's columns
            const int col = Tr::dq_part_col0(part) + n;
            if (col < p.head_dim) {
              T* const d = dq + int64_t(m) * stride + col;
              if (m < rows) store2(d, v.x * scale, v.y * scale);
              if (m + 8 < rows) store2(d + 8 * stride, v.z * scale, v.w * scale);
            }
          }
        }
      }
      __syncwarp();  // converged at the barrier (bar.sync is .aligned)
      cutlass::arch::NamedBarrier::sync(kThreads, uint32_t(BwdBarrier::Convert));
      if (u == 0 && c + kStages < kChunks) issue(c + kStages);
    }
  }
};

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
  template <bool kPersistent>
  static __device__ __forceinline__ void write_dq(const BwdParams& p, const BwdScratch& s,
                                                  typename Tr::SharedStorage& shared) {
    using cutlass::arch::NamedBarrier;
    constexpr uint32_t kFull = uint32_t(BwdBarrier::dQFull);
    constexpr uint32_t kEmpty = uint32_t(BwdBarrier::dQEmpty);
    const int64_t rows_q = s.rows_pad;
    const bool leader = threadIdx.x == 32;
    // The fused conversion's counts (BwdConverter): the narrow persistent kernels.
    using Converter = BwdConverter<Tr>;
    constexpr bool kConverter = Tr::kConverter && kPersistent;
    const bool fused = kConverter && s.dq_arrivals != nullptr;
    typename Converter::Writer conv;
    for (int h = 0; h < Tr::kdQHandoffs; ++h) NamedBarrier::arrive(kdQBarrierThreads, kEmpty + h);
    int b = 0;
    #pragma unroll 1
    for (int taken = 0;; ++taken) {
      using Items = BwdItems<Tr, kPersistent>;
      const int item = Items::take(shared, taken);
      Items::release(shared, taken);  // the writer reads nothing else of the slot or K / V
      if (item < 0) break;
      const BwdWork<Tr, kPersistent> w(p, s, item);
      if (w.steps.count() == 0) continue;
      // The scratch row of the group's first head, then of each next one.
      int64_t head_row =
          (int64_t(w.it.batch) * p.heads + w.it.head_k * w.steps.heads_per_kv) * rows_q;
      #pragma unroll 1
      for (int hq = 0; hq < w.steps.heads_per_kv; ++hq, head_row += rows_q) {
        #pragma unroll 1
        for (int m = w.steps.m_begin; m < w.steps.m_end; ++m) {
          // A deterministic add's turn passes once it is complete: in the narrow tile before
          // the buffer's free (the turns are the chain that waits: after it cost 2-12% at
          // head dims 64-128), in the wide tile after it (held through the whole add, it
          // kept the consumers' next staging waiting: +6..+18% at 192 / 256).
          if constexpr (Tr::kWide) {
            constexpr int kHalf = Tr::kdQBytes / 2;
            const float* tile = shared.dq(0);
            DqTarget target{};
            NamedBarrier::sync(kdQBarrierThreads, kFull + 1);
            if (leader) {
              target = dq_target<Tr>(p, s, w.it.n_block, w.mask, m,
                                     (head_row + m * kBlockM) * kHeadDim);
              target.add(tile, kHalf / 4, kHalf);
            }
            __syncwarp();
            NamedBarrier::sync(kdQBarrierThreads, kFull);
            if (leader) {
              target.add(tile, 0, kHalf);
              bulk_wait_read<1>();
            }
            __syncwarp();
            NamedBarrier::arrive(kdQBarrierThreads, kEmpty + 1);
            if (leader) bulk_wait_read<0>();
            __syncwarp();
            NamedBarrier::arrive(kdQBarrierThreads, kEmpty);
            if (leader && target.turns != nullptr) dq_turn_pass(target.turns);
            __syncwarp();  // converged at the next named barrier (bar.sync is .aligned)
          } else {
            NamedBarrier::sync(kdQBarrierThreads, kFull + b);
            int* turns = nullptr;
            if (leader) {
              turns = add_dq_tile<Tr>(p, s, w.it.n_block, w.mask, m,
                                      (head_row + m * kBlockM) * kHeadDim, shared.dq(b));
              if (turns != nullptr) {
                dq_turn_pass(turns);
              } else {
                bulk_wait_read();
              }
            }
            __syncwarp();
            NamedBarrier::arrive(kdQBarrierThreads, kEmpty + b);
            if constexpr (kConverter) {
              if (fused && leader) {
                conv.added(s, shared, int(head_row / kBlockM) + m,
                           Converter::adders(w.mask, m, w.it.n_block));
              }
              __syncwarp();
            }
            b ^= 1;
          }
        }
      }
    }
    if constexpr (kConverter) {
      if (fused && leader) conv.finish(s, shared);
    }
    if (leader) bulk_wait_complete();  // done before the CTA's shared memory goes
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
