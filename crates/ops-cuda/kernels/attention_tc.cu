// Fused scaled-dot-product attention on tensor cores for f16 and bf16 (FlashAttention-2 style):
// forward, and the backward as two kernels (dQ with each query's Δ = dO·O, then dK and dV).
//
// A block of 4 warps takes one (batch, head) pair and 64 of its rows (queries forward and for dQ,
// keys for dK/dV); each warp owns 16 of them. Grouped-query heads are read in place (kv head
// h / group); a dK/dV block takes one (batch, kv head) and streams the query tiles of every head of
// its group through one pipeline, summing in registers. Rows see contiguous ranges of the other
// side (attention.cuh: causal, and one packed sequence's through `cu_seqlens`); a block streams
// only the union of its rows' ranges and masks each element against its row's. The other side streams through shared memory 64 rows
// at a time, double-buffered with `cp.async` (the next tile loads while this one is used). Tiles
// sit in shared memory as [64][DP + 8] (DP = the head dim rounded up to 32; the 8-element pad makes
// `ldmatrix` conflict-free), zero past the head dim and past the last row. Every product is
// `mma.sync.m16n8k16` (16-bit operands, f32 accumulators), operands fetched with `ldmatrix`
// (`.trans` where the tile is stored k-major). Score tiles never leave registers: the accumulator
// layout of one product is the operand layout of the next, so probabilities (and score gradients)
// are rounded to the storage dtype and fed straight back. Softmax is online (running max and sum,
// base-2 exponentials of log2(e)-prescaled scores, row reductions over the 4 lanes of a row);
// backward recomputes probabilities from the saved f32 log-sum-exp, and its accumulators need no
// rescaling. The dK/dV kernel computes the transposed scores K·Qᵀ directly, so Pᵀ and dSᵀ are
// operands of dV += Pᵀ·dO and dK += dSᵀ·Q without a transpose. Results are staged through the
// warp's own rows of shared memory and written with 16-byte stores.
//
// Needs: head dims a multiple of 8 up to 128, every operand's offset and strides multiples of 8
// elements and 16-byte aligned buffers (crates/ops-cuda/src/attention/tensor_core.rs checks; other shapes
// take the cuBLAS path). Built to compute_80 PTX by `cargo xtask build-kernels`.

#include <math_constants.h>

#include "attention.cuh"
#include "elements.cuh"

// Rows per block and per streamed tile, threads per block (4 warps of 16 rows).
#define TC_ROWS 64
#define TC_THREADS 128
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f

__device__ __forceinline__ unsigned int smem_address(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

// 16 bytes from global to shared memory, asynchronously; `bytes` = 0 writes zeros instead.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm4(unsigned int (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldsm4_trans(unsigned int (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(p)));
}

// The storage dtype's tensor-core product c += a·b (16×8×16) and its two-value packing.
template <typename T> struct Tc;
template <> struct Tc<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned int (&a)[4], unsigned int b0,
                                               unsigned int b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ float2 unpack(unsigned int v) {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
    }
};
template <> struct Tc<__half> {
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned int (&a)[4], unsigned int b0,
                                               unsigned int b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ float2 unpack(unsigned int v) {
        return __half22float2(*reinterpret_cast<__half2*>(&v));
    }
};

// Fragments (m16n8k16 layouts; lane = 4·g + t). An A fragment is the 16×16 block at (row0, col0)
// of a row-major tile with row stride S.
template <int S, typename T>
__device__ __forceinline__ void frag_a(unsigned int (&a)[4], const T* tile, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    ldsm4(a, tile + (row0 + (lane & 15)) * S + col0 + (lane >> 4) * 8);
}
// B fragments of the n-tiles n0 and n0 + 8 (b[0..2] and b[2..4]) over k0..k0 + 16, from a tile
// stored n-major (row n holds the k values: keys for Q·Kᵀ).
template <int S, typename T>
__device__ __forceinline__ void frag_b_nk(unsigned int (&b)[4], const T* tile, int n0, int k0) {
    const int lane = threadIdx.x & 31, mat = lane >> 3;
    ldsm4(b, tile + (n0 + (lane & 7) + (mat >> 1) * 8) * S + k0 + (mat & 1) * 8);
}
// The same from a tile stored k-major (row k holds the n values: values for P·V).
template <int S, typename T>
__device__ __forceinline__ void frag_b_kn(unsigned int (&b)[4], const T* tile, int k0, int n0) {
    const int lane = threadIdx.x & 31, mat = lane >> 3;
    ldsm4_trans(b, tile + (k0 + (lane & 7) + (mat & 1) * 8) * S + n0 + (mat >> 1) * 8);
}

