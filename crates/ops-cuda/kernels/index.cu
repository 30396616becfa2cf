// Index kernels of the CUDA backend: gather and scatter-add along a dim, fused cross-entropy
// (forward and backward) and dropout.
//
// Out-of-range indices and targets are never read or written: the kernels record the first bad
// value in an error word (initialised to all ones by the caller), which the Rust side
// (crates/ops-cuda/src/index.rs) reads back and turns into a typed error. Dropout draws the same
// counter-based numbers as autograd-core's `uniform(seed, counter)`, so the CPU and GPU masks
// agree bit for bit. Built to PTX by `cargo xtask build-kernels`.

#include "elements.cuh"

#include "strided.cuh"

#define THREADS 256
#define NO_ERROR 0xffffffffffffffffULL


__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(__half* p, float v) { atomicAdd(p, __float2half(v)); }
__device__ __forceinline__ void atomic_add(__nv_bfloat16* p, float v) { atomicAdd(p, __float2bfloat16(v)); }

__device__ __forceinline__ void report(unsigned long long* error, long long value) {
    atomicCAS(error, NO_ERROR, (unsigned long long)value);
}

// Operands: 0 = out, 1 = index (i64), 2 = x with the dim's stride zeroed.
template <typename T>
__device__ void gather_kernel(const T* x, const long long* index, T* out, unsigned long long dim_stride,
                              long long limit, unsigned long long* error, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        long long position = index[off[1]];
        if (position < 0 || position >= limit) { report(error, position); continue; }
        out[off[0]] = x[off[2] + (unsigned long long)position * dim_stride];
    }
}

// Operands: 0 = src, 1 = index (i64), 2 = dst with the dim's stride zeroed.
template <typename T>
__device__ void scatter_add_kernel(T* dst, const long long* index, const T* src, unsigned long long dim_stride,
                                   long long limit, unsigned long long* error, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        long long position = index[off[1]];
        if (position < 0 || position >= limit) { report(error, position); continue; }
        atomic_add(dst + off[2] + (unsigned long long)position * dim_stride, ld(src + off[0]));
    }
}

template <typename C> __device__ C block_sum(C v, C* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x % 32 < THREADS / 32 ? scratch[threadIdx.x % 32] : (C)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
template <typename C> __device__ C block_max(C v, C* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffff, v, o));
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x % 32 < THREADS / 32 ? scratch[threadIdx.x % 32] : (C)-INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

// Folds the pair (m2, s2) into the running log-sum-exp state (m, s): s is Σ exp(x − m) over the
// values seen, m their maximum (−∞ and 0 before any).
template <typename C> __device__ __forceinline__ void lse_merge(C& m, C& s, C m2, C s2) {
    C mx = fmax(m, m2);
    if (mx == (C)-INFINITY) return;
    s = s * exp_acc(m - mx) + s2 * exp_acc(m2 - mx);
    m = mx;
}

