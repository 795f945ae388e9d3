// Stand-alone check and A/B timing of the FA3 backward at one head dim, without torch: random
// bf16 Q, K, V and dO; fa3's forward gives O and the lse; fa3's backward (the default and the
// deterministic mode) against a naive fp32 backward on the GPU from the same O and lse (max
// |error| of dQ, dK, dV against the largest reference value), whether two deterministic runs
// are equal bit for bit, and a timing (inputs L2-warm: compare the variants with each other,
// not with benchmark_attn.py).
//   nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -DNDEBUG \
//        -gencode arch=compute_90a,code=sm_90a [-DFA3_HDIM=128] -Icsrc -I<cutlass>/include \
//        csrc/tools/fa3_bwd_harness.cu -o fa3_bwd_harness
//   ./fa3_bwd_harness batch seqlen_q seqlen_k heads heads_k causal
// Environment: FA3_ITERS=n times n launches (default 20); FA3_NO_REF=1 skips the reference
// (slow at 16k) and reports the results as unchecked; FA3_SPLIT=k: Tuning::fa3_bwd_split;
// FA3_ZERO=0 / k: Tuning::fa3_bwd_zero (the accumulator zeroed by a memset / in k KB chunks);
// FA3_MODES=default or deterministic runs that mode alone (A/B runs: half the time);
// FA3_SPREAD=1: uneven dO rows, K and V rows (spread_rows), and dQ checked row by row.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fa3/fa3_bwd_launch.cuh"
#include "fa3/fa3_fwd_launch.cuh"
#include "tools/harness_timing.h"

#ifndef FA3_HDIM
#define FA3_HDIM 128
#endif
using Element = cutlass::bfloat16_t;
constexpr int kD = FA3_HDIM;

struct Shape4 {
  int b, sq, sk, h, hk;
  bool causal;
  __host__ __device__ bool visible(int i, int j) const { return !causal || j <= i + sk - sq; }
  __host__ __device__ int64_t q_row(int batch, int i, int head) const {
    return ((int64_t(batch) * sq + i) * h + head) * kD;
  }
  __host__ __device__ int64_t k_row(int batch, int j, int head_k) const {
    return ((int64_t(batch) * sk + j) * hk + head_k) * kD;
  }
  __host__ __device__ int64_t lse_index(int batch, int head, int i) const {
    return (int64_t(batch) * h + head) * sq + i;
  }
};

__device__ float dot(const Element* x, const Element* y) {
  float s = 0.f;
  for (int d = 0; d < kD; ++d) s += float(x[d]) * float(y[d]);
  return s;
}

// D = rowsum(dO o O), one thread per (batch, head, row).
__global__ void reference_dsum(Shape4 s, const Element* dout, const Element* o, float* dsum) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, head = blockIdx.y, batch = blockIdx.z;
  if (i < s.sq) dsum[s.lse_index(batch, head, i)] = dot(dout + s.q_row(batch, i, head),
                                                        o + s.q_row(batch, i, head));
}

// P = exp(q.k scale - lse), dS = P (dO.v - D); dQ = scale sum_j dS K_j. One thread a row.
__global__ void reference_dq(Shape4 s, const Element* q, const Element* k, const Element* v,
                             const Element* dout, const float* lse, const float* dsum,
                             float scale, float* dq) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, head = blockIdx.y, batch = blockIdx.z;
  if (i >= s.sq) return;
  const int head_k = head / (s.h / s.hk);
  const int64_t r = s.lse_index(batch, head, i);
  float acc[kD] = {};
  for (int j = 0; j < s.sk; ++j) {
    if (!s.visible(i, j)) continue;
    const Element* kr = k + s.k_row(batch, j, head_k);
    const float p = expf(dot(q + s.q_row(batch, i, head), kr) * scale - lse[r]);
    const float ds = p * (dot(dout + s.q_row(batch, i, head), v + s.k_row(batch, j, head_k)) -
                          dsum[r]);
    for (int d = 0; d < kD; ++d) acc[d] += ds * float(kr[d]);
  }
  for (int d = 0; d < kD; ++d) dq[s.q_row(batch, i, head) + d] = acc[d] * scale;
}

