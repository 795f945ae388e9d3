// Small SM90 helpers of the FA3 forward: warp roles and named barriers, WGMMA fragment views,
// the issue of one warpgroup GEMM, and the register tricks that keep ptxas's scheduling where
// the kernel needs it.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/mma.cuh"
#include "common/params.h"

namespace flash::fa3 {

using namespace cute;

// A (seqlen, head_dim, heads, batch) view of q, k, v, out or a gradient for a TMA descriptor,
// which needs every stride to be a multiple of 16 bytes, also that of a dimension of extent 1
// (the frontend leaves such a stride as it comes: a slice of a longer tensor can have any).
// Such a stride is never stepped along: it gets the extent of the dims inside it. The TMA
// boxes are kHeadDim wide; columns past head_dim (<= kHeadDim) are zero-filled, as are rows
// past seqlen. A variable-length batch is one sequence of all its rows (SeqInfo's views).
template <class T>
inline auto tma_view(T* ptr, const Strides& s, int head_dim, int seqlen, int heads,
                     int batches) {
  const int64_t row = seqlen > 1 ? s.row : head_dim;
  const int64_t head = heads > 1 ? s.head : row * seqlen;
  const int64_t batch = batches > 1 ? s.batch : head * heads;
  return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, head_dim, heads, batches),
                     make_stride(row, _1{}, head, batch));
}

// Warpgroup 0 produces (TMA loads), the others consume (64 query rows each).
enum class WarpRole { Producer, Consumer };
__device__ __forceinline__ WarpRole warp_role(int warpgroup) {
  return warpgroup == 0 ? WarpRole::Producer : WarpRole::Consumer;
}

// Named barriers (CUTLASS's user ids, above the ones it reserves). The staged epilogue (hdim
// 256) writes O into the item's last K and V stages: KFree, consumer 1's last S GEMM has read K;
// VFree, consumer 0's last P V has read V (256 threads each). ConsumerOwn + c: consumer c's own
// 128 threads.
enum class FwdBarrier : uint32_t { KFree = 2, VFree = 3, ConsumerOwn = 4 };
// Three consumers at most; CUTLASS adds its reserved count to these ids, the hardware has 16.
static_assert(uint32_t(FwdBarrier::ConsumerOwn) + 3 +
                  cutlass::arch::NamedBarrier::ReservedNamedBarrierCount <=
              cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers);
// The backward's named barriers (fa3_bwd_kernel.cuh), the same way. dSFree / dSFull: the
// consumers around the shared dS tile. Tails: the zeroed tail rows of a variable-length tile
// are in place. dQFull + h / dQEmpty + h: staged dQ handoff h (BwdTraits::kdQHandoffs)
// written by the consumers / read by the dQ writer's bulk add. Parts: a split item's part
// has added its dK / dV (fa3_bwd_epilogue.h: add_split_part; Tails' id, never at once).
enum class BwdBarrier : uint32_t {
  dSFree = 0, dSFull = 1, Tails = 2, Parts = 2, dQFull = 3, dQEmpty = 5
};
static_assert(uint32_t(BwdBarrier::dQEmpty) + 1 +
                  cutlass::arch::NamedBarrier::ReservedNamedBarrierCount <
              cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers);
constexpr int kdQBarrierThreads = 256 + 32;  // the consumers and the dQ writer warp
__device__ __forceinline__ void barrier_sync(int threads, FwdBarrier id, int offset = 0) {
  cutlass::arch::NamedBarrier::sync(threads, uint32_t(id) + offset);
}
__device__ __forceinline__ void barrier_arrive(int threads, FwdBarrier id) {
  cutlass::arch::NamedBarrier::arrive(threads, uint32_t(id));
}

// An SM90 accumulator ((2 cols, 2 rows, N / 8), MMA_M, MMA_N) seen as (rows, cols).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol(Layout const& acc) {
  static_assert(rank(Layout{}) == 3);
  auto atom = get<0>(acc);
  return make_layout(make_layout(get<1>(atom), get<1>(acc)),
                     make_layout(get<0>(atom), get<2>(atom), get<2>(acc)));
}

// The S accumulator converted to 16 bits, as the A operand of the RS WGMMA: each k16 slice
// is two adjacent n8 blocks. ((2, 2, N/8), M, N) -> ((2, 2, 2), M, (N/16, N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_operand_a(Layout const& acc) {
  // (2, 2, (2, N/16))
  auto split = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(acc),
                     make_layout(get<2, 1>(split), get<2>(acc)));
}

