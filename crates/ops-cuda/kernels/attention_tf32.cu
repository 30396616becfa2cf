// Fused scaled-dot-product attention for f32 on tensor cores (FlashAttention-2 style): forward,
// and the backward as two kernels (dQ with each query's Δ = dO·O, then dK and dV).
//
// f32 accuracy from TF32 tensor cores by the split PyTorch's memory-efficient kernel also uses
// (CUTLASS's "fast f32"): every operand x is split into a TF32 value and its TF32 remainder,
// x = big + small, and each product is small·big + big·small + big·big on `mma.sync.m16n8k8`
// with f32 accumulators (the small·small term, below f32 rounding, is dropped).
//
// The shape is attention_tc.cu's: a block of 4 warps takes one (batch, head) pair and 64 of its
// rows (queries forward and for dQ, keys for dK/dV), each warp 16 of them; the other side streams
// through shared memory KR = 32 or 64 rows at a time (32 fits twice the blocks an SM: the host
// picks by sequence length), double-buffered with `cp.async`. Tiles sit in shared memory as f32
// [rows][DP + 4] (DP = the head dim rounded up to 32): a row stride of 4 banks mod 32 makes every
// fragment load conflict-free, both the row-major ones (lane 4g + t reads row g, column t: bank
// 4g + t) and the k-major ones of the weighted sums (row 2t, column g: bank 8t + g). Score tiles
// never leave registers: the accumulator layout of Q·Kᵀ (row g, columns 2t and 2t + 1 of each
// 8-column tile) is taken as the A operand of P·V with the 8 keys of a tile permuted (operand
// column t is key 2t, column t + 4 key 2t + 1), and the B operand reads V's rows in the same
// order, so no shuffle is needed. Each streamed tile's weighted sum is formed in fresh
// accumulators and added to the running one in f32 (tensor cores do not round their sums to
// nearest, so a sum over thousands of keys kept inside them drifts: dK at 2048 tokens and groups
// of 4 missed f32's 1e-5 by 4x that way). Softmax is online (running max and sum, base-2
// exponentials of log2(e)-prescaled scores, row reductions over the 4 lanes of a row); backward
// recomputes probabilities from the saved log-sum-exp. The dK/dV kernel computes the transposed
// scores K·Qᵀ directly, so Pᵀ and dSᵀ are operands of dV += Pᵀ·dO and dK += dSᵀ·Q.
// Grouped-query heads, the causal mask and packed sequences are attention.cuh's, as in the other
// kernels.
//
// Needs: head dims a multiple of 4 up to 128, every operand's offset and strides multiples of 4
// elements and 16-byte aligned buffers (the `vector` flag of AttnArgs;
// crates/ops-cuda/src/attention/split_tf32.rs checks, other f32 operands take attention.cu's
// register-tiled kernels). Built to compute_80 PTX by `cargo xtask build-kernels`.

#include <math_constants.h>

#include "attention.cuh"

// Own rows per block, threads per block (4 warps of 16 rows).
#define TF_ROWS 64
#define TF_THREADS 128
#define TF_LOG2E 1.4426950408889634f
#define TF_LN2 0.6931471805599453f

__device__ __forceinline__ unsigned int tf_smem_address(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

// 16 bytes from global to shared memory, asynchronously; `bytes` = 0 writes zeros instead.
__device__ __forceinline__ void tf_cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tf_smem_address(dst)), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void tf_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void tf_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

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

