// The operands the RMSNorm backward scripts beside it time, and the copy ceiling: x, dy and dx of rows x n (4 bytes an
// element, room for any dtype up to f32), the weight, rstd, 4096 rows of partial weight-gradient
// sums and the weight gradient, each filled with a constant byte (dy's given, the others 0x3f).
#pragma once
#include "event_timing.cuh"

struct RmsBackwardBuffers {
  void *x, *dy, *dx, *w, *rstd, *partial, *dw;
};

// Measures and prints the copy ceiling into `ceiling`, then allocates and fills `b`; a CUDA error
// is printed and returned as 1 (CK).
inline int open_rms_backward(unsigned long long rows, unsigned long long n, int dy_fill, RmsBackwardBuffers& b,
                             double& ceiling) {
  ceiling = copy_ceiling();
  printf("ceiling %.0f GB/s\n", ceiling);
  const unsigned long long big = rows * n * 4;
  CK(cudaMalloc(&b.x, big)); CK(cudaMalloc(&b.dy, big)); CK(cudaMalloc(&b.dx, big));
  CK(cudaMalloc(&b.w, n * 4)); CK(cudaMalloc(&b.rstd, rows * 4)); CK(cudaMalloc(&b.partial, 4096 * n * 4)); CK(cudaMalloc(&b.dw, n * 4));
  CK(cudaMemset(b.x, 0x3f, big)); CK(cudaMemset(b.dy, dy_fill, big)); CK(cudaMemset(b.w, 0x3f, n * 4));
  CK(cudaMemset(b.rstd, 0x3f, rows * 4));
  return 0;
}
