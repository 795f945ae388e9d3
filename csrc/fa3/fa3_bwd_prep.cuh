// The FA3 backward's kernels around the main one. Scratch rows (per batch and head, padded to
// the main kernel's rows a step, bwd_block_m) hold, for its unguarded tile loads:
//   dq     the dQ accumulator, unscaled, zeroed by the main kernel or a memset (BwdPlan::
//          zero_chunks), added to by every key tile: fp32,
//          or in deterministic mode fixed point (below)
//   next_item  the persistent kernel's item counter (fa3_bwd_items.h), zeroed with dq;
//          zero_next and zero_all beside it
//   split  the split items' part counters and fp32 dK / dV sums (BwdPlan::split_items), zeroed
//          with dq
//   zero_done  with BwdPlan::zero_chunks: per (batch, KV head) the chunks of dq zeroed by the
//          main kernel (fa3_bwd_epilogue.h: zero_dq), whose memset then starts here
//   kv_bound  deterministic mode: per (batch, KV head) the largest |K| element and |V| row
//          norm (squared), zeroed with dq
//   lse2   the forward's lse in base 2; +inf past the sequence (P = 0 there)
//   dsum   D = rowsum(dO o O); 0 past the sequence
//   dq_scale  deterministic mode: the row's fixed-point scale (below)
// and the conversion of the accumulator into dq (times softmax_scale, in the output dtype).
//
// Deterministic mode adds dQ in fixed point: each key tile's share of a row, times the row's
// scale 2^e, rounded to an int32, so that the adds (integer, hence associative) give the same
// bits in any order, with no ordering of the key tiles. The scale bounds the row's sum by 2^30:
// |dQ_i| <= max|K| sum_j P_ij |dP_ij - D_i| <= 2 max|K| |dO_i| max_j |V_j| (sum_j P_ij = 1,
// |D_i| <= max_j |dP_ij|, |dP_ij| <= |dO_i| |V_j|; softcap's derivative is at most 1), and each
// key tile's share by the same, so no add overflows (two's complement would wrap back anyway).
// The rounding costs at most 2^-e / 2 per add, 2^-30 to 2^-27 of the bound (dq_fixed_scale
// takes the factors' exponents): against bf16's 2^-9 of the value, small unless the bound
// exceeds the row's values by some 2^13 (128 adds of random sign). A NaN in dO, K or V makes
// the scales NaN, hence dQ; one in q alone rounds to 0 (it shows in dK / dV).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/params.h"
#include "common/pdl.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_traits.h"

namespace flash::fa3 {

constexpr int kBwdPrepThreads = 256;
// The preprocess's lanes a row: 16 bytes of dO and O each, rounded up to a power of two (the
// shuffle reduction; at head dim 96 four of 16 lanes idle).
template <int kHeadDim>
constexpr int bwd_prep_lanes() {
  return kHeadDim / 8 <= 8 ? 8 : kHeadDim / 8 <= 16 ? 16 : 32;
}

struct BwdScratch {
  float* lse2;
  float* dsum;
  float* dq;         // int32 in deterministic mode
  float* dq_scale;   // nullptr unless deterministic
  float* kv_bound;   // nullptr unless deterministic: (max |K|, max |V_j|^2) per (batch, KV head)
  int64_t rows_pad;  // per (batch, head)
  unsigned* next_item;  // items taken past the CTAs' first (gridDim.x)
  int items;            // (key tile, KV head, batch): BwdPlan's
  int tail_pairs;       // the last pairs, taken key tile by key tile: BwdPlan's
  // The split items (BwdPlan::split_items; fa3_bwd_items.h): items from split_first are their
  // parts, split_parts each; split_count: the parts done, split_acc: the fp32 dK / dV sums,
  // per split item (zeroed with the dQ accumulator).
  int split_first;
  int split_parts;
  unsigned* split_count;
  float* split_acc;
  // The accumulator zeroed by the main kernel (BwdPlan::zero_chunks; 0: by a memset): chunks
  // taken from zero_next, counted done per (batch, KV head) pair in zero_done and in all in
  // zero_all.
  int zero_chunks;
  unsigned* zero_next;
  unsigned* zero_all;
  unsigned* zero_done;
};

// The fixed-point scale of a row whose dO has squared norm do2, for K / V bounds kv: 2^e with
// 2^e x (the row's bound) < 2^30, from the factors' exponents (no product that could overflow);
// NaN where a factor is NaN or inf (dQ's row is then NaN). Limits: e is clamped to float's
// range (a bound past 2^156 would saturate), and do2 overflows past |dO| ~ 1.8e19 (bf16).
__device__ __forceinline__ float dq_fixed_scale(float do2, const float* kv) {
  const float factors[3] = {sqrtf(do2), kv[0], sqrtf(kv[1])};
  int e = 30 - 2;  // the bound's factor 2, and < 2 for rounding (1.02 would do)
  #pragma unroll
  for (int f = 0; f < 3; ++f) {
    if (!(factors[f] <= 3.4e38f)) return __int_as_float(0x7fc00000);  // NaN or inf
    int x;
    frexpf(factors[f], &x);  // factor < 2^x; 0 for 0
    e -= x;
  }
  return ldexpf(1.f, min(max(e, -126), 127));
}

template <typename T>
__device__ __forceinline__ float2 bwd_to_float2(uint32_t packed) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
  }
}

