// The only input a kernel gets: plain pointers, strides in elements (64-bit, since
// batch * seqlen * heads * headdim passes 2^31 on long sequences), sizes and flags.
// No torch type appears here; the API layer (csrc/api/) fills these from tensors.
#pragma once

#include <cstdint>

namespace flash {

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
  int seqlen_q = 0, seqlen_k = 0;
  int head_dim = 0;  // the real head dim (<= the kernel's kHeadDim)

  float softmax_scale = 0.f;       // applied to q.k
  float softmax_scale_log2 = 0.f;  // softmax_scale * log2(e): the kernels work in exp2
  bool causal = false;             // aligned to the bottom-right corner

  // Family-specific scratch in global memory, allocated by the API layer
  // (FA1: the running O in fp32 and the running max/sum per row; see fa1/fa1_fwd_kernel.cuh).
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  int q_tiles_per_block = 0;  // FA1: Q tiles one block walks (chosen by the launcher)

  int num_sms = 0;  // of the current device, for grid sizing
  int arch = 0;     // its compute capability, major * 10 + minor (tile choice)
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
};

}  // namespace flash
