// Backward preprocess (FA2 Algorithm 2, line 4): D = rowsum(dO o O) in fp32, one value per
// (batch, head, query row), into dsum laid out (batch, heads, round_up(seqlen_q, kRowPad)).
// The padding rows get 0, so the main kernel may read a whole query tile unguarded.
// It also zeroes the dQ accumulator (and the deterministic mode's counters): the stores ride
// along with the loads of the same rows instead of a memset kernel of their own and the gap
// before it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/params.h"
#include "common/pdl.h"
#include "common/seqinfo.h"
#include "fa2/fa2.h"

namespace flash::fa2 {

constexpr int kDotThreads = 256;

template <typename T>
__device__ __forceinline__ float2 to_float2(uint32_t packed) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
  }
}

// kLanes lanes per row (the power of two covering hdim / 8), 8 columns each, one 16-byte load
// of dO and of O per lane. kRowsPerStep divides kRowPad, so a block's rows are all in range or
// all out, and every warp shuffles whole.
template <int kHeadDim>
struct DotTile {
  static constexpr int kVectors = kHeadDim / 8;
  static_assert(kVectors <= 32);
  static constexpr int kLanes = kVectors <= 4 ? 4 : kVectors <= 8 ? 8 : kVectors <= 16 ? 16 : 32;
  static constexpr int kRowsPerStep = kDotThreads / kLanes;
  static_assert(kRowPad % kRowsPerStep == 0);
};

// A grid-stride loop over all padded rows of all heads. The main kernel, launched after this
// one, waits for it (pdl_wait) before it reads dsum or adds into dq_accum; what it does before
// that (its K, V, Q, dO loads) may overlap this kernel's last blocks.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kDotThreads)
    bwd_dot_do_o_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  pdl_launch_dependents();
  constexpr int kLanes = DotTile<kHeadDim>::kLanes;
  constexpr int kRowsPerStep = DotTile<kHeadDim>::kRowsPerStep;
  const int64_t rows_pad = round_up(p.seqlen_q, kRowPad);
  const int64_t total_rows = int64_t(p.batch) * p.heads * rows_pad;
  const int lane = threadIdx.x % kLanes;
  if (p.deterministic) {
    int* counters = reinterpret_cast<int*>(p.dq_accum + total_rows * kHeadDim);
    for (int64_t i = int64_t(blockIdx.x) * kDotThreads + threadIdx.x;
         i < total_rows / kBwdMinBlockM; i += int64_t(gridDim.x) * kDotThreads) {
      counters[i] = 0;
    }
  }
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerStep + threadIdx.x / kLanes; row < total_rows;
       row += int64_t(gridDim.x) * kRowsPerStep) {
    if (lane * 8 < kHeadDim) {
      // kHeadDim floats of dq_accum per padded row: the whole buffer, in whatever order its
      // fragments lie.
      float4* dst = reinterpret_cast<float4*>(p.dq_accum + row * kHeadDim + lane * 8);
      dst[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      dst[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const int64_t bh = row / rows_pad;
    const int r = int(row % rows_pad);
    const int h = int(bh % p.heads);
    const SeqInfo seq(p, int(bh / p.heads));
    const int c = lane * 8;
    float acc = 0.f;
    if (r < seq.seqlen_q(p) && c < p.head_dim) {
      const uint4 dov = *reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.dout) + seq.do_offset(p, h) + r * p.do_strides.row + c);
      const uint4 ov = *reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.o) + seq.o_offset(p, h) + r * p.o_strides.row + c);
      const uint32_t dw[4] = {dov.x, dov.y, dov.z, dov.w}, ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 x = to_float2<T>(dw[w]), y = to_float2<T>(ow[w]);
        acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
      acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    }
    if (lane == 0) p.dsum[row] = acc;
  }
#endif
}

}  // namespace flash::fa2
