// bitsandbytes' 8-bit blockwise Adam on the GPU, for a whole list of parameters in one launch,
// and its 32-bit path (f32 states) for parameters under min_8bit_size.
//
// Parameters and gradients are float (`_f32`) or bf16 (`_bf16`, no master copy: the update in
// float, the new value stored to nearest or, flagged FLAG_STOCHASTIC, stochastically with the
// piece's stream; states are never bf16).
//
// 8-bit: one warp handles one 256-element quantization block at a time, each lane eight
// elements in two runs of four (vector loads of four elements of p and g, one 32-bit load of four codes per
// state): dequantize both states with the block's absmax, update them, take the block's new
// absmax (a warp reduction), update the parameter, and re-quantize against the reciprocal of the
// new absmax. The nearest-code search of bitsandbytes is replaced by its exact table form
// (crates/optim/src/kernels/quantization.rs, StateCodeTable): one shared-memory entry per bin
// of the value's bits and one integer comparison; the sign guard needs no lookup. Warps take runs of blocks from a
// counter, so the tensor of a block is found once per run, not per block.
//
// The float operations are those of crates/optim/src/kernels/adam8bit.rs in the same order, with
// rounding made explicit, so the GPU and the CPU agree to the bit. The `_bnb` kernels (pieces
// flagged FLAG_BNB_ARITH) instead run the arithmetic of bitsandbytes' own CUDA build (the
// instructions its fast-math build executes on sm_90: approximate lg2/ex2/sqrt/reciprocal, its
// fma contractions, denormals flushed), which no CPU reproduces: GPU only, to agree with
// bitsandbytes to the bit. Each arithmetic is compiled into its own kernel, and a non-finite
// gradient's element is dropped by a select, not a branch: the 8-element loop of a block is
// straight-line code. Launch side: crates/optim/src/cuda/adam8bit.rs. Built to PTX by
// `cargo xtask build-kernels`.

#include "optim.cuh"

#define QBLOCK 256

struct Bnb8Piece {
    PieceHead head;  // 8-bit: first_block counts 256-element blocks; 32-bit: CUDA blocks
    unsigned long long param, grad, state1, state2, absmax1, absmax2;  // absmax: 8-bit only
    unsigned int flags;
    float beta1, beta2, one_minus_beta1, one_minus_beta2, correction2, eps, step_size, decay_factor, grad_scale,
        lr, weight_decay;
    unsigned long long seed, param_index;  // the stochastic rounding's stream (FLAG_STOCHASTIC)
};
static_assert(sizeof(Bnb8Piece) == 144, "Bnb8Piece layout");

