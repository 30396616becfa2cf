// The FlashAttention-2-style kernel bodies shared by the tensor-core attention kernels:
// attention_tc.cu (f16/bf16 on `mma.sync.m16n8k16`) and attention_tf32.cu (f32 on split TF32).
// They differ only in their element type and their products, which a policy `M` supplies:
//
//   typedef Elem;      the element in global and shared memory
//   PAD                elements padding each shared row (a row holds DP + PAD)
//   rows_by_rows<DP, NB>(acc, x, row0, y)     acc[NB][4] += the warp's 16 rows of x · the 8·NB
//                                             rows of y (as columns), over DP
//   weights_by_rows<DP, NB>(out, w, z)        out[DP/8][4] += w (16 × 8·NB, accumulator layout)
//                                             · z ([8·NB][DP + PAD])
//   store2(p, lo, hi)  two values of a row, rounded to Elem, at p
//   dot<N>(x, y)       Σ x·y over N elements of two shared rows
//
// A block of R / 16 warps takes one (batch, head) pair and R = 64 of its rows (queries forward
// and for dQ, keys for dK/dV), each warp 16 of them (32-row blocks, tried for batch-1 grids of
// under two 64-row blocks an SM, ran slower on the H200: ViT-L/16's 197 tokens at batch 1,
// backward 76 against 71-74 µs); the other side streams through shared memory KR rows at
// a time, double-buffered with `cp.async`. Tiles sit in shared memory as [rows][DP + PAD], zero
// past the head dim and past the last row. Score tiles never leave registers: the accumulator
// layout of one product is the operand of the next. Softmax is online (running max and sum,
// base-2 exponentials of log2(e)-prescaled scores, row reductions over the 4 lanes of a row);
// backward recomputes probabilities from the saved f32 log-sum-exp, and its accumulators need no
// rescaling. The dQ kernel first writes each query's Δ = dO·O; the dK/dV kernel computes the
// transposed scores K·Qᵀ directly, so Pᵀ and dSᵀ are operands of dV += Pᵀ·dO and dK += dSᵀ·Q,
// and takes one (batch, key/value head) with the query tiles of every head of its group streamed
// through one pipeline, summing in registers. Rows see contiguous ranges of the other side
// (attention.cuh: causal, and one packed sequence's through `cu_seqlens`); a block streams only
// the union of its rows' ranges and masks each element against its row's, in the tiles that
// cross some row's range only (a warp-uniform test). Under a causal mask the grid is walked
// tile-major, heaviest tiles first (`block_tile`). Exponentials are one `ex2` each, the softmax
// scale folded into their FMA. Results are staged through the warp's own rows of shared memory
// and written with 16-byte stores.

#pragma once

#include <math_constants.h>

#include "attention.cuh"

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

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

// 2^x on the special-function unit, subnormal results flushed to zero (one instruction; exp2f
// adds a subnormal fix-up around it, for probabilities below 2^-126 that round away anyway).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// This block's tile of own rows and its (batch, head) pair. Under a causal mask the tiles differ
// in work (a query tile sees the keys up to it, a key tile the queries from it on): the grid is
// walked tile-major, the heaviest tiles first, so the light ones fill the last wave instead of
// the heavy ones trailing it. Otherwise x is the tile, y the pair.
__device__ __forceinline__ void block_tile(const AttnArgs& a, bool heavy_last, unsigned int& tile,
                                           unsigned int& pair) {
    if (!a.causal) {
        tile = blockIdx.x;
        pair = blockIdx.y;
        return;
    }
    const unsigned int linear = blockIdx.y * gridDim.x + blockIdx.x, rank = linear / gridDim.y;
    pair = linear - rank * gridDim.y;
    tile = heavy_last ? gridDim.x - 1 - rank : rank;
}

// [lo, hi) of the other side's rows that every own row of the warp meets (rows_met of the rows a
// lane holds, reduced over the warp's 8 row groups): a tile inside it needs no mask.
__device__ __forceinline__ void warp_common_range(const unsigned int (&lo)[2], const unsigned int (&hi)[2],
                                                  unsigned int& common_lo, unsigned int& common_hi) {
    unsigned int l = max(lo[0], lo[1]), h = min(hi[0], hi[1]);
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
        l = max(l, __shfl_xor_sync(0xffffffff, l, offset));
        h = min(h, __shfl_xor_sync(0xffffffff, h, offset));
    }
    common_lo = l;
    common_hi = h;
}

