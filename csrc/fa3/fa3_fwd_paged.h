// FA3's paged K / V (params.block_table): a key tile of a paged cache loaded by the producer as
// TMA boxes that each lie within one page, from the 4-D maps over the page pools the launcher
// builds (fa3_fwd_launch.cuh: head_dim, rows of a page, heads_k, pages). Where a tile has many
// boxes the producer warpgroup's four warps issue them: the producer thread hands each item to
// warps 1-3 (publish / help) and every warp loads its share onto the same pipeline stages.
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/mma.cuh"
#include "common/params.h"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

template <class Tr>
struct PagedKV {
  using Element = typename Tr::Element;
  static constexpr int kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  // Paged K / V run on the kernels without clusters or stream-K (a paged call is planned as
  // variable-length: fa3_plan.h); the others keep the dense producer alone.
  static constexpr bool kEnabled = Tr::kClusterM == 1 && !Tr::kStreamK;
  // The boxes' column width: a swizzle atom's (64 columns in the 128-byte swizzle, 32 at hdim
  // 96's 64-byte one). In SmemKV the atoms of a column block lie row after row for all kBlockN
  // rows, so column block c of tile rows [r, r + box_rows) starts at c * kBlockN * kBoxCols +
  // r * kBoxCols elements into the stage (r a multiple of the atom's 8 rows).
  static constexpr int kBoxCols = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kParts = kHeadDim / kBoxCols;  // boxes side by side across a row
  static constexpr int kWarps = 4;  // the producer warpgroup's, each issuing boxes with helpers

  // Whether warps 1-3 of the producer warpgroup issue a share of a paged call's boxes: where a
  // key tile has a row group of boxes (load_group) for each warp (box_rows at most kBlockN / 4:
  // pages of 8 / 16 / 32 rows at kBlockN 128, pages whose boxes have 8 or 16 rows at hdim 192 /
  // 256's kBlockN 112 / 80).
  template <class Tma>
  static __device__ __forceinline__ bool helpers(const FwdParams& p, const Tma& tma) {
    return kEnabled && p.block_table != nullptr && kBlockN / tma.box_rows >= kWarps;
  }

  // Key tile n of sequence `batch` (seqlen_k keys) into stage `stage` of `buf` (shared.k or
  // .v) as boxes of box_rows rows (a divisor of kBlockN and of the page size, a multiple of 8:
  // fa3.h), each within one page. The boxes past the sequence's last key repeat its last box,
  // so that the stage receives the bytes its barrier expects from rows of the sequence's own
  // pages (the consumers mask those keys and zero their V rows, as in a KV cache's tail:
  // FwdMainloop::zero_tails). Without helpers one thread issues every box, so the walk is
  // counted in instructions: one division a tile, then the box's row steps through its page and
  // the next entry is read where a page ends (a division and a clamp a box held pages of 16
  // rows at 0.47-0.55x a contiguous cache's speed).
  static __device__ __forceinline__ void load(const FwdParams& p, const CUtensorMap* map,
                                              int box_rows, Element* buf, int batch, int head_k,
                                              int seqlen_k, int n, int stage, uint64_t* bar) {
    Element* tile = buf + stage * kBlockN * kHeadDim;
    const int* table = p.block_table + int64_t(batch) * p.block_table_stride;
    const int first = n * kBlockN;
    const int live = min(kBlockN, seqlen_k - first);  // >= 1: the tile has keys
    int entry = first / p.page_size;
    int row = first - entry * p.page_size;
    int page = __ldg(table + entry);
    #pragma unroll 1
    for (int r = 0; r < kBlockN; r += box_rows) {
      #pragma unroll
      for (int c = 0; c < kParts; ++c) {
        flash::tma_load_4d(tile + c * kBlockN * kBoxCols + r * kBoxCols, map, c * kBoxCols, row,
                           head_k, page, bar);
      }
      if (r + box_rows < live) {  // the next box holds keys: step to it
        row += box_rows;
        if (row == p.page_size) {
          row = 0;
          page = __ldg(table + ++entry);
        }
      }
    }
  }

