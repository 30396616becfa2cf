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

#define PASS_LOOP(BODY)                                                              \
    for (unsigned long long i0 = threadIdx.x; i0 < n; i0 += 4ull * blockDim.x) {    \
        _Pragma("unroll") for (unsigned u = 0; u < 4; ++u) {                         \
            unsigned long long i = i0 + (unsigned long long)u * blockDim.x;          \
            if (i < n) { BODY; }                                                     \
        }                                                                            \
    }

extern "C" __global__ void sgd_pass_f32(const SgdPiece* pieces, unsigned n_pieces, unsigned long long block_elems, int op) {
    const SgdPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    unsigned flags = pc.flags;
    bool first = first_step(pc);
    float* __restrict__ p = (float*)pc.param + start;
    const float* __restrict__ g = (const float*)pc.grad + start;
    float* __restrict__ b = pc.momentum_buffer ? (float*)pc.momentum_buffer + start : 0;
    float* __restrict__ t = (float*)pc.tmp + start;
    switch (op) {
    case SGD_GRAD:
        PASS_LOOP(float x = g[i]; if (flags & FLAG_MAXIMIZE) x = -x;
                  if (flags & FLAG_L2) x = fmaf(pc.weight_decay, p[i], x); t[i] = x)
        break;
    case SGD_BUF:
        if (first) {
            PASS_LOOP(b[i] = t[i])
        } else {
            PASS_LOOP(b[i] = __fmul_rn(b[i], pc.momentum))
        }
        break;
    case SGD_BUF_ADD:
        if (first) return;
        PASS_LOOP(b[i] = __fadd_rn(b[i], __fmul_rn(pc.one_minus_dampening, t[i])))
        break;
    case SGD_USE_BUF:
        if (flags & FLAG_NESTEROV) {
            PASS_LOOP(t[i] = fmaf(pc.momentum, b[i], t[i]))
        } else {
            PASS_LOOP(t[i] = b[i])
        }
        break;
    case SGD_PARAM:
        PASS_LOOP(p[i] = fmaf(pc.neg_lr, t[i], p[i]))
        break;
    }
}
