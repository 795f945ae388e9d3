// The torch-facing layer: tensors in, params out, one call through the generated dispatch
// table. The only file that includes torch headers. The Python frontend validates every
// argument first with messages meant for users; the checks here are a second line of defence
// for anyone calling flash_attn._C directly.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common/params.h"
#include "fa1/fa1.h"

namespace {

using FwdFn = void (*)(const flash::FwdParams&, cudaStream_t);
using BwdFn = void (*)(const flash::BwdParams&, cudaStream_t);

struct Kernel {
  std::string family, direction, dtype;
  int hdim = 0, min_arch = 0;
  FwdFn fwd = nullptr;
  BwdFn bwd = nullptr;
};

Kernel entry(const char* family, const char* dir, const char* dtype, int hdim, int arch, FwdFn f) {
  return {family, dir, dtype, hdim, arch, f, nullptr};
}
Kernel entry(const char* family, const char* dir, const char* dtype, int hdim, int arch, BwdFn f) {
  return {family, dir, dtype, hdim, arch, nullptr, f};
}

const std::vector<Kernel>& kernels() {
  static const std::vector<Kernel> table = {
#define FLASH_CONFIG(family, dir, cxx_type, dtype, hdim, min_arch) \
  entry(#family, #dir, #dtype, hdim, min_arch, &flash::family::run_##dir<cxx_type, hdim>),
#include "generated/dispatch_table.inc"
#undef FLASH_CONFIG
  };
  return table;
}

std::string dtype_name(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return "fp16";
  if (t.scalar_type() == at::kBFloat16) return "bf16";
  return std::string(c10::toString(t.scalar_type()));
}

// The kernel of the smallest instantiated head dim >= head_dim.
const Kernel& find_kernel(const std::string& family, const std::string& direction,
                          const std::string& dtype, int head_dim, int arch) {
  const Kernel* best = nullptr;
  for (const Kernel& k : kernels()) {
    if (k.family == family && k.direction == direction && k.dtype == dtype &&
        k.hdim >= head_dim && (best == nullptr || k.hdim < best->hdim)) {
      best = &k;
    }
  }
  TORCH_CHECK(best != nullptr, "flash_attn: this build has no ", family, " ", direction,
              " kernel for dtype ", dtype, " and head dim ", head_dim,
              " (see flash_attn._C.built_configs())");
  TORCH_CHECK(arch >= best->min_arch, "flash_attn: ", family, " ", dtype, " needs sm",
              best->min_arch, "+, this GPU is sm", arch);
  return *best;
}

void check_qkv_like(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda(), "flash_attn: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 4, "flash_attn: ", name, " must be (batch, seqlen, heads, headdim), got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn: ", name, " has dtype ",
              t.scalar_type(), " but q has ", q.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "flash_attn: ", name, " is on ", t.device(),
              " but q is on ", q.device());
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn: ", name, " must be contiguous in its last dim");
  // 16-byte vector loads: the base and every stride that is used must be multiples of 8
  // elements (the frontend copies a tensor that is not).
  bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) aligned = aligned && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  TORCH_CHECK(aligned, "flash_attn: ", name,
              " must be 16-byte aligned with strides that are multiples of 8, got strides ",
              t.strides());
}

flash::Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Device attributes, read once per device (cudaDeviceGetAttribute does not synchronize).
struct DeviceInfo {
  int arch = 0, num_sms = 0;
};

DeviceInfo device_info(const at::Tensor& t) {
  static DeviceInfo cache[64];
  static std::mutex mutex;
  const int dev = t.device().index();
  TORCH_CHECK(dev >= 0 && dev < 64, "flash_attn: unsupported device index ", dev);
  const std::lock_guard<std::mutex> lock(mutex);
  DeviceInfo& info = cache[dev];
  if (info.arch == 0) {
    int major = 0, minor = 0, sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    info.num_sms = sms;
    info.arch = major * 10 + minor;
  }
  return info;
}

void fill_fwd(flash::FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_strides = strides_of(q);
  p.k_strides = strides_of(k);
  p.v_strides = strides_of(v);
  p.o_strides = strides_of(out);
  p.batch = int(q.size(0));
  p.seqlen_q = int(q.size(1));
  p.heads = int(q.size(2));
  p.head_dim = int(q.size(3));
  p.seqlen_k = int(k.size(1));
  p.heads_k = int(k.size(2));
  p.softmax_scale = float(softmax_scale);
  p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  p.causal = causal;
  p.num_sms = device_info(q).num_sms;
  p.arch = device_info(q).arch;
  // Tuning knob for benchmarks (README): Q tiles per FA1 forward block, 0 or unset = automatic.
  static const int q_tiles = [] {
    const char* env = std::getenv("FLASH_ATTN_FA1_Q_TILES");
    return env ? std::atoi(env) : 0;
  }();
  p.q_tiles_per_block = q_tiles;
}