// Rows first..first + ROWS of operand `op` of pair (b, h) into `tile` ([ROWS][DP + PAD]),
// asynchronously, 16 bytes at a time by THREADS threads; zeros past the head dim and past `limit`.
template <typename M, int DP, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(typename M::Elem* tile, const typename M::Elem* src, const AttnArgs& a,
                                          int op, unsigned int b, unsigned int h, unsigned int first,
                                          unsigned int limit) {
    constexpr int CHUNK = 16 / sizeof(typename M::Elem), CHUNKS = DP / CHUNK, S = DP + M::PAD;
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = (idx - r * CHUNKS) * CHUNK;
        const unsigned int row = first + r;
        const bool in = row < limit && c < (int)a.head_dim;
        cp_async16(tile + r * S + c, in ? src + row_at(a, op, b, h, row) + c : src, in ? 16 : 0);
    }
}

// Writes the warp's 16 rows (accumulator layout, times mul) to operand `op`, rows first.. of pair
// (b, h), through `stage` (the warp's own 16 rows of a tile, no longer read by anyone).
template <typename M, int DP>
__device__ __forceinline__ void store_rows(typename M::Elem* dst, const AttnArgs& a, int op, unsigned int b,
                                           unsigned int h, unsigned int first, unsigned int limit,
                                           const float (&acc)[DP / 8][4], const float (&mul)[2],
                                           typename M::Elem* stage) {
    constexpr int CHUNK = 16 / sizeof(typename M::Elem), CHUNKS = DP / CHUNK, S = DP + M::PAD;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
            M::store2(stage + (g + 8 * rr) * S + n * 8 + 2 * t, acc[n][2 * rr] * mul[rr], acc[n][2 * rr + 1] * mul[rr]);
    __syncwarp();
    for (int idx = lane; idx < 16 * CHUNKS; idx += 32) {
        const int r = idx / CHUNKS, c = (idx - r * CHUNKS) * CHUNK;
        const unsigned int row = first + r;
        if (row < limit && c < (int)a.head_dim)
            *reinterpret_cast<uint4*>(dst + row_at(a, op, b, h, row) + c) =
                *reinterpret_cast<const uint4*>(stage + r * S + c);
    }
}

// Step j of a block's walk over `tiles` key tiles (this one's first key k0; K and V double-buffered
// at ks and vs; R own rows, 2R threads): prefetches tile j + 1 into the other buffers, then waits for tile j and syncs.
template <typename M, int DP, int KR, int R>
__device__ __forceinline__ void key_tile_ready(int j, int tiles, typename M::Elem* ks, typename M::Elem* vs,
                                               const typename M::Elem* k, const typename M::Elem* v,
                                               const AttnArgs& a, unsigned int b, unsigned int kvh,
                                               unsigned int k0) {
    constexpr int KTILE = KR * (DP + M::PAD);
    if (j + 1 < tiles) {
        const int next = (j + 1) & 1;
        load_tile<M, DP, KR, 2 * R>(ks + next * KTILE, k, a, OP_K, b, kvh, k0 + KR, a.keys);
        load_tile<M, DP, KR, 2 * R>(vs + next * KTILE, v, a, OP_V, b, kvh, k0 + KR, a.keys);
        cp_commit();
        cp_wait<1>();
    } else {
        cp_wait<0>();
    }
    __syncthreads();
}

