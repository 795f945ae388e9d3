// FA2 forward launcher: grid shape, the stage, dropout and score-mod variants and the
// shared-memory opt-in. Included by the generated instantiation files only.
#pragma once

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "common/kv_box_map.h"
#include "common/pdl.h"
#include "fa2/fa2.h"
#include "fa2/fa2_decode_kernel.cuh"
#include "fa2/fa2_fwd_kernel.cuh"

namespace flash::fa2 {

// Split-KV's merge of the splits (FwdParams::o_accum): one block per (batch, head, query row),
// lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse) O_s; a row no split saw a key
// for gets zeros and lse +inf. Warp 0 turns the splits' lse into weights while every thread
// loads its columns of the first kBatch splits, then each thread sums its columns over the
// splits. A decode step waits on this kernel's latency, so every global load is issued in
// batches into registers before its first use: written as one loop, ptxas had issued the O
// loads one at a time behind each FMA (batch 1, 33 splits: 33 round trips; ncu 14.4 us
// against cuDNN's reduction's 4.4); the first batch does not wait for the weights (one round
// trip for both where there are at most kBatch splits). Dense (batch, seqlen_q, heads) rows
// only (fa2.h).
template <typename T>
__global__ void __launch_bounds__(128) combine_splits_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kMaxSplits = 128, kBatch = 32, kThreads = 128;  // fa2.h: num_splits <= 128
  constexpr int kCols = 2;  // columns a thread sums: head_dim <= 256
  __shared__ float weight[kMaxSplits];
  const int64_t rows = int64_t(p.batch) * p.heads * p.seqlen_q;
  const int64_t r = blockIdx.x;  // (batch, head, row) as lse's
  const int i = int(r % p.seqlen_q), h = int(r / p.seqlen_q % p.heads);
  const int b = int(r / p.seqlen_q / p.heads);
  const int splits = p.num_splits;
  const int64_t split_stride = rows * p.head_dim;
  const float* o = p.o_accum + r * p.head_dim;  // column d of split s at o[s * split_stride + d]
  pdl_wait();  // the partials (a no-op unless launched with pdl: launch_decode)
  // Unpredicated loads (past the last split: the last split again, at weight 0), so that ptxas
  // does not fold each load into its FMA's predicate and issue them one by one.
  float x[kCols][kBatch];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int d = threadIdx.x + c * kThreads;
    if (d < p.head_dim) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) x[c][j] = o[int64_t(min(j, splits - 1)) * split_stride + d];
    }
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float l[kMaxSplits / 32];  // split lane + 32 j's lse; -inf past the splits (weight 0)
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      const int s = lane + 32 * j;
      l[j] = s < splits ? p.lse_accum[s * rows + r] : -INFINITY;
    }
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) m = fmaxf(m, l[j]);
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int j = 0; j < kMaxSplits / 32; ++j) sum += expf(l[j] - m);
    }
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float lse = m == -INFINITY ? INFINITY : m + logf(sum);
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      weight[lane + 32 * j] = l[j] == -INFINITY ? 0.f : expf(l[j] - lse);
    }
    if (lane == 0) p.lse[r] = lse;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.o) + b * p.o_strides.batch + i * p.o_strides.row +
           h * p.o_strides.head;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int d = threadIdx.x + c * kThreads;
    if (d >= p.head_dim) continue;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) acc += weight[j] * x[c][j];
    for (int s0 = kBatch; s0 < splits; s0 += kBatch) {
      float y[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) y[j] = o[int64_t(min(s0 + j, splits - 1)) * split_stride + d];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) acc += weight[s0 + j] * y[j];
    }
    out[d] = T(acc);
  }
}

// The split-KV accumulators in the plan's workspace (fa2.h).
inline FwdParams with_splits(const FwdParams& call, const FwdPlan& plan) {
  FwdParams p = call;
  if (plan.num_splits > 1) {
    const int64_t rows = int64_t(plan.num_splits) * p.batch * p.heads * p.seqlen_q;
    p.num_splits = plan.num_splits;
    p.lse_accum = static_cast<float*>(p.workspace);
    // O after the lse, 16-byte aligned: the decode kernel stores it as float2 (an odd number
    // of rows, e.g. one head, one token, three splits, would misalign it).
    p.o_accum = p.lse_accum + round_up(rows, 4);
  }
  return p;
}

// Element: CuTe's 16-bit type (FwdTraits::Element), one instantiation for both forwards.
template <typename Element>
void launch_combine(const FwdParams& p, cudaStream_t stream, bool pdl = false) {
  const int64_t rows = int64_t(p.batch) * p.heads * p.seqlen_q;
  launch(combine_splits_kernel<Element>, dim3(unsigned(rows)), dim3(128), 0, stream, pdl, p);
  FLASH_CHECK_LAUNCH();
}

template <typename T, int kHeadDim, int kHalves, bool kTma>
void launch_decode_kernel(const FwdParams& p, const DecodeTmaMaps& maps, cudaStream_t stream,
                          bool pdl) {
  using Tr = DecodeTraits<T, kHeadDim>;
  auto kernel = decode_kernel<T, kHeadDim, kHalves, kTma>;
  if (Tr::kSmemBytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tr::kSmemBytes));
  }
  const dim3 grid(unsigned(int64_t(p.batch) * p.heads_k * decode_row_groups(p)),
                  unsigned(p.num_splits));
  launch(kernel, grid, dim3(32), Tr::kSmemBytes, stream, pdl, p, maps);
}