// dK = scale sum_i dS^T Q_i, dV = sum_i P^T dO_i over the group's heads. One thread a key.
__global__ void reference_dkv(Shape4 s, const Element* q, const Element* k, const Element* v,
                              const Element* dout, const float* lse, const float* dsum,
                              float scale, float* dk, float* dv) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x, head_k = blockIdx.y, batch = blockIdx.z;
  if (j >= s.sk) return;
  const Element* kr = k + s.k_row(batch, j, head_k);
  const Element* vr = v + s.k_row(batch, j, head_k);
  float acc_k[kD] = {}, acc_v[kD] = {};
  const int group = s.h / s.hk;
  for (int head = head_k * group; head < (head_k + 1) * group; ++head) {
    for (int i = 0; i < s.sq; ++i) {
      if (!s.visible(i, j)) continue;
      const int64_t r = s.lse_index(batch, head, i);
      const Element* qr = q + s.q_row(batch, i, head);
      const Element* dor = dout + s.q_row(batch, i, head);
      const float p = expf(dot(qr, kr) * scale - lse[r]);
      const float ds = p * (dot(dor, vr) - dsum[r]);
      for (int d = 0; d < kD; ++d) {
        acc_k[d] += ds * float(qr[d]);
        acc_v[d] += p * float(dor[d]);
      }
    }
  }
  for (int d = 0; d < kD; ++d) {
    dk[s.k_row(batch, j, head_k) + d] = acc_k[d] * scale;
    dv[s.k_row(batch, j, head_k) + d] = acc_v[d];
  }
}

// Uniform in [-1, 1), from a hash of (seed, index), on the device: the host's rand() took 1.8 s
// for the four tensors of 16k tokens x 16 heads x 128 (a CPU of the build machine).
__global__ void fill_uniform(Element* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) ^ uint32_t(i >> 32) * 0x9e3779b9u ^ seed * 0x85ebca6bu;
    h ^= h >> 16, h *= 0x7feb352du, h ^= h >> 15, h *= 0x846ca68bu, h ^= h >> 16;
    x[i] = Element(float(h >> 8) * (2.f / 16777216.f) - 1.f);
  }
}

// FA3_SPREAD=1: rows of dO from 1e-4 to 1e3 times the others (a hash of the row), key 3 three
// times the others and V row 7 ten times, per (batch, KV head): the deterministic mode's
// per-row scales then differ by up to 2^23 (tests/test_fa3_gpu.py's uneven-rows test).
__global__ void spread_rows(Element* dout, size_t nq, Element* k, Element* v, size_t nk,
                            Shape4 s) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < (nq > nk ? nq : nk);
       i += size_t(gridDim.x) * blockDim.x) {
    if (i < nq) {
      uint32_t h = uint32_t(i / kD) * 0x9e3779b9u;
      h ^= h >> 16, h *= 0x7feb352du, h ^= h >> 15;
      dout[i] = Element(float(dout[i]) * exp10f(-4.f + 7.f * float(h >> 8) / 16777216.f));
    }
    if (i < nk) {
      const size_t key = i / kD / s.hk % s.sk;
      if (key == 3) k[i] = Element(3.f * float(k[i]));
      if (key == 7) v[i] = Element(10.f * float(v[i]));
    }
  }
}