// bitsandbytes' fast-math instructions, as PTX pins them (each is one SASS instruction on sm_90:
// MUFU.LG2, MUFU.EX2, MUFU.SQRT, MUFU.RCP, and FMUL/FADD/FFMA with .FTZ).
__device__ __forceinline__ float lg2_ftz(float x) { float r; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float ex2_ftz(float x) { float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float sqrt_ftz(float x) { float r; asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float rcp_ftz(float x) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float mul_ftz(float a, float b) { float r; asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float add_ftz(float a, float b) { float r; asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float fma_ftz(float a, float b, float c) {
    float r;
    asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

struct BnbConsts {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, correction2, eps, step_size, decay_factor;
    unsigned flags;
};

// The piece's constants; after device-skipped steps the step-dependent ones are recomputed from
// the true step (f32 as on the host; powf through double, within an ulp of the host's powf).
__device__ __forceinline__ BnbConsts bnb_consts(const Bnb8Piece& pc) {
    BnbConsts c;
    c.beta1 = pc.beta1;
    c.beta2 = pc.beta2;
    c.one_minus_beta1 = pc.one_minus_beta1;
    c.one_minus_beta2 = pc.one_minus_beta2;
    c.correction2 = pc.correction2;
    c.eps = pc.eps;
    c.step_size = pc.step_size;
    c.decay_factor = pc.decay_factor;
    c.flags = pc.flags;
    unsigned long long t = true_step(pc.head);
    if (pc.flags & FLAG_BNB_ARITH) {
        // bitsandbytes' step constants, on the device as its kernels take them: __powf as
        // ex2(step · lg2(β)), the square root and the division approximate, the decay an fma.
        float step = (float)(int)t;
        float pow1 = ex2_ftz(mul_ftz(step, lg2_ftz(pc.beta1)));
        float pow2 = ex2_ftz(mul_ftz(step, lg2_ftz(pc.beta2)));
        c.one_minus_beta1 = add_ftz(1.0f, -pc.beta1);
        c.one_minus_beta2 = add_ftz(1.0f, -pc.beta2);
        c.correction2 = sqrt_ftz(add_ftz(1.0f, -pow2));
        c.step_size = mul_ftz(mul_ftz(c.correction2, pc.lr), -rcp_ftz(add_ftz(1.0f, -pow1)));
        c.decay_factor = fma_ftz(-pc.lr, pc.weight_decay, 1.0f);
    } else if (t != pc.head.step) {
        float correction1 = __fsub_rn(1.0f, (float)pow((double)pc.beta1, (double)(float)t));
        c.correction2 = __fsqrt_rn(__fsub_rn(1.0f, (float)pow((double)pc.beta2, (double)(float)t)));
        c.step_size = __fdiv_rn(__fmul_rn(-pc.lr, c.correction2), correction1);
    }
    return c;
}

// Lookup tables, one allocation (crates/optim/src/cuda/adam8bit.rs writes it), in 32-bit words:
// the two maps, the signed map's code bins (both signs), the unsigned map's (positive values),
// the two NaN codes, then the work counter (u64).
#define MAP1 0
#define MAP2 256
#define BINS_PER_SIGN (1 + 24 * 128 + 1)
#define BINS1 512
#define BINS2 (BINS1 + 2 * BINS_PER_SIGN)
#define NAN_CODES (BINS2 + BINS_PER_SIGN)
#define TABLE_WORDS (NAN_CODES + 2)

// The bin of |x| from its bits: 0 under 2^-23, then 128 per binade (exponent and top seven
// mantissa bits), the last from 2 up (StateCodeTable's code_bin, without the sign).
__device__ __forceinline__ unsigned magnitude_bin(unsigned bits) {
    int bin = (int)((bits & 0x7fffffffu) >> 16) - 0x33ff;
    return (unsigned)min(max(bin, 0), BINS_PER_SIGN - 1);
}

// bitsandbytes' quantize_2D code of x through the signed map's table (StateCodeTable::code):
// the entry of x's bin holds the code of the bin's smallest value and the key (low 16 mantissa
// bits, their complement for negative x) from which the next code starts.
__device__ __forceinline__ unsigned signed_code(const unsigned* bins, unsigned nan_code, float x) {
    unsigned bits = __float_as_uint(x);
    unsigned sign = (unsigned)((int)bits >> 31);
    unsigned entry = bins[magnitude_bin(bits) + (sign & BINS_PER_SIGN)];
    unsigned key = (bits ^ sign) & 0xffffu;
    unsigned code = (entry & 255u) + (key >= (entry >> 8) ? 1u : 0u);
    return x != x ? nan_code : code;
}

// The same for the unsigned map, whose table holds positive bins only: a negative x takes bin 0,
// whose code (0) is the search's code for any negative value.
__device__ __forceinline__ unsigned unsigned_code(const unsigned* bins, unsigned nan_code, float x) {
    unsigned bits = __float_as_uint(x);
    unsigned entry = bins[magnitude_bin(bits) & ~(unsigned)((int)bits >> 31)];
    unsigned code = (entry & 255u) + ((bits & 0xffffu) >= (entry >> 8) ? 1u : 0u);
    return x != x ? nan_code : code;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// The buffers of the tensor a warp works on, read from its piece once per run of blocks.
template <typename T>
struct Tensor8 {
    T* p;
    const T* g;
    unsigned char* c1;
    unsigned char* c2;
    float* a1;
    float* a2;
    unsigned long long len;
    bool aligned;  // vector access to four elements of p and g, 32-bit access to the codes
    ParamRounding rounding;
};

template <typename T>
__device__ __forceinline__ Tensor8<T> tensor_of(const Bnb8Piece& pc) {
    Tensor8<T> t;
    t.p = (T*)pc.param;
    t.g = (const T*)pc.grad;
    t.c1 = (unsigned char*)pc.state1;
    t.c2 = (unsigned char*)pc.state2;
    t.a1 = (float*)pc.absmax1;
    t.a2 = (float*)pc.absmax2;
    t.len = pc.head.len;
    t.aligned = ((pc.param | pc.grad) & (4 * sizeof(T) - 1)) == 0 && ((pc.state1 | pc.state2) & 3) == 0;
    t.rounding = param_rounding(pc.head, pc.flags, pc.seed, pc.param_index);
    return t;
}

// One quantization block of one tensor by one warp. Lane l holds elements 4l..4l+3 and
// 128+4l..128+4l+3 of the block. FULL: all 256 elements present and aligned (vector access, no
// bounds checks). BNB: bitsandbytes' fast-math instructions (the pieces flagged FLAG_BNB_ARITH;
// a launch is of one kind), else the portable, correctly rounded ones.
template <typename T, bool FULL, bool BNB>
__device__ __forceinline__ void qblock_update(const Tensor8<T>& t, const BnbConsts& c, unsigned long long block,
                                              bool scaled, float scale, const unsigned* smem_u, unsigned lane) {
    const float* smem_f = (const float*)smem_u;
    unsigned long long base = block * QBLOCK;
    unsigned remaining = FULL ? QBLOCK : (unsigned)min(t.len - base, (unsigned long long)QBLOCK);
    T* p = t.p + base;
    const T* gp = t.g + base;
    unsigned char* c1 = t.c1 + base;
    unsigned char* c2 = t.c2 + base;
    float g[8], pv[8];
    unsigned q1[8], q2[8];
    if (FULL) {
        load4(gp, lane, g);
        load4(gp, 32 + lane, g + 4);
        load4(p, lane, pv);
        load4(p, 32 + lane, pv + 4);
        unsigned w1a = ((const unsigned*)c1)[lane], w1b = ((const unsigned*)c1)[32 + lane];
        unsigned w2a = ((const unsigned*)c2)[lane], w2b = ((const unsigned*)c2)[32 + lane];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            q1[k] = (w1a >> (8 * k)) & 255u;
            q1[4 + k] = (w1b >> (8 * k)) & 255u;
            q2[k] = (w2a >> (8 * k)) & 255u;
            q2[4 + k] = (w2b >> (8 * k)) & 255u;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            unsigned j = (k < 4 ? 0 : 128) + 4 * lane + (k & 3);
            bool in = j < remaining;
            g[k] = in ? to_f32(gp[j]) : 0.0f;
            pv[k] = in ? to_f32(p[j]) : 0.0f;
            q1[k] = in ? c1[j] : 0u;
            q2[k] = in ? c2[j] : 0u;
        }
    }
    float old1 = t.a1[block], old2 = t.a2[block];
    float s1[8], s2[8];
    unsigned finite = 0;
    float max1 = 0.0f, max2 = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        float gk = g[k];
        if (scaled) gk = __fdiv_rn(gk, scale);
        // Both moments are computed for every element and kept where the gradient is finite (and
        // the element in the tensor): selects, not branches, in this loop and the next.
        const bool in = FULL || (k < 4 ? 0u : 128u) + 4 * lane + (k & 3) < remaining;
        const bool ok = in && isfinite(gk);
        float n1, n2;
        if (BNB) {
            // kOptimizerStatic8bit2StateBlockwise: s1 = fma(g, 1-β1, s1·β1),
            // s2 = fma(g, (1-β2)·g, s2·β2).
            float v = mul_ftz(old2, smem_f[MAP2 + q2[k]]);
            n2 = fma_ftz(gk, mul_ftz(c.one_minus_beta2, gk), mul_ftz(v, c.beta2));
            float m = mul_ftz(old1, smem_f[MAP1 + q1[k]]);
            n1 = fma_ftz(gk, c.one_minus_beta1, mul_ftz(m, c.beta1));
        } else {
            float v = __fmul_rn(smem_f[MAP2 + q2[k]], old2);
            n2 = __fadd_rn(__fmul_rn(v, c.beta2), __fmul_rn(__fmul_rn(c.one_minus_beta2, gk), gk));
            float m = __fmul_rn(smem_f[MAP1 + q1[k]], old1);
            n1 = __fadd_rn(__fmul_rn(m, c.beta1), __fmul_rn(c.one_minus_beta1, gk));
        }
        s1[k] = ok ? n1 : 0.0f;
        s2[k] = ok ? n2 : 0.0f;
        finite |= (unsigned)ok << k;
        max1 = fmaxf(max1, fabsf(s1[k]));
        max2 = fmaxf(max2, fabsf(s2[k]));
    }
    max1 = warp_max(max1);
    max2 = warp_max(max2);
    if (lane == 0) {
        t.a1[block] = max1;
        t.a2[block] = max2;
    }
    float inv1 = BNB ? rcp_ftz(max1) : __fdiv_rn(1.0f, max1), inv2 = BNB ? rcp_ftz(max2) : __fdiv_rn(1.0f, max2);
    float eps2 = __fmul_rn(c.correction2, c.eps);
    unsigned nan1 = smem_u[NAN_CODES], nan2 = smem_u[NAN_CODES + 1];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        float x;
        if (BNB) {
            // p = fma(step_size, s1·rcp(fma(c2, eps, sqrt(s2))), p), then p·(1 - lr·wd).
            float r = rcp_ftz(fma_ftz(c.correction2, c.eps, sqrt_ftz(s2[k])));
            x = fma_ftz(c.step_size, mul_ftz(r, s1[k]), pv[k]);
            if (c.flags & FLAG_DECAY) x = mul_ftz(c.decay_factor, x);
        } else {
            x = __fadd_rn(pv[k], __fmul_rn(c.step_size, __fdiv_rn(s1[k], __fadd_rn(__fsqrt_rn(s2[k]), eps2))));
            if (c.flags & FLAG_DECAY) x = __fmul_rn(x, c.decay_factor);
        }
        pv[k] = (finite >> k) & 1u ? x : pv[k];
        unsigned code1 = signed_code(smem_u + BINS1, nan1, BNB ? mul_ftz(inv1, s1[k]) : __fmul_rn(s1[k], inv1));
        // The sign guard: map1[code] is negative exactly for codes under 127.
        if ((code1 < 127u) != (__float_as_uint(s1[k]) >> 31)) code1 = (s1[k] > 0.0f ? code1 + 1 : code1 - 1) & 255u;
        q1[k] = code1;
        q2[k] = unsigned_code(smem_u + BINS2, nan2, BNB ? mul_ftz(inv2, s2[k]) : __fmul_rn(s2[k], inv2));
    }
    if (FULL) {
        store4_rounded(p, lane, pv, t.rounding, base);
        store4_rounded(p, 32 + lane, pv + 4, t.rounding, base);
        ((unsigned*)c1)[lane] = q1[0] | (q1[1] << 8) | (q1[2] << 16) | (q1[3] << 24);
        ((unsigned*)c1)[32 + lane] = q1[4] | (q1[5] << 8) | (q1[6] << 16) | (q1[7] << 24);
        ((unsigned*)c2)[lane] = q2[0] | (q2[1] << 8) | (q2[2] << 16) | (q2[3] << 24);
        ((unsigned*)c2)[32 + lane] = q2[4] | (q2[5] << 8) | (q2[6] << 16) | (q2[7] << 24);
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            unsigned j = (k < 4 ? 0 : 128) + 4 * lane + (k & 3);
            if (j < remaining) {
                p[j] = store_rounded<T>(pv[k], t.rounding, base + j);
                c1[j] = (unsigned char)q1[k];
                c2[j] = (unsigned char)q2[k];
            }
        }
    }
}

// Every 256-element block of every piece. Warps take GRAB consecutive blocks at a time from a
// counter (the u64 after the tables, zeroed by the host before the launch), so the work
// spreads evenly whatever the grid and the number of multiprocessors, and the tensor of a block
// is looked up once per grab.
#define GRAB 16

template <typename T, bool BNB>
__device__ __forceinline__ void adam8bit_blockwise(const Bnb8Piece* pieces, unsigned n_pieces,
                                                   unsigned long long n_blocks, unsigned* tables,
                                                   const float* grad_scale, const float* found_inf) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    __shared__ unsigned smem[TABLE_WORDS];
    for (unsigned k = threadIdx.x; k < TABLE_WORDS; k += blockDim.x) smem[k] = tables[k];
    __syncthreads();
    unsigned long long* counter = (unsigned long long*)(tables + TABLE_WORDS);
    unsigned lane = threadIdx.x % 32;
    for (;;) {
        unsigned long long b = 0;
        if (lane == 0) b = atomicAdd(counter, (unsigned long long)GRAB);
        b = __shfl_sync(0xffffffffu, b, 0);
        if (b >= n_blocks) break;
        unsigned long long end = min(b + GRAB, n_blocks);
        unsigned idx = find_piece(pieces, n_pieces, b);
        for (;;) {
            const Bnb8Piece& pc = pieces[idx];
            const BnbConsts c = bnb_consts(pc);
            const Tensor8<T> t = tensor_of<T>(pc);
            float scale;
            bool scaled = grad_scale_of(grad_scale, pc.flags, pc.grad_scale, &scale);
            // This tensor's blocks of the run.
            unsigned long long first = pc.head.first_block;
            unsigned long long stop = idx + 1 < n_pieces ? min(end, pieces[idx + 1].head.first_block) : end;
            unsigned long long full_blocks = t.aligned ? t.len / QBLOCK : 0;
            for (; b < stop; ++b) {
                unsigned long long block = b - first;
                if (block < full_blocks) {
                    qblock_update<T, true, BNB>(t, c, block, scaled, scale, smem, lane);
                } else {
                    qblock_update<T, false, BNB>(t, c, block, scaled, scale, smem, lane);
                }
            }
            if (b >= end) break;
            ++idx;
        }
    }
}

// bitsandbytes' 32-bit Adam (kOptimizer32bit2State) for parameters under min_8bit_size: block b
// covers `block_elems` elements of its piece.
template <typename T>
__device__ __forceinline__ void adam_bnb32(const Bnb8Piece* pieces, unsigned n_pieces, unsigned long long block_elems,
                                           const float* grad_scale, const float* found_inf) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    const Bnb8Piece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    const BnbConsts c = bnb_consts(pc);
    float scale;
    bool scaled = grad_scale_of(grad_scale, pc.flags, pc.grad_scale, &scale);
    float eps2 = __fmul_rn(c.eps, c.correction2);
    const ParamRounding r = param_rounding(pc.head, pc.flags, pc.seed, pc.param_index);
    T* p = (T*)pc.param + start;
    const T* g = (const T*)pc.grad + start;
    float* m = (float*)pc.state1 + start;
    float* v = (float*)pc.state2 + start;
    if (c.flags & FLAG_BNB_ARITH) {
        // kOptimizer32bit2State: s2 = fma(s2, β2, (1-β2)·(g·g)), s1 = fma(s1, β1, g·(1-β1)),
        // p = fma(step_size, s1·rcp(fma(c2, eps, sqrt(s2))), p), then p·(1 - lr·wd).
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            float gk = to_f32(g[i]);
            if (scaled) gk = __fdiv_rn(gk, scale);
            float vv = fma_ftz(v[i], c.beta2, mul_ftz(c.one_minus_beta2, mul_ftz(gk, gk)));
            float rc = rcp_ftz(fma_ftz(c.correction2, c.eps, sqrt_ftz(vv)));
            float mv = fma_ftz(m[i], c.beta1, mul_ftz(gk, c.one_minus_beta1));
            float x = fma_ftz(c.step_size, mul_ftz(mv, rc), to_f32(p[i]));
            if (c.flags & FLAG_DECAY) x = mul_ftz(c.decay_factor, x);
            m[i] = mv;
            v[i] = vv;
            p[i] = store_rounded<T>(x, r, start + i);
        }
        return;
    }
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        float gk = to_f32(g[i]);
        if (scaled) gk = __fdiv_rn(gk, scale);
        float mv = __fadd_rn(__fmul_rn(m[i], c.beta1), __fmul_rn(c.one_minus_beta1, gk));
        float vv = __fadd_rn(__fmul_rn(v[i], c.beta2), __fmul_rn(c.one_minus_beta2, __fmul_rn(gk, gk)));
        float x = __fadd_rn(to_f32(p[i]), __fmul_rn(c.step_size, __fdiv_rn(mv, __fadd_rn(__fsqrt_rn(vv), eps2))));
        if (c.flags & FLAG_DECAY) x = __fmul_rn(x, c.decay_factor);
        m[i] = mv;
        v[i] = vv;
        p[i] = store_rounded<T>(x, r, start + i);
    }
}

