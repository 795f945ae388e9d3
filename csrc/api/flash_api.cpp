// The torch-facing layer: tensors in, params out, one call through the generated dispatch
// table. The only file that includes torch headers. The Python frontend validates every
// argument first with messages meant for users; the checks here are a second line of defence
// for anyone calling flash_attn._C directly.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/dropout_mask.h"
#include "common/fp8_quantize.h"
#include "common/kvcache_prep.h"
#include "common/params.h"
#include "common/tuning.h"
#include "fa1/fa1.h"
#include "fa2/fa2.h"
#include "fa3/fa3.h"

namespace {

// Numbers in error messages are formatted here, not by std::ostream: with the extension built by
// a newer g++ than torch, libstdc++'s numeric ostream insertion inside TORCH_CHECK crashed the
// process (seen on the GPU machine, a segfault in num_put). std::to_string / snprintf do not
// touch the locale machinery.
std::string num(int x) { return std::to_string(x); }
std::string num(int64_t x) { return std::to_string(x); }
std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}
std::string shape(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + ")";
}

// Scratch for one call, from PyTorch's caching allocator (no device synchronisation).
at::Tensor alloc_workspace(flash::FwdParams& p, int64_t bytes, const at::Tensor& like) {
  at::Tensor workspace = at::empty({bytes}, like.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  return workspace;
}

// One call of a family's kernel, through the host interface every family has (fa*/fa*.h):
// refuse what it cannot run, plan the call once, allocate the plan's workspace, launch.
template <class F> struct ParamsOf;
template <class Params> struct ParamsOf<const char* (*)(const Params&)> { using type = Params; };

template <auto kUnsupported, auto kPlan, auto kRun>
void call(typename ParamsOf<decltype(kUnsupported)>::type& p, int kernel_hdim,
          const flash::Tuning& tuning, const at::Tensor& like) {
  const char* why = kUnsupported(p);
  TORCH_CHECK(why == nullptr, "flash_attn: ", why);
  const auto plan = kPlan(p, kernel_hdim, tuning);
  at::Tensor workspace;  // lives until the launch is queued; the allocator orders its reuse
  if (plan.workspace_bytes > 0) workspace = alloc_workspace(p, plan.workspace_bytes, like);
  kRun(p, plan, c10::cuda::getCurrentCUDAStream().stream());
}

using FwdFn = void (*)(flash::FwdParams&, int, const flash::Tuning&, const at::Tensor&);
using BwdFn = void (*)(flash::BwdParams&, int, const flash::Tuning&, const at::Tensor&);

struct Kernel {
  std::string family, direction, dtype;
  int hdim = 0, min_arch = 0;
  int max_arch = 0;  // 0: none (build_matrix.Family.max_arch)
  FwdFn fwd = nullptr;
  BwdFn bwd = nullptr;
};

Kernel entry(const char* family, const char* dir, const char* dtype, int hdim, int arch,
             int max_arch, FwdFn f) {
  return {family, dir, dtype, hdim, arch, max_arch, f, nullptr};
}
Kernel entry(const char* family, const char* dir, const char* dtype, int hdim, int arch,
             int max_arch, BwdFn f) {
  return {family, dir, dtype, hdim, arch, max_arch, nullptr, f};
}

const std::vector<Kernel>& kernels() {
  static const std::vector<Kernel> table = {
#define FLASH_CONFIG(family, dir, cxx_type, dtype, hdim, min_arch, max_arch)          \
  entry(#family, #dir, #dtype, hdim, min_arch, max_arch,                               \
        &call<&flash::family::dir##_unsupported, &flash::family::plan_##dir,           \
              &flash::family::run_##dir<cxx_type, hdim>>),
#include "generated/dispatch_table.inc"
#undef FLASH_CONFIG
  };
  return table;
}

std::string dtype_name(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return "fp16";
  if (t.scalar_type() == at::kBFloat16) return "bf16";
  if (t.scalar_type() == at::kFloat8_e4m3fn) return "e4m3";
  return std::string(c10::toString(t.scalar_type()));
}

// The target archs of this build, with machine code for each (build_matrix.cuda_archs).
const std::vector<int>& target_archs() {
  static const std::vector<int> archs = {
#include "generated/built_archs.inc"
  };
  return archs;
}

// The arch whose portable PTX this build carries, 0: none (build_matrix.ptx_arch: the
// FLASH_ATTN_CUDA_ARCHS entry marked +PTX, sm90 when the switch is unset).
constexpr int kPtxArch =
#include "generated/ptx_arch.inc"
    ;

// build_matrix.kernel_runs_on: whether a kernel that needs sm<min_arch>+ (and at most
// sm<max_arch>, 0: no limit) has code that runs on `arch`. Code for archs below min_arch does
// not count (the kernel compiles to an empty body there); with a max_arch neither does the PTX
// (it lacks the arch-specific instructions, so the kernel is empty in it too).
bool kernel_runs_on(int min_arch, int max_arch, int arch) {
  if (max_arch != 0 && arch > max_arch) return false;
  for (int a : target_archs()) {
    if (a >= min_arch && a / 10 == arch / 10 && a <= arch) return true;  // same-major SASS
  }
  return max_arch == 0 && kPtxArch != 0 && kPtxArch >= min_arch && arch >= kPtxArch;
}

// "sm80, sm90 (no PTX)" / "sm80, sm90 (+ PTX of sm90)": what an error says about the targets.
std::string targets_text() {
  std::string out;
  for (int a : target_archs()) out += (out.empty() ? "sm" : ", sm") + std::to_string(a);
  return out + (kPtxArch == 0 ? " (no PTX)" : " (+ PTX of sm" + std::to_string(kPtxArch) + ")");
}

bool max_arch_ok(const Kernel& k, int arch) { return k.max_arch == 0 || arch <= k.max_arch; }

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
              " kernel for dtype ", dtype, " and head dim ", num(head_dim),
              " (see flash_attn._C.built_configs())");
  TORCH_CHECK(arch >= best->min_arch, "flash_attn: ", family, " ", dtype, " needs sm",
              num(best->min_arch), "+, this GPU is sm", num(arch));
  TORCH_CHECK(max_arch_ok(*best, arch), "flash_attn: ", family, " runs on sm", num(best->min_arch),
              "-sm", num(best->max_arch), " only, this GPU is sm", num(arch));
  TORCH_CHECK(kernel_runs_on(best->min_arch, best->max_arch, arch), "flash_attn: this build has no ", family,
              " code that runs on sm", num(arch), " (targets: ", targets_text(),
              "); rebuild with FLASH_ATTN_CUDA_ARCHS including ", num(arch));
  return *best;
}

