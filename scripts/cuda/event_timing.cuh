// What the launch-shape scripts beside it share: a checked CUDA call, the mean time of a launch
// over back-to-back runs (CUDA events, after 5 warm-ups) or one launch at a time, and the copy
// ceiling (a 2 GB device-to-device copy, read + write, in GB/s) that their percentages are
// shares of.
#pragma once
#include <cstdio>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// Milliseconds per call of `f`, the mean of `iters` calls after 5 warm-ups.
template <typename F> float time_it(F f, int iters = 50) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) f();
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b); return ms / iters;
}

// Milliseconds of `f` launched alone between two events and synchronized, the mean of `iters`
// after 5 warm-ups: each call's launch latency counted, as the kernels bench times an op.
template <typename F> float time_synced(F f, int iters = 200) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  cudaDeviceSynchronize();
  float total = 0;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a); f(); cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); total += ms;
  }
  return total / iters;
}

// GB/s of a 2 GB device-to-device copy (read + write); 0 when the buffers cannot be had.
inline double copy_ceiling() {
  void *from, *to; const size_t bytes = 2000000000ULL;
  if (cudaMalloc(&from, bytes) != cudaSuccess || cudaMalloc(&to, bytes) != cudaSuccess) return 0;
  float ms = time_it([&] { cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice); }, 10);
  cudaFree(from); cudaFree(to);
  return 2.0 * bytes / ms / 1e6;
}
