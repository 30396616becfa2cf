// SGD with momentum, dampening, Nesterov and weight decay on the GPU: the fused update and the
// foreach passes of PyTorch's _multi_tensor_sgd, many tensors per launch through a piece table
// (see optim.cuh), each for f32, bf16 and f16 parameters (`_f32`, `_bf16`, `_f16`; states of the
// parameter's type, arithmetic in float). The float operations are those of
// crates/optim/src/kernels/sgd.rs in the same order, with explicit rounding, so CPU and GPU agree
// to the bit. Launch side:
// crates/optim/src/cuda/sgd.rs. Built to PTX by `cargo xtask build-kernels`.

#include "optim.cuh"

struct SgdPiece {
    PieceHead head;
    unsigned long long param, grad, momentum_buffer, tmp;  // 0: none
    unsigned int flags;
    float weight_decay, momentum, one_minus_dampening, neg_lr, grad_scale;
};
static_assert(sizeof(SgdPiece) == 88, "SgdPiece layout");

// Whether the momentum buffer starts from the gradient (the parameter's first real step).
__device__ __forceinline__ bool first_step(const SgdPiece& pc) { return true_step(pc.head) == 1; }

// Fused: block b updates `block_elems` elements of its piece in one pass, in float; the momentum
// buffer is stored (rounded to T) before the update reads it back, as PyTorch's fused SGD does.
template <typename T>
__device__ __forceinline__ void sgd_fused(const SgdPiece* pieces, unsigned n_pieces, unsigned long long block_elems,
                                          const float* grad_scale, const float* found_inf) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    const SgdPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    float scale;
    bool scaled = grad_scale_of(grad_scale, pc.flags, pc.grad_scale, &scale);
    bool first = first_step(pc);
    unsigned flags = pc.flags;
    T* p = (T*)pc.param + start;
    const T* g = (const T*)pc.grad + start;
    T* b = pc.momentum_buffer ? (T*)pc.momentum_buffer + start : 0;
    // One element's update from its loaded values; the buffer's new value is returned rounded
    // to T (what is stored and what the update read back).
    auto element = [&](float x, float pv, float* bv) {
        if (scaled) x = __fdiv_rn(x, scale);
        if (flags & FLAG_MAXIMIZE) x = -x;
        if (flags & FLAG_L2) x = fmaf(pc.weight_decay, pv, x);
        if (flags & FLAG_MOMENTUM) {
            float nb = first ? x
                             : __fadd_rn(__fmul_rn(*bv, pc.momentum), __fmul_rn(pc.one_minus_dampening, x));
            nb = to_f32(from_f32<T>(nb));
            *bv = nb;
            x = (flags & FLAG_NESTEROV) ? fmaf(pc.momentum, nb, x) : nb;
        }
        return fmaf(pc.neg_lr, x, pv);
    };
    unsigned long long done = 0;
    unsigned long long addresses = (unsigned long long)p | (unsigned long long)g | (unsigned long long)b;
    if ((addresses & (4 * sizeof(T) - 1)) == 0) {
        // Four elements a thread at a time (16 bytes an f32 array, 8 a bf16/f16 one).
        unsigned long long n4 = n / 4;
        for (unsigned long long i = threadIdx.x; i < n4; i += blockDim.x) {
            float pp[4], gg[4], bb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            load4(p, i, pp);
            load4(g, i, gg);
            if (b && !first) load4(b, i, bb);
#pragma unroll
            for (unsigned k = 0; k < 4; ++k) pp[k] = element(gg[k], pp[k], &bb[k]);
            if (b) store4(b, i, bb);
            store4(p, i, pp);
        }
        done = n4 * 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        float bv = (b && !first) ? to_f32(b[i]) : 0.0f;
        float pv = element(to_f32(g[i]), to_f32(p[i]), &bv);
        if (b) b[i] = from_f32<T>(bv);
        p[i] = from_f32<T>(pv);
    }
}
INSTANCES(, sgd_fused,
          (const SgdPiece* pieces, unsigned n_pieces, unsigned long long block_elems, const float* grad_scale, const float* found_inf),
          (pieces, n_pieces, block_elems, grad_scale, found_inf))

#define SGD_GRAD 0     // tmp = -g (maximize); tmp = tmp + wd·p
#define SGD_BUF 1      // first step: buf = tmp; else buf = buf·μ
#define SGD_BUF_ADD 2  // not the first step: buf = buf + (1-τ)·tmp
#define SGD_USE_BUF 3  // tmp = tmp + μ·buf (Nesterov) or buf
#define SGD_PARAM 4    // p = p + (-lr)·tmp

// One foreach op over every piece of a chunk, each result rounded to T (the temporary is of T, as
// PyTorch's foreach temporaries are of the parameter's dtype).
template <typename T>
__device__ __forceinline__ void sgd_pass(const SgdPiece* pieces, unsigned n_pieces, unsigned long long block_elems, int op) {
    const SgdPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    unsigned flags = pc.flags;
    bool first = first_step(pc);
    float mu = pc.momentum, omd = pc.one_minus_dampening, wd = pc.weight_decay, neg_lr = pc.neg_lr;
    T* p = (T*)pc.param + start;
    const T* g = (const T*)pc.grad + start;
    T* b = pc.momentum_buffer ? (T*)pc.momentum_buffer + start : 0;
    T* t = (T*)pc.tmp + start;
    switch (op) {
    case SGD_GRAD:
        pass_apply(t, g, p, 0, n, [&](float x, float pv, float) {
            if (flags & FLAG_MAXIMIZE) x = -x;
            return (flags & FLAG_L2) ? fmaf(wd, pv, x) : x;
        });
        break;
    case SGD_BUF:
        if (first) {
            pass_apply(b, t, 0, 0, n, [&](float x, float, float) { return x; });
        } else {
            pass_apply(b, b, 0, 0, n, [&](float bv, float, float) { return __fmul_rn(bv, mu); });
        }
        break;
    case SGD_BUF_ADD:
        if (first) return;
        pass_apply(b, b, t, 0, n, [&](float bv, float x, float) { return __fadd_rn(bv, __fmul_rn(omd, x)); });
        break;
    case SGD_USE_BUF:
        pass_apply(t, t, b, 0, n, [&](float x, float bv, float) {
            return (flags & FLAG_NESTEROV) ? fmaf(mu, bv, x) : bv;
        });
        break;
    case SGD_PARAM:
        pass_apply(p, p, t, 0, n, [&](float pv, float x, float) { return fmaf(neg_lr, x, pv); });
        break;
    }
}
INSTANCES(__launch_bounds__(256, 4), sgd_pass,
          (const SgdPiece* pieces, unsigned n_pieces, unsigned long long block_elems, int op),
          (pieces, n_pieces, block_elems, op))