// t as the kernels read it, like q: on q's device, q's dtype, `layout` (ndim dims: 4 dense, 3
// packed), last dim contiguous.
void check_kernel_tensor(const at::Tensor& t, const char* name, const at::Tensor& q, int ndim,
                         const char* layout) {
  TORCH_CHECK(t.is_cuda(), "flash_attn: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == ndim, "flash_attn: ", name, " must be ", layout, ", got ",
              shape(t.sizes()));
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn: ", name, " has dtype ",
              t.scalar_type(), " but q has ", q.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "flash_attn: ", name, " is on ", t.device().str(),
              " but q is on ", q.device().str());
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn: ", name, " must be contiguous in its last dim");
  // 16-byte vector loads: the base and every stride that is used must be multiples of 8
  // elements (the frontend copies a tensor that is not).
  bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < ndim - 1; ++d) aligned = aligned && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  TORCH_CHECK(aligned, "flash_attn: ", name,
              " must be 16-byte aligned with strides that are multiples of 8, got strides ",
              shape(t.strides()));
}
void check_qkv_like(const at::Tensor& t, const char* name, const at::Tensor& q) {
  check_kernel_tensor(t, name, q, 4, "(batch, seqlen, heads, headdim)");
}
void check_packed_like(const at::Tensor& t, const char* name, const at::Tensor& q) {
  check_kernel_tensor(t, name, q, 3, "(total, heads, headdim)");
}

// (batch, row, head) steps of a (batch, seqlen, heads, hdim) tensor; of a packed (total, heads,
// hdim) one, with a batch step of 0 (common/params.h).
flash::Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }
flash::Strides packed_strides_of(const at::Tensor& t) { return {0, t.stride(0), t.stride(1)}; }

// Device attributes, read once per device (cudaDeviceGetAttribute does not synchronize).
struct DeviceInfo {
  int arch = 0, num_sms = 0, l2_bytes = 0;
  int code_arch = 0;  // FwdParams::code_arch
};

// The arch of this build's code that runs on `arch`: its newest same-major machine code at or
// below it, else its PTX's arch (0: none runs; no kernel would be found).
int code_arch_on(int arch) {
  int best = 0;
  for (int a : target_archs()) {
    if (a / 10 == arch / 10 && a <= arch) best = std::max(best, a);
  }
  return best != 0 ? best : kPtxArch != 0 && arch >= kPtxArch ? kPtxArch : 0;
}

DeviceInfo device_info(const at::Tensor& t) {
  static DeviceInfo cache[64];
  static std::mutex mutex;
  const int dev = t.device().index();
  TORCH_CHECK(dev >= 0 && dev < 64, "flash_attn: unsupported device index ", num(int64_t(dev)));
  const std::lock_guard<std::mutex> lock(mutex);
  DeviceInfo& info = cache[dev];
  if (info.arch == 0) {
    int major = 0, minor = 0, sms = 0, l2 = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    info.num_sms = sms;
    info.l2_bytes = l2;
    info.arch = major * 10 + minor;
    info.code_arch = code_arch_on(info.arch);
  }
  return info;
}

// What a call asks beyond plain attention (flash_attn/_ops.py passes them through).
struct Features {
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  const std::optional<at::Tensor>& alibi_slopes;
  double dropout_p = 0.0;
};

// A 16-bit Philox draw keeps its element iff it is below this (common/philox.cuh).
uint32_t keep_threshold(double dropout_p) {
  return uint32_t(std::clamp(std::round((1.0 - dropout_p) * 65536.0), 1.0, 65536.0));
}

void check_dropout_p(double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "flash_attn: dropout_p must be in [0, 1), got ",
              num(dropout_p));
}

void set_alibi(flash::FwdParams& p, const std::optional<at::Tensor>& alibi_slopes,
               const at::Tensor& q, int64_t batch, int64_t heads) {
  if (!alibi_slopes.has_value() || !alibi_slopes->defined()) return;
  const at::Tensor& s = *alibi_slopes;
  TORCH_CHECK(s.is_cuda() && s.device() == q.device(), "flash_attn: alibi_slopes is on ",
              s.device().str(), " but q is on ", q.device().str());
  TORCH_CHECK(s.scalar_type() == at::kFloat, "flash_attn: alibi_slopes must be float32, got ",
              s.scalar_type());
  TORCH_CHECK(s.is_contiguous(), "flash_attn: alibi_slopes must be contiguous");
  const bool per_head = s.dim() == 1 && s.size(0) == heads;
  const bool per_batch = s.dim() == 2 && s.size(0) == batch && s.size(1) == heads;
  TORCH_CHECK(per_head || per_batch, "flash_attn: alibi_slopes must be (heads,) = (", num(heads),
              ",) or (batch, heads) = (", num(batch), ", ", num(heads), "), got ",
              shape(s.sizes()));
  p.alibi_slopes = s.data_ptr<float>();
  p.alibi_batch_stride = per_batch ? s.stride(0) : 0;
}

void fill_options(flash::FwdParams& p, const at::Tensor& q, double softmax_scale,
                  const Features& f);

void fill_fwd(flash::FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, double softmax_scale,
              const Features& f) {
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
  fill_options(p, q, softmax_scale, f);
}

// What fill_fwd sets besides pointers and shapes: scale, softcap, window, ALiBi, dropout and
// the device's attributes. p.batch and p.heads must be set.
void fill_options(flash::FwdParams& p, const at::Tensor& q, double softmax_scale,
                  const Features& f) {
  // Scores and softcap: the exp2-domain convention of common/params.h.
  TORCH_CHECK(std::isfinite(f.softcap) && f.softcap >= 0.0,
              "flash_attn: softcap must be 0 (off) or a finite positive number, got ", num(f.softcap));
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(f.softcap);
  if (f.softcap > 0.0) {
    p.softcap_prescale = float(softmax_scale / f.softcap);
    p.softmax_scale_log2 = float(f.softcap * M_LOG2E);
  } else {
    p.softmax_scale_log2 = float(softmax_scale * M_LOG2E);
  }

  // Window: causal is the window (-1, 0), and a causal call with a left side is local with
  // right = 0 (flash_attn 2.x's rules); p.causal is set exactly when the window is (-1, 0).
  TORCH_CHECK(f.window_left >= -1 && f.window_right >= -1 &&
                  f.window_left <= std::numeric_limits<int>::max() &&
                  f.window_right <= std::numeric_limits<int>::max(),
              "flash_attn: window sides must be ints >= -1 (-1: unbounded), got (",
              num(f.window_left), ", ", num(f.window_right), ")");
  p.window_left = int(f.window_left);
  p.window_right = f.causal ? 0 : int(f.window_right);
  p.causal = p.window_left < 0 && p.window_right == 0;

  set_alibi(p, f.alibi_slopes, q, p.batch, p.heads);

  check_dropout_p(f.dropout_p);
  p.dropout_p = float(f.dropout_p);
  p.rp_keep = float(1.0 / (1.0 - f.dropout_p));
  p.keep_threshold = keep_threshold(f.dropout_p);

  const DeviceInfo info = device_info(q);
  p.num_sms = info.num_sms;
  p.arch = info.arch;
  p.code_arch = info.code_arch;
  p.l2_bytes = info.l2_bytes;
}

