// RMSNorm forward launch shapes at 8192 x 2048 (bf16 and f32): ops-cuda's own kernels
// (kernels/llama.cu, included) at several grid sizes and vectors per thread, timed with CUDA
// events (medians are not needed: 50 back-to-back launches after 5 warm-ups), each as a share
// of a 2 GB device-to-device copy measured in the same run. It chose ops-cuda's forward launch
// (llama.rs: `RowShare::Forward`, `MAX_FORWARD_ROW_BLOCKS`).
//
// On the GPU machine, from this folder:
//   nvcc -O3 -arch=sm_90 -std=c++17 --extended-lambda rms_norm_forward_shapes.cu -o rms && ./rms
#include "../../crates/ops-cuda/kernels/llama.cu"
#include "event_timing.cuh"

int main() {
  const unsigned long long rows = 8192, n = 2048;
  const double ceiling = copy_ceiling();
  printf("ceiling %.0f GB/s\n", ceiling);
  void *x, *w, *out, *rstd;
  CK(cudaMalloc(&x, rows * n * 4)); CK(cudaMalloc(&w, n * 4)); CK(cudaMalloc(&out, rows * n * 4)); CK(cudaMalloc(&rstd, rows * 4));
  CK(cudaMemset(x, 0x3f, rows * n * 4)); CK(cudaMemset(w, 0x3f, n * 4));
  int grids[] = {8192, 132 * 16, 132 * 8, 132 * 4};
  for (int grid : grids) {
    // bf16: bytes = 2 * rows * n * 2
    double bytes = 2.0 * rows * n * 2 + rows * 4;
    float t1 = time_it([&] { rms_norm_v1_bf16<<<grid, 256>>>((const __nv_bfloat16*)x, (const __nv_bfloat16*)w, (__nv_bfloat16*)out, (float*)rstd, 1e-5, rows, n); });
    float t2 = time_it([&] { rms_norm_v2_bf16<<<grid, 128>>>((const __nv_bfloat16*)x, (const __nv_bfloat16*)w, (__nv_bfloat16*)out, (float*)rstd, 1e-5, rows, n); });
    float t4 = time_it([&] { rms_norm_v4_bf16<<<grid, 64>>>((const __nv_bfloat16*)x, (const __nv_bfloat16*)w, (__nv_bfloat16*)out, (float*)rstd, 1e-5, rows, n); });
    printf("bf16 grid %d: v1x256 %.1f us %.1f%% | v2x128 %.1f us %.1f%% | v4x64 %.1f us %.1f%%\n", grid,
           t1 * 1e3, 100 * bytes / t1 / 1e6 / ceiling, t2 * 1e3, 100 * bytes / t2 / 1e6 / ceiling, t4 * 1e3, 100 * bytes / t4 / 1e6 / ceiling);
    double fbytes = 2.0 * rows * n * 4 + rows * 4;
    float f2 = time_it([&] { rms_norm_v2_f32<<<grid, 256>>>((const float*)x, (const float*)w, (float*)out, (float*)rstd, 1e-5, rows, n); });
    float f4 = time_it([&] { rms_norm_v4_f32<<<grid, 128>>>((const float*)x, (const float*)w, (float*)out, (float*)rstd, 1e-5, rows, n); });
    printf("f32 grid %d: v2x256 %.1f us %.1f%% | v4x128 %.1f us %.1f%%\n", grid,
           f2 * 1e3, 100 * fbytes / f2 / 1e6 / ceiling, f4 * 1e3, 100 * fbytes / f4 / 1e6 / ceiling);
  }
  CK(cudaGetLastError());
  return 0;
}
