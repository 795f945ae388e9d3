// A work item as a CTA of the FA3 forward sees it: the scheduler's (query tile, head, batch)
// with the CTA's query rows, the key tiles they see and the sequence's lengths. The producer
// reads it for its loads, the consumers for their walk and the epilogue.
#pragma once

#include "common/mask.h"
#include "common/params.h"
#include "common/seqinfo.h"
#include "common/tile_order.h"

namespace flash::fa3 {

// One (query tile, head, batch) item as the CTA of cluster rank `rank` sees it, with the key
// tiles the CTA's rows see and its sequence's lengths. In a cluster the order's tiles are
// groups of kClusterM query tiles: rank r takes the r-th, and the key tiles are the group's,
// the same in every CTA.
struct Item {
  int m_block, head, batch, head_k, row0;
  flash::KeyTiles tiles;
  int seqlen_q, seqlen_k;
};

// lengths: the sequence's (seqlen_q, seqlen_k) as the producer published them (variable-length
// batches and KV caches: a consumer would otherwise read cu_seqlens / seqused / cache_seqlens
// again, latency at every item's start), or nullptr: read them (SeqInfo).
template <class Tr, class Scheduler>
__device__ __forceinline__ Item item_at(const FwdParams& p, const Scheduler& sched, int i,
                                        int rank, const int2* lengths = nullptr) {
  const flash::WorkItem w = sched.decode(i);
  const flash::Mask mask = lengths != nullptr && (p.cu_seqlens_q != nullptr || p.kv_cache)
                               ? flash::Mask(p, lengths->x, lengths->y)
                               : flash::Mask(p, flash::SeqInfo(p, w.batch));
  Item it;
  const int group = sched.order.tiles - 1 - w.tile;
  it.m_block = group * Tr::kClusterM + rank;
  it.head = w.head;
  it.batch = w.batch;
  it.head_k = w.head_k;
  it.row0 = it.m_block * Tr::kBlockM;
  it.seqlen_q = mask.seqlen_q;
  it.seqlen_k = mask.seqlen_k;
  // Variable-length: the items cover the longest sequence; a tile past this one's used rows
  // sees no key (its rows up to the sequence's end are written as rows that see none).
  const int group_row0 = group * Tr::kClusterM * Tr::kBlockM;
  it.tiles = group_row0 < mask.seqlen_q
                 ? mask.key_tiles<Tr::kBlockM * Tr::kClusterM, Tr::kBlockN>(group_row0)
                 : flash::KeyTiles{};
  return it;
}

}  // namespace flash::fa3
