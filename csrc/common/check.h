// Error reporting for library code: a failed CUDA call throws (the API layer turns it into a
// Python RuntimeError); it never exits the process.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define FLASH_CHECK_CUDA(expr)                                                              \
  do {                                                                                      \
    cudaError_t flash_err_ = (expr);                                                        \
    if (flash_err_ != cudaSuccess) {                                                        \
      throw std::runtime_error(std::string("flash_attn: CUDA error at ") + __FILE__ + ":" + \
                               std::to_string(__LINE__) + ": " +                            \
                               cudaGetErrorString(flash_err_));                             \
    }                                                                                       \
  } while (0)

// After a launch: catches bad launch configurations without synchronizing the device.
#define FLASH_CHECK_LAUNCH() FLASH_CHECK_CUDA(cudaGetLastError())
