// The mask policy, shared by FA2 and FA3: which keys a query row sees, and for a block of query
// rows which key tiles exist at all and which of them need a per-element mask. One runtime type
// covers no mask, causal and sliding windows (causal is the window (-1, 0)); the mainloops split
// their key loop at the tiles it names, so full tiles run without a single compare.
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "common/params.h"
#include "common/seqinfo.h"

namespace flash {

struct KeyTiles {
  int begin = 0, end = 0;                    // the tiles with a visible key: [begin, end)
  int unmasked_begin = 0, unmasked_end = 0;  // those every row sees entirely; the rest, above
                                             // and below, are masked per element
  __device__ bool empty() const { return end <= begin; }
};

// The forward's walk over the key tiles of a non-empty KeyTiles, from the last tile to the
// first, so that the masked tiles above the diagonal band come first, then the unmasked ones,
// then the masked ones below: step(n, first, masked), the flags as std::bool_constant, so
// each kind of step is its own instantiation and unmasked tiles run without a compare. (tiles
// by value, step by reference: so the FA2 forward compiles to the SASS it had inline.)
template <class Step>
__device__ __forceinline__ void walk_key_tiles(KeyTiles tiles, Step& step) {
  int n = tiles.end - 1;
  if (n >= tiles.unmasked_end || n < tiles.unmasked_begin) {
    step(n, std::true_type{}, std::true_type{});
  } else {
    step(n, std::true_type{}, std::false_type{});
  }
  for (--n; n >= tiles.unmasked_end; --n) step(n, std::false_type{}, std::true_type{});
  for (; n >= tiles.unmasked_begin; --n) step(n, std::false_type{}, std::false_type{});
  for (; n >= tiles.begin; --n) step(n, std::false_type{}, std::true_type{});
}

struct Mask {
  int seqlen_q, seqlen_k;
  int left, right;  // window sides, -1 unbounded

  // The mask of one sequence (common/seqinfo.h), aligned to its own lengths.
  __device__ Mask(const FwdParams& p, const SeqInfo& seq)
      : Mask(p, seq.seqlen_q(p), seq.seqlen_k(p)) {}
  // The same from lengths read before (FA3's consumers take them from the producer).
  __device__ Mask(const FwdParams& p, int seqlen_q_, int seqlen_k_)
      : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), left(p.window_left),
        right(p.causal ? 0 : p.window_right) {}

  // Query row i's diagonal key, bottom-right aligned.
  __device__ int diag(int i) const { return i + seqlen_k - seqlen_q; }
  // Keys [key_begin(i), key_end(i)) are visible to row i (possibly an empty range).
  __device__ int key_begin(int i) const { return left < 0 ? 0 : max(0, diag(i) - left); }
  __device__ int key_end(int i) const {
    return right < 0 ? seqlen_k : min(seqlen_k, diag(i) + right + 1);
  }
  // Queries [query_begin(j), query_end(j)) see key j: the transpose, for the backward's loop
  // over query tiles of one key tile.
  __device__ int query_begin(int j) const {
    return right < 0 ? 0 : max(0, j - right - (seqlen_k - seqlen_q));
  }
  __device__ int query_end(int j) const {
    return left < 0 ? seqlen_q : min(seqlen_q, j + left + 1 - (seqlen_k - seqlen_q));
  }

  // Key tiles of width kBlockN for the rows [row0, row0 + kBlockM) (clipped to seqlen_q).
  // key_begin / key_end grow with the row, so the first row bounds the tiles on the right and
  // the last row on the left.
  template <int kBlockM, int kBlockN>
  __device__ KeyTiles key_tiles(int row0) const {
    const int first = row0, last = min(row0 + kBlockM, seqlen_q) - 1;
    KeyTiles t;
    const int lo = key_begin(first), hi = key_end(last);
    t.begin = lo / kBlockN;
    t.end = hi > lo ? (hi + kBlockN - 1) / kBlockN : t.begin;
    t.unmasked_begin = min(max((key_begin(last) + kBlockN - 1) / kBlockN, t.begin), t.end);
    t.unmasked_end = min(max(key_end(first) / kBlockN, t.unmasked_begin), t.end);
    return t;
  }

  // Set to -inf the scores of invisible keys. s: a rowcol view of an accumulator fragment;
  // coord: the same view of an identity tensor over the tile; (row0, col0): the tile's origin.
  template <class S, class C>
  __device__ void apply(S& s, C const& coord, int row0, int col0) const {
#pragma unroll
    for (int mi = 0; mi < cute::size<0>(s); ++mi) {
      const int row = row0 + cute::get<0>(coord(mi, 0));
      const int lo = key_begin(row), hi = key_end(row);
#pragma unroll
      for (int ni = 0; ni < cute::size<1>(s); ++ni) {
        const int col = col0 + cute::get<1>(coord(mi, ni));
        if (col < lo || col >= hi) s(mi, ni) = -INFINITY;
      }
    }
  }
};

}  // namespace flash
