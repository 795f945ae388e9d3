// FA3's online softmax: the shared one (common/softmax.h; the same state and conventions, used
// as it is for an item's first key tile and for masked tiles) plus a step for unmasked tiles
// that takes no max before the exponentials.
//
// Why: at hdim 256 the tile max (a 20-deep fmax chain per row and lane, then two shuffle
// rounds) sits between the S GEMM's result and the first exponential, and costs more than its
// instruction count: a build that skipped it (wrong in general) ran 5-6% faster at 2k and 4k
// (H200; docs/fa3_decisions.md). FA2's lazy rescaling already keeps the old max while no
// row's max grows by more than kRescaleLog2 (log2 units); exponentiate() relies on that
// outright and checks afterwards. Its P against the old max is the value FA2's step computes
// whenever the max did not grow that much; a lane's partial sum of a row bounds each of its
// elements, so a sum at most 2^kRescaleLog2 proves the step right. Otherwise settle() makes it
// right: it rescales P, the sums and O to the row's new max, as FA2's step would have, or,
// where P went past kMaxRescale (or to inf) or a row had no max yet, recomputes the scores and
// takes FA2's step. Tiles that reach settle() are rare once the first tiles have set the max
// (the lazy build ran as fast as the one that skipped the max on random inputs); a row whose
// logits jump by more than kRescaleLog2 costs one settle(), and only a jump of more than 120
// costs a recompute (slow: CUDA cores, from global memory).
#pragma once

#include <cfloat>
#include <cmath>

#include "common/softmax.h"

namespace flash::fa3 {

template <int kRows, int kPOffset = 0>
struct Softmax : flash::Softmax<kRows, kPOffset> {
  using Base = flash::Softmax<kRows, kPOffset>;
  using Base::row_max;
  using Base::row_sum;
  static constexpr float kSettleSum = 256.f;  // 2^kRescaleLog2
  // The largest P that settle() rescales: its correction, 1 / P, must stay a normal float
  // (ex2.approx.ftz and the multiplies flush denormals to 0). Beyond it, or at inf, rescore.
  static constexpr float kMaxRescale = 0x1p120f;
  // The lazy step (exponentiate, settle) is for kPOffset 0 only (FwdTraits::kLazySteps).
  static_assert(kPOffset != 0 || kSettleSum == float(1 << int(Base::kRescaleLog2)));

  // P = exp2(S * scale_log2 - m * scale_log2) against the running max m, in place in s;
  // tile_sum gets this lane's partial row sums (added to the state by accumulate()). Returns
  // (a vote of the warp) whether settle() must run before P and tile_sum are used. Branch-free:
  // FA3 ends the basic block after the exponentials (see fa3_fwd_kernel.cuh).
  template <class S>
  __device__ __forceinline__ bool exponentiate(S& s, float scale_log2, float (&tile_sum)[kRows]) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    bool settle = false;
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      const float m_scaled = row_max[mi] * scale_log2;
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < cute::size<1>(s); ++ni) {
        s(mi, ni) = flash::exp2_approx(fmaf(s(mi, ni), scale_log2, -m_scaled));
        sum += s(mi, ni);
      }
      tile_sum[mi] = sum;
      // !(<=) also catches inf and NaN; a row without a max (-inf) is never right here.
      settle |= !(sum <= kSettleSum) || row_max[mi] == -INFINITY;
    }
    return __any_sync(0xffffffffu, settle);
  }

  // exponentiate()'s P and tile_sum made what FA2's step gives, O rescaled to match; the warp
  // runs it together (exponentiate's vote). rescore(s) writes the tile's scores (score mod
  // applied) into s again, for the rare case where P cannot be rescaled.
  template <class S, class O, class Rescore>
  __device__ __forceinline__ void settle(S& s, O& o, float scale_log2, float (&tile_sum)[kRows],
                                      Rescore&& rescore) {
    float p_max[kRows];
    bool lost = false;
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      float m = 0.f;
#pragma unroll
      for (int ni = 0; ni < cute::size<1>(s); ++ni) m = fmaxf(m, s(mi, ni));
      p_max[mi] = flash::quad_allreduce_max(m);
      lost |= !(p_max[mi] <= kMaxRescale) || row_max[mi] == -INFINITY;
    }
    float correction[kRows];
    if (__any_sync(0xffffffffu, lost)) {
      rescore(s);
      if (Base::template online<false>(s, scale_log2, correction)) Base::rescale(o, correction);
#pragma unroll
      for (int mi = 0; mi < kRows; ++mi) tile_sum[mi] = 0.f;  // online() added it
      return;
    }
    // P <= p_max = exp2(tile max * scale_log2 - m * scale_log2): move m to the tile max, as
    // FA2's step does when a row's max grows by more than kRescaleLog2 (log2 units; p_max is
    // the quad's, so the four lanes of a row agree).
    bool grow = false;
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      correction[mi] = 1.f;
      if (p_max[mi] > kSettleSum) {
        const float next = row_max[mi] + __log2f(p_max[mi]) / scale_log2;
        correction[mi] = flash::exp2_approx(row_max[mi] * scale_log2 - next * scale_log2);
        row_max[mi] = next;
        grow = true;
      }
      row_sum[mi] *= correction[mi];
      tile_sum[mi] *= correction[mi];
#pragma unroll
      for (int ni = 0; ni < cute::size<1>(s); ++ni) s(mi, ni) *= correction[mi];
    }
    if (__any_sync(0xffffffffu, grow)) Base::rescale(o, correction);
  }

  __device__ __forceinline__ void accumulate(const float (&tile_sum)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) row_sum[mi] += tile_sum[mi];
  }
};

// The scores q_row[r] . k_row[c] of kRows rows and kCols keys (fp32 sums of the 16-bit products,
// into score[r * kCols + c]), with CUDA cores from global memory: the lazy softmax step's rare
// fallback (Softmax::settle's recompute, through FwdMainloop). Not inlined, so that its registers
// and loads stay out of the loop (inline it cost the 2-CTA kernel at hdim 256 1-2% in spills).
// head_dim, the row strides and the bases are multiples of 8 elements, so each step is a 16-byte
// load. A null q_row is a row past seqlen_q, whose Q TMA fills with zeros.
template <class Element, int kRows, int kCols>
__device__ __noinline__ void rescore_rows(const Element* const (&q_row)[kRows],
                                          const Element* const (&k_row)[kCols], int head_dim,
                                          float (&score)[kRows * kCols]) {
  #pragma unroll 1
  for (int r = 0; r < kRows; ++r) {
    #pragma unroll 1
    for (int c = 0; c < kCols; ++c) {
      float acc = 0.f;
      #pragma unroll 1
      for (int d = 0; q_row[r] != nullptr && d < head_dim; d += 8) {
        const uint4 qa = *reinterpret_cast<const uint4*>(q_row[r] + d);
        const uint4 ka = *reinterpret_cast<const uint4*>(k_row[c] + d);
        const Element* qe = reinterpret_cast<const Element*>(&qa);
        const Element* ke = reinterpret_cast<const Element*>(&ka);
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(float(qe[j]), float(ke[j]), acc);
      }
      score[r * kCols + c] = acc;
    }
  }
}

}  // namespace flash::fa3