// Scratch for one call, from PyTorch's caching allocator (no device synchronisation).
at::Tensor alloc_workspace(flash::FwdParams& p, int64_t bytes, const at::Tensor& like) {
  at::Tensor workspace = at::empty({bytes}, like.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  return workspace;
}

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_qkv_like(q, "q", q);
  check_qkv_like(k, "k", q);
  check_qkv_like(v, "v", q);
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "flash_attn: batch sizes differ");
  TORCH_CHECK(v.sizes() == k.sizes(), "flash_attn: k ", k.sizes(), " and v ", v.sizes(),
              " must have the same shape");
  TORCH_CHECK(k.size(3) == q.size(3), "flash_attn: q and k head dims differ");
  TORCH_CHECK(q.size(3) > 0 && q.size(3) % 8 == 0, "flash_attn: head dim must be a positive "
              "multiple of 8 here (the frontend pads), got ", q.size(3));
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "flash_attn: heads (", q.size(2),
              ") must be a multiple of kv heads (", k.size(2), ")");
  // Tile arithmetic such as (i + 1) * Br runs in int: keep a margin below INT_MAX.
  constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 1024;
  TORCH_CHECK(q.size(1) <= kMaxSeqlen && k.size(1) <= kMaxSeqlen,
              "flash_attn: sequence lengths up to ", kMaxSeqlen, " are supported, got ",
              q.size(1), " and ", k.size(1));
}

void check_lse(const at::Tensor& lse, const at::Tensor& q) {
  TORCH_CHECK(lse.is_cuda() && lse.device() == q.device(), "flash_attn: lse is on ",
              lse.device(), " but q is on ", q.device());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({q.size(0), q.size(2), q.size(1)}),
              "flash_attn: lse must be contiguous float32 (batch, heads, seqlen_q)");
}

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
         at::Tensor& lse, double softmax_scale, bool causal, const std::string& family) {
  check_shapes(q, k, v);
  check_qkv_like(out, "out", q);
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn: out must have q's shape");
  check_lse(lse, q);
  if (q.numel() == 0) return;
  if (k.size(1) == 0) {  // no key at all: every row is empty
    out.zero_();
    lse.fill_(std::numeric_limits<float>::infinity());
    return;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const Kernel& kernel = find_kernel(family, "fwd", dtype_name(q), int(q.size(3)), device_info(q).arch);

  flash::FwdParams p;
  fill_fwd(p, q, k, v, out, lse, softmax_scale, causal);
  at::Tensor workspace;
  if (family == "fa1") {
    workspace = alloc_workspace(
        p, flash::fa1::fwd_workspace_bytes(p.batch, p.heads, p.seqlen_q, kernel.hdim), q);
  }
  kernel.fwd(p, c10::cuda::getCurrentCUDAStream().stream());
}

void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk,
         at::Tensor& dv, double softmax_scale, bool causal, bool deterministic,
         const std::string& family) {
  check_shapes(q, k, v);
  check_qkv_like(out, "out", q);
  check_qkv_like(dout, "dout", q);
  check_qkv_like(dq, "dq", q);
  check_qkv_like(dk, "dk", q);
  check_qkv_like(dv, "dv", q);
  TORCH_CHECK(out.sizes() == q.sizes() && dout.sizes() == q.sizes() && dq.sizes() == q.sizes(),
              "flash_attn: out, dout and dq must have q's shape");
  TORCH_CHECK(dk.sizes() == k.sizes() && dv.sizes() == k.sizes(),
              "flash_attn: dk and dv must have k's shape");
  check_lse(lse, q);
  if (q.size(1) == 0 || k.size(1) == 0 || q.size(0) == 0) {  // nothing attends to anything
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const Kernel& kernel = find_kernel(family, "bwd", dtype_name(q), int(q.size(3)), device_info(q).arch);

  flash::BwdParams p;
  fill_fwd(p, q, k, v, out, lse, softmax_scale, causal);
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.do_strides = strides_of(dout);
  p.dq_strides = strides_of(dq);
  p.dk_strides = strides_of(dk);
  p.dv_strides = strides_of(dv);
  p.deterministic = deterministic;
  at::Tensor workspace;
  if (family == "fa1") {
    workspace = alloc_workspace(
        p, flash::fa1::bwd_workspace_bytes(p.batch, p.heads, p.seqlen_q, kernel.hdim), q);
  }
  kernel.bwd(p, c10::cuda::getCurrentCUDAStream().stream());
}

std::vector<int> built_archs() {
  return {
#include "generated/built_archs.inc"
  };
}

std::vector<std::tuple<std::string, std::string, std::string, int, int>> built_configs() {
  std::vector<std::tuple<std::string, std::string, std::string, int, int>> out;
  for (const Kernel& k : kernels()) out.emplace_back(k.family, k.direction, k.dtype, k.hdim, k.min_arch);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_attn CUDA kernels (FA1); see ARCHITECTURE.md";
  m.def("fwd", &fwd, "attention forward: writes out and lse", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("family"));
  m.def("bwd", &bwd, "attention backward: writes dq, dk, dv", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"),
        py::arg("dv"), py::arg("softmax_scale"), py::arg("causal"), py::arg("deterministic"),
        py::arg("family"));
  m.def("built_configs", &built_configs,
        "(family, direction, dtype, hdim, min_arch) of every kernel in this build");
  m.def("built_archs", &built_archs,
        "compute capabilities (major*10+minor) with machine code in this build; the last also "
        "as PTX");
}
