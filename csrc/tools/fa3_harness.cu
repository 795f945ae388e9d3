// Stand-alone check and A/B timing of the FA3 forward's kernels at one head dim, without torch:
// random bf16 Q, K, V; each variant against a naive fp32 reference on the GPU; max |error| and
// a timing (inputs L2-warm: compare variants with each other, not with benchmark_attn.py).
//   nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -DNDEBUG \
//        -gencode arch=compute_90a,code=sm_90a [-DFA3_HDIM=128] -Icsrc -I<cutlass>/include \
//        csrc/tools/fa3_harness.cu -o fa3_harness
//   ./fa3_harness batch seqlen_q seqlen_k heads heads_k causal [variant index; default all]
// Environment: FA3_ITERS=n times n launches (default 20); FA3_NO_REF=1 skips the reference
// (slow at 16k: seconds per call) and reports the result as unchecked; FA3_KSPIKE=keys,factor
// scales the K rows of the first keys keys (walked last) by factor: logits that jump late in
// the walk, for the lazy softmax step's settle() (fa3_softmax.h); FA3_SK_WORKERS sets the
// stream-K variant's workers.
// Variants, each a plan (fa3_plan.h) run by the launcher: the plan the call gets; the table's
// wide and narrow tiles; the wide tile with the other schedule (serial / overlap); the call's
// plan on a grid of one CTA per item; clusters of two (full attention); stream-K (full
// attention). With -DFA3_TUNE also the candidate tiles listed at the end of main.
#include <cuda_bf16.h>

#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fa3/fa3_fwd_launch.cuh"
#include "tools/harness_timing.h"

#ifndef FA3_HDIM
#define FA3_HDIM 128
#endif
using Element = cutlass::bfloat16_t;
constexpr int kD = FA3_HDIM;
template <int kBlockN, int kStages, flash::fa3::Schedule kSchedule, int kConsumers,
          int kClusterM = 1, bool kStreamK = false>
using Traits = flash::fa3::FwdTraits<__nv_bfloat16, kD, kBlockN, kStages, false, kSchedule,
                                     kConsumers, kClusterM, kStreamK>;

// One thread per (batch, head, query row): scores, softmax and O in fp32.
__global__ void reference(const Element* q, const Element* k, const Element* v, float* o,
                          float* lse, int b, int sq, int sk, int h, int hk, bool causal,
                          float scale) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= sq) return;
  const int head_k = head / (h / hk);
  const Element* qr = q + ((int64_t(batch) * sq + row) * h + head) * kD;
  const int last = causal ? row + sk - sq : sk - 1;
  float m = -INFINITY;
  for (int j = 0; j <= last && j < sk; ++j) {
    const Element* kr = k + ((int64_t(batch) * sk + j) * hk + head_k) * kD;
    float s = 0.f;
    for (int d = 0; d < kD; ++d) s += float(qr[d]) * float(kr[d]);
    m = fmaxf(m, s * scale);
  }
  float acc[kD] = {};
  float l = 0.f;
  for (int j = 0; j <= last && j < sk; ++j) {
    const Element* kr = k + ((int64_t(batch) * sk + j) * hk + head_k) * kD;
    const Element* vr = v + ((int64_t(batch) * sk + j) * hk + head_k) * kD;
    float s = 0.f;
    for (int d = 0; d < kD; ++d) s += float(qr[d]) * float(kr[d]);
    const float e = expf(s * scale - m);
    l += e;
    for (int d = 0; d < kD; ++d) acc[d] += e * float(vr[d]);
  }
  float* orow = o + ((int64_t(batch) * sq + row) * h + head) * kD;
  for (int d = 0; d < kD; ++d) orow[d] = l > 0.f ? acc[d] / l : 0.f;
  lse[(int64_t(batch) * h + head) * sq + row] = l > 0.f ? m + logf(l) : INFINITY;
}

