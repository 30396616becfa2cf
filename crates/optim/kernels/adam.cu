// Adam / AdamW on the GPU: the fused update (one pass per element, every intermediate in
// registers) and the foreach passes (one op of PyTorch's _multi_tensor_adam per launch, over
// every piece of a chunk, the temporaries in the chunk's scratch). Both update many tensors per
// launch through a piece table (see optim.cuh), for f32, bf16 and f16 parameters (`_f32`,
// `_bf16`, `_f16`; states and temporaries of the parameter's type, arithmetic in float).
//
// The float operations are those of the CPU kernels in crates/optim/src/kernels/adam.rs, in the
// same order, with rounding made explicit (__f*_rn, fmaf) so the compiler cannot contract them
// differently: CPU and GPU results agree to the bit. Launch side: crates/optim/src/cuda/adam.rs.
// Built to PTX by `cargo xtask build-kernels`.

#include "optim.cuh"

struct AdamPiece {
    PieceHead head;
    unsigned long long param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, tmp;  // 0: none
    double lr, beta1, beta2;  // for the bias corrections after device-skipped steps
    unsigned int flags;
    float l2, decay_factor, one_minus_beta1, beta2f, one_minus_beta2, bias_correction2_sqrt, eps,
        neg_step_size, grad_scale;
};
static_assert(sizeof(AdamPiece) == 144, "AdamPiece layout");

struct AdamConsts {
    unsigned flags;
    float l2, decay_factor, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
};

// The piece's constants at its true step plus `replayed` (a CUDA graph's replay index: the
// table holds the first replay's step); after device-skipped steps or on a replay the two
// step-dependent ones are recomputed from that step as the host computes them (f64, then
// rounded to f32).
__device__ __forceinline__ AdamConsts adam_consts(const AdamPiece& pc, unsigned long long replayed = 0) {
    AdamConsts c;
    c.flags = pc.flags;
    c.l2 = pc.l2;
    c.decay_factor = pc.decay_factor;
    c.one_minus_beta1 = pc.one_minus_beta1;
    c.beta2 = pc.beta2f;
    c.one_minus_beta2 = pc.one_minus_beta2;
    c.bias_correction2_sqrt = pc.bias_correction2_sqrt;
    c.eps = pc.eps;
    c.neg_step_size = pc.neg_step_size;
    unsigned long long t = true_step(pc.head) + replayed;
    if (t != pc.head.step) {
        double bias_correction1 = 1.0 - pow(pc.beta1, (double)t);
        double bias_correction2 = 1.0 - pow(pc.beta2, (double)t);
        c.bias_correction2_sqrt = (float)sqrt(bias_correction2);
        c.neg_step_size = (float)(-(pc.lr / bias_correction1));
    }
    return c;
}

__device__ __forceinline__ void adam_element(const AdamConsts& c, bool scaled, float scale, float* p, float g,
                                             float* m, float* v, float* vmax) {
    if (scaled) g = __fdiv_rn(g, scale);
    if (c.flags & FLAG_MAXIMIZE) g = -g;
    float pv = *p;
    if (c.flags & FLAG_L2) g = fmaf(c.l2, pv, g);
    if (c.flags & FLAG_DECAY) pv = __fmul_rn(pv, c.decay_factor);
    float mv = lerp_pt(*m, g, c.one_minus_beta1);
    float vv = __fmul_rn(*v, c.beta2);
    vv = __fadd_rn(vv, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
    float second = vv;
    if (vmax) {
        second = maximum_pt(*vmax, vv);
        *vmax = second;
    }
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(second), c.bias_correction2_sqrt), c.eps);
    pv = __fadd_rn(pv, __fdiv_rn(__fmul_rn(c.neg_step_size, mv), denom));
    *p = pv;
    *m = mv;
    *v = vv;
}