template <typename T>
static std::vector<T> download(const T* ptr, size_t n) {
  std::vector<T> host(n);
  cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

static void check_cuda(const char* what) {
  if (cudaDeviceSynchronize() != cudaSuccess) {
    printf("CUDA error in %s: %s\n", what, cudaGetErrorString(cudaGetLastError()));
    exit(1);
  }
}

int main(int argc, char** argv) {
  Shape4 s;
  s.b = argc > 1 ? atoi(argv[1]) : 2;
  s.sq = argc > 2 ? atoi(argv[2]) : 1000;
  s.sk = argc > 3 ? atoi(argv[3]) : 777;
  s.h = argc > 4 ? atoi(argv[4]) : 6;
  s.hk = argc > 5 ? atoi(argv[5]) : 2;
  s.causal = argc > 6 && atoi(argv[6]) != 0;
  const size_t nq = size_t(s.b) * s.sq * s.h * kD, nk = size_t(s.b) * s.sk * s.hk * kD;
  const size_t nrows = size_t(s.b) * s.h * s.sq;
  uint32_t seed = 1;
  auto fill = [&](size_t n) {
    Element* dev;
    cudaMalloc(&dev, n * sizeof(Element));
    fill_uniform<<<1024, 256>>>(dev, n, seed++);
    return dev;
  };
  Element *q = fill(nq), *k = fill(nk), *v = fill(nk), *dout = fill(nq);
  const bool spread = getenv("FA3_SPREAD") != nullptr;
  if (spread) spread_rows<<<1024, 256>>>(dout, nq, k, v, nk, s);
  Element *o, *dq, *dk, *dv;
  float *lse, *dsum, *ref_dq, *ref_dk, *ref_dv;
  cudaMalloc(&o, nq * 2); cudaMalloc(&dq, nq * 2); cudaMalloc(&dk, nk * 2); cudaMalloc(&dv, nk * 2);
  cudaMalloc(&lse, nrows * 4); cudaMalloc(&dsum, nrows * 4);
  cudaMalloc(&ref_dq, nq * 4); cudaMalloc(&ref_dk, nk * 4); cudaMalloc(&ref_dv, nk * 4);
  const float scale = 1.f / sqrtf(float(kD));

  flash::BwdParams p;
  p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;
  p.dout = dout; p.dq = dq; p.dk = dk; p.dv = dv;
  p.q_strides = {int64_t(s.sq) * s.h * kD, int64_t(s.h) * kD, kD};
  p.k_strides = p.v_strides = {int64_t(s.sk) * s.hk * kD, int64_t(s.hk) * kD, kD};
  p.o_strides = p.do_strides = p.dq_strides = p.q_strides;
  p.dk_strides = p.dv_strides = p.k_strides;
  p.batch = s.b; p.heads = s.h; p.heads_k = s.hk; p.seqlen_q = s.sq; p.seqlen_k = s.sk;
  p.head_dim = kD;
  p.softmax_scale = scale;
  p.softmax_scale_log2 = scale * float(M_LOG2E);
  p.causal = s.causal;
  p.window_left = -1; p.window_right = s.causal ? 0 : -1;
  int device = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&p.l2_bytes, cudaDevAttrL2CacheSize, device);

  // The forward: O and the lse that both backwards start from.
  const flash::fa3::FwdPlan fwd_plan = flash::fa3::plan_fwd(p, kD);
  void* fwd_workspace;
  cudaMalloc(&fwd_workspace, size_t(fwd_plan.workspace_bytes) + 16);
  p.workspace = fwd_workspace;
  p.workspace_bytes = fwd_plan.workspace_bytes + 16;
  flash::fa3::run_fwd<__nv_bfloat16, kD>(p, fwd_plan, 0);
  check_cuda("the forward");

  const bool check = getenv("FA3_NO_REF") == nullptr;
  const int iters = getenv("FA3_ITERS") ? atoi(getenv("FA3_ITERS")) : 20;
  std::vector<float> want_dq, want_dk, want_dv;
  if (check) {
    const dim3 rows((s.sq + 127) / 128, s.h, s.b), keys((s.sk + 127) / 128, s.hk, s.b);
    reference_dsum<<<rows, 128>>>(s, dout, o, dsum);
    reference_dq<<<rows, 128>>>(s, q, k, v, dout, lse, dsum, scale, ref_dq);
    reference_dkv<<<keys, 128>>>(s, q, k, v, dout, lse, dsum, scale, ref_dk, ref_dv);
    check_cuda("the reference");
    want_dq = download(ref_dq, nq), want_dk = download(ref_dk, nk), want_dv = download(ref_dv, nk);
  }

  bool all_ok = true;
  const char* modes = getenv("FA3_MODES");  // "default", "deterministic" or both (unset)
  for (const bool deterministic : {false, true}) {
    if (modes != nullptr && strcmp(modes, deterministic ? "deterministic" : "default") != 0) {
      continue;
    }
    p.deterministic = deterministic;
    flash::Tuning tuning;
    if (getenv("FA3_SPLIT")) tuning.fa3_bwd_split = atoi(getenv("FA3_SPLIT"));
    if (getenv("FA3_ZERO")) tuning.fa3_bwd_zero = atoi(getenv("FA3_ZERO"));
    const flash::fa3::BwdPlan plan = flash::fa3::plan_bwd(p, kD, tuning);
    if (plan.split_parts > 1) {
      printf("plan: %d items, %d of them split in %d parts\n", plan.items, plan.split_items,
             plan.split_parts);
    }
    void* workspace;
    cudaMalloc(&workspace, size_t(plan.workspace_bytes));
    // poison: NaN in fp32 (the launcher zeroes what it relies on)
    cudaMemset(workspace, 0xff, size_t(plan.workspace_bytes));
    p.workspace = workspace;
    p.workspace_bytes = plan.workspace_bytes;
    auto launch = [&] { flash::fa3::run_bwd<__nv_bfloat16, kD>(p, plan, 0); };
    cudaMemset(dq, 0xff, nq * 2);  // poison: NaN in bf16
    cudaMemset(dk, 0xff, nk * 2);
    cudaMemset(dv, 0xff, nk * 2);
    launch();
    check_cuda("the backward");
    const std::vector<Element> got[3] = {download(dq, nq), download(dk, nk), download(dv, nk)};
    const std::vector<float>* want[3] = {&want_dq, &want_dk, &want_dv};
    double rel[3] = {0, 0, 0};
    // Max |error| / max |reference| of each gradient into out; bf16 outputs: ~2^-8 of the
    // largest value, with headroom.
    auto within = [&](const std::vector<Element>* grads, double* out) {
      bool fine = true;
      for (int t = 0; t < 3 && check; ++t) {
        double err = 0, top = 0;
        for (size_t i = 0; i < grads[t].size(); ++i) {
          const double e = fabs(double(float(grads[t][i])) - (*want[t])[i]);
          err = e == e ? fmax(err, e) : INFINITY;
          top = fmax(top, fabs((*want[t])[i]));
        }
        out[t] = top > 0 ? err / top : err;
        fine = fine && out[t] < 2e-2;
      }
      return fine;
    };
    bool ok = within(got, rel);
    if (spread && check) {  // dQ row by row: the worst row's error against its largest value
      double worst = 0;
      size_t worst_row = 0, bad = 0;
      for (size_t r = 0; r < nq / kD; ++r) {
        double err = 0, top = 0;
        for (int d = 0; d < kD; ++d) {
          const double want_x = want_dq[r * kD + d];
          err = fmax(err, fabs(double(float(got[0][r * kD + d])) - want_x));
          top = fmax(top, fabs(want_x));
        }
        const double ratio = top > 0 ? err / top : err;
        bad += ratio > 1.0 / 64;
        if (ratio > worst) worst = ratio, worst_row = r;
      }
      printf("  %s dq rows: worst error / row max %.2e at row %zu (batch %zu, query %zu, head "
             "%zu), %zu rows over 1/64\n", deterministic ? "deterministic" : "default", worst,
             worst_row, worst_row / (size_t(s.sq) * s.h), worst_row / s.h % s.sq,
             worst_row % s.h, bad);
    }
    const float ms = ms_per_launch(launch, iters);
    check_cuda("the timed backward");
    // The last timed run is checked too (a race may show in one run of many; the worse error
    // of the two is printed). Deterministic: its gradients equal the checked run's bit for bit.
    bool equal = true;
    if (check || deterministic) {
      const std::vector<Element> again[3] = {download(dq, nq), download(dk, nk),
                                             download(dv, nk)};
      double rel_again[3] = {0, 0, 0};
      ok = within(again, rel_again) && ok;
      for (int t = 0; t < 3; ++t) rel[t] = fmax(rel[t], rel_again[t]);
      for (int t = 0; t < 3 && deterministic; ++t) {
        equal = equal && memcmp(again[t].data(), got[t].data(), again[t].size() * 2) == 0;
      }
      ok = ok && equal;
    }
    all_ok = all_ok && ok;
    const double flops =
        2.5 * 4.0 * s.b * s.h * double(s.sq) * s.sk * kD * (s.causal ? 0.5 : 1.0);
    printf("fa3 bwd %-13s hdim %d b=%d sq=%d sk=%d h=%d hk=%d causal=%d: max |err| / max |ref| "
           "dq %.2e dk %.2e dv %.2e%s -> %s; %.3f ms, %.1f TFLOP/s\n",
           deterministic ? "deterministic" : "default", kD, s.b, s.sq, s.sk, s.h, s.hk,
           int(s.causal), rel[0], rel[1], rel[2],
           deterministic ? (equal ? ", runs bitwise equal" : ", RUNS DIFFER") : "",
           !ok ? "FAIL" : check ? "OK" : "unchecked", ms, flops / (ms * 1e-3) / 1e12);
    cudaFree(workspace);
  }
  return all_ok ? 0 : 1;
}