// acc[n] (n-tiles of 8 columns, NT of them) += the warp's 16 rows of `x` (tile, rows row0..) times
// the 64 rows of `y` as columns: x·yᵀ over DP.
template <typename T, int DP>
__device__ __forceinline__ void rows_by_rows(float (&acc)[8][4], const T* x, int row0, const T* y) {
    constexpr int S = DP + 8;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        unsigned int a[4];
        frag_a<S>(a, x, row0, kk * 16);
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
            unsigned int b[4];
            frag_b_nk<S>(b, y, nn * 16, kk * 16);
            Tc<T>::mma(acc[2 * nn], a, b[0], b[1]);
            Tc<T>::mma(acc[2 * nn + 1], a, b[2], b[3]);
        }
    }
}

// out += w·z: w the warp's 16 × 64 weights in accumulator layout (rounded to T here), z a
// [64][DP + 8] tile (its rows are w's columns).
template <typename T, int DP>
__device__ __forceinline__ void weights_by_rows(float (&out)[DP / 8][4], const float (&w)[8][4], const T* z) {
    constexpr int S = DP + 8;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const unsigned int a[4] = {Tc<T>::pack(w[2 * kk][0], w[2 * kk][1]), Tc<T>::pack(w[2 * kk][2], w[2 * kk][3]),
                                   Tc<T>::pack(w[2 * kk + 1][0], w[2 * kk + 1][1]),
                                   Tc<T>::pack(w[2 * kk + 1][2], w[2 * kk + 1][3])};
#pragma unroll
        for (int dn = 0; dn < DP / 16; ++dn) {
            unsigned int b[4];
            frag_b_kn<S>(b, z, kk * 16, dn * 16);
            Tc<T>::mma(out[2 * dn], a, b[0], b[1]);
            Tc<T>::mma(out[2 * dn + 1], a, b[2], b[3]);
        }
    }
}

// Rows first..first + 64 of operand `op` of pair (b, h) into `tile` ([64][DP + 8]), asynchronously;
// zeros past the head dim and past `limit`.
template <typename T, int DP>
__device__ __forceinline__ void load_tile(T* tile, const T* src, const AttnArgs& a, int op, unsigned int b,
                                          unsigned int h, unsigned int first, unsigned int limit) {
    constexpr int CHUNKS = DP / 8, S = DP + 8;
    for (int idx = threadIdx.x; idx < TC_ROWS * CHUNKS; idx += TC_THREADS) {
        const int r = idx / CHUNKS, c = (idx - r * CHUNKS) * 8;
        const unsigned int row = first + r;
        const bool in = row < limit && c < (int)a.head_dim;
        cp_async16(tile + r * S + c, in ? src + row_at(a, op, b, h, row) + c : src, in ? 16 : 0);
    }
}

// Writes the warp's 16 rows (accumulator layout, times mul) to operand `op`, rows first.. of pair
// (b, h), through `stage` (the warp's own 16 rows of a tile, no longer read by anyone).
template <typename T, int DP>
__device__ __forceinline__ void store_rows(T* dst, const AttnArgs& a, int op, unsigned int b, unsigned int h,
                                          unsigned int first, unsigned int limit, const float (&acc)[DP / 8][4],
                                          const float (&mul)[2], T* stage) {
    constexpr int S = DP + 8, CHUNKS = DP / 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
            *reinterpret_cast<unsigned int*>(stage + (g + 8 * rr) * S + n * 8 + 2 * t) =
                Tc<T>::pack(acc[n][2 * rr] * mul[rr], acc[n][2 * rr + 1] * mul[rr]);
    __syncwarp();
    for (int idx = lane; idx < 16 * CHUNKS; idx += 32) {
        const int r = idx / CHUNKS, c = (idx - r * CHUNKS) * 8;
        const unsigned int row = first + r;
        if (row < limit && c < (int)a.head_dim)
            *reinterpret_cast<uint4*>(dst + row_at(a, op, b, h, row) + c) =
                *reinterpret_cast<const uint4*>(stage + r * S + c);
    }
}

