// torchao's 4-bit Adam/AdamW (torchao.optim.Adam4bit, AdamW4bit) on the GPU, for a whole list of
// parameters in one launch, and its f32-state path for parameters torchao does not quantise.
// Parameters and gradients are float (`_f32`) or bf16 (`_bf16`, no master copy: the update in
// float, the new value stored to nearest or, flagged FLAG_STOCHASTIC, stochastically with the
// piece's stream; states are never bf16).
//
// 4-bit: one warp per quantisation block of 128 elements (a quantised parameter is whole
// blocks), four elements a lane: dequantise both moments (the code's table value times the
// block's scale), update them and the parameter, reduce the block's new absmax of each moment
// (a warp reduction), re-quantise against it (torchao's branchless search, ties up, by the
// tables' code thresholds: four compares, no arithmetic) and pack two
// codes a byte, the even element in the high nibble. A warp a block keeps the loads wide and the
// reduction in registers: no shared memory but the code tables, no barrier per block (the
// earlier block-of-128-threads form ran a 1e9-parameter step in 8.5 ms, this one measures in
// crates/optim/benches/cuda_adam.rs).
//
// The float operations are those of crates/optim/src/kernels/adam4bit.rs in the same order, each
// rounded as there (__f*_rn keep nvcc from contracting into FMAs; PyTorch's lerp is an fma on
// the CPU too), so the GPU and the CPU agree to the bit. Launch side:
// crates/optim/src/cuda/adam4bit.rs. Built to PTX by `cargo xtask build-kernels`.

#include "optim.cuh"

#define AO_BLOCK 128

struct Ao4Piece {
    PieceHead head;  // 4-bit: first_block counts 128-element blocks; f32 states: CUDA blocks
    unsigned long long param, grad, state1, state2, absmax1, absmax2;  // absmax: 4-bit only
    unsigned int flags;  // FLAG_HOST_SCALED; FLAG_DECAY: AdamW (else Adam's L2 term)
    float lr, lr_wd, wd, w1, w2, bc1, sqrt_bc2, eps, grad_scale, beta1, beta2;
    float qmap1[16], qmap2[16];  // signed (exp_avg) and unsigned (exp_avg_sq) code tables
    float thresholds1[16], thresholds2[16];  // their code thresholds (the host's code_thresholds)
    unsigned long long seed, param_index;  // the stochastic rounding's stream (FLAG_STOCHASTIC)
};
static_assert(sizeof(Ao4Piece) == 400, "Ao4Piece layout");

struct AoConsts {
    float lr, lr_wd, wd, w1, w2, bc1, sqrt_bc2, eps;
    bool decoupled;
};

// The piece's constants; after device-skipped steps the bias corrections are recomputed from
// the true step (powf through double, within an ulp of the host's powf).
__device__ __forceinline__ AoConsts ao_consts(const Ao4Piece& pc) {
    AoConsts c;
    c.lr = pc.lr;
    c.lr_wd = pc.lr_wd;
    c.wd = pc.wd;
    c.w1 = pc.w1;
    c.w2 = pc.w2;
    c.bc1 = pc.bc1;
    c.sqrt_bc2 = pc.sqrt_bc2;
    c.eps = pc.eps;
    c.decoupled = (pc.flags & FLAG_DECAY) != 0;
    unsigned long long t = true_step(pc.head);
    if (t != pc.head.step) {
        c.bc1 = __fsub_rn(1.0f, (float)pow((double)pc.beta1, (double)(float)t));
        c.sqrt_bc2 = __fsqrt_rn(__fsub_rn(1.0f, (float)pow((double)pc.beta2, (double)(float)t)));
    }
    return c;
}

// One element of torchao's single_param_adam (StepConsts::update on the host).
__device__ __forceinline__ void ao_update(const AoConsts& c, float& p, float g, float& m, float& v) {
    if (c.decoupled) {
        p = __fsub_rn(p, __fmul_rn(c.lr_wd, p));
    } else {
        g = __fadd_rn(g, __fmul_rn(c.wd, p));
    }
    m = lerp_pt(m, g, c.w1);
    v = lerp_pt(v, __fmul_rn(g, g), c.w2);
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.sqrt_bc2), c.eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(c.lr, __fdiv_rn(m, c.bc1)), denom));
}

// torchao's quantize_4bit_with_qmap of one scaled value, by the table's code thresholds t
// (threshold_code on the host, equal to torchao's search, code_4bit, for every f32: t[k] is the
// least value whose code is k or more): how many of t[1..15] y reaches, in four compares.
__device__ __forceinline__ unsigned code4(const float* t, float y) {
    unsigned c = y >= t[8] ? 8u : 0u;
    c += y >= t[c + 4] ? 4u : 0u;
    c += y >= t[c + 2] ? 2u : 0u;
    return c + (y >= t[c + 1] ? 1u : 0u);
}

