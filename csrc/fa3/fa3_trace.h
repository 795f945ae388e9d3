// Timing marks inside the FA3 forward, for csrc/tools/fa3_harness.cu built with -DFA3_TRACE:
// FA3_MARK(k, slot, value) stores value (clock64(): SM cycles, comparable within a CTA) as
// slot `slot` of the CTA's k-th item in a global buffer the harness allocates and reads back
// (its trace_report: where an item's time goes: waits for Q, first step, key tiles, epilogue).
// Without FA3_TRACE the marks compile to nothing.
//
// Slots: consumer warpgroup c (0-2) 5c + {0: before its wait for the item's Q, 1: after it,
// 2: after its first key tile, 3: after its last P V, 4: after its epilogue (O finalized and
// packed; with one Q buffer also stored, with two the stores come in the next item's first
// key tile, between its marks 1 and 2)}; producer 15: before its wait for a free Q buffer,
// 16: after issuing the Q load; 17: the item's key tiles (consumer 0); 18: when its Q landed
// (a producer thread that waits); 19 + c: when consumer c released the item's Q buffer.
// Overlap schedule, consumer c < 2: 24 + 4c + {0: cycles in masked steps after the first,
// 1: their count, 2: cycles in unmasked steps after the first, 3: their count}; 32 + c: before
// the last P V's wait for its V, 34 + c: after it (the last P V then runs to mark 5c + 3).
#pragma once

#ifdef FA3_TRACE
#include <cstdint>

namespace flash::fa3 {
__device__ long long* fa3_trace;  // kTraceItems x kTraceSlots per CTA
constexpr int kTraceSlots = 40, kTraceItems = 64;
}  // namespace flash::fa3

#define FA3_MARK(k, slot, value)                                                             \
  do {                                                                                      \
    if ((k) < ::flash::fa3::kTraceItems) {                                                  \
      ::flash::fa3::fa3_trace[(int64_t(blockIdx.x) * ::flash::fa3::kTraceItems + (k)) *     \
                                  ::flash::fa3::kTraceSlots + (slot)] = (value);            \
    }                                                                                       \
  } while (0)
#else
#define FA3_MARK(k, slot, value) \
  do {                           \
  } while (0)
#endif
