// Index kernels of the CUDA backend: gather and scatter-add along a dim, fused cross-entropy
// (forward and backward, whole rows and the tiles of a chunked loss), dropout and random fills.
//
// Out-of-range indices and targets are never read or written: the kernels record the first bad
// value in an error word (initialised to all ones by the caller), which the Rust side
// (crates/ops-cuda/src/index.rs) reads back and turns into a typed error. Dropout draws the same
// counter-based numbers as autograd-core's `uniform(seed, counter)`, so the CPU and GPU masks
// agree bit for bit. Built to PTX by `cargo xtask build-kernels`.

#include "elements.cuh"

#include "strided.cuh"
#include "counter_random.cuh"

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

// The warp's merged (max, sum) state, in every lane.
template <typename C> __device__ __forceinline__ void warp_lse(C& m, C& s) {
    for (int o = 16; o > 0; o >>= 1) {
        C m2 = __shfl_xor_sync(0xffffffff, m, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
        lse_merge(m, s, m2, s2);
    }
}

// The block's merged (max, sum) state, in every thread.
template <typename C> __device__ void block_lse(C& m, C& s, C* scratch_m, C* scratch_s) {
    warp_lse(m, s);
    __syncthreads();
    if (threadIdx.x % 32 == 0) { scratch_m[threadIdx.x / 32] = m; scratch_s[threadIdx.x / 32] = s; }
    __syncthreads();
    bool live = threadIdx.x % 32 < THREADS / 32;
    m = live ? scratch_m[threadIdx.x % 32] : (C)-INFINITY;
    s = live ? scratch_s[threadIdx.x % 32] : (C)0;
    warp_lse(m, s);
}

// Two neighbouring elements in one load or store (p aligned to two elements), in the
// accumulation type: the tiles' rows are read and written in pairs when their width is even.
__device__ __forceinline__ float2 ld2(const float* p) { return *(const float2*)p; }
__device__ __forceinline__ double2 ld2(const double* p) { return *(const double2*)p; }
__device__ __forceinline__ float2 ld2(const __half* p) { return __half22float2(*(const __half2*)p); }
__device__ __forceinline__ float2 ld2(const __nv_bfloat16* p) { return __bfloat1622float2(*(const __nv_bfloat162*)p); }
__device__ __forceinline__ void st2(float* p, float a, float b) { *(float2*)p = make_float2(a, b); }
__device__ __forceinline__ void st2(double* p, double a, double b) { *(double2*)p = make_double2(a, b); }
__device__ __forceinline__ void st2(__half* p, float a, float b) { *(__half2*)p = __floats2half2_rn(a, b); }
__device__ __forceinline__ void st2(__nv_bfloat16* p, float a, float b) {
    *(__nv_bfloat162*)p = __floats2bfloat162_rn(a, b);
}

// Whether the rows of a dense [rows, n] tile at x can be read in pairs: n even and x aligned.
template <typename T> __device__ __forceinline__ bool pairs(const T* x, unsigned long long n) {
    return n % 2 == 0 && ((unsigned long long)x % (2 * sizeof(T))) == 0;
}

// Sixteen bytes of a row in one load or store (p aligned to 16 bytes), as 16 / sizeof(T)
// values in the accumulation type: the tiles' rows are read and written this way when their
// width is a multiple of the pack (it is for the chunked loss's tiles, whose widths are
// multiples of 64) — a quarter of the load instructions of pairs, and loads enough in flight
// to keep the memory busy.
template <typename T> struct Pack {
    static constexpr int N = 16 / sizeof(T);
    typedef typename Acc<T>::type C;
};
template <typename T>
__device__ __forceinline__ void ld_pack(const T* p, typename Acc<T>::type (&v)[Pack<T>::N]) {
    uint4 raw = *(const uint4*)p;
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < Pack<T>::N; i += 2) {
        auto pair = ld2(e + i);
        v[i] = pair.x;
        v[i + 1] = pair.y;
    }
}
template <typename T>
__device__ __forceinline__ void st_pack(T* p, const typename Acc<T>::type (&v)[Pack<T>::N]) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < Pack<T>::N; i += 2) st2(e + i, v[i], v[i + 1]);
    *(uint4*)p = raw;
}

// Whether the rows of a dense [rows, n] tile at x can be read in packs: n a multiple of the
// pack and x aligned to 16 bytes.
template <typename T> __device__ __forceinline__ bool packs(const T* x, unsigned long long n) {
    return n % Pack<T>::N == 0 && ((unsigned long long)x % 16) == 0;
}

// Folds one value into an online (max, Σ exp) pair and a sum.
template <typename C> __device__ __forceinline__ void lse_push(C v, C& m, C& s, C& total) {
    total += v;
    if (v > m) {
        s = s * exp_acc(m - v) + (C)1;
        m = v;
    } else {
        s += exp_acc(v - m);
    }
}

