// The dropout keep-mask as a tensor, for return_attn_probs and the tests: the draws the kernels
// make (common/philox.cuh), one element per thread. Not on any hot path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flash {

// out: (batch_heads, seqlen_q, seqlen_k) bool, contiguous, true = kept. rng_state: the device
// [seed, offset] a forward wrote. Throws std::runtime_error on a launch failure.
void launch_dropout_mask(bool* out, const int64_t* rng_state, int batch_heads, int seqlen_q,
                         int seqlen_k, uint32_t keep_threshold, cudaStream_t stream);

}  // namespace flash
