// fa1_harness: runs the FA1 forward and backward from plain CUDA (no Python, no torch), checks
// them against a float64 CPU reference on small shapes and times them with CUDA events. For
// kernel work and for compute-sanitizer:
//
//   fa1_harness [b sq sk h hk d causal] [--dtype fp16|bf16] [--iters N] [--seed S]
//               [--q-tiles N] [--no-bwd] [--deterministic] [--check | --no-check]
//   compute-sanitizer --tool memcheck build/cmake/fa1_harness 1 113 203 6 2 64 1 --iters 0
//
// Tensors are (b, s, h, d) contiguous, d a multiple of 8 (the frontend pads; this tool does not).
// Every buffer is its own exactly-sized cudaMalloc and every output is poisoned with NaN first,
// so memcheck sees any overrun and the check sees any element left unwritten.
// Exit status: 0 pass, 1 mismatch, 2 bad arguments, 3 CUDA error.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/check.h"
#include "fa1/fa1.h"

namespace {

using FwdFn = void (*)(const flash::FwdParams&, const flash::fa1::FwdPlan&, cudaStream_t);
using BwdFn = void (*)(const flash::BwdParams&, const flash::fa1::BwdPlan&, cudaStream_t);

template <typename Fn>
struct Kernel {
  std::string dtype;
  int hdim;
  Fn fn;
};

std::vector<Kernel<FwdFn>> g_fwd;
std::vector<Kernel<BwdFn>> g_bwd;

void add_fwd(const char* dtype, int hdim, FwdFn fn) { g_fwd.push_back({dtype, hdim, fn}); }
void add_bwd(const char* dtype, int hdim, BwdFn fn) { g_bwd.push_back({dtype, hdim, fn}); }

// The FA1 kernels this build contains, from the generated table; other families are not this
// tool's business.
void register_kernels() {
#define FLASH_HARNESS_fa1(direction, T, dtype_name, hdim) \
  add_##direction(#dtype_name, hdim, &flash::fa1::run_##direction<T, hdim>);
#define FLASH_HARNESS_fa2(...)
#define FLASH_HARNESS_fa3(...)
#define FLASH_CONFIG(family, direction, T, dtype_name, hdim, min_arch, max_arch) \
  FLASH_HARNESS_##family(direction, T, dtype_name, hdim)
#include "generated/dispatch_table.inc"
#undef FLASH_CONFIG
}

// The instantiation that serves head dim d: the smallest listed head dim >= d.
template <typename Fn>
const Kernel<Fn>* pick(const std::vector<Kernel<Fn>>& table, const std::string& dtype, int d) {
  const Kernel<Fn>* best = nullptr;
  for (const auto& k : table) {
    if (k.dtype == dtype && k.hdim >= d && (best == nullptr || k.hdim < best->hdim)) best = &k;
  }
  return best;
}

template <typename Fn>
std::string listing(const std::vector<Kernel<Fn>>& table) {
  std::string s;
  for (const auto& k : table) s += " " + k.dtype + "/hdim" + std::to_string(k.hdim);
  return s.empty() ? " (none)" : s;
}

float to_float(__half x) { return __half2float(x); }
float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> T from_float(float x);
template <> __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { FLASH_CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(n, 1))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void poison() { FLASH_CHECK_CUDA(cudaMemset(ptr, 0xFF, bytes)); }  // NaN in fp16/bf16/fp32
  template <typename T> T* as() const { return static_cast<T*>(ptr); }
};

struct Args {
  int b = 2, sq = 113, sk = 203, h = 6, hk = 2, d = 64;
  bool causal = true;
  std::string dtype = "fp16";
  int iters = 20;
  unsigned seed = 0;
  bool bwd = true;
  bool deterministic = false;
  int q_tiles = 0;  // Tuning::fa1_q_tiles; 0: the launcher's choice
  int check = -1;  // -1: only when the CPU reference is cheap
};

// A (b, s, heads, d) tensor on the host, its values already rounded to the element type.
struct HostTensor {
  int b, s, heads, d;
  std::vector<float> v;
  HostTensor(int b_, int s_, int h_, int d_) : b(b_), s(s_), heads(h_), d(d_), v(size_t(b_) * s_ * h_ * d_) {}
  float& at(int bi, int si, int hi, int di) { return v[((size_t(bi) * s + si) * heads + hi) * d + di]; }
  flash::Strides strides() const { return {int64_t(s) * heads * d, int64_t(heads) * d, d}; }
};

