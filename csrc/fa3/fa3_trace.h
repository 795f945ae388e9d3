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
// Staged epilogue (hdim 256), consumer c < 2: 40 + c after finalize, 50 + c after packing
// (and consumer 1's wait for consumer 0's last P V), 42 + c after stmatrix, 44 + c after the
// warpgroup's barrier, 46 + c after the TMA store's read wait, 48 + c after the last barrier.
#pragma once

#ifdef FA3_TRACE
#include <cstdint>

namespace flash::fa3 {
__device__ long long* fa3_trace;  // kTraceItems x kTraceSlots per CTA
constexpr int kTraceSlots = 60, kTraceItems = 64;
// %globaltimer in ns, comparable across SMs (slots 52-56, -DFA3_TRACE_TIME: consumer 0's
// thread 0: 52 entry, 53 after the piece's Q wait, 54 after its last P V, 55 after the
// stream-K merge, 56 after the epilogue).
__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
}  // namespace flash::fa3

// -DFA3_TRACE_EPI keeps only the marks the epilogue's report reads (consumer marks 0, 3 and 4,
// slot 17, slots 40-51), -DFA3_TRACE_TIME those of the timeline (0, 52-56); with
// -DFA3_TRACE_NO_STEPS the overlap steps keep no cycle sums (slots 24-31). Fewer marks, fewer
// registers: the full set makes the overlap kernels spill (~400 B at hdim 256), which the
// reduced sets do less (~200-400 B; the spills stay, so read such traces as shares).
#if defined(FA3_TRACE_EPI)
#define FA3_TRACE_KEEP(slot) \
  ((slot) == 0 || (slot) == 5 || (slot) == 3 || (slot) == 4 || (slot) == 8 || (slot) == 9 || \
   (slot) == 17 || ((slot) >= 40 && (slot) < 52))
#elif defined(FA3_TRACE_TIME)
#define FA3_TRACE_KEEP(slot) ((slot) == 0 || (slot) == 5 || ((slot) >= 52 && (slot) < 57))
#else
#define FA3_TRACE_KEEP(slot) true
#endif
#define FA3_MARK(k, slot, value)                                                             \
  do {                                                                                      \
    if ((k) < ::flash::fa3::kTraceItems && FA3_TRACE_KEEP(slot)) {                          \
      ::flash::fa3::fa3_trace[(int64_t(blockIdx.x) * ::flash::fa3::kTraceItems + (k)) *     \
                                  ::flash::fa3::kTraceSlots + (slot)] = (value);            \
    }                                                                                       \
  } while (0)
#else
#define FA3_MARK(k, slot, value) \
  do {                           \
  } while (0)
#endif
