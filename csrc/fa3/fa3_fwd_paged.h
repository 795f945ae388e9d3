// FA3's paged K / V (params.block_table): a key tile of a paged cache loaded by the producer as
// TMA boxes that each lie within one page, from the 4-D maps over the page pools the launcher
// builds (fa3_fwd_launch.cuh: head_dim, rows of a page, heads_k, pages).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/mma.cuh"
#include "common/params.h"

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

  // Key tile n of sequence `batch` (seqlen_k keys) into stage `stage` of `buf` (shared.k or
  // .v) as boxes of box_rows rows (a divisor of kBlockN and of the page size, a multiple of 8:
  // fa3.h), each within one page. The boxes past the sequence's last key repeat its last box,
  // so that the stage receives the bytes its barrier expects from rows of the sequence's own
  // pages (the consumers mask those keys and zero their V rows, as in a KV cache's tail:
  // FwdMainloop::zero_tails). One thread issues every box, so the walk is counted in
  // instructions: one division a tile, then the box's row steps through its page and the next
  // entry is read where a page ends (a division and a clamp a box held pages of 16 rows at
  // 0.47-0.55x a contiguous cache's speed).
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
      for (int c = 0; c < kHeadDim / kBoxCols; ++c) {
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
};

}  // namespace flash::fa3
