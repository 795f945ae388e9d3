// The backward of the softmax, element by element (FA2 Algorithm 2, lines 11-14), with
// everything the forward did between QK^T and PV undone in one pass over the scores:
//   score = q.k, or t = tanh(q.k * softcap_prescale) with softcap; minus the ALiBi bias; mask
//   P     = exp2(score * scale_log2 - lse * log2(e))     (lse = +inf: P = 0)
//   Z     = P o M * rp_keep                              the dropped probabilities O was made of
//   dS    = P o (dP o M * rp_keep - D)                   D = rowsum(dO o O) = rowsum(Z o dP)
//   softcap: dS *= 1 - t^2                               d tanh, in score units
// M is the keep mask (common/philox.cuh); without dropout Z = P and M = 1. The caller scales dK
// and dQ by softmax_scale, the derivative of the logit in q.k (with softcap too:
// softcap * softcap_prescale = softmax_scale). Fusing the pass keeps t a scalar: no fragment
// of tanh values outlives the loop.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "common/philox.cuh"
#include "fa2/fa2_dropout.h"
#include "common/mask.h"
#include "common/score_mod.h"
#include "fa2/fa2_utils.h"

namespace flash::fa2 {

template <bool kDropout>
struct DScore {
  ScoreMod mod;
  Mask mask;
  float scale_log2;
  float rp_keep;
  uint32_t keep_threshold;
  uint32_t bh;  // batch * heads + query head: the dropout stream of this head
  PhiloxKey philox;

  // mask: the sequence's (the key tile's, with its warp-uniform lengths).
  __device__ DScore(const BwdParams& p, const SeqInfo& seq, const Mask& mask_, int head,
                    const PhiloxKey& key)
      : mod(p, seq, head), mask(mask_), scale_log2(p.softmax_scale_log2), rp_keep(p.rp_keep),
        keep_threshold(p.keep_threshold), bh(uint32_t(seq.batch) * p.heads + head),
        philox(key) {}

  // The keep bits of the elements of the tile at (row0, col0) this thread holds: bit e % 32 of
  // word e / 32 for element e = v + 4 * (n + MMA_N * m) of the fragment ((2,2), MMA_M, MMA_N)
  // that coord partitions. Called before the GEMMs: the Philox rounds then run while dK and dV
  // are the only large live fragments, and 1 or 2 words cross the GEMMs instead of 8 draws.
  template <int kWords, class Coord>
  __device__ __forceinline__ void keep_bits(uint32_t (&bits)[kWords], Coord const& coord,
                                            int row0, int col0) const {
    constexpr int kM = decltype(size<1>(coord))::value, kN = decltype(size<2>(coord))::value;
    static_assert((4 * kM * kN + 31) / 32 == kWords);
#pragma unroll
    for (int w = 0; w < kWords; ++w) bits[w] = 0u;
    for_each_dropout_decision(coord, philox, keep_threshold, bh, row0, col0,
                              [&](int v, int m, int n, bool kept) __attribute__((always_inline)) {
                                const int e = v + 4 * (n + kN * m);
                                if (kept) bits[e / 32] |= 1u << (e % 32);
                              });
  }

  // s: S = QK^T of the tile at (row0, col0), overwritten by Z. dp: dP = dO V^T, overwritten by
  // dS. Both are m16n8 accumulator fragments ((2 cols, 2 rows), MMA_M, MMA_N) of one TiledMma
  // whose neighbouring n8 tiles (n, n + 1) a lane holds are 8 keys apart inside one 16-key
  // block, so one Philox call gives the draws of all 8 elements (v, m, n..n+1) (keep_bits).
  // keep: those bits (dropout only). coord: the same partition of an identity tensor over the
  // tile. s_lse / s_dsum: lse and D of the tile's rows in shared memory (rows past seqlen_q
  // hold anything; their P is 0). kModded: softcap or ALiBi may be on (the kernel's
  // kScoreMod); which one is a uniform runtime test. The mask test uses col - row against the
  // window's diagonals, so no per-row bounds stay live in registers.
  template <bool kMasked, bool kModded, class Frag, class Coord, int kWords>
  __device__ __forceinline__ void apply(Frag& s, Frag& dp, Coord const& coord,
                                        const uint32_t (&keep)[kWords], const float* s_lse,
                                        const float* s_dsum, int row0, int col0) const {
    constexpr int kM = decltype(size<1>(s))::value, kN = decltype(size<2>(s))::value;
    const int shift = mask.seqlen_k - mask.seqlen_q;
    const int diff_lo = mask.left < 0 ? INT_MIN : shift - mask.left;
    const int diff_hi = mask.right < 0 ? INT_MAX : shift + mask.right;
    const bool softcap = mod.softcap(), alibi = mod.alibi();
    // A lane holds two rows per MMA row-repeat m (v = 0, 1 and v = 2, 3): read their lse and D
    // from shared memory once per tile, not once per element.
    float lse2[kM][2], dsum[kM][2];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int local_row = get<0>(coord(2 * h, m, 0));
        // lse = +inf past seqlen_q: P = 0 whatever the padding holds.
        lse2[m][h] = row0 + local_row < mask.seqlen_q ? s_lse[local_row] * float(M_LOG2E)
                                                      : INFINITY;
        dsum[m][h] = s_dsum[local_row];
      }
    }
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          float x = s(v, m, n);
          float dtanh = 1.f;
          if constexpr (kModded) {
            if (softcap) {
              x = tanhf(x * mod.softcap_prescale);  // the forward's exact function
              dtanh = 1.f - x * x;
            }
          }
          if constexpr (kModded || kMasked) {
            const int row = row0 + get<0>(coord(v, m, n));
            const int col = col0 + get<1>(coord(v, m, n));
            if constexpr (kModded) {
              if (alibi) x -= mod.alibi_slope * fabsf(float(row + mod.shift - col));
            }
            if constexpr (kMasked) {
              const int diff = col - row;  // visible: diff_lo <= diff <= diff_hi, col < seqlen_k
              if (diff < diff_lo || diff > diff_hi || col >= mask.seqlen_k) x = -INFINITY;
            }
          }
          const float prob = exp2_approx(fmaf(x, scale_log2, -lse2[m][v >> 1]));
          float dprob = dp(v, m, n);
          float z = prob;
          if constexpr (kDropout) {
            const int e = v + 4 * (n + kN * m);
            const float k = (keep[e / 32] >> (e % 32)) & 1u ? rp_keep : 0.f;
            dprob *= k;
            z *= k;
          }
          s(v, m, n) = z;
          dp(v, m, n) = prob * (dprob - dsum[m][v >> 1]) * dtanh;
        }
      }
    }
  }
};

}  // namespace flash::fa2
