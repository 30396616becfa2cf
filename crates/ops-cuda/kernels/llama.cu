// The fused kernels of a Llama decoder layer: RMSNorm forward and backward, SwiGLU forward and
// backward, and the rotary embedding (forward, and its transpose for backward).
//
// Each is one pass over its operands. Arithmetic is in float for f32, f16 and bf16 (double for
// f64); the rounding follows Hugging Face's LlamaRMSNorm (the normalised value is rounded to the
// input's dtype before the weight multiplies it). Where the Rust side (crates/ops-cuda/src/llama.rs)
// has checked that every row operand is 16-byte aligned and rows hold whole vectors, the `_v`
// kernels move 16-byte vectors; the others take any alignment (and the rotary one any strides).
// Built to PTX by `cargo xtask build-kernels`.

#include "elements.cuh"

// 16 bytes of T, read and written element by element in T's accumulation type.
template <typename T> struct Vec16 {
    static constexpr int N = 16 / sizeof(T);
    uint4 raw;
    __device__ __forceinline__ typename Acc<T>::type get(int k) const { return ld(reinterpret_cast<const T*>(&raw) + k); }
    __device__ __forceinline__ void set(int k, typename Acc<T>::type v) { st(reinterpret_cast<T*>(&raw) + k, v); }
};

// `v` rounded to T and read back: the normalised value as Hugging Face rounds it.
template <typename T> __device__ __forceinline__ typename Acc<T>::type round_to(typename Acc<T>::type v) {
    T t;
    st(&t, v);
    return ld(&t);
}

// The sum of `v` over the block (any multiple of 32 threads up to 1024); every thread gets it.
// `warp_sums` holds 32 values; the leading barrier lets a loop call it again.
template <typename C> __device__ __forceinline__ C block_sum(C v, C* warp_sums) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    v = lane < n_warps ? warp_sums[lane] : (C)0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }

// ---- RMSNorm ----------------------------------------------------------------------------------
// x, out, dy, dx dense [rows, n]; weight [n]; rstd [rows] in Acc<T>; partial [gridDim.x, n] in
// Acc<T>: each block's column sums of dy · round(x · rstd), which `rms_norm_weight_grad_finish`
// adds into the weight gradient.

// Vector q of this thread's share of a row: vectors t, t + blockDim.x, ... (whether it exists:
// `< nv`, the row's vectors).
__device__ __forceinline__ unsigned long long vector_of_thread(int q) {
    return threadIdx.x + (unsigned long long)q * blockDim.x;
}

// Loads this thread's VPT vectors of `row` (those that exist, zero for the others) into `v`.
template <typename T, int VPT>
__device__ __forceinline__ void load_share(const T* row, unsigned long long nv, Vec16<T>* v) {
#pragma unroll
    for (int q = 0; q < VPT; ++q)
        v[q].raw = vector_of_thread(q) < nv ? reinterpret_cast<const uint4*>(row)[vector_of_thread(q)]
                                            : make_uint4(0, 0, 0, 0);
}

// Stores this thread's VPT vectors `v` into `row` (those that exist).
template <typename T, int VPT>
__device__ __forceinline__ void store_share(T* row, unsigned long long nv, const Vec16<T>* v) {
#pragma unroll
    for (int q = 0; q < VPT; ++q)
        if (vector_of_thread(q) < nv) reinterpret_cast<uint4*>(row)[vector_of_thread(q)] = v[q].raw;
}

// One block per row (grid-stride), each thread keeping VPT vectors of the row in registers:
// thread t owns vectors t, t + blockDim.x, ... of every row, so the weight is loaded once.
template <typename T, int VPT>
__device__ void rms_norm_vec(const T* x, const T* w, T* out, typename Acc<T>::type* rstd_out, double eps,
                             unsigned long long rows, unsigned long long n) {
    typedef typename Acc<T>::type C;
    constexpr int V = Vec16<T>::N;
    __shared__ C warp_sums[32];
    const unsigned long long nv = n / V;
    Vec16<T> wv[VPT], xv[VPT];
    load_share<T, VPT>(w, nv, wv);
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        load_share<T, VPT>(x + r * n, nv, xv);
        C sq = 0;
#pragma unroll
        for (int q = 0; q < VPT; ++q)
#pragma unroll
            for (int k = 0; k < V; ++k) {
                C v = vector_of_thread(q) < nv ? xv[q].get(k) : (C)0;
                sq += v * v;
            }
        const C rstd = (C)1 / m_sqrt(block_sum(sq, warp_sums) / (C)n + (C)eps);
#pragma unroll
        for (int q = 0; q < VPT; ++q)
#pragma unroll
            for (int k = 0; k < V; ++k) xv[q].set(k, wv[q].get(k) * round_to<T>(xv[q].get(k) * rstd));
        store_share<T, VPT>(out + r * n, nv, xv);
        if (threadIdx.x == 0) rstd_out[r] = rstd;
    }
}

