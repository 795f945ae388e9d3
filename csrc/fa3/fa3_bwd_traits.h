// The compile-time shape of the FA3 backward kernel (fa3_bwd_kernel.cuh): a CTA owns kBlockN
// keys of one KV head and walks the query tiles of every query head of the group, kBlockM rows
// at a time, with two consumer warpgroups. The products are taken transposed (keys as the M
// dimension), so S^T and dP^T come out with a key a row of their accumulators.
//   Head dims up to 128 (narrow): 128 keys, consumer c keys [64 c, 64 c + 64) and all rows;
//     its P^T and dS^T are already the register A operands of dV += P^T dO and dK += dS^T Q,
//     and it keeps dK / dV of all the head dim (2 x kHeadDim / 2 registers a thread).
//   192 and 256 (wide): that would be 192 / 256 registers, so 64 keys, consumer c all keys
//     and rows [32 c, 32 c + 32) for S^T / dP^T, and dK / dV of head-dim half c, read from
//     P^T and dS^T in shared memory (SS GEMMs). dQ's staging shares that shared memory.
// Both: dQ[:, half c] = dS K[:, half c] by consumer c, dS read from shared memory; with 96
// rows a step (head dim 64, bwd_block_m) as dQ^T[:, rows half c] = K^T dS^T[:, half c], since
// a WGMMA's M is 64 a warpgroup (48 rows would not be) and its N may be 48.
#pragma once

#include <algorithm>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/fragment.h"
#include "fa3/fa3_plan.h"

namespace flash::fa3 {

using namespace cute;

// kBlockM_: the query rows a step (bwd_block_m).
template <typename T, int kHeadDim_, int kBlockM_>
struct BwdTraits {
  using Element = typename flash::CuteType<T>::type;
  using Raw = T;  // __half / __nv_bfloat16, for the dK / dV stores
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 ||
                    kHeadDim == 256,
                "the backward's tiles: head dim 64, 96, 128, 192 or 256");
  static constexpr int kBlockM = kBlockM_, kBlockN = bwd_block_n(kHeadDim);
  static_assert(kBlockM == bwd_block_m(kHeadDim, false) || kBlockM == bwd_block_m(kHeadDim, true));
  static constexpr bool kWide = kBlockN == 64;
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
  // Without it CuTe lacks GMMA atoms of N = 48 and would tile by smaller ones.
  static_assert(kBlockM % 64 == 0, "define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED first");
#endif
  // dO has one stage at 256: two would not fit beside dQ's 64 KB staging.
  static constexpr int kStagesQ = 2, kStagesdO = kHeadDim > 192 ? 1 : 2;
  static constexpr int kdQBuffers = kWide ? 1 : 2;  // dQ staging buffers
  // Staged dQ handed to the writer in flight, each with its pair of named barriers (dQFull +
  // h, dQEmpty + h): the narrow tile's two buffers, the wide tile's two halves of its one.
  static constexpr int kdQHandoffs = 2;
  // K / V buffers (item slots): with two, a persistent CTA's next item's K and V (and its
  // first Q / dO) load during this item's last steps, not after them; the shared memory has
  // room up to head dim 96.
  static constexpr int kKVSlots = !kWide && kHeadDim <= 96 ? 2 : 1;
  static constexpr int kConsumers = 2;              // warpgroups
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128 x 24 + 256 x 240
  // A consumer's S^T / dP^T: 64 keys x kStRows rows; its dK / dV: 64 keys x kKVCols.
  static constexpr int kStRows = kWide ? kBlockM / 2 : kBlockM;
  static constexpr int kKVCols = kWide ? kHeadDim / 2 : kHeadDim;

