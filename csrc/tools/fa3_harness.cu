// Stand-alone check and A/B timing of the FA3 forward's schedules (serial, intra-warpgroup
// overlap, ping-pong) at one head dim: random bf16 Q, K, V; each schedule against a naive fp32
// reference on the GPU; max |error| and a timing (inputs L2-warm: compare schedules with each
// other, not with benchmark_attn.py).
//   nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -DNDEBUG \
//        -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -gencode arch=compute_90a,code=sm_90a \
//        [-DFA3_HDIM=128] -Icsrc -I<cutlass>/include csrc/tools/fa3_harness.cu -o fa3_harness
//   ./fa3_harness batch seqlen_q seqlen_k heads heads_k causal [variant index; default all]
// Environment: FA3_ITERS=n times n launches (default 20); FA3_NO_REF=1 skips the reference
// (slow at 16k: seconds per call) and reports the result as unchecked; FA3_KSPIKE=keys,factor
// scales the K rows of the first keys keys (walked last) by factor: logits that jump late in
// the walk, for the lazy softmax step's settle() (fa3_softmax.h).
// Variants: FwdTile's tile with each schedule (on the launcher's persistent grid: a static
// stride when unmasked, the dynamic scheduler when causal), FwdTile's own on a grid of one CTA
// per tile, in 2-CTA clusters, and with stream-K (one CTA; at hdim 256 also clusters;
// FA3_SK_WORKERS sets the workers); with -DFA3_TUNE also the candidate tiles listed at the end
// of main. With -DFA3_TRACE each variant also reports where a consumer's item goes
// (fa3_trace.h's marks); add -DFA3_TRACE_EPI -DFA3_TRACE_NO_STEPS for the staged epilogue's
// phases alone, -DFA3_TRACE_TIME -DFA3_TRACE_NO_STEPS for a timeline across the CTAs in ns
// (entry, Q landed, last P V, stream-K merge, epilogue, per piece).
#include <cuda_bf16.h>

