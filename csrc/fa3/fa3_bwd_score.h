// The softmax backward of one FA3 backward step, element by element, on the consumers'
// transposed accumulators (key, row), undoing what the forward did between QK^T and PV:
//   x  = S, or t = tanh(S * softcap_prescale) with softcap; minus the ALiBi bias; masked
//   P  = exp2(x * scale_log2 - lse2)              (lse2 = +inf past the rows: P = 0)
//   dS = P o (dP - D), times 1 - t^2 with softcap  (d tanh, in score units)
// The kernel scales dK and dQ by softmax_scale, the derivative of the logit in q.k (with
// softcap too: softcap * softcap_prescale = softmax_scale).
#pragma once

#include <climits>
#include <cmath>

#include "common/mask.h"
#include "common/params.h"
#include "common/score_mod.h"

namespace flash::fa3 {

struct BwdScore {
  float scale_log2;
  // Key j is visible from row i iff diff_lo <= j - i <= diff_hi and j < seqlen_k (the window's
  // diagonals: no per-row bounds stay live in registers).
  int seqlen_q, seqlen_k, diff_lo, diff_hi;

  __device__ BwdScore(const BwdParams& p, const Mask& mask)
      : scale_log2(p.softmax_scale_log2), seqlen_q(mask.seqlen_q), seqlen_k(mask.seqlen_k) {
    const int shift = mask.seqlen_k - mask.seqlen_q;
    diff_lo = mask.left < 0 ? INT_MIN : shift - mask.left;
    diff_hi = mask.right < 0 ? INT_MAX : shift + mask.right;
  }

  __device__ bool visible(int key, int row) const {
    const int diff = key - row;
    return diff >= diff_lo && diff <= diff_hi && key < seqlen_k;
  }
  // Whether keys [key0, key0 + 64) x rows [row0, row0 + kBlockM) need the per-element mask.
  // Rows past seqlen_q do not count: their P is 0 by their lse.
  template <int kBlockM>
  __device__ bool masked(int key0, int row0) const {
    const int row_last = min(row0 + kBlockM, seqlen_q) - 1;
    return key0 + 64 > seqlen_k || key0 - row_last < diff_lo || key0 + 63 - row0 > diff_hi;
  }

  // P of one element without score mods.
  __device__ __forceinline__ float prob(float s, int key, int row, float lse2,
                                        bool masked) const {
    const float pv = exp2f(s * scale_log2 - lse2);
    return masked && !visible(key, row) ? 0.f : pv;
  }
  // P of one element with softcap and / or ALiBi (uniform runtime tests); dtanh: the factor
  // of its dS.
  __device__ __forceinline__ float prob(float s, int key, int row, float lse2, bool masked,
                                        const ScoreMod& mod, float& dtanh) const {
    dtanh = 1.f;
    if (mod.softcap()) {
      s = tanhf(s * mod.softcap_prescale);  // the forward's exact function
      dtanh = 1.f - s * s;
    }
    if (mod.alibi()) s -= mod.alibi_slope * fabsf(float(row + mod.shift - key));
    return prob(s, key, row, lse2, masked);
  }
};

}  // namespace flash::fa3