// The block's merged (max, sum) state, in every thread.
template <typename C> __device__ void block_lse(C& m, C& s, C* scratch_m, C* scratch_s) {
    for (int o = 16; o > 0; o >>= 1) {
        C m2 = __shfl_xor_sync(0xffffffff, m, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
        lse_merge(m, s, m2, s2);
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) { scratch_m[threadIdx.x / 32] = m; scratch_s[threadIdx.x / 32] = s; }
    __syncthreads();
    bool live = threadIdx.x % 32 < THREADS / 32;
    m = live ? scratch_m[threadIdx.x % 32] : (C)-INFINITY;
    s = live ? scratch_s[threadIdx.x % 32] : (C)0;
    for (int o = 16; o > 0; o >>= 1) {
        C m2 = __shfl_xor_sync(0xffffffff, m, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
        lse_merge(m, s, m2, s2);
    }
}

// Cross-entropy, per row of dense logits [rows, classes]: lse[row] (S), and the row's loss and
// whether it counts into `row_loss` / `row_valid` (double / u64 scratch of `rows`). One block a
// row, one pass over it: each thread keeps an online (max, Σ exp) pair in the accumulation type
// (float, double for f64: PyTorch's log-softmax accumulates f32, f16 and bf16 in float), merged
// across the block at the end.
template <typename T, typename S>
__device__ void ce_rows(const T* logits, const long long* target, unsigned long long target_stride,
                        long long ignore_index, S* lse, double* row_loss, unsigned long long* row_valid,
                        unsigned long long* error, unsigned long long rows, unsigned long long classes) {
    typedef typename Acc<T>::type C;
    __shared__ C scratch_m[THREADS / 32], scratch_s[THREADS / 32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* x = logits + r * classes;
        C m = (C)-INFINITY, s = 0;
#pragma unroll 4
        for (unsigned long long j = threadIdx.x; j < classes; j += blockDim.x) {
            C v = ld(x + j);
            if (v > m) {
                s = s * exp_acc(m - v) + (C)1;
                m = v;
            } else {
                s += exp_acc(v - m);
            }
        }
        block_lse(m, s, scratch_m, scratch_s);
        if (threadIdx.x == 0) {
            C log_sum_exp = m + log_acc(s);
            st(lse + r, (typename Acc<S>::type)log_sum_exp);
            long long t = target[r * target_stride];
            bool ignored = t == ignore_index;
            if (!ignored && (t < 0 || (unsigned long long)t >= classes)) { report(error, t); ignored = true; }
            row_loss[r] = ignored ? 0.0 : (double)(log_sum_exp - ld(x + t));
            row_valid[r] = ignored ? 0 : 1;
        }
    }
}

// Sums the row losses (one block) and writes the mean or the sum into `loss`.
template <typename T>
__device__ void ce_total(const double* row_loss, const unsigned long long* row_valid, unsigned long long rows,
                         int mean, T* loss) {
    __shared__ double scratch[THREADS / 32];
    double total = 0, count = 0;
    for (unsigned long long r = threadIdx.x; r < rows; r += blockDim.x) { total += row_loss[r]; count += (double)row_valid[r]; }
    total = block_sum(total, scratch);
    count = block_sum(count, scratch);
    if (threadIdx.x == 0) st(loss, (typename Acc<T>::type)(mean ? total / count : total));
}

// dlogits = scale·(softmax − onehot(target)), scale = dloss / count (mean) or dloss (sum), in the
// accumulation type; one block a row. `dloss` is G: the logits' type, or f32 for the loss of
// f16/bf16 logits computed in f32 (`cross_entropy` of upcast logits without the f32 copy).
template <typename T, typename S, typename G>
__device__ void ce_backward(const T* logits, const long long* target, unsigned long long target_stride,
                            long long ignore_index, const S* lse, const G* dloss, const unsigned long long* count,
                            int mean, T* dlogits, unsigned long long rows, unsigned long long classes) {
    typedef typename Acc<T>::type C;
    double g = (double)ld(dloss);
    C scale = (C)(mean ? g / (double)(*count) : g);
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* x = logits + r * classes;
        T* dx = dlogits + r * classes;
        long long t = target[r * target_stride];
        if (t == ignore_index) {
            for (unsigned long long j = threadIdx.x; j < classes; j += blockDim.x) st(dx + j, (C)0);
            continue;
        }
        C log_sum_exp = (C)ld(lse + r);
#pragma unroll 4
        for (unsigned long long j = threadIdx.x; j < classes; j += blockDim.x) {
            C p = exp_acc(ld(x + j) - log_sum_exp);
            st(dx + j, scale * ((long long)j == t ? p - (C)1 : p));
        }
    }
}

__device__ __forceinline__ unsigned long long mix(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Dropout: operands 0 = out (dense; its row-major index keys the random stream), 1 = x.
template <typename T>
__device__ void dropout_kernel(const T* x, T* out, unsigned char* mask, double p, unsigned long long seed,
                               unsigned long long offset, StridedArgs a) {
    typedef typename Acc<T>::type C;
    C scale = p < 1.0 ? (C)(1.0 / (1.0 - p)) : (C)0;
    unsigned long long seeded = mix(seed ^ 0x9E3779B97F4A7C15ULL);
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        double u = (double)(mix(seeded + offset + i) >> 40) / (double)(1ULL << 24);
        bool keep = u >= p;
        st(out + i, keep ? ld(x + off[1]) * scale : (C)0);
        mask[i] = keep ? 1 : 0;
    }
}

#define INDEX_KERNELS(T, N)                                                                                      \
    extern "C" __global__ void gather_##N(const T* x, const long long* index, T* out, unsigned long long ds,      \
                                          long long limit, unsigned long long* error, StridedArgs a) {           \
        gather_kernel<T>(x, index, out, ds, limit, error, a);                                                   \
    }                                                                                                            \
    extern "C" __global__ void scatter_add_##N(T* dst, const long long* index, const T* src, unsigned long long ds, \
                                               long long limit, unsigned long long* error, StridedArgs a) {      \
        scatter_add_kernel<T>(dst, index, src, ds, limit, error, a);                                            \
    }                                                                                                            \
    extern "C" __global__ void ce_total_##N(const double* rl, const unsigned long long* rv, unsigned long long rows, \
                                            int mean, T* loss) {                                                 \
        ce_total<T>(rl, rv, rows, mean, loss);                                                                  \
    }                                                                                                            \
    extern "C" __global__ void dropout_##N(const T* x, T* out, unsigned char* mask, double p,                   \
                                           unsigned long long seed, unsigned long long offset, StridedArgs a) {   \
        dropout_kernel<T>(x, out, mask, p, seed, offset, a);                                                    \
    }
