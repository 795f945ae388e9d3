// Where sequence `batch` of a call lies and how long it is: the one place a kernel asks. Dense:
// each sequence has the call's lengths and starts a batch stride into each tensor.
// Variable-length (params.cu_seqlens_q set): the sequences are packed along the rows, their
// starts and lengths in cu_seqlens / seqused. The KV-cache entry point will add page tables.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "common/params.h"

namespace flash {

struct SeqInfo {
  int batch;

  __host__ __device__ SeqInfo(const FwdParams&, int batch_) : batch(batch_) {}

  // Variable-length batches: read from cu_seqlens / seqused where used, not held (experiment:
  // members cost fa3's hdim 128 kernel 460 B of spills).
  __host__ __device__ int q_start(const FwdParams& p) const {
    return p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[batch] : 0;
  }
  __host__ __device__ int k_start(const FwdParams& p) const {
    if (p.cu_seqlens_q != nullptr) return p.cu_seqlens_k[batch];
    return p.cache_leftpad != nullptr ? p.cache_leftpad[batch] : 0;
  }
  // The batch index of the sequence's k / v: a KV cache's row (cache_batch_idx).
  __host__ __device__ int k_batch(const FwdParams& p) const {
    return p.cache_batch_idx != nullptr ? p.cache_batch_idx[batch] : batch;
  }
  // Rows of q / out the sequence has in the packed tensors (variable-length: past seqused_q,
  // rows that take no part, written as 0 with lse +inf); dense: seqlen_q.
  __host__ __device__ int rows_q(const FwdParams& p) const {
    if (p.cu_seqlens_q == nullptr) return p.seqlen_q;
    return p.cu_seqlens_q[batch + 1] - p.cu_seqlens_q[batch];
  }
  // The same for k / v: the backward writes dK = dV = 0 into the rows past seqused_k.
  __host__ __device__ int rows_k(const FwdParams& p) const {
    if (p.cu_seqlens_q == nullptr) return p.seqlen_k;
    return p.cu_seqlens_k[batch + 1] - p.cu_seqlens_k[batch];
  }
  __host__ __device__ int seqlen_q(const FwdParams& p) const {
    if (p.cu_seqlens_q == nullptr) return p.seqlen_q;
    return p.seqused_q != nullptr ? p.seqused_q[batch]
                                  : p.cu_seqlens_q[batch + 1] - p.cu_seqlens_q[batch];
  }
  __host__ __device__ int seqlen_k(const FwdParams& p) const {
    if (p.cu_seqlens_q != nullptr) {
      return p.seqused_k != nullptr ? p.seqused_k[batch]
                                    : p.cu_seqlens_k[batch + 1] - p.cu_seqlens_k[batch];
    }
    if (!p.kv_cache) return p.seqlen_k;
    const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_seqlen;
    // Clamped to the cache: a tensor cache_seqlens is never checked on the host.
    const int end = cached + p.seqlen_new;
    return (end < 0 ? 0 : end > p.seqlen_k ? p.seqlen_k : end) - k_start(p);
  }