#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fa3/fa3_fwd_launch.cuh"

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
#ifdef FA3_TRACE
  // One more launch with clock64 marks (fa3_trace.h): where a consumer's item goes, averaged
  // over every CTA's items but its first and last, in SM cycles. An interval is averaged over
  // the records that have both of its marks; the count beside it says how many did.
  long long* trace;
  using flash::fa3::kTraceItems, flash::fa3::kTraceSlots;
  const size_t trace_n = size_t(p.num_sms) * kTraceItems * kTraceSlots;
  cudaMalloc(&trace, trace_n * 8);
  cudaMemcpyToSymbol(flash::fa3::fa3_trace, &trace, sizeof(trace));
  auto trace_report = [&](auto launch) {
    cudaMemset(trace, 0, trace_n * 8);
    launch();
    cudaDeviceSynchronize();
    std::vector<long long> t(trace_n);
    cudaMemcpy(t.data(), trace, trace_n * 8, cudaMemcpyDeviceToHost);
    struct Mean {
      double sum = 0;
      long n = 0;
      void add(long long from, long long to) {
        if (from != 0 && to != 0) sum += double(to - from), ++n;
      }
      void print(const char* name) const {
        printf("  %-46s %8.0f  (%ld records)\n", name, n ? sum / n : 0.0, n);
      }
    };
    // Overlap schedule, consumers 0 and 1 (fa3_trace.h): cycles in masked steps, their count,
    // cycles in unmasked steps, their count, and the items summed over.
    double steps[2][5] = {};
    Mean last_v_wait, last_pv;
    Mean item, q_wait, first, rest, epilogue, gap, q_load, q_after_loop, released, issued, tiles;
    for (int c = 0; c < p.num_sms; ++c) {
      auto at = [&](int k, int s) { return t[(size_t(c) * kTraceItems + k) * kTraceSlots + s]; };
      int items = 0;
      while (items < kTraceItems && at(items, 0) != 0) ++items;
      for (int k = 1; k + 1 < items; ++k) {
        if (at(k, 17) < 2) continue;  // items of one key tile have no rest
        for (int cw = 0; cw < 3; ++cw) {
          auto mark = [&](int k_, int i) { return at(k_, 5 * cw + i); };
          if (mark(k, 0) == 0) continue;  // no such consumer
          item.add(mark(k, 0), mark(k + 1, 0));
          q_wait.add(mark(k, 0), mark(k, 1));
          first.add(mark(k, 1), mark(k, 2));
          rest.add(mark(k, 2), mark(k, 3));
          epilogue.add(mark(k, 3), mark(k, 4));
          gap.add(mark(k, 4), mark(k + 1, 0));
          q_load.add(at(k, 16), at(k, 18));
          q_after_loop.add(mark(k - 1, 3), at(k, 18));
          released.add(at(k, 19 + cw), mark(k, 3));
          issued.add(at(k, 19 + cw), at(k + 1, 16));
          tiles.sum += double(at(k, 17)), ++tiles.n;
          if (cw < 2) {
            for (int j = 0; j < 4; ++j) steps[cw][j] += double(at(k, 24 + 4 * cw + j));
            steps[cw][4] += 1;
            last_v_wait.add(at(k, 32 + cw), at(k, 34 + cw));
            last_pv.add(at(k, 34 + cw), mark(k, 3));
          }
        }
      }
    }
#ifdef FA3_TRACE_TIME
    {
      // A timeline over the CTAs (ns from the first CTA's entry): min / mean / max per mark.
      long long t0 = LLONG_MAX;
      for (int c = 0; c < p.num_sms; ++c) {
        const long long e = t[(size_t(c) * kTraceItems) * kTraceSlots + 52];
        if (e != 0) t0 = std::min(t0, e);
      }
      const char* names[5] = {"entry", "Q landed", "last P V", "merged", "epilogue done"};
      for (int k = 0; k < 3; ++k) {
        for (int sl = 52; sl < 57; ++sl) {
          if (k > 0 && sl == 52) continue;
          long long lo = LLONG_MAX, hi = 0; double sum = 0; int n = 0;
          for (int c = 0; c < p.num_sms; ++c) {
            const long long v = t[(size_t(c) * kTraceItems + k) * kTraceSlots + sl];
            if (v == 0) continue;
            lo = std::min(lo, v - t0); hi = std::max(hi, v - t0); sum += double(v - t0); ++n;
          }
          if (n) {
            printf("  piece %d %-14s n=%3d  min %7lld  mean %9.0f  max %7lld ns\n", k,
                   names[sl - 52], n, lo, sum / n, hi);
          }
        }
      }
    }
#endif
    printf("trace, SM cycles per consumer item (%.1f key tiles):\n",
           tiles.n ? tiles.sum / tiles.n : 0.);
    item.print("item (one wait for Q to the next)");
    q_wait.print("waiting for Q");
    first.print("first key tile");
    rest.print("the other key tiles");
    epilogue.print("epilogue (stores issued with one Q buffer)");
    gap.print("to the next wait for Q");
    q_load.print("Q load: issued to landed (producer)");
    q_after_loop.print("Q landed after the previous item's last P V");
    released.print("Q released before the item's last P V ends");
    issued.print("next Q issued after this consumer released");
    last_v_wait.print("last P V: waiting for its V");
    last_pv.print("last P V: issued to done");
    {
      // The staged epilogue (hdim 256), per consumer: finalize, pack (+ consumer 1's wait for
      // consumer 0's last P V), stmatrix, barrier, TMA store issue + read wait, lse + barrier,
      // release.
      const int from[7] = {-1, 40, 50, 42, 44, 46, 48}, to[7] = {40, 50, 42, 44, 46, 48, -2};
      const char* name[7] = {"finalize", "pack (+c1 waits c0 PV)", "stmatrix+fence", "barrier",
                             "TMA store + read wait", "lse + barrier", "release"};
      for (int cw = 0; cw < 2; ++cw) {
        Mean m[7];
        for (int c = 0; c < p.num_sms; ++c) {
          auto at = [&](int k, int s) {
            return t[(size_t(c) * kTraceItems + k) * kTraceSlots + s];
          };
          for (int k = 1; k + 1 < kTraceItems && at(k + 1, 0) != 0; ++k) {
            for (int j = 0; j < 7; ++j) {
              const int a = from[j] == -1 ? 5 * cw + 3 : from[j] + cw;
              const int b = to[j] == -2 ? 5 * cw + 4 : to[j] + cw;
              m[j].add(at(k, a), at(k, b));
            }
          }
        }
        printf("  consumer %d epilogue:", cw);
        for (int j = 0; j < 7; ++j) {
          printf(" %s %.0f%s", name[j], m[j].n ? m[j].sum / m[j].n : 0.0, j < 6 ? "," : "\n");
        }
      }
    }
    for (int cw = 0; cw < 2; ++cw) {
      const double* st = steps[cw];
      printf("  consumer %d steps after the first: masked %.0f cycles x %.2f per item, unmasked "
             "%.0f x %.2f\n", cw, st[0] / fmax(st[1], 1), st[1] / fmax(st[4], 1),
             st[2] / fmax(st[3], 1), st[3] / fmax(st[4], 1));
    }
  };
#endif
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
    cudaEvent_t t0, t1;
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    for (int i = 0; i < 3; ++i) launch();
    cudaEventRecord(t0);
    for (int i = 0; i < iters; ++i) launch();
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    const double flops = 4.0 * b * h * double(sq) * sk * kD * (causal ? 0.5 : 1.0);
#ifdef FA3_TRACE
    trace_report(launch);
#endif
    printf("fa3 %-22s hdim %d b=%d sq=%d sk=%d h=%d hk=%d causal=%d: max |O err| %.3e, "
           "max |lse err| %.3e -> %s; %.3f ms, %.1f TFLOP/s\n", name, kD, b, sq, sk, h, hk,
           causal, err, lse_err, !check ? "unchecked" : ok ? "OK" : "FAIL", ms / iters,
           flops / (ms / iters * 1e-3) / 1e12);
  };
  // The variants compared: (kBlockN, kStages, schedule, consumer warpgroups) per head dim;
  // argv[7] picks one.
  using flash::fa3::Schedule;
  const int only = argc > 7 ? atoi(argv[7]) : -1;
  int index = 0;