template <typename T, int DP>
__device__ void tc_forward(const T* q, const T* k, const T* v, T* o, float* lse, const AttnArgs& a) {
    constexpr int S = DP + 8, TILE = TC_ROWS * S, NT = DP / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* qs = (T*)smem_raw;    // [64][S]
    T* ks = qs + TILE;       // 2 × [64][S]
    T* vs = ks + 2 * TILE;   // 2 × [64][S]
    const unsigned int b = blockIdx.y / a.heads, h = blockIdx.y % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = blockIdx.x * TC_ROWS, row0 = q0 + warp * 16 + g;
    unsigned int key_begin, key_end, lo[2], hi[2];
    block_range(a, true, q0, TC_ROWS, key_begin, key_end);
    keys_seen(a, row0, lo[0], hi[0]);
    keys_seen(a, row0 + 8, lo[1], hi[1]);
    const int tiles = (key_end - key_begin + TC_ROWS - 1) / TC_ROWS;
    load_tile<T, DP>(qs, q, a, OP_Q, b, h, q0, a.queries);
    if (tiles > 0) {
        load_tile<T, DP>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<T, DP>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float acc[NT][4] = {}, m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.f, 0.f};
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * TC_ROWS;
        if (j + 1 < tiles) {
            const int next = (j + 1) & 1;
            load_tile<T, DP>(ks + next * TILE, k, a, OP_K, b, kvh, k0 + TC_ROWS, a.keys);
            load_tile<T, DP>(vs + next * TILE, v, a, OP_V, b, kvh, k0 + TC_ROWS, a.keys);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const T* kt = ks + (j & 1) * TILE;
        const T* vt = vs + (j & 1) * TILE;
        float s[8][4] = {};
        rows_by_rows<T, DP>(s, qs, warp * 16, kt);
        float base[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int n = 0; n < 8; ++n)
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
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[n][e] - base[e >> 1]);
                l[e >> 1] += p;
                s[n][e] = p;
            }
        weights_by_rows<T, DP>(acc, s, vt);
        __syncthreads();
    }
    cp_wait<0>();
    float inv[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float total = l[rr];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        inv[rr] = total > 0.f ? 1.f / total : 0.f;
        const unsigned int row = row0 + 8 * rr;
        if (t == 0 && row < a.queries)
            lse[(unsigned long long)blockIdx.y * a.queries + row] = (m[rr] + log2f(total)) * TC_LN2;
    }
    store_rows<T, DP>(o, a, OP_O, b, h, q0 + warp * 16, a.queries, acc, inv, qs + warp * 16 * S);
}