// Rows a block of `rms_norm_backward_vec` takes at a time with VPT vectors a thread: 8 vectors of
// x and of dy in flight per thread (4 for f64, and for 16-bit types at 4 vectors a thread, whose
// 32 weight-gradient sums take the registers), within 128 registers (two blocks of 256 threads
// an SM) without spilling. For 16-bit types at one vector a thread, 4 rows within 80 registers,
// three blocks an SM (`backward_blocks_per_sm`): more warps to hide the latency of the passes
// (measured on the H200 at 8192 x 2048 in bf16, scripts/cuda/rms_norm_backward_occupancy.cu:
// 40.5 us with the finish against 44.0 for 8 rows at two blocks). llama.rs mirrors both
// (`backward_rows_per_pass`, `weight_grad_threads_per_sm`).
template <typename T> __host__ __device__ constexpr int backward_rows_per_pass(int vpt) {
    return sizeof(T) == 8 ? 4 / vpt : sizeof(T) == 2 && vpt == 4 ? 1 : sizeof(T) == 2 && vpt == 1 ? 4 : 8 / vpt;
}
template <typename T> __host__ __device__ constexpr int backward_blocks_per_sm(int vpt) {
    return sizeof(T) == 2 && vpt == 1 ? 3 : 2;
}

// The sums over the block (any multiple of 32 threads up to 1024) of each of K values, which
// every thread gets. `warp_sums` holds two turns of [K][32]: calls that alternate `turn` need only
// the one barrier here, since a thread reaches the next call's barrier only after its reads.
template <typename C, int K>
__device__ __forceinline__ void block_sums(C (&v)[K], C (*warp_sums)[K][32], int turn) {
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
        if (lane == 0) warp_sums[turn][k][warp] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; ++k) {
        C s = 0;
        for (unsigned i = 0; i < n_warps; ++i) s += warp_sums[turn][k][i];
        v[k] = s;
    }
}

// dx = rstd · (g − x̂ · mean(g · x̂)) with g = dy · w and x̂ = x · rstd (skipped when dx is null);
// with `partial`, the block's column sums of dy · round(x̂) (the weight gradient) in registers,
// written once at the end to the block's row of `partial`. A block takes K rows at a time (rows
// first, first + 1, ... with first = K · (block + i · blocks)), loading all of them before it
// sums, so K · VPT vectors of x and of dy are in flight per thread; rows past the end load
// zeros, which add nothing.
template <typename T, int VPT, int K>
__device__ void rms_norm_backward_vec(const T* dy, const T* x, const typename Acc<T>::type* rstd_in, const T* w,
                                      T* dx, typename Acc<T>::type* partial, unsigned long long rows,
                                      unsigned long long n) {
    typedef typename Acc<T>::type C;
    constexpr int V = Vec16<T>::N;
    __shared__ C warp_sums[2][K][32];
    const unsigned long long nv = n / V;
    Vec16<T> wv[VPT];
    C dw[VPT][V];
    load_share<T, VPT>(w, nv, wv);
#pragma unroll
    for (int q = 0; q < VPT; ++q)
#pragma unroll
        for (int e = 0; e < V; ++e) dw[q][e] = 0;
    int turn = 0;
    for (unsigned long long first = (unsigned long long)blockIdx.x * K; first < rows;
         first += (unsigned long long)gridDim.x * K) {
        Vec16<T> xv[K][VPT], gv[K][VPT];
        C rstd[K], sgx[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const bool here = first + k < rows;
            load_share<T, VPT>(x + (first + k) * n, here ? nv : 0, xv[k]);
            load_share<T, VPT>(dy + (first + k) * n, here ? nv : 0, gv[k]);
            rstd[k] = here ? rstd_in[first + k] : (C)0;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            sgx[k] = 0;
#pragma unroll
            for (int q = 0; q < VPT; ++q)
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    C x_hat = xv[k][q].get(e) * rstd[k], g = gv[k][q].get(e);
                    if (partial) dw[q][e] += g * round_to<T>(x_hat);
                    sgx[k] += g * wv[q].get(e) * x_hat;
                }
        }
        if (!dx) continue;
        block_sums<C, K>(sgx, warp_sums, turn);
        turn ^= 1;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (first + k >= rows) continue;
            const C mean_gx = sgx[k] / (C)n;
#pragma unroll
            for (int q = 0; q < VPT; ++q)
#pragma unroll
                for (int e = 0; e < V; ++e)
                    gv[k][q].set(e, rstd[k] * (gv[k][q].get(e) * wv[q].get(e) - xv[k][q].get(e) * rstd[k] * mean_gx));
            store_share<T, VPT>(dx + (first + k) * n, nv, gv[k]);
        }
    }
    if (!partial) return;
