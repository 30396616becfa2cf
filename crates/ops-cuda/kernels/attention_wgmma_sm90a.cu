// Attention for bf16 and f16 on Hopper's warpgroup MMA (issue 35), forward and backward:
// `wgmma.mma_async` with the row-by-row products (S = Q·Kᵀ, dP = dO·Vᵀ and their transposes) from
// two shared-memory tiles and the weighted ones (P·V, dS·K, Pᵀ·dO, dSᵀ·Q) with the weights from
// registers, every tile in the 128-byte-swizzled layout wgmma reads (loaded with cp.async; no TMA
// yet, no warp specialisation, no ping-pong between warpgroups: the first step of a
// FlashAttention-3-style kernel). One warpgroup (128 threads) takes 64 own rows of one pair; the
// other side streams 64 rows a tile, double-buffered. The kernels are attention_flash.cuh's (the
// same online softmax, the same saved log-sum-exp, the dQ kernel writing Δ for the dK/dV one), so
// either path's backward follows either forward.
//
// Built for compute_90a (sm_90a PTX: wgmma exists on Hopper alone) by `cargo xtask
// build-kernels` (a `*_sm90a.cu` source); crates/ops-cuda/src/attention/wgmma.rs launches them on
// a device of compute capability 9.0 when HEADROOM_ATTENTION_WGMMA=1, head dims up to 128 (packed
// sequences through AttnArgs' cu_seqlens and tile order, dropout by replaying its draw as the
// mma.sync kernels do, bf16 only); everything else keeps the mma.sync kernels. One build a dtype
// and padded head dim (64, 128), each a whole set of unrolled kernels in the committed PTX.

#include "attention_wgmma.cuh"

// Rows first..first + 64 of operand `op` of pair (b, h) into the DP / 64 swizzled atoms at `tile`,
// asynchronously, by the block's 128 threads; zeros past the head dim and past `limit`.
template <typename T, int DP>
__device__ __forceinline__ void load_swizzled(unsigned char* tile, const T* src, const AttnArgs& a, int op,
                                              unsigned int b, unsigned int h, unsigned int first,
                                              unsigned int limit) {
    constexpr int CHUNKS = DP / 8;  // 16-byte chunks a row
    for (int idx = threadIdx.x; idx < WG_ROWS * CHUNKS; idx += 128) {
        const int r = idx / CHUNKS, chunk = idx - r * CHUNKS, c = chunk * 8;
        const unsigned int row = first + r;
        const bool in = row < limit && c < (int)a.head_dim;
        unsigned char* dst = tile + (chunk >> 3) * WG_ATOM_BYTES + r * 128 + (((chunk & 7) ^ (r & 7)) << 4);
        cp_async16(dst, in ? src + row_at(a, op, b, h, row) + c : src, in ? 16 : 0);
    }
}

