// Where sequence `batch` of a call lies and how long it is: the one place a kernel asks. Today
// every batch is dense (each sequence has the call's lengths and starts a batch stride into each
// tensor); the variable-length and KV-cache entry points will build it from cu_seqlens, seqused
// and page tables, so that the kernels that go through it do not change again.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "common/params.h"

namespace flash {

struct SeqInfo {
  int batch;

  __host__ __device__ SeqInfo(const FwdParams&, int batch_) : batch(batch_) {}

  // The sequence's lengths. Dense: the call's, read from the kernel parameters where used (held
  // in registers across FA2's forward loop, they cost its hdim 64 kernel 56 B of spill loads and
  // 1.5-2%).
  __host__ __device__ int seqlen_q(const FwdParams& p) const { return p.seqlen_q; }
  __host__ __device__ int seqlen_k(const FwdParams& p) const { return p.seqlen_k; }

  // Element offsets of the sequence's row 0 in `head` of q, k, v, out.
  __host__ __device__ int64_t q_offset(const FwdParams& p, int head) const {
    return row0(p.q_strides, head);
  }
  __host__ __device__ int64_t k_offset(const FwdParams& p, int head_k) const {
    return row0(p.k_strides, head_k);
  }
  __host__ __device__ int64_t v_offset(const FwdParams& p, int head_k) const {
    return row0(p.v_strides, head_k);
  }
  __host__ __device__ int64_t o_offset(const FwdParams& p, int head) const {
    return row0(p.o_strides, head);
  }
  // Index of the sequence's row 0 in `head` of the lse, (batch, heads, seqlen_q).
  __host__ __device__ int64_t lse_offset(const FwdParams& p, int head) const {
    return (int64_t(batch) * p.heads + head) * p.seqlen_q;
  }
  // The backward's gradients and its dO, as above.
  __host__ __device__ int64_t do_offset(const BwdParams& p, int head) const {
    return row0(p.do_strides, head);
  }
  __host__ __device__ int64_t dq_offset(const BwdParams& p, int head) const {
    return row0(p.dq_strides, head);
  }
  __host__ __device__ int64_t dk_offset(const BwdParams& p, int head_k) const {
    return row0(p.dk_strides, head_k);
  }
  __host__ __device__ int64_t dv_offset(const BwdParams& p, int head_k) const {
    return row0(p.dv_strides, head_k);
  }
  // Row 0 of the sequence in `head` of a per-row fp32 scratch of the backward (D, the dQ
  // accumulator) in which every sequence is padded to a multiple of kRowPad rows. One
  // expression on purpose: with the padded rows computed first, the FA2 backward's SASS moved 1%.
  template <int kRowPad>
  __host__ __device__ int64_t scratch_row0(const FwdParams& p, int head) const {
    return (int64_t(batch) * p.heads + head) *
           ((int64_t(p.seqlen_q) + kRowPad - 1) / kRowPad * kRowPad);
  }
  // The sequence's (rows, head_dim) slice of `head` in a (seqlen, head_dim, heads, batch) view,
  // such as the TMA tensors of the FA3 forward.
  template <class Tensor>
  __host__ __device__ auto rows(Tensor const& m, int head) const {
    return m(cute::_, cute::_, head, batch);
  }

 private:
  // Dense: the sequence starts a batch stride in.
  __host__ __device__ int64_t row0(const Strides& s, int head) const {
    return batch * s.batch + head * s.head;
  }
};

}  // namespace flash
