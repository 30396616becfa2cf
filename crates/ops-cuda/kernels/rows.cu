// Row kernels of the CUDA backend: reductions over trailing dims, softmax and log-softmax along
// a dim (forward and backward), and layer norm (forward and backward).
//
// One block handles one row (a lane of the reduced or normalised elements) at a time, its
// threads striding along the row and combining through warp shuffles and shared memory;
// accumulation is in double for f64 and in float otherwise. The Rust side
// (crates/ops-cuda/src/rows/args.rs) describes operands with the structs below, field for field.
// Built to PTX by `cargo xtask build-kernels`.

#include "elements.cuh"
#include <float.h>

#define MAX_DIMS 8
#define THREADS 256

// Row r's element j of operand k is at offsets[k] + Σ outer index·outer_strides[k]
// + Σ inner index·inner_strides[k] (inner dims are shared by all operands of a lane kernel).
struct RowArgs {
    unsigned int outer_ndim;
    unsigned int inner_ndim;
    unsigned long long rows;
    unsigned long long len;
    unsigned long long outer_shape[MAX_DIMS];
    unsigned long long outer_strides[3][MAX_DIMS];
    unsigned long long inner_shape[MAX_DIMS];
    unsigned long long inner_strides[3][MAX_DIMS];
    unsigned long long offsets[3];
};

__device__ __forceinline__ unsigned long long walk(unsigned long long i, unsigned int ndim,
                                                   const unsigned long long* shape,
                                                   const unsigned long long* strides) {
    if (ndim == 0) return 0;
    if (ndim == 1) return i * strides[0];
    unsigned long long off = 0;
    for (int d = (int)ndim - 1; d >= 0; --d) {
        off += (i % shape[d]) * strides[d];
        i /= shape[d];
    }
    return off;
}

__device__ __forceinline__ unsigned long long row_base(const RowArgs& a, int k, unsigned long long r) {
    return a.offsets[k] + walk(r, a.outer_ndim, a.outer_shape, a.outer_strides[k]);
}
__device__ __forceinline__ unsigned long long inner_off(const RowArgs& a, int k, unsigned long long j) {
    return walk(j, a.inner_ndim, a.inner_shape, a.inner_strides[k]);
}


__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }

// op: 0 sum, 1 max, 2 min. Max and min propagate NaN (`a != a`), as the CPU and PyTorch do.
template <typename C> __device__ __forceinline__ C combine(int op, C a, C b) {
    return op == 0 ? a + b : (op == 1 ? ((a > b || a != a) ? a : b) : ((a < b || a != a) ? a : b));
}
template <typename C> __device__ __forceinline__ C identity(int op);
template <> __device__ __forceinline__ float identity<float>(int op) { return op == 0 ? 0.0f : (op == 1 ? -FLT_MAX * 2.0f : FLT_MAX * 2.0f); }
template <> __device__ __forceinline__ double identity<double>(int op) { return op == 0 ? 0.0 : (op == 1 ? -DBL_MAX * 2.0 : DBL_MAX * 2.0); }

