// A GradScaler's overflow check on the GPU: PyTorch's `_amp_foreach_non_finite_check_and_unscale_`
// over many gradients per launch through a piece table (see optim.cuh), for f32, bf16 and f16
// gradients (`_f32`, `_bf16`, `_f16`).
//
// non_finite_check: block b reads its `block_elems` elements of one gradient; when one of them is
// NaN or infinite, the block writes 1.0f to *found_inf (every writer writes the same value, and
// nothing ever clears it, so launches accumulate into one flag). With `inv_scale` given, every
// element is also multiplied by *inv_scale in float and rounded once to its type (non-finite
// elements too, as PyTorch does), in the same pass. One launch per element type present, whatever
// the number of gradients; nothing is read back to the host.
// Launch side: crates/optim/src/cuda/grad_scale.rs. Built to PTX by `cargo xtask build-kernels`.

#include "optim.cuh"

#define CHECK_THREADS 256

template <typename T>
__device__ __forceinline__ void non_finite_check(const GradPiece* pieces, unsigned n_pieces,
                                                 unsigned long long block_elems, unsigned long long block_base,
                                                 float* found_inf, const float* inv_scale) {
    T* g;
    unsigned long long n = grad_block(pieces, n_pieces, block_elems, block_base + blockIdx.x, &g);
    bool bad = false;
    if (inv_scale) {
        float s = *inv_scale;
        pass_apply(g, g, 0, 0, n, [&](float x, float, float) {
            bad |= !isfinite(x);
            return __fmul_rn(x, s);
        });
    } else {
        read_each<CHECK_THREADS>(g, n, [&](float x) { bad |= !isfinite(x); });
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}
INSTANCES(__launch_bounds__(CHECK_THREADS), non_finite_check,
          (const GradPiece* pieces, unsigned n_pieces, unsigned long long block_elems, unsigned long long block_base,
           float* found_inf, const float* inv_scale),
          (pieces, n_pieces, block_elems, block_base, found_inf, inv_scale))
