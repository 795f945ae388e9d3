// The compile-time shape of the FA3 backward kernel (fa3_bwd_kernel.cuh): a CTA owns kBlockN
// keys of one KV head and walks the query tiles of every query head of the group, kBlockM rows
// at a time. Two consumer warpgroups, 64 keys each; the products are taken transposed (keys
// as the M dimension) so that P^T and dS^T come out of the WGMMA accumulators already as the
// register A operands of dV += P^T dO and dK += dS^T Q.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/fragment.h"

namespace flash::fa3 {

using namespace cute;

template <typename T, int kHeadDim_>
struct BwdTraits {
  using Element = typename flash::CuteType<T>::type;
  using Raw = T;  // __half / __nv_bfloat16, for the dK / dV stores
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2;
  static constexpr int kConsumers = 2;  // warpgroups, 64 keys each
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128 x 24 + 256 x 240
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128,
                "the backward's tile: head dim 64, 96 or 128");

  // One warpgroup's S^T = K Q^T and dP^T = V dO^T (both operands K-major in shared memory).
  using ShapeSt = Shape<_64, Int<kBlockM>, Int<kHeadDim>>;
  using MmaSt = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, ShapeSt>()));
  // dV += P^T dO and dK += dS^T Q: A from registers, B (dO, Q seen as (head_dim, rows)) MN-major.
  using ShapeKV = Shape<_64, Int<kHeadDim>, Int<kBlockM>>;
  using MmaKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, ShapeKV, GMMA::Major::K, GMMA::Major::MN>()));
  // dQ = dS K, consumer c taking head_dim columns [c kHeadDim / 2, (c + 1) kHeadDim / 2): dS
  // (rows, keys) read MN-major from where the consumers wrote dS^T, K seen as (head_dim, keys).
  using ShapedQ = Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>;
  using MmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, ShapedQ, GMMA::Major::MN, GMMA::Major::MN>()));

  // The widest swizzle whose rows (128, 64 or 32 bytes: 64, 32 or 16 elements) divide n.
  template <int n>
  using SwizzleFor = std::conditional_t<
      n % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<n % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>,
                         GMMA::Layout_K_SW32_Atom<Element>>>;
  // Q and dO: rows of kHeadDim. K and V: the dQ GEMM reads K as (head_dim, keys) MN-major in
  // halves of kHeadDim / 2 columns, which the swizzle rows must divide (64: the 64-byte one,
  // 96: the 32-byte one).
  using SwizzleAtomQ = SwizzleFor<kHeadDim>;
  using SwizzleAtomKV = SwizzleFor<kHeadDim / 2>;
  using SwizzleAtom = GMMA::Layout_K_SW128_Atom<Element>;  // rows of 64 elements
  using SmemQ = decltype(tile_to_shape(SwizzleAtomQ{},
                                       Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemQt = decltype(composition(
      SmemQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                   Step<_2, _1, _3>{})));
  using SmemKV = decltype(tile_to_shape(SwizzleAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemKt = decltype(composition(
      SmemKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS^T as (keys, rows), rows contiguous (one 128-byte swizzle row of 64 rows), and the same
  // memory seen as dS (rows, keys), MN-major.
  using SmemdSt = decltype(tile_to_shape(SwizzleAtom{}, Shape<Int<kBlockN>, Int<kBlockM>>{}));
  using SmemdS = decltype(composition(
      SmemdSt{}, make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>>{}, Step<_2, _1>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemKV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemdSt>> ds;
    alignas(128) float dq[2][kBlockM * kHeadDim];  // a step's dQ tile, accumulator order
    alignas(16) float lse[kStages][kBlockM];   // the rows' lse in base 2, with Q's stage
    alignas(16) float dsum[kStages][kBlockM];  // D = rowsum(dO o O), with dO's stage
    typename Pipeline::SharedStorage pipe_q, pipe_do;
    alignas(8) uint64_t kv_full;  // K and V of the CTA's keys
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kRowBytes = kBlockM * sizeof(float);  // lse or D of a tile
  static constexpr int kdQBytes = kBlockM * kHeadDim * sizeof(float);
};

}  // namespace flash::fa3