// Combines `v` across the block; every thread gets the result. `scratch` holds THREADS/32 values.
template <typename C> __device__ C block_combine(int op, C v, C* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = combine(op, v, __shfl_xor_sync(0xffffffff, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? scratch[lane] : identity<C>(op);
    for (int o = 16; o > 0; o >>= 1) v = combine(op, v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Reduce: operand 0 = out (inner dims ignored), 1 = x. op: 0 sum, 1 mean, 2 max, 3 min.
template <typename T> __device__ void reduce_rows(int op, const T* x, T* out, RowArgs a) {
    typedef typename Acc<T>::type C;
    __shared__ C scratch[THREADS / 32];
    int kind = op == 1 ? 0 : (op == 0 ? 0 : op - 1);
    for (unsigned long long r = blockIdx.x; r < a.rows; r += gridDim.x) {
        unsigned long long xb = row_base(a, 1, r);
        C acc = identity<C>(kind);
        for (unsigned long long j = threadIdx.x; j < a.len; j += blockDim.x)
            acc = combine(kind, acc, ld(x + xb + inner_off(a, 1, j)));
        acc = block_combine(kind, acc, scratch);
        if (op == 1) acc = acc / (C)a.len;
        if (threadIdx.x == 0) st(out + row_base(a, 0, r), acc);
    }
}

// Softmax along the inner (single) dim: operand 0 = out, 1 = x.
template <typename T> __device__ void softmax_rows(int log_softmax, const T* x, T* out, RowArgs a) {
    typedef typename Acc<T>::type C;
    __shared__ C scratch[THREADS / 32];
    for (unsigned long long r = blockIdx.x; r < a.rows; r += gridDim.x) {
        unsigned long long ob = row_base(a, 0, r), xb = row_base(a, 1, r);
        C mx = identity<C>(1);
        for (unsigned long long j = threadIdx.x; j < a.len; j += blockDim.x)
            mx = combine(1, mx, ld(x + xb + inner_off(a, 1, j)));
        mx = block_combine(1, mx, scratch);
        C sum = 0;
        for (unsigned long long j = threadIdx.x; j < a.len; j += blockDim.x)
            sum += m_exp(ld(x + xb + inner_off(a, 1, j)) - mx);
        sum = block_combine(0, sum, scratch);
        C log_sum = m_log(sum);
        for (unsigned long long j = threadIdx.x; j < a.len; j += blockDim.x) {
            C shifted = ld(x + xb + inner_off(a, 1, j)) - mx;
            st(out + ob + inner_off(a, 0, j), log_softmax ? shifted - log_sum : m_exp(shifted) / sum);
        }
    }
}

// Softmax backward: operand 0 = dx, 1 = y, 2 = dy.
template <typename T> __device__ void softmax_backward_rows(int log_softmax, const T* y, const T* dy, T* dx, RowArgs a) {
    typedef typename Acc<T>::type C;
    __shared__ C scratch[THREADS / 32];
    for (unsigned long long r = blockIdx.x; r < a.rows; r += gridDim.x) {
        unsigned long long db = row_base(a, 0, r), yb = row_base(a, 1, r), gb = row_base(a, 2, r);
        C dot = 0;
        for (unsigned long long j = threadIdx.x; j < a.len; j += blockDim.x) {
            C g = ld(dy + gb + inner_off(a, 2, j));
            dot += log_softmax ? g : g * ld(y + yb + inner_off(a, 1, j));
        }
        dot = block_combine(0, dot, scratch);
        for (unsigned long long j = threadIdx.x; j < a.len; j += blockDim.x) {
            C yv = ld(y + yb + inner_off(a, 1, j)), g = ld(dy + gb + inner_off(a, 2, j));
            st(dx + db + inner_off(a, 0, j), log_softmax ? g - m_exp(yv) * dot : yv * (g - dot));
        }
    }
}

// Layer norm over dense rows of n: x, out [rows, n]; mean, rstd [rows] in S; weight/bias may be null.
template <typename T, typename S>
__device__ void layer_norm_rows(const T* x, const T* w, unsigned long long ws, const T* b, unsigned long long bs,
                                T* out, S* mean_out, S* rstd_out, double eps, unsigned long long rows,
                                unsigned long long n) {
    typedef typename Acc<S>::type C;
    __shared__ C scratch[THREADS / 32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * n;
        C sum = 0;
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) sum += (C)ld(xr + j);
        C mean = block_combine(0, sum, scratch) / (C)n;
        C sq = 0;
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) { C d = (C)ld(xr + j) - mean; sq += d * d; }
        C var = block_combine(0, sq, scratch) / (C)n;
        C rstd = (C)1 / m_sqrt(var + (C)eps);
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
            C v = ((C)ld(xr + j) - mean) * rstd;
            if (w) v *= (C)ld(w + j * ws);
            if (b) v += (C)ld(b + j * bs);
            st(out + r * n + j, v);
        }
        if (threadIdx.x == 0) { st(mean_out + r, mean); st(rstd_out + r, rstd); }
    }
}

// Layer norm backward, input gradient: dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·w.
template <typename T, typename S>
__device__ void layer_norm_backward_rows(const T* dy, const T* x, const S* mean_in, const S* rstd_in, const T* w,
                                         unsigned long long ws, T* dx, unsigned long long rows, unsigned long long n) {
    typedef typename Acc<S>::type C;
    __shared__ C scratch[THREADS / 32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        C mean = (C)ld(mean_in + r), rstd = (C)ld(rstd_in + r);
        C sg = 0, sgx = 0;
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
            C g = (C)ld(dy + r * n + j) * (w ? (C)ld(w + j * ws) : (C)1);
            C xh = ((C)ld(x + r * n + j) - mean) * rstd;
            sg += g;
            sgx += g * xh;
        }
        C mean_g = block_combine(0, sg, scratch) / (C)n;
        C mean_gx = block_combine(0, sgx, scratch) / (C)n;
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
            C g = (C)ld(dy + r * n + j) * (w ? (C)ld(w + j * ws) : (C)1);
            C xh = ((C)ld(x + r * n + j) - mean) * rstd;
            st(dx + r * n + j, rstd * (g - mean_g - xh * mean_gx));
        }
    }
}

