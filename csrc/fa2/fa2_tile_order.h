// Which (tile, batch * head) work item each block of an FA2 grid takes. Blocks start in linear
// order, so this order decides two things: which items run last (the grid's tail), and which
// heads' K/V (forward) or Q/dO/dQ (backward) are read at the same time (the L2 working set).
//
// Items come in groups of `group` consecutive batch * head indices. Inside a group, tile 0 of
// every head comes first, then tile 1, and so on; the kernels number their tiles heaviest first
// (under a causal mask: the forward's last query tile, the backward's first key tile), so a
// grid ends on its lightest tiles instead of on the heaviest tile of its last head. Across
// groups the order is head by head, so only about `group` heads' data is in flight at once:
// the launcher sizes the group to fit half the L2 (head_group).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>

namespace flash::fa2 {

struct TileOrder {
  int tiles = 0;             // per (batch, head)
  int64_t batch_heads = 0;
  int64_t group = 1;         // heads per group, >= 1

  __host__ __device__ int64_t items() const { return int64_t(tiles) * batch_heads; }

  __device__ void decode(int64_t item, int& tile, int64_t& bh) const {
    const int64_t per_group = group * tiles;
    const int64_t head0 = item / per_group * group;
    const int64_t heads_here = batch_heads - head0 < group ? batch_heads - head0 : group;
    const int64_t r = item - head0 * tiles;  // within the group
    tile = int(r / heads_here);
    bh = head0 + r % heads_here;
  }

  // One block per item up to the grid limit; beyond it blocks stride over the items.
  unsigned grid() const { return unsigned(std::min<int64_t>(items(), INT_MAX)); }
};

// Heads per group: as many as keep bytes_per_head each within half of the L2.
// FLASH_ATTN_FA2_HEAD_GROUP=N (read once per process) overrides it, for benchmarking.
inline TileOrder tile_order(int tiles, int64_t batch_heads, int64_t bytes_per_head,
                            int l2_bytes) {
  static const int64_t forced = [] {
    const char* env = std::getenv("FLASH_ATTN_FA2_HEAD_GROUP");
    return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : int64_t(0);
  }();
  int64_t group = forced > 0 ? forced
                             : int64_t(l2_bytes) / 2 / std::max<int64_t>(bytes_per_head, 1);
  group = std::clamp<int64_t>(group, 1, std::max<int64_t>(batch_heads, 1));
  return TileOrder{tiles, batch_heads, group};
}

}  // namespace flash::fa2