// The private `_tuning` of the Python functions, "name=value,..." (flash_attn/_ops.py): overrides
// of the families' automatic choices for tests and A/B runs (common/tuning.h). Empty: none.
flash::Tuning parse_tuning(const std::string& text) {
  flash::Tuning t;
  if (text.empty()) return t;
  static const std::pair<const char*, int flash::Tuning::*> fields[] = {
      {"fa3_stream_k", &flash::Tuning::fa3_stream_k}, {"fa3_cluster", &flash::Tuning::fa3_cluster},
      {"fa3_narrow", &flash::Tuning::fa3_narrow},     {"fa3_ctas", &flash::Tuning::fa3_ctas},
      {"fa2_dq_bulk", &flash::Tuning::fa2_dq_bulk},   {"fa2_dq_defer", &flash::Tuning::fa2_dq_defer},
      {"fa2_pdl", &flash::Tuning::fa2_pdl},           {"head_group", &flash::Tuning::head_group},
      {"fa1_q_tiles", &flash::Tuning::fa1_q_tiles},   {"fa2_decode", &flash::Tuning::fa2_decode},
      {"fa3_bwd_split", &flash::Tuning::fa3_bwd_split},
      {"fa3_bwd_zero", &flash::Tuning::fa3_bwd_zero},
  };
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    at = end + 1;
    const size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    int flash::Tuning::*field = nullptr;
    for (const auto& [known, member] : fields) field = name == known ? member : field;
    if (field == nullptr || eq == std::string::npos) {
      std::string names;
      for (const auto& f : fields) names += std::string(names.empty() ? "" : ", ") + f.first;
      TORCH_CHECK(false, "flash_attn: _tuning: unknown entry '", item, "'; known: ", names);
    }
    t.*field = std::stoi(item.substr(eq + 1));
  }
  return t;
}

void check_rng_state(const at::Tensor& rng_state, const at::Tensor& q) {
  TORCH_CHECK(rng_state.is_cuda(), "flash_attn: rng_state must be a CUDA tensor, got one on ",
              rng_state.device().str());
  TORCH_CHECK(rng_state.device() == q.device(), "flash_attn: rng_state is on ",
              rng_state.device().str(), " but q is on ", q.device().str());
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.dim() == 1 &&
                  rng_state.size(0) == 2 && rng_state.is_contiguous(),
              "flash_attn: rng_state must be a contiguous int64 tensor of shape (2,) "
              "([seed, offset]), got ", rng_state.scalar_type(), " ", shape(rng_state.sizes()));
}

// Forward with dropout: a Philox stream from torch's default CUDA generator of q's device, so
// torch.manual_seed reproduces the mask. The increment of 4 (torch wants a multiple of 4)
// suffices: every element of a call has its own counter by construction (common/philox.cuh).
// Under CUDA graph capture torch hands out device pointers that each replay refills, so a
// replay draws a fresh mask; the kernel resolves them and writes what it used to rng_state.
void take_philox(flash::FwdParams& p, const at::Tensor& q) {
  auto* gen = at::check_generator<at::CUDAGeneratorImpl>(
      at::cuda::detail::getDefaultCUDAGenerator(q.device().index()));
  at::PhiloxCudaState state;
  {
    const std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(4);
  }
  if (state.captured_) {
    p.philox.seed_ptr = state.seed_.ptr;
    p.philox.offset_ptr = state.offset_.ptr;
    p.philox.offset_intragraph = state.offset_intragraph_;
  } else {
    p.philox.seed = state.seed_.val;
    p.philox.offset = state.offset_.val;
  }
}

// The forward's rng_state: the kernel writes [seed, offset] when dropping. Nothing drawn: it is
// zeros. fa3's kernel writes them itself, which keeps a fill kernel off a small call's path (1
// us of 20-35 us).
void set_rng_state(flash::FwdParams& p, const at::Tensor& rng_state, const at::Tensor& q,
                   const std::string& family) {
  p.rng_state = rng_state.data_ptr<int64_t>();
  if (p.dropout_p > 0.f) take_philox(p, q);
  if (p.dropout_p == 0.f && family != "fa3") rng_state.zero_();
}

// The 16-bit entry points: e4m3 tensors have an entry point of their own (fp8_fwd).
void check_not_fp8(const at::Tensor& q, const char* entry) {
  TORCH_CHECK(q.scalar_type() != at::kFloat8_e4m3fn, "flash_attn: ", entry, " takes float16 / "
              "bfloat16 tensors; FP8 (float8_e4m3fn) runs through fp8_fwd");
}

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_qkv_like(q, "q", q);
  check_qkv_like(k, "k", q);
  check_qkv_like(v, "v", q);
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "flash_attn: batch sizes differ");
  TORCH_CHECK(v.sizes() == k.sizes(), "flash_attn: k ", shape(k.sizes()), " and v ", shape(v.sizes()),
              " must have the same shape");
  TORCH_CHECK(k.size(3) == q.size(3), "flash_attn: q and k head dims differ");
  TORCH_CHECK(q.size(3) > 0 && q.size(3) % 8 == 0, "flash_attn: head dim must be a positive "
              "multiple of 8 here (the frontend pads), got ", num(q.size(3)));
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "flash_attn: heads (", num(q.size(2)),
              ") must be a multiple of kv heads (", num(k.size(2)), ")");
  // Tile arithmetic such as (i + 1) * Br runs in int: keep a margin below INT_MAX.
  constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 1024;
  TORCH_CHECK(q.size(1) <= kMaxSeqlen && k.size(1) <= kMaxSeqlen,
              "flash_attn: sequence lengths up to ", num(kMaxSeqlen), " are supported, got ",
              num(q.size(1)), " and ", num(k.size(1)));
}

