// The FA3 forward's per-call plan (csrc/fa3/fa3_plan.h) on the CPU: which kernel a call runs, on
// how many CTAs, with how much workspace; and the backward's workspace and dQ accumulators. Built and run by tests/test_plans.py (any C++17
// compiler; the plan is pure host logic). Exit status 0: every check passed.
#include <cstdio>
#include <string>

#include "fa3/fa3_plan.h"
#include "check.h"

using flash::BwdParams;
using flash::FwdParams;
using flash::Tuning;
using namespace flash::fa3;

// A call on an H100-sized GPU (132 SMs), dense batch, full attention unless changed.
static FwdParams call(int batch, int seqlen_q, int seqlen_k, int heads, int heads_k) {
  FwdParams p;
  p.batch = batch, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.heads = heads, p.heads_k = heads_k, p.num_sms = 132;
  p.window_left = p.window_right = -1;
  return p;
}
static FwdParams causal(FwdParams p) {
  p.causal = true, p.window_right = 0;
  return p;
}

int main() {
  // FP8: one kernel whatever the call (the wide tile of kBlockN 128; never narrow, stream-K or
  // clusters), and V^T after the scheduler's counter: head_dim rows of the keys padded to 16
  // per (batch, KV head).
  for (const int hdim : {64, 128, 256}) {
    FwdParams p = call(2, 1000, 1000, 8, 2);
    p.fp8 = true, p.head_dim = hdim == 256 ? 192 : hdim;
    const FwdPlan plan = plan_fwd(p, hdim);
    CHECK(plan.kernel == FwdKernel::kWide && plan.tile.block_n == 128 && plan.cluster_m == 1);
    CHECK(plan.tile.consumers == (hdim == 256 ? 2 : 3));
    CHECK(plan.vt_keys == 1008 && plan.vt_offset == 1024);
    CHECK(plan.workspace_bytes == 1024 + 2 * 2 * p.head_dim * 1008);
    CHECK(plan.zero_bytes == 4 && plan.zero_bytes <= plan.vt_offset);
    FwdParams few = call(1, 16384, 16384, 1, 1);  // stream-K and clusters' calls in 16 bits
    few.fp8 = true, few.head_dim = hdim;
    CHECK(plan_fwd(few, hdim).kernel == FwdKernel::kWide);
  }
  CHECK(fp8_vt_keys(0) == 0 && fp8_vt_keys(1) == 16 && fp8_vt_keys(32) == 32);
  // hdim 128, the benchmark's 2k (8 x 2k x 16 heads): 1408 items of 192 rows fill the GPU
  // five times over and 2048 rows pad no more on the wide tile: the wide tile, one CTA per SM.
  {
    const FwdPlan plan = plan_fwd(call(8, 2048, 2048, 16, 16), 128);
    CHECK(plan.kernel == FwdKernel::kWide && plan.tile.consumers == 3 && !plan.score_mod);
    CHECK(plan.items == 11 * 8 * 16 && plan.ctas == 132 && plan.workspace_bytes == 4);
    CHECK(plan.zero_bytes == 4 && plan_error(plan) == nullptr);
  }
  // 256 rows pad a 192-row tile to a lone busy consumer: the narrow tile; 512 stays wide once
  // the items fill the GPU twice.
  CHECK(plan_fwd(call(16, 256, 256, 64, 64), 128).kernel == FwdKernel::kNarrow);
  CHECK(plan_fwd(call(16, 512, 512, 64, 64), 128).kernel == FwdKernel::kWide);
  // Few items: the narrow tile's fill the GPU where the wide tile's leave SMs idle (full, or
  // causal up to 2k keys); causal at 4k stays wide.
  CHECK(plan_fwd(call(1, 2048, 2048, 8, 8), 128).kernel == FwdKernel::kNarrow);
  CHECK(plan_fwd(causal(call(1, 2048, 2048, 8, 8)), 128).kernel == FwdKernel::kNarrow);
  CHECK(plan_fwd(causal(call(1, 4096, 4096, 16, 16)), 128).kernel == FwdKernel::kWide);
  // Overrides: narrow everywhere, or only where it pads less.
  {
    Tuning t;
    t.fa3_narrow = 1;
    CHECK(plan_fwd(call(8, 2048, 2048, 16, 16), 128, t).kernel == FwdKernel::kNarrow);
    t.fa3_narrow = 0;
    CHECK(plan_fwd(call(1, 2048, 2048, 8, 8), 128, t).kernel == FwdKernel::kWide);
    CHECK(plan_fwd(call(16, 256, 256, 64, 64), 128, t).kernel == FwdKernel::kNarrow);
  }
  // Score mods: hdim 128's wide score-mod kernel spills, so softcap runs the narrow tile; no
  // stream-K or cluster kernel has them.
  {
    FwdParams p = call(8, 2048, 2048, 16, 16);
    p.softcap = 30.f;
    const FwdPlan plan = plan_fwd(p, 128);
    CHECK(plan.kernel == FwdKernel::kNarrow && plan.score_mod);
    FwdParams decode = call(1, 1, 4096, 16, 4);
    decode.softcap = 30.f;
    CHECK(plan_fwd(decode, 256).kernel == FwdKernel::kWide);
  }
  // A decode step at hdim 256 (16 items x 52 key tiles): stream-K on 128 workers, every item
  // cut (the lattice is empty), with the workspace of its published pieces.
  {
    const FwdPlan plan = plan_fwd(call(1, 1, 4096, 16, 4), 256);
    CHECK(plan.kernel == FwdKernel::kStreamK && plan.tile.block_n == 80);
    CHECK(plan.items == 16 && plan.key_tiles == 52 && plan.workers == 128 && plan.ctas == 128);
    CHECK(plan.lattice == 0);
    const StreamKLayout layout{128, 2, 256};
    CHECK(plan.workspace_bytes == layout.bytes() && plan.zero_bytes == layout.ints() * 4);
    CHECK(layout.ints() % 64 == 0 && layout.flag_offset() == 64 + 2 * 128);
    Tuning off;
    off.fa3_stream_k = 0;
    CHECK(plan_fwd(call(1, 1, 4096, 16, 4), 256, off).kernel == FwdKernel::kWide);
    Tuning workers;
    workers.fa3_ctas = 40;
    const FwdPlan forced = plan_fwd(call(1, 1, 4096, 16, 4), 256, workers);
    CHECK(forced.workers == 40 && forced.ctas == 40 && forced.lattice == 0);
  }
  // A decode step with short keys (12 items x 10 key tiles): pieces would have fewer than six
  // key tiles, so no stream-K; forced, it runs on at least one worker.
  {
    CHECK(plan_fwd(call(1, 1, 777, 12, 4), 256).kernel == FwdKernel::kWide);
    Tuning on;
    on.fa3_stream_k = 1;
    const FwdPlan plan = plan_fwd(call(1, 1, 777, 12, 4), 256, on);
    CHECK(plan.kernel == FwdKernel::kStreamK && plan.workers >= 1);
  }
  // Causal or windowed calls never run stream-K or clusters.
  CHECK(plan_fwd(causal(call(1, 1, 4096, 16, 4)), 256).kernel == FwdKernel::kWide);
  // hdim 256 full attention from 2k keys with two items per SM: clusters of two, as many
  // CTAs as SMs (the launcher may cap them at the clusters that run at once).
  {
    const FwdPlan plan = plan_fwd(call(4, 4096, 4096, 8, 8), 256);
    CHECK(plan.kernel == FwdKernel::kCluster && plan.cluster_m == 2);
    CHECK(plan.items == 16 * 4 * 8 && plan.ctas == 132);
    CHECK(plan_fwd(causal(call(4, 4096, 4096, 8, 8)), 256).kernel == FwdKernel::kWide);
    CHECK(plan_fwd(call(4, 1024, 1024, 8, 8), 256).kernel == FwdKernel::kWide);
    Tuning t;
    t.fa3_cluster = 1;
    t.fa3_stream_k = 0;
    CHECK(plan_fwd(call(2, 300, 200, 4, 2), 256, t).kernel == FwdKernel::kCluster);
    t.fa3_cluster = 0;
    CHECK(plan_fwd(call(4, 4096, 4096, 8, 8), 256, t).kernel == FwdKernel::kWide);
  }
  // A KV cache (seqlen_k: the capacity; each sequence its own length) is planned as a
  // variable-length batch: neither stream-K nor clusters, even where forced.
  {
    FwdParams p = call(4, 4096, 4096, 8, 8);
    p.kv_cache = true;
    CHECK(plan_fwd(p, 256).kernel == FwdKernel::kWide);
    FwdParams few = call(1, 1, 777, 12, 4);
    few.kv_cache = true;
    Tuning on;
    on.fa3_stream_k = 1;
    on.fa3_cluster = 1;
    CHECK(plan_fwd(few, 256, on).kernel == FwdKernel::kWide);
    CHECK(plan_fwd(p, 256, on).kernel == FwdKernel::kWide);
  }
  // A grid of one CTA per item (the harness's A/B) and fewer items than SMs.
  {
    Tuning t;
    t.fa3_ctas = 1408;
    CHECK(plan_fwd(call(8, 2048, 2048, 16, 16), 128, t).ctas == 1408);
    CHECK(plan_fwd(causal(call(1, 300, 300, 2, 2)), 192).ctas == 6);
  }
  // Sizes past the kernels' 32-bit item indices are refused.
  {
    const FwdPlan plan = plan_fwd(causal(call(1 << 20, 1 << 20, 1 << 20, 64, 64)), 128);
    CHECK(plan_error(plan) != nullptr);
  }
  // Every head dim's table row is a tile the kernels can have.
  for (int hdim : {64, 96, 128, 192, 256}) {
    const HeadDimTiles t = fwd_tiles(hdim);
    CHECK(t.wide.exists() && t.stream_k.exists() && t.wide.block_n % 16 == 0);
    CHECK(t.wide.consumers == 2 || t.wide.consumers == 3);
    CHECK(!t.narrow.exists() || (t.narrow.consumers == 2 && t.wide_gain_pct > 100));
  }
  CHECK(!fwd_tiles(80).wide.exists());

  // The backward: dQ accumulator (fp32, rows padded to 64 per head), the item counter (16
  // bytes), the zero counters of the accumulator's chunks (4 bytes a (batch, KV head), 16-byte
  // aligned; bwd_zero_chunks), lse, D; deterministic calls (a fixed-point accumulator of the
  // same size) add the K / V bounds (8 bytes a (batch, KV head), 16-byte aligned) and a dQ
  // scale a row. A CTA an SM takes the (key tile, KV head, batch) items, in both modes; at head
  // dim 192 a CTA an item.
  {
    auto bwd = [](FwdParams f, bool deterministic) {
      BwdParams p;
      static_cast<FwdParams&>(p) = f;
      p.deterministic = deterministic;
      return p;
    };
    const int64_t rows = 2 * 6 * 1024;  // batch 2, 6 heads, 1000 rows padded to 1024
    FwdParams left = call(2, 1000, 1500, 6, 2);
    left.window_left = 200;
    Tuning no_split;
    no_split.fa3_bwd_split = 0;
    const BwdPlan plain = plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 128, no_split);
    CHECK(plain.workspace_bytes == rows * (128 + 2) * 4 + 16 + 16);
    // The accumulator zeroed by the main kernel in chunks of 8 KB: a pair (3 heads x 1024 rows
    // x 128 fp32) is 192; none (a memset) with Tuning::fa3_bwd_zero = 0, and no counters; k KB
    // chunks with fa3_bwd_zero = k.
    CHECK(plain.zero_chunks == 192);
    Tuning memset = no_split;
    memset.fa3_bwd_zero = 0;
    const BwdPlan plain_memset = plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 128, memset);
    CHECK(plain_memset.zero_chunks == 0 &&
          plain_memset.workspace_bytes == rows * (128 + 2) * 4 + 16);
    Tuning chunks32 = no_split;
    chunks32.fa3_bwd_zero = 32;
    CHECK(plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 128, chunks32).zero_chunks == 48);
    // 16k rows x 128: 8 MB a pair, 1024 chunks; a pair of 96 rows x 64 (one head) three.
    CHECK(plan_bwd(bwd(call(1, 16384, 16384, 16, 16), false), 128).zero_chunks == 1024);
    CHECK(plan_bwd(bwd(call(3, 64, 1500, 2, 2), false), 64).zero_chunks == 3);
    CHECK(plain.items == 48 && plain.split_parts == 1 && plain.split_items == 0);
    CHECK(plain.block_m == 64);
    // Plain calls at head dim 64: 96-row steps, scratch rows padded to 1056.
    const BwdPlan plain64 = plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 64, no_split);
    CHECK(plain64.block_m == 96 &&
          plain64.workspace_bytes == 2 * 6 * 1056 * (64 + 2) * 4 + 16 + 16);
    // Causal calls from kBwdPlainCausalRows query rows (the diagonal's straddled key tiles
    // cost more than the fewer steps save below); windowed ones never.
    CHECK(plan_bwd(bwd(causal(call(2, 1000, 1500, 6, 2)), false), 64).block_m == 64);
    CHECK(plan_bwd(bwd(causal(call(1, 4095, 4133, 6, 2)), true), 64).block_m == 64);
    CHECK(plan_bwd(bwd(causal(call(1, 4096, 4133, 6, 2)), false), 64).block_m == 96);
    CHECK(plan_bwd(bwd(causal(call(1, 4096, 4133, 6, 2)), true), 64).block_m == 96);
    CHECK(plan_bwd(bwd(causal(call(1, 4096, 4133, 6, 2)), false), 128).block_m == 64);
    FwdParams windowed = causal(call(1, 4096, 4133, 6, 2));
    windowed.window_left = 300;
    CHECK(plan_bwd(bwd(windowed, false), 64).block_m == 64);
    CHECK(plan_bwd(bwd(call(2, 1000, 1500, 6, 2), true), 64).block_m == 96);  // deterministic too
    CHECK(plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 96).block_m == 64);
    CHECK(plain.items == 12 * 2 * 2 && plain.ctas == plain.items);  // 1500 keys: 12 tiles
    CHECK(plain.persistent);
    const BwdPlan wide = plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 256, no_split);
    CHECK(wide.items == 24 * 2 * 2 && wide.ctas == wide.items && wide.persistent);
    CHECK(!plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 192).persistent);
    const BwdPlan many = plan_bwd(bwd(call(16, 1024, 1024, 16, 16), false), 64);
    CHECK(many.items == 8 * 16 * 16 && many.persistent && many.ctas == 132);
    CHECK(!plan_error(many));
    const BwdPlan few = plan_bwd(bwd(call(1, 1024, 1024, 4, 4), false), 64);
    CHECK(few.persistent && few.ctas == few.items && few.items == 32);
    const BwdPlan many128 = plan_bwd(bwd(call(16, 1024, 1024, 16, 16), false), 128);
    CHECK(many128.persistent && many128.ctas == 132);
    CHECK(!plan_bwd(bwd(call(16, 1024, 1024, 16, 16), false), 192).persistent);
    const BwdPlan full = plan_bwd(bwd(call(2, 1000, 1500, 6, 2), true), 128);
    CHECK(full.block_m == 64 && full.workspace_bytes == rows * (128 + 3) * 4 + 16 + 16 + 32);
    CHECK(full.split_parts == 1 && full.persistent && full.ctas == full.items);
    const BwdPlan det = plan_bwd(bwd(call(16, 1024, 1024, 16, 16), true), 64);
    CHECK(det.persistent && det.ctas == 132 && det.items == many.items);
    CHECK(!plan_bwd(bwd(call(16, 1024, 1024, 16, 16), true), 192).persistent);
    const BwdPlan masked = plan_bwd(bwd(causal(call(2, 1000, 1500, 6, 3)), true), 64);
    CHECK(masked.workspace_bytes == rows * (64 + 3) * 4 + 16 + 32 + 48);
    // Causal calls take their last pairs' items key tile by key tile, at least two items an SM
    // (264 on 132 SMs): at 128, 4k (32 key tiles) the last 9 of 64 pairs; 1k (8 tiles) 33;
    // 16k (128 tiles) 3; a call of 2 pairs all of them; at 192 / 256 (64-key tiles) 4k the
    // last 5; at 64, 4k, 9 of 128 (deterministic calls alike). Full and windowed calls none.
    CHECK(plan_bwd(bwd(causal(call(4, 4096, 4096, 16, 16)), false), 128).tail_pairs == 9);
    CHECK(plan_bwd(bwd(causal(call(16, 1024, 1024, 16, 16)), false), 128).tail_pairs == 33);
    CHECK(plan_bwd(bwd(causal(call(1, 16384, 16384, 16, 16)), false), 128).tail_pairs == 3);
    CHECK(plan_bwd(bwd(causal(call(1, 1024, 1024, 4, 2)), false), 128).tail_pairs == 2);
    CHECK(plan_bwd(bwd(causal(call(4, 4096, 4096, 16, 16)), true), 128).tail_pairs == 9);
    CHECK(plan_bwd(bwd(call(4, 4096, 4096, 16, 16), false), 128).tail_pairs == 1);
    CHECK(plan_bwd(bwd(causal(call(4, 4096, 4096, 8, 8)), false), 256).tail_pairs == 5);
    CHECK(plan_bwd(bwd(causal(call(4, 4096, 4096, 10, 10)), false), 192).tail_pairs == 5);
    CHECK(plan_bwd(bwd(causal(call(4, 4096, 4096, 32, 32)), false), 64).tail_pairs == 9);
    FwdParams sliding = causal(call(4, 4096, 4096, 16, 16));
    sliding.window_left = 512;
    CHECK(plan_bwd(bwd(sliding, false), 128).tail_pairs == 1);
    // Full attention's last partial wave split by query tiles (bwd_split_parts): k parts of
    // at least 8 steps minimising ceil(R k / 132) / k. 128 at 16k tokens: 2048 items leave
    // R = 68; 4k (64 steps) in 7 parts, 2k (32 steps) in 3, 1k (16 steps: 2 parts would not
    // shorten the wave) none. 64 at 8k: 4096 items leave 4, 8 parts (86 steps of 96 rows);
    // at 4k 5 (43 steps). The split region after the item counter: a counter a split item
    // (16-byte aligned), then its fp32 dK and dV.
    const BwdPlan split4k = plan_bwd(bwd(call(4, 4096, 4096, 16, 16), false), 128);
    CHECK(split4k.split_items == 68 && split4k.split_parts == 7);
    CHECK(split4k.items == 2048 + 68 * 6 && split4k.ctas == 132);
    CHECK(split4k.workspace_bytes ==
          4 * 16 * 4096 * (128 + 2) * 4 + 16 + 272 + int64_t(68) * 2 * 128 * 128 * 4 + 256);
    CHECK(plan_bwd(bwd(call(8, 2048, 2048, 16, 16), false), 128).split_parts == 3);
    CHECK(plan_bwd(bwd(call(16, 1024, 1024, 16, 16), false), 128).split_parts == 1);
    CHECK(plan_bwd(bwd(call(2, 8192, 8192, 32, 32), false), 64).split_parts == 8);
    CHECK(plan_bwd(bwd(call(4, 4096, 4096, 32, 32), false), 64).split_parts == 5);
    CHECK(plan_bwd(bwd(call(4, 4096, 4096, 8, 8), false), 256).split_parts == 7);
    // A call of fewer items than SMs: all of them, 48 items x 5 parts (2 a CTA, 2 / 5 of an
    // item's time). Forced parts (Tuning::fa3_bwd_split), at most one a query tile.
    const BwdPlan few_items = plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 128);
    CHECK(few_items.split_items == 48 && few_items.split_parts == 5 && few_items.items == 240);
    Tuning forced;
    forced.fa3_bwd_split = 3;
    CHECK(plan_bwd(bwd(call(2, 1000, 1500, 6, 2), false), 128, forced).split_parts == 3);
    CHECK(plan_bwd(bwd(call(16, 1024, 1024, 16, 16), false), 128, forced).split_parts == 3);
    CHECK(plan_bwd(bwd(call(16, 1024, 1024, 16, 16), false), 128, forced).split_items == 68);
    forced.fa3_bwd_split = 100;
    CHECK(plan_bwd(bwd(call(1, 64, 1500, 1, 1), false), 128, forced).split_parts == 1);
    // Parts cut the query tiles, not the heads of a group: one query tile (64 rows, GQA 64)
    // gives no parts, forced or not; 4 tiles of GQA 8 at most 4 parts of 8 steps.
    CHECK(plan_bwd(bwd(call(1, 64, 17408, 64, 1), false), 128).split_parts == 1);
    CHECK(plan_bwd(bwd(call(1, 64, 17408, 64, 1), false), 128, forced).split_parts == 1);
    CHECK(plan_bwd(bwd(call(1, 256, 17408, 64, 8), false), 128).split_parts == 4);
    // None where items differ or are not persistent: causal, windowed, deterministic, 192.
    CHECK(plan_bwd(bwd(causal(call(4, 4096, 4096, 16, 16)), false), 128).split_parts == 1);
    CHECK(plan_bwd(bwd(left, false), 128).split_parts == 1);
    CHECK(plan_bwd(bwd(call(4, 4096, 4096, 16, 16), true), 128).split_parts == 1);
    CHECK(plan_bwd(bwd(call(4, 4096, 4096, 10, 10), false), 192).split_parts == 1);
    // 2^31 items or more: refused (the kernel's item indices are 32-bit).
    CHECK(plan_error(plan_bwd(bwd(call(1 << 16, 64, 1 << 16, 256, 256), false), 128)));
    // 1.5 * 2^30 items, a CTA each: accepted (only a persistent grid counts past its items).
    CHECK(!plan_error(plan_bwd(bwd(call(1 << 16, 64, 96 * 64, 256, 256), false), 192)));
  }
  return check_status("fa3 plan");
}
