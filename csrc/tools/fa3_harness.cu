// Stand-alone check of the FA3 v0 forward (before it is wired into flash_attn._C): random bf16
// Q, K, V; the kernel against a naive fp32 reference on the GPU; max |error| and a timing.
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//        -Icsrc -I<cutlass>/include csrc/tools/fa3_harness.cu -o fa3_harness
//   ./fa3_harness batch seqlen_q seqlen_k heads heads_k causal
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fa3/fa3_fwd_launch.cuh"

using Element = cutlass::bfloat16_t;
constexpr int kD = 128;
using Tr = flash::fa3::FwdTraits<Element, kD, 128, 2>;

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
  Element *q, *k, *v, *o;
  float *ref_o, *ref_lse, *lse;
  cudaMalloc(&q, nq * 2); cudaMalloc(&k, nk * 2); cudaMalloc(&v, nk * 2); cudaMalloc(&o, nq * 2);
  cudaMalloc(&ref_o, nq * 4); cudaMalloc(&ref_lse, size_t(b) * h * sq * 4);
  cudaMalloc(&lse, size_t(b) * h * sq * 4);
  cudaMemcpy(q, hq.data(), nq * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(k, hk_.data(), nk * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(v, hv.data(), nk * 2, cudaMemcpyHostToDevice);
  cudaMemset(o, 0xff, nq * 2);  // poison: NaN in bf16
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

  flash::fa3::launch_fwd<Tr>(p, 0);
  reference<<<dim3((sq + 127) / 128, h, b), 128>>>(q, k, v, ref_o, ref_lse, b, sq, sk, h, hk,
                                                   causal, scale);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    printf("CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  std::vector<Element> got(nq);
  std::vector<float> want(nq), got_lse(size_t(b) * h * sq), want_lse(got_lse.size());
  cudaMemcpy(got.data(), o, nq * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(want.data(), ref_o, nq * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(got_lse.data(), lse, got_lse.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(want_lse.data(), ref_lse, want_lse.size() * 4, cudaMemcpyDeviceToHost);
  double err = 0, lse_err = 0;
  for (size_t i = 0; i < nq; ++i) err = fmax(err, fabs(double(float(got[i])) - want[i]));
  for (size_t i = 0; i < got_lse.size(); ++i) {
    if (std::isinf(want_lse[i])) continue;
    lse_err = fmax(lse_err, fabs(double(got_lse[i]) - want_lse[i]));
  }
  // bf16 rounding of O alone is ~2^-9 relative; |O| <= 1 here.
  printf("fa3 v0 b=%d sq=%d sk=%d h=%d hk=%d causal=%d: max |O err| %.3e, max |lse err| %.3e -> %s\n",
         b, sq, sk, h, hk, causal, err, lse_err, err < 1e-2 && lse_err < 1e-3 ? "OK" : "FAIL");

  cudaEvent_t t0, t1;
  cudaEventCreate(&t0); cudaEventCreate(&t1);
  for (int i = 0; i < 3; ++i) flash::fa3::launch_fwd<Tr>(p, 0);
  cudaEventRecord(t0);
  const int iters = 20;
  for (int i = 0; i < iters; ++i) flash::fa3::launch_fwd<Tr>(p, 0);
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  const double flops = 4.0 * b * h * double(sq) * sk * kD * (causal ? 0.5 : 1.0);
  printf("  %.3f ms per call, %.1f TFLOP/s (harness timing, inputs L2-warm)\n", ms / iters,
         flops / (ms / iters * 1e-3) / 1e12);
  return err < 1e-2 && lse_err < 1e-3 ? 0 : 2;
}
