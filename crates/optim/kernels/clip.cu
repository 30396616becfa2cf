// Gradient clipping on the GPU: torch.nn.utils.clip_grad_norm_ and clip_grad_value_ over many
// gradients per launch through a piece table (see optim.cuh), for f32, bf16 and f16 gradients
// (`_f32`, `_bf16`, `_f16`; arithmetic in float, each stored value rounded once).
//
// clip_grad_norm_ is three launches whatever the number of tensors, and no host synchronisation:
// 1. clip_partials: block b reduces its `block_elems` elements of one gradient — the sum of
//    squares in f64 (norm 2) or the largest magnitude (norm inf, NaN propagating) — in a fixed
//    tree, into partials[b];
// 2. clip_finish (one block): each gradient's norm from its partials in block order (f64, rounded
//    to f32 as PyTorch's CPU norm is), then the total — the norm of the norms, the squares of the
//    f32 norms summed in f64 in tensor order — and the clamped coefficient, both to device memory;
// 3. clip_scale: every gradient element times the coefficient read from device memory.
// The float operations are those of crates/optim/src/clip.rs (its host side), so the two agree
// to the bit except where an f64 sum summed in another order rounds to another f32 (an ulp).
// Launch side: crates/optim/src/cuda/clip.rs. Built to PTX by `cargo xtask build-kernels`.

#include "optim.cuh"

#define CLIP_THREADS 256
#define CLIP_NORM_2 0
#define CLIP_NORM_INF 1

// The larger of two magnitudes, NaN from either side (torch's max reduction propagates NaN).
__device__ __forceinline__ double clip_max(double a, double b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
}

// How two partial results combine: a sum (norm 2) or a maximum (norm inf).
__device__ __forceinline__ double clip_combine(double a, double b, int norm_type) {
    return norm_type == CLIP_NORM_2 ? a + b : clip_max(a, b);
}

// One element's contribution: its square (norm 2) or its magnitude (norm inf).
__device__ __forceinline__ double clip_term(double acc, float x, int norm_type) {
    double v = (double)x;
    return norm_type == CLIP_NORM_2 ? fma(v, v, acc) : clip_max(acc, fabs(v));
}

// The block's values combined in a fixed tree.
__device__ double clip_block_reduce(double v, int norm_type) {
    __shared__ double s[CLIP_THREADS];
    s[threadIdx.x] = v;
    __syncthreads();
    for (unsigned o = CLIP_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) s[threadIdx.x] = clip_combine(s[threadIdx.x], s[threadIdx.x + o], norm_type);
        __syncthreads();
    }
    return s[0];
}

// partials[block_base + b] = the reduction of block b's elements (blocks are numbered across every
// piece of the table, `block_base` being the first block of this launch's pieces).
template <typename T>
__device__ __forceinline__ void clip_partials(const GradPiece* pieces, unsigned n_pieces, unsigned long long block_elems,
                                              unsigned long long block_base, int norm_type, double* partials) {
    unsigned long long block = block_base + blockIdx.x;
    T* g;
    unsigned long long n = grad_block(pieces, n_pieces, block_elems, block, &g);
    double acc = 0.0;
    read_each<CLIP_THREADS>(g, n, [&](float x) { acc = clip_term(acc, x, norm_type); });
    double r = clip_block_reduce(acc, norm_type);
    if (threadIdx.x == 0) partials[block] = r;
}
INSTANCES(__launch_bounds__(CLIP_THREADS), clip_partials,
          (const GradPiece* pieces, unsigned n_pieces, unsigned long long block_elems, unsigned long long block_base,
           int norm_type, double* partials),
          (pieces, n_pieces, block_elems, block_base, norm_type, partials))

// PyTorch's `clip_coef = max_norm / (total_norm + 1e-6)` in float (`max_norm / t` is
// `t.reciprocal() * max_norm` for a tensor t), clamped to at most 1 (NaN stays NaN).
__device__ __forceinline__ float clip_coef(float max_norm, float total) {
    float coef = __fmul_rn(__frcp_rn(__fadd_rn(total, 1e-6f)), max_norm);
    return coef > 1.0f ? 1.0f : coef;
}

// One block of CLIP_THREADS: piece_norms[p] = piece p's norm (squared, for norm 2), from its
// partials in block order; then thread 0 combines them in piece order into *total and the clamped
// coefficient *coef. `n_blocks` is the table's number of blocks (the last piece's end).
extern "C" __global__ void __launch_bounds__(CLIP_THREADS)
clip_finish(const GradPiece* pieces, unsigned n_pieces, unsigned long long n_blocks, int norm_type, float max_norm,
            const double* partials, double* piece_norms, float* total, float* coef) {
    for (unsigned p = threadIdx.x; p < n_pieces; p += CLIP_THREADS) {
        unsigned long long first = pieces[p].head.first_block;
        unsigned long long end = p + 1 < n_pieces ? pieces[p + 1].head.first_block : n_blocks;
        double acc = 0.0;
        for (unsigned long long b = first; b < end; ++b) acc = clip_combine(acc, partials[b], norm_type);
        if (norm_type == CLIP_NORM_2) {
            double norm = (double)(float)sqrt(acc);
            piece_norms[p] = norm * norm;
        } else {
            piece_norms[p] = acc;
        }
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    double acc = 0.0;
    for (unsigned p = 0; p < n_pieces; ++p) acc = clip_combine(acc, piece_norms[p], norm_type);
    float t = norm_type == CLIP_NORM_2 ? (float)sqrt(acc) : (float)acc;
    *total = t;
    *coef = clip_coef(max_norm, t);
}

// Every element of the launch's pieces times *coef, in float, rounded to T.
template <typename T>
__device__ __forceinline__ void clip_scale(const GradPiece* pieces, unsigned n_pieces, unsigned long long block_elems,
                                           unsigned long long block_base, const float* coef) {
    T* g;
    unsigned long long n = grad_block(pieces, n_pieces, block_elems, block_base + blockIdx.x, &g);
    float c = *coef;
    pass_apply(g, g, 0, 0, n, [&](float x, float, float) { return __fmul_rn(x, c); });
}
INSTANCES(__launch_bounds__(CLIP_THREADS), clip_scale,
          (const GradPiece* pieces, unsigned n_pieces, unsigned long long block_elems, unsigned long long block_base,
           const float* coef),
          (pieces, n_pieces, block_elems, block_base, coef))

// clip_grad_value_: every element clamped to [lo, hi] (the bounds already rounded to T, as
// PyTorch converts a clamp's scalar bounds to the tensor's type), NaN staying NaN.
template <typename T>
__device__ __forceinline__ void clip_value(const GradPiece* pieces, unsigned n_pieces, unsigned long long block_elems,
                                           unsigned long long block_base, float lo, float hi) {
    T* g;
    unsigned long long n = grad_block(pieces, n_pieces, block_elems, block_base + blockIdx.x, &g);
    pass_apply(g, g, 0, 0, n, [&](float x, float, float) { return x != x ? x : fminf(fmaxf(x, lo), hi); });
}
INSTANCES(__launch_bounds__(CLIP_THREADS), clip_value,
          (const GradPiece* pieces, unsigned n_pieces, unsigned long long block_elems, unsigned long long block_base,
           float lo, float hi),
          (pieces, n_pieces, block_elems, block_base, lo, hi))
