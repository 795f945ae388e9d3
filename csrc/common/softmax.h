// Online softmax state of the rows a thread holds (FA2, Algorithm 1 lines 8-10 and 12; FA3
// adds its lazy step in fa3/fa3_softmax.h):
//   rescale:       m_new = max(m, rowmax(S)); O *= exp2(m - m_new); l *= exp2(m - m_new)
//                  (lazily: only when some row's max grew by more than 2^8, see update)
//   exponentiate:  P = exp2(S * scale_log2 - m_new * scale_log2); l += rowsum(P)
//   finalize:      O /= l (times 1/keep for dropout); lse = (m * scale_log2 + log2(l)) * ln(2)
// Scores stay in score units (see score_mod.h); scale_log2 folds the softmax scale and
// log2(e) into the FFMA that feeds ex2. A row with no visible key so far has m = -inf; it is
// exponentiated against 0 instead, so its P is 0 and never NaN.
// kPOffset (FP8's P): P = exp2(S * scale_log2 - m * scale_log2 + kPOffset), up to 2^kPOffset
// times FA2's, so that an 8-bit P keeps the small probabilities that [0, 1] would flush; l
// carries the same factor (O / l is unchanged) and finalize takes it out of the lse.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/fragment.h"

namespace flash {

template <int kRows, int kPOffset = 0>
struct Softmax {
  // See update(). With an offset, P <= 2^(kPOffset + kRescaleLog2) must stay below e4m3's 448.
  static constexpr float kRescaleLog2 = kPOffset > 0 ? 0.5f : 8.f;
  static_assert(kPOffset == 0 || kPOffset + kRescaleLog2 < 8.8f);
  float row_max[kRows];
  float row_sum[kRows];

  // S: scores (rowcol view, fp32), overwritten by P. O: the output accumulator (rowcol view).
  // kFirst: the first key tile of the row, with nothing to rescale.
  template <bool kFirst, class S, class O>
  __device__ __forceinline__ void update(S& s, O& o, float scale_log2) {
    float correction[kRows];
    if (online<kFirst>(s, scale_log2, correction)) rescale(o, correction);
  }

  // update() in two halves, for a caller whose O is still being written by an asynchronous
  // GEMM when the next scores are ready (FA3): online() moves the max and the sum, turns S
  // into P and returns whether O must be multiplied by correction (rescale()) before the next
  // P V is added to it. kBranch = false: the lazy decision is applied with selects, leaving
  // the caller's O rescale the only branch, after the exponentials: ptxas waits for every
  // WGMMA in flight before a branch, which must not come before the softmax in FA3.
  template <bool kFirst, bool kBranch = true, class S>
  __device__ __forceinline__ bool online(S& s, float scale_log2, float (&correction)[kRows]) {
    static_assert(decltype(cute::size<0>(s))::value == kRows);
    float tile_max[kRows];
    bool grow = kFirst;
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      float m = kFirst ? -INFINITY : row_max[mi];
#pragma unroll
      for (int ni = 0; ni < cute::size<1>(s); ++ni) m = fmaxf(m, s(mi, ni));
      tile_max[mi] = quad_allreduce_max(m);
      // Lazy rescaling: while no row of the warp has its max grow by more than
      // kRescaleLog2 (in log2 units), keep exponentiating against the old max. P then stays
      // <= 2^kRescaleLog2, harmless in fp32 and in the 16-bit P, and the O rescale (one
      // multiply per O element per tile, the bulk of the softmax's ALU work at large head
      // dims) is skipped once the max has settled, which is most tiles. lse uses the same max
      // as l, so the result is exact.
      if (!kFirst) grow |= (tile_max[mi] - row_max[mi]) * scale_log2 > kRescaleLog2;
    }
    const bool rescale_o = !kFirst && __any_sync(0xffffffffu, grow);
    auto move_max = [&](bool apply) {
#pragma unroll
      for (int mi = 0; mi < kRows; ++mi) {
        if (!kFirst) {
          const float prev = row_max[mi] == -INFINITY ? 0.f : row_max[mi] * scale_log2;
          const float next = tile_max[mi] == -INFINITY ? 0.f : tile_max[mi] * scale_log2;
          correction[mi] = apply ? exp2_approx(prev - next) : 1.f;
          row_sum[mi] *= correction[mi];
        }
        row_max[mi] = apply ? tile_max[mi] : row_max[mi];
      }
    };
    if constexpr (kBranch) {
      if (kFirst || rescale_o) move_max(true);
    } else {
      move_max(kFirst || rescale_o);
    }
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
      const float m_scaled =
          (row_max[mi] == -INFINITY ? 0.f : row_max[mi] * scale_log2) - float(kPOffset);
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < cute::size<1>(s); ++ni) {
        s(mi, ni) = exp2_approx(fmaf(s(mi, ni), scale_log2, -m_scaled));
        sum += s(mi, ni);
      }
      // The quad reduction of the sum waits until finalize: each lane keeps a partial.
      row_sum[mi] = kFirst ? sum : row_sum[mi] + sum;
    }
    return rescale_o;
  }

  template <class O>
  __device__ __forceinline__ void rescale(O& o, const float (&correction)[kRows]) const {
#pragma unroll
    for (int mi = 0; mi < kRows; ++mi) {
#pragma unroll
      for (int di = 0; di < cute::size<1>(o); ++di) o(mi, di) *= correction[mi];
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
                      : (row_max[mi] * scale_log2 - float(kPOffset) + __log2f(sum)) *
                            float(M_LN2);
#pragma unroll
      for (int di = 0; di < cute::size<1>(o); ++di) o(mi, di) *= inv;
    }
  }
};

}  // namespace flash
