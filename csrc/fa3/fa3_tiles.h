// FA3 forward tile per head dim: key-tile width, K/V ring depth, consumer schedule and the
// number of consumer warpgroups (64 query rows each, kBlockM = 64 x consumers) beside the
// producer warpgroup.
//
// Limits (H100 / H200: 227 KB of shared memory per block; registers per consumer thread after
// setmaxnreg: 240 with two consumers, 160 with three):
//   shared memory = Q (kBlockM x hdim) + kStages x (K + V) (kBlockN x hdim each), 16-bit
//   registers per consumer thread ~ O (hdim / 2) + S (kBlockN / 2) + P (kBlockN / 4) + ~30
// kBlockN is a multiple of 16 (the k-step of P V). Widths that are not a power of two need
// CuTe's extended WGMMA shapes (-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, setup.py), without
// which N = 80 / 112 ran as N = 16 instructions (hdim 256: 480 -> 695 TFLOP/s at 4k with them).
//
// Tiles and schedules are the fastest measured (H100, csrc/tools/fa3_harness.cu, bf16, 4k and
// 16k, full and causal; fa3_notes.md, sessions 10-11):
// - hdim 64: three consumers (kBlockM 192), kBlockN 128 serial. Over two consumers with
//   kBlockN 192 (the best two-consumer tile): full +13% at 1k / 4k, +16% at 16k, causal +5% at
//   4k, -2% at 1k (session 13). With three: 160 serial within +-1% at 4k / 16k but -11% at 1k,
//   3 stages the same as 2, overlap -26%. 192 spills in 160 registers. Overlap and ping-pong
//   also lose 13-18% with two consumers, at every width, not understood yet.
// - hdim 128: kBlockN 128 serial. Overlap / ping-pong are within -4..+1% of it, kBlockN 176
//   -3..+1% (its overlap and ping-pong spill), 3 stages +-1%.
// - hdim 192 / 256: overlap, widest two-stage tile. Over serial: hdim 256 +6..+10%, hdim 192
//   +1..+4%; ping-pong is between the two.
// - hdim 96: three consumers, kBlockN 128 serial. Over two consumers with 128: full +6% at 1k,
//   +15% at 4k, +14% at 16k; causal -8% at 1k, +2% at 4k, +13% at 16k (session 13). kBlockN 96
//   / 112 with three consumers 1-5% below 128; 176 with two below them all.
#pragma once

#include "fa3/fa3_fwd_kernel.cuh"

namespace flash::fa3 {

template <int kHeadDim>
struct FwdTile;

template <int kBlockN_, int kStages_, Schedule kSchedule_, int kConsumers_ = 2>
struct Tile {
  static constexpr int kBlockN = kBlockN_, kStages = kStages_;
  static constexpr Schedule kSchedule = kSchedule_;
  static constexpr int kConsumers = kConsumers_;
};

//                                      kBlockN kStages              consumers  smem (KB)  O+S+P regs
template <> struct FwdTile<64>  : Tile<128, 2, Schedule::kSerial, 3> {};   // 88   32+64+32
template <> struct FwdTile<96>  : Tile<128, 2, Schedule::kSerial, 3> {};   // 132  48+64+32
template <> struct FwdTile<128> : Tile<128, 2, Schedule::kSerial> {};      // 160  64+64+32
template <> struct FwdTile<192> : Tile<112, 2, Schedule::kOverlap> {};     // 216  96+56+28
template <> struct FwdTile<256> : Tile<80, 2, Schedule::kOverlap> {};      // 224 128+40+20

}  // namespace flash::fa3