// One thread's share of a row x[0..n) (every step-th element from first) folded online into its
// (max m, Σ exp(x − m) s) pair, and its elements summed into total (a caller that does not read
// total pays nothing: the compiler drops it).
template <typename C, typename T>
__device__ __forceinline__ void thread_lse(const T* x, unsigned long long n, unsigned first, unsigned step,
                                           C& m, C& s, C& total) {
#pragma unroll 4
    for (unsigned long long j = first; j < n; j += step) lse_push((C)ld(x + j), m, s, total);
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
        C m = (C)-INFINITY, s = 0, total = 0;
        thread_lse(x, classes, threadIdx.x, blockDim.x, m, s, total);
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

// The column of target t in a tile of n classes from class_start, or −1 when it is not in it
// (ignored, or outside the tile).
__device__ __forceinline__ long long tile_column(long long t, long long ignore_index,
                                                 unsigned long long class_start, unsigned long long n) {
    bool in_tile = t != ignore_index && t >= (long long)class_start && t < (long long)(class_start + n);
    return in_tile ? t - (long long)class_start : -1;
}

// One thread's share of a tile's row x[0..n): every step-th element (or pack, or pair) from
// `first`, folded online into its (max m, Σ exp(x − m) s) pair and summed into total, in 16-byte
// packs where the tile allows (packed), else in pairs (paired), else one by one.
template <typename T, typename C>
__device__ __forceinline__ void tile_row_share(const T* x, unsigned long long n, unsigned first, unsigned step,
                                               bool packed, bool paired, C& m, C& s, C& total) {
    if (packed) {
        // A pack at a time, without branches: the pack's maximum joins the running one, then
        // one rescale and one exponential per value (an all −∞ pack adds nothing).
        constexpr int N = Pack<T>::N;
#pragma unroll 2
        for (unsigned long long j = (unsigned long long)first * N; j < n; j += (unsigned long long)step * N) {
            C v[N];
            ld_pack(x + j, v);
            C most = v[0];
#pragma unroll
            for (int i = 0; i < N; ++i) { most = fmax(most, v[i]); total += v[i]; }
            const C next = fmax(m, most), base = next == (C)-INFINITY ? (C)0 : next;
            C added = 0;
#pragma unroll
            for (int i = 0; i < N; ++i) added += exp_acc(v[i] - base);
            s = s * exp_acc(m - base) + added;
            m = next;
        }
    } else if (paired) {
        // The pair's two halves in two independent online chains, merged at the end: half the
        // dependent latency of one chain.
        C m2 = (C)-INFINITY, s2 = 0;
#pragma unroll 4
        for (unsigned long long j = 2ull * first; j < n; j += 2ull * step) {
            auto v = ld2(x + j);
            lse_push((C)v.x, m, s, total);
            lse_push((C)v.y, m2, s2, total);
        }
        lse_merge(m, s, m2, s2);
    } else {
        thread_lse(x, n, first, step, m, s, total);
    }
}

// A row's (max m, Σ exp s) pair and sum over the tile merged into the row's running pair
// (row_max, row_sum) and sum, and the target's logit written when the tile holds it.
template <typename T, typename S, typename C>
__device__ __forceinline__ void tile_row_fold(const T* x, unsigned long long r, unsigned long long n,
                                              unsigned long long class_start, const long long* target,
                                              unsigned long long target_stride, long long ignore_index,
                                              C m, C s, C total, S* row_max, S* row_sum, S* target_logit,
                                              S* logit_sum) {
    C running_m = (C)row_max[r], running_s = (C)row_sum[r];
    lse_merge(running_m, running_s, m, s);
    row_max[r] = (S)running_m;
    row_sum[r] = (S)running_s;
    long long column = tile_column(target[r * target_stride], ignore_index, class_start, n);
    if (column >= 0) target_logit[r] = (S)ld(x + column);
    if (logit_sum != nullptr) logit_sum[r] = (S)((C)logit_sum[r] + total);
}

// One tile of a chunked cross-entropy's forward (`CrossEntropyTile`): one warp a row of the
// dense tile [rows, n] (classes class_start..class_start + n; a tile's rows are a few thousand
// logits, too short to pay for a block's barriers), one pass over it (tile_row_share). The
// tile's (max, Σ exp) pair, built online as `ce_rows` builds a row's, is merged into the row's
// running pair (row_max, row_sum); the target's logit is written when it falls in the tile;
// `logit_sum` (may be null) gains the row's sum. Statistics are S (float; double for f64 logits).
template <typename T, typename S>
__device__ void ce_tile(const T* logits, unsigned long long n, unsigned long long class_start,
                        const long long* target, unsigned long long target_stride, long long ignore_index,
                        S* row_max, S* row_sum, S* target_logit, S* logit_sum, unsigned long long rows) {
    typedef typename Acc<S>::type C;
    const unsigned lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const bool packed = packs(logits, n), paired = pairs(logits, n);
    for (unsigned long long r = (unsigned long long)blockIdx.x * warps + threadIdx.x / 32; r < rows;
         r += (unsigned long long)gridDim.x * warps) {
        const T* x = logits + r * n;
        C m = (C)-INFINITY, s = 0, total = 0;
        tile_row_share(x, n, lane, 32, packed, paired, m, s, total);
        warp_lse(m, s);
        if (logit_sum != nullptr)
            for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffff, total, o);
        if (lane == 0)
            tile_row_fold(x, r, n, class_start, target, target_stride, ignore_index, m, s, total, row_max,
                          row_sum, target_logit, logit_sum);
    }
}

