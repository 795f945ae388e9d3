// The tensor map of a KV cache's K or V for TMA boxes of box_rows rows, read by the kernels that
// cannot take a whole tile in one box: fa2's decode kernel (boxes into its own shared layout)
// and fa3's forward over paged pools (a tile's rows can span pages). A 4-D view (head_dim,
// rows, heads_k, p.cache_batch): rows the cache's capacity, or a paged pool's page size with
// the pool's pages as the last extent. Boxes of box_cols columns (64 in the 128-byte swizzle,
// 32 in the 64-byte one: 16-bit elements) x box_rows rows; rows past the extent and columns
// past head_dim read as zeros. Host only.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda.h>
#include <cutlass/cuda_host_adapter.hpp>

#include "common/params.h"

namespace flash {

inline CUtensorMap kv_box_map(const void* ptr, const Strides& s, const FwdParams& p, int rows,
                              int box_cols, int box_rows) {
  constexpr int kElementBytes = 2;  // fp16 / bf16
  // A stride must be a multiple of 16 bytes also along a dimension of extent 1, where the
  // frontend leaves it as it comes; it is never stepped along (as in fa3_fwd_launch.cuh).
  const int64_t row = rows > 1 ? s.row : p.head_dim;
  const int64_t head = p.heads_k > 1 ? s.head : row * rows;
  const int64_t batch = p.cache_batch > 1 ? s.batch : head * p.heads_k;
  cuuint64_t dims[4] = {cuuint64_t(p.head_dim), cuuint64_t(rows), cuuint64_t(p.heads_k),
                        cuuint64_t(p.cache_batch)};
  cuuint64_t strides[3] = {cuuint64_t(row * kElementBytes), cuuint64_t(head * kElementBytes),
                           cuuint64_t(batch * kElementBytes)};
  cuuint32_t box[4] = {cuuint32_t(box_cols), cuuint32_t(box_rows), 1, 1};
  cuuint32_t steps[4] = {1, 1, 1, 1};
  const CUtensorMapSwizzle swizzle =
      box_cols * kElementBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  CUtensorMap map;
  const CUresult result = cutlass::call_cuTensorMapEncodeTiled(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(ptr), dims, strides, box, steps,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error("flash_attn: cuTensorMapEncodeTiled failed for a KV cache's box map "
                             "(CUresult " + std::to_string(int(result)) + ")");
  }
  return map;
}

}  // namespace flash
