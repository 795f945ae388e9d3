// The FA3 backward's kernels around the main one. Scratch rows (per batch and head, padded to
// the main kernel's rows a step, bwd_block_m) hold, for its unguarded tile loads:
//   lse2   the forward's lse in base 2; +inf past the sequence (P = 0 there)
//   dsum   D = rowsum(dO o O); 0 past the sequence
//   dq     the dQ accumulator (fp32, unscaled), zeroed by a memset, added to by every key
//          tile; dq_copies of them in some deterministic calls, summed in order at the
//          conversion. Deterministic mode zeroes none: a tile's first key tile stores, and
//          the conversion reads only the tiles some key tile wrote (their counter past 0)
//   next_item  the persistent kernel's item counter (fa3_bwd_items.h), zeroed with the dq
//          accumulators, or alone in deterministic mode
//   split  the split items' part counters and fp32 dK / dV sums (BwdPlan::split_items), zeroed
//          with the dq accumulators
//   dq_turns  deterministic mode only: a counter per query tile (kBlockM rows) and copy
//          (fa3_bwd_kernel.cuh), zeroed by a memset
// and the conversion of the accumulator into dq (times softmax_scale, in the output dtype).
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
  float* dq;
  int64_t dq_copy_stride;  // floats between two copies of the accumulator
  int dq_copies;
  int* dq_turns;     // nullptr unless deterministic
  int64_t rows_pad;  // per (batch, head)
  unsigned* next_item;  // items taken (past the CTAs' first, gridDim.x, unless counted)
  int items;            // (key tile, KV head, batch): BwdPlan's
  int tail_pairs;       // the last pairs, taken key tile by key tile: BwdPlan's
  // The split items (BwdPlan::split_items; fa3_bwd_items.h): items from split_first are their
  // parts, split_parts each; split_count: the parts done, split_acc: the fp32 dK / dV sums,
  // per split item (zeroed with the dQ accumulator).
  int split_first;
  int split_parts;
  unsigned* split_count;
  float* split_acc;
};

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

// bwd_prep_lanes lanes a row, 16 bytes of dO and O each.
template <typename T, int kHeadDim>
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
    float acc = 0.f;
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
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
      acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    }
    if (lane == 0) {
      s.dsum[row] = acc;
      // lse is +inf for a row that saw no key: P = 0 there as past the sequence.
      s.lse2[row] = live ? p.lse[seq.lse_offset(p, h) + r] * float(M_LOG2E) : INFINITY;
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
template <class Tr>
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
    // This thread's first value of column block cw + 2 i in accumulator copy c.
    auto part = [&](int c, int i) {
      return src + c * s.dq_copy_stride / 4 + Tr::dq_slot(cw + 2 * i) * kVecs * 128 + tid;
    };
    // Deterministic mode: copy c's tile holds something once its turn counter is past 0.
    const int* turns = s.dq_turns == nullptr ? nullptr : s.dq_turns + tile;
    auto written = [&](int c) { return turns == nullptr || turns[c * tiles] > 0; };
    float4 v[kParts][kVecs];
    const bool first = written(0);
    CUTE_UNROLL
    for (int i = 0; i < kParts; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < kVecs; ++j) v[i][j] = first ? part(0, i)[j * 128] : float4{};
    }
    for (int c = 1; c < s.dq_copies; ++c) {  // in order: deterministic
      if (!written(c)) continue;
      CUTE_UNROLL
      for (int i = 0; i < kParts; ++i) {
        CUTE_UNROLL
        for (int j = 0; j < kVecs; ++j) {
          const float4 w = part(c, i)[j * 128];
          v[i][j].x += w.x, v[i][j].y += w.y, v[i][j].z += w.z, v[i][j].w += w.w;
        }
      }
    }
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
            store1(tile_s + r * kRowElems + c, e[k] * p.softmax_scale);
          }
        } else {
          const int r = get<0>(cdQ(4 * j)), c = col0 + get<1>(cdQ(4 * j));
          const int r2 = get<0>(cdQ(4 * j + 2)), c2 = col0 + get<1>(cdQ(4 * j + 2));
          store2(tile_s + r * kRowElems + c, v[i][j].x * p.softmax_scale,
                 v[i][j].y * p.softmax_scale);
          store2(tile_s + r2 * kRowElems + c2, v[i][j].z * p.softmax_scale,
                 v[i][j].w * p.softmax_scale);
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