template <typename T>
__device__ __forceinline__ void store1(T* ptr, float a) {
  if constexpr (std::is_same_v<T, __half>) {
    *ptr = __float2half_rn(a);
  } else {
    *ptr = __float2bfloat16_rn(a);
  }
}

template <typename T>
__device__ __forceinline__ void store2(T* ptr, float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(ptr) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(ptr) = __floats2bfloat162_rn(a, b);
  }
}

// Deterministic mode's bounds (kv_bound, zeroed): a block per (key rows chunk, KV head, batch),
// flattened (batch may pass a grid's 65535), bwd_prep_lanes lanes a row; per block the largest
// |K| element and squared |V| row norm, one atomic max each (non-negative floats order as their
// bits; NaN's above inf, and kept: a NaN in K or V makes its (batch, KV head)'s dQ NaN).
constexpr int kBwdBoundRows = 256;  // key rows a block
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kBwdPrepThreads)
    bwd_kv_bound_kernel(const __grid_constant__ BwdParams p, const BwdScratch s, int chunks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kLanes = bwd_prep_lanes<kHeadDim>(), kRowsPerStep = kBwdPrepThreads / kLanes;
  static_assert(kBwdBoundRows % kRowsPerStep == 0);
  __shared__ float block_max[2][kBwdPrepThreads / 32];
  const int chunk = int(blockIdx.x % unsigned(chunks));
  const int pair = int(blockIdx.x / unsigned(chunks));  // batch * heads_k + head_k
  const int head_k = pair % p.heads_k;
  const SeqInfo seq(p, pair / p.heads_k);
  const int row_end = min(seq.seqlen_k(p), (chunk + 1) * kBwdBoundRows);
  const int lane = threadIdx.x % kLanes;
  const T* k = static_cast<const T*>(p.k) + seq.k_offset(p, head_k) + lane * 8;
  const T* v = static_cast<const T*>(p.v) + seq.v_offset(p, head_k) + lane * 8;
  // NaN-keeping maxima (fmaxf would drop a NaN).
  auto keep_max = [](float m, float x) { return x > m || x != x ? x : m; };
  float kmax = 0.f, vmax = 0.f;
  // The same trip count in every thread of the block (the shuffles want whole warps).
  for (int r0 = chunk * kBwdBoundRows; r0 < (chunk + 1) * kBwdBoundRows; r0 += kRowsPerStep) {
    const int r = r0 + int(threadIdx.x) / kLanes;
    float v2 = 0.f;
    if (r < row_end && lane * 8 < p.head_dim) {
      const uint4 kv = __ldg(reinterpret_cast<const uint4*>(k + int64_t(r) * p.k_strides.row));
      const uint4 vv = __ldg(reinterpret_cast<const uint4*>(v + int64_t(r) * p.v_strides.row));
      const uint32_t kw[4] = {kv.x, kv.y, kv.z, kv.w}, vw[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 x = bwd_to_float2<T>(kw[w]), y = bwd_to_float2<T>(vw[w]);
        kmax = keep_max(keep_max(kmax, fabsf(x.x)), fabsf(x.y));
        v2 = fmaf(y.x, y.x, fmaf(y.y, y.y, v2));
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
      v2 += __shfl_xor_sync(0xffffffffu, v2, offset);
    }
    vmax = keep_max(vmax, v2);
  }
  // The block's maxima as unsigned bits (max of the bits is the max of non-negative floats).
  unsigned km = __float_as_uint(kmax), vm = __float_as_uint(vmax);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    km = max(km, __shfl_xor_sync(0xffffffffu, km, offset));
    vm = max(vm, __shfl_xor_sync(0xffffffffu, vm, offset));
  }
  if (threadIdx.x % 32 == 0) {
    block_max[0][threadIdx.x / 32] = __uint_as_float(km);
    block_max[1][threadIdx.x / 32] = __uint_as_float(vm);
  }
  __syncthreads();
  if (threadIdx.x < 2) {
    unsigned m = 0;
    for (int w = 0; w < kBwdPrepThreads / 32; ++w) {
      m = max(m, __float_as_uint(block_max[threadIdx.x][w]));
    }
    atomicMax(reinterpret_cast<unsigned*>(s.kv_bound) + 2 * int64_t(pair) + threadIdx.x, m);
  }
#endif
}

