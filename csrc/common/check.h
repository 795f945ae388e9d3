// Error reporting for library code: a failed CUDA call throws (the API layer turns it into a
// Python RuntimeError); it never exits the process. The throw first clears the thread's last
// error, so that a failed launch (a non-sticky error) is not reported again by the next call's
// FLASH_CHECK_LAUNCH.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define FLASH_CHECK_CUDA(expr)                                                              \
  do {                                                                                      \
    cudaError_t flash_err_ = (expr);                                                        \
    if (flash_err_ != cudaSuccess) {                                                        \
      (void)cudaGetLastError();                                                             \
      throw std::runtime_error(std::string("flash_attn: CUDA error at ") + __FILE__ + ":" + \
                               std::to_string(__LINE__) + ": " +                            \
                               cudaGetErrorString(flash_err_));                             \
    }                                                                                       \
  } while (0)

// After a launch: catches bad launch configurations without synchronizing the device.
#define FLASH_CHECK_LAUNCH() FLASH_CHECK_CUDA(cudaGetLastError())
