// Fused Adam / AdamW on the GPU: one launch updates every parameter of a list, one pass per
// element (read p, g, m, v; write p, m, v), with the gradient scale and found-inf flag read from
// device memory (the GradScaler's in-kernel unscale and skip, no host synchronisation).
//
// The float operations are those of the CPU kernels in crates/optim/src/kernels/adam.rs, in the
// same order, with rounding made explicit (__f*_rn, fmaf) so the compiler cannot contract them
// differently: CPU and GPU results agree to the bit. The launch side is crates/optim/src/cuda.rs.
// Built to PTX by `cargo xtask build-kernels`.

struct Chunk {
    unsigned long long param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq;  // addresses (0: none)
    unsigned long long start, len;                                       // elements
};

struct AdamConsts {
    int maximize, has_l2, has_decay, amsgrad;
    float l2, decay_factor, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
        neg_step_size;
};

__device__ __forceinline__ float lerp_pt(float start, float end, float weight) {
    float diff = __fsub_rn(end, start);
    return fabsf(weight) < 0.5f ? fmaf(weight, diff, start) : fmaf(__fsub_rn(weight, 1.0f), diff, end);
}

__device__ __forceinline__ void adam_element(const AdamConsts& c, float inv, bool scaled, float* p, float g,
                                             float* m, float* v, float* vmax) {
    if (scaled) g = __fdiv_rn(g, inv);
    if (c.maximize) g = -g;
    float pv = *p;
    if (c.has_l2) g = fmaf(c.l2, pv, g);
    if (c.has_decay) pv = __fmul_rn(pv, c.decay_factor);
    float mv = lerp_pt(*m, g, c.one_minus_beta1);
    float vv = __fmul_rn(*v, c.beta2);
    vv = __fadd_rn(vv, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
    float second = vv;
    if (vmax) {
        float mx = *vmax;
        mx = (vv > mx || mx != mx) ? vv : mx;
        *vmax = mx;
        second = mx;
    }
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(second), c.bias_correction2_sqrt), c.eps);
    pv = __fadd_rn(pv, __fdiv_rn(__fmul_rn(c.neg_step_size, mv), denom));
    *p = pv;
    *m = mv;
    *v = vv;
}

extern "C" __global__ void adam_fused_f32(const Chunk* chunks, int maximize, int has_l2, int has_decay,
                                          float l2, float decay_factor, float one_minus_beta1, float beta2,
                                          float one_minus_beta2, float bias_correction2_sqrt, float eps,
                                          float neg_step_size, const float* grad_scale, const float* found_inf) {
    if (found_inf && *found_inf != 0.0f) return;
    AdamConsts c;
    c.maximize = maximize;
    c.has_l2 = has_l2;
    c.has_decay = has_decay;
    c.amsgrad = 0;
    c.l2 = l2;
    c.decay_factor = decay_factor;
    c.one_minus_beta1 = one_minus_beta1;
    c.beta2 = beta2;
    c.one_minus_beta2 = one_minus_beta2;
    c.bias_correction2_sqrt = bias_correction2_sqrt;
    c.eps = eps;
    c.neg_step_size = neg_step_size;
    const Chunk ch = chunks[blockIdx.x];
    bool scaled = grad_scale != 0;
    float inv = scaled ? *grad_scale : 1.0f;
    float* p = (float*)ch.param + ch.start;
    const float* g = (const float*)ch.grad + ch.start;
    float* m = (float*)ch.exp_avg + ch.start;
    float* v = (float*)ch.exp_avg_sq + ch.start;
    float* vm = ch.max_exp_avg_sq ? (float*)ch.max_exp_avg_sq + ch.start : 0;
    unsigned long long n = ch.len;
    bool aligned = ((ch.param | ch.grad | ch.exp_avg | ch.exp_avg_sq) & 15) == 0 && (ch.start & 3) == 0 && !vm;
    if (aligned) {
        unsigned long long n4 = n / 4;
        for (unsigned long long i = threadIdx.x; i < n4; i += blockDim.x) {
            float4 pp = ((float4*)p)[i], gg = ((const float4*)g)[i], mm = ((float4*)m)[i], vv = ((float4*)v)[i];
            adam_element(c, inv, scaled, &pp.x, gg.x, &mm.x, &vv.x, 0);
            adam_element(c, inv, scaled, &pp.y, gg.y, &mm.y, &vv.y, 0);
            adam_element(c, inv, scaled, &pp.z, gg.z, &mm.z, &vv.z, 0);
            adam_element(c, inv, scaled, &pp.w, gg.w, &mm.w, &vv.w, 0);
            ((float4*)p)[i] = pp;
            ((float4*)m)[i] = mm;
            ((float4*)v)[i] = vv;
        }
        for (unsigned long long i = n4 * 4 + threadIdx.x; i < n; i += blockDim.x)
            adam_element(c, inv, scaled, p + i, g[i], m + i, v + i, 0);
    } else {
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x)
            adam_element(c, inv, scaled, p + i, g[i], m + i, v + i, vm ? vm + i : 0);
    }
}