// kHalves from the rows: one 8-row half where a KV head has at most 8 query rows.
template <typename T, int kHeadDim, bool kTma>
void launch_decode_halves(const FwdParams& p, const DecodeTmaMaps& maps, cudaStream_t stream,
                          bool pdl) {
  if (decode_rows(p) <= kDecodeRows / 2) {
    launch_decode_kernel<T, kHeadDim, 1, kTma>(p, maps, stream, pdl);
  } else {
    launch_decode_kernel<T, kHeadDim, 2, kTma>(p, maps, stream, pdl);
  }
}

template <typename T, int kHeadDim>
void launch_decode(const FwdParams& call, const FwdPlan& plan, cudaStream_t stream) {
  const FwdParams p = with_splits(call, plan);
  using Tr = DecodeTraits<T, kHeadDim>;
  bool tma = false;
  if constexpr (kHeadDim % 64 == 0) {
    // A paged cache's boxes stay within a page: the largest power of two dividing both the
    // page and kBlockN; pages of fewer than 8 rows (or not a multiple of 8) copy row by row.
    const bool paged = p.block_table != nullptr;
    const int box_rows = paged ? std::gcd(p.page_size, Tr::kBlockN) : Tr::kBlockN;
    tma = p.code_arch == 90 && p.cache_batch > 0 && box_rows % 8 == 0;
    if (tma) {
      const int rows = paged ? p.page_size : p.seqlen_k;
      const DecodeTmaMaps maps{kv_box_map(p.k, p.k_strides, p, rows, 64, box_rows),
                               kv_box_map(p.v, p.v_strides, p, rows, 64, box_rows), box_rows};
      launch_decode_halves<T, kHeadDim, true>(p, maps, stream, plan.pdl);
    }
  }
  if (!tma) launch_decode_halves<T, kHeadDim, false>(p, DecodeTmaMaps{}, stream, plan.pdl);
  FLASH_CHECK_LAUNCH();
  // CuTe's element type, as launch_fwd's: one combine instantiation per dtype.
  if (p.num_splits > 1) launch_combine<typename CuteType<T>::type>(p, stream, plan.pdl);
}

template <class Tr, bool kKvCache>
void launch_fwd(const FwdParams& call, const FwdPlan& plan, cudaStream_t stream) {
  const FwdParams p = with_splits(call, plan);
  const int m_blocks = int((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
  // A query tile reads its KV head's K and V, shared by heads_per_kv query heads.
  const int heads_per_kv = p.heads / p.heads_k;
  const int64_t kv_bytes = int64_t(p.seqlen_k) * Tr::kHeadDim * 2 * sizeof(typename Tr::Element);
  auto kernel = fwd_kernel<Tr, kKvCache>;
  if (Tr::kSmemBytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Tr::kSmemBytes));
  }
  const TileOrder order =
      tile_order(m_blocks, p.batch, p.heads, heads_per_kv, kv_bytes / heads_per_kv, p.l2_bytes,
                 resident_blocks(kernel, Tr::kThreads, Tr::kSmemBytes, p.num_sms),
                 plan.head_group);
  kernel<<<dim3(order.grid(), p.num_splits), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, order);
  FLASH_CHECK_LAUNCH();
  if constexpr (kKvCache) {
    if (p.num_splits > 1) launch_combine<typename Tr::Element>(p, stream);
  }
}

// Two K/V stages where the device's shared memory holds them, else one (FwdTile).
template <typename T, int kHeadDim, bool kDropout, bool kScoreMod, bool kKvCache>
void launch_fwd_stages(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  constexpr int kStages = FwdTile<kHeadDim>::kStages;
  using Table = FwdTraits<T, kHeadDim, kStages, kDropout, kScoreMod>;
  if constexpr (kStages == 2 && Table::kSmemBytes > kSm86SmemBytes) {
    int device = 0, max_smem = 0;
    FLASH_CHECK_CUDA(cudaGetDevice(&device));
    FLASH_CHECK_CUDA(
        cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (Table::kSmemBytes > max_smem) {
      launch_fwd<FwdTraits<T, kHeadDim, 1, kDropout, kScoreMod>, kKvCache>(p, plan, stream);
      return;
    }
  }
  launch_fwd<Table, kKvCache>(p, plan, stream);
}

template <typename T, int kHeadDim, bool kDropout, bool kKvCache>
void launch_fwd_variant(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  if (p.softcap > 0.f || p.alibi_slopes != nullptr) {
    launch_fwd_stages<T, kHeadDim, kDropout, true, kKvCache>(p, plan, stream);
  } else {
    launch_fwd_stages<T, kHeadDim, kDropout, false, kKvCache>(p, plan, stream);
  }
}

template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream) {
  // Dropout, the score mods (softcap, ALiBi) and the KV-cache kernels (page gather, split-KV)
  // are template flags: their state and code cost registers, and the loop's instruction
  // footprint, that the plain kernel should not carry. Masks and windows are runtime fields.
  // Paged K / V comes without dropout (an inference layout; fwd_unsupported).
  if (plan.decode) {
    launch_decode<T, kHeadDim>(params, plan, stream);
  } else if (params.kv_cache || params.block_table != nullptr) {
    launch_fwd_variant<T, kHeadDim, false, true>(params, plan, stream);
  } else if (params.dropout_p > 0.f) {
    launch_fwd_variant<T, kHeadDim, true, false>(params, plan, stream);
  } else {
    launch_fwd_variant<T, kHeadDim, false, false>(params, plan, stream);
  }
}

}  // namespace flash::fa2
