// SGD with momentum, dampening, Nesterov and weight decay on the GPU: the fused update and the
// foreach passes of PyTorch's _multi_tensor_sgd, many tensors per launch through a piece table
// (see optim.cuh). The float operations are those of crates/optim/src/kernels/sgd.rs in the same
// order, with explicit rounding, so CPU and GPU agree to the bit. Launch side:
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

extern "C" __global__ void sgd_fused_f32(const SgdPiece* pieces, unsigned n_pieces, unsigned long long block_elems,
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
    float* p = (float*)pc.param + start;
    const float* g = (const float*)pc.grad + start;
    float* b = pc.momentum_buffer ? (float*)pc.momentum_buffer + start : 0;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        float x = g[i];
        if (scaled) x = __fdiv_rn(x, scale);
        if (flags & FLAG_MAXIMIZE) x = -x;
        float pv = p[i];
        if (flags & FLAG_L2) x = fmaf(pc.weight_decay, pv, x);
        if (flags & FLAG_MOMENTUM) {
            float bv;
            if (first) {
                bv = x;
            } else {
                bv = __fadd_rn(__fmul_rn(b[i], pc.momentum), __fmul_rn(pc.one_minus_dampening, x));
            }
            b[i] = bv;
            x = (flags & FLAG_NESTEROV) ? fmaf(pc.momentum, bv, x) : bv;
        }
        p[i] = fmaf(pc.neg_lr, x, pv);
    }
}

#define SGD_GRAD 0     // tmp = -g (maximize); tmp = tmp + wd·p
#define SGD_BUF 1      // first step: buf = tmp; else buf = buf·μ
#define SGD_BUF_ADD 2  // not the first step: buf = buf + (1-τ)·tmp
#define SGD_USE_BUF 3  // tmp = tmp + μ·buf (Nesterov) or buf
#define SGD_PARAM 4    // p = p + (-lr)·tmp

extern "C" __global__ void __launch_bounds__(256, 4) sgd_pass_f32(const SgdPiece* pieces, unsigned n_pieces, unsigned long long block_elems, int op) {
    const SgdPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    unsigned flags = pc.flags;
    bool first = first_step(pc);
    float mu = pc.momentum, omd = pc.one_minus_dampening, wd = pc.weight_decay, neg_lr = pc.neg_lr;
    float* p = (float*)pc.param + start;
    const float* g = (const float*)pc.grad + start;
    float* b = pc.momentum_buffer ? (float*)pc.momentum_buffer + start : 0;
    float* t = (float*)pc.tmp + start;
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
