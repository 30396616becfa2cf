// Adafactor on the GPU, one parameter at a time (its step needs the parameter's and the
// update's norms), as the launch side crates/optim/src/cuda/adafactor.rs sequences it:
// parameter norm → decay → second moments (row and column means, or the full variance) → the
// update's norm → the parameter. The single form writes the update to a temporary between the
// last two; the fused form recomputes it.
//
// The float32 operations are those of crates/optim/src/kernels/adafactor.rs in the same order.
// Sums are f64 as on the CPU: a row, column or row-mean sum runs sequentially on one thread in
// the CPU's order (bit-identical); the two whole-tensor sums (parameter and update norms) are a
// fixed tree over blocks, whose f64 result can differ from the CPU's sequential sum in the last
// bits, so the f32 norm they give is within one ulp of the CPU's (in practice equal).
// Built to PTX by `cargo xtask build-kernels`.

#include "optim.cuh"

#define AF_THREADS 256

// Gradient flags.
#define AF_SCALED 1
#define AF_MAXIMIZE 2

// af_update modes.
#define AF_READ_U 1   // the update comes from u (single form), else it is recomputed
#define AF_WRITE_U 2  // write the update to u
#define AF_NORM 4     // sum its squares into partials
#define AF_APPLY 8    // p = p + value·u

__device__ __forceinline__ float af_grad(float g, float scale, int flags) {
    if (flags & AF_SCALED) g = __fdiv_rn(g, scale);
    return (flags & AF_MAXIMIZE) ? -g : g;
}

// Sum of the block's values, in a fixed order.
__device__ double block_sum(double v) {
    __shared__ double s[AF_THREADS];
    s[threadIdx.x] = v;
    __syncthreads();
    for (unsigned o = AF_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
        __syncthreads();
    }
    return s[0];
}