// acc[n] (NB n-tiles of 8 columns) += the warp's 16 rows of `x` (rows row0..) times the 8·NB rows
// of `y` as columns: x·yᵀ over DP. Fragments (lane = 4g + t): A rows g and g + 8, columns t and
// t + 4 of each 8-wide k step; B row (= output column) g, the same columns.
template <int DP, int NB>
__device__ __forceinline__ void rows_by_rows(float (&acc)[NB][4], const float* x, int row0, const float* y) {
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
__device__ __forceinline__ void weights_by_rows(float (&out)[DP / 8][4], const float (&w)[NB][4], const float* z) {
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

// Rows first..first + ROWS of operand `op` of pair (b, h) into `tile` ([ROWS][DP + 4]),
// asynchronously; zeros past the head dim and past `limit`.
template <int DP, int ROWS>
__device__ __forceinline__ void load_tile(float* tile, const float* src, const AttnArgs& a, int op, unsigned int b,
                                          unsigned int h, unsigned int first, unsigned int limit) {
    constexpr int CHUNKS = DP / 4, S = DP + 4;
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += TF_THREADS) {
        const int r = idx / CHUNKS, c = (idx - r * CHUNKS) * 4;
        const unsigned int row = first + r;
        const bool in = row < limit && c < (int)a.head_dim;
        tf_cp_async16(tile + r * S + c, in ? src + row_at(a, op, b, h, row) + c : src, in ? 16 : 0);
    }
}

// Writes the warp's 16 rows (accumulator layout, times mul) to operand `op`, rows first.. of pair
// (b, h), through `stage` (the warp's own 16 rows of a tile, no longer read by anyone).
template <int DP>
__device__ __forceinline__ void store_rows(float* dst, const AttnArgs& a, int op, unsigned int b, unsigned int h,
                                          unsigned int first, unsigned int limit, const float (&acc)[DP / 8][4],
                                          const float (&mul)[2], float* stage) {
    constexpr int S = DP + 4, CHUNKS = DP / 4;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
            *reinterpret_cast<float2*>(stage + (g + 8 * rr) * S + n * 8 + 2 * t) =
                make_float2(acc[n][2 * rr] * mul[rr], acc[n][2 * rr + 1] * mul[rr]);
    __syncwarp();
    for (int idx = lane; idx < 16 * CHUNKS; idx += 32) {
        const int r = idx / CHUNKS, c = (idx - r * CHUNKS) * 4;
        const unsigned int row = first + r;
        if (row < limit && c < (int)a.head_dim)
            *reinterpret_cast<float4*>(dst + row_at(a, op, b, h, row) + c) =
                *reinterpret_cast<const float4*>(stage + r * S + c);
    }
}

template <int DP, int KR>
__device__ void tf_forward(const float* q, const float* k, const float* v, float* o, float* lse,
                           const AttnArgs& a) {
    constexpr int S = DP + 4, TILE = TF_ROWS * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* qs = (float*)smem_raw;  // [64][S]
    float* ks = qs + TILE;         // 2 × [KR][S]
    float* vs = ks + 2 * KTILE;    // 2 × [KR][S]
    const unsigned int b = blockIdx.y / a.heads, h = blockIdx.y % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = blockIdx.x * TF_ROWS, row0 = q0 + warp * 16 + g;
    unsigned int key_begin, key_end, lo[2], hi[2];
    block_range(a, true, q0, TF_ROWS, key_begin, key_end);
    keys_seen(a, row0, lo[0], hi[0]);
    keys_seen(a, row0 + 8, lo[1], hi[1]);
    const int tiles = (key_end - key_begin + KR - 1) / KR;
    load_tile<DP, TF_ROWS>(qs, q, a, OP_Q, b, h, q0, a.queries);
    if (tiles > 0) {
        load_tile<DP, KR>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<DP, KR>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    tf_cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float acc[NT][4] = {}, m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.f, 0.f};
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * KR;
        if (j + 1 < tiles) {
            const int next = (j + 1) & 1;
            load_tile<DP, KR>(ks + next * KTILE, k, a, OP_K, b, kvh, k0 + KR, a.keys);
            load_tile<DP, KR>(vs + next * KTILE, v, a, OP_V, b, kvh, k0 + KR, a.keys);
            tf_cp_commit();
            tf_cp_wait<1>();
        } else {
            tf_cp_wait<0>();
        }
        __syncthreads();
        const float* kt = ks + (j & 1) * KTILE;
        const float* vt = vs + (j & 1) * KTILE;
        float s[NB][4] = {};
        rows_by_rows<DP, NB>(s, qs, warp * 16, kt);
        float base[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const unsigned int key = k0 + n * 8 + 2 * t + e;
                    float x = s[n][2 * rr + e] * scale2;
                    if (key < lo[rr] || key >= hi[rr]) x = -CUDART_INF_F;
                    s[n][2 * rr + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float m_new = fmaxf(m[rr], mx);
            base[rr] = m_new == -CUDART_INF_F ? 0.f : m_new;
            const float correction = exp2f(m[rr] - base[rr]);
            m[rr] = m_new;
            l[rr] *= correction;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                acc[n][2 * rr] *= correction;
                acc[n][2 * rr + 1] *= correction;
            }
        }
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[n][e] - base[e >> 1]);
                l[e >> 1] += p;
                s[n][e] = p;
            }
        weights_by_rows<DP, NB>(acc, s, vt);
        __syncthreads();
    }
    tf_cp_wait<0>();
    float inv[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float total = l[rr];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        inv[rr] = total > 0.f ? 1.f / total : 0.f;
        const unsigned int row = row0 + 8 * rr;
        if (t == 0 && row < a.queries)
            lse[(unsigned long long)blockIdx.y * a.queries + row] = (m[rr] + log2f(total)) * TF_LN2;
    }
    store_rows<DP>(o, a, OP_O, b, h, q0 + warp * 16, a.queries, acc, inv, qs + warp * 16 * S);
}

