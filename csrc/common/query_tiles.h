// The mask policy seen from a key tile, for the backward's loop over query tiles: which query
// tiles see any key of the tile, and which of them see all of it (no per-element mask). The
// transpose of Mask::key_tiles, built on Mask::query_begin / query_end. Shared by FA2's and
// FA3's backward.
#pragma once

#include "common/mask.h"

namespace flash {

struct QueryTiles {
  int begin = 0, end = 0;                    // query tiles that may see a key: [begin, end)
  int unmasked_begin = 0, unmasked_end = 0;  // those whose rows all see every key of the tile;
                                             // the rest, above and below, are masked per element
  __device__ bool empty() const { return end <= begin; }
};

__device__ __forceinline__ int div_up(int a, int b) { return (a + b - 1) / b; }

// Query tiles of kBlockM rows for the key tile [n_block * kBlockN, + kBlockN) (clipped to
// seqlen_k). query_begin / query_end grow with the key, so the first key bounds the tiles from
// below and the last key from above. begin and end never decrease as n_block grows (both are
// clamped monotone functions of it): the deterministic dQ order relies on that. A tile in the
// range whose rows see none of the keys (possible at the far ends of a window) is walked with
// the mask and contributes zeros.
template <int kBlockM, int kBlockN>
__device__ QueryTiles query_tiles(const Mask& mask, int n_block) {
  const int first = n_block * kBlockN, last = min(first + kBlockN, mask.seqlen_k) - 1;
  const int m_tiles = div_up(mask.seqlen_q, kBlockM);
  QueryTiles t;
  t.begin = min(mask.query_begin(first) / kBlockM, m_tiles);
  t.end = min(max(t.begin, div_up(max(mask.query_end(last), 0), kBlockM)), m_tiles);
  // Row i sees key j from the right iff i >= query_begin(j), from the left iff
  // i < query_end(j): every row of tile m sees the whole key tile iff its first row passes the
  // right bound of the last key and its last row the left bound of the first key. A tile
  // that runs past seqlen_k always needs the mask.
  const int unmasked_begin = first + kBlockN <= mask.seqlen_k
                                 ? div_up(mask.query_begin(first + kBlockN - 1), kBlockM)
                                 : t.end;
  const int row_end = mask.query_end(first);
  const int unmasked_end = row_end >= mask.seqlen_q ? m_tiles : max(row_end, 0) / kBlockM;
  t.unmasked_begin = min(max(unmasked_begin, t.begin), t.end);
  t.unmasked_end = min(max(unmasked_end, t.unmasked_begin), t.end);
  return t;
}

// The first key tile whose range contains query tile m_block, given that tile n_block's does:
// the key tiles walking m_block are exactly [that, ..., n_block, ...] (begin and end are
// monotone in the key tile), so n_block is the (n_block - that)-th to add into dQ_m.
template <int kBlockM, int kBlockN>
__device__ int first_key_tile_of(const Mask& mask, int m_block, int n_block) {
  int lo = 0, hi = n_block;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (query_tiles<kBlockM, kBlockN>(mask, mid).end > m_block) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

}  // namespace flash