  // The same with helpers: row group g (box_rows rows, kParts boxes side by side) is issued by
  // lane 0 of the producer warpgroup's warp g % kWarps (`warp`). An issuer's page lookups and
  // boxes are its bound: one thread issuing all of a tile's held pages of 16 rows at 0.62-0.69x
  // a contiguous cache's speed, and a lookup per box, each waited on before its box, took pages
  // of 64 rows from 0.96 to 0.84x. So a group's boxes share one lookup, and the next group's
  // entry loads while this group's boxes issue.
  static __device__ __forceinline__ void load_group(const FwdParams& p, const CUtensorMap* map,
                                                    int box_rows, Element* buf, int batch,
                                                    int head_k, int seqlen_k, int n, int stage,
                                                    uint64_t* bar, int warp) {
    Element* tile = buf + stage * kBlockN * kHeadDim;
    const int* table = p.block_table + int64_t(batch) * p.block_table_stride;
    const int first = n * kBlockN;
    const int live = min(kBlockN, seqlen_k - first);  // >= 1: the tile has keys
    const int last = (live - 1) / box_rows * box_rows;  // the last box with keys: its first row
    // The page holding tile row r (clamped to the last box with keys) and r's row in it.
    auto lookup = [&](int r, int& row) {
      const int key = first + min(r, last);
      const int entry = key / p.page_size;
      row = key - entry * p.page_size;
      return __ldg(table + entry);
    };
    const int step = kWarps * box_rows;
    int r = warp * box_rows;
    if (r >= kBlockN) return;
    int row, page = lookup(r, row);
    #pragma unroll 1
    for (; r < kBlockN; r += step) {
      int next_row = 0, next_page = 0;
      if (r + step < kBlockN) next_page = lookup(r + step, next_row);
      #pragma unroll
      for (int c = 0; c < kParts; ++c) {
        flash::tma_load_4d(tile + c * kBlockN * kBoxCols + r * kBoxCols, map, c * kBoxCols, row,
                           head_k, page, bar);
      }
      row = next_row, page = next_page;
    }
  }

  // The hand-over's barriers (thread 0, with the mainloop's).
  template <class SharedStorage>
  static __device__ __forceinline__ void init(SharedStorage& shared) {
    if constexpr (kEnabled) {
      cutlass::arch::ClusterBarrier::init(&shared.walk_full, 1);
      cutlass::arch::ClusterBarrier::init(&shared.walk_empty, kWarps - 1);
    }
  }

  // The producer thread's hand-over of its n-th item's key tiles [begin, end) to help, once
  // every helper has read the (n - 1)-th; end < 0: no more items.
  template <class SharedStorage>
  static __device__ __forceinline__ void publish(SharedStorage& shared, int n, int batch,
                                                 int head_k, int seqlen_k, int begin, int end) {
    if (n > 0) cutlass::arch::ClusterBarrier::wait(&shared.walk_empty, (n - 1) & 1);
    compiler_fence();
    shared.walk[0] = batch, shared.walk[1] = head_k, shared.walk[2] = seqlen_k;
    shared.walk[3] = begin, shared.walk[4] = end;
    compiler_fence();
    cutlass::arch::ClusterBarrier::arrive(&shared.walk_full);
  }

  // Warps 1-3 (lane 0) of the producer warpgroup in a call with helpers: per item the producer
  // thread publishes, their shares of each key tile's boxes, last tile first, on the same
  // pipeline stages (they wait for a stage's consumers as the producer thread does; its
  // arrival carries the whole tile's bytes, which the barrier may see after some of their
  // boxes landed).
  template <class Tma, class SharedStorage, class Pipeline>
  static __device__ __forceinline__ void help(const FwdParams& p, const Tma& tma,
                                              SharedStorage& shared, Pipeline& pipe_k,
                                              Pipeline& pipe_v, int warp) {
    auto state = cutlass::make_producer_start_state<Pipeline>();
    for (int taken = 0;; ++taken) {
      cutlass::arch::ClusterBarrier::wait(&shared.walk_full, taken & 1);
      compiler_fence();
      const int batch = shared.walk[0], head_k = shared.walk[1], seqlen_k = shared.walk[2];
      const int begin = shared.walk[3], end = shared.walk[4];
      compiler_fence();
      cutlass::arch::ClusterBarrier::arrive(&shared.walk_empty);
      if (end < 0) return;
      #pragma unroll 1
      for (int n = end - 1; n >= begin; --n) {
        pipe_k.producer_acquire(state);
        load_group(p, &tma.paged_k, tma.box_rows, shared.k.data(), batch, head_k, seqlen_k, n,
                   state.index(), pipe_k.producer_get_barrier(state), warp);
        // With kStageO the item's first V follows its Q (FwdMainloop::load); the producer thread
        // issues that tile alone. (A helper waiting on Q could miss its phase: a one-tile item
        // releases Q before its V, and the next item's Q may land first.)
        if (!(Tr::kStageO && n == end - 1)) {
          pipe_v.producer_acquire(state);
          load_group(p, &tma.paged_v, tma.box_rows, shared.v.data(), batch, head_k, seqlen_k, n,
                     state.index(), pipe_v.producer_get_barrier(state), warp);
        }
        ++state;
      }
    }
  }
};

}  // namespace flash::fa3