// Layer norm with one warp per row for float, half and bf16 rows that fit in registers: the row
// is a whole number of 16-byte vectors, at most 32 · VPL of them, every operand 16-byte aligned
// and the parameters dense (the Rust side checks). Each lane keeps its vectors of the row in
// registers, so x is read once and no barrier is needed, as in PyTorch's vectorized layer norm.
// Statistics are float.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& packed, float* out) {
    const T* e = reinterpret_cast<const T*>(&packed);
#pragma unroll
    for (int k = 0; k < (int)(16 / sizeof(T)); ++k) out[k] = ld(e + k);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float* in) {
    uint4 packed;
    T* e = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int k = 0; k < (int)(16 / sizeof(T)); ++k) st(e + k, in[k]);
    return packed;
}

template <typename T, int VPL>
__device__ void layer_norm_warp(const T* x, const T* w, const T* b, T* out, float* mean_out,
                                float* rstd_out, double eps, unsigned long long rows,
                                unsigned long long n) {
    constexpr int V = 16 / sizeof(T);
    const unsigned lane = threadIdx.x & 31;
    const unsigned long long nv = n / V;
    const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x >> 5);
    for (unsigned long long r = (unsigned long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         r < rows; r += warps) {
        const uint4* xr = reinterpret_cast<const uint4*>(x + r * n);
        float v[VPL][V];
        float sum = 0.f;
#pragma unroll
        for (int q = 0; q < VPL; ++q) {
            unsigned long long idx = lane + 32ull * q;
            if (idx < nv) {
                unpack<T>(xr[idx], v[q]);
#pragma unroll
                for (int k = 0; k < V; ++k) sum += v[q][k];
            }
        }
        const float mean = warp_sum(sum) / (float)n;
        float sq = 0.f;
#pragma unroll
        for (int q = 0; q < VPL; ++q) {
            if (lane + 32ull * q < nv) {
#pragma unroll
                for (int k = 0; k < V; ++k) { float d = v[q][k] - mean; sq += d * d; }
            }
        }
        const float rstd = 1.f / sqrtf(warp_sum(sq) / (float)n + (float)eps);
        uint4* outr = reinterpret_cast<uint4*>(out + r * n);
#pragma unroll
        for (int q = 0; q < VPL; ++q) {
            unsigned long long idx = lane + 32ull * q;
            if (idx < nv) {
                float wv[V], bv[V];
                if (w) unpack<T>(reinterpret_cast<const uint4*>(w)[idx], wv);
                if (b) unpack<T>(reinterpret_cast<const uint4*>(b)[idx], bv);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    float y = (v[q][k] - mean) * rstd;
                    if (w) y *= wv[k];
                    if (b) y += bv[k];
                    v[q][k] = y;
                }
                outr[idx] = pack<T>(v[q]);
            }
        }
        if (lane == 0) { mean_out[r] = mean; rstd_out[r] = rstd; }
    }
}

