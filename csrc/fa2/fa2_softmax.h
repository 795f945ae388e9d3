// Online softmax state of the rows a thread holds (FA2, Algorithm 1 lines 8-10 and 12):
//   begin/rescale: m_new = max(m, rowmax(S)); O *= exp2(m - m_new); l *= exp2(m - m_new)
//   exponentiate:  P = exp2(S * scale_log2 - m_new * scale_log2); l += rowsum(P)
//   finalize:      O /= l (times 1/keep for dropout); lse = (m * scale_log2 + log2(l)) * ln(2)
// Scores stay in score units (see fa2_score_mod.h); scale_log2 folds the softmax scale and
// log2(e) into the FFMA that feeds ex2. A row with no visible key so far has m = -inf; it is
// exponentiated against 0 instead, so its P is 0 and never NaN.
#pragma once

#include <cmath>

#include "fa2/fa2_utils.h"

namespace flash::fa2 {

template <int kRows>
struct Softmax {
  float row_max[kRows];
  float row_sum[kRows];

  // S: scores (rowcol view, fp32), overwritten by P. O: the output accumulator (rowcol view).
  // kFirst: the first key tile of the row, with nothing to rescale.
  template <bool kFirst, class S, class O>
  __device__ __forceinline__ void update(S& s, O& o, float scale_log2) {
    static_assert(decltype(size<0>(s))::value == kRows);
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      float m = kFirst ? -INFINITY : row_max[mi];
#pragma unroll
      for (int ni = 0; ni < size<1>(s); ++ni) m = fmaxf(m, s(mi, ni));
      m = quad_allreduce_max(m);
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      if (!kFirst) {
        const float prev_scaled = row_max[mi] == -INFINITY ? 0.f : row_max[mi] * scale_log2;
        const float correction = exp2_approx(prev_scaled - m_scaled);
        row_sum[mi] *= correction;
#pragma unroll
        for (int di = 0; di < size<1>(o); ++di) o(mi, di) *= correction;
      }
      row_max[mi] = m;
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < size<1>(s); ++ni) {
        s(mi, ni) = exp2_approx(fmaf(s(mi, ni), scale_log2, -m_scaled));
        sum += s(mi, ni);
      }
      // The quad reduction of the sum waits until finalize: each lane keeps a partial.
      row_sum[mi] = kFirst ? sum : row_sum[mi] + sum;
    }
  }

  // O /= l; returns nothing, writes the natural-log lse of each row into lse[mi] (+inf for a
  // row that saw no key, whose O stays 0).
  template <class O>
  __device__ __forceinline__ void finalize(O& o, float scale_log2, float rp_keep,
                                           float (&lse)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      const float sum = quad_allreduce_sum(row_sum[mi]);
      const bool empty = sum == 0.f || sum != sum;
      const float inv = empty ? 0.f : rp_keep / sum;
      lse[mi] = empty ? INFINITY
                      : (row_max[mi] * scale_log2 + __log2f(sum)) * float(M_LN2);
#pragma unroll
      for (int di = 0; di < size<1>(o); ++di) o(mi, di) *= inv;
    }
  }
};

}  // namespace flash::fa2