// Step j of a block's walk over `tiles` key tiles (this one's first key k0; K and V
// double-buffered at ks and vs, TILE bytes apart): prefetches tile j + 1 into the other buffers,
// waits for tile j, and makes every thread's copies visible to wgmma (the async proxy) and to the
// block.
template <typename T, int DP>
__device__ __forceinline__ void swizzled_key_tile_ready(int j, int tiles, unsigned char* ks, unsigned char* vs,
                                                        const T* k, const T* v, const AttnArgs& a,
                                                        unsigned int b, unsigned int kvh, unsigned int k0) {
    constexpr int TILE = DP / 64 * WG_ATOM_BYTES;
    if (j + 1 < tiles) {
        const int next = (j + 1) & 1;
        load_swizzled<T, DP>(ks + next * TILE, k, a, OP_K, b, kvh, k0 + WG_ROWS, a.keys);
        load_swizzled<T, DP>(vs + next * TILE, v, a, OP_V, b, kvh, k0 + WG_ROWS, a.keys);
        cp_commit();
        cp_wait<1>();
    } else {
        cp_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();
}

// Forward of 64 queries of one (batch, head) pair by one warpgroup (4 warps, each 16 queries in
// wgmma's accumulator rows): S = Q·Kᵀ by wgmma from the swizzled Q and K tiles, the online
// softmax in registers as attention_flash.cuh's forward, O += P·V by wgmma with P from registers
// (the accumulator layout is the A fragment's) and V read transposed from its tile. K and V stream
// 64 keys a tile, double-buffered with cp.async.
template <typename T, int DP, bool DROP>
__device__ void wgmma_forward(const T* q, const T* k, const T* v, T* o, float* lse, const AttnArgs& a) {
    constexpr int ATOMS = DP / 64, TILE = ATOMS * WG_ATOM_BYTES, NB = 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // Dynamic shared memory starts 16-byte aligned at least: round up to the swizzle's 1024.
    unsigned char* base = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
    unsigned char* qs = base;                // ATOMS atoms
    unsigned char* ks = qs + TILE;           // 2 × ATOMS atoms
    unsigned char* vs = ks + 2 * TILE;       // 2 × ATOMS atoms
    unsigned int tile, pair;
    block_tile(a, true, tile, pair);
    const unsigned int b = pair / a.heads, h = pair % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = tile * WG_ROWS, warp_row0 = warp * 16;
    unsigned int key_begin, key_end, lo[2], hi[2], common_lo, common_hi;
    block_range(a, true, q0, WG_ROWS, key_begin, key_end);
#pragma unroll
    for (int r = 0; r < 2; ++r) keys_seen(a, q0 + warp_row0 + 8 * r + g, lo[r], hi[r]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const int tiles = (key_end - key_begin + WG_ROWS - 1) / WG_ROWS;
    load_swizzled<T, DP>(qs, q, a, OP_Q, b, h, q0, a.queries);
    if (tiles > 0) {
        load_swizzled<T, DP>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_swizzled<T, DP>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    float acc[1][DP / 8][4] = {}, m[2], l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m[r] = -CUDART_INF_F;
        l[r] = 0.f;
    }
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * WG_ROWS;
        swizzled_key_tile_ready<T, DP>(j, tiles, ks, vs, k, v, a, b, kvh, k0);
        const unsigned char* kt = ks + (j & 1) * TILE;
        const unsigned char* vt = vs + (j & 1) * TILE;
        float s[1][NB][4] = {};
        rows_by_rows<T, DP>(s[0], qs, kt);
        wgmma_wait0();
        if (k0 < common_lo || k0 + WG_ROWS > common_hi) hide_unseen_keys<NB>(s[0], k0, t, lo, hi);
        online_softmax<1, NB, DP / 8>(s, acc, m, l, scale2);
        if constexpr (DROP) {
            // The running sum took every probability; the weights only the kept ones.
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const unsigned int row = q0 + warp_row0 + 8 * (e >> 1) + g;
                    const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                    if (!dropout_keeps(a, drop_base, pair, row, key)) s[0][n][e] = 0.f;
                }
        }
        weights_by_rows<T, DP>(acc[0], s[0], vt);
        wgmma_wait0();
        __syncthreads();
    }
    cp_wait<0>();
    __syncthreads();
    float inv[2];
    finish_rows<DROP>(m, l, inv, lse, a, pair, q0 + warp_row0, g, t);
    // Staged through the K buffers (no longer read): each warp its own 16 rows of [64][DP + 8].
    T* stage = reinterpret_cast<T*>(ks) + warp_row0 * (DP + Tc16<T>::PAD);
    store_rows<Tc16<T>, DP>(o, a, OP_O, b, h, q0 + warp_row0, a.queries, acc[0], inv, stage);
}

// Δ = dO·O of query `row` of pair (b, h), by the 8 lanes l..l + 7 of a row group (each a 16-byte
// chunk at a time), summed over them.
template <typename T>
__device__ __forceinline__ float delta_of(const T* o, const T* dout, const AttnArgs& a, unsigned int b,
                                          unsigned int h, unsigned int row, int part) {
    float sum = 0.f;
    if (row < a.queries) {
        const T* op = o + row_at(a, OP_O, b, h, row);
        const T* gp = dout + row_at(a, OP_DO, b, h, row);
        for (int c = part * 8; c < (int)a.head_dim; c += 64) {
            const uint4 ov = *reinterpret_cast<const uint4*>(op + c), gv = *reinterpret_cast<const uint4*>(gp + c);
            const unsigned int* ow = reinterpret_cast<const unsigned int*>(&ov);
            const unsigned int* gw = reinterpret_cast<const unsigned int*>(&gv);
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const float2 x = Tc<T>::unpack(ow[w]), y = Tc<T>::unpack(gw[w]);
                sum += x.x * y.x + x.y * y.y;
            }
        }
    }
#pragma unroll
    for (int offset = 1; offset < 8; offset <<= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    return sum;
}

