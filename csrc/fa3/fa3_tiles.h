// FA3 forward tile per head dim: key-tile width, K/V ring depth, consumer schedule and the
// number of consumer warpgroups (64 query rows each, kBlockM = 64 x consumers) beside the
// producer warpgroup.
//
// Limits (H100 / H200: 227 KB of shared memory per block; registers per consumer thread after
// setmaxnreg: 240 with two consumers, 160 with three):
//   shared memory = Q (kBlockM x hdim, twice where it fits: FwdTraits::kQBufs) + kStages x
//   (K + V) (kBlockN x hdim each), 16-bit
//   registers per consumer thread ~ O (hdim / 2) + S (kBlockN / 2) + P (kBlockN / 4) + ~30
// kBlockN is a multiple of 16 (the k-step of P V). Widths that are not a power of two need
// CuTe's extended WGMMA shapes (-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, setup.py), without
// which N = 80 / 112 ran as N = 16 instructions (hdim 256: 480 -> 695 TFLOP/s at 4k with them).
//
// Tiles and schedules are the fastest measured (H100, csrc/tools/fa3_harness.cu, bf16, full and
// causal; fa3_notes.md, sessions 10-13):
// - hdim 64 / 96 / 128: three consumers (kBlockM 192), kBlockN 128 serial. Over the best
//   two-consumer tile (kBlockN 192 at hdim 64, 128 above), at query lengths that fill 192-row
//   tiles: hdim 64 full +12..+20% (512-16k), causal +4.5..+10% from 2k; hdim 96 full +14% at
//   4k / 16k, causal +13% at 16k; hdim 128 full +9% (2k) / +11% (4k) / +4.5% (16k), causal
//   +4% (2k) / +8.5% (16k) (session 13). Where 192 rows pad the query length much more than 128 do
//   (256 x 8k: -18..-22% before idle consumers skipped their GEMMs, session 15), the call runs
//   the two-consumer tile instead (Narrow; narrow_pays below), and so do calls whose narrow
//   items fill the GPU where the wide ones leave SMs idle (up to 2 x SMs of them).
//   hdim 64, three consumers: 160 serial -2..+4% at 4k / 16k but -11% at 1k, overlap -26%;
//   192 spills in 160 registers. Three K / V stages, the only wide tile with room for them
//   (144 KB): the same as two from 2k, +5% / +2% at causal 512 / 1k, where items have 3-5 key
//   tiles and the first costs ~1000 cycles more than the others (trace; that it waits for a
//   free stage is a guess, session 16). Two consumers: overlap and ping-pong
//   lose 13-18% at every width, not understood yet. hdim 96 / 128, three consumers: kBlockN 80
//   / 96 / 112 below 128 on most cells (up to -12%).
// - hdim 192 / 256: two consumers (the O accumulator alone is 96 / 128 registers), overlap,
//   widest two-stage tile. Over serial: hdim 256 +6..+10%, hdim 192 +1..+4%; ping-pong is
//   between the two. hdim 256 full attention in clusters of two CTAs: +3.2% at 2k, +2.7% at 4k,
//   +0.8% at 1k, +2.5% at 16k (harness, H100, bf16, session 17): a 128 x 80 tile does 128 FLOP
//   per byte of K / V, 7.7 TB/s from L2 at peak, and the consumers waited for K / V (ncu).
//   hdim 192 and the three-consumer tiles (192 FLOP per byte) have not been measured with it.
//   hdim 256 kBlockN 64 (the only other two-stage width; no padded last key tile at 1k-4k)
//   against 80, harness, H200 (session 20): full -2.5..-3% at 1k-4k, -4..-7% at 16k (one-CTA
//   and clusters); causal +6.7% at 512, +1.5% at 1k, -0.8% at 2k, -1.7% at 4k.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "fa3/fa3_fwd_kernel.cuh"

