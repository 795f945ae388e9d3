// flash_attn.fp8.quantize on the GPU: q, k, v (16- or 32-bit) to e4m3 with one scale per
// (batch, KV head), q and k first rotated by random signs and a Hadamard transform (the FA3
// paper's incoherent processing). Two passes over the inputs, each one launch for all three
// tensors: the first finds the amax of every (tensor, batch, KV head) after the rotation, the
// second rotates again and writes x / descale in e4m3. Memory-bound, so recomputing the
// rotation costs nothing; reading the inputs twice is what it costs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace flash {

struct Fp8Quantize {
  enum class Input { kFp16, kBf16, kFp32 };
  Input input = Input::kBf16;
  int batch = 0, heads_k = 0, head_dim = 0;  // head_dim: a multiple of 16, at most 256
  // Rotation of q and k: x * signs, then the Sylvester Hadamard transform in blocks of
  // hadamard_block (a power of two dividing head_dim) divided by sqrt(block). 0: none.
  int hadamard_block = 0;
  const float* signs = nullptr;  // (head_dim) of +-1

  // q, k, v in turn. in: (batch, seqlen, heads, head_dim), any strides with rows of 16 bytes
  // aligned; out: e4m3 with the same index order, rows of 8 bytes aligned.
  struct Tensor {
    const void* in = nullptr;
    void* out = nullptr;
    Strides in_strides, out_strides;
    int seqlen = 0, heads = 0;
  };
  Tensor t[3];

  float* amax = nullptr;     // (3, batch, heads_k) scratch, zeroed by the launcher
  float* descale = nullptr;  // (3, batch, heads_k): max(amax / 448, FLT_MIN)
};

// Throws std::runtime_error on a launch failure.
void launch_fp8_quantize(const Fp8Quantize& p, cudaStream_t stream);

}  // namespace flash
