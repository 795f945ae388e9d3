// FA3 forward tile per head dim: key-tile width, K/V ring depth and consumer schedule. A CTA
// is always two consumer warpgroups of 64 query rows (kBlockM 128) plus the producer
// warpgroup.
//
// Limits (H100 / H200: 227 KB of shared memory per block, 232-240 registers per consumer
// thread after setmaxnreg):
//   shared memory = Q (128 x hdim) + kStages x (K + V) (kBlockN x hdim each), 16-bit
//   registers per consumer thread ~ O (hdim / 2) + S (kBlockN / 2) + P (kBlockN / 4) + ~30
// kBlockN is a multiple of 16 (the k-step of P V). Widths that are not a power of two need
// CuTe's extended WGMMA shapes (-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, setup.py), without
// which N = 80 / 112 ran as N = 16 instructions (hdim 256: 480 -> 695 TFLOP/s at 4k with them).
//
// Tiles and schedules are the fastest measured (H100, csrc/tools/fa3_harness.cu, bf16, 4k and
// 16k, full and causal; fa3_notes.md, sessions 10-11):
// - hdim 64: kBlockN 192 serial, +0..+2.5% over 128 (176 the same as 192). Overlap and
//   ping-pong lose 13-18% at every width (128 / 176 / 192), not understood yet.
// - hdim 128: kBlockN 128 serial. Overlap / ping-pong are within -4..+1% of it, kBlockN 176
//   -3..+1% (its overlap and ping-pong spill), 3 stages +-1%.
// - hdim 192 / 256: overlap, widest two-stage tile. Over serial: hdim 256 +6..+10%, hdim 192
//   +1..+4%; ping-pong is between the two.
// hdim 96 follows 64 / 128, unmeasured.
#pragma once

#include "fa3/fa3_fwd_kernel.cuh"

namespace flash::fa3 {

template <int kHeadDim>
struct FwdTile;

template <int kBlockN_, int kStages_, Schedule kSchedule_>
struct Tile {
  static constexpr int kBlockN = kBlockN_, kStages = kStages_;
  static constexpr Schedule kSchedule = kSchedule_;
};

//                                            kBlockN kStages                smem (KB)  O+S+P regs
template <> struct FwdTile<64>  : Tile<192, 2, Schedule::kSerial> {};    // 112  32+96+48
template <> struct FwdTile<96>  : Tile<128, 2, Schedule::kSerial> {};    // 120  48+64+32
template <> struct FwdTile<128> : Tile<128, 2, Schedule::kSerial> {};    // 160  64+64+32
template <> struct FwdTile<192> : Tile<112, 2, Schedule::kOverlap> {};   // 216  96+56+28
template <> struct FwdTile<256> : Tile<80, 2, Schedule::kOverlap> {};    // 224 128+40+20

}  // namespace flash::fa3
