// FA3 forward tile per head dim: key-tile width, K/V ring depth and consumer schedule. A CTA
// is always two consumer warpgroups of 64 query rows (kBlockM 128) plus the producer
// warpgroup.
//
// Limits (H100 / H200: 227 KB of shared memory per block, 232-240 registers per consumer
// thread after setmaxnreg):
//   shared memory = Q (128 x hdim) + kStages x (K + V) (kBlockN x hdim each), 16-bit
//   registers per consumer thread ~ O (hdim / 2) + S (kBlockN / 2) + P (kBlockN / 4) + ~30
// kBlockN is a multiple of 16 (the k-step of P V). The tiles are where those limits put the
// widest tile with two stages; widths that are not a power of two need CuTe's extended WGMMA
// shapes (-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, setup.py), without which N = 80 / 112 ran
// as N = 16 instructions (hdim 256: 480 -> 695 TFLOP/s at 4k with them). Measured
// alternatives (H100, csrc/tools/fa3_harness.cu, bf16, session 10, fa3_notes.md): 3 stages at
// hdim 64 / 128 moved nothing (+-1%); kBlockN 176 at hdim 128 was measured only without the
// extended shapes (-25..-35%), so it is still to be tried.
//
// The schedule is the fastest one measured per head dim. Overlap wins where the GEMMs are long
// against the softmax (hdim 192 / 256: +3..+5% over serial at 4k-16k); at hdim 64 / 128
// serial is as fast or faster (overlap -4..-8%, ping-pong -2..+2%), because ptxas moves the
// wait for P V above the softmax there (fa3_notes.md); hdim 96 follows 64 / 128, unmeasured.
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
template <> struct FwdTile<64>  : Tile<128, 2, Schedule::kSerial> {};    //  80  32+64+32
template <> struct FwdTile<96>  : Tile<128, 2, Schedule::kSerial> {};    // 120  48+64+32
template <> struct FwdTile<128> : Tile<128, 2, Schedule::kSerial> {};    // 160  64+64+32
template <> struct FwdTile<192> : Tile<112, 2, Schedule::kOverlap> {};   // 216  96+56+28
template <> struct FwdTile<256> : Tile<80, 2, Schedule::kOverlap> {};    // 224 128+40+20

}  // namespace flash::fa3
