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
// and written with 16-byte stores. Dropout (the `DROP` builds, attention.cuh's draw) zeroes a
// probability after
// it enters the running sum and scales the output by `dropout_scale`; the backward kernels derive
// the same keep bits per element (dV takes the dropped probabilities, dP the mask times
// `dropout_scale`; Δ = dO·O is unchanged).

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
    if (a.tile_order != nullptr) {
        // Packed sequences: a tile's work depends on its place in its own sequence, so the host
        // orders them (heaviest first), and the grid is walked tile-major in that order.
        const unsigned int linear = blockIdx.y * gridDim.x + blockIdx.x, rank = linear / gridDim.y;
        pair = linear - rank * gridDim.y;
        tile = a.tile_order[rank];
        return;
    }
    if (!a.causal) {
        tile = blockIdx.x;
        pair = blockIdx.y;
        return;
    }
    const unsigned int linear = blockIdx.y * gridDim.x + blockIdx.x, rank = linear / gridDim.y;
    pair = linear - rank * gridDim.y;
    tile = heavy_last ? gridDim.x - 1 - rank : rank;
}

// [lo, hi) of the other side's rows that every own row of the warp meets (rows_met of the N rows a
// lane holds, reduced over the warp's 8 row groups): a tile inside it needs no mask.
template <int N>
__device__ __forceinline__ void warp_common_range(const unsigned int (&lo)[N], const unsigned int (&hi)[N],
                                                  unsigned int& common_lo, unsigned int& common_hi) {
    unsigned int l = lo[0], h = hi[0];
#pragma unroll
    for (int r = 1; r < N; ++r) {
        l = max(l, lo[r]);
        h = min(h, hi[r]);
    }
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
// at ks and vs; THREADS threads): prefetches tile j + 1 into the other buffers, then waits for tile
// j and syncs.
template <typename M, int DP, int KR, int THREADS>
__device__ __forceinline__ void key_tile_ready(int j, int tiles, typename M::Elem* ks, typename M::Elem* vs,
                                               const typename M::Elem* k, const typename M::Elem* v,
                                               const AttnArgs& a, unsigned int b, unsigned int kvh,
                                               unsigned int k0) {
    constexpr int KTILE = KR * (DP + M::PAD);
    if (j + 1 < tiles) {
        const int next = (j + 1) & 1;
        load_tile<M, DP, KR, THREADS>(ks + next * KTILE, k, a, OP_K, b, kvh, k0 + KR, a.keys);
        load_tile<M, DP, KR, THREADS>(vs + next * KTILE, v, a, OP_V, b, kvh, k0 + KR, a.keys);
        cp_commit();
        cp_wait<1>();
    } else {
        cp_wait<0>();
    }
    __syncthreads();
}

// The products of a warp that holds MW 16-row fragments of own rows (rows row0.. of x): MW = 1 is
// the policy's own; wider ones come from its `_wide` forms, which read each fragment of the other
// side once for all MW (half the shared-memory reads of a product at MW = 2).
template <typename M, int DP, int NB, int MW>
__device__ __forceinline__ void warp_rows_by_rows(float (&acc)[MW][NB][4], const typename M::Elem* x, int row0,
                                                  const typename M::Elem* y) {
    if constexpr (MW == 1) M::template rows_by_rows<DP, NB>(acc[0], x, row0, y);
    else M::template rows_by_rows_wide<DP, NB, MW>(acc, x, row0, y);
}
template <typename M, int DP, int NB, int MW>
__device__ __forceinline__ void warp_weights_by_rows(float (&out)[MW][DP / 8][4], const float (&w)[MW][NB][4],
                                                     const typename M::Elem* z) {
    if constexpr (MW == 1) M::template weights_by_rows<DP, NB>(out[0], w[0], z);
    else M::template weights_by_rows_wide<DP, NB, MW>(out, w, z);
}

// Forward of R queries, each warp 16·MW of them (R / (16·MW) warps), streaming keys and values.
// One streamed tile's step of the online softmax of a warp holding MW 16-row fragments (thread
// row r = 2·mw + rr is fragment mw's row g + 8·rr): each row's running maximum m (of
// scale2-prescaled scores) and sum l, the output accumulators rescaled to the new maximum, and
// the raw scores s turned into probabilities (base-2 exponentials, the scale inside their FMA:
// scale2 > 0 keeps the maximum's place). Hidden scores are -inf.
template <int MW, int NB, int NT>
__device__ __forceinline__ void online_softmax(float (&s)[MW][NB][4], float (&acc)[MW][NT][4], float (&m)[2 * MW],
                                               float (&l)[2 * MW], float scale2) {
    float base[2 * MW];
#pragma unroll
    for (int r = 0; r < 2 * MW; ++r) {
        const int mw = r >> 1, rr = r & 1;
        float mx = -CUDART_INF_F;
#pragma unroll
        for (int n = 0; n < NB; ++n) mx = fmaxf(mx, fmaxf(s[mw][n][2 * rr], s[mw][n][2 * rr + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[r], mx * scale2);
        base[r] = m_new == -CUDART_INF_F ? 0.f : m_new;
        const float correction = fast_exp2(m[r] - base[r]);
        m[r] = m_new;
        l[r] *= correction;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            acc[mw][n][2 * rr] *= correction;
            acc[mw][n][2 * rr + 1] *= correction;
        }
    }
#pragma unroll
    for (int mw = 0; mw < MW; ++mw)
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = 2 * mw + (e >> 1);
                const float p = fast_exp2(fmaf(s[mw][n][e], scale2, -base[r]));
                l[r] += p;
                s[mw][n][e] = p;
            }
}

template <typename M, int DP, int KR, int R, int MW, bool DROP>
__device__ void flash_forward(const typename M::Elem* q, const typename M::Elem* k, const typename M::Elem* v,
                              typename M::Elem* o, float* lse, const AttnArgs& a) {
    typedef typename M::Elem T;
    constexpr int S = DP + M::PAD, TILE = R * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8, THREADS = 2 * R / MW,
                  ROWS = 2 * MW;  // rows a thread holds: g and g + 8 of each fragment
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* qs = (T*)smem_raw;    // [R][S]
    T* ks = qs + TILE;       // 2 × [KR][S]
    T* vs = ks + 2 * KTILE;  // 2 × [KR][S]
    unsigned int tile, pair;
    block_tile(a, true, tile, pair);
    const unsigned int b = pair / a.heads, h = pair % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = tile * R, warp_row0 = warp * 16 * MW;
    unsigned int key_begin, key_end, lo[ROWS], hi[ROWS], common_lo, common_hi;
    block_range(a, true, q0, R, key_begin, key_end);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) keys_seen(a, q0 + warp_row0 + 8 * r + g, lo[r], hi[r]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const int tiles = (key_end - key_begin + KR - 1) / KR;
    load_tile<M, DP, R, THREADS>(qs, q, a, OP_Q, b, h, q0, a.queries);
    if (tiles > 0) {
        load_tile<M, DP, KR, THREADS>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<M, DP, KR, THREADS>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    float acc[MW][NT][4] = {}, m[ROWS], l[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = -CUDART_INF_F;
        l[r] = 0.f;
    }
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * KR;
        key_tile_ready<M, DP, KR, THREADS>(j, tiles, ks, vs, k, v, a, b, kvh, k0);
        const T* kt = ks + (j & 1) * KTILE;
        const T* vt = vs + (j & 1) * KTILE;
        float s[MW][NB][4] = {};
        warp_rows_by_rows<M, DP, NB, MW>(s, qs, warp_row0, kt);
        // Raw scores; hidden ones -inf (only tiles that cross a row's range need the test). The
        // scale is applied inside the exponent's FMA: scale2 > 0 keeps the maximum's place.
        // Thread row r = 2·mw + rr is fragment mw's row g + 8·rr.
        if (k0 < common_lo || k0 + KR > common_hi) {
#pragma unroll
            for (int mw = 0; mw < MW; ++mw)
#pragma unroll
                for (int n = 0; n < NB; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                        const int r = 2 * mw + (e >> 1);
                        if (key < lo[r] || key >= hi[r]) s[mw][n][e] = -CUDART_INF_F;
                    }
        }
        online_softmax<MW, NB, NT>(s, acc, m, l, scale2);
        if constexpr (DROP) {
#pragma unroll
            for (int mw = 0; mw < MW; ++mw)
#pragma unroll
                for (int n = 0; n < NB; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const unsigned int row = q0 + warp_row0 + 16 * mw + 8 * (e >> 1) + g;
                        const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                        if (!dropout_keeps(a, drop_base, pair, row, key)) s[mw][n][e] = 0.f;
                    }
        }
        warp_weights_by_rows<M, DP, NB, MW>(acc, s, vt);
        __syncthreads();
    }
    cp_wait<0>();
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) {
        float inv[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int r = 2 * mw + rr;
            float total = l[r];
            total += __shfl_xor_sync(0xffffffff, total, 1);
            total += __shfl_xor_sync(0xffffffff, total, 2);
            inv[rr] = total > 0.f ? 1.f / total : 0.f;
            if constexpr (DROP) inv[rr] *= (float)a.dropout_scale;
            const unsigned int row = q0 + warp_row0 + 16 * mw + 8 * rr + g;
            if (t == 0 && row < a.queries)
                lse[(unsigned long long)pair * a.queries + row] = (m[r] + log2f(total)) * FA_LN2;
        }
        const unsigned int first = warp_row0 + 16 * mw;
        store_rows<M, DP>(o, a, OP_O, b, h, q0 + first, a.queries, acc[mw], inv, qs + first * S);
    }
}

