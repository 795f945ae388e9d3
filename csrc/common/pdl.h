// Programmatic dependent launch (sm90): a kernel launched with `pdl` set may be scheduled while
// the kernel before it in the stream still runs, once every block of that one has called
// pdl_launch_dependents() (or exited). Before it reads anything the earlier kernel writes, it
// calls pdl_wait(), which returns when that grid has completed and its writes are visible.
// What it gains is the gap between the two kernels (the launch, the first blocks' setup and
// loads of inputs the earlier kernel does not write), so it is worth having only between
// kernels of one operation whose order we own, e.g. the backward's preprocess -> main ->
// dQ conversion. Below sm90 both calls compile to nothing and launches never set the flag.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/check.h"

namespace flash {

// Lets the next kernel, if launched with `pdl`, be scheduled once every block has called this.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits for the kernel before this one to complete (a no-op when launched without `pdl`).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// `pdl` (callers pass it only on sm90+).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, int smem_bytes,
            cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  config.attrs = pdl ? &attr : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  FLASH_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace flash