// A cluster variant (CM > 1: full attention only) runs unasked only where the call is not causal.
#define FA3_VARIANT_CLUSTER(N, S, SCHEDULE, C, CM)                                         \
  if ((only < 0 && (CM == 1 || !causal)) || only == index) {                              \
    run((std::to_string(N) + "x" + std::to_string(S) + " " #SCHEDULE " wg" +               \
         std::to_string(C) + (CM > 1 ? " cluster " + std::to_string(CM) : "")).c_str(),   \
        [&] { flash::fa3::launch_fwd<Traits<N, S, Schedule::SCHEDULE, C, CM>>(p, 0); });   \
  }                                                                                       \
  ++index;
#define FA3_VARIANT(N, S, SCHEDULE, C) FA3_VARIANT_CLUSTER(N, S, SCHEDULE, C, 1)
  using Tile = flash::fa3::FwdTile<kD>;
  FA3_VARIANT(Tile::kBlockN, Tile::kStages, kSerial, Tile::kConsumers)
  FA3_VARIANT(Tile::kBlockN, Tile::kStages, kOverlap, Tile::kConsumers)
  FA3_VARIANT(Tile::kBlockN, Tile::kStages, kPingPong, 2)  // turns between two consumers
  // FwdTile's own, on a grid of one CTA per tile instead of the persistent one.
  if (only < 0 || only == index) {
    using Tr = Traits<Tile::kBlockN, Tile::kStages, Tile::kSchedule, Tile::kConsumers>;
    run("own, CTA per tile", [&] { flash::fa3::launch_fwd<Tr>(p, 0, INT64_MAX); });
  }
  ++index;
  // FwdTile's own in clusters of two CTAs that multicast K / V (experiment; full only).
  if ((only < 0 && !causal) || only == index) {
    using Tr = Traits<Tile::kBlockN, Tile::kStages, Tile::kSchedule, Tile::kConsumers, 2>;
    run("own, 2-CTA cluster", [&] { flash::fa3::launch_fwd<Tr>(p, 0); });
  }
  ++index;
  // FwdTile's stream-K kernel (fa3_scheduler.h; full only) on FA3_SK_WORKERS workers (default:
  // fa3.h's stream_k_workers, or one per SM where it says none); at hdim 256 also in clusters
  // of two (not dispatched: it spills).
  using SK = Tile::StreamK;
  const int64_t sk_rule = flash::fa3::stream_k_workers(p, kD);
  const int64_t sk_workers = getenv("FA3_SK_WORKERS") ? atoll(getenv("FA3_SK_WORKERS"))
                             : sk_rule > 0 ? sk_rule : int64_t(p.num_sms);
  if ((only < 0 && !causal) || only == index) {
    using Tr = Traits<SK::kBlockN, SK::kStages, SK::kSchedule, SK::kConsumers, 1, true>;
    run("own, stream-K", [&] { flash::fa3::launch_fwd<Tr>(p, 0, sk_workers); });
  }
  ++index;
#if FA3_HDIM == 256
  if ((only < 0 && !causal) || only == index) {
    using Tr = Traits<SK::kBlockN, SK::kStages, SK::kSchedule, SK::kConsumers, 2, true>;
    run("own, stream-K cluster", [&] { flash::fa3::launch_fwd<Tr>(p, 0, sk_workers / 2); });
  }
  ++index;
#endif
#ifdef FA3_TUNE
  // Candidates beside FwdTile's (wide) tile, its narrow tile first where it has one (fa3_tiles.h
  // states their limits and results).
  // #if, not if constexpr: main is no template, so if constexpr would compile every list.
#if FA3_HDIM == 64
  FA3_VARIANT(192, 2, kSerial, 2)
  FA3_VARIANT(160, 2, kSerial, 3)
  FA3_VARIANT(128, 2, kSerial, 3)
#elif FA3_HDIM == 96
  FA3_VARIANT(96, 2, kSerial, 3)
  FA3_VARIANT(112, 2, kSerial, 3)
  FA3_VARIANT(128, 2, kSerial, 2)
#elif FA3_HDIM == 128
  FA3_VARIANT(128, 2, kSerial, 2)
  FA3_VARIANT(80, 2, kSerial, 3)
  FA3_VARIANT(96, 2, kSerial, 3)
  FA3_VARIANT(112, 2, kSerial, 3)
  FA3_VARIANT(176, 2, kSerial, 2)
#elif FA3_HDIM == 256
  FA3_VARIANT(64, 2, kOverlap, 2)
  FA3_VARIANT_CLUSTER(64, 2, kOverlap, 2, 2)
#endif
#endif
#undef FA3_VARIANT
#undef FA3_VARIANT_CLUSTER
  return all_ok ? 0 : 2;
}
