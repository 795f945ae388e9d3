// flash::launch_fp8_quantize (common/fp8_quantize.h). Compiled once, for every target arch (the
// e4m3 conversion is an instruction from sm89 on, emulated before).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <stdexcept>

#include "common/check.h"
#include "common/fp8_quantize.h"

namespace flash {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnit = 8;    // elements of a row per lane: 16 bytes of 16-bit input
constexpr int kUnroll = 4;  // rows a lane has in flight: loads of all before any use
constexpr int kSteps = 4;   // unrolled rounds per CTA: each CTA covers kSteps * kUnroll rounds
constexpr float kE4m3Max = 448.f;

__device__ void load_unit(const __nv_bfloat16* src, float (&x)[kUnit]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kUnit / 2; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}

__device__ void load_unit(const __half* src, float (&x)[kUnit]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < kUnit / 2; ++i) {
    const float2 f = __half22float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}

__device__ void load_unit(const float* src, float (&x)[kUnit]) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// amax / 448, at least FLT_MIN; NaN stays NaN (as torch's clamp_min keeps it).
__device__ float descale_of(float amax) {
  return amax != amax ? amax : fmaxf(__fdiv_rn(amax, kE4m3Max), FLT_MIN);
}

// The Sylvester Hadamard transform of each `block` consecutive elements of a row, spread over
// lanes of kUnit elements: butterflies of stride < kUnit within the lane, then one shuffle per
// doubling across the block's block / kUnit lanes. Every lane of the warp must call it.
__device__ void hadamard(float (&x)[kUnit], int block, int lane) {
#pragma unroll
  for (int h = 1; h < kUnit; h <<= 1) {
#pragma unroll
    for (int i = 0; i < kUnit; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b, x[i + h] = a - b;
      }
    }
  }
  for (int m = 1; m < block / kUnit; m <<= 1) {
    const bool upper = lane & m;  // this lane holds the b's of the pairs
#pragma unroll
    for (int i = 0; i < kUnit; ++i) {
      const float other = __shfl_xor_sync(~0u, x[i], m);
      x[i] = upper ? other - x[i] : x[i] + other;
    }
  }
}

// Grid (chunks * batch, 3): chunk of rows of one batch of q, k or v. A row is (seqlen, head),
// head_dim elements, read by lanes_per_row lanes (a power of two; lanes past head_dim / kUnit
// idle but shuffle).
template <class T, bool kWrite>
__global__ void __launch_bounds__(kThreads) fp8_quantize_kernel(const Fp8Quantize p,
                                                                int lanes_per_row, int chunks) {
  extern __shared__ float cta_amax[];  // (heads_k), the first pass only
  const int z = blockIdx.y, b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const Fp8Quantize::Tensor t = z == 0 ? p.t[0] : z == 1 ? p.t[1] : p.t[2];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int unit = lane % lanes_per_row, rows_per_warp = 32 / lanes_per_row;
  const bool active = unit * kUnit < p.head_dim;
  const bool rotate = z < 2 && p.hadamard_block > 0;
  const int group = t.heads / p.heads_k;  // query heads per KV head (1 for k, v)
  const int64_t rows = int64_t(t.seqlen) * t.heads;
  const int64_t round_rows = int64_t(kWarps) * rows_per_warp;
  const int64_t first = int64_t(chunk) * round_rows * kUnroll * kSteps;
  float* amax = p.amax + (int64_t(z) * p.batch + b) * p.heads_k;

  if constexpr (!kWrite) {
    for (int i = threadIdx.x; i < p.heads_k; i += kThreads) cta_amax[i] = 0.f;
    __syncthreads();
  } else if (chunk == 0) {
    float* descale = p.descale + (int64_t(z) * p.batch + b) * p.heads_k;
    for (int i = threadIdx.x; i < p.heads_k; i += kThreads) {
      descale[i] = descale_of(amax[i]);
    }
  }

  float sign[kUnit];
#pragma unroll
  for (int i = 0; i < kUnit; ++i) sign[i] = rotate && active ? p.signs[unit * kUnit + i] : 1.f;
  const float norm = rotate ? rsqrtf(float(p.hadamard_block)) : 1.f;

  for (int step = 0; step < kSteps; ++step) {
    if (first + step * kUnroll * round_rows >= rows) break;  // uniform over the CTA
    float x[kUnroll][kUnit];
    int seq[kUnroll], head[kUnroll];  // the row's (seqlen, head); seq -1: past the rows
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      // 32-bit division: the launcher bounds a batch's rows.
      const unsigned row = unsigned(first + (step * kUnroll + j) * round_rows) +
                           unsigned(warp * rows_per_warp + lane / lanes_per_row);
      seq[j] = int(row / unsigned(t.heads));
      head[j] = int(row - unsigned(seq[j]) * unsigned(t.heads));
      if (active && row < rows) {
        load_unit(static_cast<const T*>(t.in) + b * t.in_strides.batch +
                      seq[j] * t.in_strides.row + head[j] * t.in_strides.head + unit * kUnit,
                  x[j]);
      } else {
        seq[j] = -1;
#pragma unroll
        for (int i = 0; i < kUnit; ++i) x[j][i] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (rotate) {
#pragma unroll
        for (int i = 0; i < kUnit; ++i) x[j][i] *= sign[i];
        hadamard(x[j], p.hadamard_block, lane);
#pragma unroll
        for (int i = 0; i < kUnit; ++i) x[j][i] *= norm;
      }
      const bool in_range = seq[j] >= 0;
      const int kv_head = in_range ? head[j] / group : 0;
      if constexpr (!kWrite) {
        // As bits: non-negative floats order as ints, and the NaN below above all of them (a
        // NaN input makes its scale NaN, as torch's amax does).
        int m = 0;
        bool nan = false;
#pragma unroll
        for (int i = 0; i < kUnit; ++i) {
          m = max(m, __float_as_int(fabsf(x[j][i])));
          nan |= x[j][i] != x[j][i];
        }
        if (nan) m = INT32_MAX;
        for (int o = 1; o < lanes_per_row; o <<= 1) m = max(m, __shfl_xor_sync(~0u, m, o));
        if (in_range && unit == 0 && m > 0) atomicMax(reinterpret_cast<int*>(&cta_amax[kv_head]), m);
      } else if (in_range) {
        const float descale = descale_of(amax[kv_head]);
        __nv_fp8x2_storage_t packed[kUnit / 2];
#pragma unroll
        for (int i = 0; i < kUnit / 2; ++i) {
          packed[i] = __nv_cvt_float2_to_fp8x2(
              make_float2(__fdiv_rn(x[j][2 * i], descale), __fdiv_rn(x[j][2 * i + 1], descale)),
              __NV_SATFINITE, __NV_E4M3);
        }
        *reinterpret_cast<uint2*>(static_cast<uint8_t*>(t.out) + b * t.out_strides.batch +
                                  seq[j] * t.out_strides.row + head[j] * t.out_strides.head +
                                  unit * kUnit) = *reinterpret_cast<const uint2*>(packed);
      }
    }
  }

  if constexpr (!kWrite) {
    __syncthreads();
    for (int i = threadIdx.x; i < p.heads_k; i += kThreads) {
      const int bits = __float_as_int(cta_amax[i]);
      if (bits > 0) atomicMax(reinterpret_cast<int*>(&amax[i]), bits);
    }
  }
}

