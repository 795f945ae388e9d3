// flash::launch_kvcache_prep (common/kvcache_prep.h). Compiled once, for every target arch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/check.h"
#include "common/kvcache_prep.h"
#include "common/pdl.h"

namespace flash {
namespace {

constexpr int kThreads = 128;
// Elements per thread per round: a decode step waits on this kernel, and with each load
// followed by its store (which may alias the next load) a 1-token append of 8 KV heads at
// hdim 128 was 16 memory round trips in a row (ncu: 8.4 us).
constexpr int kPerThread = 8;

template <class T> __device__ float to_float(T x);
template <> __device__ float to_float(__half x) { return __half2float(x); }
template <> __device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ T from_float(float x);
template <> __device__ __half from_float(float x) { return __float2half_rn(x); }
template <> __device__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

// Element d of row x (head_dim elements) rotated at table row pos (see KvcachePrep).
template <class T>
__device__ T rotated(const KvcachePrep& p, const T* x, int d, int pos) {
  const int half = p.rotary_half;
  if (p.rotary_cos == nullptr || d >= 2 * half) return x[d];
  const T* cos = static_cast<const T*>(p.rotary_cos) + int64_t(pos) * half;
  const T* sin = static_cast<const T*>(p.rotary_sin) + int64_t(pos) * half;
  int j, lo, hi;  // the pair (lo, hi) rotates by table entry j
  if (p.interleaved) {
    j = d / 2, lo = 2 * j, hi = lo + 1;
  } else {
    j = d % half, lo = j, hi = j + half;
  }
  const float c = to_float(cos[j]), s = to_float(sin[j]);
  const float a = to_float(x[lo]), b = to_float(x[hi]);
  return from_float<T>(d == lo ? a * c - b * s : a * s + b * c);
}

__device__ int clamp_position(const KvcachePrep& p, int pos) {
  return min(max(pos, 0), p.seqlen_ro - 1);
}

// Block (row, b): row `row` of sequence b's new keys / values and of its q.
template <class T>
__global__ void __launch_bounds__(kThreads) kvcache_prep_kernel(const KvcachePrep p) {
  // The attention kernel after this one, if launched with pdl (fa2's decode kernel), may be
  // scheduled now: its prologue overlaps this kernel, and it waits for this grid's writes.
  // This kernel itself must never be launched with pdl: the decode kernel's prologue reads the
  // lengths before its wait, safe only because whatever wrote them finished before this began.
  pdl_launch_dependents();
  const int b = blockIdx.y, row = blockIdx.x;
  const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_seqlen;
  if (p.k_new != nullptr && row < p.seqlen_new) {
    const int pos = cached + row;
    if (pos >= 0 && pos < p.capacity) {
      int64_t k_slot, v_slot;  // the position's row in each cache
      if (p.block_table != nullptr) {
        const int page = p.block_table[b * p.block_table_stride + pos / p.page_size];
        k_slot = page * p.k_cache_strides.batch + (pos % p.page_size) * p.k_cache_strides.row;
        v_slot = page * p.v_cache_strides.batch + (pos % p.page_size) * p.v_cache_strides.row;
      } else {
        const int64_t r = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
        k_slot = r * p.k_cache_strides.batch + int64_t(pos) * p.k_cache_strides.row;
        v_slot = r * p.v_cache_strides.batch + int64_t(pos) * p.v_cache_strides.row;
      }
      const int ro = p.rotary_cos != nullptr ? clamp_position(p, pos) : 0;
      const T* k =
          static_cast<const T*>(p.k_new) + b * p.k_new_strides.batch + row * p.k_new_strides.row;
      const T* v =
          static_cast<const T*>(p.v_new) + b * p.v_new_strides.batch + row * p.v_new_strides.row;
      T* k_cache = static_cast<T*>(p.k_cache) + k_slot;
      T* v_cache = static_cast<T*>(p.v_cache) + v_slot;
      const int n = p.heads_k * p.head_dim;
      for (int e0 = threadIdx.x; e0 < n; e0 += kThreads * kPerThread) {
        T kx[kPerThread], vx[kPerThread];  // all loads of a round before its stores (latency)
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          const int e = e0 + j * kThreads, h = e / p.head_dim, d = e % p.head_dim;
          if (e < n) {
            kx[j] = rotated(p, k + h * p.k_new_strides.head, d, ro);
            vx[j] = v[h * p.v_new_strides.head + d];
          }
        }
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          const int e = e0 + j * kThreads, h = e / p.head_dim, d = e % p.head_dim;
          if (e < n) {
            k_cache[h * p.k_cache_strides.head + d] = kx[j];
            v_cache[h * p.v_cache_strides.head + d] = vx[j];
          }
        }
      }
    }
  }
  if (p.q_out != nullptr && row < p.seqlen_q) {
    const int ro = clamp_position(p, cached + (p.q_per_row ? row : 0));
    const T* q = static_cast<const T*>(p.q) + b * p.q_strides.batch + row * p.q_strides.row;
    T* q_out = static_cast<T*>(p.q_out) + b * p.q_out_strides.batch + row * p.q_out_strides.row;
    const int n = p.heads * p.head_dim;
    for (int e0 = threadIdx.x; e0 < n; e0 += kThreads * kPerThread) {
      T qx[kPerThread];
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int e = e0 + j * kThreads;
        if (e < n) qx[j] = rotated(p, q + e / p.head_dim * p.q_strides.head, e % p.head_dim, ro);
      }
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int e = e0 + j * kThreads;
        if (e < n) q_out[e / p.head_dim * p.q_out_strides.head + e % p.head_dim] = qx[j];
      }
    }
  }
}

}  // namespace

bool launch_kvcache_prep(const KvcachePrep& p, cudaStream_t stream) {
  const int rows = std::max(p.k_new != nullptr ? p.seqlen_new : 0,
                            p.q_out != nullptr ? p.seqlen_q : 0);
  if (rows == 0 || p.batch == 0) return false;
  const dim3 grid(unsigned(rows), unsigned(p.batch));
  if (p.bf16) {
    kvcache_prep_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  } else {
    kvcache_prep_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  }
  FLASH_CHECK_LAUNCH();
  return true;
}

}  // namespace flash
