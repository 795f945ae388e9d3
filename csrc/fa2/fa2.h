// FA2 entry points: what the API layer calls. Instantiated per (element type, head dim) by the
// generated files in csrc/generated/. Every feature of the params (window, softcap, ALiBi,
// dropout, GQA) is supported in both directions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "common/params.h"

namespace flash::fa2 {

// A run-time switch of the kernels (FLASH_ATTN_FA2_*, for A/B benchmarks and for the tests of
// the paths they turn off), read at every call: a getenv next to a kernel launch, so one
// process can compare both settings. The launchers list theirs.
inline bool env_flag(const char* name, bool fallback) {
  const char* env = std::getenv(name);
  return env == nullptr ? fallback : std::atoi(env) != 0;
}

// Rows of the per-row backward scratch (D, dQ accumulator) are padded to this.
constexpr int kRowPad = 128;

__host__ __device__ inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The most dynamic shared memory a block may opt into: sm80 (A100) and sm86/sm89. A tile
// larger than the smaller also gets a variant with fewer buffers, chosen at launch.
constexpr int kSm80SmemBytes = 163 * 1024;
constexpr int kSm86SmemBytes = 99 * 1024;

// The backward kernels' query tiles are at least this tall (the deterministic mode keeps one
// counter per tile of this height, enough for any of them).
constexpr int kBwdMinBlockM = 64;

// Backward scratch, laid out by the launcher (fa2_bwd_launch.cuh), rows_pad = round_up(seqlen_q,
// kRowPad):
//   dq_accum: fp32 (batch, heads, rows_pad, kernel_hdim) in m16n8 fragment order (fa2_bwd_dq.h)
//   counters: int32 (batch, heads, rows_pad / kBwdMinBlockM), deterministic mode only: whose
//             turn it is to add into each query tile of dq_accum
//   dsum:     fp32 (batch, heads, rows_pad), D = rowsum(dO o O)
// dq_accum and the counters are zeroed by the preprocess (or a memset, fa2_bwd_launch.cuh); dsum
// is written whole by the preprocess.
// (The backward's launcher owns this layout; the API layer only sizes the allocation.)
inline int64_t bwd_workspace_bytes(const BwdParams& p, int kernel_hdim) {
  const int64_t rows = int64_t(p.batch) * p.heads * round_up(p.seqlen_q, kRowPad);
  const int64_t counters = p.deterministic ? rows / kBwdMinBlockM : 0;
  return rows * kernel_hdim * 4 + counters * 4 + rows * 4;
}

// The forward needs no scratch. Throws std::runtime_error on a launch failure.
template <typename T, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);

// params.workspace must hold bwd_workspace_bytes(...) bytes (no initialisation needed).
template <typename T, int kHeadDim>
void run_bwd(const BwdParams& params, cudaStream_t stream);

}  // namespace flash::fa2