  // Element offsets of the sequence's row 0 in `head` of q, k, v, out.
  __host__ __device__ int64_t q_offset(const FwdParams& p, int head) const {
    return row0(p.q_strides, head, q_start(p));
  }
  __host__ __device__ int64_t k_offset(const FwdParams& p, int head_k) const {
    return row0(p.k_strides, head_k, k_start(p), k_batch(p));
  }
  __host__ __device__ int64_t v_offset(const FwdParams& p, int head_k) const {
    return row0(p.v_strides, head_k, k_start(p), k_batch(p));
  }
  __host__ __device__ int64_t o_offset(const FwdParams& p, int head) const {
    return row0(p.o_strides, head, q_start(p));
  }
  // Paged K / V: the element offset of key j of the sequence in head_k of a pool with strides
  // s (k_offset / v_offset do not apply: a sequence's keys are not one run of rows).
  __device__ int64_t paged_row(const FwdParams& p, const Strides& s, int head_k, int j) const {
    const PagedKey at = paged_key(p, j);
    return at.page * s.batch + at.row * s.row + head_k * s.head;
  }
  // The same as (page, row in the page): K and V share it, their strides differ.
  struct PagedKey {
    int page, row;
  };
  __device__ PagedKey paged_key(const FwdParams& p, int j) const {
    const int i = j / p.page_size;
    return {p.block_table[batch * p.block_table_stride + i], j - i * p.page_size};
  }
  // Index of the sequence's row 0 in `head` of the lse: (batch, heads, seqlen_q) dense,
  // (heads, total_q) variable-length.
  __host__ __device__ int64_t lse_offset(const FwdParams& p, int head) const {
    return p.cu_seqlens_q != nullptr ? int64_t(head) * p.total_q + q_start(p)
                                     : (int64_t(batch) * p.heads + head) * p.seqlen_q;
  }
  // Elements between two heads of the lse: lse_offset(p, h) = lse_offset(p, 0) + h * this.
  __host__ __device__ int64_t lse_head_stride(const FwdParams& p) const {
    return p.cu_seqlens_q != nullptr ? p.total_q : p.seqlen_q;
  }
  // The backward's gradients and its dO, as above.
  __host__ __device__ int64_t do_offset(const BwdParams& p, int head) const {
    return row0(p.do_strides, head, q_start(p));
  }
  __host__ __device__ int64_t dq_offset(const BwdParams& p, int head) const {
    return row0(p.dq_strides, head, q_start(p));
  }
  __host__ __device__ int64_t dk_offset(const BwdParams& p, int head_k) const {
    return row0(p.dk_strides, head_k, k_start(p));
  }
  __host__ __device__ int64_t dv_offset(const BwdParams& p, int head_k) const {
    return row0(p.dv_strides, head_k, k_start(p));
  }
  // Row 0 of the sequence in `head` of a per-row fp32 scratch of the backward (D, the dQ
  // accumulator) in which every sequence is padded to a multiple of kRowPad rows. One
  // expression on purpose: with the padded rows computed first, the FA2 backward's SASS moved 1%.
  template <int kRowPad>
  __host__ __device__ int64_t scratch_row0(const FwdParams& p, int head) const {
    return (int64_t(batch) * p.heads + head) *
           ((int64_t(p.seqlen_q) + kRowPad - 1) / kRowPad * kRowPad);
  }
  // The TMA views of the FA3 forward (fa3_fwd_launch.cuh): (seqlen, head_dim, heads, batch) over
  // q / out and over k / v; a variable-length batch is viewed as one sequence of all its rows.
  static __host__ __device__ int view_rows_q(const FwdParams& p) {
    return p.cu_seqlens_q != nullptr ? p.total_q : p.seqlen_q;
  }
  static __host__ __device__ int view_rows_k(const FwdParams& p) {
    return p.cu_seqlens_q != nullptr ? p.total_k : p.seqlen_k;
  }
  static __host__ __device__ int view_batch(const FwdParams& p) {
    return p.cu_seqlens_q != nullptr ? 1 : p.batch;
  }
  // The same for k / v: a KV cache has cache_batch rows (cache_batch_idx picks a sequence's).
  static __host__ __device__ int view_batch_k(const FwdParams& p) {
    return p.cu_seqlens_q != nullptr ? 1 : p.kv_cache ? p.cache_batch : p.batch;
  }
  // The sequence's (rows, head_dim) slice of `head` in such a view of q / out (k / v): its
  // batch, or the rows from its start. Rows past the sequence in the slice are the next
  // sequence's in a variable-length batch: what reads or writes them must clip to the
  // sequence's lengths itself.
  template <class Tensor>
  __host__ __device__ auto q_rows(const FwdParams& p, Tensor const& m, int head) const {
    return view_slice(p, m, head, q_start(p), batch);
  }
  template <class Tensor>
  __host__ __device__ auto k_rows(const FwdParams& p, Tensor const& m, int head_k) const {
    return view_slice(p, m, head_k, k_start(p), k_batch(p));
  }

 private:
  template <class Tensor>
  __host__ __device__ auto view_slice(const FwdParams& p, Tensor const& m, int head, int start,
                                      int b) const {
    return cute::domain_offset(cute::make_coord(start, 0),
                               m(cute::_, cute::_, head, p.cu_seqlens_q != nullptr ? 0 : b));
  }
  // Dense: the sequence starts a batch stride in (k / v of a KV cache: its cache row's, from
  // its left padding on); variable-length: `start` rows in (the batch stride is 0).
  __host__ __device__ int64_t row0(const Strides& s, int head, int start) const {
    return row0(s, head, start, batch);
  }
  __host__ __device__ int64_t row0(const Strides& s, int head, int start, int b) const {
    return b * s.batch + head * s.head + start * s.row;
  }
};

}  // namespace flash