// lse: contiguous float32 of `sizes` (spelled `layout`) on q's device.
void check_lse(const at::Tensor& lse, const at::Tensor& q, at::IntArrayRef sizes,
               const char* layout) {
  TORCH_CHECK(lse.is_cuda() && lse.device() == q.device(), "flash_attn: lse is on ",
              lse.device().str(), " but q is on ", q.device().str());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.sizes() == sizes,
              "flash_attn: lse must be contiguous float32 ", layout);
}
void check_lse(const at::Tensor& lse, const at::Tensor& q) {
  check_lse(lse, q, {q.size(0), q.size(2), q.size(1)}, "(batch, heads, seqlen_q)");
}

// out, lse and rng_state are the caller's tensors to write, or None: then this allocates them
// (out contiguous in q's shape and dtype, lse float32 (batch, heads, seqlen_q), rng_state int64
// (2,)): 2-4 us of host time here against ~9 us for the three allocations in Python (a decode
// call's host time went from 37 to 30 us). Returns (out, lse, rng_state).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& out_arg, const std::optional<at::Tensor>& lse_arg,
    const std::optional<at::Tensor>& rng_state_arg, const std::optional<at::Tensor>& alibi_slopes,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, double dropout_p, const std::string& family, const std::string& tuning) {
  check_not_fp8(q, "fwd");
  check_shapes(q, k, v);
  at::Tensor out = out_arg ? *out_arg : at::empty(q.sizes(), q.options());
  at::Tensor lse = lse_arg ? *lse_arg
                           : at::empty({q.size(0), q.size(2), q.size(1)},
                                       q.options().dtype(at::kFloat));
  at::Tensor rng_state =
      rng_state_arg ? *rng_state_arg : at::empty({2}, q.options().dtype(at::kLong));
  check_qkv_like(out, "out", q);
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn: out must have q's shape");
  check_lse(lse, q);
  check_rng_state(rng_state, q);
  const auto result = std::make_tuple(out, lse, rng_state);
  if (q.numel() == 0 || k.size(1) == 0) {  // nothing to launch, nothing drawn
    rng_state.zero_();
    if (q.numel() > 0) {  // no key at all: every row is empty
      out.zero_();
      lse.fill_(std::numeric_limits<float>::infinity());
    }
    return result;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const Kernel& kernel = find_kernel(family, "fwd", dtype_name(q), int(q.size(3)), device_info(q).arch);

  flash::FwdParams p;
  fill_fwd(p, q, k, v, out, lse, softmax_scale,
           {causal, window_left, window_right, softcap, alibi_slopes, dropout_p});
  set_rng_state(p, rng_state, q, family);
  kernel.fwd(p, kernel.hdim, parse_tuning(tuning), q);
  return result;
}

// FP8 (fa3 on sm90): e4m3 q / k / v, each with float32 (batch, heads_k) descales (None: 1), out
// bf16; forward only. Returns (out, lse).
std::tuple<at::Tensor, at::Tensor> fp8_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale, const std::optional<at::Tensor>& out_arg,
    const std::optional<at::Tensor>& lse_arg, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, const std::string& family,
    const std::string& tuning) {
  check_shapes(q, k, v);
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn, "flash_attn: the FP8 forward takes "
              "float8_e4m3fn q, k, v, got ", q.scalar_type());
  // TMA: 16-byte strides, 16-element (16-byte) rows.
  for (const at::Tensor* t : {&q, &k, &v}) {
    bool aligned = reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
    for (int d = 0; d < 3; ++d) aligned = aligned && (t->size(d) <= 1 || t->stride(d) % 16 == 0);
    TORCH_CHECK(aligned, "flash_attn: FP8 q, k, v must be 16-byte aligned with strides that are "
                "multiples of 16, got strides ", shape(t->strides()));
  }
  const int64_t batch = q.size(0), heads_k = k.size(2);
  at::Tensor out = out_arg ? *out_arg : at::empty(q.sizes(), q.options().dtype(at::kBFloat16));
  TORCH_CHECK(out.is_cuda() && out.device() == q.device() &&
                  out.scalar_type() == at::kBFloat16 && out.sizes() == q.sizes() &&
                  out.stride(-1) == 1,
              "flash_attn: out of an FP8 call must be bfloat16 in q's shape on q's device, "
              "contiguous in its last dim");
  bool out_aligned = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) {
    out_aligned = out_aligned && (out.size(d) <= 1 || out.stride(d) % 8 == 0);
  }
  TORCH_CHECK(out_aligned, "flash_attn: out must be 16-byte aligned with strides that are "
              "multiples of 8, got strides ", shape(out.strides()));
  at::Tensor lse = lse_arg ? *lse_arg
                           : at::empty({q.size(0), q.size(2), q.size(1)},
                                       q.options().dtype(at::kFloat));
  check_lse(lse, q);
  // The descales as contiguous (batch, heads_k) float32: one stride pair for the three.
  std::array<at::Tensor, 3> scales;
  const std::array<const std::optional<at::Tensor>*, 3> given = {&q_descale, &k_descale,
                                                                 &v_descale};
  const char* names[3] = {"q_descale", "k_descale", "v_descale"};
  for (int i = 0; i < 3; ++i) {
    if (!given[i]->has_value() || !(*given[i])->defined()) continue;
    const at::Tensor& d = **given[i];
    TORCH_CHECK(d.is_cuda() && d.device() == q.device() && d.scalar_type() == at::kFloat &&
                    d.dim() == 2 && d.size(0) == batch && d.size(1) == heads_k,
                "flash_attn: ", names[i], " must be float32 (batch, heads_k) = (", num(batch),
                ", ", num(heads_k), ") on q's device, got ", d.scalar_type(), " ",
                shape(d.sizes()), " on ", d.device().str());
    scales[i] = d.contiguous();
  }
  if (q.numel() == 0 || k.size(1) == 0) {
    if (q.numel() > 0) {
      out.zero_();
      lse.fill_(std::numeric_limits<float>::infinity());
    }
    return {out, lse};
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const Kernel& kernel = find_kernel(family, "fwd", "e4m3", int(q.size(3)), device_info(q).arch);
  flash::FwdParams p;
  const std::optional<at::Tensor> no_alibi;
  fill_fwd(p, q, k, v, out, lse, softmax_scale,
           {causal, window_left, window_right, 0.0, no_alibi, 0.0});
  p.fp8 = true;
  p.q_descale = scales[0].defined() ? scales[0].data_ptr<float>() : nullptr;
  p.k_descale = scales[1].defined() ? scales[1].data_ptr<float>() : nullptr;
  p.v_descale = scales[2].defined() ? scales[2].data_ptr<float>() : nullptr;
  p.descale_batch_stride = heads_k;
  p.descale_head_stride = 1;
  kernel.fwd(p, kernel.hdim, parse_tuning(tuning), q);
  return {out, lse};
}