// The gradients of the warp-per-row layer norm (same conditions): the input's,
// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w (skipped when dx is null), and with PARAMS
// each block's column sums of dy·x̂ and dy (the weight and bias gradients) into
// partial [2, gridDim.x, n], for `layer_norm_param_finish` to add up: the parameter gradients
// need no second pass over dy and x. Warps fold their sums into shared memory one after another,
// so the result does not depend on timing.
template <typename T, int VPL, bool PARAMS>
__device__ void layer_norm_backward_warp(const T* dy, const T* x, const float* mean_in,
                                         const float* rstd_in, const T* w, T* dx, float* partial,
                                         unsigned long long rows, unsigned long long n) {
    constexpr int V = 16 / sizeof(T);
    const unsigned lane = threadIdx.x & 31;
    const unsigned long long nv = n / V;
    const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x >> 5);
    float gw[PARAMS ? VPL : 1][V], gb[PARAMS ? VPL : 1][V];
    if (PARAMS) {
#pragma unroll
        for (int q = 0; q < VPL; ++q)
#pragma unroll
            for (int k = 0; k < V; ++k) { gw[q][k] = 0.f; gb[q][k] = 0.f; }
    }
    for (unsigned long long r = (unsigned long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         r < rows; r += warps) {
        const uint4* dyr = reinterpret_cast<const uint4*>(dy + r * n);
        const uint4* xr = reinterpret_cast<const uint4*>(x + r * n);
        const float mean = mean_in[r], rstd = rstd_in[r];
        float g[VPL][V], xh[VPL][V];
        float sg = 0.f, sgx = 0.f;
#pragma unroll
        for (int q = 0; q < VPL; ++q) {
            unsigned long long idx = lane + 32ull * q;
            if (idx < nv) {
                unpack<T>(dyr[idx], g[q]);
                unpack<T>(xr[idx], xh[q]);
                float wv[V];
                if (w) unpack<T>(reinterpret_cast<const uint4*>(w)[idx], wv);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    xh[q][k] = (xh[q][k] - mean) * rstd;
                    if (PARAMS) { gw[q][k] += g[q][k] * xh[q][k]; gb[q][k] += g[q][k]; }
                    if (w) g[q][k] *= wv[k];
                    sg += g[q][k];
                    sgx += g[q][k] * xh[q][k];
                }
            }
        }
        if (!dx) continue;
        const float mean_g = warp_sum(sg) / (float)n, mean_gx = warp_sum(sgx) / (float)n;
        uint4* dxr = reinterpret_cast<uint4*>(dx + r * n);
#pragma unroll
        for (int q = 0; q < VPL; ++q) {
            unsigned long long idx = lane + 32ull * q;
            if (idx < nv) {
#pragma unroll
                for (int k = 0; k < V; ++k) g[q][k] = rstd * (g[q][k] - mean_g - xh[q][k] * mean_gx);
                dxr[idx] = pack<T>(g[q]);
            }
        }
    }
    if (PARAMS) {
        extern __shared__ float folded[];  // [2, n]: weight, bias
        const unsigned warp = threadIdx.x >> 5;
        for (unsigned turn = 0; turn < (blockDim.x >> 5); ++turn) {
            if (warp == turn) {
#pragma unroll
                for (int q = 0; q < VPL; ++q) {
                    unsigned long long idx = lane + 32ull * q;
                    if (idx < nv) {
#pragma unroll
                        for (int k = 0; k < V; ++k) {
                            unsigned long long j = idx * V + k;
                            folded[j] = turn == 0 ? gw[q][k] : folded[j] + gw[q][k];
                            folded[n + j] = turn == 0 ? gb[q][k] : folded[n + j] + gb[q][k];
                        }
                    }
                }
            }
            __syncthreads();
        }
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
            partial[blockIdx.x * n + j] = folded[j];
            partial[(gridDim.x + blockIdx.x) * n + j] = folded[n + j];
        }
    }
}

