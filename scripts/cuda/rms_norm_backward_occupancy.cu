// RMSNorm backward at 8192 x 2048 in bf16, by rows in flight and blocks an SM: ncu showed the
// op's backward as it stood at f1a72bb (8 rows a pass, 128 registers, 2 blocks of 256 an SM: 25%
// occupancy) at 54% of DRAM bandwidth, latency-bound (llama.cu now runs 4 rows at 3 blocks). Here ops-cuda's `rms_norm_backward_vec` (kernels/llama.cu, included)
// at K rows a pass under launch bounds of B blocks an SM, on B · 132 blocks, timed alone, with
// today's finish kernel after it, and with the finish inside one cooperative launch (a grid
// barrier, then each block adds 8 columns), one launch at a time between events as the kernels
// bench times it. Against a 2 GB copy.
//
// On the GPU machine, from this folder:
//   nvcc -O3 -arch=sm_90 -std=c++17 --extended-lambda rms_norm_backward_occupancy.cu -o occupancy && ./occupancy
#include <cooperative_groups.h>

#include "../../crates/ops-cuda/kernels/llama.cu"
#include "rms_norm_backward_buffers.cuh"

namespace cg = cooperative_groups;
typedef __nv_bfloat16 B;

template <int K, int BLOCKS>
__global__ void __launch_bounds__(256, BLOCKS)
    backward(const B* dy, const B* x, const float* rstd, const B* w, B* dx, float* partial, B* dw,
             unsigned long long rows, unsigned long long n) {
    rms_norm_backward_vec<B, 1, K>(dy, x, rstd, w, dx, partial, rows, n);
}

// The same, then a grid barrier, then block b adds 8 columns (every gridDim.x · 8-th group
// after): 32 lanes of threads each take every 32nd partial row, lane 0 adds the lanes in order.
template <int K, int BLOCKS>
__global__ void __launch_bounds__(256, BLOCKS)
    backward_fused(const B* dy, const B* x, const float* rstd, const B* w, B* dx, float* partial, B* dw,
                   unsigned long long rows, unsigned long long n) {
    rms_norm_backward_vec<B, 1, K>(dy, x, rstd, w, dx, partial, rows, n);
    cg::this_grid().sync();
    constexpr unsigned COLS = 8;
    __shared__ float lane_sums[256];
    const unsigned lanes = blockDim.x / COLS, col = threadIdx.x % COLS, lane = threadIdx.x / COLS;
    for (unsigned long long c0 = (unsigned long long)blockIdx.x * COLS; c0 < n; c0 += (unsigned long long)gridDim.x * COLS) {
        const unsigned long long j = c0 + col;
        float acc = 0;
        if (j < n) {
#pragma unroll 4
            for (unsigned long long r = lane; r < gridDim.x; r += lanes) acc += partial[r * n + j];
        }
        lane_sums[threadIdx.x] = acc;
        __syncthreads();
        if (lane == 0 && j < n) {
            for (unsigned k = 1; k < lanes; ++k) acc += lane_sums[k * COLS + col];
            st(dw + j, acc);
        }
        __syncthreads();
    }
}

struct Buffers { const B *dy, *x; const float* rstd; const B* w; B* dx; float* partial; B* dw; unsigned long long rows, n; };

template <int K, int BLOCKS> int measure(Buffers& b, double bytes, double ceiling) {
    auto pct = [&](float ms) { return 100.0 * bytes / ms / 1e6 / ceiling; };
    int regs_fit = 0, fused_fit = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&regs_fit, backward<K, BLOCKS>, 256, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fused_fit, backward_fused<K, BLOCKS>, 256, 0));
    cudaFuncAttributes attr;
    CK(cudaFuncGetAttributes(&attr, backward<K, BLOCKS>));
    const int grid = 132 * BLOCKS;
    auto main_kernel = [&] { backward<K, BLOCKS><<<grid, 256>>>(b.dy, b.x, b.rstd, b.w, b.dx, b.partial, b.dw, b.rows, b.n); };
    auto finish = [&] { rms_norm_weight_grad_finish_bf16<<<b.n / FINISH_COLS, dim3(FINISH_COLS, FINISH_ROWS)>>>(b.partial, grid, b.dw, 1, b.n); };
    const float alone = time_synced(main_kernel), both = time_synced([&] { main_kernel(); finish(); });
    float fused = 0;
    if (fused_fit >= BLOCKS) {
        void* args[] = {&b.dy, &b.x, &b.rstd, &b.w, &b.dx, &b.partial, &b.dw, &b.rows, &b.n};
        fused = time_synced([&] { cudaLaunchCooperativeKernel((void*)backward_fused<K, BLOCKS>, grid, 256, args, 0, 0); });
    }
    CK(cudaGetLastError());
    printf("K %d, %d blocks an SM (%d fit, %d regs, %d B local), grid %d: alone %.1f us (%.1f%%) | + finish kernel %.1f us "
           "(%.1f%%) | fused finish %.1f us (%.1f%%)\n",
           K, BLOCKS, regs_fit, attr.numRegs, (int)attr.localSizeBytes, grid, alone * 1e3, pct(alone), both * 1e3, pct(both),
           fused * 1e3, fused > 0 ? pct(fused) : 0.0);
    return 0;
}

int main() {
    const unsigned long long rows = 8192, n = 2048;
    RmsBackwardBuffers buffers;
    double ceiling;
    if (open_rms_backward(rows, n, 0x3c, buffers, ceiling)) return 1;
    Buffers b{(const B*)buffers.dy, (const B*)buffers.x, (const float*)buffers.rstd, (const B*)buffers.w,
              (B*)buffers.dx,       (float*)buffers.partial, (B*)buffers.dw,       rows, n};
    const double bytes = 3.0 * rows * n * 2 + rows * 4;
    measure<8, 2>(b, bytes, ceiling);
    measure<4, 2>(b, bytes, ceiling);
    measure<4, 3>(b, bytes, ceiling);
    measure<4, 4>(b, bytes, ceiling);
    measure<2, 4>(b, bytes, ceiling);
    measure<2, 6>(b, bytes, ceiling);
    measure<2, 8>(b, bytes, ceiling);
    measure<1, 8>(b, bytes, ceiling);
    return 0;
}
