// The harnesses' timing: milliseconds a launch, from CUDA events around `iters` launches on
// the default stream after three untimed ones (inputs stay L2-warm: for comparing variants
// with each other, not with benchmark_attn.py).
#pragma once

#include <cuda_runtime.h>

template <class Launch>
float ms_per_launch(Launch&& launch, int iters) {
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  for (int i = 0; i < 3; ++i) launch();
  cudaEventRecord(t0);
  for (int i = 0; i < iters; ++i) launch();
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return ms / iters;
}
