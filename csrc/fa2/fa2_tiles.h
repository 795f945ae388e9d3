// FA2 tile sizes, one row per kernel head dim, and the shared-memory / copy layouts that every
// FA2 kernel builds its tiles from. The limiting resource of each choice is named on its row.
#pragma once

#include <type_traits>

#include "fa2/fa2.h"
#include "fa2/fa2_utils.h"

namespace flash::fa2 {

// ---- forward --------------------------------------------------------------------------------
// A block owns kBlockM query rows (16 per warp per MMA row-repeat) and walks key tiles of
// kBlockN. Per thread, O costs kBlockM * hdim / threads fp32 registers and S
// kBlockM * kBlockN / threads.
// kStages: K/V shared-memory buffers. 2: the loads of tile n-1 are issued as tile n starts and
// have a whole step to land, and a step has one barrier; 1: K and V alternate (each load
// overlaps one GEMM, two barriers a step). Where two stages do not fit the device (the smem
// column against kSm80SmemBytes / kSm86SmemBytes in fa2.h), the launcher runs one.
// hdim 256 takes 64-row tiles so that two blocks share an SM: one block's prologue (Q, K, V
// loads) and epilogue (O through shared memory) run under the other's GEMMs. Measured on an
// H100 against 128 x 64, 8 warps, 2 stages (192 KB, 1 block per SM): causal 1k +8%, 2k +4%,
// full 1k +2%, the rest within +-1%: the doubled K/V reads from L2 did not become the limit.
template <int kHeadDim> struct FwdTile;
//                                     kBlockM      kBlockN      kWarps     kStages   limit; smem with kStages (1 stage)
template <> struct FwdTile<32>  { static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 4, kStages = 2; };  // S registers (128); 48 KB
template <> struct FwdTile<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 4, kStages = 2; };  // O 64 + S 128 registers; 80 KB
template <> struct FwdTile<96>  { static constexpr int kBlockM = 128, kBlockN = 64,  kWarps = 4, kStages = 2; };  // O 96 + S 64 registers; 72 KB
template <> struct FwdTile<128> { static constexpr int kBlockM = 128, kBlockN = 64,  kWarps = 4, kStages = 2; };  // O 128 + S 64 registers; 96 KB
template <> struct FwdTile<192> { static constexpr int kBlockM = 128, kBlockN = 64,  kWarps = 8, kStages = 2; };  // O registers: 8 warps keep it at 96; 144 KB (96 KB: sm86)
template <> struct FwdTile<256> { static constexpr int kBlockM = 64,  kBlockN = 64,  kWarps = 4, kStages = 1; };  // O 128 + S 32 registers; 96 KB: 2 blocks per SM (sm90)

// The plan's statement of the same (fa2.h).
template <int h> constexpr bool kFwdTileStated =
    FwdTile<h>::kBlockM == fwd_block_m(h) && FwdTile<h>::kBlockN == fwd_block_n(h);
static_assert(kFwdTileStated<32> && kFwdTileStated<64> && kFwdTileStated<96> &&
              kFwdTileStated<128> && kFwdTileStated<192> && kFwdTileStated<256>);