// bwd_prep_lanes lanes a row, 16 bytes of dO and O each; kFixed (deterministic mode): the row
// scales too, from dO's norm and kv_bound (bwd_kv_bound_kernel, launched before).
template <typename T, int kHeadDim, bool kFixed>
__global__ void __launch_bounds__(kBwdPrepThreads)
    bwd_prep_kernel(const __grid_constant__ BwdParams p, const BwdScratch s) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kLanes = bwd_prep_lanes<kHeadDim>(), kRowsPerStep = kBwdPrepThreads / kLanes;
  static_assert(kLanes * 8 >= kHeadDim && 32 % kLanes == 0);
  const int64_t total = int64_t(p.batch) * p.heads * s.rows_pad;
  const int lane = threadIdx.x % kLanes;
  // Read-only loads (ld.global.nc), which the compiler may move above the previous row's
  // stores: two rows' loads in flight a thread.
#pragma unroll 2
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerStep + threadIdx.x / kLanes; row < total;
       row += int64_t(gridDim.x) * kRowsPerStep) {
    const int64_t bh = row / s.rows_pad;
    const int r = int(row % s.rows_pad), h = int(bh % p.heads);
    const SeqInfo seq(p, int(bh / p.heads));
    const bool live = r < seq.seqlen_q(p);
    float acc = 0.f, do2 = 0.f;
    if (live && lane * 8 < p.head_dim) {
      const uint4 dov = __ldg(reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.dout) + seq.do_offset(p, h) + r * p.do_strides.row + lane * 8));
      const uint4 ov = __ldg(reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.o) + seq.o_offset(p, h) + r * p.o_strides.row + lane * 8));
      const uint32_t dw[4] = {dov.x, dov.y, dov.z, dov.w}, ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 x = bwd_to_float2<T>(dw[w]), y = bwd_to_float2<T>(ow[w]);
        acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
        if constexpr (kFixed) do2 = fmaf(x.x, x.x, fmaf(x.y, x.y, do2));
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
      acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      if constexpr (kFixed) do2 += __shfl_xor_sync(0xffffffffu, do2, offset);
    }
    if (lane == 0) {
      s.dsum[row] = acc;
      // lse is +inf for a row that saw no key: P = 0 there as past the sequence.
      s.lse2[row] = live ? p.lse[seq.lse_offset(p, h) + r] * float(M_LOG2E) : INFINITY;
      if constexpr (kFixed) {
        const int head_k = h / (p.heads / p.heads_k);
        s.dq_scale[row] =
            dq_fixed_scale(do2, s.kv_bound + 2 * (int64_t(seq.batch) * p.heads_k + head_k));
      }
    }
  }
#endif
}