// Fused: block b updates `block_elems` elements of its piece in one pass. Every value is loaded
// to float, the whole update runs in float, and p, m, v (and vmax) are each stored (rounded to
// T) once at the end, as PyTorch's fused Adam does for low-precision parameters. Inside a CUDA
// graph `replay_index` points at the replay's index (added to every piece's step), else it is
// null.
template <typename T>
__device__ __forceinline__ void adam_fused(const AdamPiece* pieces, unsigned n_pieces, unsigned long long block_elems,
                                           const float* grad_scale, const float* found_inf,
                                           const unsigned* replay_index) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    const AdamPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    const AdamConsts c = adam_consts(pc, replay_index ? *replay_index : 0);
    float scale;
    bool scaled = grad_scale_of(grad_scale, pc.flags, pc.grad_scale, &scale);
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    T* p = (T*)pc.param + start;
    const T* g = (const T*)pc.grad + start;
    T* m = (T*)pc.exp_avg + start;
    T* v = (T*)pc.exp_avg_sq + start;
    T* vm = pc.max_exp_avg_sq ? (T*)pc.max_exp_avg_sq + start : 0;
    bool aligned = (((unsigned long long)p | (unsigned long long)g | (unsigned long long)m | (unsigned long long)v) & (4 * sizeof(T) - 1)) == 0 && !vm;
    unsigned long long done = 0;
    if (aligned) {
        unsigned long long n4 = n / 4;
        unsigned long long i = threadIdx.x;
        // G groups of four a thread per pass: 4·G 16-byte loads in flight before the first
        // update, which a step that only streams memory needs to keep the bus busy.
        constexpr unsigned G = 4;
        for (; i + (G - 1) * blockDim.x < n4; i += G * blockDim.x) {
            float pp[4 * G], gg[4 * G], mm[4 * G], vv[4 * G];
#pragma unroll
            for (unsigned u = 0; u < G; ++u) load4(p, i + u * blockDim.x, pp + 4 * u);
#pragma unroll
            for (unsigned u = 0; u < G; ++u) load4(g, i + u * blockDim.x, gg + 4 * u);
#pragma unroll
            for (unsigned u = 0; u < G; ++u) load4(m, i + u * blockDim.x, mm + 4 * u);
#pragma unroll
            for (unsigned u = 0; u < G; ++u) load4(v, i + u * blockDim.x, vv + 4 * u);
#pragma unroll
            for (unsigned k = 0; k < 4 * G; ++k) adam_element(c, scaled, scale, &pp[k], gg[k], &mm[k], &vv[k], 0);
#pragma unroll
            for (unsigned u = 0; u < G; ++u) {
                store4(p, i + u * blockDim.x, pp + 4 * u);
                store4(m, i + u * blockDim.x, mm + 4 * u);
                store4(v, i + u * blockDim.x, vv + 4 * u);
            }
        }
        for (; i < n4; i += blockDim.x) {
            float pp[4], gg[4], mm[4], vv[4];
            load4(p, i, pp);
            load4(g, i, gg);
            load4(m, i, mm);
            load4(v, i, vv);
#pragma unroll
            for (unsigned k = 0; k < 4; ++k) adam_element(c, scaled, scale, &pp[k], gg[k], &mm[k], &vv[k], 0);
            store4(p, i, pp);
            store4(m, i, mm);
            store4(v, i, vv);
        }
        done = n4 * 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        float pv = to_f32(p[i]), mv = to_f32(m[i]), vv = to_f32(v[i]);
        if (vm) {
            float vmv = to_f32(vm[i]);
            adam_element(c, scaled, scale, &pv, to_f32(g[i]), &mv, &vv, &vmv);
            vm[i] = from_f32<T>(vmv);
        } else {
            adam_element(c, scaled, scale, &pv, to_f32(g[i]), &mv, &vv, 0);
        }
        p[i] = from_f32<T>(pv);
        m[i] = from_f32<T>(mv);
        v[i] = from_f32<T>(vv);
    }
}
INSTANCES(, adam_fused,
          (const AdamPiece* pieces, unsigned n_pieces, unsigned long long block_elems, const float* grad_scale, const float* found_inf,
           const unsigned* replay_index),
          (pieces, n_pieces, block_elems, grad_scale, found_inf, replay_index))

