// The FA3 forward's tile table and its per-call plan: which kernel runs a call (tile, schedule,
// cluster, stream-K), on how many CTAs, with how much workspace; and the backward's plan.
// Decided here once per call and read by the launchers (fa3_fwd_launch.cuh,
// fa3_bwd_launch.cuh). Pure host logic with no CUDA header, so that tests/cpp/test_fa3_plan.cpp
// checks it on the CPU. Measurements behind every rule: docs/fa3_decisions.md.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "common/params.h"
#include "common/tuning.h"

namespace flash::fa3 {

// How a consumer warpgroup orders its GEMMs and its softmax: serial (each GEMM waited for at
// once) or intra-warpgroup overlap (S[n] is issued before P[n+1] V[n+1], and the softmax of
// S[n] runs while that P V is on the tensor cores).
enum class Schedule { kSerial, kOverlap };

// One kernel's tile: kBlockN keys per step, a ring of `stages` K / V buffers, `consumers`
// warpgroups of 64 query rows each beside the producer warpgroup.
struct TileShape {
  int block_n = 0, stages = 0, consumers = 0;
  Schedule schedule = Schedule::kSerial;
  constexpr int block_m() const { return 64 * consumers; }
  constexpr bool exists() const { return consumers > 0; }
};

// The tiles of a head dim's kernels. Limits (H100 / H200): 227 KB of shared memory per block
// (Q + stages x (K + V), 16-bit); registers per consumer thread after setmaxnreg 240 with two
// consumers, 160 with three, of which O takes hdim / 2, S kBlockN / 2 and P kBlockN / 4.
struct HeadDimTiles {
  TileShape wide;           // the default tile
  TileShape narrow;         // two consumers, for calls the wide (three) pads or under-fills
  int wide_gain_pct = 0;    // the wide tile's speed over the narrow one's where both fill, %
  bool wide_score_mod = true;  // softcap / ALiBi may run the wide tile (else it spills)
  int cluster_m = 1;        // CTAs per cluster (K / V multicast) for long full attention
  TileShape stream_k;       // the tile of the stream-K kernel (few items, full attention)
};

constexpr TileShape kSerial128x3{128, 2, 3, Schedule::kSerial};
constexpr TileShape kSerial128x2{128, 2, 2, Schedule::kSerial};

// Per row: the limiting resource, then the measured reason.
// - hdim 64 / 96 / 128: three consumers (192 rows), kBlockN 128 serial, +4..+20% over the best
//   two-consumer tile where 192 rows fill; hdim 64 has room for three stages (144 KB). The
//   score-mod kernel of hdim 128's wide tile spills in 160 registers.
// - hdim 192 / 256: two consumers (O alone is 96 / 128 registers), overlap, the widest
//   two-stage kBlockN (112 / 80; needs CuTe's extended WGMMA shapes); overlap over serial
//   +6..10% at hdim 256. hdim 256 full attention in clusters of two: +2.5..3.3% from 2k.
// FP8 (e4m3): one tile per head dim, kBlockN 128 keys: a K / V tile row is 128 bytes, the
// widest swizzle, and V's transpose (fwd_fp8_vt, keys contiguous: FP8 WGMMA reads both operands
// K-major) is one 128-byte row per head-dim column. Half the bytes of a 16-bit tile, so hdim 64
// has room for four stages; hdim 256 keeps two consumers (O alone is 128 registers).
constexpr HeadDimTiles fwd_tiles_fp8(int kernel_hdim) {
  switch (kernel_hdim) {
    case 64:
      return {{128, 4, 3, Schedule::kSerial}, {}, 0, false, 1, {}};
    case 128:
      return {{128, 3, 3, Schedule::kSerial}, {}, 0, false, 1, {}};
    case 256:
      return {{128, 2, 2, Schedule::kOverlap}, {}, 0, false, 1, {}};
    default:
      return {};
  }
}

constexpr HeadDimTiles fwd_tiles(int kernel_hdim, bool fp8 = false) {
  if (fp8) return fwd_tiles_fp8(kernel_hdim);
  switch (kernel_hdim) {
    case 64:
      return {{128, 3, 3, Schedule::kSerial}, {192, 2, 2, Schedule::kSerial}, 115, true, 1,
              {192, 2, 2, Schedule::kSerial}};
    case 96:
      return {kSerial128x3, kSerial128x2, 110, true, 1, kSerial128x2};
    case 128:
      return {kSerial128x3, kSerial128x2, 108, false, 1, kSerial128x2};
    case 192:
      return {{112, 2, 2, Schedule::kOverlap}, {}, 0, true, 1, {112, 2, 2, Schedule::kOverlap}};
    case 256:
      return {{80, 2, 2, Schedule::kOverlap}, {}, 0, true, 2, {80, 2, 2, Schedule::kOverlap}};
    default:
      return {};
  }
}

// Which instantiation runs: the wide tile, the narrow one, the wide one in clusters, or the
// stream-K kernel.
enum class FwdKernel { kWide, kNarrow, kCluster, kStreamK };

struct FwdPlan {
  FwdKernel kernel = FwdKernel::kWide;
  bool score_mod = false;   // softcap or ALiBi: the kernels that apply them
  TileShape tile;           // the kernel's tile
  int cluster_m = 1;
  int64_t items = 0;        // (query tile or cluster's tiles, head, batch) work items
  // The grid, in CTAs: one per SM (every kernel takes all 64K registers of one), fewer where
  // there are fewer items or stream-K workers. The cluster kernel's grid is further limited by
  // the launcher to the clusters the GPU runs at once. 0: nothing to launch.
  int64_t ctas = 0;
  // Stream-K: every item has key_tiles key tiles; `workers` CTAs run items k workers + w below
  // `lattice` whole and cut the rest into pieces (fa3_scheduler.h).
  int64_t key_tiles = 0, workers = 0, lattice = 0;
  // Scratch in global memory: the dynamic scheduler's counter (and stream-K's counts, flags and
  // published pieces); the launcher zeroes its first zero_bytes on the stream.
  int64_t workspace_bytes = 0, zero_bytes = 0;
  int head_group = 0;  // the tile order's heads per group; 0: automatic (Tuning::head_group)
  // FP8: V transposed per (batch, KV head) into (head_dim, keys) rows for the kernel
  // (fwd_fp8_vt), keys padded to vt_keys, at this byte offset of the workspace.
  int64_t vt_offset = 0, vt_keys = 0;
};

// FP8's V^T: keys padded to a multiple of this (the P fragment's key order repeats every 16
// keys, fa3_fwd_fp8.h).
constexpr int kFp8KeyGroup = 16;
constexpr int64_t fp8_vt_keys(int64_t seqlen_k) {
  return (seqlen_k + kFp8KeyGroup - 1) / kFp8KeyGroup * kFp8KeyGroup;
}

// Stream-K's workspace for `ctas` workers of `consumers` warpgroups at head dim `hdim`, in
// 4-byte words: the scheduler's counter (64 words), per CTA and consumer a count, and two
// published pieces per CTA and consumer, each a flag and, after the ints, 128 threads x
// (hdim / 2 + 4) floats.
struct StreamKLayout {
  int64_t ctas, consumers, hdim;
  static constexpr int64_t kCountOffset = 64;
  constexpr int64_t flag_offset() const { return kCountOffset + consumers * ctas; }
  constexpr int64_t ints() const { return (kCountOffset + 3 * consumers * ctas + 63) / 64 * 64; }
  constexpr int64_t part_floats() const { return 128 * (hdim / 2 + 4); }
  constexpr int64_t bytes() const { return ints() * 4 + 2 * consumers * ctas * part_floats() * 4; }
};

namespace plan_detail {

inline bool full_attention(const FwdParams& p) {
  return !p.causal && p.window_left < 0 && p.window_right < 0;
}
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Stream-K's workers for a call, 0 where it does not run: where cutting the items gives every
// item two CTAs or more, each with six key tiles or more, and no item more than eight pieces
// (an item's last piece reads the others' fp32 O on one SM). It paid up to 3.8x on few items and
// lost 0.5% on the benchmark's many.
inline int64_t stream_k_workers(const FwdParams& p, const TileShape& tile, int forced) {
  if (!tile.exists() || !full_attention(p) || p.softcap > 0.f || p.alibi_slopes != nullptr ||
      p.seqlen_k == 0 || forced == 0) {
    return 0;
  }
  const int64_t items = ceil_div(p.seqlen_q, tile.block_m()) * p.heads * p.batch;
  const int64_t key_tiles = ceil_div(p.seqlen_k, tile.block_n);
  const int64_t workers =
      std::min<int64_t>(p.num_sms, std::min<int64_t>(items * key_tiles / 6, items * 8));
  if (forced > 0) return items > 0 ? std::max<int64_t>(workers, 1) : 0;
  return items > 0 && workers >= 2 * items ? workers : 0;
}

// Clusters pay where the K / V stream is the limit: long items that fill the GPU twice (short
// ones lost 1-5%, not understood).
inline bool cluster_pays(const FwdParams& p, int64_t items) {
  return p.seqlen_k >= 2048 && items >= 2 * int64_t(p.num_sms);
}

// Whether seqlen_q rows pad less on the narrow tile, counting consumer warpgroups per (batch,
// head): a consumer whose rows all lie past seqlen_q skips its GEMMs, so padding costs only
// where it leaves a tile with a lone busy consumer (no other warpgroup to run its softmax
// under: counted as two). Weighed by the wide tile's gain.
inline bool narrow_pads_less(const HeadDimTiles& t, int64_t seqlen_q) {
  auto consumers = [&](int64_t per_tile) {
    const int64_t rows = 64 * per_tile, rest = (seqlen_q % rows + 63) / 64;
    return seqlen_q / rows * per_tile + (rest == 0 ? 0 : rest < 2 ? 2 : rest);
  };
  return consumers(t.narrow.consumers) * t.wide_gain_pct < consumers(t.wide.consumers) * 100;
}

// Whether the narrow tile's items fill the GPU where the wide tile's leave SMs idle: at most two
// narrow items per SM, full attention or causal up to 2k keys (+3..26% on 30 shapes; the wide
// tile wins above).
inline bool narrow_fills(const FwdParams& p, int64_t narrow_items) {
  const bool causal = p.causal && p.window_left < 0;
  return narrow_items <= 2 * int64_t(p.num_sms) &&
         (full_attention(p) || (causal && p.seqlen_k <= 2048));
}

inline bool narrow_pays(const FwdParams& p, const HeadDimTiles& t, int forced) {
  if (forced > 0) return true;
  if (narrow_pads_less(t, p.seqlen_q)) return true;
  if (forced == 0) return false;
  return narrow_fills(p, ceil_div(p.seqlen_q, t.narrow.block_m()) * p.heads * p.batch);
}

// Stream-K cuts the items past the lattice only where there are such items and every worker's
// range holds two key tiles or more; else every item is whole (the plain static stride).
inline bool stream_k_cuts(int64_t items, int64_t key_tiles, int64_t workers) {
  return items % workers != 0 && (items % workers) * key_tiles >= 2 * workers;
}

}  // namespace plan_detail

// The grid and workspace of a plan whose kernel, tile and cluster are chosen (by plan_fwd, or
// by the harness for a tile of its own). A stream-K plan without workers gets the rule's count,
// forced to at least one.
inline FwdPlan size_plan(const FwdParams& p, int kernel_hdim, FwdPlan plan,
                         const Tuning& tuning = {}) {
  using namespace plan_detail;
  const int64_t rows = int64_t(plan.tile.block_m()) * plan.cluster_m;
  plan.items = ceil_div(p.seqlen_q, rows) * p.heads * p.batch;
  plan.workspace_bytes = plan.zero_bytes = sizeof(unsigned);
  plan.head_group = tuning.head_group;
  if (plan.kernel == FwdKernel::kStreamK) {
    if (tuning.fa3_ctas > 0) plan.workers = tuning.fa3_ctas;
    if (plan.workers <= 0) plan.workers = stream_k_workers(p, plan.tile, /*forced=*/1);
    plan.ctas = plan.workers;
    plan.key_tiles = ceil_div(p.seqlen_k, plan.tile.block_n);
    plan.lattice = plan.workers > 0 && stream_k_cuts(plan.items, plan.key_tiles, plan.workers)
                       ? plan.items / plan.workers * plan.workers
                       : plan.items;
    const StreamKLayout layout{plan.ctas, plan.tile.consumers, kernel_hdim};
    plan.workspace_bytes = layout.bytes();
    plan.zero_bytes = layout.ints() * 4;
  } else {
    const int64_t grid =
        tuning.fa3_ctas > 0 ? tuning.fa3_ctas : std::max(p.num_sms, 1) / plan.cluster_m;
    plan.ctas = std::min(plan.items, grid) * plan.cluster_m;
  }
  return plan;
}

// The plan of a call to the kernels of head dim kernel_hdim (an instantiated one: 64, 96, 128,
// 192, 256). p needs its sizes, mask, score mods and num_sms.
inline FwdPlan plan_fwd(const FwdParams& p, int kernel_hdim, const Tuning& tuning = {}) {
  using namespace plan_detail;
  const HeadDimTiles t = fwd_tiles(kernel_hdim, p.fp8);
  FwdPlan plan;
  if (p.fp8) {
    // One kernel (dense calls, no score mod: fwd_unsupported), and V^T after the counter.
    plan.tile = t.wide;
    if (!plan.tile.exists()) return plan;  // no FP8 kernel of this head dim: ctas 0
    plan = size_plan(p, kernel_hdim, plan, tuning);
    plan.vt_keys = fp8_vt_keys(p.seqlen_k);
    plan.vt_offset = ceil_div(plan.workspace_bytes, 1024) * 1024;  // after the counter
    plan.workspace_bytes =
        plan.vt_offset + int64_t(p.batch) * p.heads_k * p.head_dim * plan.vt_keys;
    return plan;
  }
  plan.score_mod = p.softcap > 0.f || p.alibi_slopes != nullptr;
  plan.tile = t.wide;
  // Variable-length batches (sizes: the longest sequence's) and KV caches (seqlen_k: the
  // capacity; each sequence its cache_seqlens) take neither stream-K, whose pieces assume
  // every item has the same key tiles, nor clusters, whose CTAs share K / V tiles and so would
  // have to share a sequence's key range.
  const bool ragged = p.cu_seqlens_q != nullptr || p.kv_cache;
  const int64_t workers =
      plan.score_mod || ragged ? 0 : stream_k_workers(p, t.stream_k, tuning.fa3_stream_k);
  const int64_t wide_items = ceil_div(p.seqlen_q, t.wide.block_m()) * p.heads * p.batch;
  const bool cluster = t.cluster_m > 1 && !plan.score_mod && !ragged && full_attention(p) &&
                       (tuning.fa3_cluster >= 0 ? tuning.fa3_cluster > 0
                                                : cluster_pays(p, wide_items));
  if (workers > 0) {
    plan.kernel = FwdKernel::kStreamK;
    plan.tile = t.stream_k;
    plan.workers = workers;
  } else if (cluster) {
    plan.kernel = FwdKernel::kCluster;
    plan.cluster_m = t.cluster_m;
  } else if (t.narrow.exists() && ((plan.score_mod && !t.wide_score_mod) ||
                                   narrow_pays(p, t, tuning.fa3_narrow))) {
    plan.kernel = FwdKernel::kNarrow;
    plan.tile = t.narrow;
  }
  return size_plan(p, kernel_hdim, plan, tuning);
}

// Why this plan cannot run (a size past the kernels' 32-bit item indices), nullptr if it can.
inline const char* plan_error(const FwdPlan& plan) {
  if (plan.items + plan.ctas > INT_MAX) {
    return "more than 2^31 - 1 (query tile, head, batch) work items";
  }
  if (plan.kernel == FwdKernel::kStreamK &&
      (plan.workers <= 0 || (plan.items % plan.workers) * plan.key_tiles > INT_MAX)) {
    return "no stream-K workers, or more than 2^31 - 1 stream-K units";
  }
  return nullptr;
}

// ---- the backward ---------------------------------------------------------------------------

// The backward's plan: its grid and its workspace (fa3_bwd_launch.cuh lays it out).
struct BwdPlan {
  int64_t workspace_bytes = 0;  // dQ accumulator, item counter, split region, K / V bounds,
                                // lse in base 2, D, dQ scales (fa3_bwd_prep.cuh)
  int items = 0;                // (key tile, KV head, batch)
  int ctas = 0;                 // the grid
  bool persistent = false;      // ctas take the items in turn from a counter (bwd_persistent)
  int block_m = 64;             // query rows a step (bwd_block_m)
  int tail_pairs = 1;           // the last (KV head, batch) pairs taken key tile by key tile
  // Full attention's last partial wave: its split_items items (the last in order) run as
  // split_parts items each, a share of the query tiles apiece (bwd_split_parts).
  int split_items = 0;
  int split_parts = 1;
  // The dQ accumulator's chunks per (KV head, batch) pair that the main kernel zeroes
  // (bwd_zero_chunks); 0: a memset zeroes it before the kernels.
  int zero_chunks = 0;
};

// The backward's keys a CTA (BwdTraits::kBlockN): 64 where dK / dV of 128 keys would not fit
// in registers (fa3_bwd_traits.h).
constexpr int bwd_block_n(int kernel_hdim) { return kernel_hdim > 128 ? 64 : 128; }
// Its query rows a step (BwdTraits::kBlockM), to which each (batch, head)'s scratch rows are
// padded (fa3_bwd_prep.cuh): 96 at head dim 64 for the calls of bwd_plain, half as much GEMM
// work again a step for the same barriers, waits and fences (dQ^T then, fa3_bwd_traits.h;
// +3..+7%); 64 elsewhere. Head dim 128 keeps 64: 80 rows there lost 3-9% (docs/fa3_decisions.md).
constexpr int bwd_block_m(int kernel_hdim, bool plain) {
  return plain && kernel_hdim == 64 ? 96 : 64;
}
// Causal calls take the 96-row tile from this many query rows: its diagonal steps straddle
// two key tiles of 128, which cost more than the fewer steps save below it (1k -2.5%, 2k -1%,
// 4k +4%, 16k +7%; deterministic 16k +16%).
constexpr int kBwdPlainCausalRows = 4096;
// The calls of the 96-row tile: neither a window nor a score mod, causal ones from
// kBwdPlainCausalRows query rows.
inline bool bwd_plain(const BwdParams& p) {
  return p.window_left < 0 && (p.causal ? p.seqlen_q >= kBwdPlainCausalRows : p.window_right < 0) &&
         p.softcap == 0.f && p.alibi_slopes == nullptr;
}

// Head dims whose backward keeps a CTA an SM taking (key tile, KV head, batch) items in turn
// (fa3_bwd_kernel.cuh), not a CTA an item: the next item's K / V load under this one's dK / dV
// stores (64 +6..10%, 128 / 256 up to +3%, 96 level; docs/fa3_decisions.md). Not at 192
// (-1.4..-1.9%): its 64-key items leave little to overlap.
constexpr bool bwd_persistent(int kernel_hdim) { return kernel_hdim != 192; }

// The workspace's item counter (BwdScratch::next_item) and the zeroing's two (zero_next,
// zero_all), after the dQ accumulators: 16 bytes, so that lse and D after them stay 16-byte
// aligned for bulk copies.
constexpr int kBwdCounterBytes = 16;
// The split items' region of the workspace (BwdPlan::split_items), after the item counter: a
// counter each (16-byte aligned as a block), then each item's fp32 dK and dV.
inline int64_t bwd_split_counter_bytes(int64_t split) { return (split * 4 + 15) / 16 * 16; }
inline int64_t bwd_split_bytes(int64_t split, int kernel_hdim) {
  return bwd_split_counter_bytes(split) + split * 2 * bwd_block_n(kernel_hdim) * kernel_hdim * 4;
}

// The dQ accumulator zeroed by the main kernel, not a memset before it (fa3_bwd_epilogue.h:
// zero_dq): the producer warpgroup's idle warps take chunks of it from a counter, the first
// pairs' first, and count each chunk done per (KV head, batch) pair; the dQ writer waits for
// its pair's count before its first add. The memset's 128 MB at 16k tokens x hidden 2048
// (~45 us) then overlap the kernel's first wave, which reads little from memory: H100, 64 and
// 128, +1.7..+3.7% at 1k-4k, level at 16k (docs/fa3_decisions.md). Chunks of 8 KB: the first
// wave's pairs land before their first adds (32 KB: 2k -1%; 2 KB: the claims' atomics, -20%
// at 1k). The counters (a 4-byte count a pair, 16-byte aligned as a block) sit after the split
// region, zeroed with the item counter. Only when the main kernel runs (a grid of 0 CTAs
// would leave the accumulator as it was).
constexpr int64_t kBwdZeroChunkBytes = 8 << 10;
inline int bwd_zero_chunks(int64_t pair_bytes, int64_t pairs,
                           int64_t chunk_bytes = kBwdZeroChunkBytes) {
  const int64_t chunks = std::max<int64_t>((pair_bytes + chunk_bytes - 1) / chunk_bytes, 1);
  return chunks * pairs >= INT_MAX ? 0 : int(chunks);
}
inline int64_t bwd_zero_counter_bytes(int64_t pairs) { return (pairs * 4 + 15) / 16 * 16; }

// Deterministic mode's bounds of |K| and of |V|'s rows (fa3_bwd_prep.cuh), a pair of floats
// per (batch, KV head), after the split region: zeroed with the dQ accumulator.
inline int64_t bwd_kv_bound_bytes(int64_t pairs) { return (pairs * 8 + 15) / 16 * 16; }

// A causal call's last items taken key tile by key tile: about this many an SM
// (BwdPlan::tail_pairs). Harness, H200, 1k / 2k / 4k / 8k causal: 128 +2.6 / +4.2 / +4.3 /
// +6.2%, 256 +4.7 / +4.8 / +4.1 / -0.5%, 96 +2.7..+3.1 / +3.6 / +3.6 / +2.6..+4.7%, 64 and 192
// +2..+3.6%; 16k level. One an SM or four did less (docs/fa3_decisions.md).
constexpr int kBwdTailItems = 2;

// Full attention's items are all alike, so a persistent grid ends on a partial wave: 2048 items
// on 132 SMs (head dim 128 at 16k tokens) leave 68 for a last wave that runs while 64 SMs idle,
// ~3% of the call. Those items go as parts of their query tiles instead, each part a work item
// of its own (fa3_bwd_items.h), whose fp32 dK / dV the last part to finish sums and stores
// (fa3_bwd_epilogue.h: add_split_part). The parts: k from 2 to kBwdSplitMaxParts minimising
// the last wave's time, ceil(R k / SMs) / k of an item's (R the last wave's items), each with
// kBwdSplitMinSteps steps or more (heads_per_kv x its share of the q_tiles query tiles, the
// part's cut), so that their fixed cost (K / V in, the pipeline's fill, the fp32 adds) stays
// small beside their steps. Harness, H200, 16k tokens: 128 +0.3..+2.3% at 4k, +1.7..+2.1% at
// 16k, level at 1k / 2k; 64 +0.8..+3.0% from 2k; 256 +1.1..+2.0% from 8k (docs/fa3_decisions.md).
// The parts' fp32 adds come in any order, so a split item's dK / dV may differ in the last bit
// from run to run (as dQ's does in default mode). 0: no split. forced > 0
// (Tuning::fa3_bwd_split): that many parts (at most one a query tile), the last wave being all
// items when it is a full one.
constexpr int kBwdSplitMaxParts = 8, kBwdSplitMinSteps = 8;
inline int bwd_split_parts(int64_t items, int sms, int heads_per_kv, int64_t q_tiles, int forced,
                           int64_t& split) {
  split = items % sms;
  if (forced > 0) {
    if (split == 0) split = std::min<int64_t>(items, sms);
    return int(std::min<int64_t>(forced, q_tiles));
  }
  if (split == 0) return 0;  // no partial wave
  int best = 0;
  double best_time = 1.0;  // unsplit: one item's time
  for (int k = 2; k <= kBwdSplitMaxParts && heads_per_kv * (q_tiles / k) >= kBwdSplitMinSteps;
       ++k) {
    const double time = double(plan_detail::ceil_div(split * k, int64_t(sms))) / k;
    if (time < best_time - 1e-9) best = k, best_time = time;
  }
  return best;
}

inline BwdPlan plan_bwd(const BwdParams& p, int kernel_hdim, const Tuning& tuning = {}) {
  using plan_detail::ceil_div;
  const int block_m = bwd_block_m(kernel_hdim, bwd_plain(p));
  const int64_t rows_pad = ceil_div(p.seqlen_q, block_m) * block_m;  // per (batch, head)
  const int64_t rows = int64_t(p.batch) * p.heads * rows_pad;
  const int64_t key_tiles = ceil_div(p.seqlen_k, bwd_block_n(kernel_hdim));
  BwdPlan plan;
  plan.block_m = block_m;
  // Per row: the accumulator (fp32, or deterministic mode's fixed point in int32), lse, D and,
  // deterministic, the row's dQ scale.
  plan.workspace_bytes = rows * (kernel_hdim + (p.deterministic ? 3 : 2)) * 4 + kBwdCounterBytes;
  if (p.deterministic) {
    plan.workspace_bytes += bwd_kv_bound_bytes(int64_t(p.batch) * p.heads_k);
  }
  const int64_t items = key_tiles * p.heads_k * p.batch;
  plan.items = int(std::min<int64_t>(items, INT_MAX));  // plan_error: past INT_MAX
  // Persistent: the next item's K / V and first Q load under this one's last steps and
  // dK / dV stores.
  plan.persistent = bwd_persistent(kernel_hdim);
  plan.ctas = plan.persistent ? std::min(plan.items, std::max(p.num_sms, 1)) : plan.items;
  // The split (bwd_split_parts): persistent default-mode calls of dense full attention, whose
  // items all walk the same query tiles (deterministic mode: the parts' fp32 adds of dK / dV
  // come in any order).
  const bool dense = p.cu_seqlens_q == nullptr && p.cu_seqlens_k == nullptr &&
                     p.seqused_q == nullptr && p.seqused_k == nullptr;
  if (plan.persistent && !p.deterministic && !p.causal && p.window_left < 0 &&
      p.window_right < 0 && dense && tuning.fa3_bwd_split != 0) {
    int64_t split = 0;
    const int parts = bwd_split_parts(items, std::max(p.num_sms, 1), p.heads / p.heads_k,
                                      ceil_div(p.seqlen_q, block_m), tuning.fa3_bwd_split, split);
    if (parts >= 2) {
      plan.split_items = int(split);
      plan.split_parts = parts;
      plan.items = int(std::min<int64_t>(items + split * (parts - 1), INT_MAX));
      plan.ctas = std::min(plan.items, std::max(p.num_sms, 1));
      // Each split item's fp32 dK / dV (kBlockN x head dim each) and its parts' counter, zeroed
      // with the dQ accumulator (fa3_bwd_launch.cuh: bwd_scratch).
      plan.workspace_bytes += bwd_split_bytes(split, kernel_hdim);
    }
  }
  const int64_t pairs = int64_t(p.heads_k) * p.batch;
  // The accumulator zeroed by the main kernel where it runs (bwd_zero_chunks).
  if (plan.ctas > 0 && tuning.fa3_bwd_zero != 0) {
    const int64_t pair_bytes = int64_t(p.heads / p.heads_k) * rows_pad * kernel_hdim * 4;
    plan.zero_chunks = bwd_zero_chunks(
        pair_bytes, pairs,
        tuning.fa3_bwd_zero > 0 ? int64_t(tuning.fa3_bwd_zero) << 10 : kBwdZeroChunkBytes);
    if (plan.zero_chunks > 0) plan.workspace_bytes += bwd_zero_counter_bytes(pairs);
  }
  // Causal items differ in length (key tile n walks the query tiles from about n kBlockN /
  // kBlockM on), longest first within a pair. Taken pair by pair (the CTAs running at once
  // then share a few pairs' Q and dO in L2), the last pairs' long items would start when the
  // other CTAs are nearly done; so the last pairs, kBwdTailItems items an SM, go key tile by
  // key tile over all of them, and the last items taken are short ones (fa3_bwd_items.h).
  if (p.causal && p.window_left < 0) {
    plan.tail_pairs = int(std::clamp<int64_t>(
        ceil_div(int64_t(kBwdTailItems) * std::max(p.num_sms, 1), key_tiles), 1, pairs));
  }
  return plan;
}

// Why this plan cannot run (the kernel's 32-bit item indices), nullptr if it can.
inline const char* plan_error(const BwdPlan& plan) {
  // A persistent CTA's next() counts past the last item by up to its grid.
  const int64_t last = int64_t(plan.items) + (plan.persistent ? plan.ctas : 0);
  return last >= INT_MAX
             ? "2^31 - 1 or more (key tile, KV head, batch) work items"
             : nullptr;
}

}  // namespace flash::fa3