#pragma unroll
    for (int q = 0; q < VPT; ++q)
        if (vector_of_thread(q) < nv)
#pragma unroll
            for (int e = 0; e < V; ++e) partial[blockIdx.x * n + vector_of_thread(q) * V + e] = dw[q][e];
}

// Threads of a block of `rms_norm_weight_grad_finish`: columns x rows (llama.rs's FINISH_BLOCK).
// Narrow and tall measured fastest beside the backward (scripts/cuda/
// rms_norm_weight_grad_finish_shapes.cu: 8 x 128 with a tree 38.5 µs for the pair at 8192 x 2048
// bf16, 32 x 32 in order 39.8): more blocks in flight, fewer chunks per thread.
constexpr int FINISH_COLS = 8;
constexpr int FINISH_ROWS = 128;

// dw[j · dws] = the sum over `chunks` rows of `partial` [chunks, n] of column j: a block takes
// COLS columns, each of its ROWS rows of threads every ROWS-th chunk (unrolled so several loads
// are in flight), then the rows' sums are added as a tree in shared memory. Deterministic: the
// order depends only on `chunks`. The op runs FINISH_COLS x FINISH_ROWS; other shapes are for
// scripts/cuda/rms_norm_weight_grad_finish_shapes.cu.
template <typename T, int COLS = FINISH_COLS, int ROWS = FINISH_ROWS>
__device__ void rms_norm_weight_grad_finish(const typename Acc<T>::type* partial, unsigned long long chunks, T* dw,
                                            unsigned long long dws, unsigned long long n) {
    typedef typename Acc<T>::type C;
    __shared__ C column_sums[ROWS][COLS + 1];
    const unsigned long long j = (unsigned long long)blockIdx.x * COLS + threadIdx.x;
    C acc = 0;
    if (j < n) {
#pragma unroll 4
        for (unsigned long long c = threadIdx.y; c < chunks; c += ROWS) acc += partial[c * n + j];
    }
    column_sums[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
#pragma unroll
    for (int stride = ROWS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.y < stride) column_sums[threadIdx.y][threadIdx.x] += column_sums[threadIdx.y + stride][threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.y == 0 && j < n) st(dw + j * dws, column_sums[0][threadIdx.x]);
}

// Any alignment and weight stride: one block per row (grid-stride), threads striding along it;
// x is read twice (the second time from cache).
template <typename T>
__device__ void rms_norm_rows(const T* x, const T* w, unsigned long long ws, T* out, typename Acc<T>::type* rstd_out,
                              double eps, unsigned long long rows, unsigned long long n) {
    typedef typename Acc<T>::type C;
    __shared__ C warp_sums[32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        C sq = 0;
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) { C v = ld(x + r * n + j); sq += v * v; }
        const C rstd = (C)1 / m_sqrt(block_sum(sq, warp_sums) / (C)n + (C)eps);
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x)
            st(out + r * n + j, ld(w + j * ws) * round_to<T>(ld(x + r * n + j) * rstd));
        if (threadIdx.x == 0) rstd_out[r] = rstd;
    }
}