// Layer norm backward, parameter gradients, in two deterministic stages. Stage 1: a 32 x 8 block
// sums a chunk of ROWS_PER_CHUNK rows for 32 columns (coalesced across the columns) into
// `partial` [2, n_chunks, n] (weight, bias); stage 2: one thread per column adds the chunks.
#define ROWS_PER_CHUNK 256
template <typename T, typename S>
__device__ void layer_norm_param_partials(const T* dy, const T* x, const S* mean_in, const S* rstd_in,
                                          typename Acc<S>::type* partial, unsigned long long rows,
                                          unsigned long long n) {
    typedef typename Acc<S>::type C;
    __shared__ C sw[8][33], sb[8][33];
    unsigned long long j = (unsigned long long)blockIdx.x * 32 + threadIdx.x;
    unsigned long long chunk = blockIdx.y, n_chunks = gridDim.y;
    C gw = 0, gb = 0;
    if (j < n) {
        unsigned long long end = min((chunk + 1) * ROWS_PER_CHUNK, rows);
        for (unsigned long long r = chunk * ROWS_PER_CHUNK + threadIdx.y; r < end; r += 8) {
            C g = (C)ld(dy + r * n + j);
            gw += g * ((C)ld(x + r * n + j) - (C)ld(mean_in + r)) * (C)ld(rstd_in + r);
            gb += g;
        }
    }
    sw[threadIdx.y][threadIdx.x] = gw;
    sb[threadIdx.y][threadIdx.x] = gb;
    __syncthreads();
    if (threadIdx.y == 0 && j < n) {
        for (int k = 1; k < 8; ++k) { gw += sw[k][threadIdx.x]; gb += sb[k][threadIdx.x]; }
        partial[chunk * n + j] = gw;
        partial[(n_chunks + chunk) * n + j] = gb;
    }
}

// Stage 2: a 32 x 8 block adds the chunks for 32 columns, each of its 8 rows of threads taking
// every 8th chunk (coalesced across the columns), then folds the 8 sums in a fixed order.
template <typename T, typename S>
__device__ void layer_norm_param_finish(const typename Acc<S>::type* partial, unsigned long long n_chunks,
                                        T* dw, unsigned long long dws, T* db, unsigned long long dbs,
                                        unsigned long long n) {
    typedef typename Acc<S>::type C;
    __shared__ C sw[8][33], sb[8][33];
    unsigned long long j = (unsigned long long)blockIdx.x * 32 + threadIdx.x;
    C gw = 0, gb = 0;
    if (j < n) {
        for (unsigned long long c = threadIdx.y; c < n_chunks; c += 8) {
            gw += partial[c * n + j];
            gb += partial[(n_chunks + c) * n + j];
        }
    }
    sw[threadIdx.y][threadIdx.x] = gw;
    sb[threadIdx.y][threadIdx.x] = gb;
    __syncthreads();
    if (threadIdx.y == 0 && j < n) {
        for (int k = 1; k < 8; ++k) { gw += sw[k][threadIdx.x]; gb += sb[k][threadIdx.x]; }
        if (dw) st(dw + j * dws, gw);
        if (db) st(db + j * dbs, gb);
    }
}

