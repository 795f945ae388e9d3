// The only input a kernel gets: plain pointers, strides in elements (64-bit, since
// batch * seqlen * heads * headdim passes 2^31 on long sequences), sizes and flags.
// No torch type appears here; the API layer (csrc/api/) fills these from tensors.
#pragma once

#include <cstdint>

namespace flash {

// Where the Philox seed and offset come from. Outside CUDA graph capture they are values; under
// capture torch hands out device pointers (read when the graph replays) plus an offset within
// the graph, so a replay draws fresh numbers without re-recording. Resolved on the device by
// philox_seed_offset() in common/philox.cuh.
struct PhiloxArgs {
  uint64_t seed = 0, offset = 0;
  const int64_t* seed_ptr = nullptr;    // non-null: read seed (and offset) from the device
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;       // added to *offset_ptr
};

// Strides of a (batch, seqlen, heads, headdim) tensor whose last dim is contiguous.
struct Strides {
  int64_t batch = 0;
  int64_t row = 0;   // one step along seqlen
  int64_t head = 0;
};

struct FwdParams {
  const void* q = nullptr;  // (b, seqlen_q, h, d)
  const void* k = nullptr;  // (b, seqlen_k, h_k, d)
  const void* v = nullptr;  // (b, seqlen_k, h_k, d)
  void* o = nullptr;        // (b, seqlen_q, h, d)
  float* lse = nullptr;     // (b, h, seqlen_q), natural log; +inf for rows that see no key
  Strides q_strides, k_strides, v_strides, o_strides;

  int batch = 0, heads = 0, heads_k = 0;
  int seqlen_q = 0, seqlen_k = 0;  // variable-length batches: the longest sequence's
  // Variable-length batches (cu_seqlens_q set; nullptr: dense): q / k / v / o are (total, heads,
  // head_dim) with Strides::batch 0, sequence b starts at row cu_seqlens_[b] and has
  // cu_seqlens_[b + 1] - cu_seqlens_[b] rows, of which the first seqused_[b] (where given) take
  // part; lse is (heads, total_q).
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  const int* seqused_q = nullptr;
  const int* seqused_k = nullptr;
  int total_q = 0, total_k = 0;  // variable-length: the packed tensors' rows
  // KV cache (flash_attn_with_kvcache, kv_cache set): k / v are the caches (batch_cache,
  // capacity, heads_k, head_dim) with seqlen_k the capacity; sequence b reads cache row
  // cache_batch_idx[b] (nullptr: b), keys [cache_leftpad[b] (nullptr: 0), cached + seqlen_new),
  // cached = cache_seqlens[b] (nullptr: cache_seqlen). The new keys are already in the cache
  // (common/kvcache_prep.h).
  bool kv_cache = false;
  // Paged K / V (block_table set; variable-length or KV cache): k / v are pools (num_blocks,
  // page_size, heads_k, head_dim) with Strides::batch a page; key j of sequence b is row
  // j % page_size of page block_table[b * block_table_stride + j / page_size].
  const int* block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_size = 0;
  // Split-KV (fa2's forward over a KV cache): split s = blockIdx.y of num_splits takes its share
  // of each item's key tiles and writes O / l and the lse in fp32 to o_accum (num_splits,
  // batch, heads, seqlen_q, head_dim) and lse_accum (num_splits, batch, heads, seqlen_q), -inf
  // where it saw no key; a combine kernel writes out and lse. splits_requested: the call's
  // num_splits (0: automatic), read by the plan; the launcher sets the rest.
  int splits_requested = 0, num_splits = 1;
  float* o_accum = nullptr;
  float* lse_accum = nullptr;
  const int* cache_seqlens = nullptr;
  const int* cache_batch_idx = nullptr;
  const int* cache_leftpad = nullptr;
  int cache_seqlen = 0, seqlen_new = 0;
  // KV cache: kvcache_prep is the kernel just ahead (it lets a pdl-launched kernel start);
  // q_from_prep: q is its rotated copy (it writes the new keys in any case).
  bool after_prep = false, q_from_prep = false;
  // KV cache or paged K / V: k / v's first extent: the caches (>= batch with cache_batch_idx) or
  // a pool's pages.
  int cache_batch = 0;
  int head_dim = 0;  // the real head dim (<= the kernel's kHeadDim)

