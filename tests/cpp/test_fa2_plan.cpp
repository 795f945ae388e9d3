// The FA2 per-call plans (csrc/fa2/fa2.h) on the CPU: for forward calls over a KV cache, which
// kernel runs (the decode kernel or the forward's), how many key splits, how much workspace; for
// the backward, where programmatic launch is used.
// Built and run by tests/test_plans.py. Exit status 0: every check passed.
#include <cstdio>

#include "fa2/fa2.h"
#include "check.h"

using flash::BwdParams;
using flash::FwdParams;
using flash::Tuning;
using namespace flash::fa2;

// One decode step over a KV cache of `cached` positions on an H100 / H200 (sm90, 132 SMs).
static FwdParams decode(int batch, int seqlen_q, int heads, int heads_k, int cached) {
  FwdParams p;
  p.batch = batch, p.seqlen_q = seqlen_q, p.seqlen_k = cached;
  p.heads = heads, p.heads_k = heads_k, p.head_dim = 128;
  p.kv_cache = true, p.num_sms = 132, p.arch = p.code_arch = 90;
  return p;
}

int main() {
  // Which kernel: the decode kernel while seqlen_q * heads / heads_k is at most 64 rows (in
  // groups of 16, one block each).
  CHECK(plan_fwd(decode(4, 1, 32, 8, 8192), 128).decode);
  CHECK(plan_fwd(decode(4, 4, 32, 8, 8192), 128).decode);   // 16 rows
  CHECK(plan_fwd(decode(4, 5, 16, 4, 8192), 128).decode);   // 20 rows: two groups
  CHECK(plan_fwd(decode(4, 8, 64, 8, 8192), 128).decode);   // 64 rows
  CHECK(!plan_fwd(decode(4, 9, 64, 8, 8192), 128).decode);  // 72 rows: the forward's kernel
  CHECK(!plan_fwd(decode(4, 1, 128, 1, 8192), 128).decode);  // MQA with 128 heads
  {
    FwdParams p = decode(4, 1, 32, 8, 8192);
    Tuning off;
    off.fa2_decode = 0;
    CHECK(!plan_fwd(p, 128, off).decode);
    p.kv_cache = false;  // a dense or variable-length call never takes it
    CHECK(!plan_fwd(p, 128).decode);
  }
  // Programmatic launch of the decode kernel and its combine: sm90 decode calls right after
  // kvcache_prep, unless fa2_pdl = 0; never the forward's kernel, never on other GPUs.
  {
    FwdParams p = decode(4, 1, 32, 8, 8192);
    CHECK(!plan_fwd(p, 128).pdl);  // no append or rotary: an unknown kernel ahead
    p.after_prep = true;
    CHECK(plan_fwd(p, 128).pdl);
    Tuning off;
    off.fa2_pdl = 0;
    CHECK(!plan_fwd(p, 128, off).pdl);
    off = Tuning{};
    off.fa2_decode = 0;
    CHECK(!plan_fwd(p, 128, off).pdl);
    // Never where the code that runs is not sm90's: an H100 running a build's compute_80 PTX,
    // an sm100 (the default build's PTX), an A100.
    p.code_arch = 80;
    CHECK(!plan_fwd(p, 128).pdl);
    p.arch = 100;
    CHECK(!plan_fwd(p, 128).pdl);
    p.arch = 80;
    CHECK(!plan_fwd(p, 128).pdl);
  }

  // Splits (hdim 128: 4 blocks of 56.6 KB fit per SM, 528 slots): as many as one wave holds,
  // or where that is more than 8, as many as 2 blocks per SM (264 slots) hold; each with 4 key
  // tiles of 32 or more, never more blocks than slots.
  CHECK(plan_fwd(decode(1, 1, 32, 8, 8192), 128).num_splits == 33);    // 264 / 8 items
  CHECK(plan_fwd(decode(1, 1, 32, 8, 2048), 128).num_splits == 16);    // 64 tiles / 4
  CHECK(plan_fwd(decode(1, 1, 32, 8, 131072), 128).num_splits == 33);
  CHECK(plan_fwd(decode(2, 1, 32, 8, 8192), 128).num_splits == 16);    // 264 / 16
  CHECK(plan_fwd(decode(4, 1, 32, 8, 8192), 128).num_splits == 8);     // 264 / 32 (wave: 16)
  CHECK(plan_fwd(decode(8, 1, 32, 8, 8192), 128).num_splits == 8);     // 528 / 64: a wave
  CHECK(plan_fwd(decode(16, 1, 32, 8, 8192), 128).num_splits == 4);    // 512 blocks
  CHECK(plan_fwd(decode(32, 1, 32, 8, 8192), 128).num_splits == 2);    // 512 blocks
  CHECK(plan_fwd(decode(128, 1, 32, 8, 8192), 128).num_splits == 1);   // 1024 items
  CHECK(plan_fwd(decode(1, 1, 32, 8, 100), 128).num_splits == 1);      // 4 tiles
  CHECK(plan_fwd(decode(8, 8, 32, 8, 8192), 128).num_splits == 4);     // 2 groups: 512 blocks
  {  // Pages that cut a 32-key tile: 3 blocks per SM (396 slots); pages of whole tiles: 2.
    FwdParams p = decode(1, 1, 32, 8, 8192);
    static const int table[1] = {0};
    p.block_table = table;
    p.page_size = 16;
    CHECK(plan_fwd(p, 128).num_splits == 49);  // 396 / 8 items
    p.batch = 4;
    CHECK(plan_fwd(p, 128).num_splits == 12);
    p.batch = 8;
    CHECK(plan_fwd(p, 128).num_splits == 8);   // a wave
    p.batch = 1, p.page_size = 8;
    CHECK(plan_fwd(p, 128).num_splits == 49);
    p.page_size = 64;
    CHECK(plan_fwd(p, 128).num_splits == 33);
  }
  {  // One block per SM where shared memory holds one (sm86: 100 KB).
    FwdParams p = decode(1, 1, 32, 8, 131072);
    p.arch = 86;
    CHECK(plan_fwd(p, 128).num_splits == 16);  // 132 / 8 items
  }
  for (int batch : {1, 2, 3, 5, 8, 13, 32, 60, 66}) {
    const int splits = plan_fwd(decode(batch, 1, 32, 8, 65536), 128).num_splits;
    CHECK(splits >= 1 && (splits == 1 || int64_t(batch) * 8 * splits <= 528));
    CHECK(splits <= 8 || int64_t(batch) * 8 * splits <= 264);
  }
  // The call's num_splits, clamped to 128 and to the cache's key tiles.
  {
    FwdParams p = decode(2, 1, 32, 8, 8192);
    p.splits_requested = 3;
    CHECK(plan_fwd(p, 128).num_splits == 3);
    p.splits_requested = 1000;
    CHECK(plan_fwd(p, 128).num_splits == 128);
    p.seqlen_k = 40;  // two tiles
    CHECK(plan_fwd(p, 128).num_splits == 2);
  }
  // Workspace: fp32 O and one lse per (split, batch, head, query row); none without splits.
  {
    const FwdParams p = decode(8, 1, 32, 8, 8192);
    const FwdPlan plan = plan_fwd(p, 128);
    CHECK(plan.workspace_bytes == int64_t(plan.num_splits) * 8 * 32 * 1 * (128 + 1) * 4);
    // An odd number of rows: the O part still starts 16 bytes in.
    FwdParams odd = decode(1, 1, 1, 1, 8192);
    odd.splits_requested = 3;
    CHECK(plan_fwd(odd, 128).workspace_bytes == (4 + 3 * 128) * 4);
    CHECK(plan_fwd(decode(128, 1, 32, 8, 8192), 128).workspace_bytes == 0);
  }

  // The backward's programmatic launch and bulk dQ: sm90 code only (elsewhere the kernels'
  // waits and bulk reductions are compiled out of the PTX they run), PDL off with fa2_pdl = 0.
  {
    BwdParams p;
    p.batch = 2, p.heads = 8, p.heads_k = 8, p.seqlen_q = p.seqlen_k = 1024, p.head_dim = 128;
    p.arch = p.code_arch = 90;
    CHECK(plan_bwd(p, 128).pdl && plan_bwd(p, 128).dq_bulk);
    Tuning off;
    off.fa2_pdl = 0;
    CHECK(!plan_bwd(p, 128, off).pdl);
    p.code_arch = 80;  // an H100 running compute_80 PTX: no sm90 instructions in the kernels
    CHECK(!plan_bwd(p, 128).pdl && !plan_bwd(p, 128).dq_bulk);
    p.arch = 100;
    CHECK(!plan_bwd(p, 128).pdl);
    p.arch = 80;
    CHECK(!plan_bwd(p, 128).pdl);
  }

  return check_status("fa2 plan");
}