  // S^T = K Q^T and dP^T = V dO^T (both operands K-major in shared memory).
  using ShapeSt = Shape<_64, Int<kStRows>, Int<kHeadDim>>;
  using MmaSt = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, ShapeSt>()));
  // dP^T with V from registers (loaded once: the CTA's for all its steps), where V fits beside
  // dK / dV: the narrow tile up to head dim 96 (at 128 it serialises the WGMMAs, ptxas C7512).
  using MmaStRS =
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, ShapeSt>()));
  static constexpr bool kVRegs = !kWide && kHeadDim <= 96;
  // dV += P^T dO and dK += dS^T Q; B (dO, Q seen as (head_dim, rows)) MN-major; A from
  // registers (narrow) or shared memory (wide, K-major).
  using ShapeKV = Shape<_64, Int<kKVCols>, Int<kBlockM>>;
  using MmaKV = decltype(make_tiled_mma(std::conditional_t<
      kWide,
      decltype(GMMA::ss_op_selector<Element, Element, float, ShapeKV, GMMA::Major::K,
                                    GMMA::Major::MN>()),
      decltype(GMMA::rs_op_selector<Element, Element, float, ShapeKV, GMMA::Major::K,
                                    GMMA::Major::MN>())>{}));
  // dQ = dS K in kdQParts column blocks of kdQCols, consumer c taking its head-dim half (the
  // wide tile in two GEMMs: one 64-column accumulator more would not fit beside dK / dV): dS
  // (rows, keys) read MN-major from where the consumers wrote dS^T, K seen as (head_dim, keys).
  static constexpr int kdQParts = kWide ? 4 : 2, kdQCols = kHeadDim / kdQParts;
  // kdQT: rows a step not a multiple of 64 (96 at head dim 64), so a consumer's part is
  // dQ^T = K^T dS^T over all 64 columns (M) and its half of the rows (N = 48): K^T MN-major,
  // dS seen as (rows, keys) MN-major; its accumulator is (columns, rows).
  static constexpr bool kdQT = kBlockM % 64 != 0;
  static_assert(!kdQT || kHeadDim == 64);
  using ShapedQ = std::conditional_t<kdQT, Shape<Int<kHeadDim>, Int<kBlockM / 2>, Int<kBlockN>>,
                                     Shape<Int<kBlockM>, Int<kdQCols>, Int<kBlockN>>>;
  using ShapedQAcc = decltype(take<0, 2>(ShapedQ{}));
  using MmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, ShapedQ, GMMA::Major::MN, GMMA::Major::MN>()));

  // The widest swizzle whose rows (128, 64 or 32 bytes: 64, 32 or 16 elements) divide n.
  template <int n>
  using SwizzleFor = std::conditional_t<
      n % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<n % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>,
                         GMMA::Layout_K_SW32_Atom<Element>>>;
  // A tile read MN-major in column blocks of n (the dQ GEMMs' blocks of K^T; the wide dK / dV
  // GEMMs' Q^T / dO^T halves) needs swizzle rows that divide n (96: the 64-byte one, 48: the
  // 32-byte one).
  using SwizzleAtomQ = SwizzleFor<kKVCols>;
  using SwizzleAtomKV = SwizzleFor<kdQCols>;
  // dS^T's rows: 64 in a 128-byte swizzle row; 96 read in halves of 48, the 32-byte one.
  using SwizzleAtom = SwizzleFor<kdQT ? kBlockM / 2 : kBlockM>;
  template <int kStages>
  using SmemRows = decltype(tile_to_shape(SwizzleAtomQ{},
                                          Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  template <int kStages>
  using SmemRowsT = decltype(composition(
      SmemRows<kStages>{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                               Step<_2, _1, _3>{})));
  using SmemQ = SmemRows<kStagesQ>;
  using SmemQt = SmemRowsT<kStagesQ>;
  using SmemdO = SmemRows<kStagesdO>;
  using SmemdOt = SmemRowsT<kStagesdO>;
  using SmemKV = decltype(tile_to_shape(SwizzleAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemKt = decltype(composition(
      SmemKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS^T (and the wide tile's P^T) as (keys, rows), rows contiguous (one 128-byte swizzle row
  // of 64 rows; 96 in six 32-byte ones), and the same memory seen as dS (rows, keys),
  // MN-major.
  using SmemdSt = decltype(tile_to_shape(SwizzleAtom{}, Shape<Int<kBlockN>, Int<kBlockM>>{}));
  using SmemdS = decltype(composition(
      SmemdSt{}, make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>>{}, Step<_2, _1>{})));

  // The shared region of dS^T, P^T (wide) and dQ's staging buffers (a step's dQ tile each, in
  // accumulator order). Narrow: side by side. Wide: the staging overlays P^T / dS^T, which the
  // last dQ GEMMs read (fa3_bwd_wide.h), so the first dQ GEMMs' parts go to the upper half.
  static constexpr int kdSBytes = kBlockN * kBlockM * int(sizeof(Element));
  static constexpr int kdQBytes = kBlockM * kHeadDim * int(sizeof(float));
  // Part p of the dQ tile is column block p (row half p with kdQT); its slot in the staging
  // (and the global accumulator) is dq_slot(p), its values in the MMA's order: float4 j of
  // thread t at (slot kdQPartVecs + j) 128 + t.
  static constexpr int kdQPartVecs = decltype(size(ShapedQAcc{}))::value / 128 / 4;
  __host__ __device__ static constexpr int dq_part_row0(int part) {
    return kdQT ? part * kBlockM / 2 : 0;
  }
  __host__ __device__ static constexpr int dq_part_col0(int part) {
    return kdQT ? 0 : part * kdQCols;
  }
  __host__ __device__ static constexpr int dq_slot(int part) {
    return !kWide ? part : part % 2 == 0 ? kdQParts / 2 + part / 2 : part / 2;
  }
  static_assert(!kWide || 2 * kdSBytes <= kdQBytes / 2, "the first parts clear of P^T / dS^T");
  static constexpr int kdQOffset = kWide ? 0 : kdSBytes;
  static constexpr int kScratchBytes = kWide ? std::max(2 * kdSBytes, kdQBytes)
                                             : kdSBytes + kdQBuffers * kdQBytes;

  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, kKVSlots * cosize_v<SmemKV>> k;
    alignas(1024) cute::array_aligned<Element, kKVSlots * cosize_v<SmemKV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemdO>> dout;
    alignas(1024) char scratch[kScratchBytes];
    alignas(16) float lse[kStagesQ][kBlockM];    // the rows' lse in base 2, with Q's stage
    alignas(16) float dsum[kStagesdO][kBlockM];  // D = rowsum(dO o O), with dO's stage
    alignas(16) float dq_scale[kStagesQ][kBlockM];  // deterministic mode's, with Q's stage
    typename PipelineQ::SharedStorage pipe_q;
    typename PipelinedO::SharedStorage pipe_do;
    // The CTA's items in flight (fa3_bwd_items.h), a slot each, published with their K and V
    // (kv_full) and released, with them, by the consumers and the dQ writer (kv_empty).
    alignas(8) uint64_t kv_full[kKVSlots];
    alignas(8) uint64_t kv_empty[kKVSlots];
    int item[kKVSlots];

    __device__ Element* ds() { return reinterpret_cast<Element*>(scratch); }
    // The wide tile's only: in the narrow one this is dQ staging buffer 0.
    __device__ Element* pt() { return reinterpret_cast<Element*>(scratch + kdSBytes); }
    __device__ float* dq(int buffer) {
      return reinterpret_cast<float*>(scratch + kdQOffset + buffer * kdQBytes);
    }
  };
  template <class Layout>
  using SmemView = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Layout{}));
  // The shared-memory tiles as the loads and GEMMs see them (*t: transposed views).
  struct Tiles {
    SmemView<SmemKV> k, v;
    SmemView<SmemKt> kt;
    SmemView<SmemQ> q;
    SmemView<SmemQt> qt;
    SmemView<SmemdO> dout;
    SmemView<SmemdOt> doutt;
    SmemView<SmemdSt> dst, pt;  // dS^T, P^T (wide)
    SmemView<SmemdS> ds;        // dS^T's memory as dS
    // slot: the item's K / V buffer (kKVSlots).
    __device__ Tiles(SharedStorage& s, int slot)
        : k(make_tensor(make_smem_ptr(s.k.data() + slot * cosize_v<SmemKV>), SmemKV{})),
          v(make_tensor(make_smem_ptr(s.v.data() + slot * cosize_v<SmemKV>), SmemKV{})),
          kt(make_tensor(make_smem_ptr(s.k.data() + slot * cosize_v<SmemKV>), SmemKt{})),
          q(make_tensor(make_smem_ptr(s.q.data()), SmemQ{})),
          qt(make_tensor(make_smem_ptr(s.q.data()), SmemQt{})),
          dout(make_tensor(make_smem_ptr(s.dout.data()), SmemdO{})),
          doutt(make_tensor(make_smem_ptr(s.dout.data()), SmemdOt{})),
          dst(make_tensor(make_smem_ptr(s.ds()), SmemdSt{})),
          pt(make_tensor(make_smem_ptr(s.pt()), SmemdSt{})),
          ds(make_tensor(make_smem_ptr(s.ds()), SmemdS{})) {}
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "the backward's shared memory");
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kRowBytes = kBlockM * sizeof(float);  // lse or D of a tile
};

}  // namespace flash::fa3
