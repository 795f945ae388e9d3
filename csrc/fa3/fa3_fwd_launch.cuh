// FA3 forward launcher: TMA descriptors over (seqlen, head_dim, heads, batch) views of Q, K,
// V, the score-mod variant, the persistent grid and its scheduler. Included by the generated
// instantiation files and the harness only.
#pragma once

#include <cute/tensor.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "common/check.h"
#include "fa3/fa3.h"
#include "fa3/fa3_fwd_kernel.cuh"
#include "fa3/fa3_tiles.h"

namespace flash::fa3 {

// Whether stream-K cuts the items past the lattice of `workers`: only where there are such
// items and every worker's range holds two key tiles or more.
inline bool stream_k_cuts(int64_t items, int64_t key_tiles, int64_t workers) {
  return items % workers != 0 && (items % workers) * key_tiles >= 2 * workers;
}

template <class Tr>
void launch_fwd(const FwdParams& p, cudaStream_t stream, int64_t max_ctas = 0) {
  using Element = typename Tr::Element;
  // A TMA descriptor needs every stride to be a multiple of 16 bytes, also that of a dimension
  // of extent 1, which the frontend leaves as it comes (a slice of a longer tensor can have
  // any). Such a stride is never stepped along: give it the extent of the dims inside it.
  auto tensor = [&](auto* ptr, const Strides& s, int seqlen, int heads) {
    const int64_t row = seqlen > 1 ? s.row : p.head_dim;
    const int64_t head = heads > 1 ? s.head : row * seqlen;
    const int64_t batch = p.batch > 1 ? s.batch : head * heads;
    // The TMA boxes are kHeadDim wide; columns past head_dim (<= kHeadDim) are zero-filled,
    // as are rows past seqlen.
    return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, p.head_dim, heads, p.batch),
                       make_stride(row, _1{}, head, batch));
  };
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{},
                             tensor(static_cast<const Element*>(p.q), p.q_strides, p.seqlen_q,
                                    p.heads),
                             take<0, 2>(typename Tr::SmemQ{}));
  // K / V: multicast to the cluster's CTAs, each loading 1 / kClusterM of a tile.
  auto kv_tma = [&](const void* ptr, const Strides& s) {
    auto g = tensor(static_cast<const Element*>(ptr), s, p.seqlen_k, p.heads_k);
    if constexpr (Tr::kClusterM > 1) {
      return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, g, take<0, 2>(typename Tr::SmemKV{}),
                           Int<Tr::kClusterM>{});
    } else {
      return make_tma_copy(SM90_TMA_LOAD{}, g, take<0, 2>(typename Tr::SmemKV{}));
    }
  };
  auto tma_k = kv_tma(p.k, p.k_strides);
  auto tma_v = kv_tma(p.v, p.v_strides);
  // O: stored from shared memory in 64 x 64 boxes where the kernel stages it (kStageO).
  auto tma_o = [&] {
    if constexpr (Tr::kStageO) {
      return make_tma_copy(SM90_TMA_STORE{},
                           tensor(static_cast<Element*>(p.o), p.o_strides, p.seqlen_q, p.heads),
                           typename Tr::SmemOBox{});
    } else {
      return NoTma{};
    }
  }();
  using Tma = FwdTma<decltype(tma_q), decltype(tma_k), decltype(tma_v), decltype(tma_o)>;
  const Tma tma{tma_q, tma_k, tma_v, tma_o};
  auto kernel = fwd_kernel<Tr, Tma>;
  FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Tr::kSmemBytes));
  // The order in which CTAs take (query tile, head) items: FA2's (fa2_tile_order.h), heaviest
  // tiles first, heads grouped by what fills the GPU once. The grid is persistent, one CTA per
  // SM, each producer loading the next tile while its consumers finish one (harness, H100,
  // bf16, full: +9..+26% at 512-2k, +0.5..+11% at 4k-16k over one CTA per item). The CTAs
  // take the next item from a counter in p.workspace as they free up (fa3_scheduler.h;
  // harness, causal: +1..+28% over one CTA per item, most at 512-2k).
  // max_ctas > 0 overrides the grid (the harness's A/B).
  // In a cluster the order's tiles are groups of kClusterM query tiles (fa3_fwd_kernel.cuh).
  if (Tr::kClusterM > 1 && (p.causal || p.window_left >= 0 || p.window_right >= 0)) {
    throw std::runtime_error("flash_attn: fa3 forward: the cluster kernel is full attention only");
  }
  const int m_blocks = int((p.seqlen_q + Tr::kBlockM * Tr::kClusterM - 1) /
                           (Tr::kBlockM * Tr::kClusterM));
  const int heads_per_kv = p.heads / p.heads_k;
  const int64_t kv_bytes = int64_t(p.seqlen_k) * Tr::kHeadDim * 2 * sizeof(Element);
  const int64_t resident = flash::fa2::resident_blocks(kernel, Tr::kThreads, Tr::kSmemBytes,
                                                       p.num_sms);
  TileScheduler sched;
  sched.order = flash::fa2::tile_order(m_blocks, p.batch, p.heads, heads_per_kv,
                                       kv_bytes / heads_per_kv, p.l2_bytes, resident);
  // Stream-K's grid: fa3.h's stream_k_workers (or max_ctas), more CTAs than items where it pays.
  int64_t max_items = sched.order.items();
  if constexpr (Tr::kStreamK) {
    static_assert(stream_k_tile(Tr::kHeadDim).block_n == Tr::kBlockN &&
                  stream_k_tile(Tr::kHeadDim).block_m == Tr::kBlockM &&
                  stream_k_tile(Tr::kHeadDim).consumers == Tr::kConsumers,
                  "fa3.h's stream_k_tile sizes its grid and workspace");
    max_items = max_ctas > 0 ? max_ctas : stream_k_workers(p, Tr::kHeadDim);  // or clusters
    if (max_items == 0) {
      throw std::runtime_error("flash_attn: fa3 forward: stream-K called where it does not run");
    }
  }
  int64_t ctas = std::min(max_items, max_ctas > 0 ? max_ctas : resident);
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attr[1];
  if constexpr (Tr::kClusterM > 1) {
    // One cluster per item up to as many clusters as fit at once.
    config.gridDim = dim3(unsigned(sched.order.items() * Tr::kClusterM));
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
    ctas = std::min(max_items, int64_t(max_ctas > 0 ? max_ctas : clusters)) *
           Tr::kClusterM;
    config.gridDim = dim3(unsigned(ctas));
  }
  if (ctas == 0) return;
  // The scheduler counts items in 32 bits (up to items + grid): 2^31 tiles of 128 or more
  // query rows would be more Q than a GPU holds.
  if (sched.order.items() + ctas > INT_MAX) {
    throw std::runtime_error("flash_attn: fa3 forward: more than 2^31 - 1 (query tile, head, "
                             "batch) items plus CTAs");
  }
  if (p.workspace == nullptr || p.workspace_bytes < fwd_workspace_bytes(p, Tr::kHeadDim) ||
      reinterpret_cast<uintptr_t>(p.workspace) % alignof(unsigned) != 0) {
    throw std::runtime_error("flash_attn: fa3 forward: params.workspace needs "
                             "fwd_workspace_bytes(params, kHeadDim) of aligned scratch");
  }
  sched.counter = static_cast<unsigned*>(p.workspace);
  int64_t zero_bytes = sizeof(*sched.counter);
  if constexpr (Tr::kStreamK) {
    const int64_t key_tiles = (p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
    const int64_t workers = ctas / Tr::kClusterM, items = sched.order.items();
    if (p.causal || p.window_left >= 0 || p.window_right >= 0 || p.seqlen_k == 0) {
      throw std::runtime_error("flash_attn: fa3 forward: stream-K is full attention only");
    }
    if (p.workspace_bytes < stream_k_bytes(ctas, stream_k_tile(Tr::kHeadDim)) ||
        items % workers * key_tiles > INT_MAX) {
      throw std::runtime_error("flash_attn: fa3 forward: stream-K needs stream_k_bytes() of "
                               "workspace and fewer remainder units");
    }
    sched.key_tiles = int(key_tiles);
    sched.workers = int(workers);
    // Without cuts (stream_k_cuts) every item is a lattice item: the plain static stride.
    sched.lattice = int(stream_k_cuts(items, key_tiles, workers) ? items / workers * workers
                                                                 : items);
    int* ints = static_cast<int*>(p.workspace);
    sched.split_count = ints + 64;
    sched.split_flag = sched.split_count + Tr::kConsumers * ctas;
    const int64_t int_count = stream_k_ints(ctas, stream_k_tile(Tr::kHeadDim));
    sched.split_part = reinterpret_cast<float4*>(ints + int_count);
    zero_bytes = int_count * 4;
  }
  FLASH_CHECK_CUDA(cudaMemsetAsync(sched.counter, 0, zero_bytes, stream));
  if constexpr (Tr::kClusterM > 1) {
    FLASH_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, p, tma, sched));
  } else {
    kernel<<<unsigned(ctas), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, tma, sched);
  }
  FLASH_CHECK_LAUNCH();
}

