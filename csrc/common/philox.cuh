// Dropout randomness: Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC'11), keyed by torch's generator seed, with a counter built from the position
// of the element. The keep decision of (batch*head, row, key) is therefore a pure function of
// (seed, offset, bh, row, key): the forward, the backward (which regenerates the mask instead of
// storing it) and _C.dropout_mask (the tests' view of it) agree whatever their tiling.
//
// One Philox call gives 128 bits = eight 16-bit draws, for the 16x16 block of (row, key) that
// one lane owns in two adjacent m16n8 MMA accumulator tiles: rows r, r+8 and keys c, c+1,
// c+8, c+9, where r % 16 < 8 and c % 16 < 8 is even. So a thread spends exactly one call per
// 8 elements it holds, with no shuffles.
//
//   counter = (key / 16, (row / 16) << 5 | (row % 8) << 2 | (key % 8) / 2, bh, offset_lo)
//   key     = (seed_lo, seed_hi ^ offset_hi)
//   draw    = 16-bit word ((row / 8) % 2) | (key % 2) << 1 | ((key / 8) % 2) << 2
//   keep    = draw < keep_threshold
#pragma once

#include <cstdint>

#include "common/params.h"

namespace flash {

struct PhiloxKey {
  uint32_t k0, k1, ctr_hi;  // ctr_hi: the low 32 bits of the offset (the counter's last word)
};

// Resolve the seed and offset (values, or device pointers under CUDA graph capture).
__device__ __forceinline__ PhiloxKey philox_key(const PhiloxArgs& a) {
  uint64_t seed = a.seed, offset = a.offset;
  if (a.seed_ptr != nullptr) {
    seed = static_cast<uint64_t>(*a.seed_ptr);
    offset = static_cast<uint64_t>(*a.offset_ptr) + a.offset_intragraph;
  }
  return {static_cast<uint32_t>(seed),
          static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32),
          static_cast<uint32_t>(offset)};
}

__device__ __forceinline__ uint64_t philox_offset(const PhiloxArgs& a) {
  return a.seed_ptr != nullptr ? static_cast<uint64_t>(*a.offset_ptr) + a.offset_intragraph
                               : a.offset;
}
__device__ __forceinline__ uint64_t philox_seed(const PhiloxArgs& a) {
  return a.seed_ptr != nullptr ? static_cast<uint64_t>(*a.seed_ptr) : a.seed;
}

// Philox-4x32 with 10 rounds.
__device__ __forceinline__ uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kMul0, c.x), lo0 = kMul0 * c.x;
    const uint32_t hi1 = __umulhi(kMul1, c.z), lo1 = kMul1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return c;
}

// The eight 16-bit draws of the block that (row, key) belongs to (see the header comment);
// any (row, key) of the block gives the same words.
__device__ __forceinline__ uint4 dropout_draws(const PhiloxKey& key, uint32_t bh, uint32_t row,
                                               uint32_t col) {
  const uint4 ctr = make_uint4(col >> 4, ((row >> 4) << 5) | ((row & 7u) << 2) | ((col & 7u) >> 1),
                               bh, key.ctr_hi);
  return philox4x32(ctr, key.k0, key.k1);
}

// Which of the eight words is the draw of (row, key).
__device__ __forceinline__ int dropout_draw_index(uint32_t row, uint32_t col) {
  return ((row >> 3) & 1u) | ((col & 1u) << 1) | (((col >> 3) & 1u) << 2);
}

__device__ __forceinline__ uint32_t draw16(const uint4& w, int index) {
  const uint32_t word = (index >> 1) == 0 ? w.x : (index >> 1) == 1 ? w.y : (index >> 1) == 2 ? w.z : w.w;
  return (index & 1) ? (word >> 16) : (word & 0xFFFFu);
}

__device__ __forceinline__ bool dropout_keep(const PhiloxKey& key, uint32_t threshold,
                                             uint32_t bh, uint32_t row, uint32_t col) {
  return draw16(dropout_draws(key, bh, row, col), dropout_draw_index(row, col)) < threshold;
}

}  // namespace flash