// dQ of 64 queries, streaming keys and values; also writes Δ = dO·O of those queries.
template <int DP, int KR>
__device__ void tf_backward_dq(const float* q, const float* k, const float* v, const float* o, const float* dout,
                               const float* lse, float* dq, float* delta, const AttnArgs& a) {
    constexpr int S = DP + 4, TILE = TF_ROWS * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* qs = (float*)smem_raw;  // [64][S]
    float* dos = qs + TILE;        // [64][S]
    float* ks = dos + TILE;        // 2 × [KR][S]
    float* vs = ks + 2 * KTILE;    // 2 × [KR][S]
    float* lses = vs + 2 * KTILE;  // [64], log2 domain
    float* deltas = lses + TF_ROWS;  // [64]
    const unsigned int b = blockIdx.y / a.heads, h = blockIdx.y % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = blockIdx.x * TF_ROWS, row0 = q0 + warp * 16 + g;
    const unsigned long long stats = (unsigned long long)blockIdx.y * a.queries;
    unsigned int key_begin, key_end, lo[2], hi[2];
    block_range(a, true, q0, TF_ROWS, key_begin, key_end);
    keys_seen(a, row0, lo[0], hi[0]);
    keys_seen(a, row0 + 8, lo[1], hi[1]);
    const int tiles = (key_end - key_begin + KR - 1) / KR;
    load_tile<DP, TF_ROWS>(qs, q, a, OP_Q, b, h, q0, a.queries);
    load_tile<DP, TF_ROWS>(dos, dout, a, OP_DO, b, h, q0, a.queries);
    // O only for Δ, where the key and value tiles go next (4·KR ≥ 64 rows).
    load_tile<DP, TF_ROWS>(ks, o, a, OP_O, b, h, q0, a.queries);
    tf_cp_commit();
    tf_cp_wait<0>();
    __syncthreads();
    {
        // Two threads per query, half the head dim each.
        const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
        const float* op = ks + r * S + half * (DP / 2);
        const float* gp = dos + r * S + half * (DP / 2);
        float dl = 0.f;
#pragma unroll
        for (int c = 0; c < DP / 2; c += 4) {
            const float4 x = *reinterpret_cast<const float4*>(op + c), y = *reinterpret_cast<const float4*>(gp + c);
            dl += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
        }
        dl += __shfl_xor_sync(0xffffffff, dl, 1);
        const unsigned int row = q0 + r;
        if (half == 0) {
            deltas[r] = dl;
            lses[r] = row < a.queries ? lse[stats + row] * TF_LOG2E : 0.f;
            if (row < a.queries) delta[stats + row] = dl;
        }
    }
    __syncthreads();
    if (tiles > 0) {
        load_tile<DP, KR>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<DP, KR>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    tf_cp_commit();
    float l2[2], dl[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        l2[rr] = lses[warp * 16 + g + 8 * rr];
        dl[rr] = deltas[warp * 16 + g + 8 * rr];
    }
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float acc[NT][4] = {};
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * KR;
        if (j + 1 < tiles) {
            const int next = (j + 1) & 1;
            load_tile<DP, KR>(ks + next * KTILE, k, a, OP_K, b, kvh, k0 + KR, a.keys);
            load_tile<DP, KR>(vs + next * KTILE, v, a, OP_V, b, kvh, k0 + KR, a.keys);
            tf_cp_commit();
            tf_cp_wait<1>();
        } else {
            tf_cp_wait<0>();
        }
        __syncthreads();
        const float* kt = ks + (j & 1) * KTILE;
        const float* vt = vs + (j & 1) * KTILE;
        float s[NB][4] = {}, dp[NB][4] = {};
        rows_by_rows<DP, NB>(s, qs, warp * 16, kt);
        rows_by_rows<DP, NB>(dp, dos, warp * 16, vt);
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = e >> 1;
                const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                const bool hidden = key < lo[rr] || key >= hi[rr];
                const float p = hidden ? 0.f : exp2f(s[n][e] * scale2 - l2[rr]);
                s[n][e] = p * (dp[n][e] - dl[rr]);
            }
        weights_by_rows<DP, NB>(acc, s, kt);
        __syncthreads();
    }
    const float scale = (float)a.scale, mul[2] = {scale, scale};
    store_rows<DP>(dq, a, OP_DQ, b, h, q0 + warp * 16, a.queries, acc, mul, qs + warp * 16 * S);
}

