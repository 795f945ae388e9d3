// Register-fragment helpers that FA2 (mma.sync) and FA3 (WGMMA) share: the CuTe element type of
// a CUDA element type, fp32 -> 16-bit fragment conversion, the ex2 instruction and the reductions
// over the four lanes of a quad that hold one accumulator row between them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash {

// The element type of CuTe's MMA atoms for the CUDA type the build matrix names.
template <typename T> struct CuteType;
template <> struct CuteType<__half> { using type = cutlass::half_t; };
template <> struct CuteType<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct CuteType<__nv_fp8_e4m3> { using type = cutlass::float_e4m3_t; };

// fp32 fragment -> 16-bit fragment of the same layout, two elements per instruction.
template <typename To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(cute::Tensor<Engine, Layout> const& src) {
  static_assert(cute::size(Layout{}) % 2 == 0);
  cute::Tensor dst = cute::make_tensor<To>(src.layout());
#pragma unroll
  for (int i = 0; i < cute::size(src); i += 2) {
    const float2 pair = make_float2(src(i), src(i + 1));
    if constexpr (std::is_same_v<To, cutlass::half_t>) {
      *reinterpret_cast<__half2*>(&dst(i)) = __float22half2_rn(pair);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(&dst(i)) = __float22bfloat162_rn(pair);
    }
  }
  return dst;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The four lanes of a quad hold one accumulator row between them.
__device__ __forceinline__ float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace flash
