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

  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next() const {
    return int(atomicAdd(counter, 1u) + gridDim.x);
  }
};

}  // namespace flash::fa3