#define BLOCKWISE_PARAMS \
    (const Bnb8Piece* pieces, unsigned n_pieces, unsigned long long n_blocks, unsigned* tables, \
     const float* grad_scale, const float* found_inf)
#define BLOCKWISE_ARGS (pieces, n_pieces, n_blocks, tables, grad_scale, found_inf)
// Four blocks a multiprocessor (64 registers; the table's 38 KiB of shared memory four times
// still fits): on the H200 the 1e9-parameter step took 5.01 ms against 5.46 at three
// (crates/optim/benches/cuda_adam.rs), the warps then issuing 78% of the cycles.
extern "C" __global__ void __launch_bounds__(QBLOCK, 4) adam8bit_blockwise_f32 BLOCKWISE_PARAMS {
    adam8bit_blockwise<float, false> BLOCKWISE_ARGS;
}
extern "C" __global__ void __launch_bounds__(QBLOCK, 4) adam8bit_blockwise_bf16 BLOCKWISE_PARAMS {
    adam8bit_blockwise<__nv_bfloat16, false> BLOCKWISE_ARGS;
}
extern "C" __global__ void __launch_bounds__(QBLOCK, 4) adam8bit_blockwise_bnb_f32 BLOCKWISE_PARAMS {
    adam8bit_blockwise<float, true> BLOCKWISE_ARGS;
}
extern "C" __global__ void __launch_bounds__(QBLOCK, 4) adam8bit_blockwise_bnb_bf16 BLOCKWISE_PARAMS {
    adam8bit_blockwise<__nv_bfloat16, true> BLOCKWISE_ARGS;
}

#define BNB32_PARAMS \
    (const Bnb8Piece* pieces, unsigned n_pieces, unsigned long long block_elems, const float* grad_scale, \
     const float* found_inf)
#define BNB32_ARGS (pieces, n_pieces, block_elems, grad_scale, found_inf)
extern "C" __global__ void adam_bnb32_f32 BNB32_PARAMS { adam_bnb32<float> BNB32_ARGS; }
extern "C" __global__ void adam_bnb32_bf16 BNB32_PARAMS { adam_bnb32<__nv_bfloat16> BNB32_ARGS; }