// Loads the log-sum-exp (log2 domain) and Δ of queries first..first + ROWS into shared memory.
template <int ROWS>
__device__ __forceinline__ void tf_load_query_stats(float* lses, float* deltas, const float* lse, const float* delta,
                                                    unsigned long long stats, unsigned int first,
                                                    unsigned int queries) {
    for (int i = threadIdx.x; i < ROWS; i += TF_THREADS) {
        const bool in = first + i < queries;
        lses[i] = in ? lse[stats + first + i] * TF_LOG2E : 0.f;
        deltas[i] = in ? delta[stats + first + i] : 0.f;
    }
}

// dK and dV of 64 keys, streaming queries, dO, log-sum-exp and Δ.
template <int DP, int KR>
__device__ void tf_backward_dkdv(const float* q, const float* k, const float* v, const float* dout, const float* lse,
                                 const float* delta, float* dk, float* dv, const AttnArgs& a) {
    constexpr int S = DP + 4, TILE = TF_ROWS * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* ks = (float*)smem_raw;      // [64][S]
    float* vs = ks + TILE;             // [64][S]
    float* qs = vs + TILE;             // 2 × [KR][S]
    float* dos = qs + 2 * KTILE;       // 2 × [KR][S]
    float* lses = dos + 2 * KTILE;     // 2 × [KR], log2 domain
    float* deltas = lses + 2 * KR;     // 2 × [KR]
    // One block per (batch, kv head) and 64 keys: dK and dV sum over the group's query heads, whose
    // query tiles stream one after the other through one double-buffered pipeline (step s: head
    // s / tiles of the group, query tile s % tiles).
    const unsigned int b = blockIdx.y / a.kv_heads, kvh = blockIdx.y % a.kv_heads, group = group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int k0 = blockIdx.x * TF_ROWS, key0 = k0 + warp * 16 + g;
    unsigned int query_begin, query_end, lo[2], hi[2];
    block_range(a, false, k0, TF_ROWS, query_begin, query_end);
    queries_seeing(a, key0, lo[0], hi[0]);
    queries_seeing(a, key0 + 8, lo[1], hi[1]);
    const unsigned int tiles = (query_end - query_begin + KR - 1) / KR, steps = group * tiles;
    auto head_of = [&](unsigned int step) { return kvh * group + step / tiles; };
    auto first_query = [&](unsigned int step) { return query_begin + step % tiles * KR; };
    auto stats_of = [&](unsigned int step) {
        return ((unsigned long long)b * a.heads + head_of(step)) * a.queries;
    };
    load_tile<DP, TF_ROWS>(ks, k, a, OP_K, b, kvh, k0, a.keys);
    load_tile<DP, TF_ROWS>(vs, v, a, OP_V, b, kvh, k0, a.keys);
    if (steps > 0) {
        load_tile<DP, KR>(qs, q, a, OP_Q, b, head_of(0), first_query(0), a.queries);
        load_tile<DP, KR>(dos, dout, a, OP_DO, b, head_of(0), first_query(0), a.queries);
        tf_load_query_stats<KR>(lses, deltas, lse, delta, stats_of(0), first_query(0), a.queries);
    }
    tf_cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float dka[NT][4] = {}, dva[NT][4] = {};
    for (unsigned int j = 0; j < steps; ++j) {
        const unsigned int q0 = first_query(j);
        const int buf = j & 1;
        if (j + 1 < steps) {
            const int next = buf ^ 1;
            const unsigned int h1 = head_of(j + 1), q1 = first_query(j + 1);
            load_tile<DP, KR>(qs + next * KTILE, q, a, OP_Q, b, h1, q1, a.queries);
            load_tile<DP, KR>(dos + next * KTILE, dout, a, OP_DO, b, h1, q1, a.queries);
            tf_load_query_stats<KR>(lses + next * KR, deltas + next * KR, lse, delta, stats_of(j + 1), q1,
                                a.queries);
            tf_cp_commit();
            tf_cp_wait<1>();
        } else {
            tf_cp_wait<0>();
        }
        __syncthreads();
        const float* qt = qs + buf * KTILE;
        const float* dot = dos + buf * KTILE;
        const float* l2 = lses + buf * KR;
        const float* dl = deltas + buf * KR;
        // Transposed: rows are the warp's keys, columns the tile's queries.
        float s[NB][4] = {}, dp[NB][4] = {};
        rows_by_rows<DP, NB>(s, ks, warp * 16, qt);
        rows_by_rows<DP, NB>(dp, vs, warp * 16, dot);
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t + (e & 1);
                const unsigned int query = q0 + col;
                const bool hidden = query < lo[e >> 1] || query >= hi[e >> 1];
                const float p = hidden ? 0.f : exp2f(s[n][e] * scale2 - l2[col]);
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - dl[col]);
            }
        weights_by_rows<DP, NB>(dva, s, dot);
        weights_by_rows<DP, NB>(dka, dp, qt);
        __syncthreads();
    }
    tf_cp_wait<0>();
    const float scale = (float)a.scale, mul_k[2] = {scale, scale}, one[2] = {1.f, 1.f};
    store_rows<DP>(dk, a, OP_DK, b, kvh, k0 + warp * 16, a.keys, dka, mul_k, ks + warp * 16 * S);
    store_rows<DP>(dv, a, OP_DV, b, kvh, k0 + warp * 16, a.keys, dva, one, vs + warp * 16 * S);
}

