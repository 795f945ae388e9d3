// The FA3 forward's epilogue, per consumer warpgroup and item: O / l and the lse out of the
// registers, in one of two ways, and for stream-K the merge of an item's pieces before that.
//   register store: O / l in 16 bits, transposed within quads so that each lane holds 8
//     adjacent columns of a block, written with 16-byte stores (a quarter of the instructions
//     and L2 requests of 4-byte stores, which took 8000 cycles of an 85000-cycle item at hdim
//     256). With two Q buffers the stores wait (pending) until the next item's first S GEMM is
//     on the tensor cores (+0.8..2.5% at causal 512 / 1k); with one they follow at once (under
//     the S GEMM they spilled).
//   staged store (FwdTraits::kStageO, hdim 256): O / l with stmatrix into the item's last K
//     (consumer 0) or V (consumer 1) stage as 64 x 64 boxes of swizzled 128-byte rows, stored
//     by one thread with TMA; the stage goes back to the producer once the store has read it.
//     Consumer 0 may write the K stage once consumer 1's last S GEMM has read it (KFree),
//     consumer 1 the V stage once consumer 0's last P V has (VFree); consumer 1 arrives on KFree
//     before it waits on VFree, consumer 0 on VFree after it has waited on KFree, so neither
//     barrier sees an item's arrival before the item before has passed it.
//   stream-K merge: after a piece's last P V each consumer counts its piece among the item's;
//     all but the last to count publish their unnormalised O (fp32, in fragment order) with the
//     rows' max and sum, and the last merges them and writes the item.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/mma.cuh"
#include "common/params.h"
#include "common/seqinfo.h"
#include "fa3/fa3_fwd_fp8.h"
#include "fa3/fa3_fwd_mainloop.h"
#include "fa3/fa3_item.h"
#include "fa3/fa3_scheduler.h"
#include "fa3/fa3_softmax.h"
#include "fa3/fa3_utils.h"

namespace flash::fa3 {

using namespace cute;

// The TMA descriptors, built by the launcher over (seqlen, head_dim, heads, batch) views.
struct NoTma {};
template <class TmaQ, class TmaK, class TmaV, class TmaO>
struct FwdTma {
  TmaQ q;
  TmaK k;
  TmaV v;
  TmaO o;  // the store of O from shared memory (FwdTraits::kStageO), else NoTma
  // Paged K / V (params.block_table): maps over the pools for boxes of box_rows rows, each
  // within a page (common/kv_box_map.h; PagedKV::load, fa3_fwd_paged.h); unset otherwise.
  CUtensorMap paged_k, paged_v;
  int box_rows;
};

template <class Tr>
struct FwdEpilogue {
  using Element = typename Tr::Element;
  using Raw = typename Tr::Raw;
  using Out = typename Tr::Out;  // O's element: Element, bf16 for FP8
  using RowSoftmax = typename Tr::RowSoftmax;
  using Mainloop = FwdMainloop<Tr>;
  using PipelineState = typename Tr::PipelineState;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr bool kStageO = Tr::kStageO;
  static constexpr bool kDeferStores = Tr::kDeferO;

  int cw, wg_tid, quad;
  uint32_t o_pack[2][kHeadDim / 32][4];  // per row, this lane's 8 columns of 4 blocks
  Out* o_dst[2];  // this lane's first column in each of its rows; nullptr: past the rows
  float* lse_dst[2];  // nullptr: past the rows, or not quad 0 (which writes the row's lse)
  float lse_val[2];
  bool pending = false;

  __device__ explicit FwdEpilogue(int cw_)
      : cw(cw_), wg_tid(threadIdx.x % 128), quad(threadIdx.x % 4) {}

  // The register store's writes of the last item packed (if not yet written).
  __device__ __forceinline__ void flush(const FwdParams& p) {
    if (!pending) return;
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      CUTE_UNROLL
      for (int g = 0; g < kHeadDim / 32; ++g) {
        if (o_dst[mi] != nullptr && 32 * g + 8 * quad < p.head_dim) {
          *reinterpret_cast<uint4*>(o_dst[mi] + 32 * g) =
              make_uint4(o_pack[mi][g][0], o_pack[mi][g][1], o_pack[mi][g][2], o_pack[mi][g][3]);
        }
      }
      if (lse_dst[mi] != nullptr) *lse_dst[mi] = lse_val[mi];
    }
    pending = false;
  }

