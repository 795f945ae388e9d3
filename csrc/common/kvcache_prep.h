// flash_attn_with_kvcache's step before the attention kernel: the new k / v written into the
// cache after each sequence's cached tokens (k rotated there first), and q rotated into a copy.
// One small launch for both; the attention then reads the cache as it stands. Decode sizes (a
// few tokens a sequence), so plain element-wise code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace flash {

struct KvcachePrep {
  bool bf16 = false;  // else fp16
  int batch = 0, seqlen_q = 0, seqlen_new = 0, heads = 0, heads_k = 0, head_dim = 0;

  // q (batch, seqlen_q, heads, head_dim) -> q_out (rotated), when rotary.
  const void* q = nullptr;
  void* q_out = nullptr;
  Strides q_strides, q_out_strides;
  // The new keys and values (batch, seqlen_new, heads_k, head_dim), or null.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  Strides k_new_strides, v_new_strides;
  // The caches: (batch_cache, capacity, heads_k, head_dim), or paged (num_blocks, page_size,
  // heads_k, head_dim) with block_table (batch, max_blocks); Strides::batch steps a cache row
  // or a page.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  Strides k_cache_strides, v_cache_strides;
  int capacity = 0;  // positions per sequence
  const int* block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_size = 0;
  const int* cache_batch_idx = nullptr;  // dense caches: sequence b's row (nullptr: b)
  // Tokens already cached: cache_seqlens[b], or cache_seqlen for all when null.
  const int* cache_seqlens = nullptr;
  int cache_seqlen = 0;

  // Rotary tables (seqlen_ro, rotary_dim / 2) in q's dtype, or null: dims [0, rotary_dim)
  // rotate in pairs, (2i, 2i + 1) if interleaved (GPT-J) else (i, i + rotary_dim / 2)
  // (GPT-NeoX). k row j rotates at cached + j; q row i at cached + i if q_per_row (causal or
  // local) else at cached.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int rotary_half = 0, seqlen_ro = 0;
  bool interleaved = false, q_per_row = false;
};

// Throws std::runtime_error on a launch failure. Positions past the cache are not written and
// rotary positions past the tables are clamped: a tensor cache_seqlens is never read on the
// host, so the frontend cannot check it.
// Returns whether it launched (nothing to append or rotate: no kernel).
bool launch_kvcache_prep(const KvcachePrep& p, cudaStream_t stream);

}  // namespace flash
