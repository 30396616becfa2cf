// Fused scaled-dot-product attention for f32 on tensor cores (FlashAttention-2 style): forward,
// and the backward as two kernels (dQ with each query's Δ = dO·O, then dK and dV).
//
// f32 accuracy from TF32 tensor cores by the split PyTorch's memory-efficient kernel also uses
// (CUTLASS's "fast f32"): every operand x is split into a TF32 value and its TF32 remainder,
// x = big + small, and each product is small·big + big·small + big·big on `mma.sync.m16n8k8`
// with f32 accumulators (the small·small term, below f32 rounding, is dropped).
//
// The kernel bodies are attention_flash.cuh's; this file is their f32 policy. The other side
// streams KR = 32 or 64 rows at a time (32 fits twice the blocks an SM: the host picks by
// sequence length). Tiles sit in shared memory as f32 [rows][DP + 4] (DP = the head dim rounded
// up to 32): a row stride of 4 banks mod 32 makes every fragment load conflict-free, both the
// row-major ones (lane 4g + t reads row g, column t: bank 4g + t) and the k-major ones of the
// weighted sums (row 2t, column g: bank 8t + g). The accumulator layout of Q·Kᵀ (row g, columns
// 2t and 2t + 1 of each 8-column tile) is taken as the A operand of P·V with the 8 keys of a tile
// permuted (operand column t is key 2t, column t + 4 key 2t + 1), and the B operand reads V's
// rows in the same order, so no shuffle is needed. Each streamed tile's weighted sum is formed in
// fresh accumulators and added to the running one in f32 (tensor cores do not round their sums
// to nearest, so a sum over thousands of keys kept inside them drifts: dK at 2048 tokens and
// groups of 4 missed f32's 1e-5 by 4x that way).
//
// Needs: head dims a multiple of 4 up to 128, every operand's offset and strides multiples of 4
// elements and 16-byte aligned buffers (the `vector` flag of AttnArgs;
// crates/ops-cuda/src/attention/tensor_core.rs checks, other f32 operands take attention.cu's
// register-tiled kernels). Built to compute_80 PTX by `cargo xtask build-kernels`.

#include "attention_flash.cuh"

// x = big + small, both TF32: each rounded to its top 11 significant bits (to nearest, ties away
// from zero, by adding half a TF32 unit to the bit pattern and clearing the 13 low bits; infinities
// and NaNs stay what they are), which is what `cvt.rna.tf32.f32` computes without its special-case
// branches (a third of the split's instructions at sm_90).
struct Split {
    unsigned int big, small;
};
__device__ __forceinline__ unsigned int round_tf32(float x) {
    return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}
