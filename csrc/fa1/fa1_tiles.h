// FA1 tile sizes and the shared-memory tile loader used by its forward and backward.
//
// Every tile fits in 64 KB of shared memory, the most a Turing (sm75) block can have, so one
// configuration runs on every target. 4 warps; each warp owns 16 rows of the MMA's M side.
#pragma once

#include "common/mma.cuh"
#include "common/params.h"

namespace flash::fa1 {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * 32;

// A shared-memory row is the head dim plus 8 padding elements (16 bytes): the row pitch is then
// an odd multiple of 16 bytes modulo 128, so the 8 row addresses of one ldmatrix hit 8 distinct
// 16-byte bank groups for every head dim we build (32, 64, 96, 128).
template <int kHeadDim>
constexpr int kPitch = kHeadDim + 8;

// kWide: the GPU has more than 64 KB of shared memory per block (sm80+).
template <int kHeadDim, bool kWide>
struct FwdTile {
  static constexpr int Br = 64;  // Q rows per tile: 4 warps x 16 rows
  // K/V rows per tile. Every step reads and writes the running O (Br x d fp32) in global
  // memory, so the step's arithmetic per byte of that traffic grows with Bc: take the widest
  // tile that fits. Shared memory, Q + K + V = (Br + 2 Bc) * pitch * 2 bytes: Bc = 128 is 46 KB
  // at d = 64 but 87 KB at d = 128, past sm75's 64 KB, where d > 64 takes Bc = 64 (52 KB).
  // Registers: a warp holds S (16 x Bc) and O (16 x d) in fp32, 128 a thread at Bc = d = 128.
  static constexpr int Bc = (kHeadDim <= 64 || kWide) ? 128 : 64;
  static constexpr int kSmemBytes = (Br + 2 * Bc) * kPitch<kHeadDim> * 2;
};

template <int kHeadDim>
struct BwdTile {
  static constexpr int Bc = 64;  // K/V rows per tile: 4 warps x 16 rows, dK and dV in registers
  // Q rows per tile. Shared memory: K, V (Bc rows), Q, dO (Br rows), dS^T (Bc x Br) and the
  // per-row lse / D. At d = 128, Br = 64 would need 79 KB, past sm75's 64 KB; Br = 32 fits in 57.
  static constexpr int Br = kHeadDim <= 96 ? 64 : 32;
  static constexpr int kDsPitch = Br + 8;
  static constexpr int kSmemBytes =
      (2 * Bc + 2 * Br) * kPitch<kHeadDim> * 2 + Bc * kDsPitch * 2 + 2 * Br * 4;
};

// Loads rows [row0, row0 + Rows) of one head of a (b, s, h, d) tensor into a padded
// shared-memory tile, 16 bytes per thread per step, zero-filling rows >= num_rows and columns
// >= head_dim (head_dim is a multiple of 8, so a 16-byte chunk is wholly in or out).
template <typename T, int Rows, int kHeadDim>
__device__ __forceinline__ void load_tile(T* smem, const T* head_base, int64_t row_stride,
                                          int row0, int num_rows, int head_dim, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kChunks = Rows * kChunksPerRow;
  static_assert(kChunks % kNumThreads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int it = 0; it < kChunks / kNumThreads; ++it) {
    const int chunk = it * kNumThreads + tid;
    const int r = chunk / kChunksPerRow;
    const int c = (chunk % kChunksPerRow) * 8;
    const bool valid = row0 + r < num_rows && c < head_dim;
    const T* src = valid ? head_base + (row0 + r) * row_stride + c : head_base;
    copy16_async(smem + r * kPitch<kHeadDim> + c, src, valid);
  }
}

// Row-block accumulators in global memory (FA1's running O, the backward's dQ) are stored in
// the MMA's C-fragment order: for each 16-row group and each 8-column n-tile, 32 lanes x 4
// floats. A warp then reads or writes its whole 16 x d block with 16-byte accesses that are
// contiguous across the warp.
template <int kHeadDim>
__device__ __forceinline__ int64_t frag_offset(int64_t row_group, int n_tile, int lane) {
  return ((row_group * (kHeadDim / 8) + n_tile) * 32 + lane) * 4;
}

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// Kernel variants that need sm80 (bf16 MMA, or a block with more than 64 KB of shared memory)
// are never launched on an older GPU, so their bodies are left out of the sm75 device pass:
// build time and binary size, not behaviour.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kDevicePassHasSm80 = false;
#else
constexpr bool kDevicePassHasSm80 = true;
#endif
template <typename T, bool kWide = false>
constexpr bool kCompileBody = kDevicePassHasSm80 || !(std::is_same_v<T, __nv_bfloat16> || kWide);

}  // namespace flash::fa1