struct Reference {
  HostTensor o, dq, dk, dv;
  std::vector<float> lse;  // (b, h, sq)
};

// Float64 attention, forward and backward, straight from the definitions. Causal aligns to the
// bottom-right corner; query head hi reads K/V head hi / (h / hk).
Reference reference(const Args& a, HostTensor& q, HostTensor& k, HostTensor& v, HostTensor& dout,
                    double scale) {
  Reference r{HostTensor(a.b, a.sq, a.h, a.d), HostTensor(a.b, a.sq, a.h, a.d),
              HostTensor(a.b, a.sk, a.hk, a.d), HostTensor(a.b, a.sk, a.hk, a.d),
              std::vector<float>(size_t(a.b) * a.h * a.sq)};
  std::vector<double> dk(r.dk.v.size(), 0.0), dv(r.dv.v.size(), 0.0);
  std::vector<double> p(a.sk), dp(a.sk), o(a.d);
  for (int bi = 0; bi < a.b; ++bi)
    for (int hi = 0; hi < a.h; ++hi) {
      const int kh = hi / (a.h / a.hk);
      for (int i = 0; i < a.sq; ++i) {
        const int n = a.causal ? std::clamp(i + a.sk - a.sq + 1, 0, a.sk) : a.sk;  // keys seen
        float& lse = r.lse[(size_t(bi) * a.h + hi) * a.sq + i];
        if (n == 0) {  // a row that sees no key: O = 0, LSE = +inf, no gradient
          lse = INFINITY;
          for (int di = 0; di < a.d; ++di) r.o.at(bi, i, hi, di) = r.dq.at(bi, i, hi, di) = 0.f;
          continue;
        }
        double m = -INFINITY;
        for (int j = 0; j < n; ++j) {
          double s = 0;
          for (int di = 0; di < a.d; ++di) s += double(q.at(bi, i, hi, di)) * k.at(bi, j, kh, di);
          p[j] = s * scale;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (int j = 0; j < n; ++j) l += (p[j] = std::exp(p[j] - m));
        for (int j = 0; j < n; ++j) p[j] /= l;
        lse = float(m + std::log(l));
        std::fill(o.begin(), o.end(), 0.0);
        for (int j = 0; j < n; ++j)
          for (int di = 0; di < a.d; ++di) o[di] += p[j] * v.at(bi, j, kh, di);
        for (int di = 0; di < a.d; ++di) r.o.at(bi, i, hi, di) = float(o[di]);
        // dP = dO V^T, D = rowsum(P * dP) = rowsum(dO * O), dS = P * (dP - D)
        double dsum = 0;
        for (int j = 0; j < n; ++j) {
          double s = 0;
          for (int di = 0; di < a.d; ++di) s += double(dout.at(bi, i, hi, di)) * v.at(bi, j, kh, di);
          dp[j] = s;
          dsum += p[j] * s;
        }
        for (int di = 0; di < a.d; ++di) {
          double dq = 0;
          for (int j = 0; j < n; ++j) dq += p[j] * (dp[j] - dsum) * k.at(bi, j, kh, di);
          r.dq.at(bi, i, hi, di) = float(dq * scale);
        }
        for (int j = 0; j < n; ++j) {
          const double ds = p[j] * (dp[j] - dsum) * scale;
          const size_t row = ((size_t(bi) * a.sk + j) * a.hk + kh) * a.d;
          for (int di = 0; di < a.d; ++di) {
            dk[row + di] += ds * q.at(bi, i, hi, di);      // dK = dS^T Q
            dv[row + di] += p[j] * dout.at(bi, i, hi, di);  // dV = P^T dO
          }
        }
      }
    }
  for (size_t e = 0; e < dk.size(); ++e) r.dk.v[e] = float(dk[e]), r.dv.v[e] = float(dv[e]);
  return r;
}

template <typename T>
void upload(const DeviceBuffer& dst, const HostTensor& src) {
  std::vector<T> tmp(src.v.size());
  for (size_t e = 0; e < tmp.size(); ++e) tmp[e] = from_float<T>(src.v[e]);
  FLASH_CHECK_CUDA(cudaMemcpy(dst.ptr, tmp.data(), tmp.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <typename T>
std::vector<float> download(const DeviceBuffer& src) {
  std::vector<T> tmp(src.bytes / sizeof(T));
  FLASH_CHECK_CUDA(cudaMemcpy(tmp.data(), src.ptr, src.bytes, cudaMemcpyDeviceToHost));
  std::vector<float> out(tmp.size());
  for (size_t e = 0; e < tmp.size(); ++e) out[e] = to_float(tmp[e]);
  return out;
}

// |got - want| <= tol * (1 + |want|) everywhere, infinities matching exactly; NaN never passes.
bool compare(const char* name, const std::vector<float>& got, const std::vector<float>& want,
             double tol, double magnitude = 0) {
  double worst = 0;
  size_t worst_at = 0, bad = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    double err = std::isinf(want[e]) ? (got[e] == want[e] ? 0.0 : INFINITY)
                                     : std::fabs(double(got[e]) - want[e]);
    if (std::isnan(got[e])) err = INFINITY;
    const double allowed = tol * (1 + std::max(magnitude, std::isinf(want[e]) ? 0.0 : std::fabs(want[e])));
    if (!(err <= allowed)) ++bad;
    if (!(err <= worst)) worst = err, worst_at = e;
  }
  std::printf("  %-4s max |err| %.3e at %zu (got %g, want %g)  %s\n", name, worst, worst_at,
              got.empty() ? 0.f : got[worst_at], want.empty() ? 0.f : want[worst_at],
              bad ? "MISMATCH" : "ok");
  if (bad) std::printf("  %-4s %zu of %zu elements outside tolerance %.1e\n", name, bad, want.size(), tol);
  return bad == 0;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float e : x) m = std::max(m, double(std::fabs(e)));
  return m;
}

template <typename F>
float median_ms(int iters, F&& launch) {
  cudaEvent_t start, stop;
  FLASH_CHECK_CUDA(cudaEventCreate(&start));
  FLASH_CHECK_CUDA(cudaEventCreate(&stop));
  for (int w = 0; w < 3; ++w) launch();
  std::vector<float> ms(iters);
  for (int it = 0; it < iters; ++it) {
    FLASH_CHECK_CUDA(cudaEventRecord(start));
    launch();
    FLASH_CHECK_CUDA(cudaEventRecord(stop));
    FLASH_CHECK_CUDA(cudaEventSynchronize(stop));
    FLASH_CHECK_CUDA(cudaEventElapsedTime(&ms[it], start, stop));
  }
  FLASH_CHECK_CUDA(cudaEventDestroy(start));
  FLASH_CHECK_CUDA(cudaEventDestroy(stop));
  std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
  return ms[iters / 2];
}

template <typename T>
int run(const Args& a) {
  const auto* fwd = pick(g_fwd, a.dtype, a.d);
  if (fwd == nullptr) {
    std::fprintf(stderr, "no FA1 forward kernel for %s head dim %d in this build; built:%s\n",
                 a.dtype.c_str(), a.d, listing(g_fwd).c_str());
    return 2;
  }
  const auto* bwd = a.bwd ? pick(g_bwd, a.dtype, a.d) : nullptr;
  if (a.bwd && bwd == nullptr)
    std::printf("no FA1 backward kernel for %s head dim %d in this build (built:%s); forward only\n",
                a.dtype.c_str(), a.d, listing(g_bwd).c_str());

  int device = 0, sms = 0, major = 0, minor = 0;
  cudaDeviceProp prop;
  FLASH_CHECK_CUDA(cudaGetDevice(&device));
  FLASH_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  std::printf("%s (sm%d%d, %d SMs): b=%d sq=%d sk=%d h=%d hk=%d d=%d causal=%d %s, kernel hdim %d%s\n",
              prop.name, major, minor, sms, a.b, a.sq, a.sk, a.h, a.hk, a.d, int(a.causal),
              a.dtype.c_str(), fwd->hdim, a.deterministic ? ", deterministic bwd" : "");

  std::mt19937 rng(a.seed);
  std::normal_distribution<float> normal;
  auto random_tensor = [&](int s, int heads) {
    HostTensor t(a.b, s, heads, a.d);
    for (float& e : t.v) e = to_float(from_float<T>(normal(rng)));  // exactly what the GPU sees
    return t;
  };
  HostTensor q = random_tensor(a.sq, a.h), k = random_tensor(a.sk, a.hk),
             v = random_tensor(a.sk, a.hk), dout = random_tensor(a.sq, a.h);

  const size_t q_bytes = q.v.size() * sizeof(T), kv_bytes = k.v.size() * sizeof(T);
  DeviceBuffer d_q(q_bytes), d_k(kv_bytes), d_v(kv_bytes), d_o(q_bytes),
      d_lse(size_t(a.b) * a.h * a.sq * sizeof(float));
  upload<T>(d_q, q);
  upload<T>(d_k, k);
  upload<T>(d_v, v);
  d_o.poison();
  d_lse.poison();

  flash::FwdParams p;
  p.q = d_q.ptr, p.k = d_k.ptr, p.v = d_v.ptr, p.o = d_o.ptr, p.lse = d_lse.as<float>();
  p.q_strides = q.strides(), p.k_strides = k.strides(), p.v_strides = v.strides();
  p.o_strides = q.strides();
  p.batch = a.b, p.heads = a.h, p.heads_k = a.hk;
  p.seqlen_q = a.sq, p.seqlen_k = a.sk, p.head_dim = a.d;
  p.softmax_scale = 1.f / std::sqrt(float(a.d));
  p.softmax_scale_log2 = p.softmax_scale * float(M_LOG2E);
  p.causal = a.causal;
  p.num_sms = sms;
  p.arch = major * 10 + minor;
  p.code_arch = p.arch;  // the harness is built for the GPU it runs on
  flash::Tuning tuning;
  tuning.fa1_q_tiles = a.q_tiles;
  const flash::fa1::FwdPlan plan = flash::fa1::plan_fwd(p, fwd->hdim, tuning);
  DeviceBuffer d_fwd_ws(size_t(plan.workspace_bytes));
  p.workspace = d_fwd_ws.ptr, p.workspace_bytes = int64_t(d_fwd_ws.bytes);

  fwd->fn(p, plan, nullptr);
  FLASH_CHECK_CUDA(cudaDeviceSynchronize());

  // The backward reads O and LSE of the forward above.
  std::unique_ptr<DeviceBuffer> d_dout, d_dq, d_dk, d_dv, d_bwd_ws;
  flash::BwdParams bp;
  flash::fa1::BwdPlan bwd_plan;
  if (bwd != nullptr) {
    d_dout = std::make_unique<DeviceBuffer>(q_bytes);
    d_dq = std::make_unique<DeviceBuffer>(q_bytes);
    d_dk = std::make_unique<DeviceBuffer>(kv_bytes);
    d_dv = std::make_unique<DeviceBuffer>(kv_bytes);
    upload<T>(*d_dout, dout);
    d_dq->poison();
    d_dk->poison();
    d_dv->poison();
    static_cast<flash::FwdParams&>(bp) = p;
    bwd_plan = flash::fa1::plan_bwd(bp, bwd->hdim);
    d_bwd_ws = std::make_unique<DeviceBuffer>(size_t(bwd_plan.workspace_bytes));
    bp.workspace = d_bwd_ws->ptr, bp.workspace_bytes = int64_t(d_bwd_ws->bytes);  // the launcher carves it
    bp.deterministic = a.deterministic;
    bp.dout = d_dout->ptr, bp.dq = d_dq->ptr, bp.dk = d_dk->ptr, bp.dv = d_dv->ptr;
    bp.do_strides = q.strides(), bp.dq_strides = q.strides();
    bp.dk_strides = k.strides(), bp.dv_strides = v.strides();
    bwd->fn(bp, bwd_plan, nullptr);
    FLASH_CHECK_CUDA(cudaDeviceSynchronize());
  }

  bool pass = true;
  const double work = double(a.b) * a.h * a.sq * a.sk * a.d;
  const bool check = a.check == 1 || (a.check == -1 && work <= double(1 << 27));
  if (check) {
    // Tolerances: a few units in the last place of the element type, relative to the magnitude.
    const double eps = a.dtype == "bf16" ? 1.0 / 128 : 1.0 / 1024;
    Reference r = reference(a, q, k, v, dout, p.softmax_scale);
    std::printf("check against the float64 reference:\n");
    pass &= compare("out", download<T>(d_o), r.o.v, 4 * eps);
    std::vector<float> lse(d_lse.bytes / sizeof(float));
    FLASH_CHECK_CUDA(cudaMemcpy(lse.data(), d_lse.ptr, d_lse.bytes, cudaMemcpyDeviceToHost));
    pass &= compare("lse", lse, r.lse, 1e-3);
    if (bwd != nullptr) {  // gradients: relative to the tensor's largest element
      pass &= compare("dq", download<T>(*d_dq), r.dq.v, 8 * eps, max_abs(r.dq.v));
      pass &= compare("dk", download<T>(*d_dk), r.dk.v, 8 * eps, max_abs(r.dk.v));
      pass &= compare("dv", download<T>(*d_dv), r.dv.v, 8 * eps, max_abs(r.dv.v));
    }
  } else {
    std::printf("check skipped (%s)\n", a.check == 0 ? "--no-check" : "large shape; --check forces it");
  }

  if (a.iters > 0) {
    // FLOPs: 2 matmuls of 2*d per (query, key) pair that the mask lets through; backward 2.5x.
    double pairs = 0;
    for (int i = 0; i < a.sq; ++i)
      pairs += a.causal ? std::clamp(i + a.sk - a.sq + 1, 0, a.sk) : a.sk;
    const double fwd_flops = 4.0 * a.b * a.h * a.d * pairs;
    const float ms = median_ms(a.iters, [&] { fwd->fn(p, plan, nullptr); });
    std::printf("fwd: %.3f ms  %.1f TFLOP/s  (median of %d)\n", ms, fwd_flops / ms * 1e-9, a.iters);
    if (bwd != nullptr) {
      const float bms = median_ms(a.iters, [&] { bwd->fn(bp, bwd_plan, nullptr); });
      std::printf("bwd: %.3f ms  %.1f TFLOP/s  (median of %d)\n", bms, 2.5 * fwd_flops / bms * 1e-9,
                  a.iters);
    }
  }
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [b sq sk h hk d causal] [--dtype fp16|bf16] [--iters N] [--seed S]\n"
               "          [--q-tiles N] [--no-bwd] [--deterministic] [--check | --no-check]\n"
               "  q (b, sq, h, d), k/v (b, sk, hk, d); h a multiple of hk; d a multiple of 8.\n"
               "  Built FA1 kernels: fwd%s; bwd%s\n",
               argv0, listing(g_fwd).c_str(), listing(g_bwd).c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  register_kernels();
  Args a;
  std::vector<int> pos;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--dtype" && has_value) a.dtype = argv[++i];
    else if (arg == "--iters" && has_value) a.iters = std::atoi(argv[++i]);
    else if (arg == "--seed" && has_value) a.seed = unsigned(std::strtoul(argv[++i], nullptr, 10));
    else if (arg == "--q-tiles" && has_value) a.q_tiles = std::atoi(argv[++i]);
    else if (arg == "--no-bwd") a.bwd = false;
    else if (arg == "--deterministic") a.deterministic = true;
    else if (arg == "--check") a.check = 1;
    else if (arg == "--no-check") a.check = 0;
    else if (!arg.empty() && arg[0] != '-' && std::isdigit(static_cast<unsigned char>(arg[0])))
      pos.push_back(std::atoi(arg.c_str()));
    else return usage(argv[0]);
  }
  if (!pos.empty()) {
    if (pos.size() != 7) return usage(argv[0]);
    a.b = pos[0], a.sq = pos[1], a.sk = pos[2], a.h = pos[3], a.hk = pos[4], a.d = pos[5];
    a.causal = pos[6] != 0;
  }
  if (a.b < 1 || a.sq < 1 || a.sk < 1 || a.h < 1 || a.hk < 1 || a.h % a.hk != 0 || a.d < 8 ||
      a.d % 8 != 0 || a.iters < 0 || a.q_tiles < 0 || (a.dtype != "fp16" && a.dtype != "bf16"))
    return usage(argv[0]);
  try {
    return a.dtype == "fp16" ? run<__half>(a) : run<__nv_bfloat16>(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 3;
  }
}
