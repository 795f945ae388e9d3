// FA3 forward launcher: reads the call's plan (fa3_plan.h), builds the TMA descriptors over
// (seqlen, head_dim, heads, batch) views of Q, K, V (and O) (common/seqinfo.h: a
// variable-length batch is one sequence of all its rows), the scheduler, and launches the
// planned kernel. Included by the generated instantiation files and the harness only.
#pragma once

// CuTe's WGMMA shapes with N not a power of two (kBlockN 80, 112), which fa3's tiles need. Set
// here rather than on the command line: their declarations cost every file that includes CuTe
// about 30 s of front end, and no other family uses them. It must precede CuTe's first include
// in the translation unit; FwdTraits asserts that it did.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#include <cute/tensor.hpp>

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "common/kv_box_map.h"
#include "common/seqinfo.h"
#include "common/tile_order.h"
#include "fa3/fa3.h"
#include "fa3/fa3_fwd_kernel.cuh"

namespace flash::fa3 {

// The scheduler of a kernel's traits: stream-K, clusters (static stride) or dynamic.
template <class Tr>
using SchedulerFor =
    std::conditional_t<Tr::kStreamK, StreamKScheduler,
                       std::conditional_t<(Tr::kClusterM > 1), ClusterScheduler<Tr::kClusterM>,
                                          DynamicScheduler>>;

template <class Tr>
void launch_fwd(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  using Element = typename Tr::Element;
  using Scheduler = SchedulerFor<Tr>;
  if (const char* error = plan_error(plan)) {
    throw std::runtime_error(std::string("flash_attn: fa3 forward: ") + error);
  }
  if (plan.ctas == 0) return;
  if (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes ||
      reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) {
    throw std::runtime_error("flash_attn: fa3 forward: params.workspace needs the plan's "
                             "workspace_bytes of 16-byte aligned scratch");
  }
  // TMA views of the tensors (fa3_utils.h: tma_view).
  auto tensor = [&](auto* ptr, const Strides& s, int seqlen, int heads, int batches) {
    return tma_view(ptr, s, p.head_dim, seqlen, heads, batches);
  };
  const int rows_q = SeqInfo::view_rows_q(p), rows_k = SeqInfo::view_rows_k(p);
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{},
                             tensor(static_cast<const Element*>(p.q), p.q_strides, rows_q,
                                    p.heads, SeqInfo::view_batch(p)),
                             take<0, 2>(typename Tr::SmemQ{}));
  // K / V: multicast to the cluster's CTAs, each loading 1 / kClusterM of a tile. Paged pools
  // are viewed as (page_size, head_dim, heads_k, pages), a valid map the producer leaves for
  // its box maps below.
  const bool paged = p.block_table != nullptr;
  auto kv_tma = [&](const void* ptr, const Strides& s) {
    auto g = tensor(static_cast<const Element*>(ptr), s, paged ? p.page_size : rows_k, p.heads_k,
                    paged ? p.cache_batch : SeqInfo::view_batch_k(p));
    if constexpr (Tr::kClusterM > 1) {
      return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, g, take<0, 2>(typename Tr::SmemKV{}),
                           Int<Tr::kClusterM>{});
    } else {
      return make_tma_copy(SM90_TMA_LOAD{}, g, take<0, 2>(typename Tr::SmemKV{}));
    }
  };
  auto tma_k = kv_tma(p.k, p.k_strides);
  // FP8: V^T (head_dim, keys, heads_k, batch) in the workspace, keys contiguous
  // (fa3_fwd_fp8.h), written by fwd_fp8_vt just before the kernel.
  Element* vt = reinterpret_cast<Element*>(static_cast<char*>(p.workspace) + plan.vt_offset);
  auto tma_v = [&] {
    if constexpr (Tr::kFp8) {
      const int64_t keys = plan.vt_keys, head = keys * p.head_dim;
      auto g = make_tensor(make_gmem_ptr(static_cast<const Element*>(vt)),
                           make_shape(p.head_dim, int(keys), p.heads_k, p.batch),
                           make_stride(keys, _1{}, head, head * p.heads_k));
      return make_tma_copy(SM90_TMA_LOAD{}, g, take<0, 2>(typename Tr::SmemV{}));
    } else {
      return kv_tma(p.v, p.v_strides);
    }
  }();
  // O: stored from shared memory in 64 x 64 boxes where the kernel stages it (kStageO).
  auto tma_o = [&] {
    if constexpr (Tr::kStageO) {
      return make_tma_copy(SM90_TMA_STORE{},
                           tensor(static_cast<typename Tr::Out*>(p.o), p.o_strides, rows_q, p.heads,
                                  SeqInfo::view_batch(p)),
                           typename Tr::SmemOBox{});
    } else {
      return NoTma{};
    }
  }();
  using Tma = FwdTma<decltype(tma_q), decltype(tma_k), decltype(tma_v), decltype(tma_o)>;
  Tma tma{tma_q, tma_k, tma_v, tma_o, CUtensorMap{}, CUtensorMap{}, 0};
  if (paged) {
    // Boxes within a page: the rows a page and a tile have in common (fa3.h: a multiple of
    // kPageRows).
    using Paged = PagedKV<Tr>;
    tma.box_rows = std::gcd(p.page_size, Tr::kBlockN);
    if (!Paged::kEnabled || tma.box_rows % kPageRows != 0) {
      throw std::runtime_error("flash_attn: fa3 forward: a paged call reached a kernel without "
                               "the paged producer, or pages of " + std::to_string(p.page_size) +
                               " rows (the boxes need a multiple of 8)");
    }
    tma.paged_k = kv_box_map(p.k, p.k_strides, p, p.page_size, Paged::kBoxCols, tma.box_rows);
    tma.paged_v = kv_box_map(p.v, p.v_strides, p, p.page_size, Paged::kBoxCols, tma.box_rows);
  }
  auto kernel = fwd_kernel<Tr, Scheduler, Tma>;
  FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Tr::kSmemBytes));

  // The items in the tile order (common/tile_order.h): heaviest tiles first, heads grouped by
  // what fills the GPU once (one CTA per SM: every kernel takes all 64K registers of one). In
  // a cluster the order's tiles are groups of kClusterM query tiles.
  const int m_blocks = int((p.seqlen_q + Tr::kBlockM * Tr::kClusterM - 1) /
                           (Tr::kBlockM * Tr::kClusterM));
  const int heads_per_kv = p.heads / p.heads_k;
  const int64_t kv_bytes = int64_t(p.seqlen_k) * Tr::kHeadDim * 2 * sizeof(Element);
  Scheduler sched;
  sched.order = flash::tile_order(m_blocks, p.batch, p.heads, heads_per_kv,
                                  kv_bytes / heads_per_kv, p.l2_bytes, p.num_sms,
                                  plan.head_group);
  if (sched.order.items() != plan.items) {
    throw std::runtime_error("flash_attn: fa3 forward: the plan's tile is not the kernel's");
  }
  int64_t ctas = plan.ctas;
  if constexpr (Tr::kStreamK) {
    const StreamKLayout layout{plan.ctas, Tr::kConsumers, Tr::kHeadDim};
    int* ints = static_cast<int*>(p.workspace);
    sched.key_tiles = int(plan.key_tiles);
    sched.workers = int(plan.workers);
    sched.lattice = int(plan.lattice);
    sched.split_count = ints + StreamKLayout::kCountOffset;
    sched.split_flag = ints + layout.flag_offset();
    sched.split_part = reinterpret_cast<float4*>(ints + layout.ints());
  } else if constexpr (std::is_same_v<Scheduler, DynamicScheduler>) {
    sched.counter = static_cast<unsigned*>(p.workspace);
  }
  FLASH_CHECK_CUDA(cudaMemsetAsync(p.workspace, 0, plan.zero_bytes, stream));
  if constexpr (Tr::kFp8) {
    if (plan.vt_keys != fp8_vt_keys(p.seqlen_k) || p.cu_seqlens_q != nullptr || p.kv_cache ||
        p.block_table != nullptr) {
      throw std::runtime_error("flash_attn: fa3 forward: an FP8 call that is not a dense one, "
                               "or a plan without V^T");
    }
    const int64_t blocks =
        (plan.vt_keys + kFp8VtKeys - 1) / kFp8VtKeys * p.heads_k * int64_t(p.batch);
    if (blocks > INT_MAX || plan.vt_keys > INT_MAX) {
      throw std::runtime_error("flash_attn: fa3 forward: FP8's V^T needs more than 2^31 - 1 "
                               "blocks or key slots");
    }
    fwd_fp8_vt<Tr::kHeadDim><<<unsigned(blocks), 256, 0, stream>>>(
        p, reinterpret_cast<uint8_t*>(vt), int(plan.vt_keys));
    FLASH_CHECK_LAUNCH();
  }
  if constexpr (Tr::kClusterM > 1) {
    // As many clusters as run at once (or fewer items).
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr[1];
    config.gridDim = dim3(unsigned(ctas));
    config.blockDim = dim3(Tr::kThreads);
    config.dynamicSmemBytes = Tr::kSmemBytes;
    config.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = Tr::kClusterM;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    int clusters = 0;
    FLASH_CHECK_CUDA(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
    ctas = std::min<int64_t>(ctas, int64_t(clusters) * Tr::kClusterM);
    config.gridDim = dim3(unsigned(ctas));
    FLASH_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, p, tma, sched));
  } else {
    kernel<<<unsigned(ctas), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, tma, sched);
  }
  FLASH_CHECK_LAUNCH();
}