// What the backward reads besides the forward's params: dO, the gradients (their steps by
// `strides`, dense or packed) and the Philox state the forward wrote, read on the device (no
// synchronisation, and right under CUDA graph replay) to regenerate the dropout mask.
void fill_grads(flash::BwdParams& p, const at::Tensor& dout, const at::Tensor& dq,
                const at::Tensor& dk, const at::Tensor& dv,
                flash::Strides (*strides)(const at::Tensor&), const at::Tensor& rng_state,
                bool deterministic) {
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.do_strides = strides(dout);
  p.dq_strides = strides(dq);
  p.dk_strides = strides(dk);
  p.dv_strides = strides(dv);
  p.deterministic = deterministic;
  int64_t* state = rng_state.data_ptr<int64_t>();
  p.rng_state = state;
  if (p.dropout_p > 0.f) {
    p.philox.seed_ptr = state;
    p.philox.offset_ptr = state + 1;
    p.philox.offset_intragraph = 0;
  }
}

void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& out, const at::Tensor& lse, const at::Tensor& rng_state,
         at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         const std::optional<at::Tensor>& alibi_slopes, double softmax_scale, bool causal,
         int64_t window_left, int64_t window_right, double softcap, double dropout_p,
         bool deterministic, const std::string& family, const std::string& tuning) {
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
  check_rng_state(rng_state, q);
  if (q.size(1) == 0 || k.size(1) == 0 || q.size(0) == 0) {  // nothing attends to anything
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const Kernel& kernel = find_kernel(family, "bwd", dtype_name(q), int(q.size(3)), device_info(q).arch);

  flash::BwdParams p;
  fill_fwd(p, q, k, v, out, lse, softmax_scale,
           {causal, window_left, window_right, softcap, alibi_slopes, dropout_p});
  fill_grads(p, dout, dq, dk, dv, strides_of, rng_state, deterministic);
  kernel.bwd(p, kernel.hdim, parse_tuning(tuning), q);
}

// ---- variable-length batches (flash_attn/_ops.py run_varlen_fwd) ------------------------------

const int* index_ptr(const std::optional<at::Tensor>& t, const char* name, int64_t size,
                     const at::Tensor& q) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->scalar_type() == at::kInt &&
                  t->dim() == 1 && t->size(0) == size && t->is_contiguous(),
              "flash_attn: ", name, " must be a contiguous int32 CUDA tensor of shape (",
              num(size), ",) on q's device, got ", t->scalar_type(), " ", shape(t->sizes()));
  return t->data_ptr<int>();
}

// q packed; k / v packed, or with `paged` (num_blocks, page_size, heads_k, hdim) pools.
void check_packed_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         bool paged = false) {
  check_packed_like(q, "q", q);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k, "k"}, {v, "v"}}) {
    if (paged) {
      check_qkv_like(t, name, q);
    } else {
      check_packed_like(t, name, q);
    }
  }
  const int kh = k.dim() - 2;  // k's heads dim
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(kh + 1) == q.size(2) && q.size(2) % 8 == 0 &&
                  k.size(kh) > 0 && q.size(1) % k.size(kh) == 0,
              "flash_attn: q ", shape(q.sizes()), ", k ", shape(k.sizes()), ", v ",
              shape(v.sizes()), " do not fit together");
}

// fill_fwd for a packed batch of cu_seqlens.size(0) - 1 sequences (common/params.h): the
// longest sequence's lengths as seqlen_q / seqlen_k, a batch step of 0; k / v may be paged
// pools (4-D: set_pages gives their block table).
void fill_varlen(flash::FwdParams& p, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                 int64_t batch, const int* cu_q, const int* cu_k,
                 const std::optional<at::Tensor>& seqused_q,
                 const std::optional<at::Tensor>& seqused_k, int64_t max_seqlen_q,
                 int64_t max_seqlen_k, double softmax_scale, const Features& f) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_strides = packed_strides_of(q);
  const bool pools = k.dim() == 4;
  p.k_strides = pools ? strides_of(k) : packed_strides_of(k);
  p.v_strides = pools ? strides_of(v) : packed_strides_of(v);
  p.o_strides = packed_strides_of(out);
  p.batch = int(batch);
  p.seqlen_q = int(max_seqlen_q);
  p.seqlen_k = int(max_seqlen_k);
  p.heads = int(q.size(1));
  p.head_dim = int(q.size(2));
  p.heads_k = int(k.size(pools ? 2 : 1));
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.seqused_q = index_ptr(seqused_q, "seqused_q", batch, q);
  p.seqused_k = index_ptr(seqused_k, "seqused_k", batch, q);
  p.total_q = int(q.size(0));
  p.total_k = int(k.size(0));
  fill_options(p, q, softmax_scale, f);
}

// A paged K / V: k and v (num_blocks, page_size, heads_k, hdim) pools, block_table int32
// (batch, max_blocks) of page indices into them (common/params.h). Page indices are not read
// on the host; the frontend checks the shapes.
void set_pages(flash::FwdParams& p, const at::Tensor& block_table, int64_t batch,
               const at::Tensor& k, const at::Tensor& q) {
  TORCH_CHECK(block_table.is_cuda() && block_table.device() == q.device() &&
                  block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) == batch && block_table.stride(1) == 1,
              "flash_attn: block_table must be an int32 CUDA tensor (batch, max_blocks) with a "
              "contiguous last dim on q's device, got ", block_table.scalar_type(), " ",
              shape(block_table.sizes()));
  TORCH_CHECK(k.size(1) >= 1, "flash_attn: the page size must be >= 1");
  p.block_table = block_table.data_ptr<int>();
  p.block_table_stride = block_table.stride(0);
  p.page_size = int(k.size(1));
  p.cache_batch = int(k.size(0));  // the pool's pages (the TMA maps' last extent)
}