int main(int argc, char** argv) {
  const int b = argc > 1 ? atoi(argv[1]) : 2, sq = argc > 2 ? atoi(argv[2]) : 1000;
  const int sk = argc > 3 ? atoi(argv[3]) : 777, h = argc > 4 ? atoi(argv[4]) : 4;
  const int hk = argc > 5 ? atoi(argv[5]) : 2, causal = argc > 6 ? atoi(argv[6]) : 0;
  const size_t nq = size_t(b) * sq * h * kD, nk = size_t(b) * sk * hk * kD;
  std::vector<Element> hq(nq), hk_(nk), hv(nk);
  srand(1);
  auto rnd = [] { return Element(float(rand()) / RAND_MAX * 2.f - 1.f); };
  for (auto& x : hq) x = rnd();
  for (auto& x : hk_) x = rnd();
  for (auto& x : hv) x = rnd();
  if (const char* spike = getenv("FA3_KSPIKE")) {  // "keys,factor": K rows below keys scaled
    int keys = 0;
    float factor = 1.f;
    sscanf(spike, "%d,%f", &keys, &factor);
    for (size_t i = 0; i < nk; ++i) {
      if (int(i / (size_t(hk) * kD) % sk) < keys) hk_[i] = Element(float(hk_[i]) * factor);
    }
  }
  Element *q, *k, *v, *o;
  float *ref_o, *ref_lse, *lse;
  cudaMalloc(&q, nq * 2); cudaMalloc(&k, nk * 2); cudaMalloc(&v, nk * 2); cudaMalloc(&o, nq * 2);
  cudaMalloc(&ref_o, nq * 4); cudaMalloc(&ref_lse, size_t(b) * h * sq * 4);
  cudaMalloc(&lse, size_t(b) * h * sq * 4);
  void* workspace;  // the scheduler's counter, stream-K's pieces
  const size_t workspace_bytes = size_t(64) << 20;
  cudaMalloc(&workspace, workspace_bytes);
  cudaMemcpy(q, hq.data(), nq * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(k, hk_.data(), nk * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(v, hv.data(), nk * 2, cudaMemcpyHostToDevice);
  const float scale = 1.f / sqrtf(float(kD));

  flash::FwdParams p;
  p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;
  p.q_strides = {int64_t(sq) * h * kD, int64_t(h) * kD, kD};
  p.k_strides = p.v_strides = {int64_t(sk) * hk * kD, int64_t(hk) * kD, kD};
  p.o_strides = p.q_strides;
  p.batch = b; p.heads = h; p.heads_k = hk; p.seqlen_q = sq; p.seqlen_k = sk; p.head_dim = kD;
  p.softmax_scale = scale;
  p.softmax_scale_log2 = scale * float(M_LOG2E);
  p.causal = causal != 0;
  p.window_left = -1; p.window_right = causal ? 0 : -1;
  p.workspace = workspace;
  p.workspace_bytes = int64_t(workspace_bytes);

  int device = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&p.l2_bytes, cudaDevAttrL2CacheSize, device);

  const bool check = getenv("FA3_NO_REF") == nullptr;
  const int iters = getenv("FA3_ITERS") ? atoi(getenv("FA3_ITERS")) : 20;
  if (check) {
    reference<<<dim3((sq + 127) / 128, h, b), 128>>>(q, k, v, ref_o, ref_lse, b, sq, sk, h, hk,
                                                     causal, scale);
  }
  std::vector<float> want(nq), want_lse(size_t(b) * h * sq);
  cudaMemcpy(want.data(), ref_o, nq * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(want_lse.data(), ref_lse, want_lse.size() * 4, cudaMemcpyDeviceToHost);
  bool all_ok = true;
  auto run = [&](const char* name, auto launch) {
    cudaMemset(o, 0xff, nq * 2);  // poison: NaN in bf16
    cudaMemset(lse, 0xff, want_lse.size() * 4);
    launch();
    if (cudaDeviceSynchronize() != cudaSuccess) {
      printf("CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
      exit(1);
    }
    std::vector<Element> got(nq);
    std::vector<float> got_lse(want_lse.size());
    cudaMemcpy(got.data(), o, nq * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(got_lse.data(), lse, got_lse.size() * 4, cudaMemcpyDeviceToHost);
    double err = 0, lse_err = 0;
    for (size_t i = 0; i < nq; ++i) {
      const double e = fabs(double(float(got[i])) - want[i]);
      err = e == e ? fmax(err, e) : INFINITY;
    }
    for (size_t i = 0; i < got_lse.size(); ++i) {
      if (std::isinf(want_lse[i]) && std::isinf(got_lse[i])) continue;
      const double e = fabs(double(got_lse[i]) - want_lse[i]);
      lse_err = e == e ? fmax(lse_err, e) : INFINITY;
    }
    const bool ok = !check || (err < 1e-2 && lse_err < 1e-3);  // bf16 O: ~2^-9 relative
    all_ok = all_ok && ok;
    const float ms = ms_per_launch(launch, iters);
    const double flops = 4.0 * b * h * double(sq) * sk * kD * (causal ? 0.5 : 1.0);
    printf("fa3 %-22s hdim %d b=%d sq=%d sk=%d h=%d hk=%d causal=%d: max |O err| %.3e, "
           "max |lse err| %.3e -> %s; %.3f ms, %.1f TFLOP/s\n", name, kD, b, sq, sk, h, hk,
           causal, err, lse_err, !check ? "unchecked" : ok ? "OK" : "FAIL", ms,
           flops / (ms * 1e-3) / 1e12);
  };
  // The variants compared; argv[7] picks one.
  using flash::fa3::FwdKernel, flash::fa3::FwdPlan, flash::fa3::Schedule, flash::fa3::TileShape;
  const int only = argc > 7 ? atoi(argv[7]) : -1;
  int index = 0;
  constexpr flash::fa3::HeadDimTiles kTiles = flash::fa3::fwd_tiles(kD);
  // A plan for a tile of our own: kernel kind, tile and cluster chosen, sized by the plan.
  auto plan_for = [&](FwdKernel kernel, TileShape tile, int cluster_m, flash::Tuning t = {}) {
    FwdPlan plan;
    plan.kernel = kernel;
    plan.tile = tile;
    plan.cluster_m = cluster_m;
    return flash::fa3::size_plan(p, kD, plan, t);
  };
  auto variant = [&](bool run_unasked, const std::string& name, auto launch) {
    if ((only < 0 && run_unasked) || only == index) run(name.c_str(), launch);
    ++index;
  };
  auto tile_name = [](const TileShape& t) {
    return std::to_string(t.block_n) + "x" + std::to_string(t.stages) +
           (t.schedule == Schedule::kSerial ? " serial" : " overlap") + " wg" +
           std::to_string(t.consumers);
  };
  // A tile of the table's, or a candidate (its traits from constants).
#define FA3_TILE(N, S, SCHEDULE, C, CM, KIND)                                                \
  variant(CM == 1 || !causal, tile_name({N, S, C, Schedule::SCHEDULE}) +                     \
                                  (CM > 1 ? " cluster " + std::to_string(CM) : ""),          \
          [&] {                                                                              \
            const FwdPlan plan = plan_for(KIND, {N, S, C, Schedule::SCHEDULE}, CM);          \
            flash::fa3::launch_fwd<Traits<N, S, Schedule::SCHEDULE, C, CM>>(p, plan, 0);     \
          });
  constexpr TileShape kWide = kTiles.wide, kSplit = kTiles.stream_k;
  [[maybe_unused]] constexpr TileShape kNarrow = kTiles.narrow;
  constexpr Schedule kOther =
      kWide.schedule == Schedule::kSerial ? Schedule::kOverlap : Schedule::kSerial;
  // The call's own plan, as the extension would run it.
  variant(true, "plan", [&] {
    const FwdPlan plan = flash::fa3::plan_fwd(p, kD);
    flash::fa3::run_fwd<__nv_bfloat16, kD>(p, plan, 0);
  });
  // The same on a grid of one CTA per item instead of the persistent one.
  variant(true, "plan, CTA per item", [&] {
    flash::Tuning t;
    t.fa3_ctas = int(flash::fa3::plan_fwd(p, kD).items);
    const FwdPlan plan = flash::fa3::plan_fwd(p, kD, t);
    flash::fa3::run_fwd<__nv_bfloat16, kD>(p, plan, 0);
  });
  variant(true, tile_name(kWide), [&] {
    const FwdPlan plan = plan_for(FwdKernel::kWide, kWide, 1);
    flash::fa3::launch_fwd<Traits<kWide.block_n, kWide.stages, kWide.schedule, kWide.consumers>>(
        p, plan, 0);
  });
  variant(true, tile_name({kWide.block_n, kWide.stages, kWide.consumers, kOther}), [&] {
    const FwdPlan plan = plan_for(FwdKernel::kWide, kWide, 1);
    flash::fa3::launch_fwd<Traits<kWide.block_n, kWide.stages, kOther, kWide.consumers>>(
        p, plan, 0);
  });
#if FA3_HDIM <= 128  // the head dims with a narrow tile (main is no template: no if constexpr)
  variant(true, "narrow " + tile_name(kNarrow), [&] {
    const FwdPlan plan = plan_for(FwdKernel::kNarrow, kNarrow, 1);
    flash::fa3::launch_fwd<Traits<kNarrow.block_n, kNarrow.stages, kNarrow.schedule,
                                  kNarrow.consumers>>(p, plan, 0);
  });
#endif
  // The wide tile in clusters of two CTAs that multicast K / V (full attention only).
  variant(!causal, tile_name(kWide) + " cluster 2", [&] {
    const FwdPlan plan = plan_for(FwdKernel::kCluster, kWide, 2);
    flash::fa3::launch_fwd<Traits<kWide.block_n, kWide.stages, kWide.schedule, kWide.consumers,
                                  2>>(p, plan, 0);
  });
  // Stream-K (full attention) on FA3_SK_WORKERS workers (default: the plan's rule, forced on).
  variant(!causal, "stream-K " + tile_name(kSplit), [&] {
    flash::Tuning t;
    if (getenv("FA3_SK_WORKERS")) t.fa3_ctas = atoi(getenv("FA3_SK_WORKERS"));
    const FwdPlan plan = plan_for(FwdKernel::kStreamK, kSplit, 1, t);
    flash::fa3::launch_fwd<Traits<kSplit.block_n, kSplit.stages, kSplit.schedule,
                                  kSplit.consumers, 1, true>>(p, plan, 0);
  });
#ifdef FA3_TUNE
  // Candidates beside the table's tiles (fa3_plan.h states their limits; docs/fa3_decisions.md
  // what they measured). #if, not if constexpr: main is no template.
#if FA3_HDIM == 64
  FA3_TILE(160, 2, kSerial, 3, 1, FwdKernel::kWide)
  FA3_TILE(128, 2, kSerial, 3, 1, FwdKernel::kWide)
#elif FA3_HDIM == 96
  FA3_TILE(96, 2, kSerial, 3, 1, FwdKernel::kWide)
  FA3_TILE(112, 2, kSerial, 3, 1, FwdKernel::kWide)
#elif FA3_HDIM == 128
  FA3_TILE(80, 2, kSerial, 3, 1, FwdKernel::kWide)
  FA3_TILE(96, 2, kSerial, 3, 1, FwdKernel::kWide)
  FA3_TILE(112, 2, kSerial, 3, 1, FwdKernel::kWide)
  FA3_TILE(176, 2, kSerial, 2, 1, FwdKernel::kWide)
#elif FA3_HDIM == 256
  FA3_TILE(64, 2, kOverlap, 2, 1, FwdKernel::kWide)
  FA3_TILE(64, 2, kOverlap, 2, 2, FwdKernel::kCluster)
#endif
#endif
#undef FA3_TILE
  return all_ok ? 0 : 2;
}