// dQ of R queries, each warp 16·MW of them, streaming keys and values; also writes Δ = dO·O of
// those queries.
template <typename M, int DP, int KR, int R, int MW, bool DROP>
__device__ void flash_backward_dq(const typename M::Elem* q, const typename M::Elem* k, const typename M::Elem* v,
                                  const typename M::Elem* o, const typename M::Elem* dout, const float* lse,
                                  typename M::Elem* dq, float* delta, const AttnArgs& a) {
    typedef typename M::Elem T;
    constexpr int S = DP + M::PAD, TILE = R * S, KTILE = KR * S, NT = DP / 8, NB = KR / 8, THREADS = 2 * R / MW,
                  ROWS = 2 * MW;
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
    const unsigned int q0 = tile * R, warp_row0 = warp * 16 * MW;
    const unsigned long long stats = (unsigned long long)pair * a.queries;
    unsigned int key_begin, key_end, lo[ROWS], hi[ROWS], common_lo, common_hi;
    block_range(a, true, q0, R, key_begin, key_end);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) keys_seen(a, q0 + warp_row0 + 8 * r + g, lo[r], hi[r]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const int tiles = (key_end - key_begin + KR - 1) / KR;
    load_tile<M, DP, R, THREADS>(qs, q, a, OP_Q, b, h, q0, a.queries);
    load_tile<M, DP, R, THREADS>(dos, dout, a, OP_DO, b, h, q0, a.queries);
    // O only for Δ: in the second key buffer, loading beside the first key and value tiles, when
    // it holds R rows (KR ≥ R); else where those tiles go, which then load after Δ (4·KR ≥ R).
    constexpr bool beside = KR >= R;
    T* os = beside ? ks + KTILE : ks;
    load_tile<M, DP, R, THREADS>(os, o, a, OP_O, b, h, q0, a.queries);
    if (beside && tiles > 0) {
        load_tile<M, DP, KR, THREADS>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<M, DP, KR, THREADS>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    {
        // THREADS / R threads per query, the head dim split between them.
        constexpr int PER_ROW = THREADS / R, PART = DP / PER_ROW;
        const int r = threadIdx.x / PER_ROW, part = threadIdx.x % PER_ROW;
        float dl = M::template dot<PART>(os + r * S + part * PART, dos + r * S + part * PART);
        if (PER_ROW == 2) dl += __shfl_xor_sync(0xffffffff, dl, 1);
        const unsigned int row = q0 + r;
        if (part == 0) {
            deltas[r] = dl;
            lses[r] = row < a.queries ? lse[stats + row] * FA_LOG2E : 0.f;
            if (row < a.queries) delta[stats + row] = dl;
        }
    }
    __syncthreads();
    if (!beside && tiles > 0) {
        load_tile<M, DP, KR, THREADS>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_tile<M, DP, KR, THREADS>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
        cp_commit();
    }
    // Thread row r = 2·mw + rr is fragment mw's row g + 8·rr.
    float l2[ROWS], dl[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        l2[r] = lses[warp_row0 + 8 * r + g];
        dl[r] = deltas[warp_row0 + 8 * r + g];
    }
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    const float drop_scale = (float)a.dropout_scale;
    float acc[MW][NT][4] = {};
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * KR;
        key_tile_ready<M, DP, KR, THREADS>(j, tiles, ks, vs, k, v, a, b, kvh, k0);
        const T* kt = ks + (j & 1) * KTILE;
        const T* vt = vs + (j & 1) * KTILE;
        float s[MW][NB][4] = {}, dp[MW][NB][4] = {};
        warp_rows_by_rows<M, DP, NB, MW>(s, qs, warp_row0, kt);
        warp_rows_by_rows<M, DP, NB, MW>(dp, dos, warp_row0, vt);
        if (k0 < common_lo || k0 + KR > common_hi) {
#pragma unroll
            for (int mw = 0; mw < MW; ++mw)
#pragma unroll
                for (int n = 0; n < NB; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                        const int r = 2 * mw + (e >> 1);
                        if (key < lo[r] || key >= hi[r]) s[mw][n][e] = -CUDART_INF_F;
                    }
        }
#pragma unroll
        for (int mw = 0; mw < MW; ++mw)
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 2 * mw + (e >> 1);
                    const float p = fast_exp2(fmaf(s[mw][n][e], scale2, -l2[r]));
                    float dpv = dp[mw][n][e];
                    if constexpr (DROP) {
                        const unsigned int row = q0 + warp_row0 + 16 * mw + 8 * (e >> 1) + g;
                        const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                        dpv = dropout_keeps(a, drop_base, pair, row, key) ? dpv * drop_scale : 0.f;
                    }
                    s[mw][n][e] = p * (dpv - dl[r]);
                }
        warp_weights_by_rows<M, DP, NB, MW>(acc, s, kt);
        __syncthreads();
    }
    const float scale = (float)a.scale, mul[2] = {scale, scale};
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) {
        const unsigned int first = warp_row0 + 16 * mw;
        store_rows<M, DP>(dq, a, OP_DQ, b, h, q0 + first, a.queries, acc[mw], mul, qs + first * S);
    }
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
template <typename M, int DP, int KR, int R, bool DROP>
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
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    const float drop_scale = (float)a.dropout_scale;
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
                if constexpr (DROP) {
                    const unsigned long long query_pair = (unsigned long long)b * a.heads + head_of(j);
                    const float factor =
                        dropout_keeps(a, drop_base, query_pair, q0 + col, key0 + 8 * (e >> 1)) ? drop_scale : 0.f;
                    s[n][e] = p * factor;
                    dp[n][e] = p * (dp[n][e] * factor - dl[col]);
                } else {
                    s[n][e] = p;
                    dp[n][e] = p * (dp[n][e] - dl[col]);
                }
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