// ---- backward -------------------------------------------------------------------------------
// A block owns kBlockN keys and walks the query tiles of kBlockM that see them. Per thread, dK
// and dV cost 2 * kBlockN * hdim / threads fp32 registers for the whole loop; S and dP
// kBlockM * kBlockN / threads each while P and dS are formed; dQ kBlockM * hdim / threads
// during its GEMM only. Each GEMM has its own warp grid (the first factor is given, the other
// is kWarps / first): S, dP (kBlockM x kBlockN) kSdPWarpsM along M; dK, dV (kBlockN x hdim)
// kdKVWarpsN along N; dQ (kBlockM x hdim) kdQWarpsM along M. Shared memory holds Q (with
// its rows' lse and D) in two buffers, dO in kdOStages, K, V, P and dS (size on each row);
// sm80 allows 163 KB, sm90 227 KB. A second dO buffer saves a barrier per step: measured on an
// H100, +2-3% at hdim 128, -1% at hdim 64, -12% at hdim 256. kdQChunks: dQ = dS K in that
// many column chunks, so its accumulator takes 1 / kdQChunks of the registers.
// kdQBulk (sm90, fa2_bwd_dq.h): 1 = a step's dQ tile goes through a shared-memory staging
// tile (kBlockM x hdim fp32, on top of the smem column) and one bulk reduction; 0 = reds.
// Measured on an H100 against the reds as they were then (all issued right after the dQ GEMM,
// before they were spread over dK's GEMM; A/B in one process, bf16 bwd 1k-16k, three leases):
// hdim 64 +1-4%, 192 +5-6%, but 128 -1-3%, and at 256 (dQ in two chunks, the first staged as
// four 16-row bulk ops, the second by reds) -3-5%; why 128 and 256 lose is not established.
// 32 and 96 follow the tile they share (64's, 128's), unmeasured.
template <int kHeadDim> struct BwdTile;
//                                     kBlockM      kBlockN      kWarps     kSdPWarpsM     kdKVWarpsN     kdQWarpsM     kdOStages     kdQChunks     kdQBulk   limit
template <> struct BwdTile<32>  { static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 8, kSdPWarpsM = 4, kdKVWarpsN = 4, kdQWarpsM = 4, kdOStages = 1, kdQChunks = 1, kdQBulk = 1; };  // S + dP registers (128); smem 106 KB
template <> struct BwdTile<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 8, kSdPWarpsM = 4, kdKVWarpsN = 4, kdQWarpsM = 4, kdOStages = 1, kdQChunks = 1, kdQBulk = 1; };  // S + dP 128 + dK, dV 64 registers; smem 146 KB
template <> struct BwdTile<96>  { static constexpr int kBlockM = 64,  kBlockN = 128, kWarps = 8, kSdPWarpsM = 2, kdKVWarpsN = 4, kdQWarpsM = 4, kdOStages = 2, kdQChunks = 1, kdQBulk = 0; };  // dK, dV 96 + S + dP 64 registers; smem 129 KB
template <> struct BwdTile<128> { static constexpr int kBlockM = 64,  kBlockN = 128, kWarps = 8, kSdPWarpsM = 2, kdKVWarpsN = 4, kdQWarpsM = 2, kdOStages = 2, kdQChunks = 1, kdQBulk = 0; };  // dK, dV 128 + S + dP 64 registers; smem 161 KB
template <> struct BwdTile<192> { static constexpr int kBlockM = 64,  kBlockN = 64,  kWarps = 8, kSdPWarpsM = 4, kdKVWarpsN = 2, kdQWarpsM = 2, kdOStages = 1, kdQChunks = 1, kdQBulk = 1; };  // dK, dV 96 + dQ 48 registers; smem 137 KB
template <> struct BwdTile<256> { static constexpr int kBlockM = 64,  kBlockN = 64,  kWarps = 8, kSdPWarpsM = 4, kdKVWarpsN = 2, kdQWarpsM = 2, kdOStages = 1, kdQChunks = 2, kdQBulk = 0; };  // dK, dV 128 + dQ 2 x 32 registers; smem 177 KB (145 KB with one Q buffer: sm80)

// ---- layouts shared by forward and backward -------------------------------------------------

template <typename Element, int kHeadDim>
struct Layouts {
  // A row of a (rows, hdim) tile is read in chunks of kBlockK columns; the swizzle spreads the
  // 8 rows of each ldmatrix over all 32 banks.
  static constexpr int kBlockK = kHeadDim % 64 == 0 ? 64 : 32;
  using SmemAtom = decltype(composition(
      Swizzle<kBlockK == 64 ? 3 : 2, 3, 3>{},
      Layout<Shape<_8, Int<kBlockK>>, Stride<Int<kBlockK>, _1>>{}));

  // (rows, hdim) and its transpose (hdim, rows), the B operand of P*V and dS^T*Q style GEMMs.
  template <int kRows>
  using Smem = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kRows>, Int<kHeadDim>>{}));
  template <int kRows>
  using SmemTransposed = decltype(composition(
      Smem<kRows>{}, make_layout(Shape<Int<kHeadDim>, Int<kRows>>{}, GenRowMajor{})));
  template <int kRows>
  using SmemTransposedNoSwizzle = decltype(get_nonswizzle_portion(SmemTransposed<kRows>{}));

  // The MMA: m16n8k16 with fp32 accumulators, warps stacked along M.
  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   SM80_16x8x16_F32F16F16F32_TN, SM80_16x8x16_F32BF16BF16F32_TN>;
  template <int kWarpsM, int kWarpsN = 1>
  using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;

  // Global <-> shared: 16-byte vectors, kBlockK / 8 threads per row.
  static constexpr int kThreadsPerRow = kBlockK / 8;
  template <int kThreads>
  using GmemThreads = Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>,
                             Stride<Int<kThreadsPerRow>, _1>>;
  // Loads are cp.async with zero fill: a vector outside the tile's rows or head dim is one
  // cp.async with src-size 0 (copy_tile), not a branch to shared-memory stores.
  template <int kThreads>
  using GmemLoad = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
      GmemThreads<kThreads>{}, Layout<Shape<_1, _8>>{}));
  template <int kThreads>
  using GmemStore = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{}, GmemThreads<kThreads>{},
      Layout<Shape<_1, _8>>{}));

  using LdsmAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;            // row-major operand
  using LdsmTransposedAtom = Copy_Atom<SM75_U16x8_LDSM_T, Element>;  // transposed operand
  using AccStoreAtom = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;
};

}  // namespace flash::fa2
