// Strided operands of the elementwise-style kernels: up to three operands of one shape, each with
// its own strides and offset (in elements), and the walk from a linear index to their offsets.
// Included by elementwise.cu and index.cu; the Rust side is `StridedArgs` in
// crates/ops-cuda/src/operands.rs, field for field.

#pragma once

#define MAX_DIMS 8

struct StridedArgs {
    unsigned int ndim;
    unsigned int n_operands;
    unsigned long long numel;
    unsigned long long shape[MAX_DIMS];
    unsigned long long strides[3][MAX_DIMS];
    unsigned long long offsets[3];
};

__device__ __forceinline__ void element_offsets(const StridedArgs& a, unsigned long long i,
                                                unsigned long long off[3]) {
    off[0] = a.offsets[0];
    off[1] = a.offsets[1];
    off[2] = a.offsets[2];
    if (a.ndim <= 1) {
        // Merged to one run (the common, contiguous case): no division at all.
        off[0] += i * a.strides[0][0];
        off[1] += i * a.strides[1][0];
        off[2] += i * a.strides[2][0];
        return;
    }
    if (a.ndim == 2 && a.numel <= 0xffffffffULL) {
        // Two runs (a broadcast row, a transposed matrix): one 32-bit division.
        unsigned int j = (unsigned int)i, inner = (unsigned int)a.shape[1];
        unsigned int outer = j / inner, idx = j - outer * inner;
        off[0] += outer * a.strides[0][0] + idx * a.strides[0][1];
        off[1] += outer * a.strides[1][0] + idx * a.strides[1][1];
        off[2] += outer * a.strides[2][0] + idx * a.strides[2][1];
        return;
    }
    if (a.numel <= 0xffffffffULL) {
        // 32-bit division is several times cheaper than 64-bit on the GPU.
        unsigned int j = (unsigned int)i;
        for (int d = (int)a.ndim - 1; d >= 0; --d) {
            unsigned int size = (unsigned int)a.shape[d];
            unsigned int idx = j % size;
            j /= size;
            off[0] += idx * a.strides[0][d];
            off[1] += idx * a.strides[1][d];
            off[2] += idx * a.strides[2][d];
        }
        return;
    }
    for (int d = (int)a.ndim - 1; d >= 0; --d) {
        unsigned long long size = a.shape[d];
        unsigned long long idx = i % size;
        i /= size;
        off[0] += idx * a.strides[0][d];
        off[1] += idx * a.strides[1][d];
        off[2] += idx * a.strides[2][d];
    }
}

// A loop over [0, n) spread over the whole grid.
#define GRID_STRIDE_LOOP(i, n) \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (n); \
         i += (unsigned long long)gridDim.x * blockDim.x)
