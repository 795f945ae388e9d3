// Which work item a CTA of the persistent FA3 grid takes next. The items are the tile order's
// (common/tile_order.h): (query tile, head, batch), heaviest tile first within a group of heads.
// Three schedulers with one interface, used by the producer thread only (it hands each item to
// the consumers with the item's Q, fa3_fwd_mainloop.h):
//   first() -> Work, next(Work) -> Work: the CTA's items in turn; an item >= items() ends it
//   decode(item) -> WorkItem: the item's (query tile, head, batch)
//   kPieces: whether a Work is a piece of an item (its own key tiles) rather than all of it.
#pragma once

#include <cstdint>

#include "common/tile_order.h"

namespace flash::fa3 {

// A unit of work: an item, and for stream-K the piece of its key tiles [key_begin, key_end)
// and the worker's next segment.
struct Work {
  int item = 0;
  int key_begin = 0, key_end = 0;
  int segment = 0;
};

// Item indices are 32-bit (fa3_plan.h checks that they fit): the producer thread that runs the
// scheduler has 24 registers, and 64-bit indices made it spill.
struct SchedulerBase {
  flash::TileOrder order;
  __device__ __forceinline__ int items() const { return int(order.items()); }
  __device__ __forceinline__ flash::WorkItem decode(int item) const {
    return order.decode_fast(item);
  }
};

// Masked items differ in cost; taking them heaviest first as CTAs free up balances the tail as a
// grid of one CTA per item would (a static stride: hdim 256 16k causal 461 against 764
// TFLOP/s), and unmasked items run at different speeds on different SMs too (3% at hdim 128 16k
// with a static stride). A CTA takes item blockIdx.x, then the next of a counter in global
// memory that the launcher zeroes.
struct DynamicScheduler : SchedulerBase {
  static constexpr bool kPieces = false;
  unsigned* counter = nullptr;
  __device__ __forceinline__ Work first() const { return {int(blockIdx.x)}; }
  __device__ __forceinline__ Work next(const Work&) const {
    return {int(atomicAdd(counter, 1u) + gridDim.x)};
  }
};

// Clusters take items at a static stride: their items are unmasked (full attention) and cost
// the same, and a claim from the counter would have to be shared across the cluster.
template <int kClusterM>
struct ClusterScheduler : SchedulerBase {
  static constexpr bool kPieces = false;
  __device__ __forceinline__ Work first() const { return {int(blockIdx.x) / kClusterM}; }
  __device__ __forceinline__ Work next(const Work& w) const {
    return {w.item + int(gridDim.x) / kClusterM};
  }
};

// Stream-K (full attention: every item has key_tiles key tiles). Worker w (a CTA) of `workers`
// runs the items k workers + w of the static stride's lattice (k workers + w < lattice) whole;
// the items past the lattice (fewer than workers) are cut into pieces of key tiles: worker w
// takes their units (item, key tile) [range_begin(w), range_begin(w + 1)), part of at most two
// items, the first before its lattice items and the second after. So every worker runs the same
// number of key tiles to within one. The last piece of a cut item to finish merges the others'
// (fa3_fwd_epilogue.h) through the workspace below.
struct StreamKScheduler : SchedulerBase {
  static constexpr bool kPieces = true;
  int key_tiles = 0, workers = 1, lattice = 0;
  int* split_count = nullptr;   // per (the item's last worker, consumer): pieces done
  int* split_flag = nullptr;    // per published piece: its O, max and sum are in split_part
  float4* split_part = nullptr;

  // The first remainder unit of worker w (w = workers: the end).
  __device__ __forceinline__ int range_begin(int w) const {
    const int units = (items() - lattice) * key_tiles;
    return int(int64_t(w) * units / workers);
  }
  // The worker whose range holds remainder unit u (every range holds one or more: the plan).
  __device__ __forceinline__ int worker_of(int u) const {
    const int units = (items() - lattice) * key_tiles;
    int w = int((int64_t(u) * workers + workers - 1) / units);
    while (w > 0 && range_begin(w) > u) --w;
    while (w + 1 < workers && range_begin(w + 1) <= u) ++w;
    return w;
  }
  // Worker w's s-th piece: the item (items(): none left; -1: this piece is empty, go on to
  // s + 1) and its key tiles [kb, ke).
  __device__ __forceinline__ int segment(int w, int s, int& kb, int& ke) const {
    const int whole = (lattice - w + workers - 1) / workers;  // lattice items k workers + w
    kb = 0;
    ke = key_tiles;
    if (s >= 1 && s <= whole) return (s - 1) * workers + w;
    if (s > whole + 1) return items();
    const int a = range_begin(w), b = range_begin(w + 1), r = a / key_tiles;
    if (s == 0) {
      kb = a - r * key_tiles;
      ke = min(key_tiles, b - r * key_tiles);
      return kb < ke ? lattice + r : -1;
    }
    ke = b - (r + 1) * key_tiles;
    return ke > 0 ? lattice + r + 1 : -1;
  }
  // This worker's next non-empty piece from segment s on.
  __device__ __forceinline__ Work piece_from(int s) const {
    Work w;
    do {
      w.item = segment(int(blockIdx.x), s++, w.key_begin, w.key_end);
    } while (w.item < 0);
    w.segment = s;
    return w;
  }
  __device__ __forceinline__ Work first() const { return piece_from(0); }
  __device__ __forceinline__ Work next(const Work& w) const { return piece_from(w.segment); }
};

}  // namespace flash::fa3