__device__ __forceinline__ float warp_maximum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = maximum_pt(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A block's scale from its absmax: NaN stays NaN, else at least 1e-12 (`clip(1e-12)`).
__device__ __forceinline__ float block_scale(float amax) {
    return amax != amax ? amax : fmaxf(amax, 1e-12f);
}

// Warps per CUDA block of the 4-bit kernel (crates/optim/src/cuda/adam4bit.rs launches this many
// times 32 threads).
#define AO_WARPS 8

// Every 128-element block of every piece, one warp each (grid-stride over the warps of the
// launch): block b of the launch is block b - first_block of its piece. Lane l holds elements
// 4l..4l+3 (one vector load of the parameter and of the gradient, one 16-bit load of the two
// bytes of codes of each moment where the piece is aligned; element by element otherwise), the
// block's absmax of each moment is a warp reduction, and the lane writes its two bytes of each
// moment's new codes. Every lane reads the old scales before the reduction's shuffles and lane 0
// writes the new ones after them, so the warp updates its block in place.
template <typename T>
__device__ __forceinline__ void adam4bit_blockwise(const Ao4Piece* pieces, unsigned n_pieces,
                                                   unsigned long long n_blocks, const float* grad_scale,
                                                   const float* found_inf) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    // Every piece carries the same two tables and their thresholds (the host's qmap4_tables).
    __shared__ float tables[64];
    const Ao4Piece& first = pieces[0];
    const unsigned entry = threadIdx.x % 16;
    if (threadIdx.x < 64)
        tables[threadIdx.x] = threadIdx.x < 16   ? first.qmap1[entry]
                              : threadIdx.x < 32 ? first.qmap2[entry]
                              : threadIdx.x < 48 ? first.thresholds1[entry]
                                                 : first.thresholds2[entry];
    __syncthreads();
    const float* q1 = tables;
    const float* q2 = tables + 16;
    const float* t1 = tables + 32;
    const float* t2 = tables + 48;
    const unsigned lane = threadIdx.x % 32;
    const unsigned long long warps = (unsigned long long)gridDim.x * AO_WARPS;
    // The piece of the warp's last block and what follows from it alone (its constants, the
    // gradient scale, the rounding stream), found again only when a block falls outside it: a
    // warp's blocks are mostly of one piece.
    unsigned piece = 0;
    unsigned long long lo = 1, hi = 0;  // its blocks [lo, hi): none yet
    AoConsts c;
    float scale;
    bool scaled;
    ParamRounding r;
    for (unsigned long long b = (unsigned long long)blockIdx.x * AO_WARPS + threadIdx.x / 32; b < n_blocks; b += warps) {
        if (b < lo || b >= hi) {
            piece = find_piece(pieces, n_pieces, b);
            const Ao4Piece& found = pieces[piece];
            lo = found.head.first_block;
            hi = lo + (found.head.len + AO_BLOCK - 1) / AO_BLOCK;
            c = ao_consts(found);
            scaled = grad_scale_of(grad_scale, found.flags, found.grad_scale, &scale);
            r = param_rounding(found.head, found.flags, found.seed, found.param_index);
        }
        const Ao4Piece& pc = pieces[piece];
        const unsigned long long block = b - lo;
        const unsigned long long first = block * AO_BLOCK;  // the block's first element
        T* p = (T*)pc.param + first;
        const T* g = (const T*)pc.grad + first;
        unsigned char* c1 = (unsigned char*)pc.state1 + first / 2;
        unsigned char* c2 = (unsigned char*)pc.state2 + first / 2;
        float* s1 = (float*)pc.absmax1 + block;
        float* s2 = (float*)pc.absmax2 + block;
        const bool aligned = ((pc.param | pc.grad) & (4 * sizeof(T) - 1)) == 0 && ((pc.state1 | pc.state2) & 1) == 0;
        float pv[4], gv[4];
        unsigned w1, w2;  // the lane's two bytes of codes: byte 0 holds elements 0 (high) and 1
        if (aligned) {
            load4(p, lane, pv);
            load4(g, lane, gv);
            w1 = ((const unsigned short*)c1)[lane];
            w2 = ((const unsigned short*)c2)[lane];
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                pv[k] = to_f32(p[4 * lane + k]);
                gv[k] = to_f32(g[4 * lane + k]);
            }
            w1 = c1[2 * lane] | ((unsigned)c1[2 * lane + 1] << 8);
            w2 = c2[2 * lane] | ((unsigned)c2[2 * lane + 1] << 8);
        }
        const float old1 = *s1, old2 = *s2;
        float m[4], v[4], a1 = 0.0f, a2 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned shift = 8 * (k / 2) + ((k & 1) ? 0 : 4);
            m[k] = __fmul_rn(q1[(w1 >> shift) & 15u], old1);
            v[k] = __fmul_rn(q2[(w2 >> shift) & 15u], old2);
            float gk = gv[k];
            if (scaled) gk = __fdiv_rn(gk, scale);
            ao_update(c, pv[k], gk, m[k], v[k]);
            a1 = maximum_pt(a1, fabsf(m[k]));
            a2 = maximum_pt(a2, fabsf(v[k]));
        }
        const float scale1 = block_scale(warp_maximum(a1)), scale2 = block_scale(warp_maximum(a2));
        unsigned n1 = 0, n2 = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned shift = 8 * (k / 2) + ((k & 1) ? 0 : 4);
            n1 |= code4(t1, __fdiv_rn(m[k], scale1)) << shift;
            n2 |= code4(t2, __fdiv_rn(v[k], scale2)) << shift;
        }
        if (aligned) {
            store4_rounded(p, lane, pv, r, first);
            ((unsigned short*)c1)[lane] = (unsigned short)n1;
            ((unsigned short*)c2)[lane] = (unsigned short)n2;
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) p[4 * lane + k] = store_rounded<T>(pv[k], r, first + 4 * lane + k);
            c1[2 * lane] = (unsigned char)n1;
            c1[2 * lane + 1] = (unsigned char)(n1 >> 8);
            c2[2 * lane] = (unsigned char)n2;
            c2[2 * lane + 1] = (unsigned char)(n2 >> 8);
        }
        if (lane == 0) {
            *s1 = scale1;
            *s2 = scale2;
        }
    }
}

