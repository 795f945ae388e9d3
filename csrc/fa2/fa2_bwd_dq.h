// The dQ accumulator of the backward: every key tile adds dS K into dQ_i (FA2 Algorithm 2,
// line 15), so dQ lives in fp32 scratch until a last kernel scales and converts it.
//
// Layout: per (batch, head), in m16n8 fragment order: (rows / 16, hdim / 8, 32 lanes, 4) fp32,
// the 4 values of a lane being rows (g, g + 8) x cols (2t, 2t + 1) of the tile, g = lane / 4,
// t = lane % 4. A lane's fragment is then 16 contiguous bytes: one red.global.add.v4.f32 on
// sm90 (four scalar reds on sm80), instead of one per element in a row-major buffer.
//
// Deterministic mode: the adds into one query tile happen in key-tile order. A counter per
// (batch, head, query tile) says how many key tiles have added; the block of key tile n waits
// for its turn (the number of earlier key tiles walking that query tile), adds, and passes
// the turn on. The wait never deadlocks because the turn always goes to an earlier block of the
// grid (the tile order, common/tile_order.h, puts key tile n - 1 of a head before key tile n), and
// blocks start in grid order. (With more than 2^31 - 1 work items blocks would stride over
// items and that argument would not hold; no real shape comes near.)
#pragma once

#include <cstdint>

#include "common/mma.cuh"
#include "common/params.h"
#include "common/pdl.h"
#include "common/seqinfo.h"
#include "fa2/fa2.h"
#include "fa2/fa2_utils.h"

namespace flash::fa2 {

// Index of a lane's 4 floats within one head's accumulator.
template <int kHeadDim>
__host__ __device__ __forceinline__ int64_t dq_frag_offset(int row, int col, int lane) {
  return ((int64_t(row / 16) * (kHeadDim / 8) + col / 8) * 32 + lane) * 4;
}

// acc: an m16n8 accumulator fragment ((2,2), MMA_M, MMA_N) of a (rows, cols) tile; coord: the
// same partition of an identity tensor. A lane's first fragment sits at row g + 16i, column
// 2t + 8j, and fragment (m, n) a multiple of 16 rows and 8 columns further: in a kCols-wide
// fragment-ordered buffer its address is the lane's base plus f's `offset`, a compile-time
// constant once the loops unroll (the instruction's immediate), not a fresh fragment-order
// index each time. Calls f(offset, m, n) for every fragment, in (m, n) order.
template <int kCols, class Acc, class Coord, class F>
__device__ __forceinline__ void for_each_dq_fragment(Acc const& acc, Coord const& coord, F&& f) {
  const int r0 = get<0>(coord(0, 0, 0)), c0 = get<1>(coord(0, 0, 0));
#pragma unroll
  for (int m = 0; m < size<1>(acc); ++m) {
#pragma unroll
    for (int n = 0; n < size<2>(acc); ++n) {
      const int dr = get<0>(coord(0, m, n)) - r0, dc = get<1>(coord(0, m, n)) - c0;
      f((dr / 16 * (kCols / 8) + dc / 8) * 32 * 4, m, n);
    }
  }
}

// Adds acc, the part of a tile starting at (row0, col0) of the head's dQ (row0 a multiple of
// 16, col0 of 8), into dq_accum.
// Columns past head_dim are added too: the buffer is kHeadDim wide and the convert kernel never
// reads them, so no predicate. (A predicated red costs a BSSY/BRA/BSYNC region per fragment in
// ptxas's output, which is most of the dQ epilogue's issue slots at hdim 256.)
// part / parts: only that share of the fragments (in (m, n) order), so that the adds can be
// spread over another GEMM's slices.
template <int kHeadDim, class Acc, class Coord>
__device__ __forceinline__ void dq_atomic_add(float* dq_head, Acc const& acc, Coord const& coord,
                                              int row0, int col0, int part = 0, int parts = 1) {
  constexpr int kFrags = decltype(size<1>(acc) * size<2>(acc))::value;
  const int lane = threadIdx.x % 32;
  float* base = dq_head + dq_frag_offset<kHeadDim>(row0 + get<0>(coord(0, 0, 0)),
                                                   col0 + get<1>(coord(0, 0, 0)), lane);
  for_each_dq_fragment<kHeadDim>(acc, coord, [&](int offset, int m, int n) {
    const int i = m * size<2>(acc) + n;
    if (i < kFrags * part / parts || i >= kFrags * (part + 1) / parts) return;
    red_add_v4(base + offset, acc(0, m, n), acc(1, m, n), acc(2, m, n), acc(3, m, n));
  });
}

// sm90, non-deterministic mode (where BwdTile::kdQBulk says so): a query tile's dQ goes to
// shared memory in the same fragment order, and one thread adds the whole tile (kBlockM rows:
// one contiguous range of dq_accum) with a bulk reduction that the copy engine performs.
// Against the 16-byte reds, the warps only store to shared memory (conflict-free: a warp's 32
// lanes write 512 contiguous bytes) and no register waits for the LSU to take it. Measured on
// an H100: one 512-byte bulk op per fragment and warp instead was 5-15% slower than the reds.
// The staging buffer is read by the async proxy: each writer fences before the barrier that
// precedes the bulk copy, and the issuing thread waits for the read before the buffer is
// written again. kCols: the staged tile's columns (the head dim).
template <int kCols, class Acc, class Coord>
__device__ __forceinline__ void dq_stage(float* stage, Acc const& acc, Coord const& coord) {
  const int lane = threadIdx.x % 32;
  float* base = stage + dq_frag_offset<kCols>(get<0>(coord(0, 0, 0)), get<1>(coord(0, 0, 0)), lane);
  for_each_dq_fragment<kCols>(acc, coord, [&](int offset, int m, int n) {
    *reinterpret_cast<float4*>(base + offset) =
        make_float4(acc(0, m, n), acc(1, m, n), acc(2, m, n), acc(3, m, n));
  });
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasBulkReduce = true;
#else
constexpr bool kHasBulkReduce = false;
#endif

// Turn-taking on one counter of the deterministic mode. All threads of the block call both.
struct DqTurn {
  __device__ static void wait(const int* counter, int turn) {
    if (threadIdx.x == 0) {
      int seen;
      while (true) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        if (seen == turn) break;
        __nanosleep(64);
      }
    }
    __syncthreads();
  }
  // After the block's adds: the barrier orders every thread's reds before thread 0's release.
  __device__ static void pass(int* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
    }
  }
};