template <class T>
void launch_passes(const Fp8Quantize& p, cudaStream_t stream) {
  const int lanes_per_row = [&] {
    int l = 1;
    while (l * kUnit < p.head_dim) l *= 2;
    return l;
  }();
  int64_t rows = 0;
  for (const Fp8Quantize::Tensor& t : p.t) rows = std::max(rows, int64_t(t.seqlen) * t.heads);
  const int64_t chunk_rows = int64_t(kWarps) * (32 / lanes_per_row) * kUnroll * kSteps;
  const int64_t chunks = std::max<int64_t>(1, (rows + chunk_rows - 1) / chunk_rows);
  if (chunks * p.batch > int64_t(INT32_MAX) || rows + chunk_rows > int64_t(UINT32_MAX)) {
    throw std::runtime_error("flash_attn: fp8 quantize: seqlen * heads * batch too large");
  }
  const dim3 grid(unsigned(chunks * p.batch), 3);
  const size_t smem = sizeof(float) * size_t(p.heads_k);
  if (smem > 48 * 1024) {
    throw std::runtime_error("flash_attn: fp8 quantize: more KV heads than shared memory holds");
  }
  fp8_quantize_kernel<T, false><<<grid, kThreads, smem, stream>>>(p, lanes_per_row, int(chunks));
  FLASH_CHECK_LAUNCH();
  fp8_quantize_kernel<T, true><<<grid, kThreads, 0, stream>>>(p, lanes_per_row, int(chunks));
  FLASH_CHECK_LAUNCH();
}

}  // namespace

void launch_fp8_quantize(const Fp8Quantize& p, cudaStream_t stream) {
  if (p.batch == 0 || p.heads_k == 0) return;
  FLASH_CHECK_CUDA(cudaMemsetAsync(p.amax, 0, sizeof(float) * 3 * p.batch * p.heads_k, stream));
  switch (p.input) {
    case Fp8Quantize::Input::kFp16: launch_passes<__half>(p, stream); break;
    case Fp8Quantize::Input::kBf16: launch_passes<__nv_bfloat16>(p, stream); break;
    case Fp8Quantize::Input::kFp32: launch_passes<float>(p, stream); break;
  }
}

}  // namespace flash