  // A consumer whose rows see no key: O is zeros (or past seqlen_q), stored below. The other
  // consumer may stage its O: keep the named barriers' turns.
  template <class AccO>
  __device__ __forceinline__ void no_keys(const FwdParams& p, const Item& it, AccO& acc_o,
                                          RowSoftmax& softmax) {
    flush(p);
    clear(acc_o);
    for (int mi = 0; mi < 2; ++mi) softmax.row_sum[mi] = 0.f;
    if (kStageO && !it.tiles.empty()) {
      if (cw == 0) {
        barrier_sync(256, FwdBarrier::KFree);
        barrier_arrive(256, FwdBarrier::VFree);
      } else {
        barrier_arrive(256, FwdBarrier::KFree);
        barrier_sync(256, FwdBarrier::VFree);
      }
    }
  }

  // Stream-K: whether this consumer writes item i's O (merging the other pieces into acc_o and
  // softmax), or published its piece for the one that does. It waits only for pieces that have
  // counted, so for no CTA that is not running.
  template <class AccO>
  __device__ __forceinline__ bool merge(const FwdParams& p, Mainloop& ml,
                                       const StreamKScheduler& sched, int i, AccO& acc_o,
                                       RowSoftmax& softmax) {
    if (i < sched.lattice) return true;  // a whole item
    const int kt = sched.key_tiles, first_unit = (i - sched.lattice) * kt;
    const int w_lo = sched.worker_of(first_unit), w_hi = sched.worker_of(first_unit + kt - 1);
    if (w_lo == w_hi) return true;
    const int worker = int(blockIdx.x);
    // A worker's first piece in its range is its slot 0, a second one (the item after) slot 1.
    auto slot_of = [&](int w) {
      const int slot = sched.range_begin(w) >= first_unit ? 0 : 1;
      return (2 * w + slot) * Tr::kConsumers + cw;
    };
    if (wg_tid == 0) {
      ml.shared.split_old[cw] = atomicAdd(sched.split_count + w_hi * Tr::kConsumers + cw, 1);
    }
    barrier_sync(128, FwdBarrier::ConsumerOwn, cw);
    constexpr int kVecs = decltype(size(acc_o))::value / 4;
    if (ml.shared.split_old[cw] < w_hi - w_lo) {  // not the last: publish
      const int slot = slot_of(worker);
      float4* part = sched.split_part + int64_t(slot) * (kVecs + 1) * 128;
      CUTE_UNROLL
      for (int k = 0; k < kVecs; ++k) {
        __stcg(part + k * 128 + wg_tid,
               make_float4(acc_o(4 * k), acc_o(4 * k + 1), acc_o(4 * k + 2), acc_o(4 * k + 3)));
      }
      __stcg(part + kVecs * 128 + wg_tid, make_float4(softmax.row_max[0], softmax.row_max[1],
                                                      softmax.row_sum[0], softmax.row_sum[1]));
      __threadfence();
      barrier_sync(128, FwdBarrier::ConsumerOwn, cw);
      if (wg_tid == 0) atomicExch(sched.split_flag + slot, 1);
      return false;
    }
    // The last: wait for every other piece's flag at once (thread t for worker w_lo + t), then
    // merge them one after another with no barrier between, so that one piece's loads are in
    // flight while the one before is added (a wait, a barrier and three dependent loads a piece
    // made the merge most of the call at 16 pieces an item).
    for (int t = wg_tid; t <= w_hi - w_lo; t += 128) {
      if (w_lo + t == worker) continue;
      const int* flag = sched.split_flag + slot_of(w_lo + t);
      int up = 0;
      do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(up) : "l"(flag) : "memory");
      } while (up == 0);
    }
    barrier_sync(128, FwdBarrier::ConsumerOwn, cw);
    #pragma unroll 1
    for (int w = w_lo; w <= w_hi; ++w) {
      if (w == worker) continue;
      const float4* part = sched.split_part + int64_t(slot_of(w)) * (kVecs + 1) * 128;
      const float4 ml_ = __ldcg(part + kVecs * 128 + wg_tid);
      const float other_max[2] = {ml_.x, ml_.y}, other_sum[2] = {ml_.z, ml_.w};
      float mine[2], theirs[2];
      CUTE_UNROLL
      for (int mi = 0; mi < 2; ++mi) {
        const float m = fmaxf(softmax.row_max[mi], other_max[mi]);
        mine[mi] = softmax.row_max[mi] == -INFINITY
                       ? 0.f : exp2f((softmax.row_max[mi] - m) * p.softmax_scale_log2);
        theirs[mi] = other_max[mi] == -INFINITY
                         ? 0.f : exp2f((other_max[mi] - m) * p.softmax_scale_log2);
        softmax.row_max[mi] = m;
        softmax.row_sum[mi] = softmax.row_sum[mi] * mine[mi] + other_sum[mi] * theirs[mi];
      }
      // acc_o's fragment ((2 cols, 2 rows, n8), 1, 1): element k is in row (k / 2) % 2.
      CUTE_UNROLL
      for (int k = 0; k < kVecs; ++k) {
        const float4 v = __ldcg(part + k * 128 + wg_tid);
        acc_o(4 * k) = acc_o(4 * k) * mine[0] + v.x * theirs[0];
        acc_o(4 * k + 1) = acc_o(4 * k + 1) * mine[0] + v.y * theirs[0];
        acc_o(4 * k + 2) = acc_o(4 * k + 2) * mine[1] + v.z * theirs[1];
        acc_o(4 * k + 3) = acc_o(4 * k + 3) * mine[1] + v.w * theirs[1];
      }
    }
    return true;
  }

  // A stream-K piece that another writes: give back the stages the staged store would have.
  __device__ __forceinline__ void skip(Mainloop& ml, const PipelineState& o_state) {
    if constexpr (kStageO) {
      if (cw == 1) barrier_sync(256, FwdBarrier::VFree);
      if (cw == 0) {
        ml.pipe_k.consumer_release(o_state);
      } else {
        ml.pipe_v.consumer_release(o_state);
      }
    }
  }

  // O / l and the lse of this consumer's 64 rows (from wg_row0) of item it. walked: whether
  // the CTA walked key tiles for the item (the staged store needs the borrowed stages).
  template <class Tma, class AccO>
  __device__ __forceinline__ void store(const FwdParams& p, const Tma& tma, Mainloop& ml,
                                        const Item& it, bool walked, int wg_row0,
                                        const PipelineState& o_state, AccO& acc_o,
                                        RowSoftmax& softmax) {
    Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
    typename Tr::MmaO mma_o;
    Tensor cO = mma_o.get_thread_slice(wg_tid).partition_C(
        make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
    Tensor cO_rc = make_tensor(cO.data(), rowcol(cO.layout()));
    const flash::SeqInfo seq(p, it.batch);
    float lse[2];
    if constexpr (Tr::kFp8) {  // the item's scale, and v_descale with 1 / l
      const Fp8Scales scales = fp8_scales(p, it.batch, it.head_k);
      softmax.finalize(acc_o_rc, scales.scale_log2, scales.v, lse);
    } else {
      softmax.finalize(acc_o_rc, p.softmax_scale_log2, 1.f, lse);  // O stays 0 if no key
    }
    if constexpr (kStageO) {
      if (walked) {
        if (p.cu_seqlens_q == nullptr) {
          stage(p, tma.o, ml, seq, it, wg_row0, o_state, acc_o_rc, cO_rc, lse);
          return;
        }
        // Variable-length: TMA's boxes would write past the sequence's rows into the next
        // one's. The register store writes row by row; the borrowed stages go back first.
        skip(ml, o_state);
      }
    }
    Out* o = static_cast<Out*>(p.o) + seq.o_offset(p, it.head);
    // Variable-length: rows from seqused_q to the sequence's end take no part (O 0, lse +inf);
    // dense, both are seqlen_q.
    const int used_q = it.seqlen_q, rows_q = seq.rows_q(p);
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      const int row = wg_row0 + get<0>(cO_rc(mi, 0));
      const bool used = row < used_q;
      CUTE_UNROLL
      for (int g = 0; g < kHeadDim / 32; ++g) {  // groups of four 8-column blocks
        pack_quad_block<Raw>(o_pack[mi][g], acc_o_rc, mi, g, quad, 1.f, used);
      }
      if (!used) lse[mi] = INFINITY;
      const bool in = row < rows_q;
      o_dst[mi] = in ? o + int64_t(row) * p.o_strides.row + 8 * quad : nullptr;
      lse_dst[mi] = in && quad == 0 ? p.lse + seq.lse_offset(p, it.head) + row : nullptr;
      lse_val[mi] = lse[mi];
    }
    pending = true;
    if constexpr (!kDeferStores) flush(p);
  }

  // The staged store (see the header comment).
  template <class TmaO, class AccORowCol, class CORowCol>
  __device__ __forceinline__ void stage(const FwdParams& p, const TmaO& tma_o, Mainloop& ml,
                                        const flash::SeqInfo& seq, const Item& it, int wg_row0,
                                        const PipelineState& o_state, AccORowCol& acc_o_rc,
                                        const CORowCol& cO_rc, const float (&lse)[2]) {
    uint32_t pk[2][kHeadDim / 8];  // this lane's column pair of each 8-column block, per row
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      CUTE_UNROLL
      for (int b = 0; b < kHeadDim / 8; ++b) {
        pk[mi][b] = pack2<Raw>(acc_o_rc(mi, 2 * b), acc_o_rc(mi, 2 * b + 1));
      }
    }
    if (cw == 1) barrier_sync(256, FwdBarrier::VFree);
    Element* region = (cw == 0 ? ml.shared.k.data() : ml.shared.v.data()) +
                      o_state.index() * Tr::kBlockN * kHeadDim;
    const uint32_t base = cute::cast_smem_ptr_to_uint(region);
    // stmatrix x4: matrices (row half 0, block 2c), (1, 2c), (0, 2c + 1), (1, 2c + 1); lane l
    // gives row l % 8 of matrix l / 8. Swizzle: 16-byte chunk k of row r at chunk k ^ (r % 8).
    const int lane = wg_tid % 32, half = lane / 16;
    const int row = 16 * (wg_tid / 32) + 8 * ((lane / 8) % 2) + lane % 8;
    CUTE_UNROLL
    for (int c = 0; c < kHeadDim / 16; ++c) {
      const int blk = 2 * c + half;
      stmatrix_x4(base + (blk / 8) * 8192 + row * 128 + (((blk % 8) ^ (row % 8)) << 4),
                  pk[0][2 * c], pk[1][2 * c], pk[0][2 * c + 1], pk[1][2 * c + 1]);
    }
    cutlass::arch::fence_view_async_shared();  // the writes, before the async proxy reads them
    barrier_sync(128, FwdBarrier::ConsumerOwn, cw);
    if (wg_tid == 0) {
      Tensor mO = tma_o.get_tma_tensor(make_shape(flash::SeqInfo::view_rows_q(p), p.head_dim,
                                                  p.heads, flash::SeqInfo::view_batch(p)));
      auto cta_o = tma_o.get_slice(Int<0>{});
      CUTE_UNROLL
      for (int j = 0; j < kHeadDim / 64; ++j) {  // rows past seqlen_q, columns past head_dim clip
        Tensor sO = make_tensor(make_smem_ptr(region + 64 * 64 * j), typename Tr::SmemOBox{});
        Tensor gO = local_tile(seq.q_rows(p, mO, it.head), Shape<_64, _64>{},
                               make_coord(wg_row0 / 64, j));
        copy(tma_o, cta_o.partition_S(sO), cta_o.partition_D(gO));
      }
      tma_store_arrive();
      tma_store_wait<0>();  // read out of shared memory (the writes to out complete on their own)
    }
    if (quad == 0) {
      CUTE_UNROLL
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wg_row0 + get<0>(cO_rc(mi, 0));
        if (r < seq.seqlen_q(p)) p.lse[seq.lse_offset(p, it.head) + r] = lse[mi];
      }
    }
    barrier_sync(128, FwdBarrier::ConsumerOwn, cw);  // the stores have read the stage
    if (cw == 0) {  // (not a ternary of the two pipelines: that put them on the stack)
      ml.pipe_k.consumer_release(o_state);
    } else {
      ml.pipe_v.consumer_release(o_state);
    }
  }
};

}  // namespace flash::fa3
