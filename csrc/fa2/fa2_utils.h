// Small CuTe helpers of the FA2 forward and backward (mma.sync): fragment views, the two GEMM
// shapes of the mainloops and predicated tile copies. What FA3 shares is in common/fragment.h.
#pragma once

#include <cute/tensor.hpp>

#include "common/fragment.h"

namespace flash::fa2 {

using namespace cute;

// ---- fragment views -------------------------------------------------------------------------

// An m16n8 accumulator fragment ((2 cols, 2 rows), MMA_M, MMA_N) seen as a matrix of the rows
// and columns a thread owns: ((2, MMA_M), (2, MMA_N)). Softmax and masks index it by row.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol(Layout const& acc) {
  static_assert(rank(Layout{}) == 3);
  auto atom = get<0>(acc);
  return make_layout(make_layout(get<1>(atom), get<1>(acc)),
                     make_layout(get<0>(atom), get<2>(acc)));
}

// The accumulator of C = A*B reused, once converted to 16 bits, as the A operand of the next
// m16n8k16 MMA: two adjacent n8 tiles form one k16 slice. ((2,2), MMA_M, MMA_N) ->
// (((2,2),2), MMA_M, MMA_N/2).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_operand_a(Layout const& acc) {
  static_assert(rank(Layout{}) == 3);
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split),
                     get<2, 1>(split));
}

// ---- GEMMs from shared memory ----------------------------------------------------------------

// acc += A * B^T with both operands in shared memory. The ldmatrix of k-slice k+1 is issued
// before the MMAs of slice k, so shared-memory latency hides under tensor-core work.
// tCrA/tCrB: the MMA's register fragments (MMA, MMA_M|N, MMA_K); tCsA/tCsB: the smem views
// partitioned by the matching smem->register tiled copies. after_slice(k, slices) runs after
// the MMAs of slice k (other work to interleave with the GEMM's).
struct NoHook {
  __device__ void operator()(int, int) const {}
};
template <class Acc, class RA, class RB, class SA, class SB, class TiledMma, class CopyA,
          class CopyB, class Hook = NoHook>
__device__ __forceinline__ void gemm_ss(Acc& acc, RA& tCrA, RB& tCrB, SA const& tCsA,
                                        SB const& tCsB, TiledMma const& mma, CopyA const& copy_a,
                                        CopyB const& copy_b, Hook const& after_slice = {}) {
  Tensor tCrA_view = copy_a.get_thread_slice(threadIdx.x).retile_D(tCrA);
  Tensor tCrB_view = copy_b.get_thread_slice(threadIdx.x).retile_D(tCrB);
  copy(copy_a, tCsA(_, _, 0), tCrA_view(_, _, 0));
  copy(copy_b, tCsB(_, _, 0), tCrB_view(_, _, 0));
  constexpr int kSlices = decltype(size<2>(tCrA))::value;
#pragma unroll
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) {
      copy(copy_a, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1));
      copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    }
    gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    after_slice(k, kSlices);
  }
}

// acc += A * B^T with A already in registers (P, or dS) and B in shared memory.
template <class Acc, class RA, class RB, class SB, class TiledMma, class CopyB>
__device__ __forceinline__ void gemm_rs(Acc& acc, RA const& tCrA, RB& tCrB, SB const& tCsB,
                                        TiledMma const& mma, CopyB const& copy_b) {
  Tensor tCrB_view = copy_b.get_thread_slice(threadIdx.x).retile_D(tCrB);
  copy(copy_b, tCsB(_, _, 0), tCrB_view(_, _, 0));
  constexpr int kSlices = decltype(size<2>(tCrA))::value;
#pragma unroll
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// ---- predicated tile copies ------------------------------------------------------------------

// Global -> shared copy of one (rows, head dim) tile, 16 bytes per cp.async. Rows at or past
// max_rows and columns at or past head_dim are written as zeros (the zero-fill form reads no
// bytes there), so padded rows and columns never bring garbage (possibly NaN) into a dot
// product. tiled_copy: a cp.async zero-fill TiledCopy (Layouts::GmemLoad); tS/tD: its
// partitions (CPY, CPY_M, CPY_K); tC: the same partition of an identity tensor over the tile,
// giving each vector's (row, col).
template <bool kCheckRows, class TiledCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void copy_tile(TiledCopy const& tiled_copy, Src const& tS, Dst& tD,
                                          Coord const& tC, int max_rows, int head_dim) {
#pragma unroll
  for (int m = 0; m < size<1>(tS); ++m) {
    const bool row_ok = !kCheckRows || get<0>(tC(0, m, 0)) < max_rows;
#pragma unroll
    for (int k = 0; k < size<2>(tS); ++k) {
      copy(tiled_copy.with(row_ok && get<1>(tC(0, m, k)) < head_dim), tS(_, m, k), tD(_, m, k));
    }
  }
}

// x as ptxas can see that every lane of the warp holds it alike: lane 0's, through a shuffle.
// Lengths and offsets read from cu_seqlens are per-thread loads to the compiler; as uniform
// values they take uniform registers and predicates, as a dense call's kernel parameters do.
template <class T>
__device__ __forceinline__ T warp_uniform(T x) {
  return __shfl_sync(0xffffffffu, x, 0);
}

// copy_tile from rows that are not one strided run (a paged K / V): row_ptr(r) is the first
// element of tile row r; tS gives the layout of each vector. Zero-fills rows past max_rows
// and columns past head_dim.
template <class TiledCopy, class Src, class Dst, class Coord, class RowPtr>
__device__ __forceinline__ void copy_rows(TiledCopy const& tiled_copy, Src const& tS, Dst& tD,
                                          Coord const& tC, RowPtr const& row_ptr, int max_rows,
                                          int head_dim) {
#pragma unroll
  for (int m = 0; m < size<1>(tS); ++m) {
    const int row = get<0>(tC(0, m, 0));
    const bool row_ok = row < max_rows;
    const auto* src = row_ptr(row_ok ? row : 0);
#pragma unroll
    for (int k = 0; k < size<2>(tS); ++k) {
      const int col = get<1>(tC(0, m, k));
      copy(tiled_copy.with(row_ok && col < head_dim),
           make_tensor(make_gmem_ptr(src + col), tS(_, m, k).layout()), tD(_, m, k));
    }
  }
}

// Register (or shared) -> global copy that skips rows past max_rows and columns past head_dim.
template <class TiledCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void store_tile(TiledCopy const& tiled_copy, Src const& tS, Dst& tD,
                                           Coord const& tC, int max_rows, int head_dim) {
#pragma unroll
  for (int m = 0; m < size<1>(tS); ++m) {
    if (get<0>(tC(0, m, 0)) < max_rows) {
#pragma unroll
      for (int k = 0; k < size<2>(tS); ++k) {
        if (get<1>(tC(0, m, k)) < head_dim) copy(tiled_copy, tS(_, m, k), tD(_, m, k));
      }
    }
  }
}

}  // namespace flash::fa2