  float softmax_scale = 0.f;       // applied to q.k
  // The kernels keep a "score" per (row, key) and exponentiate it in base 2:
  //   no softcap: score = q.k,                            logit = score * softmax_scale
  //   softcap:    score = tanh(q.k * softcap_prescale),   logit = score * softcap
  // softmax_scale_log2 = log2(e) * (softmax_scale or softcap) turns a score into a logit in
  // base 2, so p = exp2(score * softmax_scale_log2 - max) and lse = (max + log2(sum)) * ln(2).
  float softmax_scale_log2 = 0.f;
  float softcap = 0.f;             // 0: off
  float softcap_prescale = 0.f;    // softmax_scale / softcap

  // Visible keys of query row i, with diag = i + seqlen_k - seqlen_q (bottom-right aligned):
  // diag - window_left <= j <= diag + window_right, -1 meaning unbounded on that side.
  // causal is window_right = 0; the API layer sets both fields consistently.
  bool causal = false;
  int window_left = -1, window_right = -1;

  // ALiBi: logit += -slope * |diag - j|. fp32 slope of (b, h) at b * alibi_batch_stride + h
  // (stride 0 for slopes of shape (heads,)). nullptr: off.
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;

  // Dropout on the probabilities (not on the lse). An element is kept iff a 16-bit Philox
  // draw is below keep_threshold (= round((1 - dropout_p) * 65536)); kept values are scaled by
  // rp_keep = 1 / (1 - dropout_p). See common/philox.cuh for which draw belongs to which
  // (row, key). dropout_p == 0: off.
  float dropout_p = 0.f;
  float rp_keep = 1.f;
  uint32_t keep_threshold = 65536;
  PhiloxArgs philox;
  // Forward: where the kernel writes the (seed, offset) it used, for the backward and for
  // _C.dropout_mask. Backward: philox points its seed_ptr / offset_ptr here.
  int64_t* rng_state = nullptr;

  // Family-specific scratch in global memory, allocated by the API layer
  // (FA1: the running O in fp32 and the running max/sum per row; see fa1/fa1_fwd_kernel.cuh).
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  int q_tiles_per_block = 0;  // FA1: Q tiles one block walks (the launcher's, from its plan)

  int num_sms = 0;  // of the current device, for grid sizing
  int arch = 0;     // its compute capability, major * 10 + minor (tile choice)
  // The arch of the code the kernels run on it: the device's where the build has its machine
  // code, else an older target's (sm80 SASS on sm86) or the PTX's (a build of 80+PTX on an
  // H100, the default build on sm100). What sm90's instructions (TMA, programmatic launch)
  // need, where `arch` only sizes tiles and shared memory.
  int code_arch = 0;
  int l2_bytes = 0; // its L2 size, for the order in which blocks take tiles

  // FP8 (fa3's e4m3 forward): q / k / v hold e4m3, out bf16. The real Q is q * q_descale[b, h_k]
  // (likewise K, V), fp32 (batch, heads_k) at b * descale_batch_stride + h_k *
  // descale_head_stride; nullptr: 1. The kernel folds q_descale * k_descale into the softmax
  // scale and v_descale into O's normalisation.
  bool fp8 = false;
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t descale_batch_stride = 0, descale_head_stride = 0;
};

struct BwdParams : FwdParams {
  const void* dout = nullptr;  // (b, seqlen_q, h, d)
  void* dq = nullptr;          // (b, seqlen_q, h, d)
  void* dk = nullptr;          // (b, seqlen_k, h_k, d)
  void* dv = nullptr;          // (b, seqlen_k, h_k, d)
  Strides do_strides, dq_strides, dk_strides, dv_strides;

  float* dsum = nullptr;       // D = rowsum(dO * O), (b, h, seqlen_q_rounded), fp32
  float* dq_accum = nullptr;   // dQ in fp32, accumulated across K/V blocks
  bool deterministic = false;  // one writer per dQ element, in a fixed order
  bool dq_bulk = false;        // FA2, sm90: dQ tiles added by bulk reductions (launcher's choice)
  bool dq_defer = false;       // FA2: the last dQ chunk's reds spread over dK's GEMM (launcher's choice)
};

}  // namespace flash