__device__ __forceinline__ Split split(float x) {
    Split s;
    s.big = round_tf32(x);
    s.small = round_tf32(x - __uint_as_float(s.big));
    return s;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += a·b in f32 accuracy from split operands (a: 16×8 A fragment, b: 8×8 B fragment); the small
// terms first, as CUTLASS orders them.
__device__ __forceinline__ void mma_split(float (&c)[4], const Split (&a)[4], const Split (&b)[2]) {
    mma_tf32(c, a[0].small, a[1].small, a[2].small, a[3].small, b[0].big, b[1].big);
    mma_tf32(c, a[0].big, a[1].big, a[2].big, a[3].big, b[0].small, b[1].small);
    mma_tf32(c, a[0].big, a[1].big, a[2].big, a[3].big, b[0].big, b[1].big);
}

// The f32 policy of attention_flash.cuh.
struct Tf32 {
    typedef float Elem;
    static constexpr int PAD = 4;

    // acc[n] (NB n-tiles of 8 columns) += the warp's 16 rows of `x` (rows row0..) times the 8·NB rows
    // of `y` as columns: x·yᵀ over DP. Fragments (lane = 4g + t): A rows g and g + 8, columns t and
    // t + 4 of each 8-wide k step; B row (= output column) g, the same columns.
    template <int DP, int NB>
    static __device__ __forceinline__ void rows_by_rows(float (&acc)[NB][4], const float* x, int row0, const float* y) {
        constexpr int S = DP + 4;
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const float* xr = x + (row0 + g) * S + t;
        const float* yr = y + g * S + t;
    #pragma unroll 2
        for (int kk = 0; kk < DP / 8; ++kk) {
            const Split a[4] = {split(xr[kk * 8]), split(xr[8 * S + kk * 8]), split(xr[kk * 8 + 4]),
                                split(xr[8 * S + kk * 8 + 4])};
    #pragma unroll
            for (int n = 0; n < NB; ++n) {
                const Split b[2] = {split(yr[n * 8 * S + kk * 8]), split(yr[n * 8 * S + kk * 8 + 4])};
                mma_split(acc[n], a, b);
            }
        }
    }

    // out += w·z: w the warp's 16 × 8·NB weights in accumulator layout, z a [8·NB][DP + 4] tile (its
    // rows are w's columns). For the 8 columns of w's n-tile k, operand column t is column 2t and
    // column t + 4 column 2t + 1 (what the accumulator holds), and B reads z's rows 8k + 2t and
    // 8k + 2t + 1. The tile's sum is formed in fresh accumulators and added to `out` in f32: tensor
    // cores add without rounding to nearest, so long sums stay short inside them (a key tile each);
    // head dims over 64 take their columns in two halves, bounding the registers this holds.
    template <int DP, int NB>
    static __device__ __forceinline__ void weights_by_rows(float (&out)[DP / 8][4], const float (&w)[NB][4], const float* z) {
        constexpr int S = DP + 4, NT = DP / 8, HALF = NT > 8 ? NT / 2 : NT;
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const float* zr = z + 2 * t * S + g;
    #pragma unroll
        for (int d0 = 0; d0 < NT; d0 += HALF) {
            float tile[HALF][4] = {};
    #pragma unroll
            for (int k = 0; k < NB; ++k) {
                const Split a[4] = {split(w[k][0]), split(w[k][2]), split(w[k][1]), split(w[k][3])};
    #pragma unroll
                for (int dn = 0; dn < HALF; ++dn) {
                    const Split b[2] = {split(zr[k * 8 * S + (d0 + dn) * 8]), split(zr[(k * 8 + 1) * S + (d0 + dn) * 8])};
                    mma_split(tile[dn], a, b);
                }
            }
    #pragma unroll
            for (int dn = 0; dn < HALF; ++dn)
    #pragma unroll
                for (int e = 0; e < 4; ++e) out[d0 + dn][e] += tile[dn][e];
        }
    }

    static __device__ __forceinline__ void store2(float* p, float lo, float hi) {
        *reinterpret_cast<float2*>(p) = make_float2(lo, hi);
    }

    template <int N> static __device__ __forceinline__ float dot(const float* x, const float* y) {
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < N; c += 4) {
            const float4 u = *reinterpret_cast<const float4*>(x + c), v = *reinterpret_cast<const float4*>(y + c);
            sum += u.x * v.x + u.y * v.y + u.z * v.z + u.w * v.w;
        }
        return sum;
    }
};

// attention_tf32_forward_<DP>_<KR> and so on: 32 or 64 streamed rows for head dims up to 64, 64
// above; the dK/dV kernels with 32 streamed rows bounded to 3 blocks an SM (168 registers).
FLASH_KERNELS(Tf32, tf32, 32_32, 32, 1, 32, 1, 32, 32, 3)
FLASH_KERNELS(Tf32, tf32, 64_32, 64, 1, 32, 1, 32, 32, 3)
FLASH_KERNELS(Tf32, tf32, 32_64, 32, 1, 64, 1, 64, 64, 1)
FLASH_KERNELS(Tf32, tf32, 64_64, 64, 1, 64, 1, 64, 64, 1)
FLASH_KERNELS(Tf32, tf32, 96_64, 96, 1, 64, 1, 64, 64, 1)
FLASH_KERNELS(Tf32, tf32, 128_64, 128, 1, 64, 1, 64, 64, 1)
