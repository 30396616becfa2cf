// RMSNorm backward launch shapes at 8192 x 2048 in bf16: ops-cuda's own kernels
// (kernels/llama.cu, included) at several vectors per thread and grid sizes, each timed with
// CUDA events (50 back-to-back launches after 5 warm-ups) as the op runs it (the backward, then
// `rms_norm_weight_grad_finish` adding the blocks' partial weight-gradient rows), the backward
// alone and the finish alone, against a 2 GB device-to-device copy measured in the same run.
// Issue 30 asks 80% of the copy; it shows where the time goes (the finish: 4 to 5 µs of 38).
//
// On the GPU machine, from this folder:
//   nvcc -O3 -arch=sm_90 -std=c++17 --extended-lambda rms_norm_backward_shapes.cu -o rms && ./rms
#include "../../crates/ops-cuda/kernels/llama.cu"
#include "rms_norm_backward_buffers.cuh"

int main() {
  const unsigned long long rows = 8192, n = 2048;
  RmsBackwardBuffers buffers;
  double ceiling;
  if (open_rms_backward(rows, n, 0x3f, buffers, ceiling)) return 1;
  void *x = buffers.x, *dy = buffers.dy, *w = buffers.w, *dx = buffers.dx, *rstd = buffers.rstd, *partial = buffers.partial,
       *dw = buffers.dw;
  typedef __nv_bfloat16 B;
  const double bytes = 3.0 * rows * n * 2 + rows * 4;
  auto pct = [&](float ms) { return 100.0 * bytes / ms / 1e6 / ceiling; };
  auto finish = [&](unsigned long long chunks) {
    rms_norm_weight_grad_finish_bf16<<<n / FINISH_COLS, dim3(FINISH_COLS, FINISH_ROWS)>>>((const float*)partial, chunks, (B*)dw, 1, n);
  };
  struct Shape { int vpt, threads, grid; };
  Shape shapes[] = {{1, 256, 264}, {1, 256, 132}, {1, 256, 528}, {2, 128, 528}, {2, 128, 264}, {2, 128, 1056}, {4, 64, 1056}, {4, 64, 2112}};
  for (auto s : shapes) {
    auto main_kernel = [&] {
      if (s.vpt == 1) rms_norm_backward_v1_bf16<<<s.grid, s.threads>>>((const B*)dy, (const B*)x, (const float*)rstd, (const B*)w, (B*)dx, (float*)partial, rows, n);
      if (s.vpt == 2) rms_norm_backward_v2_bf16<<<s.grid, s.threads>>>((const B*)dy, (const B*)x, (const float*)rstd, (const B*)w, (B*)dx, (float*)partial, rows, n);
      if (s.vpt == 4) rms_norm_backward_v4_bf16<<<s.grid, s.threads>>>((const B*)dy, (const B*)x, (const float*)rstd, (const B*)w, (B*)dx, (float*)partial, rows, n);
    };
    float both = time_it([&] { main_kernel(); finish(s.grid); });
    float alone = time_it(main_kernel);
    float fin = time_it([&] { finish(s.grid); });
    printf("bf16 v%dx%d grid %d: both %.1f us (%.1f%%) | main %.1f us (%.1f%%) | finish %.1f us\n", s.vpt, s.threads, s.grid,
           both * 1e3, pct(both), alone * 1e3, pct(alone), fin * 1e3);
  }
  CK(cudaGetLastError());
  return 0;
}