// PyTorch 2.11's own fused kernel (`torch.optim.Adam/AdamW(fused=True)`, ATen's
// fused_adam_utils.cuh), for callers that must agree with it to the bit rather than with the
// op-by-op Adam above: every hyperparameter rounded to float first, the bias corrections from
// the device's powf of the step as a float, the moments as two fmas each, the decays contracted
// into an fma (what nvcc emits for `param -= lr * weight_decay * param` and
// `grad += param * weight_decay`), and `param -= step_size * exp_avg / denom` in float. f32 only.
struct AdamTorchPiece {
    PieceHead head;
    unsigned long long param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq;  // 0: none
    unsigned int flags;
    float lr, beta1, beta2, weight_decay, eps;
};
static_assert(sizeof(AdamTorchPiece) == 96, "AdamTorchPiece layout");

// One element; `g` is the gradient already divided by the GradScaler's scale, if any.
__device__ __forceinline__ void adam_torch_element(const AdamTorchPiece& c, float step_size, float bias_correction2_sqrt,
                                                   float neg_lr_wd, float* p, float g, float* m, float* v, float* vmax) {
    if (c.flags & FLAG_MAXIMIZE) g = -g;
    float pv = *p;
    if (c.flags & FLAG_L2) g = __fmaf_rn(pv, c.weight_decay, g);
    if (c.flags & FLAG_DECAY) pv = __fmaf_rn(neg_lr_wd, pv, pv);
    float mv = __fmaf_rn(c.beta1, *m, __fmaf_rn(-c.beta1, g, g));
    float gg = __fmul_rn(g, g);
    float vv = __fmaf_rn(c.beta2, *v, __fmaf_rn(-c.beta2, gg, gg));
    float second = vv;
    if (vmax) {
        second = (*vmax < vv) ? vv : *vmax;  // std::max(max_exp_avg_sq, exp_avg_sq)
        *vmax = second;
    }
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(second), bias_correction2_sqrt), c.eps);
    *p = __fsub_rn(pv, __fdiv_rn(__fmul_rn(step_size, mv), denom));
    *m = mv;
    *v = vv;
}

extern "C" __global__ void adam_fused_torch_f32(const AdamTorchPiece* pieces, unsigned n_pieces,
                                                unsigned long long block_elems, const float* grad_scale,
                                                const float* found_inf) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    const AdamTorchPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    float step = (float)true_step(pc.head);
    float bias_correction1 = __fsub_rn(1.0f, powf(pc.beta1, step));
    float bias_correction2_sqrt = __fsqrt_rn(__fsub_rn(1.0f, powf(pc.beta2, step)));
    float step_size = __fdiv_rn(pc.lr, bias_correction1);
    float neg_lr_wd = -__fmul_rn(pc.lr, pc.weight_decay);
    // With a GradScaler's scale, the gradient is divided by it and stored back unscaled, as
    // PyTorch's fused step leaves it.
    const bool scaled = grad_scale != 0;
    const float scale = scaled ? *grad_scale : 1.0f;
    float* p = (float*)pc.param + start;
    float* g = (float*)pc.grad + start;
    float* m = (float*)pc.exp_avg + start;
    float* v = (float*)pc.exp_avg_sq + start;
    float* vm = pc.max_exp_avg_sq ? (float*)pc.max_exp_avg_sq + start : 0;
    unsigned long long done = 0;
    if (!vm && ((((unsigned long long)p | (unsigned long long)g | (unsigned long long)m | (unsigned long long)v) & 15) == 0)) {
        unsigned long long n4 = n / 4;
        for (unsigned long long i = threadIdx.x; i < n4; i += blockDim.x) {
            float pp[4], gg[4], mm[4], vv[4];
            load4(p, i, pp);
            load4(g, i, gg);
            load4(m, i, mm);
            load4(v, i, vv);
            if (scaled) {
#pragma unroll
                for (unsigned k = 0; k < 4; ++k) gg[k] = __fdiv_rn(gg[k], scale);
                store4(g, i, gg);
            }
#pragma unroll
            for (unsigned k = 0; k < 4; ++k)
                adam_torch_element(pc, step_size, bias_correction2_sqrt, neg_lr_wd, &pp[k], gg[k], &mm[k], &vv[k], 0);
            store4(p, i, pp);
            store4(m, i, mm);
            store4(v, i, vv);
        }
        done = n4 * 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        float pv = p[i], gv = g[i], mv = m[i], vv = v[i], vmv = vm ? vm[i] : 0.0f;
        if (scaled) {
            gv = __fdiv_rn(gv, scale);
            g[i] = gv;
        }
        adam_torch_element(pc, step_size, bias_correction2_sqrt, neg_lr_wd, &pv, gv, &mv, &vv, vm ? &vmv : 0);
        p[i] = pv;
        m[i] = mv;
        v[i] = vv;
        if (vm) vm[i] = vmv;
    }
}

