// FA3 entry point: what the API layer calls. Instantiated per (element type, head dim) by the
// generated files in csrc/generated/. Forward only (its gradient is FA2's backward, which
// shares the O and LSE conventions); every FwdParams feature but dropout (window, softcap,
// ALiBi, GQA). sm_90a machine code: the kernels are empty in any other compilation.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "common/params.h"

namespace flash::fa3 {

// Stream-K (fa3_scheduler.h): full attention whose (query tile, head, batch) items are fewer
// than the SMs runs them cut into pieces of key tiles on more CTAs, the pieces of an item
// merged by the last to finish. The kernels' head dims that have it, with the tile it runs
// (fa3_tiles.h checks it against FwdTile's StreamK; head_dim 0: none).
struct StreamKTile {
  int head_dim = 0, block_m = 0, block_n = 0, consumers = 0;
};
constexpr StreamKTile stream_k_tile(int kernel_hdim) {
  return kernel_hdim == 256 ? StreamKTile{256, 128, 80, 2}
         : kernel_hdim == 192 ? StreamKTile{192, 128, 112, 2}
         : kernel_hdim == 128 ? StreamKTile{128, 128, 128, 2}
         : kernel_hdim == 96  ? StreamKTile{96, 128, 128, 2}
         : kernel_hdim == 64  ? StreamKTile{64, 128, 192, 2}
                              : StreamKTile{};
}
// The CTAs (workers) a call on the kernel of head dim kernel_hdim runs with stream-K, 0 where it
// does not: where cutting the items gives every item two CTAs or more, each with six key tiles
// or more, and no item more than eight pieces (an item's last piece reads the others' fp32 O,
// 64 KB a consumer each at hdim 256, on one SM: 8 items x 103 key tiles ran in 51 us on 66
// CTAs, 56 us on 100, 61 us on 132). Harness, H100, hdim 256, bf16, 512 queries (fa3_notes.md,
// session 21): 32 items x 52 key tiles 192 -> 333 TFLOP/s, 64 x 52 378 -> 451, 64 x 26 338 ->
// 367; 100 items (on 132 SMs) lost 0.3-8%, 120 items 6-13%. The same rule at hdim 64 / 96 (their
// narrow tiles, session 22, H200, bf16, TFLOP/s): 128 x 8192 x 8 heads 26 -> 76 / 33 -> 123,
// 1024 x 8192 x 8 205 -> 337 / 262 -> 424; 1024 x 1024 x 8 (the rule says no, forced) 122 ->
// 107 / 185 -> 159.
// FLASH_ATTN_FA3_STREAM_K=1 runs it on every call it can run (full attention, no softcap /
// ALiBi, a kernel that has it), 0 never; unset, the rule above. Read at every call, for A/B
// runs and tests.
inline int64_t stream_k_workers(const FwdParams& p, int kernel_hdim) {
  const StreamKTile tile = stream_k_tile(kernel_hdim);
  if (tile.head_dim == 0 || p.causal || p.window_left >= 0 || p.window_right >= 0 ||
      p.softcap > 0.f || p.alibi_slopes != nullptr || p.seqlen_k == 0) {
    return 0;
  }
  const int64_t items =
      (int64_t(p.seqlen_q) + tile.block_m - 1) / tile.block_m * p.heads * p.batch;
  const int64_t key_tiles = (int64_t(p.seqlen_k) + tile.block_n - 1) / tile.block_n;
  const int64_t workers =
      std::min<int64_t>(p.num_sms, std::min<int64_t>(items * key_tiles / 6, items * 8));
  const char* env = std::getenv("FLASH_ATTN_FA3_STREAM_K");
  if (env != nullptr && *env != '\0') {
    return std::atoi(env) != 0 && items > 0 ? std::max<int64_t>(workers, 1) : 0;
  }
  return items > 0 && workers >= 2 * items ? workers : 0;
}
// Its workspace after the scheduler's counter, for a grid of ctas CTAs: per CTA one count per
// consumer, and two published pieces per consumer (a flag and 128 threads x (hdim / 2 + 4)
// floats each).
inline int64_t stream_k_ints(int64_t ctas, const StreamKTile& tile) {
  return (64 + 3 * tile.consumers * ctas + 63) / 64 * 64;  // the pieces' float4 after
}
inline int64_t stream_k_bytes(int64_t ctas, const StreamKTile& tile) {
  return stream_k_ints(ctas, tile) * 4 +
         2 * tile.consumers * ctas * 128 * (tile.head_dim / 2 + 4) * 4;
}

// Scratch in global memory for a call on the kernel of head dim kernel_hdim: the counter of the
// tile scheduler (fa3_scheduler.h), which the launcher zeroes on the stream, and stream-K's
// pieces. Every call needs it.
inline int64_t fwd_workspace_bytes(const FwdParams& p, int kernel_hdim) {
  const int64_t workers = stream_k_workers(p, kernel_hdim);
  return workers > 0 ? stream_k_bytes(workers, stream_k_tile(kernel_hdim))
                     : int64_t(sizeof(unsigned));
}

// params.workspace must hold fwd_workspace_bytes(params, kHeadDim) bytes, aligned for an unsigned.
// Throws std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);

}  // namespace flash::fa3