// The backward of `rms_norm_rows`; with `partial`, each block adds its rows' dy · round(x̂) into
// its own row of `partial` (thread j owns columns j, j + blockDim.x, ...: no races).
template <typename T>
__device__ void rms_norm_backward_rows(const T* dy, const T* x, const typename Acc<T>::type* rstd_in, const T* w,
                                       unsigned long long ws, T* dx, typename Acc<T>::type* partial,
                                       unsigned long long rows, unsigned long long n) {
    typedef typename Acc<T>::type C;
    __shared__ C warp_sums[32];
    if (partial)
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) partial[blockIdx.x * n + j] = 0;
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const C rstd = rstd_in[r];
        C sgx = 0;
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
            C x_hat = ld(x + r * n + j) * rstd, g = ld(dy + r * n + j);
            if (partial) partial[blockIdx.x * n + j] += g * round_to<T>(x_hat);
            sgx += g * ld(w + j * ws) * x_hat;
        }
        if (!dx) continue;
        const C mean_gx = block_sum(sgx, warp_sums) / (C)n;
        for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
            C x_hat = ld(x + r * n + j) * rstd;
            st(dx + r * n + j, rstd * (ld(dy + r * n + j) * ld(w + j * ws) - x_hat * mean_gx));
        }
    }
}

// ---- SwiGLU -----------------------------------------------------------------------------------
// gate and up [rows, n] with row strides gs and us (contiguous within a row: halves of a packed
// projection work); out, dout, dgate, dup dense [rows, n]. Rows along grid y, a row's elements (or
// 16-byte vectors, VEC) along grid x.

template <typename C> __device__ __forceinline__ C sigmoid(C g) { return (C)1 / ((C)1 + m_exp(-g)); }

// FORWARD: out = g · σ(g) · u. Backward: dgate = dout · u · σ(g)(1 + g(1 − σ(g))), dup = dout · g · σ(g).
template <typename T, bool VEC, bool FORWARD>
__device__ void swiglu_rows(const T* gate, unsigned long long gs, const T* up, unsigned long long us, const T* dout,
                            T* out, T* dup, unsigned long long rows, unsigned long long n) {
    typedef typename Acc<T>::type C;
    constexpr int V = VEC ? Vec16<T>::N : 1;
    const unsigned long long units = n / V;
    for (unsigned long long r = blockIdx.y; r < rows; r += gridDim.y) {
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < units;
             i += (unsigned long long)gridDim.x * blockDim.x) {
            const unsigned long long j = i * V;
            C g[V], u[V], d[V], a[V], b[V];
            if (VEC) {
                Vec16<T> gv, uv, dv;
                gv.raw = *reinterpret_cast<const uint4*>(gate + r * gs + j);
                uv.raw = *reinterpret_cast<const uint4*>(up + r * us + j);
                if (!FORWARD) dv.raw = *reinterpret_cast<const uint4*>(dout + r * n + j);
#pragma unroll
                for (int k = 0; k < V; ++k) { g[k] = gv.get(k); u[k] = uv.get(k); d[k] = FORWARD ? (C)0 : dv.get(k); }
            } else {
                g[0] = ld(gate + r * gs + j);
                u[0] = ld(up + r * us + j);
                d[0] = FORWARD ? (C)0 : ld(dout + r * n + j);
            }
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const C s = sigmoid(g[k]);
                a[k] = FORWARD ? g[k] * s * u[k] : d[k] * u[k] * s * ((C)1 + g[k] * ((C)1 - s));
                b[k] = d[k] * g[k] * s;
            }
            if (VEC) {
                Vec16<T> av, bv;
#pragma unroll
                for (int k = 0; k < V; ++k) { av.set(k, a[k]); bv.set(k, b[k]); }
                *reinterpret_cast<uint4*>(out + r * n + j) = av.raw;
                if (!FORWARD) *reinterpret_cast<uint4*>(dup + r * n + j) = bv.raw;
            } else {
                st(out + r * n + j, a[0]);
                if (!FORWARD) st(dup + r * n + j, b[0]);
            }
        }
    }
}