// Keeps the compiler from moving shared-memory accesses across CUTLASS's mbarrier waits and
// arrives, whose asm has no memory clobber (the hardware ordering is the mbarriers').
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

// A named barrier of `threads` (CUTLASS's user id `id`) that also ORs a flag over them.
__device__ __forceinline__ bool barrier_or(int threads, uint32_t id, bool flag) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 q, %1, 0;\n"
      " bar.red.or.pred p, %2, %3, q;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(any)
      : "r"(uint32_t(flag)), "r"(id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount),
        "r"(threads)
      : "memory");
  return any != 0;
}

// Shared-memory GEMM operands' descriptor bases hidden from the compiler (an empty asm on each
// one's low word) at the top of a loop that uses them: otherwise each k-block's descriptor,
// invariant in the loop, is hoisted out and held in a register of its own. In a persistent
// backward CTA some twenty of them went out of the item loop into vector registers and spilled
// in the steps. A register fragment (no descriptor) is left as it is.
template <class... Frags>
__device__ __forceinline__ void hide_desc_base(Frags&... frags) {
  auto hide = [](auto& frag) {
    using Iterator = std::remove_cv_t<std::remove_reference_t<decltype(frag.data())>>;
    if constexpr (std::is_same_v<Iterator, GMMA::DescriptorIterator>) {
      asm volatile("" : "+r"(frag.data().desc_.reg32_[0]));
    }
  };
  (hide(frags), ...);
}

// One warpgroup's GEMM, issued and committed (not waited for). zero: C = A B (C's registers
// are not read), else C += A B.
template <class Mma, class A, class B, class C>
__device__ __forceinline__ void wgmma(Mma& mma, A const& a, B const& b, C& c, bool zero) {
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
}

// Ends the life of a float fragment's values for the compiler: an empty asm that writes each
// register without reading it. An item's first P V overwrites O (ScaleOut::Zero) but its asm
// reads the registers all the same, which would keep the previous item's O alive next to the
// one being stored (640 B of spills at hdim 256 without it).
template <class Fragment>
__device__ __forceinline__ void forget(Fragment& f) {
  CUTE_UNROLL
  for (int k = 0; k < size(f); ++k) asm volatile("" : "=f"(f(k)));
}

// True, in a way the compilers cannot see (the lane index is below 32): a branch on it ends a
// basic block, below which ptxas does not hoist a wait.
__device__ __forceinline__ bool opaque_true() {
  uint32_t lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane < 32;
}

// A 4 x 4 transpose of 32-bit words across the four lanes of a quad (lane = quad index):
// w[j] of lane i becomes w[i] of lane j. Two xor shuffles, each swapping half of the words;
// every lane of the warp must call it.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int quad) {
  CUTE_UNROLL
  for (int bit = 1; bit <= 2; bit *= 2) {
    const bool upper = quad & bit;
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) {
      if (k & bit) continue;  // the pair (k, k + bit)
      const uint32_t recv = __shfl_xor_sync(0xffffffff, upper ? w[k] : w[k + bit], bit);
      (upper ? w[k] : w[k + bit]) = recv;
    }
  }
}

// Columns [32 g, 32 g + 32) of row mi of an accumulator seen as (row, col) (rowcol), times
// `scale`, in 16 bits, ready for the register store of 16 bytes a lane (the forward's O, the
// backward's dK / dV): w[j] is first this lane's column pair of 8-column block 4g + j, then,
// transposed within the quad, lane j's pair of block 4g + quad, so that lane q holds the 8
// adjacent columns of block 4g + q. Zeros where !keep (keep is the same across a quad).
template <class Raw, class AccRowCol>
__device__ __forceinline__ void pack_quad_block(uint32_t (&w)[4], const AccRowCol& acc, int mi,
                                                int g, int quad, float scale = 1.f,
                                                bool keep = true) {
  CUTE_UNROLL
  for (int j = 0; j < 4; ++j) {
    w[j] = keep ? pack2<Raw>(acc(mi, 8 * g + 2 * j) * scale, acc(mi, 8 * g + 2 * j + 1) * scale)
                : 0u;
  }
  quad_transpose(w, quad);
}

// Four 8 x 8 matrices of 16-bit pairs from an accumulator fragment into shared memory
// (stmatrix): register j goes to matrix j, whose eight row addresses lanes 8j..8j+7 give.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

}  // namespace flash::fa3