// partials[b] = Σ x² over block b's `block_elems` elements.
extern "C" __global__ void af_sum_squares(const float* x, unsigned long long n, unsigned long long block_elems,
                                          double* partials) {
    unsigned long long start = blockIdx.x * block_elems, end = min(start + block_elems, n);
    double acc = 0.0;
    for (unsigned long long i = start + threadIdx.x; i < end; i += AF_THREADS) acc += (double)x[i] * (double)x[i];
    double sum = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__device__ __forceinline__ float norm_of(const double* partials, unsigned n_partials) {
    double sum = 0.0;
    for (unsigned k = 0; k < n_partials; ++k) sum += partials[k];
    return (float)sqrt(sum);
}

// scalars[0] = α = max(eps2, RMS(θ))·ρ, from the parameter's partial sums of squares.
extern "C" __global__ void af_alpha(double* scalars, const double* partials, unsigned n_partials,
                                    unsigned long long numel, double eps2, double rho) {
    double rms = (double)norm_of(partials, n_partials) / sqrt((double)numel);
    scalars[0] = fmax(eps2, rms) * rho;
}

// scalars[1] = -α / max(1, RMS(U)/d) as the f32 `alpha=` of the final add.
extern "C" __global__ void af_value(double* scalars, const double* partials, unsigned n_partials,
                                    unsigned long long numel, double d) {
    double denom = fmax(1.0, (double)norm_of(partials, n_partials) / (sqrt((double)numel) * d));
    scalars[1] = (double)(float)(-scalars[0] / denom);
}

extern "C" __global__ void af_scale_param(float* p, unsigned long long n, float factor) {
    unsigned long long i = (unsigned long long)blockIdx.x * AF_THREADS + threadIdx.x;
    if (i < n) p[i] = __fmul_rn(p[i], factor);
}

// One thread per row r (of batch·rows): row_var[r] = lerp(row_var[r], ‖g_r‖²/cols, weight).
extern "C" __global__ void af_rows(const float* g, float* row_var, unsigned long long n_rows, unsigned long long cols,
                                   float weight, float scale, int flags) {
    unsigned long long r = (unsigned long long)blockIdx.x * AF_THREADS + threadIdx.x;
    if (r >= n_rows) return;
    const float* row = g + r * cols;
    double acc = 0.0;
    for (unsigned long long j = 0; j < cols; ++j) {
        double x = (double)af_grad(row[j], scale, flags);
        acc += x * x;
    }
    float norm = (float)sqrt(acc);
    float mean = __fdiv_rn(__fmul_rn(norm, norm), (float)cols);
    row_var[r] = lerp_pt(row_var[r], mean, weight);
}

// One thread per column (b, j): col_var[b·cols + j] = lerp(col_var, ‖g_{b,·,j}‖²/rows, weight).
extern "C" __global__ void af_cols(const float* g, float* col_var, unsigned long long batch, unsigned long long rows,
                                   unsigned long long cols, float weight, float scale, int flags) {
    unsigned long long k = (unsigned long long)blockIdx.x * AF_THREADS + threadIdx.x;
    if (k >= batch * cols) return;
    unsigned long long b = k / cols, j = k % cols;
    const float* mat = g + b * rows * cols;
    double acc = 0.0;
    for (unsigned long long i = 0; i < rows; ++i) {
        double x = (double)af_grad(mat[i * cols + j], scale, flags);
        acc += x * x;
    }
    float norm = (float)sqrt(acc);
    float mean = __fdiv_rn(__fmul_rn(norm, norm), (float)rows);
    col_var[k] = lerp_pt(col_var[k], mean, weight);
}

// One thread per batch entry: floors[b] = max(mean(row_var[b, ·]), eps1).
extern "C" __global__ void af_floors(const float* row_var, float* floors, unsigned long long batch,
                                     unsigned long long rows, float eps1) {
    unsigned long long b = (unsigned long long)blockIdx.x * AF_THREADS + threadIdx.x;
    if (b >= batch) return;
    double sum = 0.0;
    for (unsigned long long i = 0; i < rows; ++i) sum += (double)row_var[b * rows + i];
    floors[b] = fmaxf((float)(sum / (double)rows), eps1);
}

// Vectors: variance = lerp(variance, g·g, weight).
extern "C" __global__ void af_variance(const float* g, float* variance, unsigned long long n, float weight,
                                       float scale, int flags) {
    unsigned long long i = (unsigned long long)blockIdx.x * AF_THREADS + threadIdx.x;
    if (i >= n) return;
    float x = af_grad(g[i], scale, flags);
    variance[i] = lerp_pt(variance[i], __fmul_rn(x, x), weight);
}

// The update U = rsqrt(max(V, eps1²))·g, V = row_var·col_var/floor (factored: cols > 0) or the
// variance; per `mode` read or written, its squares summed per block, and applied.
extern "C" __global__ void af_update(int mode, const float* g, float* p, float* u, const float* row_var,
                                     const float* col_var, const float* floors, const float* variance,
                                     unsigned long long n, unsigned long long rows, unsigned long long cols,
                                     unsigned long long block_elems, float eps1_sq, float scale, int flags,
                                     double* partials, const double* scalars) {
    unsigned long long start = blockIdx.x * block_elems, end = min(start + block_elems, n);
    float value = (mode & AF_APPLY) ? (float)scalars[1] : 0.0f;
    double acc = 0.0;
    for (unsigned long long idx = start + threadIdx.x; idx < end; idx += AF_THREADS) {
        float x;
        if (mode & AF_READ_U) {
            x = u[idx];
        } else {
            float v;
            if (cols) {
                unsigned long long j = idx % cols, bi = idx / cols, b = bi / rows;
                v = __fdiv_rn(__fmul_rn(row_var[bi], col_var[b * cols + j]), floors[b]);
            } else {
                v = variance[idx];
            }
            x = __fmul_rn(__fdiv_rn(1.0f, __fsqrt_rn(fmaxf(v, eps1_sq))), af_grad(g[idx], scale, flags));
        }
        if (mode & AF_WRITE_U) u[idx] = x;
        if (mode & AF_NORM) acc += (double)x * (double)x;
        if (mode & AF_APPLY) p[idx] = fmaf(value, x, p[idx]);
    }
    if (mode & AF_NORM) {
        double sum = block_sum(acc);
        if (threadIdx.x == 0) partials[blockIdx.x] = sum;
    }
}