// The f32-state path (adam4bit_f32_states on the host): block b covers `block_elems` elements of
// its piece.
template <typename T>
__device__ __forceinline__ void adam4bit_f32_states(const Ao4Piece* pieces, unsigned n_pieces,
                                                    unsigned long long block_elems, const float* grad_scale,
                                                    const float* found_inf) {
    if (skip_step(pieces, n_pieces, found_inf)) return;
    const Ao4Piece& pc = pieces[find_piece(pieces, n_pieces, blockIdx.x)];
    unsigned long long start = (blockIdx.x - pc.head.first_block) * block_elems;
    if (start >= pc.head.len) return;
    unsigned long long n = min(block_elems, pc.head.len - start);
    const AoConsts c = ao_consts(pc);
    float scale;
    bool scaled = grad_scale_of(grad_scale, pc.flags, pc.grad_scale, &scale);
    const ParamRounding r = param_rounding(pc.head, pc.flags, pc.seed, pc.param_index);
    T* p = (T*)pc.param + start;
    const T* g = (const T*)pc.grad + start;
    float* m = (float*)pc.state1 + start;
    float* v = (float*)pc.state2 + start;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        float gk = to_f32(g[i]);
        if (scaled) gk = __fdiv_rn(gk, scale);
        float pv = to_f32(p[i]), mv = m[i], vv = v[i];
        ao_update(c, pv, gk, mv, vv);
        p[i] = store_rounded<T>(pv, r, start + i);
        m[i] = mv;
        v[i] = vv;
    }
}

#define AO4_PARAMS \
    (const Ao4Piece* pieces, unsigned n_pieces, unsigned long long block_elems, const float* grad_scale, \
     const float* found_inf)
#define AO4_ARGS (pieces, n_pieces, block_elems, grad_scale, found_inf)
extern "C" __global__ void __launch_bounds__(AO_WARPS * 32) adam4bit_blockwise_f32 AO4_PARAMS {
    adam4bit_blockwise<float> AO4_ARGS;
}
extern "C" __global__ void __launch_bounds__(AO_WARPS * 32) adam4bit_blockwise_bf16 AO4_PARAMS {
    adam4bit_blockwise<__nv_bfloat16> AO4_ARGS;
}
extern "C" __global__ void adam4bit_f32_states_f32 AO4_PARAMS { adam4bit_f32_states<float> AO4_ARGS; }
extern "C" __global__ void adam4bit_f32_states_bf16 AO4_PARAMS { adam4bit_f32_states<__nv_bfloat16> AO4_ARGS; }