// ---- Rotary embedding -------------------------------------------------------------------------
// x and out padded to [outer, heads, seq, d] with strides xs and os (each 4 values); cos and sin
// dense [seq, d]. Forward: out₁ = x₁c₁ − x₂s₁, out₂ = x₂c₂ + x₁s₂; TRANSPOSE (the backward):
// out₁ = x₁c₁ + x₂s₂, out₂ = x₂c₂ − x₁s₁. One thread per (row, unit) in a flat grid-stride walk
// (a row is one head at one position, a unit one element of the first half, or a 16-byte vector
// of it with VEC: unit last strides), so short heads still fill the blocks.
struct RotaryShape {
    unsigned long long shape[4];
    unsigned long long xs[4];
    unsigned long long os[4];
};

template <typename T, bool VEC>
__device__ void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int transpose, RotaryShape a) {
    typedef typename Acc<T>::type C;
    constexpr int V = VEC ? Vec16<T>::N : 1;
    const unsigned long long heads = a.shape[1], seq = a.shape[2], d = a.shape[3], half = d / 2;
    const unsigned long long rows = a.shape[0] * heads * seq, units = half / V;
    const C sign = transpose ? (C)-1 : (C)1;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < rows * units;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = i / units;
        const unsigned long long o = r / (heads * seq), h = (r / seq) % heads, s = r % seq;
        const T* xr = x + o * a.xs[0] + h * a.xs[1] + s * a.xs[2];
        T* outr = out + o * a.os[0] + h * a.os[1] + s * a.os[2];
        const T* cr = cos + s * d;
        const T* sr = sin + s * d;
        const unsigned long long j = (i % units) * V;
        C x1[V], x2[V], c1[V], c2[V], s1[V], s2[V];
        if (VEC) {
            Vec16<T> v[6];
            v[0].raw = *reinterpret_cast<const uint4*>(xr + j);
            v[1].raw = *reinterpret_cast<const uint4*>(xr + j + half);
            v[2].raw = *reinterpret_cast<const uint4*>(cr + j);
            v[3].raw = *reinterpret_cast<const uint4*>(cr + j + half);
            v[4].raw = *reinterpret_cast<const uint4*>(sr + j);
            v[5].raw = *reinterpret_cast<const uint4*>(sr + j + half);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                x1[k] = v[0].get(k); x2[k] = v[1].get(k); c1[k] = v[2].get(k);
                c2[k] = v[3].get(k); s1[k] = v[4].get(k); s2[k] = v[5].get(k);
            }
        } else {
            x1[0] = ld(xr + j * a.xs[3]); x2[0] = ld(xr + (j + half) * a.xs[3]);
            c1[0] = ld(cr + j); c2[0] = ld(cr + j + half);
            s1[0] = ld(sr + j); s2[0] = ld(sr + j + half);
        }
        C out1[V], out2[V];
#pragma unroll
        for (int k = 0; k < V; ++k) {
            // The transpose swaps which half's sine pairs with which, and flips the signs.
            out1[k] = x1[k] * c1[k] - sign * x2[k] * (transpose ? s2[k] : s1[k]);
            out2[k] = x2[k] * c2[k] + sign * x1[k] * (transpose ? s1[k] : s2[k]);
        }
        if (VEC) {
            Vec16<T> w1, w2;
#pragma unroll
            for (int k = 0; k < V; ++k) { w1.set(k, out1[k]); w2.set(k, out2[k]); }
            *reinterpret_cast<uint4*>(outr + j) = w1.raw;
            *reinterpret_cast<uint4*>(outr + j + half) = w2.raw;
        } else {
            st(outr + j * a.os[3], out1[0]);
            st(outr + (j + half) * a.os[3], out2[0]);
        }
    }
}