// Column sums of a [rows, n] matrix with contiguous rows (`x[r * rs + j]`), the reduction a bias
// gradient is, in the same two deterministic stages: per-chunk sums coalesced across columns into
// `partial` [n_chunks, n], then one thread per column adds the chunks (times `scale`: 1 for a sum,
// 1/rows for a mean).
template <typename T>
__device__ void column_partials(const T* x, unsigned long long rs, typename Acc<T>::type* partial,
                                unsigned long long rows, unsigned long long n) {
    typedef typename Acc<T>::type C;
    __shared__ C sums[8][33];
    unsigned long long j = (unsigned long long)blockIdx.x * 32 + threadIdx.x;
    unsigned long long chunk = blockIdx.y;
    C acc = 0;
    if (j < n) {
        unsigned long long end = min((chunk + 1) * ROWS_PER_CHUNK, rows);
        for (unsigned long long r = chunk * ROWS_PER_CHUNK + threadIdx.y; r < end; r += 8)
            acc += (C)ld(x + r * rs + j);
    }
    sums[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < n) {
        for (int k = 1; k < 8; ++k) acc += sums[k][threadIdx.x];
        partial[chunk * n + j] = acc;
    }
}

template <typename T>
__device__ void column_finish(const typename Acc<T>::type* partial, unsigned long long n_chunks, T* out,
                              unsigned long long os, double scale, unsigned long long n) {
    typedef typename Acc<T>::type C;
    for (unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; j < n;
         j += (unsigned long long)gridDim.x * blockDim.x) {
        C acc = 0;
        for (unsigned long long c = 0; c < n_chunks; ++c) acc += partial[c * n + j];
        st(out + j * os, acc * (C)scale);
    }
}

// Max or min over the last dim with its index (first occurrence; a NaN wins, as on the CPU):
// operand 0 = values, 1 = indices (i64), 2 = x; one thread per row, walking the row serially.
template <typename T>
__device__ void arg_reduce_rows(int is_max, const T* x, T* values, long long* indices, RowArgs a) {
    typedef typename Acc<T>::type C;
    for (unsigned long long r = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; r < a.rows;
         r += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long xb = row_base(a, 2, r);
        C best = ld(x + xb);
        unsigned long long best_idx = 0;
        for (unsigned long long j = 1; j < a.len; ++j) {
            C v = ld(x + xb + inner_off(a, 2, j));
            bool better = is_max ? v > best : v < best;
            if (!(best != best) && (better || v != v)) { best = v; best_idx = j; }
        }
        st(values + row_base(a, 0, r), best);
        indices[row_base(a, 1, r)] = (long long)best_idx;
    }
}

#define ROW_KERNELS(T, N)                                                                                  \
    extern "C" __global__ void reduce_##N(int op, const T* x, T* out, RowArgs a) { reduce_rows<T>(op, x, out, a); } \
    extern "C" __global__ void softmax_##N(int l, const T* x, T* out, RowArgs a) { softmax_rows<T>(l, x, out, a); } \
    extern "C" __global__ void arg_reduce_##N(int m, const T* x, T* v, long long* i, RowArgs a) {             \
        arg_reduce_rows<T>(m, x, v, i, a);                                                                 \
    }                                                                                                      \
    extern "C" __global__ void softmax_backward_##N(int l, const T* y, const T* dy, T* dx, RowArgs a) {       \
        softmax_backward_rows<T>(l, y, dy, dx, a);                                                         \
    }                                                                                                      \
    extern "C" __global__ void column_partials_##N(const T* x, unsigned long long rs, Acc<T>::type* p,    \
                                                   unsigned long long rows, unsigned long long n) {       \
        column_partials<T>(x, rs, p, rows, n);                                                             \
    }                                                                                                      \
    extern "C" __global__ void column_finish_##N(const Acc<T>::type* p, unsigned long long chunks, T* out, \
                                                 unsigned long long os, double scale, unsigned long long n) { \
        column_finish<T>(p, chunks, out, os, scale, n);                                                    \
    }
ROW_KERNELS(float, f32)
ROW_KERNELS(double, f64)
ROW_KERNELS(__half, f16)
ROW_KERNELS(__nv_bfloat16, bf16)