template <typename M, int DP, int KR, int R>
__device__ void flash_forward(const typename M::Elem* q, const typename M::Elem* k, const typename M::Elem* v,
                              typename M::Elem* o, float* lse, const AttnArgs& a) {
    typedef typename M::Elem T;
    constexpr int S = DP + M::PAD, TILE = R * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* qs = (T*)smem_raw;    // [R][S]
    T* ks = qs + TILE;       // 2 × [KR][S]
    T* vs = ks + 2 * KTILE;  // 2 × [KR][S]
    unsigned int tile, pair;
    block_tile(a, true, tile, pair);
    const unsigned int b = pair / a.heads, h = pair % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = tile * R, row0 = q0 + warp * 16 + g;
    unsigned int key_begin, key_end, lo[2], hi[2], common_lo, common_hi;
    block_range(a, true, q0, R, key_begin, key_end);
    keys_seen(a, row0, lo[0], hi[0]);
    keys_seen(a, row0 + 8, lo[1], hi[1]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const int tiles = (key_end - key_begin + KR - 1) / KR;
    load_tile<M, DP, R, 2 * R>(qs, q, a, OP_Q, b, h, q0, a.queries);
    if (tiles > 0) {
        load_tile<M, DP, KR, 2 * R>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<M, DP, KR, 2 * R>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float acc[NT][4] = {}, m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.f, 0.f};
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * KR;
        key_tile_ready<M, DP, KR, R>(j, tiles, ks, vs, k, v, a, b, kvh, k0);
        const T* kt = ks + (j & 1) * KTILE;
        const T* vt = vs + (j & 1) * KTILE;
        float s[NB][4] = {};
        M::template rows_by_rows<DP, NB>(s, qs, warp * 16, kt);
        // Raw scores; hidden ones -inf (only tiles that cross a row's range need the test). The
        // scale is applied inside the exponent's FMA: scale2 > 0 keeps the maximum's place.
        if (k0 < common_lo || k0 + KR > common_hi) {
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                    if (key < lo[e >> 1] || key >= hi[e >> 1]) s[n][e] = -CUDART_INF_F;
                }
        }
        float base[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float mx = -CUDART_INF_F;
#pragma unroll
            for (int n = 0; n < NB; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * rr], s[n][2 * rr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float m_new = fmaxf(m[rr], mx * scale2);
            base[rr] = m_new == -CUDART_INF_F ? 0.f : m_new;
            const float correction = fast_exp2(m[rr] - base[rr]);
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
                const float p = fast_exp2(fmaf(s[n][e], scale2, -base[e >> 1]));
                l[e >> 1] += p;
                s[n][e] = p;
            }
        M::template weights_by_rows<DP, NB>(acc, s, vt);
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
            lse[(unsigned long long)pair * a.queries + row] = (m[rr] + log2f(total)) * FA_LN2;
    }
    store_rows<M, DP>(o, a, OP_O, b, h, q0 + warp * 16, a.queries, acc, inv, qs + warp * 16 * S);
}

// dQ of R queries, streaming keys and values; also writes Δ = dO·O of those queries.
template <typename M, int DP, int KR, int R>
__device__ void flash_backward_dq(const typename M::Elem* q, const typename M::Elem* k, const typename M::Elem* v,
                                  const typename M::Elem* o, const typename M::Elem* dout, const float* lse,
                                  typename M::Elem* dq, float* delta, const AttnArgs& a) {
    typedef typename M::Elem T;
    constexpr int S = DP + M::PAD, TILE = R * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* qs = (T*)smem_raw;      // [R][S]
    T* dos = qs + TILE;        // [R][S]
    T* ks = dos + TILE;        // 2 × [KR][S]
    T* vs = ks + 2 * KTILE;    // 2 × [KR][S]
    float* lses = (float*)(vs + 2 * KTILE);  // [R], log2 domain
    float* deltas = lses + R;                // [R]
    unsigned int tile, pair;
    block_tile(a, true, tile, pair);
    const unsigned int b = pair / a.heads, h = pair % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = tile * R, row0 = q0 + warp * 16 + g;
    const unsigned long long stats = (unsigned long long)pair * a.queries;
    unsigned int key_begin, key_end, lo[2], hi[2], common_lo, common_hi;
    block_range(a, true, q0, R, key_begin, key_end);
    keys_seen(a, row0, lo[0], hi[0]);
    keys_seen(a, row0 + 8, lo[1], hi[1]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const int tiles = (key_end - key_begin + KR - 1) / KR;
    load_tile<M, DP, R, 2 * R>(qs, q, a, OP_Q, b, h, q0, a.queries);
    load_tile<M, DP, R, 2 * R>(dos, dout, a, OP_DO, b, h, q0, a.queries);
    // O only for Δ: in the second key buffer, loading beside the first key and value tiles, when
    // it holds R rows (KR ≥ R); else where those tiles go, which then load after Δ (4·KR ≥ R).
    constexpr bool beside = KR >= R;
    T* os = beside ? ks + KTILE : ks;
    load_tile<M, DP, R, 2 * R>(os, o, a, OP_O, b, h, q0, a.queries);
    if (beside && tiles > 0) {
        load_tile<M, DP, KR, 2 * R>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<M, DP, KR, 2 * R>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    {
        // Two threads per query, half the head dim each.
        const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
        float dl = M::template dot<DP / 2>(os + r * S + half * (DP / 2), dos + r * S + half * (DP / 2));
        dl += __shfl_xor_sync(0xffffffff, dl, 1);
        const unsigned int row = q0 + r;
        if (half == 0) {
            deltas[r] = dl;
            lses[r] = row < a.queries ? lse[stats + row] * FA_LOG2E : 0.f;
            if (row < a.queries) delta[stats + row] = dl;
        }
    }
    __syncthreads();
    if (!beside && tiles > 0) {
        load_tile<M, DP, KR, 2 * R>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<M, DP, KR, 2 * R>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
        cp_commit();
    }
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
        key_tile_ready<M, DP, KR, R>(j, tiles, ks, vs, k, v, a, b, kvh, k0);
        const T* kt = ks + (j & 1) * KTILE;
        const T* vt = vs + (j & 1) * KTILE;
        float s[NB][4] = {}, dp[NB][4] = {};
        M::template rows_by_rows<DP, NB>(s, qs, warp * 16, kt);
        M::template rows_by_rows<DP, NB>(dp, dos, warp * 16, vt);
        if (k0 < common_lo || k0 + KR > common_hi) {
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                    if (key < lo[e >> 1] || key >= hi[e >> 1]) s[n][e] = -CUDART_INF_F;
                }
        }
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = e >> 1;
                const float p = fast_exp2(fmaf(s[n][e], scale2, -l2[rr]));
                s[n][e] = p * (dp[n][e] - dl[rr]);
            }
        M::template weights_by_rows<DP, NB>(acc, s, kt);
        __syncthreads();
    }
    const float scale = (float)a.scale, mul[2] = {scale, scale};
    store_rows<M, DP>(dq, a, OP_DQ, b, h, q0 + warp * 16, a.queries, acc, mul, qs + warp * 16 * S);
}