// ---- Entry points -----------------------------------------------------------------------------
#define LLAMA_VEC_KERNELS(T, N, VPT)                                                                        \
    extern "C" __global__ void rms_norm_v##VPT##_##N(const T* x, const T* w, T* out, Acc<T>::type* rstd,    \
                                                     double eps, unsigned long long rows, unsigned long long n) { \
        rms_norm_vec<T, VPT>(x, w, out, rstd, eps, rows, n);                                                 \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, backward_blocks_per_sm<T>(VPT))                       \
        rms_norm_backward_v##VPT##_##N(const T* dy, const T* x, const Acc<T>::type* rstd, const T* w, T* dx,   \
                                       Acc<T>::type* partial, unsigned long long rows, unsigned long long n) { \
        rms_norm_backward_vec<T, VPT, backward_rows_per_pass<T>(VPT)>(dy, x, rstd, w, dx, partial, rows, n);                        \
    }

#define LLAMA_KERNELS(T, N)                                                                                  \
    LLAMA_VEC_KERNELS(T, N, 1) LLAMA_VEC_KERNELS(T, N, 2) LLAMA_VEC_KERNELS(T, N, 4)                          \
    extern "C" __global__ void rms_norm_rows_##N(const T* x, const T* w, unsigned long long ws, T* out,       \
                                                 Acc<T>::type* rstd, double eps, unsigned long long rows,      \
                                                 unsigned long long n) {                                       \
        rms_norm_rows<T>(x, w, ws, out, rstd, eps, rows, n);                                                   \
    }                                                                                                          \
    extern "C" __global__ void rms_norm_backward_rows_##N(const T* dy, const T* x, const Acc<T>::type* rstd,   \
                                                          const T* w, unsigned long long ws, T* dx,            \
                                                          Acc<T>::type* partial, unsigned long long rows,      \
                                                          unsigned long long n) {                              \
        rms_norm_backward_rows<T>(dy, x, rstd, w, ws, dx, partial, rows, n);                                   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(FINISH_COLS * FINISH_ROWS)                                    \
        rms_norm_weight_grad_finish_##N(const Acc<T>::type* partial, unsigned long long chunks, T* dw,         \
                                        unsigned long long dws, unsigned long long n) {                        \
        rms_norm_weight_grad_finish<T>(partial, chunks, dw, dws, n);                                           \
    }                                                                                                          \
    extern "C" __global__ void swiglu_v_##N(const T* g, unsigned long long gs, const T* u, unsigned long long us, \
                                            T* out, unsigned long long rows, unsigned long long n) {           \
        swiglu_rows<T, true, true>(g, gs, u, us, nullptr, out, nullptr, rows, n);                              \
    }                                                                                                          \
    extern "C" __global__ void swiglu_s_##N(const T* g, unsigned long long gs, const T* u, unsigned long long us, \
                                            T* out, unsigned long long rows, unsigned long long n) {           \
        swiglu_rows<T, false, true>(g, gs, u, us, nullptr, out, nullptr, rows, n);                             \
    }                                                                                                          \
    extern "C" __global__ void swiglu_backward_v_##N(const T* g, unsigned long long gs, const T* u,             \
                                                     unsigned long long us, const T* dout, T* dgate, T* dup,   \
                                                     unsigned long long rows, unsigned long long n) {          \
        swiglu_rows<T, true, false>(g, gs, u, us, dout, dgate, dup, rows, n);                                  \
    }                                                                                                          \
    extern "C" __global__ void swiglu_backward_s_##N(const T* g, unsigned long long gs, const T* u,             \
                                                     unsigned long long us, const T* dout, T* dgate, T* dup,   \
                                                     unsigned long long rows, unsigned long long n) {          \
        swiglu_rows<T, false, false>(g, gs, u, us, dout, dgate, dup, rows, n);                                 \
    }                                                                                                          \
    extern "C" __global__ void rotary_v_##N(const T* x, const T* c, const T* s, T* out, int transpose,          \
                                            RotaryShape a) {                                                   \
        rotary_rows<T, true>(x, c, s, out, transpose, a);                                                      \
    }                                                                                                          \
    extern "C" __global__ void rotary_s_##N(const T* x, const T* c, const T* s, T* out, int transpose,          \
                                            RotaryShape a) {                                                   \
        rotary_rows<T, false>(x, c, s, out, transpose, a);                                                     \
    }
LLAMA_KERNELS(float, f32)
LLAMA_KERNELS(double, f64)
LLAMA_KERNELS(__half, f16)
LLAMA_KERNELS(__nv_bfloat16, bf16)