// dQ of 64 queries, streaming keys and values; also writes Δ = dO·O of those queries.
template <typename T, int DP>
__device__ void tc_backward_dq(const T* q, const T* k, const T* v, const T* o, const T* dout, const float* lse,
                               T* dq, float* delta, const AttnArgs& a) {
    constexpr int S = DP + 8, TILE = TC_ROWS * S, NT = DP / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* qs = (T*)smem_raw;                       // [64][S]
    T* dos = qs + TILE;                         // [64][S]
    T* ks = dos + TILE;                         // 2 × [64][S]
    T* vs = ks + 2 * TILE;                      // 2 × [64][S]
    float* lses = (float*)(vs + 2 * TILE);      // [64], log2 domain
    float* deltas = lses + TC_ROWS;             // [64]
    const unsigned int b = blockIdx.y / a.heads, h = blockIdx.y % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = blockIdx.x * TC_ROWS, row0 = q0 + warp * 16 + g;
    const unsigned long long stats = (unsigned long long)blockIdx.y * a.queries;
    unsigned int key_begin, key_end, lo[2], hi[2];
    block_range(a, true, q0, TC_ROWS, key_begin, key_end);
    keys_seen(a, row0, lo[0], hi[0]);
    keys_seen(a, row0 + 8, lo[1], hi[1]);
    const int tiles = (key_end - key_begin + TC_ROWS - 1) / TC_ROWS;
    load_tile<T, DP>(qs, q, a, OP_Q, b, h, q0, a.queries);
    load_tile<T, DP>(dos, dout, a, OP_DO, b, h, q0, a.queries);
    // O only for Δ, in the second key buffer (free until the first prefetch).
    load_tile<T, DP>(ks + TILE, o, a, OP_O, b, h, q0, a.queries);
    if (tiles > 0) {
        load_tile<T, DP>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<T, DP>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    {
        // Two threads per query, half the head dim each.
        const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
        const unsigned int* op = reinterpret_cast<const unsigned int*>(ks + TILE + r * S + half * (DP / 2));
        const unsigned int* gp = reinterpret_cast<const unsigned int*>(dos + r * S + half * (DP / 2));
        float dl = 0.f;
#pragma unroll
        for (int c = 0; c < DP / 4; ++c) {
            const float2 x = Tc<T>::unpack(op[c]), y = Tc<T>::unpack(gp[c]);
            dl += x.x * y.x + x.y * y.y;
        }
        dl += __shfl_xor_sync(0xffffffff, dl, 1);
        const unsigned int row = q0 + r;
        if (half == 0) {
            deltas[r] = dl;
            lses[r] = row < a.queries ? lse[stats + row] * TC_LOG2E : 0.f;
            if (row < a.queries) delta[stats + row] = dl;
        }
    }
    __syncthreads();
    float l2[2], dl[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        l2[rr] = lses[warp * 16 + g + 8 * rr];
        dl[rr] = deltas[warp * 16 + g + 8 * rr];
    }
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float acc[NT][4] = {};
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * TC_ROWS;
        if (j + 1 < tiles) {
            const int next = (j + 1) & 1;
            load_tile<T, DP>(ks + next * TILE, k, a, OP_K, b, kvh, k0 + TC_ROWS, a.keys);
            load_tile<T, DP>(vs + next * TILE, v, a, OP_V, b, kvh, k0 + TC_ROWS, a.keys);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const T* kt = ks + (j & 1) * TILE;
        const T* vt = vs + (j & 1) * TILE;
        float s[8][4] = {}, dp[8][4] = {};
        rows_by_rows<T, DP>(s, qs, warp * 16, kt);
        rows_by_rows<T, DP>(dp, dos, warp * 16, vt);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = e >> 1;
                const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                const bool hidden = key < lo[rr] || key >= hi[rr];
                const float p = hidden ? 0.f : exp2f(s[n][e] * scale2 - l2[rr]);
                s[n][e] = p * (dp[n][e] - dl[rr]);
            }
        weights_by_rows<T, DP>(acc, s, kt);
        __syncthreads();
    }
    const float scale = (float)a.scale, mul[2] = {scale, scale};
    store_rows<T, DP>(dq, a, OP_DQ, b, h, q0 + warp * 16, a.queries, acc, mul, qs + warp * 16 * S);
}

// Loads the log-sum-exp (log2 domain) and Δ of queries first..first + 64 into shared memory.
__device__ __forceinline__ void load_query_stats(float* lses, float* deltas, const float* lse, const float* delta,
                                                 unsigned long long stats, unsigned int first, unsigned int queries) {
    for (int i = threadIdx.x; i < TC_ROWS; i += TC_THREADS) {
        const bool in = first + i < queries;
        lses[i] = in ? lse[stats + first + i] * TC_LOG2E : 0.f;
        deltas[i] = in ? delta[stats + first + i] : 0.f;
    }
}

