// The dropout decisions of the elements a thread holds in an m16n8 accumulator fragment, in the
// grouping common/philox.cuh defines: one Philox call per pair of neighbouring n8 tiles (a
// 16x16 block of (row, key) per lane). The forward zeroes dropped probabilities with it and the
// backward packs the same decisions into bits, so both read the draws in exactly one way.
#pragma once

#include <cstdint>

#include "common/philox.cuh"
#include "fa2/fa2_utils.h"

namespace flash::fa2 {

// Calls keep(v, m, n, kept) for every element (v, m, n) of a fragment ((2,2), MMA_M, MMA_N)
// of the tile at (row0, col0); coord: an identity tensor partitioned like the fragment.
template <class Coord, class F>
__device__ __forceinline__ void for_each_dropout_decision(Coord const& coord, const PhiloxKey& key,
                                                          uint32_t threshold, uint32_t bh,
                                                          int row0, int col0, F&& keep) {
  constexpr int kM = decltype(size<1>(coord))::value, kN = decltype(size<2>(coord))::value;
  static_assert(kN % 2 == 0, "a Philox call covers two neighbouring n8 tiles");
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int n = 0; n < kN; n += 2) {
      const uint4 draws = dropout_draws(key, bh, row0 + get<0>(coord(0, m, n)),
                                        col0 + get<1>(coord(0, m, n)));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const uint32_t row = row0 + get<0>(coord(v, m, n + half));
          const uint32_t col = col0 + get<1>(coord(v, m, n + half));
          keep(v, m, n + half, draw16(draws, dropout_draw_index(row, col)) < threshold);
        }
      }
    }
  }
}

}  // namespace flash::fa2
