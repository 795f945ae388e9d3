// The compile-time shape of one FA3 forward kernel: tile, schedule, warpgroups and their
// registers, shared-memory layouts, the pipelines and the TMA byte counts. One instantiation per
// row of fa3_plan.h's table (and score-mod variant) per element type and head dim.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/fragment.h"
#include "fa3/fa3_plan.h"
#include "fa3/fa3_softmax.h"

namespace flash::fa3 {

using namespace cute;

// FP8's V^T stages (head dim, keys, stage), keys contiguous in 128-byte rows, as a type that is
// only formed where it is named.
template <class Element, int kHeadDim, int kBlockN, int kStages>
struct Fp8VtLayout {
  using type = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                      Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}));
};
template <class Layout>
struct LayoutOf {
  using type = Layout;
};

template <typename T, int kHeadDim_, int kBlockN_, int kStages_, bool kScoreMod_,
          Schedule kSchedule_, int kConsumers_ = 2, int kClusterM_ = 1, bool kStreamK_ = false>
struct FwdTraits {
  using Element = typename flash::CuteType<T>::type;
  // FP8 (e4m3 q / k / v, fa3_fwd_fp8.h): O in bf16, V read as V^T (keys contiguous).
  static constexpr bool kFp8 = sizeof(Element) == 1;
  using Raw = std::conditional_t<kFp8, __nv_bfloat16, T>;  // O's type: __half / __nv_bfloat16
  using Out = typename flash::CuteType<Raw>::type;
  // P against the row max scaled by 2^kPOffset: FP8's P then spans e4m3's range, not [0, 1].
  using RowSoftmax = Softmax<2, kFp8 ? 8 : 0>;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr bool kScoreMod = kScoreMod_;  // softcap or ALiBi may be on (runtime fields)
  static constexpr Schedule kSchedule = kSchedule_;
  static constexpr int kConsumers = kConsumers_;  // warpgroups, 64 rows each
  // CTAs per cluster: a cluster's CTAs take neighbouring query tiles of one (head, batch) and
  // the same key tiles, and each loads 1 / kClusterM of every K / V tile for all of them. Full
  // attention only (the CTAs must see the same key tiles).
  static constexpr int kClusterM = kClusterM_;
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
  // Stream-K (fa3_scheduler.h): a template flag, because as a runtime switch its merge made
  // the other kernels spill. Never in clusters (that variant spilled and was dropped).
  static constexpr bool kStreamK = kStreamK_;
  static_assert(kClusterM == 1 || kClusterM == 2);
  static_assert(!(kStreamK && kClusterM > 1));
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // setmaxnreg: the split must add up to what the launch bound gives the CTA (64K registers:
  // 128 x 24 + 256 x 240, 128 x 32 + 384 x 160). With 32 for the producer of two consumers the
  // consumers' setmaxnreg waited forever.
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kConsumers == 2 || kConsumers == 3);
  static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0);

  using ShapeS = Shape<_64, Int<kBlockN>, Int<kHeadDim>>;   // one warpgroup's S = Q K^T
  using ShapeO = Shape<_64, Int<kHeadDim>, Int<kBlockN>>;   // one warpgroup's O += P V
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, ShapeS>()));
  // FP8 WGMMA takes both operands K-major: V^T (head dim, keys) with keys contiguous.
  using MmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, ShapeO, GMMA::Major::K,
                           kFp8 ? GMMA::Major::K : GMMA::Major::MN>()));
  // Without CuTe's extended shapes (fa3_fwd_launch.cuh) the selector silently tiles a kBlockN
  // of 80 or 112 with N = 16 instructions (hdim 256 4k: 480 against 695 TFLOP/s).
  static_assert(decltype(size<1>(typename MmaS::Shape_MNK{}))::value == kBlockN &&
                    decltype(size<1>(typename MmaO::Shape_MNK{}))::value == kHeadDim,
                "one WGMMA per k-step: include fa3/fa3_fwd_launch.cuh before any CuTe header");

  // Q, K, V in shared memory as they are in global: rows of hdim, swizzled by the widest
  // pattern a row divides into (128 bytes, or 64 at hdim 96). V viewed as (hdim, keys) is the
  // MN-major B operand of P V, so no transpose is needed.
  static constexpr int kRowBytes = kHeadDim * int(sizeof(Element));
  using SwizzleAtom = std::conditional_t<kRowBytes % 128 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                         GMMA::Layout_K_SW64_Atom<Element>>;
  // Q is double-buffered where shared memory has room (hdim <= 128): the next item's Q loads
  // while the consumers still run this one, and each consumer goes on to it without waiting for
  // the others.
  static constexpr int kSmemLimit = 227 * 1024;  // per block, H100 / H200
  static constexpr int kQBufs =
      (2 * kBlockM + 2 * kStages * kBlockN) * kHeadDim * int(sizeof(Element)) + 1024 <= kSmemLimit
          ? 2 : 1;
  // With two Q buffers the epilogue's register stores wait under the next item's first S GEMM
  // (fa3_fwd_epilogue.h), holding O packed (hdim / 4 registers): not in FP8's kernels, whose
  // two Q buffers come where the 16-bit tiles of the same consumers have one, and which spilled
  // with it (docs/fa3_decisions.md).
  static constexpr bool kDeferO = kQBufs == 2 && !kFp8;
  // At hdim 256 O leaves through shared memory (stmatrix into the item's last K / V stage, then
  // a TMA store): +1..2% at causal 512-2k over 16-byte stores from registers, level at full 2k-4k.
  static constexpr bool kStageO = !kFp8 && kQBufs == 1 && kSchedule == Schedule::kOverlap &&
                                  kConsumers == 2 && kHeadDim == 256 && kBlockN >= 64;
  // Which kernels take the lazy softmax step on unmasked tiles (fa3_softmax.h): the overlapped
  // ones, whose softmax runs beside the GEMMs (+4..6% at hdim 192 / 256); not stream-K, whose
  // merge leaves no registers for its rare path (-15..19%), nor the serial schedule (spills).
  // Not FP8, whose P must stay within e4m3's range (RowSoftmax).
  static constexpr bool kLazySteps = kSchedule != Schedule::kSerial && !kStreamK && !kFp8;
  using SmemOBox = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Out>{}, Shape<_64, _64>{}));
  using SmemQ = decltype(tile_to_shape(SwizzleAtom{},
                                       Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQBufs>>{}));
  using SmemKV = decltype(tile_to_shape(SwizzleAtom{},
                                        Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V as P V's B operand (head dim, keys, stage): 16 bits, SmemKV's tiles read MN-major; FP8,
  // V^T's tiles (fwd_fp8_vt) as they land, keys contiguous in 128-byte rows (kBlockN 128).
  using SmemVt16 = decltype(composition(
      SmemKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                    Step<_2, _1, _3>{})));
  // Named only for FP8: a 16-bit kBlockN of 80 / 112 does not tile the 128-byte atom.
  using SmemVt = typename std::conditional_t<kFp8, Fp8VtLayout<Element, kHeadDim, kBlockN, kStages>,
                                             LayoutOf<SmemVt16>>::type;
  // The V stages as the producer's TMA fills them.
  using SmemV = std::conditional_t<kFp8, SmemVt, SmemKV>;
  static_assert(!kFp8 || (kBlockN == 128 && !kStreamK && kClusterM == 1));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemV>> v;
    typename Pipeline::SharedStorage pipe_k, pipe_v;
    // Per Q buffer:
    alignas(8) uint64_t q_full[kQBufs];   // item published and its Q loaded (producer's tx)
    alignas(8) uint64_t q_empty[kQBufs];  // every consumer thread done with the index and Q
    int item[kQBufs];                     // the item in the buffer, -1: none left
    int2 piece[kQBufs];                   // stream-K: the item's key tiles [x, y) in this piece
    int2 lengths[kQBufs];                 // variable-length: the item's (seqlen_q, seqlen_k)
    int split_old[kConsumers];            // stream-K: the item's pieces finished before this
    // Paged K / V: the item whose key tiles the producer warpgroup's other warps help load
    // (PagedKV::help, fa3_fwd_paged.h), handed over by the producer thread.
    alignas(8) uint64_t walk_full;   // published (the producer thread's arrival)
    alignas(8) uint64_t walk_empty;  // read by every helper
    int walk[5];                     // batch, head_k, seqlen_k, tiles begin, end; end < 0: done
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);
};

}  // namespace flash::fa3