// Loads the log-sum-exp (log2 domain) and Δ of queries first..first + ROWS into shared memory.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_query_stats(float* lses, float* deltas, const float* lse, const float* delta,
                                                 unsigned long long stats, unsigned int first,
                                                 unsigned int queries) {
    for (int i = threadIdx.x; i < ROWS; i += THREADS) {
        const bool in = first + i < queries;
        lses[i] = in ? lse[stats + first + i] * FA_LOG2E : 0.f;
        deltas[i] = in ? delta[stats + first + i] : 0.f;
    }
}

// dK and dV of R keys, streaming queries, dO, log-sum-exp and Δ.
template <typename M, int DP, int KR, int R>
__device__ void flash_backward_dkdv(const typename M::Elem* q, const typename M::Elem* k, const typename M::Elem* v,
                                   const typename M::Elem* dout, const float* lse, const float* delta,
                                   typename M::Elem* dk, typename M::Elem* dv, const AttnArgs& a) {
    typedef typename M::Elem T;
    constexpr int S = DP + M::PAD, TILE = R * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* ks = (T*)smem_raw;                     // [R][S]
    T* vs = ks + TILE;                        // [R][S]
    T* qs = vs + TILE;                        // 2 × [KR][S]
    T* dos = qs + 2 * KTILE;                  // 2 × [KR][S]
    float* lses = (float*)(dos + 2 * KTILE);  // 2 × [KR], log2 domain
    float* deltas = lses + 2 * KR;            // 2 × [KR]
    // One block per (batch, kv head) and R keys: dK and dV sum over the group's query heads, whose
    // query tiles stream one after the other through one double-buffered pipeline (step s: head
    // s / tiles of the group, query tile s % tiles).
    unsigned int tile, pair;
    block_tile(a, false, tile, pair);
    const unsigned int b = pair / a.kv_heads, kvh = pair % a.kv_heads, group = group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int k0 = tile * R, key0 = k0 + warp * 16 + g;
    unsigned int query_begin, query_end, lo[2], hi[2], common_lo, common_hi;
    block_range(a, false, k0, R, query_begin, query_end);
    queries_seeing(a, key0, lo[0], hi[0]);
    queries_seeing(a, key0 + 8, lo[1], hi[1]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const unsigned int tiles = (query_end - query_begin + KR - 1) / KR, steps = group * tiles;
    auto head_of = [&](unsigned int step) { return kvh * group + step / tiles; };
    auto first_query = [&](unsigned int step) { return query_begin + step % tiles * KR; };
    auto stats_of = [&](unsigned int step) {
        return ((unsigned long long)b * a.heads + head_of(step)) * a.queries;
    };
    load_tile<M, DP, R, 2 * R>(ks, k, a, OP_K, b, kvh, k0, a.keys);
    load_tile<M, DP, R, 2 * R>(vs, v, a, OP_V, b, kvh, k0, a.keys);
    if (steps > 0) {
        load_tile<M, DP, KR, 2 * R>(qs, q, a, OP_Q, b, head_of(0), first_query(0), a.queries);
        load_tile<M, DP, KR, 2 * R>(dos, dout, a, OP_DO, b, head_of(0), first_query(0), a.queries);
        load_query_stats<KR, 2 * R>(lses, deltas, lse, delta, stats_of(0), first_query(0), a.queries);
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
            load_tile<M, DP, KR, 2 * R>(qs + next * KTILE, q, a, OP_Q, b, h1, q1, a.queries);
            load_tile<M, DP, KR, 2 * R>(dos + next * KTILE, dout, a, OP_DO, b, h1, q1, a.queries);
            load_query_stats<KR, 2 * R>(lses + next * KR, deltas + next * KR, lse, delta, stats_of(j + 1), q1,
                                a.queries);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const T* qt = qs + buf * KTILE;
        const T* dot = dos + buf * KTILE;
        const float* l2 = lses + buf * KR;
        const float* dl = deltas + buf * KR;
        // Transposed: rows are the warp's keys, columns the tile's queries.
        float s[NB][4] = {}, dp[NB][4] = {};
        M::template rows_by_rows<DP, NB>(s, ks, warp * 16, qt);
        M::template rows_by_rows<DP, NB>(dp, vs, warp * 16, dot);
        if (q0 < common_lo || q0 + KR > common_hi) {
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const unsigned int query = q0 + n * 8 + 2 * t + (e & 1);
                    if (query < lo[e >> 1] || query >= hi[e >> 1]) s[n][e] = -CUDART_INF_F;
                }
        }
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t + (e & 1);
                const float p = fast_exp2(fmaf(s[n][e], scale2, -l2[col]));
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - dl[col]);
            }
        M::template weights_by_rows<DP, NB>(dva, s, dot);
        M::template weights_by_rows<DP, NB>(dka, dp, qt);
        __syncthreads();
    }
    cp_wait<0>();
    const float scale = (float)a.scale, mul_k[2] = {scale, scale}, one[2] = {1.f, 1.f};
    store_rows<M, DP>(dk, a, OP_DK, b, kvh, k0 + warp * 16, a.keys, dka, mul_k, ks + warp * 16 * S);
    store_rows<M, DP>(dv, a, OP_DV, b, kvh, k0 + warp * 16, a.keys, dva, one, vs + warp * 16 * S);
}


