// RMSNorm backward at 8192 x 2048 in bf16 with the weight gradient's finish inside the same
// launch: ops-cuda's backward (kernels/llama.cu, included) as a cooperative kernel whose blocks,
// after writing their partial rows, meet at a grid barrier and then each add the partials of a
// few columns (in a fixed order, so the sums stay deterministic). Beside it, the op as it runs
// today (the backward, then `rms_norm_weight_grad_finish`). Each timed two ways: back-to-back
// launches (launch latency hidden) and one launch at a time between events with a synchronize,
// as the kernels bench times it (the first launch's latency counted). Against a 2 GB copy.
//
// On the GPU machine, from this folder:
//   nvcc -O3 -arch=sm_90 -std=c++17 --extended-lambda rms_norm_backward_fused_finish.cu -o fused && ./fused
#include <cooperative_groups.h>

#include "../../crates/ops-cuda/kernels/llama.cu"
#include "event_timing.cuh"

namespace cg = cooperative_groups;

// The backward, a grid barrier, then block b adds columns [b·COLS, b·COLS + COLS) (and every
// gridDim.x·COLS-th group after): blockDim.x / COLS lanes of threads each take every lane-th
// partial row of a column, and lane 0 adds the lanes' sums in order.
template <typename T, int VPT, int COLS>
__global__ void __launch_bounds__(256, 2)
    backward_fused_finish(const T* dy, const T* x, const float* rstd, const T* w, T* dx, float* partial, T* dw,
                          unsigned long long rows, unsigned long long n) {
    rms_norm_backward_vec<T, VPT, backward_rows_per_pass<T>(VPT)>(dy, x, rstd, w, dx, partial, rows, n);
    cg::this_grid().sync();
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

// Milliseconds of `f` launched alone between two events and synchronized, the mean of `iters`.
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

int main() {
    typedef __nv_bfloat16 B;
    const unsigned long long rows = 8192, n = 2048;
    const double ceiling = copy_ceiling();
    printf("ceiling %.0f GB/s\n", ceiling);
    void *x, *dy, *w, *dx, *rstd, *partial, *dw, *dw_ref;
    CK(cudaMalloc(&x, rows * n * 2)); CK(cudaMalloc(&dy, rows * n * 2)); CK(cudaMalloc(&dx, rows * n * 2));
    CK(cudaMalloc(&w, n * 2)); CK(cudaMalloc(&rstd, rows * 4)); CK(cudaMalloc(&partial, 4096 * n * 4));
    CK(cudaMalloc(&dw, n * 2)); CK(cudaMalloc(&dw_ref, n * 2));
    CK(cudaMemset(x, 0x3f, rows * n * 2)); CK(cudaMemset(dy, 0x3c, rows * n * 2)); CK(cudaMemset(w, 0x3f, n * 2));
    CK(cudaMemset(rstd, 0x3f, rows * 4));
    const double bytes = 3.0 * rows * n * 2 + rows * 4;
    auto pct = [&](float ms) { return 100.0 * bytes / ms / 1e6 / ceiling; };

    // Today's op: v1 x 256 on 264 blocks, then the finish kernel.
    auto today = [&] {
        rms_norm_backward_v1_bf16<<<264, 256>>>((const B*)dy, (const B*)x, (const float*)rstd, (const B*)w, (B*)dx, (float*)partial, rows, n);
        rms_norm_weight_grad_finish_bf16<<<n / 32, dim3(32, 32, 1)>>>((const float*)partial, 264, (B*)dw_ref, 1, n);
    };
    printf("today v1x256 grid 264 + finish: back-to-back %.1f us (%.1f%%) | synced %.1f us (%.1f%%)\n",
           time_it(today) * 1e3, pct(time_it(today)), time_synced(today) * 1e3, pct(time_synced(today)));
    today();

    struct Shape { int vpt, threads, grid, cols; };
    Shape shapes[] = {{1, 256, 264, 8}, {1, 256, 264, 16}, {1, 256, 264, 32}, {2, 128, 528, 4}, {2, 128, 528, 8}};
    for (auto s : shapes) {
        void* kernel = nullptr;
        if (s.vpt == 1 && s.cols == 8) kernel = (void*)backward_fused_finish<B, 1, 8>;
        if (s.vpt == 1 && s.cols == 16) kernel = (void*)backward_fused_finish<B, 1, 16>;
        if (s.vpt == 1 && s.cols == 32) kernel = (void*)backward_fused_finish<B, 1, 32>;
        if (s.vpt == 2 && s.cols == 4) kernel = (void*)backward_fused_finish<B, 2, 4>;
        if (s.vpt == 2 && s.cols == 8) kernel = (void*)backward_fused_finish<B, 2, 8>;
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, s.threads, 0));
        if (per_sm * 132 < s.grid) {
            printf("v%dx%d grid %d cols %d: only %d blocks an SM fit, skipped\n", s.vpt, s.threads, s.grid, s.cols, per_sm);
            continue;
        }
        const B* dyp = (const B*)dy; const B* xp = (const B*)x; const float* rp = (const float*)rstd; const B* wp = (const B*)w;
        B* dxp = (B*)dx; float* pp = (float*)partial; B* dwp = (B*)dw; unsigned long long r = rows, nn = n;
        void* args[] = {&dyp, &xp, &rp, &wp, &dxp, &pp, &dwp, &r, &nn};
        auto fused = [&] { cudaLaunchCooperativeKernel(kernel, s.grid, s.threads, args, 0, 0); };
        fused();
        CK(cudaDeviceSynchronize());
        // The weight gradient against today's (both sum the same partial rows: the backward is
        // the same code; only the finish's order of addition differs).
        B host[2048], ref[2048];
        CK(cudaMemcpy(host, dw, n * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(ref, dw_ref, n * 2, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (unsigned long long j = 0; j < n; ++j) {
            double a = __bfloat162float(host[j]), b = __bfloat162float(ref[j]);
            worst = fmax(worst, fabs(a - b) / fmax(fabs(b), 1e-30));
        }
        const float b2b = time_it(fused), synced = time_synced(fused);
        printf("fused v%dx%d grid %d cols %d (%d an SM fit): back-to-back %.1f us (%.1f%%) | synced %.1f us (%.1f%%) | "
               "dw vs today's max rel %.2e\n",
               s.vpt, s.threads, s.grid, s.cols, per_sm, b2b * 1e3, pct(b2b), synced * 1e3, pct(synced), worst);
    }
    CK(cudaGetLastError());
    return 0;
}