INDEX_KERNELS(float, f32)
INDEX_KERNELS(double, f64)
INDEX_KERNELS(__half, f16)
INDEX_KERNELS(__nv_bfloat16, bf16)

#define CE_KERNELS(T, S, N)                                                                                      \
    extern "C" __global__ void ce_rows_##N(const T* logits, const long long* target, unsigned long long ts,      \
                                           long long ignore, S* lse, double* rl, unsigned long long* rv,          \
                                           unsigned long long* error, unsigned long long rows,                   \
                                           unsigned long long classes) {                                         \
        ce_rows<T, S>(logits, target, ts, ignore, lse, rl, rv, error, rows, classes);                           \
    }                                                                                                            \
    extern "C" __global__ void ce_backward_##N(const T* logits, const long long* target, unsigned long long ts,  \
                                               long long ignore, const S* lse, const T* dloss,                   \
                                               const unsigned long long* count, int mean, T* dlogits,            \
                                               unsigned long long rows, unsigned long long classes) {            \
        ce_backward<T, S, T>(logits, target, ts, ignore, lse, dloss, count, mean, dlogits, rows, classes);      \
    }
CE_KERNELS(float, float, f32_f32)
CE_KERNELS(double, double, f64_f64)
CE_KERNELS(__half, float, f16_f32)
CE_KERNELS(__nv_bfloat16, float, bf16_f32)

// The backward of an f32 loss of f16/bf16 logits (`_gf32`: the loss gradient is f32).
#define CE_UPCAST_KERNELS(T, N)                                                                                  \
    extern "C" __global__ void ce_backward_##N##_gf32(const T* logits, const long long* target,                 \
                                                      unsigned long long ts, long long ignore, const float* lse, \
                                                      const float* dloss, const unsigned long long* count,       \
                                                      int mean, T* dlogits, unsigned long long rows,            \
                                                      unsigned long long classes) {                             \
        ce_backward<T, float, float>(logits, target, ts, ignore, lse, dloss, count, mean, dlogits, rows, classes); \
    }
CE_UPCAST_KERNELS(__half, f16_f32)
CE_UPCAST_KERNELS(__nv_bfloat16, bf16_f32)

// Counts the targets that are not ignored (one block).
extern "C" __global__ void ce_count(const long long* target, unsigned long long ts, long long ignore,
                                    unsigned long long rows, unsigned long long* count) {
    __shared__ double scratch[THREADS / 32];
    double c = 0;
    for (unsigned long long r = threadIdx.x; r < rows; r += blockDim.x) c += target[r * ts] != ignore ? 1.0 : 0.0;
    c = block_sum(c, scratch);
    if (threadIdx.x == 0) *count = (unsigned long long)c;
}