// dQ = softmax_scale * accumulator, in the output dtype and dq_strides. A block converts
// kRows rows of one head: the fragment-ordered floats are read contiguously, transposed
// through shared memory and written as 16-byte row vectors.
constexpr int kDqConvertThreads = 256;
constexpr int kDqConvertRows = 64;
static_assert(kRowPad % kDqConvertRows == 0);

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kDqConvertThreads) bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kPitch = kHeadDim + 8;  // 16 bytes of padding: rows start on different banks
  __shared__ __align__(16) T tile[kDqConvertRows * kPitch];
  pdl_wait();  // for the main kernel's adds (launched with pdl: fa2_bwd_launch.cuh)
  constexpr int kFloat4s = kDqConvertRows * kHeadDim / 4;
  constexpr int kVectors = kDqConvertRows * kHeadDim / 8;
  constexpr int kFragsPerRowGroup = kHeadDim / 8 * 32;
  const int row0 = blockIdx.x * kDqConvertRows;
  const int64_t batch_heads = int64_t(p.batch) * p.heads;
  for (int64_t bh = blockIdx.y; bh < batch_heads; bh += gridDim.y) {
    const int h = int(bh % p.heads);
    const SeqInfo seq(p, int(bh / p.heads));
    const float4* src = reinterpret_cast<const float4*>(
        p.dq_accum + (seq.scratch_row0<kRowPad>(p, h) + row0) * kHeadDim);
    for (int i = threadIdx.x; i < kFloat4s; i += kDqConvertThreads) {
      const float4 v = src[i];
      const int group = i / kFragsPerRowGroup, frag = i % kFragsPerRowGroup;
      const int lane = frag % 32;
      const int r = group * 16 + lane / 4, c = frag / 32 * 8 + 2 * (lane % 4);
      const float s = p.softmax_scale;
      if constexpr (std::is_same_v<T, __half>) {
        *reinterpret_cast<__half2*>(&tile[r * kPitch + c]) = __floats2half2_rn(v.x * s, v.y * s);
        *reinterpret_cast<__half2*>(&tile[(r + 8) * kPitch + c]) = __floats2half2_rn(v.z * s, v.w * s);
      } else {
        *reinterpret_cast<__nv_bfloat162*>(&tile[r * kPitch + c]) = __floats2bfloat162_rn(v.x * s, v.y * s);
        *reinterpret_cast<__nv_bfloat162*>(&tile[(r + 8) * kPitch + c]) = __floats2bfloat162_rn(v.z * s, v.w * s);
      }
    }
    __syncthreads();
    T* dq_head = static_cast<T*>(p.dq) + seq.dq_offset(p, h);
    for (int i = threadIdx.x; i < kVectors; i += kDqConvertThreads) {
      const int r = i / (kHeadDim / 8), c = i % (kHeadDim / 8) * 8;
      const int row = row0 + r;
      // Rows past seqused_q (variable-length) got no adds: their zeros are written too.
      if (row < seq.rows_q(p) && c < p.head_dim) {
        *reinterpret_cast<uint4*>(dq_head + row * p.dq_strides.row + c) =
            *reinterpret_cast<const uint4*>(&tile[r * kPitch + c]);
      }
    }
    __syncthreads();  // the next head's values overwrite the tile
  }
#endif
}

}  // namespace flash::fa2
