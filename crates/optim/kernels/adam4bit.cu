// torchao's 4-bit Adam/AdamW (torchao.optim.Adam4bit, AdamW4bit) on the GPU, for a whole list of
// parameters in one launch, and its f32-state path for parameters torchao does not quantise.
// Parameters and gradients are float (`_f32`) or bf16 (`_bf16`, no master copy: the update in
// float, the new value stored to nearest or, flagged FLAG_STOCHASTIC, stochastically with the
// piece's stream; states are never bf16).
//
// 4-bit: one warp per quantisation block of 128 elements (a quantised parameter is whole
// blocks), four elements a lane: dequantise both moments (the code's table value times the
// block's scale), update them and the parameter, reduce the block's new absmax of each moment
// (a warp reduction), re-quantise against it and pack two codes a byte, the even element in the
// high nibble. A warp a block keeps the loads wide and the reduction in registers. Written with
// __fdiv_rn (a range check and a branch a division), the step issued about 210 instructions an
// element; here the divisions and the square root run as nvcc's own fast-path instructions with
// range checks of their own (FastRange), straight-line across the lane's four elements, and a
// lane whose operands leave that range computes its four again with __fdiv_rn and __fsqrt_rn; a
// code is one shared-memory read of its bin (code_bin) where the tables allow, else torchao's
// branchless search by the tables' code thresholds (four compares, no arithmetic). On an H100
// that took a 1e9-parameter step from 5.71e9 warp instructions to 4.65e9 (Nsight Compute), but
// its time only from 7.6 to 7.5 ms: the warps then wait on their loads about a third of the
// time (results/2026-12-05-ccbeacf). crates/optim/benches/cuda_adam.rs measures it.
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

// The weight decay (AdamW's on p, Adam's L2 term into g) and both moments' update: the start of
// ao_update and of ao_update_fast, which differ only in how they divide.
__device__ __forceinline__ void ao_moments(const AoConsts& c, float& p, float g, float& m, float& v) {
    if (c.decoupled) {
        p = __fsub_rn(p, __fmul_rn(c.lr_wd, p));
    } else {
        g = __fadd_rn(g, __fmul_rn(c.wd, p));
    }
    m = lerp_pt(m, g, c.w1);
    v = lerp_pt(v, __fmul_rn(g, g), c.w2);
}

// One element of torchao's single_param_adam (StepConsts::update on the host).
__device__ __forceinline__ void ao_update(const AoConsts& c, float& p, float g, float& m, float& v) {
    ao_moments(c, p, g, m, v);
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.sqrt_bc2), c.eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(c.lr, __fdiv_rn(m, c.bc1)), denom));
}

// The fast arithmetic of the 4-bit kernel: the instructions nvcc's correctly rounded division
// and square root run when their operands are in range (their range checks, FCHK and an integer
// compare, otherwise send them to a slow routine behind a branch), written out so that a
// divisor's reciprocal is refined once and the code is straight-line: the four elements of a
// lane interleave instead of waiting on a branch per operation. The operands' range is tracked
// per lane (FastRange), and a lane out of it computes its four elements again with __fdiv_rn
// and __fsqrt_rn. The range is narrower than the hardware's: divisors in [2^-58, 2^58),
// dividends zero or of magnitude in the same range, so that no operand, residual or quotient is
// subnormal or overflows, where the sequence equals div.rn (crates/optim/tests/cuda_adam4bit.rs
// checks it against __fdiv_rn over every significand of the dividend); the square root takes
// sqrt.rn's own range, capped at 2^116 so that its root is a dividend in range.
struct Divisor {
    float d, r;  // the divisor and its reciprocal, refined as div.rn's fast path refines it
};

__device__ __forceinline__ Divisor divisor_of(float d) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(d));
    return Divisor{d, fmaf(r0, fmaf(-d, r0, 1.0f), r0)};
}

// Whether a divisor is in the fast arithmetic's range: positive, [2^-58, 2^58).
__device__ __forceinline__ bool divides_fast(float d) {
    return __float_as_uint(d) - (69u << 23) < (116u << 23);
}

// a / q.d, correctly rounded when both are in range. A zero dividend comes out +0 from the
// sequence; the dividend's sign bit makes it -0 for -0 (and changes nothing else: the divisor
// is positive).
__device__ __forceinline__ float quotient(float a, const Divisor& q) {
    const float q0 = __fmul_rn(a, q.r);
    const float y = fmaf(q.r, fmaf(-q.d, q0, a), q0);
    return __uint_as_float(__float_as_uint(y) | (__float_as_uint(a) & 0x80000000u));
}

// sqrt(x), correctly rounded when x is in range: sqrt.rn's fast path.
__device__ __forceinline__ float square_root(float x) {
    float y;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    const float s = __fmul_rn(x, y);
    return fmaf(fmaf(-s, s, x), __fmul_rn(y, 0.5f), s);
}