// dK and dV of 64 keys, streaming queries, dO, log-sum-exp and Δ.
template <typename T, int DP>
__device__ void tc_backward_dkdv(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                 const float* delta, T* dk, T* dv, const AttnArgs& a) {
    constexpr int S = DP + 8, TILE = TC_ROWS * S, NT = DP / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* ks = (T*)smem_raw;                       // [64][S]
    T* vs = ks + TILE;                          // [64][S]
    T* qs = vs + TILE;                          // 2 × [64][S]
    T* dos = qs + 2 * TILE;                     // 2 × [64][S]
    float* lses = (float*)(dos + 2 * TILE);     // 2 × [64], log2 domain
    float* deltas = lses + 2 * TC_ROWS;         // 2 × [64]
    // One block per (batch, kv head) and 64 keys: dK and dV sum over the group's query heads, whose
    // query tiles stream one after the other through one double-buffered pipeline (step s: head
    // s / tiles of the group, query tile s % tiles).
    const unsigned int b = blockIdx.y / a.kv_heads, kvh = blockIdx.y % a.kv_heads, group = group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int k0 = blockIdx.x * TC_ROWS, key0 = k0 + warp * 16 + g;
    // Each key sees queries [lo, hi) (causal: none before it); the block the union.
    unsigned int query_begin, query_end, lo[2], hi[2];
    block_range(a, false, k0, TC_ROWS, query_begin, query_end);
    queries_seeing(a, key0, lo[0], hi[0]);
    queries_seeing(a, key0 + 8, lo[1], hi[1]);
    const unsigned int tiles = (query_end - query_begin + TC_ROWS - 1) / TC_ROWS, steps = group * tiles;
    // Where step s reads: its query head's statistics and first query.
    auto head_of = [&](unsigned int step) { return kvh * group + step / tiles; };
    auto first_query = [&](unsigned int step) { return query_begin + step % tiles * TC_ROWS; };
    auto stats_of = [&](unsigned int step) {
        return ((unsigned long long)b * a.heads + head_of(step)) * a.queries;
    };
    load_tile<T, DP>(ks, k, a, OP_K, b, kvh, k0, a.keys);
    load_tile<T, DP>(vs, v, a, OP_V, b, kvh, k0, a.keys);
    if (steps > 0) {
        load_tile<T, DP>(qs, q, a, OP_Q, b, head_of(0), first_query(0), a.queries);
        load_tile<T, DP>(dos, dout, a, OP_DO, b, head_of(0), first_query(0), a.queries);
        load_query_stats(lses, deltas, lse, delta, stats_of(0), first_query(0), a.queries);
    }
    cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float dka[NT][4] = {}, dva[NT][4] = {};
    for (unsigned int j = 0; j < steps; ++j) {
        const unsigned int q0 = first_query(j);
        const int buf = j & 1;
        if (j + 1 < steps) {
            const int next = buf ^ 1;
            const unsigned int h1 = head_of(j + 1), q1 = first_query(j + 1);
            load_tile<T, DP>(qs + next * TILE, q, a, OP_Q, b, h1, q1, a.queries);
            load_tile<T, DP>(dos + next * TILE, dout, a, OP_DO, b, h1, q1, a.queries);
            load_query_stats(lses + next * TC_ROWS, deltas + next * TC_ROWS, lse, delta, stats_of(j + 1), q1,
                             a.queries);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const T* qt = qs + buf * TILE;
        const T* dot = dos + buf * TILE;
        const float* l2 = lses + buf * TC_ROWS;
        const float* dl = deltas + buf * TC_ROWS;
        // Transposed: rows are the warp's keys, columns the tile's queries.
        float s[8][4] = {}, dp[8][4] = {};
        rows_by_rows<T, DP>(s, ks, warp * 16, qt);
        rows_by_rows<T, DP>(dp, vs, warp * 16, dot);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t + (e & 1);
                const unsigned int query = q0 + col;
                const bool hidden = query < lo[e >> 1] || query >= hi[e >> 1];
                const float p = hidden ? 0.f : exp2f(s[n][e] * scale2 - l2[col]);
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - dl[col]);
            }
        weights_by_rows<T, DP>(dva, s, dot);
        weights_by_rows<T, DP>(dka, dp, qt);
        __syncthreads();
    }
    cp_wait<0>();
    const float scale = (float)a.scale, mul_k[2] = {scale, scale}, one[2] = {1.f, 1.f};
    store_rows<T, DP>(dk, a, OP_DK, b, kvh, k0 + warp * 16, a.keys, dka, mul_k, ks + warp * 16 * S);
    store_rows<T, DP>(dv, a, OP_DV, b, kvh, k0 + warp * 16, a.keys, dva, one, vs + warp * 16 * S);
}

// Kernels per dtype and padded head dim: `attention_tc_forward_<dtype>_<DP>` and so on.
#define ATTENTION_TC_KERNELS(T, N, DP)                                                                     \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_tc_forward_##N##_##DP(              \
        const T* q, const T* k, const T* v, T* o, float* lse, AttnArgs a) {                                \
        tc_forward<T, DP>(q, k, v, o, lse, a);                                                             \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_tc_backward_dq_##N##_##DP(          \
        const T* q, const T* k, const T* v, const T* o, const T* dout, const float* lse, T* dq,            \
        float* delta, AttnArgs a) {                                                                        \
        tc_backward_dq<T, DP>(q, k, v, o, dout, lse, dq, delta, a);                                        \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attention_tc_backward_dkdv_##N##_##DP(        \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dk,    \
        T* dv, AttnArgs a) {                                                                               \
        tc_backward_dkdv<T, DP>(q, k, v, dout, lse, delta, dk, dv, a);                                     \
    }

#define ATTENTION_TC_WIDTHS(T, N)      \
    ATTENTION_TC_KERNELS(T, N, 32)     \
    ATTENTION_TC_KERNELS(T, N, 64)     \
    ATTENTION_TC_KERNELS(T, N, 96)     \
    ATTENTION_TC_KERNELS(T, N, 128)

ATTENTION_TC_WIDTHS(__nv_bfloat16, bf16)
ATTENTION_TC_WIDTHS(__half, f16)