// An AdamPiece whose parameter is bf16 (moments f32 or bf16), with the seed and the parameter's
// index that key its random stream.
struct AdamStochasticPiece : AdamPiece {
    unsigned long long seed, param_index;
};
static_assert(sizeof(AdamStochasticPiece) == 160, "AdamStochasticPiece layout");

// W consecutive elements at a time (W = 4 or 8, `runs` runs of them, the first at element
// `first` of the piece, a multiple of four) of adam_fused_stochastic: W / 4 groups of the stream,
// one hash each. The arrays are aligned to W elements of their type (4 x 8 bytes of bf16 in flight
// a thread at W = 4, twice that at W = 8).
template <typename M, int W>
__device__ __forceinline__ void adam_stochastic_runs(const AdamConsts& c, bool scaled, float scale,
                                                     unsigned long long key, unsigned long long first,
                                                     __nv_bfloat16* p, const __nv_bfloat16* g, M* m, M* v,
                                                     unsigned long long runs) {
    static_assert(W == 4 || W == 8, "runs of four or eight");
    for (unsigned long long i = threadIdx.x; i < runs; i += blockDim.x) {
        float pp[W], gg[W], mm[W], vv[W];
        if constexpr (W == 8) {
            load8(p, i, pp);
            load8(g, i, gg);
            load8(m, i, mm);
            load8(v, i, vv);
        } else {
            load4(p, i, pp);
            load4(g, i, gg);
            load4(m, i, mm);
            load4(v, i, vv);
        }
        unsigned s[W];
#pragma unroll
        for (unsigned q = 0; q < W / 4; ++q) {
            const unsigned long long group = stochastic_group(key, first / 4 + i * (W / 4) + q);
#pragma unroll
            for (unsigned k = 0; k < 4; ++k) {
                const unsigned e = 4 * q + k;
                adam_element(c, scaled, scale, &pp[e], gg[e], &mm[e], &vv[e], 0);
                s[e] = bits16(round_bf16_stochastic(pp[e], stochastic_bits_of(group, k)));
            }
        }
        if constexpr (W == 8) {
            ((uint4*)p)[i] = make_uint4(s[0] | (s[1] << 16), s[2] | (s[3] << 16), s[4] | (s[5] << 16),
                                        s[6] | (s[7] << 16));
            store8(m, i, mm);
            store8(v, i, vv);
        } else {
            ((uint2*)p)[i] = make_uint2(s[0] | (s[1] << 16), s[2] | (s[3] << 16));
            store4(m, i, mm);
            store4(v, i, vv);
        }
    }
}

