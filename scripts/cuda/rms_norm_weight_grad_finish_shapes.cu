// The RMSNorm backward's weight-gradient finish at 8192 x 2048 in bf16, by block shape: after
// ops-cuda's backward (kernels/llama.cu, included: 4 rows a pass, 396 blocks, so 396 partial
// rows), `rms_norm_weight_grad_finish` as the op runs it (FINISH_COLS x FINISH_ROWS threads,
// a tree; 32 x 32 added in order until 9b81b63) beside COLS x ROWS blocks (n / COLS blocks, the
// rows' sums added as a tree). Each pair timed one launch at a time between events with a
// synchronize, as the kernels bench times the op, and each finish alone back to back.
//
// On the GPU machine, from this folder:
//   nvcc -O3 -arch=sm_90 -std=c++17 --extended-lambda rms_norm_weight_grad_finish_shapes.cu -o finish && ./finish
#include "../../crates/ops-cuda/kernels/llama.cu"
#include "rms_norm_backward_buffers.cuh"

typedef __nv_bfloat16 B;

// The op's finish at COLS x ROWS (its rows' sums added as a tree).
template <int COLS, int ROWS>
__global__ void __launch_bounds__(COLS * ROWS)
    finish_shape(const float* partial, unsigned long long chunks, B* dw, unsigned long long n) {
    rms_norm_weight_grad_finish<B, COLS, ROWS>(partial, chunks, dw, 1, n);
}

// The op before the tree (until 9b81b63): 32 x 32, the first row adding the rows in order.
__global__ void __launch_bounds__(1024)
    finish_in_order(const float* partial, unsigned long long chunks, B* dw, unsigned long long n) {
    __shared__ float sums[32][33];
    const unsigned long long j = (unsigned long long)blockIdx.x * 32 + threadIdx.x;
    float acc = 0;
    if (j < n) {
#pragma unroll 4
        for (unsigned long long c = threadIdx.y; c < chunks; c += 32) acc += partial[c * n + j];
    }
    sums[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y != 0 || j >= n) return;
    for (int k = 1; k < 32; ++k) acc += sums[k][threadIdx.x];
    st(dw + j, acc);
}

int main() {
    const unsigned long long rows = 8192, n = 2048, grid = 396;
    RmsBackwardBuffers b;
    double ceiling;
    if (open_rms_backward(rows, n, 0x3c, b, ceiling)) return 1;
    const double bytes = 3.0 * rows * n * 2 + rows * 4;
    auto pct = [&](float ms) { return 100.0 * bytes / ms / 1e6 / ceiling; };
    auto main_kernel = [&] {
        rms_norm_backward_v1_bf16<<<grid, 256>>>((const B*)b.dy, (const B*)b.x, (const float*)b.rstd, (const B*)b.w, (B*)b.dx,
                                                 (float*)b.partial, rows, n);
    };
    auto before = [&] { finish_in_order<<<n / 32, dim3(32, 32)>>>((const float*)b.partial, grid, (B*)b.dw, n); };
    auto op = [&] {
        rms_norm_weight_grad_finish_bf16<<<n / FINISH_COLS, dim3(FINISH_COLS, FINISH_ROWS)>>>((const float*)b.partial, grid, (B*)b.dw, 1, n);
    };
    const float alone = time_synced(main_kernel);
    printf("backward alone (v1 x 256, grid %llu): %.1f us (%.1f%%)\n", grid, alone * 1e3, pct(alone));
    auto report = [&](const char* name, auto finish) {
        const float pair = time_synced([&] { main_kernel(); finish(); }), fin = time_it(finish);
        printf("%-28s with the backward %.1f us (%.1f%%) | finish back to back %.2f us\n", name, pair * 1e3, pct(pair), fin * 1e3);
    };
    report("32 x 32 in order (before)", before);
    report("the op's finish", op);
    report("32 x 32 tree", [&] { finish_shape<32, 32><<<n / 32, dim3(32, 32)>>>((const float*)b.partial, grid, (B*)b.dw, n); });
    report("16 x 64 tree", [&] { finish_shape<16, 64><<<n / 16, dim3(16, 64)>>>((const float*)b.partial, grid, (B*)b.dw, n); });
    report("8 x 128 tree", [&] { finish_shape<8, 128><<<n / 8, dim3(8, 128)>>>((const float*)b.partial, grid, (B*)b.dw, n); });
    report("16 x 16 tree", [&] { finish_shape<16, 16><<<n / 16, dim3(16, 16)>>>((const float*)b.partial, grid, (B*)b.dw, n); });
    report("8 x 32 tree", [&] { finish_shape<8, 32><<<n / 8, dim3(8, 32)>>>((const float*)b.partial, grid, (B*)b.dw, n); });
    CK(cudaGetLastError());
    return 0;
}