// `ce_tile` for tiles of few, long rows (a block of whole rows of a large vocabulary: the
// Python wheel's float32 loss computes its gradients in the forward from such blocks): one
// block a row, the threads' pairs merged across the block as `ce_rows` merges them. One warp a
// row left such tiles waiting on each warp's loads: 314 rows of 50,264 f32 logits took 0.19 ms a
// tile at 190e3f5, against 16 µs for their bytes at the copy ceiling.
template <typename T, typename S>
__device__ void ce_tile_wide(const T* logits, unsigned long long n, unsigned long long class_start,
                             const long long* target, unsigned long long target_stride, long long ignore_index,
                             S* row_max, S* row_sum, S* target_logit, S* logit_sum, unsigned long long rows) {
    typedef typename Acc<S>::type C;
    __shared__ C scratch_m[THREADS / 32], scratch_s[THREADS / 32], scratch_total[THREADS / 32];
    const bool packed = packs(logits, n), paired = pairs(logits, n);
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* x = logits + r * n;
        C m = (C)-INFINITY, s = 0, total = 0;
        tile_row_share(x, n, threadIdx.x, blockDim.x, packed, paired, m, s, total);
        block_lse(m, s, scratch_m, scratch_s);
        if (logit_sum != nullptr) total = block_sum(total, scratch_total);
        if (threadIdx.x == 0)
            tile_row_fold(x, r, n, class_start, target, target_stride, ignore_index, m, s, total, row_max,
                          row_sum, target_logit, logit_sum);
    }
}

// One tile of a chunked cross-entropy's backward (`CrossEntropyTileBackward`), in place: one
// block a row, read and written in 16-byte packs where the width allows, x ← exp(x − lse)·scale − factor·(ε/classes + (1 − ε)·[class == target]), computed
// in S and rounded once into T.
template <typename T, typename S>
__device__ void ce_tile_backward(T* logits, unsigned long long n, unsigned long long class_start,
                                 const long long* target, unsigned long long target_stride, long long ignore_index,
                                 unsigned long long classes, double smoothing, const S* lse, const S* scale,
                                 const S* factor, unsigned long long rows) {
    typedef typename Acc<S>::type C;
    const C uniform = (C)(smoothing / (double)classes), keep = (C)(1.0 - smoothing);
    const bool packed = packs(logits, n), paired = pairs(logits, n);
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        T* x = logits + r * n;
        const C l = (C)lse[r], sc = (C)scale[r], f = (C)factor[r];
        const C off = f * uniform, hit = f * (uniform + keep);
        long long column = tile_column(target[r * target_stride], ignore_index, class_start, n);
        if (packed) {
            constexpr int N = Pack<T>::N;
#pragma unroll 2
            for (unsigned long long j = (unsigned long long)threadIdx.x * N; j < n; j += (unsigned long long)blockDim.x * N) {
                C v[N];
                ld_pack(x + j, v);
#pragma unroll
                for (int i = 0; i < N; ++i)
                    v[i] = exp_acc(v[i] - l) * sc - ((long long)j + i == column ? hit : off);
                st_pack(x + j, v);
            }
        } else if (paired) {
#pragma unroll 4
            for (unsigned long long j = 2 * threadIdx.x; j < n; j += 2 * blockDim.x) {
                auto v = ld2(x + j);
                C a = exp_acc((C)v.x - l) * sc - ((long long)j == column ? hit : off);
                C b = exp_acc((C)v.y - l) * sc - ((long long)j + 1 == column ? hit : off);
                st2(x + j, a, b);
            }
        } else {
#pragma unroll 4
            for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
                C p = exp_acc((C)ld(x + j) - l);
                st(x + j, p * sc - ((long long)j == column ? hit : off));
            }
        }
    }
}