// dq = softmax_scale * accumulator. The accumulator holds each query tile in the order the
// main kernel stages it for its bulk adds (BwdTraits::dq_slot: the dQ MMA's values of column
// block p, float4 j of thread t at (slot(p) kdQPartVecs + j) 128 + t): a block takes a tile,
// thread (c, t) of its two warpgroups the blocks c, c + 2, ..., whose (row, column) the dQ
// MMA's thread layout gives. All of a thread's loads are issued before its first store (the
// loads and stores may alias for the compiler, so it keeps the order it is given), and the
// tile goes out through shared memory as 16-byte row pieces, not 4-byte ones.
template <class Tr, bool kFixed>
__global__ void __launch_bounds__(kBwdPrepThreads)
    bwd_convert_dq_kernel(const __grid_constant__ BwdParams p, const BwdScratch s) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Tr::Raw;
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;
  // Rows padded by 16 bytes: the (row, column) stores below hit 32 banks.
  constexpr int kRowElems = kHeadDim + 8, kPieces = kHeadDim / 8;
  __shared__ __align__(16) T tile_s[kBlockM * kRowElems];
  pdl_wait();  // the main kernel's adds (a no-op without programmatic launch)
  static_assert(kBwdPrepThreads == 256 && Tr::kdQParts % 2 == 0);
  const int cw = threadIdx.x / 128, tid = threadIdx.x % 128;
  typename Tr::MmadQ mma_dq;
  // (row, column) of each value; (column, row) for dQ^T (BwdTraits::kdQT).
  Tensor cdQ =
      mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(typename Tr::ShapedQAcc{}));
  static_assert(decltype(size(cdQ))::value == 4 * Tr::kdQPartVecs);
  constexpr int kParts = Tr::kdQParts / 2, kVecs = Tr::kdQPartVecs;  // a thread's
  const int64_t tiles_per_head = s.rows_pad / kBlockM;
  const int64_t tiles = int64_t(p.batch) * p.heads * tiles_per_head;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t bh = tile / tiles_per_head;
    const int row0 = int(tile % tiles_per_head) * kBlockM, h = int(bh % p.heads);
    const SeqInfo seq(p, int(bh / p.heads));
    const float4* src = reinterpret_cast<const float4*>(s.dq + tile * kBlockM * kHeadDim);
    float4 v[kParts][kVecs];  // thread (cw, tid)'s values of column block cw + 2 i
    CUTE_UNROLL
    for (int i = 0; i < kParts; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < kVecs; ++j) {
        v[i][j] = src[(Tr::dq_slot(cw + 2 * i) * kVecs + j) * 128 + tid];
      }
    }
    // Value x of tile row r, times softmax_scale; kFixed: x's bits are the fixed-point int32,
    // over the row's scale (a power of two).
    auto out = [&](float x, int r) {
      if constexpr (kFixed) {
        const float scale = s.dq_scale[tile * kBlockM + r];
        return float(__float_as_int(x)) * p.softmax_scale * (1.f / scale);
      } else {
        return x * p.softmax_scale;
      }
    };
    CUTE_UNROLL
    for (int i = 0; i < kParts; ++i) {
      const int col0 = Tr::dq_part_col0(cw + 2 * i), row0p = Tr::dq_part_row0(cw + 2 * i);
      CUTE_UNROLL
      for (int j = 0; j < kVecs; ++j) {
        if constexpr (Tr::kdQT) {  // value pairs run along rows: one store each
          const float e[4] = {v[i][j].x, v[i][j].y, v[i][j].z, v[i][j].w};
          CUTE_UNROLL
          for (int k = 0; k < 4; ++k) {
            const int r = row0p + get<1>(cdQ(4 * j + k)), c = col0 + get<0>(cdQ(4 * j + k));
            store1(tile_s + r * kRowElems + c, out(e[k], r));
          }
        } else {
          const int r = get<0>(cdQ(4 * j)), c = col0 + get<1>(cdQ(4 * j));
          const int r2 = get<0>(cdQ(4 * j + 2)), c2 = col0 + get<1>(cdQ(4 * j + 2));
          store2(tile_s + r * kRowElems + c, out(v[i][j].x, r), out(v[i][j].y, r));
          store2(tile_s + r2 * kRowElems + c2, out(v[i][j].z, r2), out(v[i][j].w, r2));
        }
      }
    }
    __syncthreads();
    T* dq = static_cast<T*>(p.dq) + seq.dq_offset(p, h);
    const int rows = seq.rows_q(p);
    // dq is 16-byte aligned with strides of multiples of 8 (the API's check_kernel_tensor).
    for (int i = threadIdx.x; i < kBlockM * kPieces; i += 256) {
      const int r = i / kPieces, c = i % kPieces * 8;
      if (row0 + r < rows && c < p.head_dim) {
        *reinterpret_cast<uint4*>(dq + int64_t(row0 + r) * p.dq_strides.row + c) =
            *reinterpret_cast<const uint4*>(tile_s + r * kRowElems + c);
      }
    }
    __syncthreads();  // before the next tile's stores into tile_s
  }
#endif
}

}  // namespace flash::fa3