#define LN_KERNELS(T, S, N)                                                                                \
    extern "C" __global__ void layer_norm_##N(const T* x, const T* w, unsigned long long ws, const T* b,   \
                                              unsigned long long bs, T* out, S* mean, S* rstd, double eps,  \
                                              unsigned long long rows, unsigned long long n) {              \
        layer_norm_rows<T, S>(x, w, ws, b, bs, out, mean, rstd, eps, rows, n);                             \
    }                                                                                                       \
    extern "C" __global__ void layer_norm_backward_##N(const T* dy, const T* x, const S* mean, const S* rstd, \
                                                       const T* w, unsigned long long ws, T* dx,             \
                                                       unsigned long long rows, unsigned long long n) {      \
        layer_norm_backward_rows<T, S>(dy, x, mean, rstd, w, ws, dx, rows, n);                             \
    }                                                                                                       \
    extern "C" __global__ void layer_norm_param_partials_##N(const T* dy, const T* x, const S* mean,       \
                                                             const S* rstd, Acc<S>::type* partial,           \
                                                             unsigned long long rows, unsigned long long n) { \
        layer_norm_param_partials<T, S>(dy, x, mean, rstd, partial, rows, n);                              \
    }                                                                                                       \
    extern "C" __global__ void layer_norm_param_finish_##N(const Acc<S>::type* partial,                     \
                                                           unsigned long long n_chunks, T* dw,               \
                                                           unsigned long long dws, T* db,                    \
                                                           unsigned long long dbs, unsigned long long n) {   \
        layer_norm_param_finish<T, S>(partial, n_chunks, dw, dws, db, dbs, n);                             \
    }
LN_KERNELS(float, float, f32_f32)
LN_KERNELS(double, double, f64_f64)
LN_KERNELS(__half, float, f16_f32)
LN_KERNELS(__nv_bfloat16, float, bf16_f32)

// Warp-per-row layer norm, by vectors per lane (1, 2, 4 or 8).
#define LN_WARP_KERNEL(T, N, VPL)                                                                           \
    extern "C" __global__ void layer_norm_warp##VPL##_##N(const T* x, const T* w, const T* b, T* out,       \
                                                          float* mean, float* rstd, double eps,             \
                                                          unsigned long long rows, unsigned long long n) {  \
        layer_norm_warp<T, VPL>(x, w, b, out, mean, rstd, eps, rows, n);                                   \
    }                                                                                                       \
    extern "C" __global__ void layer_norm_backward_warp##VPL##_##N(const T* dy, const T* x, const float* mean, \
                                                                   const float* rstd, const T* w, T* dx,    \
                                                                   unsigned long long rows,                 \
                                                                   unsigned long long n) {                  \
        layer_norm_backward_warp<T, VPL, false>(dy, x, mean, rstd, w, dx, nullptr, rows, n);              \
    }
// With the parameter gradients' block sums (registers allow it up to 4 vectors per lane).
#define LN_WARP_PARAMS_KERNEL(T, N, VPL)                                                                    \
    extern "C" __global__ void layer_norm_backward_params_warp##VPL##_##N(                                  \
        const T* dy, const T* x, const float* mean, const float* rstd, const T* w, T* dx, float* partial,   \
        unsigned long long rows, unsigned long long n) {                                                    \
        layer_norm_backward_warp<T, VPL, true>(dy, x, mean, rstd, w, dx, partial, rows, n);                \
    }
#define LN_WARP_KERNELS(T, N)                                                                               \
    LN_WARP_KERNEL(T, N, 1) LN_WARP_KERNEL(T, N, 2) LN_WARP_KERNEL(T, N, 4) LN_WARP_KERNEL(T, N, 8)         \
    LN_WARP_PARAMS_KERNEL(T, N, 1) LN_WARP_PARAMS_KERNEL(T, N, 2) LN_WARP_PARAMS_KERNEL(T, N, 4)
LN_WARP_KERNELS(float, f32_f32)
LN_WARP_KERNELS(__half, f16_f32)
LN_WARP_KERNELS(__nv_bfloat16, bf16_f32)
