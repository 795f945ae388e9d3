// What the FA3 forward does differently for e4m3 q / k / v (FwdTraits::kFp8).
//
// FP8 WGMMA reads both shared-memory operands K-major. For S = Q K^T that is how Q and K lie;
// for O += P V the reduction runs over keys, so V must lie as V^T (head dim, keys) with keys
// contiguous. fwd_fp8_vt writes that V^T per (batch, KV head) into the workspace before the
// kernel, and the producer loads V^T's tiles as it loads K's.
//
// P leaves the S accumulator as the A operand of the next GEMM, in registers. An 8-bit A
// fragment wants four adjacent k of one row in a register, where the accumulator gives a lane
// column pairs {2q, 2q + 1} of rows r and r + 8 in each 8-column block (q = lane % 4).
// convert_p_fp8 reorders within the lane only (no shuffle): A's k = 4q + j of each 16 then
// holds key 8 (j / 2) + 2q + j % 2, and V^T's slots are written in that order (fp8_key), so the
// sum over k meets each key's P with the key's V. O's columns are untouched.
//
// Descales (FwdParams): q_descale * k_descale multiplies the softmax scale of the item's (batch,
// KV head), v_descale O's 1 / l.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include <cute/tensor.hpp>

#include "common/params.h"

namespace flash::fa3 {

using namespace cute;

// The key in slot k of V^T (and of P's A fragment) within each group of kFp8KeyGroup.
__host__ __device__ constexpr int fp8_key(int k) {
  const int q = (k % 16) / 4, j = k % 4;
  return k / 16 * 16 + 8 * (j / 2) + 2 * q + j % 2;
}

struct Fp8Scales {
  float scale_log2;  // the item's softmax_scale_log2
  float v;           // O's factor
};
__device__ __forceinline__ Fp8Scales fp8_scales(const FwdParams& p, int batch, int head_k) {
  const int64_t at = batch * p.descale_batch_stride + head_k * p.descale_head_stride;
  const float q = p.q_descale != nullptr ? p.q_descale[at] : 1.f;
  const float k = p.k_descale != nullptr ? p.k_descale[at] : 1.f;
  const float v = p.v_descale != nullptr ? p.v_descale[at] : 1.f;
  return {p.softmax_scale_log2 * q * k, v};
}

// P's A fragment for kBlockN keys: per 32-key k-step, 16 bytes a lane, v0 + 4 v1 + 8 v2 holding
// row r + 8 v1, k 16 v2 + 4q + v0 (CuTe's ALayout_64x32 for 8-bit types). Its registers are
// a uint32_t fragment (PWordsFp8; bytes of a register array written through a wider pointer
// went to the stack), viewed as bytes by p_operand_fp8.
template <int kBlockN>
using PFragmentFp8 = Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>>;
template <int kBlockN>
using PWordsFp8 = Layout<Int<kBlockN / 8>>;
template <class Element, int kBlockN, class Words>
__device__ __forceinline__ auto p_operand_fp8(Words& words) {
  return make_tensor(reinterpret_cast<Element*>(words.data()), PFragmentFp8<kBlockN>{});
}

// acc (the S accumulator, P after the softmax: ((2, 2, kBlockN / 8), 1, 1), element
// v0 + 2 v1 + 4 g at row r + 8 v1, column 8 g + 2q + v0) into words (PWordsFp8), saturating.
// Each 8 accumulator elements (two 8-column blocks) give 8 bytes of one k16 half of a k-step:
// A's (v0, v1) takes the element (v0 % 2, v1, block v0 / 2), so pairs 1 and 2 trade places.
template <class Acc, class Words>
__device__ __forceinline__ void convert_p_fp8(const Acc& acc, Words& words) {
  static_assert(decltype(size(acc))::value == 4 * decltype(size(words))::value);
  auto pair = [&](int i) -> uint32_t {
    return __nv_cvt_float2_to_fp8x2(make_float2(acc(i), acc(i + 1)), __NV_SATFINITE, __NV_E4M3);
  };
  CUTE_UNROLL
  for (int i = 0; i < decltype(size(acc))::value; i += 8) {
    words(i / 4) = pair(i) | (pair(i + 4) << 16);
    words(i / 4 + 1) = pair(i + 2) | (pair(i + 6) << 16);
  }
}

// V^T for the kernel: vt[(b, h_k)][d][slot] = v[b][fp8_key(slot)][h_k][d] for d < head_dim,
// zero for keys past seqlen_k; `keys` slots a row (plan.vt_keys). A block moves kFp8VtKeys keys
// of one (batch, KV head), blockIdx.x = (key block, KV head, batch), the key block fastest:
// coalesced 16-byte loads of V's rows, then a lane per (column d, 16 slots) gathers them from
// shared memory, the slot groups fastest so that a warp writes 64 contiguous bytes of each of 8
// rows of V^T (a lane per row wrote 16 bytes to each of 32 rows: an H100 moved 1.1-1.7 TB/s).
// A row's 16-byte chunks lie XOR-swizzled by its slot group, so that the four groups' byte reads
// of one column hit four banks.
constexpr int kFp8VtKeys = 64;
template <int kHeadDim>
__global__ void __launch_bounds__(256) fwd_fp8_vt(const __grid_constant__ FwdParams p,
                                                 uint8_t* vt, int keys) {
  constexpr int kKeys = kFp8VtKeys;
  __shared__ __align__(16) uint8_t tile[kKeys][kHeadDim];
  const unsigned blocks = unsigned(keys + kKeys - 1) / kKeys;
  const int key0 = int(blockIdx.x % blocks) * kKeys;
  const int head_k = int(blockIdx.x / blocks % unsigned(p.heads_k));
  const int b = int(blockIdx.x / blocks / unsigned(p.heads_k));
  const uint8_t* v = static_cast<const uint8_t*>(p.v) + b * p.v_strides.batch +
                     head_k * p.v_strides.head;
  const int vecs = p.head_dim / 16;
  for (int i = threadIdx.x; i < kKeys * vecs; i += blockDim.x) {
    const int r = i / vecs, c = i % vecs;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key0 + r < p.seqlen_k) {
      x = *reinterpret_cast<const uint4*>(v + (key0 + r) * p.v_strides.row + c * 16);
    }
    *reinterpret_cast<uint4*>(&tile[r][(c ^ (r / 16)) * 16]) = x;
  }
  __syncthreads();
  constexpr int kGroups = kKeys / 16;
  static_assert(kGroups <= kHeadDim / 16, "the swizzle stays within a row");
  uint8_t* out = vt + (int64_t(b) * p.heads_k + head_k) * p.head_dim * keys;
  for (int i = threadIdx.x; i < p.head_dim * kGroups; i += blockDim.x) {
    const int group = i % kGroups, d = i / kGroups, slot0 = key0 + 16 * group;
    if (slot0 >= keys) continue;
    const int col = ((d / 16) ^ group) * 16 + d % 16;
    uint32_t w[4];
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      uint32_t x = 0;
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        x |= uint32_t(tile[16 * group + fp8_key(4 * q + j)][col]) << (8 * j);
      }
      w[q] = x;
    }
    *reinterpret_cast<uint4*>(out + int64_t(d) * keys + slot0) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace flash::fa3