// Fused Adam on bf16 parameters with moments of M (f32, or bf16 rounded to nearest-even as they
// are stored): the update of adam_fused in float from the moments before their rounding, the new
// parameter rounded stochastically, element i of a piece with stochastic_bits(key, i). Eight
// elements a thread at a time where every array is aligned to 16 bytes (twice the bytes in
// flight of four: measured on the H200, four left bf16 states at 3.3 TB/s), else four where they
// are aligned to four elements, then the rest one by one. A block's first element is a multiple
// of four (fused_block_elems, crates/optim/src/cuda/launch.rs, makes every block's elements a
// multiple of 4 x threads), so its runs are whole groups of the stream.
template <typename M>
__device__ __forceinline__ void adam_fused_stochastic(const AdamStochasticPiece* pieces, unsigned n_pieces,
                                                      unsigned long long block_elems, const float* grad_scale,
                                                      const float* found_inf) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    const AdamStochasticPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    const AdamConsts c = adam_consts(pc);
    float scale;
    bool scaled = grad_scale_of(grad_scale, pc.flags, pc.grad_scale, &scale);
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    unsigned long long key = stochastic_key(pc.seed, pc.param_index, true_step(pc.head));
    __nv_bfloat16* p = (__nv_bfloat16*)pc.param + start;
    const __nv_bfloat16* g = (const __nv_bfloat16*)pc.grad + start;
    M* m = (M*)pc.exp_avg + start;
    M* v = (M*)pc.exp_avg_sq + start;
    M* vm = pc.max_exp_avg_sq ? (M*)pc.max_exp_avg_sq + start : 0;
    unsigned long long done = 0;
    const unsigned long long addresses = (unsigned long long)p | (unsigned long long)g;
    const unsigned long long states = (unsigned long long)m | (unsigned long long)v;
    if (!vm && (addresses & 15) == 0 && (states & 15) == 0) {
        adam_stochastic_runs<M, 8>(c, scaled, scale, key, start, p, g, m, v, n / 8);
        done = n / 8 * 8;
    } else if (!vm && (addresses & 7) == 0 && (states & (4 * sizeof(M) - 1)) == 0) {
        adam_stochastic_runs<M, 4>(c, scaled, scale, key, start, p, g, m, v, n / 4);
        done = n / 4 * 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        float pv = to_f32(p[i]), mv = to_f32(m[i]), vv = to_f32(v[i]);
        if (vm) {
            float vmv = to_f32(vm[i]);
            adam_element(c, scaled, scale, &pv, to_f32(g[i]), &mv, &vv, &vmv);
            vm[i] = from_f32<M>(vmv);
        } else {
            adam_element(c, scaled, scale, &pv, to_f32(g[i]), &mv, &vv, 0);
        }
        p[i] = round_bf16_stochastic(pv, stochastic_bits(key, start + i));
        m[i] = from_f32<M>(mv);
        v[i] = from_f32<M>(vv);
    }
}
extern "C" __global__ void __launch_bounds__(512, 2) adam_fused_stochastic_bf16(const AdamStochasticPiece* pieces, unsigned n_pieces,
                                                      unsigned long long block_elems, const float* grad_scale,
                                                      const float* found_inf) {
    adam_fused_stochastic<float>(pieces, n_pieces, block_elems, grad_scale, found_inf);
}
extern "C" __global__ void __launch_bounds__(512, 2) adam_fused_stochastic_bf16_bf16_state(const AdamStochasticPiece* pieces,
                                                                 unsigned n_pieces, unsigned long long block_elems,
                                                                 const float* grad_scale, const float* found_inf) {
    adam_fused_stochastic<__nv_bfloat16>(pieces, n_pieces, block_elems, grad_scale, found_inf);
}