namespace flash::fa3 {

template <int kHeadDim>
struct FwdTile;

template <int kBlockN_, int kStages_, Schedule kSchedule_, int kConsumers_ = 2>
struct Tile {
  static constexpr int kBlockN = kBlockN_, kStages = kStages_;
  static constexpr Schedule kSchedule = kSchedule_;
  static constexpr int kConsumers = kConsumers_;
  using Narrow = void;  // no second tile
  static constexpr int kWideGainPct = 0;
  static constexpr bool kWideScoreMod = true;
  static constexpr int kClusterM = 1;  // CTAs per cluster for full attention (below)
  using StreamK = void;  // no stream-K kernel (below)
};

// A head dim's tiles with a stream-K kernel on tile SplitTile (one CTA, no cluster), for
// full-attention calls with few items: fa3.h's stream_k_tile states its sizes (the launcher
// checks them) and stream_k_workers where it runs.
template <typename Tile, typename SplitTile>
struct WithStreamK : Tile {
  using StreamK = SplitTile;
};

// A tile whose full-attention calls (no causal mask, no window, no score mod) run in clusters
// of kClusterM CTAs that multicast K / V (fa3_fwd_kernel.cuh): each L2 read of K / V then
// feeds kClusterM CTAs. Only where the items are long and fill the GPU (cluster_pays below).
template <typename Tile, int kClusterM_>
struct WithCluster : Tile {
  static constexpr int kClusterM = kClusterM_;
};

// Whether a full-attention call runs Tile's clusters. hdim 256, harness, bf16, one-CTA kernel
// against clusters of two (session 18, H200): seqlen 512 525 / 500, 768 600 / 566, 1k 638 /
// 632, 1.5k 646 / 633, 2k 704 / 713 TFLOP/s; 512 queries x 4k keys (64 items, fewer than the
// SMs) 373 / 365. (H100, session 17: 2k +3.3%, 1k +0.8%; the benchmark's full 512 fell from
// 0.93 to 0.89x cuDNN with clusters.) The multicast halves the K / V reads, which pays where
// the K / V stream is the limit, in long items; why short ones lose was not measured (the
// clusters take items at a static stride and run their pairs in lock step: candidates).
// FLASH_ATTN_FA3_CLUSTER=1 runs the clusters wherever the tile has them (full attention, no
// score mod), 0 never, unset the rule above; read at every call, for A/B runs and for the
// tests that cover the cluster kernel on small shapes.
inline bool cluster_pays(const FwdParams& p, int64_t items) {
  const char* env = std::getenv("FLASH_ATTN_FA3_CLUSTER");
  if (env != nullptr && *env != '\0') return std::atoi(env) != 0;
  return p.seqlen_k >= 2048 && items >= 2 * int64_t(p.num_sms);
}

// A wide tile (three consumers) with a narrow one (two) for the query lengths the wide tile
// would pad too much. kWideGainPct: the wide tile's speed over the narrow one's on query
// lengths both fill, in percent (the harness's long-sequence ratio, rounded down).
// kWideScoreMod: whether softcap / ALiBi calls may run the wide tile (at hdim 128 its score-mod
// kernel spills in 160 registers, so they run the narrow one).
template <typename Wide, typename Narrow_, int kWideGainPct_, bool kWideScoreMod_ = true>
struct WithNarrow : Wide {
  using Narrow = Narrow_;
  static constexpr int kWideGainPct = kWideGainPct_;
  static constexpr bool kWideScoreMod = kWideScoreMod_;
};

// Wide tile (three consumers), narrow tile (two), the wide tile's gain. Per consumer thread,
// O + S + P registers: hdim 64 32+64+32, 96 48+64+32, 128 64+64+32 (wide); 192 96+56+28,
// 256 128+40+20. Shared memory (wide, Q double-buffered up to hdim 128): 144 (three stages),
// 168, 224, 216, 224 KB.
template <> struct FwdTile<64>
    : WithStreamK<WithNarrow<Tile<128, 3, Schedule::kSerial, 3>, Tile<192, 2, Schedule::kSerial>,
                             115>,
                  Tile<192, 2, Schedule::kSerial>> {};
template <> struct FwdTile<96>
    : WithStreamK<WithNarrow<Tile<128, 2, Schedule::kSerial, 3>, Tile<128, 2, Schedule::kSerial>,
                             110>,
                  Tile<128, 2, Schedule::kSerial>> {};
template <> struct FwdTile<128>
    : WithStreamK<WithNarrow<Tile<128, 2, Schedule::kSerial, 3>, Tile<128, 2, Schedule::kSerial>,
                             108, /*kWideScoreMod=*/false>,
                  Tile<128, 2, Schedule::kSerial>> {};
template <> struct FwdTile<192>
    : WithStreamK<Tile<112, 2, Schedule::kOverlap>, Tile<112, 2, Schedule::kOverlap>> {};
template <> struct FwdTile<256>
    : WithStreamK<WithCluster<Tile<80, 2, Schedule::kOverlap>, 2>,
                  Tile<80, 2, Schedule::kOverlap>> {};

// Whether a call with seqlen_q query rows is faster on Tile's narrow tile (Tile has one),
// counting consumer warpgroups per (batch, head): a consumer whose 64 rows all lie past
// seqlen_q skips its GEMMs (fa3_fwd_kernel.cuh), so padding costs only where it leaves a tile
// with a lone busy consumer, which has no other warpgroup to run its softmax under and is
// counted as two. Weighed by the wide tile's speed. hdim 128: 193-256 and 577-640 rows go
// narrow (256: 3 + 2 consumers wide against 2 + 2 narrow x 1.08); 512 and 1k wide (harness,
// H100, session 15: +1.4 / +4.6% full, +1.6 / +8.4% causal), where, before consumers skipped,
// they went narrow.
template <typename Tile>
bool narrow_pads_less(int64_t seqlen_q) {
  static_assert(!std::is_void_v<typename Tile::Narrow>);
  auto consumers = [&](int64_t per_tile) {
    const int64_t rows = 64 * per_tile, rest = (seqlen_q % rows + 63) / 64;
    return seqlen_q / rows * per_tile + (rest == 0 ? 0 : rest < 2 ? 2 : rest);
  };
  return consumers(Tile::Narrow::kConsumers) * Tile::kWideGainPct <
         consumers(Tile::kConsumers) * 100;
}

// Whether the narrow tile's (query tile, head, batch) items fill the GPU where the wide tile's
// leave SMs idle: at most two narrow items per SM. Harness, bf16, wide / narrow TFLOP/s
// (fa3_notes.md, session 21; H200 at hdim 64 / 128, H100 at 96): full attention, every one of
// 30 shapes fits the rule: up to 2 x SMs narrow items the narrow tile wins by 3-26% (hdim 128
// 1 x 2k x 8 heads 422 / 518, 1 x 4k x 8 493 / 610, 2 x 1k x 16 402 / 486), above it loses
// by 4-10% (1 x 4k x 16 657 / 623, 1 x 2k x 32 615 / 588). Causal: the same while seqlen_k
// <= 2k (hdim 128 1 x 2k x 8 228 / 257, 2 x 1k x 16 295 / 335; hdim 96 +2.6..+13%), except
// hdim 64 1 x 2k x 16 (265 / 259); at 4k the wide tile wins with the same items (452 / 415).
// Windows (not measured) keep the padding rule.
inline bool narrow_fills(const FwdParams& p, int64_t narrow_items) {
  const bool full = !p.causal && p.window_left < 0 && p.window_right < 0;
  const bool causal = p.causal && p.window_left < 0;
  return narrow_items <= 2 * int64_t(p.num_sms) && (full || (causal && p.seqlen_k <= 2048));
}

// The choice between Tile's wide and narrow tiles: narrow where it pads the query length less
// or where its items fill the GPU. FLASH_ATTN_FA3_NARROW=1 runs the narrow tile on every call of
// a head dim that has one, 0 only where the wide tile pads more (the tests use it to keep the
// wide tile covered on small shapes); read at every call.
template <typename Tile>
bool narrow_pays(const FwdParams& p) {
  const char* env = std::getenv("FLASH_ATTN_FA3_NARROW");
  const bool forced = env != nullptr && *env != '\0';
  if (forced && std::atoi(env) != 0) return true;
  if (narrow_pads_less<Tile>(p.seqlen_q)) return true;
  if (forced) return false;
  const int64_t rows = 64 * Tile::Narrow::kConsumers;
  return narrow_fills(p, (p.seqlen_q + rows - 1) / rows * p.heads * p.batch);
}

}  // namespace flash::fa3