// q (total_q, heads, hdim), k / v (total_k, heads_k, hdim); sequence b's rows start at
// cu_seqlens[b] (common/params.h), or with block_table paged pools (set_pages); out like q, lse
// (heads, total_q).
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& seqused_q,
    const std::optional<at::Tensor>& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& out_arg,
    const std::optional<at::Tensor>& lse_arg, const std::optional<at::Tensor>& rng_state_arg,
    const std::optional<at::Tensor>& alibi_slopes, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    const std::string& family, const std::string& tuning) {
  const bool paged = block_table.has_value() && block_table->defined();
  check_not_fp8(q, "varlen_fwd");
  check_packed_shapes(q, k, v, paged);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK(batch >= 1, "flash_attn: cu_seqlens_q must hold batch + 1 >= 2 offsets");
  const int* cu_q = index_ptr(cu_seqlens_q, "cu_seqlens_q", batch + 1, q);
  const int* cu_k = index_ptr(cu_seqlens_k, "cu_seqlens_k", batch + 1, q);
  constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 1024;
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0 && max_seqlen_q <= kMaxSeqlen &&
                  max_seqlen_k <= kMaxSeqlen && q.size(0) <= kMaxSeqlen && k.size(0) <= kMaxSeqlen,
              "flash_attn: max_seqlen_q / max_seqlen_k and the totals must be in [0, ",
              num(kMaxSeqlen), "]");
  at::Tensor out = out_arg ? *out_arg : at::empty(q.sizes(), q.options());
  at::Tensor lse = lse_arg ? *lse_arg
                           : at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  at::Tensor rng_state =
      rng_state_arg ? *rng_state_arg : at::empty({2}, q.options().dtype(at::kLong));
  check_packed_like(out, "out", q);
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn: out must have q's shape");
  check_lse(lse, q, {q.size(1), q.size(0)}, "(heads, total_q)");
  check_rng_state(rng_state, q);
  const auto result = std::make_tuple(out, lse, rng_state);
  if (q.size(0) == 0 || max_seqlen_q == 0 || k.size(0) == 0 || max_seqlen_k == 0) {
    rng_state.zero_();
    out.zero_();
    lse.fill_(std::numeric_limits<float>::infinity());
    return result;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const Kernel& kernel =
      find_kernel(family, "fwd", dtype_name(q), int(q.size(2)), device_info(q).arch);

  flash::FwdParams p;
  fill_varlen(p, q, k, v, out, lse, batch, cu_q, cu_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, softmax_scale,
              {causal, window_left, window_right, softcap, alibi_slopes, dropout_p});
  if (paged) set_pages(p, *block_table, batch, k, q);
  set_rng_state(p, rng_state, q, family);
  kernel.fwd(p, kernel.hdim, parse_tuning(tuning), q);
  return result;
}

// The gradient of varlen_fwd: dq like q, dk / dv like k (rows past seqused get zeros).
void varlen_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                const at::Tensor& rng_state, const at::Tensor& cu_seqlens_q,
                const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& seqused_q,
                const std::optional<at::Tensor>& seqused_k, int64_t max_seqlen_q,
                int64_t max_seqlen_k, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                const std::optional<at::Tensor>& alibi_slopes, double softmax_scale, bool causal,
                int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                bool deterministic, const std::string& family, const std::string& tuning) {
  check_packed_shapes(q, k, v);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{out, "out"},
                                {dout, "dout"}, {dq, "dq"}}) {
    check_packed_like(t, name, q);
    TORCH_CHECK(t.sizes() == q.sizes(), "flash_attn: ", name, " must have q's shape");
  }
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{dk, "dk"}, {dv, "dv"}}) {
    check_packed_like(t, name, q);
    TORCH_CHECK(t.sizes() == k.sizes(), "flash_attn: ", name, " must have k's shape");
  }
  check_lse(lse, q, {q.size(1), q.size(0)}, "(heads, total_q)");
  check_rng_state(rng_state, q);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK(batch >= 1, "flash_attn: cu_seqlens_q must hold batch + 1 >= 2 offsets");
  const int* cu_q = index_ptr(cu_seqlens_q, "cu_seqlens_q", batch + 1, q);
  const int* cu_k = index_ptr(cu_seqlens_k, "cu_seqlens_k", batch + 1, q);
  if (q.size(0) == 0 || k.size(0) == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const Kernel& kernel =
      find_kernel(family, "bwd", dtype_name(q), int(q.size(2)), device_info(q).arch);

  flash::BwdParams p;
  fill_varlen(p, q, k, v, out, lse, batch, cu_q, cu_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, softmax_scale,
              {causal, window_left, window_right, softcap, alibi_slopes, dropout_p});
  fill_grads(p, dout, dq, dk, dv, packed_strides_of, rng_state, deterministic);
  kernel.bwd(p, kernel.hdim, parse_tuning(tuning), q);
}

// The keep-mask of the forward that wrote rng_state, for return_attn_probs and the tests:
// (batch, heads, seqlen_q, seqlen_k) bool, True = kept. The same Philox draws as the kernels.
// ---- KV cache (flash_attn/_ops.py run_kvcache_fwd) ---------------------------------------------