// The three kernels of policy M at padded head dim DP, named `attention_<FAMILY>_forward_<SUFFIX>`,
// `..._backward_dq_...` and `..._backward_dkdv_...`, 128 threads each; FLASH_KERNELS_WITH_DROPOUT
// adds the same three with dropout (`attention_<FAMILY>_forward_dropout_<SUFFIX>` and so on;
// separate builds, so the plain kernels keep their registers; built at the head dims the host
// sends dropout to, each a whole PTX's worth of unrolled code): the forward and dQ kernels take
// 64·MW queries a block (16·MW a warp) and stream KR keys at a time, the dK/dV kernel 64 keys and
// KR queries, its registers bounded to fit MINB blocks an SM. The host's tile shapes
// (crates/ops-cuda/src/attention/tensor_core.rs) must say the same.
#define FLASH_KERNELS_OF(M, FAMILY, SUFFIX, DP, FWD_MW, FWD_KR, DQ_MW, DQ_KR, DKDV_KR, MINB, DROP, TAG)    \
    extern "C" __global__ void __launch_bounds__(128) attention_##FAMILY##_forward##TAG##SUFFIX(         \
        const M::Elem* q, const M::Elem* k, const M::Elem* v, M::Elem* o, float* lse, AttnArgs a) {        \
        flash_forward<M, DP, FWD_KR, 64 * FWD_MW, FWD_MW, DROP>(q, k, v, o, lse, a);                        \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) attention_##FAMILY##_backward_dq##TAG##SUFFIX(     \
        const M::Elem* q, const M::Elem* k, const M::Elem* v, const M::Elem* o, const M::Elem* dout,       \
        const float* lse, M::Elem* dq, float* delta, AttnArgs a) {                                         \
        flash_backward_dq<M, DP, DQ_KR, 64 * DQ_MW, DQ_MW, DROP>(q, k, v, o, dout, lse, dq, delta, a);      \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                              \
        attention_##FAMILY##_backward_dkdv##TAG##SUFFIX(const M::Elem* q, const M::Elem* k,                \
                                                        const M::Elem* v, const M::Elem* dout,             \
                                                        const float* lse, const float* delta,              \
                                                        M::Elem* dk, M::Elem* dv, AttnArgs a) {            \
        flash_backward_dkdv<M, DP, DKDV_KR, 64, DROP>(q, k, v, dout, lse, delta, dk, dv, a);               \
    }
#define FLASH_KERNELS(M, FAMILY, SUFFIX, DP, FWD_MW, FWD_KR, DQ_MW, DQ_KR, DKDV_KR, MINB)                  \
    FLASH_KERNELS_OF(M, FAMILY, SUFFIX, DP, FWD_MW, FWD_KR, DQ_MW, DQ_KR, DKDV_KR, MINB, false, _)
#define FLASH_KERNELS_WITH_DROPOUT(M, FAMILY, SUFFIX, DP, FWD_MW, FWD_KR, DQ_MW, DQ_KR, DKDV_KR, MINB)     \
    FLASH_KERNELS_OF(M, FAMILY, SUFFIX, DP, FWD_MW, FWD_KR, DQ_MW, DQ_KR, DKDV_KR, MINB, false, _)         \
    FLASH_KERNELS_OF(M, FAMILY, SUFFIX, DP, FWD_MW, FWD_KR, DQ_MW, DQ_KR, DKDV_KR, MINB, true, _dropout_)