// The traits of a tile of the table (fa3_plan.h).
template <typename T, int kHeadDim, const TileShape& kTile, bool kScoreMod, int kClusterM = 1,
          bool kStreamK = false>
using TileTraits = FwdTraits<T, kHeadDim, kTile.block_n, kTile.stages, kScoreMod, kTile.schedule,
                             kTile.consumers, kClusterM, kStreamK>;

template <typename T, int kHeadDim, bool kScoreMod>
struct FwdKernels {
  static constexpr HeadDimTiles kTiles = fwd_tiles(kHeadDim, sizeof(T) == 1);
  static constexpr TileShape kWide = kTiles.wide, kNarrow = kTiles.narrow,
                             kStreamK = kTiles.stream_k;

  static void run(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
    switch (plan.kernel) {
      case FwdKernel::kStreamK:
        if constexpr (!kScoreMod && kStreamK.exists()) {
          return launch_fwd<TileTraits<T, kHeadDim, kStreamK, false, 1, true>>(p, plan, stream);
        }
        break;
      case FwdKernel::kCluster:
        if constexpr (!kScoreMod && kTiles.cluster_m > 1) {
          return launch_fwd<TileTraits<T, kHeadDim, kWide, false, kTiles.cluster_m>>(p, plan,
                                                                                    stream);
        }
        break;
      case FwdKernel::kNarrow:
        if constexpr (kNarrow.exists()) {
          return launch_fwd<TileTraits<T, kHeadDim, kNarrow, kScoreMod>>(p, plan, stream);
        }
        break;
      case FwdKernel::kWide:
        if constexpr (!kScoreMod || kTiles.wide_score_mod) {
          return launch_fwd<TileTraits<T, kHeadDim, kWide, kScoreMod>>(p, plan, stream);
        }
        break;
    }
    throw std::runtime_error("flash_attn: fa3 forward: the plan names a kernel head dim " +
                             std::to_string(kHeadDim) + " does not have");
  }
};

// The score mods (softcap, ALiBi) are a template flag: their code and registers stay out of the
// plain kernels. Masks and windows are runtime fields.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& p, const FwdPlan& plan, cudaStream_t stream) {
  if constexpr (sizeof(T) == 1) {  // FP8: no score mod (fwd_unsupported)
    if (plan.score_mod || !p.fp8) {
      throw std::runtime_error("flash_attn: fa3 forward: an FP8 kernel given a score mod, or "
                               "params not marked fp8");
    }
    FwdKernels<T, kHeadDim, false>::run(p, plan, stream);
  } else if (plan.score_mod) {
    FwdKernels<T, kHeadDim, true>::run(p, plan, stream);
  } else {
    FwdKernels<T, kHeadDim, false>::run(p, plan, stream);
  }
}

}  // namespace flash::fa3