// q (batch, seqlen_q, heads, hdim); the caches (batch_cache, capacity, heads_k, hdim), updated
// in place with the new k / v (batch, seqlen_new, heads_k, hdim) at cache_seqlens (or the
// int cache_seqlen for every sequence, -1: the cache is full); rotary on q and the new k.
// Paged caches (block_table): pools (num_blocks, page_size, heads_k, hdim). num_splits: the
// split-KV count (0: the plan's choice, fa2.h). Returns (out, lse (batch, heads, seqlen_q)).
std::tuple<at::Tensor, at::Tensor> kvcache_fwd(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
    const std::optional<at::Tensor>& cache_seqlens, int64_t cache_seqlen,
    const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, const std::string& family, const std::string& tuning) {
  check_not_fp8(q, "kvcache_fwd");
  check_qkv_like(q, "q", q);
  check_qkv_like(k_cache, "k_cache", q);
  check_qkv_like(v_cache, "v_cache", q);
  TORCH_CHECK(num_splits >= 0, "flash_attn: num_splits must be >= 0, got ", num(num_splits));
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2), dim = q.size(3);
  // Paged: the caches are (num_blocks, page_size, heads_k, hdim) pools.
  const bool paged = block_table.has_value() && block_table->defined();
  const int64_t capacity = paged ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);
  const int64_t heads_k = k_cache.size(2);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == dim && dim % 8 == 0 &&
                  heads_k > 0 && heads % heads_k == 0,
              "flash_attn: q ", shape(q.sizes()), ", k_cache ", shape(k_cache.sizes()),
              ", v_cache ", shape(v_cache.sizes()), " do not fit together");
  const bool append = k.has_value() && k->defined();
  TORCH_CHECK(append == (v.has_value() && v->defined()), "flash_attn: k and v go together");
  const int64_t seqlen_new = append ? k->size(1) : 0;
  if (append) {
    check_qkv_like(*k, "k", q);
    check_qkv_like(*v, "v", q);
    TORCH_CHECK(k->sizes() == v->sizes() && k->size(0) == batch && k->size(2) == heads_k &&
                    k->size(3) == dim && seqlen_new <= capacity,
                "flash_attn: k / v must be (batch, seqlen_new, heads_k, hdim) with seqlen_new "
                "<= the cache's capacity, got ", shape(k->sizes()));
  }
  const int* cached = index_ptr(cache_seqlens, "cache_seqlens", batch, q);
  const int* rows = index_ptr(cache_batch_idx, "cache_batch_idx", batch, q);
  const int* leftpad = index_ptr(cache_leftpad, "cache_leftpad", batch, q);
  TORCH_CHECK(!paged || (rows == nullptr && leftpad == nullptr),
              "flash_attn: a paged cache takes neither cache_batch_idx nor cache_leftpad");
  TORCH_CHECK(paged || rows != nullptr || k_cache.size(0) == batch, "flash_attn: k_cache has ",
              num(k_cache.size(0)), " rows for a batch of ", num(batch),
              " and no cache_batch_idx");
  const int cached_all = int(cache_seqlen < 0 ? capacity - seqlen_new : cache_seqlen);
  TORCH_CHECK(cached != nullptr || (cached_all >= 0 && cached_all + seqlen_new <= capacity),
              "flash_attn: cache_seqlen ", num(cache_seqlen), " with ", num(seqlen_new),
              " new tokens does not fit a cache of ", num(capacity));
  const bool rotary = rotary_cos.has_value() && rotary_cos->defined();

  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({batch, heads, seqlen_q}, q.options().dtype(at::kFloat));
  if (batch == 0 || seqlen_q == 0) return {out, lse};
  const c10::cuda::CUDAGuard guard(q.device());
  if (capacity == 0) {  // no key anywhere (and nothing to append): every row is empty
    out.zero_();
    lse.fill_(std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const Kernel& kernel = find_kernel(family, "fwd", dtype_name(q), int(dim), device_info(q).arch);
  flash::FwdParams p;
  if (paged) set_pages(p, *block_table, batch, k_cache, q);

  // 2.x rotates q row i at cached + i when the call is causal or local, else every row at
  // cached (the frontend has made a window side past the cache unbounded).
  at::Tensor q_attn = q;
  bool after_prep = false;
  if (append || rotary) {
    flash::KvcachePrep prep;
    prep.bf16 = q.scalar_type() == at::kBFloat16;
    prep.batch = int(batch);
    prep.seqlen_q = int(seqlen_q);
    prep.seqlen_new = int(seqlen_new);
    prep.heads = int(heads);
    prep.heads_k = int(heads_k);
    prep.head_dim = int(dim);
    if (rotary) {
      q_attn = at::empty(q.sizes(), q.options());
      prep.q = q.data_ptr();
      prep.q_out = q_attn.data_ptr();
      prep.q_strides = strides_of(q);
      prep.q_out_strides = strides_of(q_attn);
      prep.rotary_cos = rotary_cos->data_ptr();
      prep.rotary_sin = rotary_sin->data_ptr();
      prep.rotary_half = int(rotary_cos->size(1));
      prep.seqlen_ro = int(rotary_cos->size(0));
      prep.interleaved = rotary_interleaved;
      prep.q_per_row = causal || window_left >= 0 || window_right >= 0;
    }
    if (append) {
      prep.k_new = k->data_ptr();
      prep.v_new = v->data_ptr();
      prep.k_new_strides = strides_of(*k);
      prep.v_new_strides = strides_of(*v);
    }
    prep.k_cache = k_cache.data_ptr();
    prep.v_cache = v_cache.data_ptr();
    prep.k_cache_strides = strides_of(k_cache);
    prep.v_cache_strides = strides_of(v_cache);
    prep.capacity = int(capacity);
    prep.block_table = p.block_table;
    prep.block_table_stride = p.block_table_stride;
    prep.page_size = p.page_size;
    prep.cache_batch_idx = rows;
    prep.cache_seqlens = cached;
    prep.cache_seqlen = cached_all;
    after_prep = flash::launch_kvcache_prep(prep, stream);
  }

  fill_fwd(p, q_attn, k_cache, v_cache, out, lse, softmax_scale,
           {causal, window_left, window_right, softcap, alibi_slopes, 0.0});
  p.seqlen_k = int(capacity);  // fill_fwd read a paged pool's page size there
  p.kv_cache = true;
  p.cache_seqlens = cached;
  p.cache_seqlen = cached_all;
  p.seqlen_new = int(seqlen_new);
  p.cache_batch_idx = rows;
  p.cache_leftpad = leftpad;
  p.cache_batch = int(k_cache.size(0));
  p.after_prep = after_prep;
  p.q_from_prep = after_prep && rotary;
  p.splits_requested = int(std::min<int64_t>(num_splits, 1 << 20));
  p.rng_state = nullptr;
  kernel.fwd(p, kernel.hdim, parse_tuning(tuning), q);
  return {out, lse};
}

// flash_attn.fp8.quantize's kernel: q, k, v (fp16 / bf16 / fp32) to e4m3, scaled per (batch,
// KV head), q and k rotated by `signs` (head_dim floats of +-1, or None: no rotation) and the
// Hadamard transform in blocks of the largest power of two dividing head_dim. Returns
// (q8, k8, v8, descales (3, batch, heads_k) float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& signs) {
  check_shapes(q, k, v);
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "flash_attn: fp8_quantize takes float16, bfloat16 or float32, got ", dtype);
  const int64_t head_dim = q.size(3);
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 256, "flash_attn: fp8_quantize takes head dims "
              "that are multiples of 16 up to 256 (the FP8 forward's), got ", num(head_dim));
  const bool rotate = signs.has_value() && signs->defined();
  if (rotate) {
    TORCH_CHECK(signs->is_cuda() && signs->device() == q.device() &&
                    signs->scalar_type() == at::kFloat && signs->dim() == 1 &&
                    signs->size(0) == head_dim && signs->is_contiguous(),
                "flash_attn: signs must be contiguous float32 (head_dim,) on q's device");
  }
  const int64_t batch = q.size(0), heads_k = k.size(2);
  TORCH_CHECK(batch <= std::numeric_limits<int>::max() / 3,
              "flash_attn: fp8_quantize batch too large, got ", num(batch));
  const auto e4m3 = q.options().dtype(at::kFloat8_e4m3fn);
  at::Tensor q8 = at::empty(q.sizes(), e4m3), k8 = at::empty(k.sizes(), e4m3),
             v8 = at::empty(v.sizes(), e4m3);
  at::Tensor scales = at::empty({2, 3, batch, heads_k}, q.options().dtype(at::kFloat));
  if (q.numel() == 0 && k.numel() == 0) {
    scales[1].fill_(std::numeric_limits<float>::min());
    return {q8, k8, v8, scales[1]};
  }
  flash::Fp8Quantize p;
  p.input = dtype == at::kHalf ? flash::Fp8Quantize::Input::kFp16
            : dtype == at::kBFloat16 ? flash::Fp8Quantize::Input::kBf16
                                     : flash::Fp8Quantize::Input::kFp32;
  p.batch = int(batch);
  p.heads_k = int(heads_k);
  p.head_dim = int(head_dim);
  p.hadamard_block = rotate ? int(head_dim & -head_dim) : 0;
  p.signs = rotate ? signs->data_ptr<float>() : nullptr;
  const std::array<const at::Tensor*, 3> in = {&q, &k, &v};
  const std::array<at::Tensor*, 3> out = {&q8, &k8, &v8};
  for (int i = 0; i < 3; ++i) {
    p.t[i].in = in[i]->data_ptr();
    p.t[i].out = out[i]->data_ptr();
    p.t[i].in_strides = strides_of(*in[i]);
    p.t[i].out_strides = strides_of(*out[i]);
    p.t[i].seqlen = int(in[i]->size(1));
    p.t[i].heads = int(in[i]->size(2));
  }
  p.amax = scales[0].data_ptr<float>();
  p.descale = scales[1].data_ptr<float>();
  const c10::cuda::CUDAGuard guard(q.device());
  flash::launch_fp8_quantize(p, c10::cuda::getCurrentCUDAStream().stream());
  return {q8, k8, v8, scales[1]};
}