// Dropout: operands 0 = out (dense; its row-major index keys the random stream), 1 = x.
template <typename T>
__device__ void dropout_kernel(const T* x, T* out, unsigned char* mask, double p, unsigned long long seed,
                               unsigned long long offset, StridedArgs a) {
    typedef typename Acc<T>::type C;
    C scale = p < 1.0 ? (C)(1.0 / (1.0 - p)) : (C)0;
    unsigned long long seeded = counter_stream(seed);
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        double u = (double)counter_bits24(seeded, offset + i) / (double)(1ULL << 24);
        bool keep = u >= p;
        st(out + i, keep ? ld(x + off[1]) * scale : (C)0);
        mask[i] = keep ? 1 : 0;
    }
}

// Random fill (autograd-core's RandomDraw::value, random.rs): the same f64 operations in the same
// order, each rounded as on the host (the _rn intrinsics keep nvcc from contracting into FMAs);
// the normal's log and cos are CUDA's (within 1 and 2 ulp), the host's libm's there. The value is
// stored by elements.cuh's `st`, rounded to nearest from the double (CUDA's __double2bfloat16
// rounds to odd in f32 first, as ops-cpu does), so the bits are the CPU's.
#define RANDOM_TAU 6.283185307179586

__device__ __forceinline__ double random_value(int normal, double a, double b, unsigned long long stream,
                                               unsigned long long offset, unsigned long long i) {
    const double unit = 1.0 / (double)(1ULL << 24);  // exact: the uniform is bits · 2^-24
    if (normal) {
        const double u1 = __dsub_rn(1.0, __dmul_rn((double)counter_bits24(stream, offset + 2 * i), unit));
        const double u2 = __dmul_rn((double)counter_bits24(stream, offset + 2 * i + 1), unit);
        const double radius = __dsqrt_rn(__dmul_rn(-2.0, log(u1)));
        return __dadd_rn(a, __dmul_rn(__dmul_rn(b, radius), cos(__dmul_rn(RANDOM_TAU, u2))));
    }
    const double u = __dmul_rn((double)counter_bits24(stream, offset + i), unit);
    return __dadd_rn(a, __dmul_rn(__dsub_rn(b, a), u));
}

// Operands: 0 = out. Element i (row-major) is the draw's value i; (a, b) are (low, high) or
// (mean, std).
template <typename T>
__device__ void random_kernel(T* out, int normal, double a, double b, unsigned long long seed,
                              unsigned long long offset, StridedArgs args) {
    const unsigned long long stream = counter_stream(seed);
    GRID_STRIDE_LOOP(i, args.numel) {
        unsigned long long off[3];
        element_offsets(args, i, off);
        st(out + off[0], random_value(normal, a, b, stream, offset, i));
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
    }                                                                                                            \
    extern "C" __global__ void random_##N(T* out, int normal, double a, double b, unsigned long long seed,      \
                                          unsigned long long offset, StridedArgs args) {                         \
        random_kernel<T>(out, normal, a, b, seed, offset, args);                                                \
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

// The forward tile's launch bounds hold it to 32 registers, eight blocks an SM: the Llama-3.2-1B
// head's 8192-row tiles (1024 blocks of 8 rows) then run in one wave (ncu at 9490a50: 40
// registers, 6 blocks an SM, 1.3 waves, 55% of the warps active).
#define CE_TILE_KERNELS(T, S, N)                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, 8) ce_tile_##N(const T* logits, unsigned long long n, unsigned long long cs,         \
                                           const long long* target, unsigned long long ts, long long ignore,      \
                                           S* row_max, S* row_sum, S* target_logit, S* logit_sum,                \
                                           unsigned long long rows) {                                            \
        ce_tile<T, S>(logits, n, cs, target, ts, ignore, row_max, row_sum, target_logit, logit_sum, rows);      \
    }                                                                                                            \
    extern "C" __global__ void ce_tile_wide_##N(const T* logits, unsigned long long n, unsigned long long cs,    \
                                                const long long* target, unsigned long long ts, long long ignore, \
                                                S* row_max, S* row_sum, S* target_logit, S* logit_sum,           \
                                                unsigned long long rows) {                                       \
        ce_tile_wide<T, S>(logits, n, cs, target, ts, ignore, row_max, row_sum, target_logit, logit_sum, rows); \
    }                                                                                                            \
    extern "C" __global__ void ce_tile_backward_##N(T* logits, unsigned long long n, unsigned long long cs,      \
                                                    const long long* target, unsigned long long ts,              \
                                                    long long ignore, unsigned long long classes,                \
                                                    double smoothing, const S* lse, const S* scale,              \
                                                    const S* factor, unsigned long long rows) {                  \
        ce_tile_backward<T, S>(logits, n, cs, target, ts, ignore, classes, smoothing, lse, scale, factor, rows); \
    }
CE_TILE_KERNELS(float, float, f32)
CE_TILE_KERNELS(double, double, f64)
CE_TILE_KERNELS(__half, float, f16)
CE_TILE_KERNELS(__nv_bfloat16, float, bf16)

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
