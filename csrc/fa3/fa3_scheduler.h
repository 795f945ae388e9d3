// Which work item a CTA of the persistent FA3 grid takes next. The items are FA2's
// (fa2_tile_order.h): (query tile, head, batch), heaviest tile first within a group of heads.
//
// A CTA takes first item blockIdx.x, then whichever item is next in a counter in global
// memory (zeroed by the launcher before the kernel). Under a causal mask or a window the items
// differ in cost; taking them heaviest first as SMs free up balances the tail the way the
// hardware does for a grid of one CTA per item (which a static stride, CTA c taking items c,
// c + grid, ..., did not: hdim 256 16k causal 461 against 764 TFLOP/s, fa3_notes.md, session
// 11), while the CTA keeps the persistent grid's overlap of one item's loads with the last
// one's epilogue. Unmasked items cost the same, but CTAs do not run at the same speed: with
// a static stride the CTAs that took one item more finished 3% later with Q double-buffered
// (ncu, hdim 128 16k: SM active cycles the same on average, elapsed +3%), which taking items
// as CTAs free up removed (fa3_notes.md, session 14).
// Only the producer thread calls next(); it hands the item to the consumers through shared
// memory (fa3_fwd_kernel.cuh).
#pragma once

#include <cstdint>

#include "fa2/fa2_tile_order.h"

namespace flash::fa3 {

// Item indices are 32-bit (the launcher checks that they fit): the producer thread that
// runs the scheduler has 24 registers, and 64-bit indices made it spill.
struct TileScheduler {
  flash::fa2::TileOrder order;
  unsigned* counter = nullptr;

  // Stream-K (kernels with FwdTraits::kStreamK, full attention: every item has key_tiles key
  // tiles). Worker w (a CTA, or a cluster) of `workers` runs the items k workers + w of the
  // static stride's lattice (k workers + w < lattice) as whole items; the items past the
  // lattice (fewer than workers) are cut into pieces of key tiles: worker w takes their units
  // (item, key tile) [range_begin(w), range_begin(w + 1)), part of at most two items, the
  // first before its lattice items and the second after. So every worker runs the same number
  // of key tiles to within one, and the workers' item ends are spread by the first piece's
  // length instead of falling in lock step. A cut item's pieces are merged by the last to
  // finish (fa3_fwd_kernel.cuh), through the workspace below. Measured (fa3_notes.md, session
  // 21): it pays where the items are fewer than the SMs (fa3.h's rule: up to 3.8x); on the
  // benchmark's many items it lost 0.5% to the dynamic scheduler (the merges and the pieces'
  // stores cost what the spread saves).
  int key_tiles = 0, workers = 1, lattice = 0;
  int* split_count = nullptr;   // per (the item's last worker, CTA rank, consumer): pieces done
  int* split_flag = nullptr;    // per published piece: its O, max and sum are in split_part
  float4* split_part = nullptr;

  // The first remainder unit of worker w (w = workers: the end).
  __device__ __forceinline__ int range_begin(int w) const {
    const int units = (int(order.items()) - lattice) * key_tiles;
    return int(int64_t(w) * units / workers);
  }
  // The worker whose range holds remainder unit u (every range holds one or more: launcher).
  __device__ __forceinline__ int worker_of(int u) const {
    const int units = (int(order.items()) - lattice) * key_tiles;
    int w = int((int64_t(u) * workers + workers - 1) / units);
    while (w > 0 && range_begin(w) > u) --w;
    while (w + 1 < workers && range_begin(w + 1) <= u) ++w;
    return w;
  }
  // Worker w's s-th piece: the item (items: none left; -1: this piece is empty, go on to
  // s + 1) and its key tiles [kb, ke).
  __device__ __forceinline__ int segment(int w, int s, int& kb, int& ke) const {
    const int whole = (lattice - w + workers - 1) / workers;  // lattice items k workers + w
    kb = 0;
    ke = key_tiles;
    if (s >= 1 && s <= whole) return (s - 1) * workers + w;
    if (s > whole + 1) return int(order.items());
    const int a = range_begin(w), b = range_begin(w + 1), r = a / key_tiles;
    if (s == 0) {
      kb = a - r * key_tiles;
      ke = min(key_tiles, b - r * key_tiles);
      return kb < ke ? lattice + r : -1;
    }
    ke = b - (r + 1) * key_tiles;
    return ke > 0 ? lattice + r + 1 : -1;
  }

  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next() const {
    return int(atomicAdd(counter, 1u) + gridDim.x);
  }
};

}  // namespace flash::fa3