template <typename T, int kHeadDim, typename Tile, bool kScoreMod, int kClusterM = 1,
          bool kStreamK = false>
using TraitsOf = FwdTraits<T, kHeadDim, Tile::kBlockN, Tile::kStages, kScoreMod, Tile::kSchedule,
                           Tile::kConsumers, kClusterM, kStreamK>;

// FwdTile's wide or narrow tile (fa3_tiles.h) for this call.
template <typename T, int kHeadDim, bool kScoreMod>
void run_fwd_tile(const FwdParams& p, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDim>;
  if constexpr (!std::is_void_v<typename Tile::StreamK> && !kScoreMod) {
    if (stream_k_workers(p, kHeadDim) > 0) {
      launch_fwd<TraitsOf<T, kHeadDim, typename Tile::StreamK, kScoreMod, 1, true>>(p, stream);
      return;
    }
  }
  if constexpr (Tile::kClusterM > 1 && !kScoreMod) {
    const int64_t items = (p.seqlen_q + 64 * Tile::kConsumers - 1) / (64 * Tile::kConsumers) *
                          p.batch * p.heads;
    if (!p.causal && p.window_left < 0 && p.window_right < 0 && cluster_pays(p, items)) {
      launch_fwd<TraitsOf<T, kHeadDim, Tile, kScoreMod, Tile::kClusterM>>(p, stream);
      return;
    }
  }
  if constexpr (std::is_void_v<typename Tile::Narrow>) {
    launch_fwd<TraitsOf<T, kHeadDim, Tile, kScoreMod>>(p, stream);
  } else {
    using Narrow = TraitsOf<T, kHeadDim, typename Tile::Narrow, kScoreMod>;
    if constexpr (kScoreMod && !Tile::kWideScoreMod) {
      launch_fwd<Narrow>(p, stream);
    } else if (narrow_pays<Tile>(p)) {
      launch_fwd<Narrow>(p, stream);
    } else {
      launch_fwd<TraitsOf<T, kHeadDim, Tile, kScoreMod>>(p, stream);
    }
  }
}

template <typename T, int kHeadDim>
void run_fwd(const FwdParams& p, cudaStream_t stream) {
  // The score mods (softcap, ALiBi) are a template flag, as in FA2: their code and registers
  // stay out of the plain kernel. Masks and windows are runtime fields.
  if (p.softcap > 0.f || p.alibi_slopes != nullptr) {
    run_fwd_tile<T, kHeadDim, true>(p, stream);
  } else {
    run_fwd_tile<T, kHeadDim, false>(p, stream);
  }
}

}  // namespace flash::fa3