// The ops of the foreach and single-tensor paths (crates/optim/src/cuda/adam.rs launches them in
// an order that keeps each array's reuses close together for the L2; ops on different arrays
// commute, so every element sees the CPU's operations in the CPU's order).
#define ADAM_GRAD 0     // tmp = -g (maximize); tmp = tmp + wd·p (L2)
#define ADAM_DECAY 1    // p = p·(1 - lr·wd)
#define ADAM_LERP 2     // m = lerp(m, g, 1-β1)
#define ADAM_MUL_V 3    // v = v·β2
#define ADAM_ADDCMUL 4  // v = v + (1-β2)·g·g
#define ADAM_MAX 5      // vmax = maximum(vmax, v)
#define ADAM_SQRT 6     // tmp = sqrt(v or vmax)
#define ADAM_DIV 7      // tmp = tmp / sqrt(1-β2^t)
#define ADAM_ADD_EPS 8  // tmp = tmp + eps
#define ADAM_ADDCDIV 9  // p = p + (-lr/(1-β1^t))·m / tmp

// One foreach op over every piece of a chunk: block b covers `block_elems` elements of its piece;
// each result is rounded to T (the temporary is of T, as PyTorch's foreach temporaries are of the
// parameter's dtype).
template <typename T>
__device__ __forceinline__ void adam_pass(const AdamPiece* pieces, unsigned n_pieces, unsigned long long block_elems, int op) {
    const AdamPiece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    const AdamConsts c = adam_consts(pc);
    T* p = (T*)pc.param + start;
    const T* g = (const T*)pc.grad + start;
    T* m = (T*)pc.exp_avg + start;
    T* v = (T*)pc.exp_avg_sq + start;
    T* vm = pc.max_exp_avg_sq ? (T*)pc.max_exp_avg_sq + start : 0;
    T* t = (T*)pc.tmp + start;
    const T* gs = (c.flags & FLAG_CHANGES_GRAD) ? t : g;
    switch (op) {
    case ADAM_GRAD:
        if (!(c.flags & FLAG_CHANGES_GRAD)) return;
        pass_apply(t, g, p, 0, n, [&](float x, float pv, float) {
            if (c.flags & FLAG_MAXIMIZE) x = -x;
            return (c.flags & FLAG_L2) ? fmaf(c.l2, pv, x) : x;
        });
        break;
    case ADAM_DECAY:
        if (!(c.flags & FLAG_DECAY)) return;
        pass_apply(p, p, 0, 0, n, [&](float pv, float, float) { return __fmul_rn(pv, c.decay_factor); });
        break;
    case ADAM_LERP:
        pass_apply(m, m, gs, 0, n, [&](float mv, float x, float) { return lerp_pt(mv, x, c.one_minus_beta1); });
        break;
    case ADAM_MUL_V:
        pass_apply(v, v, 0, 0, n, [&](float vv, float, float) { return __fmul_rn(vv, c.beta2); });
        break;
    case ADAM_ADDCMUL:
        pass_apply(v, v, gs, 0, n, [&](float vv, float x, float) {
            return __fadd_rn(vv, __fmul_rn(__fmul_rn(c.one_minus_beta2, x), x));
        });
        break;
    case ADAM_MAX:
        if (!vm) return;
        pass_apply(vm, vm, v, 0, n, [&](float a, float b, float) { return maximum_pt(a, b); });
        break;
    case ADAM_SQRT:
        pass_apply(t, vm ? vm : v, 0, 0, n, [&](float x, float, float) { return __fsqrt_rn(x); });
        break;
    case ADAM_DIV:
        pass_apply(t, t, 0, 0, n, [&](float x, float, float) { return __fdiv_rn(x, c.bias_correction2_sqrt); });
        break;
    case ADAM_ADD_EPS:
        pass_apply(t, t, 0, 0, n, [&](float x, float, float) { return __fadd_rn(x, c.eps); });
        break;
    case ADAM_ADDCDIV:
        pass_apply(p, p, m, t, n, [&](float pv, float mv, float d) {
            return __fadd_rn(pv, __fdiv_rn(__fmul_rn(c.neg_step_size, mv), d));
        });
        break;
    }
}
INSTANCES(__launch_bounds__(256, 4), adam_pass,
          (const AdamPiece* pieces, unsigned n_pieces, unsigned long long block_elems, int op),
          (pieces, n_pieces, block_elems, op))
