// The FA3 backward's work items (fa3_bwd_kernel.cuh). Item i is (key tile, KV head, batch),
// key tiles fastest (neighbouring items read the same Q and dO) but over the plan's tail
// pairs (BwdItem); a persistent grid's last partial wave of full attention goes as parts of its
// items' query tiles (BwdPlan::split_items). A CTA takes items until none is left:
// its producer thread claims each and publishes it with the item's K and V (kv_full), and
// the consumers and the dQ writer take it there and release the slot, and K and V with it
// (kv_empty). An item walks the query tiles of BwdSteps.
#pragma once

#include <cutlass/arch/barrier.h>

#include "common/mask.h"
#include "common/params.h"
#include "common/query_tiles.h"
#include "common/seqinfo.h"
#include "fa3/fa3_bwd_prep.cuh"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

// kSplit: the plan may split items (a persistent kernel's, BwdPlan::split_items): item
// s.split_first + k r + j is part j of the k = s.split_parts parts of item s.split_first + r.
template <class Tr, bool kSplit>
struct BwdItem {
  int n_block, head_k, batch;
  int part = 0, parts = 1;
  // Pair by pair, key tiles fastest, but for the last s.tail_pairs (KV head, batch) pairs,
  // taken key tile by key tile (all their first key tiles, then their second ones, ...).
  __device__ BwdItem(const BwdParams& p, const BwdScratch& s, int item) {
    if constexpr (kSplit) {
      if (item >= s.split_first) {
        const int split = item - s.split_first;
        parts = s.split_parts;
        part = split % parts;
        item = s.split_first + split / parts;
      }
    }
    const int n_blocks = (p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
    const int head_pairs = p.heads_k * p.batch - s.tail_pairs;
    const int tail = item - head_pairs * n_blocks;
    n_block = tail < 0 ? item % n_blocks : tail / s.tail_pairs;
    const int pair = tail < 0 ? item / n_blocks : head_pairs + tail % s.tail_pairs;
    head_k = pair % p.heads_k;
    batch = pair / p.heads_k;
  }
};

// The query tiles [begin, end) that may see a key of key tile n_block (common/query_tiles.h);
// none for a tile past the sequence's keys. Part `part` of `parts` takes that share of them
// (of each query head's).
template <class Tr>
struct BwdSteps {
  int m_begin, m_end, heads_per_kv;
  __device__ BwdSteps(const BwdParams& p, const Mask& mask, int n_block, int part, int parts) {
    const QueryTiles t = query_tiles<Tr::kBlockM, Tr::kBlockN>(mask, n_block);
    m_begin = t.begin;
    m_end = n_block * Tr::kBlockN < mask.seqlen_k ? t.end : 0;
    if (parts > 1 && m_end > m_begin) {
      const int tiles = m_end - m_begin;
      m_end = m_begin + tiles * (part + 1) / parts;
      m_begin += tiles * part / parts;
    }
    heads_per_kv = p.heads / p.heads_k;
  }
  __device__ int count() const { return m_end > m_begin ? heads_per_kv * (m_end - m_begin) : 0; }
};

// An item with what follows from it: its sequence, mask and query tiles. The producer, the
// consumers and the dQ writer each derive it from the item they take.
template <class Tr, bool kSplit>
struct BwdWork {
  BwdItem<Tr, kSplit> it;
  flash::SeqInfo seq;
  Mask mask;
  BwdSteps<Tr> steps;
  __device__ BwdWork(const BwdParams& p, const BwdScratch& s, int item)
      : it(p, s, item), seq(p, it.batch), mask(p, seq),
        steps(p, mask, it.n_block, it.part, it.parts) {}
};

// The handoff. Items are 32-bit (fa3_plan.h: plan_error). kPersistent: a CTA takes items
// until none is left (bwd_persistent); otherwise it runs item blockIdx.x alone and nothing is
// published. The n-th item published (and taken) goes through slot n % kKVSlots, with its K
// and V in that slot's buffers, in that slot's barrier phase (n / kKVSlots) & 1.
template <class Tr, bool kPersistent>
struct BwdItems {
  using Shared = typename Tr::SharedStorage;
  static constexpr int kSlots = Tr::kKVSlots;
  __device__ static int slot(int n) { return n % kSlots; }
  __device__ static int phase(int n) { return (n / kSlots) & 1; }
  // The producer's first item.
  static __device__ __forceinline__ int first() { return int(blockIdx.x); }
  // The persistent producer's item after its first; s.items or more: none left.
  static __device__ __forceinline__ int next(const BwdScratch& s) {
    if (int(gridDim.x) >= s.items) return s.items;
    return int(atomicAdd(s.next_item, 1u)) + int(gridDim.x);
  }
  // The producer's published-th item (-1: none left) into its slot, once every taker has
  // released the slot's item before; the caller then completes the slot's kv_full phase (K
  // and V's bytes, or an arrive).
  static __device__ __forceinline__ void publish(Shared& shared, int published, int item) {
    if constexpr (kPersistent) {
      const int k = slot(published);
      if (published >= kSlots) {
        cutlass::arch::ClusterBarrier::wait(&shared.kv_empty[k], phase(published - kSlots));
      }
      compiler_fence();  // the wait (asm without a memory clobber) before the write
      shared.item[k] = item;
      compiler_fence();  // the write before the caller's completion of kv_full (no clobber)
    }
  }
  // The taken-th item (-1: none left), once its K and V have landed. The shuffle tells the
  // compiler that the item is the same in every lane: without it the item loop's branches
  // count as divergent, and the steps' shared-memory descriptors, kept in uniform registers
  // when provably uniform, went to 30 more vector registers and spilled.
  // A CTA of one item waits for its K and V where it first reads them (BwdMainloop::wait_kv).
  static __device__ __forceinline__ int take(Shared& shared, int taken) {
    if constexpr (!kPersistent) return taken == 0 ? int(blockIdx.x) : -1;
    cutlass::arch::ClusterBarrier::wait(&shared.kv_full[slot(taken)], phase(taken));
    compiler_fence();
    return __shfl_sync(0xffffffffu, shared.item[slot(taken)], 0);
  }
  // The taken-th item, read again (in a persistent CTA: not kept in registers through its
  // steps, where its coordinates were spilled).
  static __device__ __forceinline__ int current(Shared& shared, int taken, int item) {
    if constexpr (!kPersistent) return item;
    compiler_fence();
    return __shfl_sync(0xffffffffu, shared.item[slot(taken)], 0);
  }
  // The taken-th item's slot read, and its K and V by the consumers: a next item may come in.
  static __device__ __forceinline__ void release(Shared& shared, int taken) {
    if constexpr (kPersistent) {
      compiler_fence();
      cutlass::arch::ClusterBarrier::arrive(&shared.kv_empty[slot(taken)]);
    }
  }
};

}  // namespace flash::fa3