at::Tensor dropout_mask(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                        int64_t seqlen_q, int64_t seqlen_k, double dropout_p) {
  check_rng_state(rng_state, rng_state);  // (its own device: only the CUDA and layout checks)
  check_dropout_p(dropout_p);
  TORCH_CHECK(batch >= 0 && heads >= 0 && seqlen_q >= 0 && seqlen_k >= 0,
              "flash_attn: dropout_mask sizes must be >= 0, got (", num(batch), ", ", num(heads), ", ",
              num(seqlen_q), ", ", num(seqlen_k), ")");
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  TORCH_CHECK(batch * heads <= kMaxInt && seqlen_q <= kMaxInt && seqlen_k <= kMaxInt,
              "flash_attn: dropout_mask sizes past 2^31");
  at::Tensor mask = at::empty({batch, heads, seqlen_q, seqlen_k},
                              rng_state.options().dtype(at::kBool));
  if (mask.numel() == 0) return mask;
  const c10::cuda::CUDAGuard guard(rng_state.device());
  flash::launch_dropout_mask(mask.data_ptr<bool>(), rng_state.data_ptr<int64_t>(),
                             int(batch * heads), int(seqlen_q), int(seqlen_k),
                             keep_threshold(dropout_p),
                             c10::cuda::getCurrentCUDAStream().stream());
  return mask;
}

// The hash of the csrc/ this build was made from (build_matrix.source_hash): the tests of a
// checkout compare it with theirs.
constexpr const char* kSourceHash =
#include "generated/source_hash.inc"
    ;

std::vector<int> built_archs() { return target_archs(); }

int ptx_arch() { return kPtxArch; }

std::vector<std::tuple<std::string, std::string, std::string, int, int>> built_configs() {
  std::vector<std::tuple<std::string, std::string, std::string, int, int>> out;
  for (const Kernel& k : kernels()) out.emplace_back(k.family, k.direction, k.dtype, k.hdim, k.min_arch);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_attn CUDA kernels (FA1, FA2, FA3); see ARCHITECTURE.md";
  m.def("fwd", &fwd, "attention forward: (out, lse, rng_state), into the tensors given or new "
        "ones where None",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
        py::arg("rng_state"), py::arg("alibi_slopes"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("dropout_p"), py::arg("family"), py::arg("tuning") = "");
  m.def("fp8_fwd", &fp8_fwd,
        "FP8 attention forward (fa3, e4m3 q / k / v, bf16 out): (out, lse), into the tensors "
        "given or new ones where None",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_descale"), py::arg("k_descale"),
        py::arg("v_descale"), py::arg("out"), py::arg("lse"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("window_left"), py::arg("window_right"), py::arg("family"),
        py::arg("tuning") = "");
  m.def("fp8_quantize", &fp8_quantize,
        "e4m3 q / k / v scaled per (batch, KV head), q and k rotated by signs and a Hadamard "
        "transform: (q8, k8, v8, descales (3, batch, heads_k))",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("signs"));
  m.def("bwd", &bwd, "attention backward: writes dq, dk, dv", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("rng_state"),
        py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("alibi_slopes"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left"),
        py::arg("window_right"), py::arg("softcap"), py::arg("dropout_p"),
        py::arg("deterministic"), py::arg("family"), py::arg("tuning") = "");
  m.def("varlen_fwd", &varlen_fwd,
        "variable-length forward: (out, lse (heads, total_q), rng_state)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("seqused_q"), py::arg("seqused_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("block_table"), py::arg("out"), py::arg("lse"),
        py::arg("rng_state"), py::arg("alibi_slopes"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("dropout_p"), py::arg("family"), py::arg("tuning") = "");
  m.def("varlen_bwd", &varlen_bwd, "variable-length backward: writes dq, dk, dv",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("rng_state"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("seqused_q"), py::arg("seqused_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("alibi_slopes"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("dropout_p"), py::arg("deterministic"), py::arg("family"),
        py::arg("tuning") = "");
  m.def("kvcache_fwd", &kvcache_fwd,
        "attention over a KV cache, the new k / v written into it first: (out, lse)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("rotary_cos"), py::arg("rotary_sin"), py::arg("cache_seqlens"),
        py::arg("cache_seqlen"), py::arg("cache_batch_idx"), py::arg("cache_leftpad"),
        py::arg("block_table"), py::arg("alibi_slopes"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("rotary_interleaved"), py::arg("num_splits"), py::arg("family"),
        py::arg("tuning") = "");
  m.def("dropout_mask", &dropout_mask,
        "(batch, heads, seqlen_q, seqlen_k) bool keep-mask of the forward that wrote rng_state",
        py::arg("rng_state"), py::arg("batch"), py::arg("heads"), py::arg("seqlen_q"),
        py::arg("seqlen_k"), py::arg("dropout_p"));
  m.def("built_configs", &built_configs,
        "(family, direction, dtype, hdim, min_arch) of every kernel in this build");
  m.def("built_archs", &built_archs,
        "compute capabilities (major*10+minor) with machine code in this build");
  m.def("source_hash", [] { return std::string(kSourceHash); },
        "hash of the csrc/ sources this build was made from (build_matrix.source_hash)");
  m.def("ptx_arch", &ptx_arch,
        "compute capability whose portable PTX this build carries (the FLASH_ATTN_CUDA_ARCHS "
        "entry marked +PTX), 0: none");
}