// Kernels per padded head dim and streamed rows: `attention_tf32_forward_<DP>_<KR>` and so on;
// the dK/dV kernel's registers bounded to fit MINB blocks an SM.
#define ATTENTION_TF32_KERNELS(DP, KR, MINB)                                                                    \
    extern "C" __global__ void __launch_bounds__(TF_THREADS) attention_tf32_forward_##DP##_##KR(           \
        const float* q, const float* k, const float* v, float* o, float* lse, AttnArgs a) {                \
        tf_forward<DP, KR>(q, k, v, o, lse, a);                                                            \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TF_THREADS) attention_tf32_backward_dq_##DP##_##KR(       \
        const float* q, const float* k, const float* v, const float* o, const float* dout,                 \
        const float* lse, float* dq, float* delta, AttnArgs a) {                                           \
        tf_backward_dq<DP, KR>(q, k, v, o, dout, lse, dq, delta, a);                                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TF_THREADS, MINB) attention_tf32_backward_dkdv_##DP##_##KR(     \
        const float* q, const float* k, const float* v, const float* dout, const float* lse,               \
        const float* delta, float* dk, float* dv, AttnArgs a) {                                            \
        tf_backward_dkdv<DP, KR>(q, k, v, dout, lse, delta, dk, dv, a);                                    \
    }

ATTENTION_TF32_KERNELS(32, 32, 3)
ATTENTION_TF32_KERNELS(64, 32, 3)
ATTENTION_TF32_KERNELS(96, 32, 1)
ATTENTION_TF32_KERNELS(128, 32, 1)
ATTENTION_TF32_KERNELS(32, 64, 1)
ATTENTION_TF32_KERNELS(64, 64, 1)
ATTENTION_TF32_KERNELS(96, 64, 1)
ATTENTION_TF32_KERNELS(128, 64, 1)