// dQ of 64 queries of one (batch, head) pair, streaming key tiles of 64: S = Q·Kᵀ and dP = dO·Vᵀ
// by wgmma from the swizzled tiles, dS = P (dP − Δ) in registers, dQ += dS·K with dS from
// registers and K read transposed; first writes Δ = dO·O of its queries (for the dK/dV kernel).
// The flash kernels' dQ (attention_flash.cuh) on wgmma.
template <typename T, int DP, bool DROP>
__device__ void wgmma_backward_dq(const T* q, const T* k, const T* v, const T* o, const T* dout, const float* lse,
                                  T* dq, float* delta, const AttnArgs& a) {
    constexpr int TILE = DP / 64 * WG_ATOM_BYTES, NB = 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
    unsigned char* qs = base;           // Q
    unsigned char* dos = qs + TILE;     // dO
    unsigned char* ks = dos + TILE;     // 2 × K
    unsigned char* vs = ks + 2 * TILE;  // 2 × V
    float* lses = reinterpret_cast<float*>(vs + 2 * TILE);  // [64], log2 domain
    float* deltas = lses + WG_ROWS;                         // [64]
    unsigned int tile, pair;
    block_tile(a, true, tile, pair);
    const unsigned int b = pair / a.heads, h = pair % a.heads, kvh = h / group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int q0 = tile * WG_ROWS, warp_row0 = warp * 16;
    const unsigned long long stats = (unsigned long long)pair * a.queries;
    unsigned int key_begin, key_end, lo[2], hi[2], common_lo, common_hi;
    block_range(a, true, q0, WG_ROWS, key_begin, key_end);
#pragma unroll
    for (int r = 0; r < 2; ++r) keys_seen(a, q0 + warp_row0 + 8 * r + g, lo[r], hi[r]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const int tiles = (key_end - key_begin + WG_ROWS - 1) / WG_ROWS;
    load_swizzled<T, DP>(qs, q, a, OP_Q, b, h, q0, a.queries);
    load_swizzled<T, DP>(dos, dout, a, OP_DO, b, h, q0, a.queries);
    if (tiles > 0) {
        load_swizzled<T, DP>(ks, k, a, OP_K, b, kvh, key_begin, a.keys);
        load_swizzled<T, DP>(vs, v, a, OP_V, b, kvh, key_begin, a.keys);
    }
    cp_commit();
    // Δ and the log-sum-exp of the block's queries: 16 row groups of 8 lanes, 4 rows each.
    for (int r = threadIdx.x >> 3; r < WG_ROWS; r += 16) {
        const unsigned int row = q0 + r;
        const float dl = delta_of(o, dout, a, b, h, row, threadIdx.x & 7);
        if ((threadIdx.x & 7) == 0) {
            deltas[r] = dl;
            lses[r] = row < a.queries ? lse[stats + row] * FA_LOG2E : 0.f;
            if (row < a.queries) delta[stats + row] = dl;
        }
    }
    __syncthreads();
    float l2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l2[r] = lses[warp_row0 + 8 * r + g];
        dl[r] = deltas[warp_row0 + 8 * r + g];
    }
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    const float drop_scale = (float)a.dropout_scale;
    float acc[DP / 8][4] = {};
    for (int j = 0; j < tiles; ++j) {
        const unsigned int k0 = key_begin + j * WG_ROWS;
        swizzled_key_tile_ready<T, DP>(j, tiles, ks, vs, k, v, a, b, kvh, k0);
        const unsigned char* kt = ks + (j & 1) * TILE;
        const unsigned char* vt = vs + (j & 1) * TILE;
        float s[NB][4] = {}, dp[NB][4] = {};
        rows_by_rows<T, DP>(s, qs, kt);
        rows_by_rows<T, DP>(dp, dos, vt);
        wgmma_wait0();
        const bool crossing = k0 < common_lo || k0 + WG_ROWS > common_hi;
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                const bool hidden = crossing && (key < lo[r] || key >= hi[r]);
                const float p = hidden ? 0.f : fast_exp2(fmaf(s[n][e], scale2, -l2[r]));
                float dpv = dp[n][e];
                if constexpr (DROP) {
                    const unsigned int row = q0 + warp_row0 + 8 * r + g;
                    dpv = dropout_keeps(a, drop_base, pair, row, key) ? dpv * drop_scale : 0.f;
                }
                s[n][e] = p * (dpv - dl[r]);
            }
        weights_by_rows<T, DP>(acc, s, kt);
        wgmma_wait0();
        __syncthreads();
    }
    cp_wait<0>();
    __syncthreads();
    const float scale = (float)a.scale, mul[2] = {scale, scale};
    T* stage = reinterpret_cast<T*>(ks) + warp_row0 * (DP + Tc16<T>::PAD);
    store_rows<Tc16<T>, DP>(dq, a, OP_DQ, b, h, q0 + warp_row0, a.queries, acc, mul, stage);
}

