// flash::launch_dropout_mask (common/dropout_mask.h). Compiled once, for every target arch:
// Philox needs nothing newer than sm75.
#include <algorithm>

#include "common/check.h"
#include "common/dropout_mask.h"
#include "common/philox.cuh"

namespace flash {
namespace {

constexpr int kThreads = 256;

// One thread per element, grid-stride: a Philox call gives eight draws but spending one per
// element keeps the indexing obvious, which is what a checking tool is for.
__global__ void __launch_bounds__(kThreads)
    dropout_mask_kernel(bool* out, PhiloxArgs philox, int64_t n, int seqlen_q, int seqlen_k,
                        uint32_t keep_threshold) {
  const PhiloxKey key = philox_key(philox);
  const int64_t per_head = int64_t(seqlen_q) * seqlen_k;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t bh = i / per_head;
    const int64_t in_head = i - bh * per_head;
    const int64_t row = in_head / seqlen_k;
    const int64_t col = in_head - row * seqlen_k;
    out[i] = dropout_keep(key, keep_threshold, uint32_t(bh), uint32_t(row), uint32_t(col));
  }
}

}  // namespace

void launch_dropout_mask(bool* out, const int64_t* rng_state, int batch_heads, int seqlen_q,
                         int seqlen_k, uint32_t keep_threshold, cudaStream_t stream) {
  const int64_t n = int64_t(batch_heads) * seqlen_q * seqlen_k;
  if (n == 0) return;
  // The seed and offset stay on the device: reading them here would synchronise.
  PhiloxArgs philox;
  philox.seed_ptr = rng_state;
  philox.offset_ptr = rng_state + 1;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(1) << 20);
  dropout_mask_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(out, philox, n, seqlen_q,
                                                                   seqlen_k, keep_threshold);
  FLASH_CHECK_LAUNCH();
}

}  // namespace flash
