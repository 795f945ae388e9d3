// Which (tile, batch, head) work item each block of an FA2 grid, or each item an FA3 CTA takes. Blocks start in linear
// order, so this order decides two things: which items run last (the grid's tail), and which
// heads' K/V (forward) or Q/dO/dQ (backward) are read at the same time (the L2 working set).
//
// Items come in groups of `group` consecutive batch * head indices. Inside a group, tile 0 of
// every head comes first, then tile 1, and so on; the kernels number their tiles heaviest first
// (under a causal mask: the forward's last query tile, the backward's first key tile), so a
// grid ends on its lightest tiles instead of on the heaviest tile of its last head. Across
// groups the order is head by head. The group is as many heads as fill the GPU's resident
// blocks once (resident / tiles): a larger one only spreads the blocks in flight over more
// heads, each of whose K/V (forward) then has to stay in the L2 until its next tile starts.
// Measured on an H100 (ncu), hdim-64 forward at 1k with the group sized to half the L2 instead
// (~100 heads, where 33 fill the GPU): L2 hit rate 57% against SDPA's 75%, twice its DRAM
// traffic; yet the time did not move when the group shrank (DRAM was not the limit there).
// Half the L2 over the bytes one head's tiles read stays an upper bound.
//
// Decoding an item is on every block's critical path: nothing is loaded before it. With 64-bit
// '/' and '%' it was three 64-bit divisions (each a branch to the 32-bit reciprocal sequence or
// a call) and four 32-bit ones (batch, head, KV head), ~25 dependent instructions apiece; where
// every index fits in 32 bits (any real shape: the fallback needs 2^31 tiles) it is four
// multiply-high divisions by divisors prepared on the host. (On the H100 the time did not move
// measurably: two co-resident blocks hide most of one block's prologue.)
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include <cuda_runtime.h>
#include <cutlass/fast_math.h>

#include "common/check.h"

namespace flash {

struct WorkItem {
  int tile;    // 0 = the heaviest tile of its head
  int batch;
  int head;    // over the grid's heads: query heads (forward), KV heads (backward)
  int head_k;  // the KV head that `head` reads (forward; the backward's heads are KV heads)
};

struct TileOrder {
  int tiles = 0;             // per (batch, head)
  int64_t batch_heads = 0;
  int64_t group = 1;         // heads per group, >= 1
  int heads = 1;             // heads per batch (the 64-bit path's divisor)
  bool fast = false;         // items, and so every index below, fit in int32
  // Divisors: group * tiles, group, the last group's size, heads, heads per KV head.
  cutlass::FastDivmod per_group_div, group_div, last_group_div, heads_div, kv_div;

  __host__ __device__ int64_t items() const { return int64_t(tiles) * batch_heads; }

  __device__ __forceinline__ WorkItem decode(int64_t item) const {
    if (fast) return decode_fast(int(item));
    WorkItem w;
    const int64_t per_group = group * tiles;
    const int64_t head0 = item / per_group * group;
    const int64_t heads_here = std::min<int64_t>(batch_heads - head0, group);
    const int64_t r = item - head0 * tiles;  // within the group
    const int64_t bh = head0 + r % heads_here;
    w.tile = int(r / heads_here);
    w.batch = int(bh / heads);
    w.head = int(bh % heads);
    int rem;
    kv_div(w.head_k, rem, w.head);
    return w;
  }

  // decode() where `fast` holds (a caller that checked it on the host: the FA3 forward, whose
  // producer thread has no registers to spare for the 64-bit divisions).
  __device__ __forceinline__ WorkItem decode_fast(int item) const {
    WorkItem w;
    int g, r, h;
    per_group_div(g, r, item);
    const int head0 = g * int(group);
    const bool last = head0 + group > batch_heads;
    const cutlass::FastDivmod d = last ? last_group_div : group_div;  // by value: a reference
    d(w.tile, h, r);                                                   // puts `this` in local memory
    heads_div(w.batch, w.head, head0 + h);
    int rem;
    kv_div(w.head_k, rem, w.head);
    return w;
  }

  // One block per item up to the grid limit; beyond it blocks stride over the items.
  unsigned grid() const { return unsigned(std::min<int64_t>(items(), INT_MAX)); }
};

// Blocks of `kernel` the whole GPU runs at once (its shared-memory opt-in already set).
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, int smem_bytes, int num_sms) {
  int per_sm = 0;
  FLASH_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads,
                                                                 smem_bytes));
  return int64_t(std::max(per_sm, 1)) * std::max(num_sms, 1);
}

// resident_blocks: blocks of this kernel the whole GPU runs at once. forced_group > 0 overrides
// the group (Tuning::head_group, for A/B runs); 0: the rule above.
inline TileOrder tile_order(int tiles, int batch, int heads, int heads_per_kv,
                            int64_t bytes_per_head, int l2_bytes, int64_t resident_blocks,
                            int64_t forced_group = 0) {
  const int64_t forced = std::max<int64_t>(0, forced_group);
  TileOrder o;
  o.tiles = tiles;
  o.batch_heads = int64_t(batch) * heads;
  o.heads = heads;
  const int64_t fill = (std::max<int64_t>(resident_blocks, 1) + tiles - 1) / std::max(tiles, 1);
  const int64_t l2_heads = int64_t(l2_bytes) / 2 / std::max<int64_t>(bytes_per_head, 1);
  const int64_t group = forced > 0 ? forced : std::min(fill, l2_heads);
  o.group = std::clamp<int64_t>(group, 1, std::max<int64_t>(o.batch_heads, 1));
  o.fast = o.items() <= INT_MAX;
  if (o.fast) {
    o.per_group_div = cutlass::FastDivmod(int(o.group * tiles));
    o.group_div = cutlass::FastDivmod(int(o.group));
    const int64_t last = o.batch_heads % o.group;
    o.last_group_div = cutlass::FastDivmod(int(last == 0 ? o.group : last));
  }
  o.heads_div = cutlass::FastDivmod(heads);
  o.kv_div = cutlass::FastDivmod(heads_per_kv);
  return o;
}

}  // namespace flash
