// Overrides of the launchers' automatic choices: for tests that cover a variant on shapes the
// rules would not send to it, for A/B benchmarks and for the harnesses. Not user interface
// (../shared/INTERFACE.md): reached through the private `_tuning=` keyword of the Python
// functions, parsed once per call by the API layer, and read only by the families' plans.
// Every field's default is the automatic choice.
#pragma once

#include <cstdint>

namespace flash {

struct Tuning {
  // fa3 forward (fa3_plan.h)
  int fa3_stream_k = -1;  // 1: stream-K on every full-attention call it can run, 0: never
  int fa3_cluster = -1;   // 1: clusters wherever the tile has them (full attention), 0: never
  int fa3_narrow = -1;    // 1: the narrow tile on every call, 0: only where the wide one pads more
  int fa3_ctas = 0;       // > 0: the grid (stream-K: the workers), for the harness
  // fa3 backward (fa3_plan.h, plan_bwd)
  int fa3_bwd_split = -1;  // 0: no split of full attention's last wave, k > 0: k parts an item
  int fa3_bwd_zero = -1;   // 0: the dQ accumulator zeroed by a memset, not the main kernel;
                           // k > 0: by the main kernel in chunks of k KB
  // fa2 backward (fa2/fa2.h, plan_bwd)
  int fa2_dq_bulk = -1;   // 0: per-fragment dQ reductions on sm90 too (sm80's path)
  int fa2_dq_defer = -1;  // 0: a dQ tile's reductions after its GEMM (the deterministic path)
  int fa2_pdl = -1;       // 0: plain launches on sm90 too (other GPUs' chain)
  // fa2 forward (fa2/fa2.h, plan_fwd)
  int fa2_decode = -1;    // 0: the forward's kernel for short-query KV-cache calls too
  // fa2 and fa3: heads per group of the tile order (common/tile_order.h); 0: automatic
  int head_group = 0;
  // fa1 forward: query tiles one block walks; 0: automatic
  int fa1_q_tiles = 0;
};

}  // namespace flash