// dK and dV of 64 keys of one (batch, key/value head) pair, streaming 64-query tiles of every
// query head of its group: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ by wgmma, Pᵀ and dSᵀ = Pᵀ (dPᵀ − Δ) in
// registers, dV += Pᵀ·dO and dK += dSᵀ·Q with the weights from registers and dO and Q read
// transposed. The flash kernels' dK/dV (attention_flash.cuh) on wgmma.
template <typename T, int DP, bool DROP>
__device__ void wgmma_backward_dkdv(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                    const float* delta, T* dk, T* dv, const AttnArgs& a) {
    constexpr int TILE = DP / 64 * WG_ATOM_BYTES, NB = 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
    unsigned char* ks = base;            // K
    unsigned char* vs = ks + TILE;       // V
    unsigned char* qs = vs + TILE;       // 2 × Q
    unsigned char* dos = qs + 2 * TILE;  // 2 × dO
    float* lses = reinterpret_cast<float*>(dos + 2 * TILE);  // 2 × [64], log2 domain
    float* deltas = lses + 2 * WG_ROWS;                       // 2 × [64]
    unsigned int tile, pair;
    block_tile(a, false, tile, pair);
    const unsigned int b = pair / a.kv_heads, kvh = pair % a.kv_heads, group = group_size(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int k0 = tile * WG_ROWS, key0 = k0 + warp * 16 + g;
    unsigned int query_begin, query_end, lo[2], hi[2], common_lo, common_hi;
    block_range(a, false, k0, WG_ROWS, query_begin, query_end);
    queries_seeing(a, key0, lo[0], hi[0]);
    queries_seeing(a, key0 + 8, lo[1], hi[1]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const unsigned int tiles = (query_end - query_begin + WG_ROWS - 1) / WG_ROWS, steps = group * tiles;
    auto head_of = [&](unsigned int step) { return kvh * group + step / tiles; };
    auto first_query = [&](unsigned int step) { return query_begin + step % tiles * WG_ROWS; };
    auto stats_of = [&](unsigned int step) { return ((unsigned long long)b * a.heads + head_of(step)) * a.queries; };
    load_swizzled<T, DP>(ks, k, a, OP_K, b, kvh, k0, a.keys);
    load_swizzled<T, DP>(vs, v, a, OP_V, b, kvh, k0, a.keys);
    if (steps > 0) {
        load_swizzled<T, DP>(qs, q, a, OP_Q, b, head_of(0), first_query(0), a.queries);
        load_swizzled<T, DP>(dos, dout, a, OP_DO, b, head_of(0), first_query(0), a.queries);
        load_query_stats<WG_ROWS, 128>(lses, deltas, lse, delta, stats_of(0), first_query(0), a.queries);
    }
    cp_commit();
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    const float drop_scale = (float)a.dropout_scale;
    float dka[DP / 8][4] = {}, dva[DP / 8][4] = {};
    for (unsigned int j = 0; j < steps; ++j) {
        const unsigned int q0 = first_query(j);
        const int buf = j & 1;
        if (j + 1 < steps) {
            const int next = buf ^ 1;
            const unsigned int h1 = head_of(j + 1), q1 = first_query(j + 1);
            load_swizzled<T, DP>(qs + next * TILE, q, a, OP_Q, b, h1, q1, a.queries);
            load_swizzled<T, DP>(dos + next * TILE, dout, a, OP_DO, b, h1, q1, a.queries);
            load_query_stats<WG_ROWS, 128>(lses + next * WG_ROWS, deltas + next * WG_ROWS, lse, delta,
                                           stats_of(j + 1), q1, a.queries);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        fence_proxy_async();
        __syncthreads();
        const unsigned char* qt = qs + buf * TILE;
        const unsigned char* dot = dos + buf * TILE;
        const float* l2 = lses + buf * WG_ROWS;
        const float* dl = deltas + buf * WG_ROWS;
        // Transposed: rows are the warpgroup's keys, columns the tile's queries.
        float s[NB][4] = {}, dp[NB][4] = {};
        rows_by_rows<T, DP>(s, ks, qt);
        rows_by_rows<T, DP>(dp, vs, dot);
        wgmma_wait0();
        const bool crossing = q0 < common_lo || q0 + WG_ROWS > common_hi;
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t + (e & 1);
                const unsigned int query = q0 + col;
                const bool hidden = crossing && (query < lo[e >> 1] || query >= hi[e >> 1]);
                const float p = hidden ? 0.f : fast_exp2(fmaf(s[n][e], scale2, -l2[col]));
                if constexpr (DROP) {
                    const unsigned long long query_pair = (unsigned long long)b * a.heads + head_of(j);
                    const float factor =
                        dropout_keeps(a, drop_base, query_pair, query, key0 + 8 * (e >> 1)) ? drop_scale : 0.f;
                    s[n][e] = p * factor;
                    dp[n][e] = p * (dp[n][e] * factor - dl[col]);
                } else {
                    s[n][e] = p;
                    dp[n][e] = p * (dp[n][e] - dl[col]);
                }
            }
        weights_by_rows<T, DP>(dva, s, dot);
        weights_by_rows<T, DP>(dka, dp, qt);
        wgmma_wait0();
        __syncthreads();
    }
    cp_wait<0>();
    __syncthreads();
    const float scale = (float)a.scale, mul_k[2] = {scale, scale}, one[2] = {1.f, 1.f};
    T* stage = reinterpret_cast<T*>(qs) + warp * 16 * (DP + Tc16<T>::PAD);
    store_rows<Tc16<T>, DP>(dk, a, OP_DK, b, kvh, k0 + warp * 16, a.keys, dka, mul_k, stage);
    __syncwarp();
    store_rows<Tc16<T>, DP>(dv, a, OP_DV, b, kvh, k0 + warp * 16, a.keys, dva, one, stage);
}

// attention_wgmma_forward<TAG><dtype>_<DP>, ..._backward_dq..., ..._backward_dkdv...: 128
// threads, 64 own rows a block (queries, or keys for dK/dV); dynamic shared memory 1024 bytes of
// alignment slack plus DP / 64 · 8 KiB a tile: 5 tiles forward (Q, two buffers each of K and V),
// 6 backward plus 2 · 64 (dQ) or 4 · 64 (dK/dV) floats of statistics (attention/wgmma.rs says the
// same). TAG `_` is the plain build, `_dropout_` the one with dropout (bf16 only, as the mma.sync
// kernels: separate builds, so the plain ones keep their registers).
#define WGMMA_KERNELS_OF(T, SUFFIX, DP, DROP, TAG)                                                       \
    extern "C" __global__ void __launch_bounds__(128) attention_wgmma_forward##TAG##SUFFIX(             \
        const T* q, const T* k, const T* v, T* o, float* lse, AttnArgs a) {                              \
        wgmma_forward<T, DP, DROP>(q, k, v, o, lse, a);                                                  \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128) attention_wgmma_backward_dq##TAG##SUFFIX(         \
        const T* q, const T* k, const T* v, const T* o, const T* dout, const float* lse, T* dq,          \
        float* delta, AttnArgs a) {                                                                      \
        wgmma_backward_dq<T, DP, DROP>(q, k, v, o, dout, lse, dq, delta, a);                             \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128) attention_wgmma_backward_dkdv##TAG##SUFFIX(       \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dk,  \
        T* dv, AttnArgs a) {                                                                             \
        wgmma_backward_dkdv<T, DP, DROP>(q, k, v, dout, lse, delta, dk, dv, a);                          \
    }
WGMMA_KERNELS_OF(__nv_bfloat16, bf16_64, 64, false, _)
WGMMA_KERNELS_OF(__nv_bfloat16, bf16_128, 128, false, _)
WGMMA_KERNELS_OF(__half, f16_64, 64, false, _)
WGMMA_KERNELS_OF(__half, f16_128, 128, false, _)
WGMMA_KERNELS_OF(__nv_bfloat16, bf16_64, 64, true, _dropout_)
WGMMA_KERNELS_OF(__nv_bfloat16, bf16_128, 128, true, _dropout_)
