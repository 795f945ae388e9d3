// What happens to a score between the QK^T GEMM and the softmax, besides masking: softcap and
// ALiBi. Runtime switches (uniform branches): neither changes the loop structure, and the cost
// when off is one predicated branch per tile.
//
// Units (see FwdParams): without softcap a score is q.k and logit = score * softmax_scale;
// with softcap a score is tanh(q.k * softcap_prescale) and logit = score * softcap. The ALiBi
// bias is a logit, so it is added in score units: slope / (logit per score).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/params.h"
#include "common/seqinfo.h"

namespace flash {

__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct ScoreMod {
  float softcap_prescale = 0.f;  // 0: no softcap
  float alibi_slope = 0.f;       // in score units; 0: no ALiBi
  int shift = 0;                 // seqlen_k - seqlen_q: row i's diagonal key is i + shift

  ScoreMod() = default;  // neither

  // For one sequence (common/seqinfo.h): its own diagonal.
  __device__ ScoreMod(const FwdParams& p, const SeqInfo& seq, int head)
      : shift(seq.seqlen_k(p) - seq.seqlen_q(p)) {
    if (p.softcap > 0.f) softcap_prescale = p.softcap_prescale;
    if (p.alibi_slopes != nullptr) {
      const float logit_per_score = p.softcap > 0.f ? p.softcap : p.softmax_scale;
      alibi_slope = p.alibi_slopes[seq.batch * p.alibi_batch_stride + head] / logit_per_score;
    }
  }

  __device__ bool softcap() const { return softcap_prescale != 0.f; }
  __device__ bool alibi() const { return alibi_slope != 0.f; }

  // s, coord, row0, col0 as in Mask::apply. Call before the mask (the mask overwrites).
  template <class S, class C>
  __device__ void apply(S& s, C const& coord, int row0, int col0) const {
    if (softcap()) {
#pragma unroll
      for (int i = 0; i < cute::size(s); ++i) s(i) = tanhf(s(i) * softcap_prescale);
    }
    if (alibi()) {
#pragma unroll
      for (int mi = 0; mi < cute::size<0>(s); ++mi) {
        const int diag = row0 + cute::get<0>(coord(mi, 0)) + shift;
#pragma unroll
        for (int ni = 0; ni < cute::size<1>(s); ++ni) {
          const int col = col0 + cute::get<1>(coord(mi, ni));
          s(mi, ni) -= alibi_slope * fabsf(float(diag - col));
        }
      }
    }
  }
};

}  // namespace flash