// The three kernels of policy M at padded head dim DP and KR streamed rows (64 own rows), named
// `attention_<FAMILY>_forward_<SUFFIX>`, `..._backward_dq_...` and `..._backward_dkdv_...`; the
// dK/dV kernel's registers bounded to fit MINB blocks an SM.
#define FLASH_KERNELS(M, FAMILY, SUFFIX, DP, KR, MINB)                                                     \
    extern "C" __global__ void __launch_bounds__(128) attention_##FAMILY##_forward_##SUFFIX(         \
        const M::Elem* q, const M::Elem* k, const M::Elem* v, M::Elem* o, float* lse, AttnArgs a) {        \
        flash_forward<M, DP, KR, 64>(q, k, v, o, lse, a);                                                      \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) attention_##FAMILY##_backward_dq_##SUFFIX(     \
        const M::Elem* q, const M::Elem* k, const M::Elem* v, const M::Elem* o, const M::Elem* dout,       \
        const float* lse, M::Elem* dq, float* delta, AttnArgs a) {                                         \
        flash_backward_dq<M, DP, KR, 64>(q, k, v, o, dout, lse, dq, delta, a);                                 \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                         \
        attention_##FAMILY##_backward_dkdv_##SUFFIX(const M::Elem* q, const M::Elem* k, const M::Elem* v,  \
                                                    const M::Elem* dout, const float* lse,                 \
                                                    const float* delta, M::Elem* dk, M::Elem* dv,          \
                                                    AttnArgs a) {                                          \
        flash_backward_dkdv<M, DP, KR, 64>(q, k, v, dout, lse, delta, dk, dv, a);                              \
    }