// A lane's operands of the fast arithmetic, as integers so that tracking costs no branch: the
// largest magnitude's bits (shifted past the sign), the smallest nonzero one's less one (a zero
// wraps to the top and never lowers it), and the square roots' operands' bits above sqrt.rn's
// lowest fast one (a zero or a value under it wraps to the top).
struct FastRange {
    unsigned top = 0u, bottom = 0xffffffffu, root = 0u;
    __device__ __forceinline__ void dividend(float x) {
        const unsigned u = __float_as_uint(x) << 1;
        top = max(top, u);
        bottom = min(bottom, u - 1u);
    }
    __device__ __forceinline__ void radicand(float x) { root = max(root, __float_as_uint(x) - 0x0d000000u); }
    // Every dividend zero or in [2^-58, 2^58), every radicand in [2^-101, 2^116).
    __device__ __forceinline__ bool holds() const {
        return top < (185u << 24) && bottom >= (69u << 24) - 1u && root < (217u << 23);
    }
};

// ao_update in the fast arithmetic: the same operations in the same order, the dividends and
// radicand tracked in `range` (the divisors bc1 and sqrt_bc2 are checked once a piece).
__device__ __forceinline__ void ao_update_fast(const AoConsts& c, const Divisor& bc1, const Divisor& sqrt_bc2,
                                               float& p, float g, float& m, float& v, FastRange& range) {
    ao_moments(c, p, g, m, v);
    range.dividend(m);
    range.radicand(v);
    const float denom = __fadd_rn(quotient(square_root(v), sqrt_bc2), c.eps);
    const float step = __fmul_rn(c.lr, quotient(m, bc1));
    range.dividend(denom);
    range.dividend(step);
    p = __fsub_rn(p, quotient(step, divisor_of(denom)));
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

// The code bins: the same codes in one shared-memory read. A scaled value's bits name its bin:
// the sign, then (clamped below at 2^-10) its binade and three bits of significand, so a bin
// covers an eighth of a binade, and every value under 2^-9 shares the binade 2^-10's eight bins.
// Each bin keeps its least value's code and the threshold of the next code, +inf where the bin
// holds none, as long as no bin holds two thresholds (true of torchao's two tables: their
// thresholds nearest each other lie 1/16 apart in [1/2, 1) and 1/32 apart in [1/4, 1/2); the
// kernel checks it when it fills the bins and otherwise searches by code4). A scaled value is at
// most 1 in magnitude (the fast path's quotients are exact), so its binade is at most 2^0.
#define CODE_BINADES 11  // 2^-10 to 2^0
#define CODE_BINS (2 * CODE_BINADES * 8)
#define CODE_BIN_FLOOR (117u << 3)  // 2^-10's exponent and three bits of significand

__device__ __forceinline__ unsigned code_bin(float y) {
    const unsigned u = __float_as_uint(y);
    return max((u >> 20) & 0x7ffu, CODE_BIN_FLOOR) - CODE_BIN_FLOOR + (u >> 31) * (CODE_BINADES * 8);
}

// Bin i's entry from the thresholds t: x the next code's threshold (or +inf), y the least
// value's code (as bits); false when the bin holds two thresholds.
__device__ __forceinline__ bool fill_code_bin(const float* t, unsigned i, float2* bin) {
    const unsigned binade = (i / 8) % CODE_BINADES;
    const unsigned least_bits = binade == 0 ? 0u : ((117u + binade) << 23) | ((i % 8) << 20);
    const unsigned most_bits = binade == 0 ? (118u << 23) - 1u : least_bits | 0xfffffu;
    const bool negative = i >= CODE_BINADES * 8;
    const float least = negative ? -__uint_as_float(most_bits) : __uint_as_float(least_bits);
    const float most = negative ? -__uint_as_float(least_bits) : __uint_as_float(most_bits);
    const unsigned low = code4(t, least), high = code4(t, most);
    *bin = make_float2(high > low ? t[high] : __int_as_float(0x7f800000), __uint_as_float(low));
    return high <= low + 1;
}

__device__ __forceinline__ unsigned code_by_bins(const float2* bins, float y) {
    const float2 bin = bins[code_bin(y)];
    return __float_as_uint(bin.y) + (y >= bin.x ? 1u : 0u);
}

// torch.maximum in one instruction (max.NaN, sm_80 on): NaN if either is NaN, as some NaN.
__device__ __forceinline__ float maximum_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float warp_maximum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = maximum_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A block's scale from its absmax: NaN stays NaN (Rust's NaN, as the host stores it), else at
// least 1e-12 (`clip(1e-12)`).
__device__ __forceinline__ float block_scale(float amax) {
    return amax != amax ? RUST_NAN : fmaxf(amax, 1e-12f);
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
    __shared__ float2 bins[2][CODE_BINS];
    __shared__ int bins_exact;
    if (threadIdx.x == 0) bins_exact = 1;
    __syncthreads();
    for (unsigned i = threadIdx.x; i < 2 * CODE_BINS; i += blockDim.x)
        if (!fill_code_bin(tables + (i < CODE_BINS ? 32 : 48), i % CODE_BINS, &bins[i / CODE_BINS][i % CODE_BINS]))
            bins_exact = 0;
    __syncthreads();
    const bool by_bins = bins_exact != 0;
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
    Divisor bc1, sqrt_bc2, unscale;
    bool piece_fast = false;  // whether the piece's divisors are in the fast arithmetic's range
    for (unsigned long long b = (unsigned long long)blockIdx.x * AO_WARPS + threadIdx.x / 32; b < n_blocks; b += warps) {
        if (b < lo || b >= hi) {
            piece = find_piece(pieces, n_pieces, b);
            const Ao4Piece& found = pieces[piece];
            lo = found.head.first_block;
            hi = lo + (found.head.len + AO_BLOCK - 1) / AO_BLOCK;
            c = ao_consts(found);
            scaled = grad_scale_of(grad_scale, found.flags, found.grad_scale, &scale);
            r = param_rounding(found.head, found.flags, found.seed, found.param_index);
            bc1 = divisor_of(c.bc1);
            sqrt_bc2 = divisor_of(c.sqrt_bc2);
            unscale = divisor_of(scale);
            piece_fast = divides_fast(c.bc1) && divides_fast(c.sqrt_bc2) && (!scaled || divides_fast(scale));
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
        float m[4], v[4], np[4], a1 = 0.0f, a2 = 0.0f;
        FastRange range;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned shift = 8 * (k / 2) + ((k & 1) ? 0 : 4);
            m[k] = __fmul_rn(q1[(w1 >> shift) & 15u], old1);
            v[k] = __fmul_rn(q2[(w2 >> shift) & 15u], old2);
            float gk = gv[k];
            if (scaled) {
                range.dividend(gk);
                gk = quotient(gk, unscale);
            }
            np[k] = pv[k];
            ao_update_fast(c, bc1, sqrt_bc2, np[k], gk, m[k], v[k], range);
        }
        if (!(piece_fast && range.holds())) {  // an operand out of range: the lane's four again
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned shift = 8 * (k / 2) + ((k & 1) ? 0 : 4);
                m[k] = __fmul_rn(q1[(w1 >> shift) & 15u], old1);
                v[k] = __fmul_rn(q2[(w2 >> shift) & 15u], old2);
                const float gk = scaled ? __fdiv_rn(gv[k], scale) : gv[k];
                np[k] = pv[k];
                ao_update(c, np[k], gk, m[k], v[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            pv[k] = np[k];
            a1 = maximum_nan(a1, fabsf(m[k]));
            a2 = maximum_nan(a2, fabsf(v[k]));
        }
        const float scale1 = block_scale(warp_maximum(a1)), scale2 = block_scale(warp_maximum(a2));
        // The codes' quotients need only their divisors in range: |m| and v are at most their
        // scale, so a dividend under 2^-58 has a quotient under 2^-17 (scales are at least 1e-12)
        // exactly and in the sequence, far inside the code nearest zero either way (its
        // thresholds are ±0.00275 signed, 3/32 unsigned).
        unsigned n1 = 0, n2 = 0;
        if (by_bins && divides_fast(scale1) && divides_fast(scale2)) {
            const Divisor by1 = divisor_of(scale1), by2 = divisor_of(scale2);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned shift = 8 * (k / 2) + ((k & 1) ? 0 : 4);
                n1 |= code_by_bins(bins[0], quotient(m[k], by1)) << shift;
                n2 |= code_by_bins(bins[1], quotient(v[k], by2)) << shift;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned shift = 8 * (k / 2) + ((k & 1) ? 0 : 4);
                n1 |= code4(t1, __fdiv_rn(m[k], scale1)) << shift;
                n2 |= code4(t2, __fdiv_rn(v[k], scale2)) << shift;
            }
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

// Test support (crates/optim/tests/cuda_adam4bit.rs, through
// crates/optim/src/cuda/adam4bit.rs' fast_arithmetic_mismatches): thread i takes the float of
// biased exponent `exponent`, significand i % 2^23 and sign bit i / 2^23. As a dividend the
// fast path admits, it is divided by each of the n_divisors divisors the fast path admits, and
// mismatches[0] counts the quotients whose bits differ from __fdiv_rn's; as a radicand the fast
// path admits, mismatches[1] counts the square roots whose bits differ from __fsqrt_rn's.
extern "C" __global__ void adam4bit_fast_arithmetic_mismatches(const float* divisors, unsigned n_divisors,
                                                               unsigned exponent, unsigned* mismatches) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (2u << 23)) return;
    const float x = __uint_as_float(((i >> 23) << 31) | ((exponent & 0xffu) << 23) | (i & 0x7fffffu));
    FastRange dividend;
    dividend.dividend(x);
    unsigned quotients = 0;
    if (dividend.holds()) {
        for (unsigned k = 0; k < n_divisors; ++k) {
            const float d = divisors[k];
            if (divides_fast(d) && __float_as_uint(quotient(x, divisor_of(d))) != __float_as_uint(__fdiv_rn(x, d)))
                ++quotients;
        }
    }
    if (quotients) atomicAdd(&mismatches[0], quotients);
    FastRange radicand;
    radicand.radicand(x);
    if (radicand.holds() && __float_as_uint(square_root(x)) != __float_as_uint(__fsqrt_rn(x)))
        atomicAdd(&mismatches[1], 1u);
}
