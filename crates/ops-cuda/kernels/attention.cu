// Fused scaled-dot-product attention of the CUDA backend: forward, and the backward as two
// kernels (dQ with each query's Δ = dO·O, then dK and dV).
//
// No [queries, keys] matrix reaches memory. A block of 64 threads (8 × 8, thread (ty, tx)) takes
// one (batch, head) pair and 32 of its rows (queries forward and for dQ, keys for dK/dV), and
// streams the other side through shared memory 32 rows at a time. Every operand sits in shared
// memory as it is in global memory, row by row, each row padded by 4 values (a row stride of 4
// banks mod 32). Both products of a tile are register-tiled like a GEMM: the score tile is
// 32 × 32 with 4 × 4 per thread — own rows ty + 8r, streamed rows tx + 8c, so the 8 threads of a
// row read 8 different rows with 16-byte loads and never share a bank — and the output tile
// 32 × head_dim with 4 rows × DC columns per thread (columns 4·tx + 32·i + j, again conflict-free;
// head dims up to 8·DC, DC = 4, 8, 12 or 16). Probability tiles are stored with each thread's 4
// own rows adjacent (slot 4·ty + r), read back 4 at a time. Global loads and stores move 4
// elements at once when every operand's rows are 4-element aligned (the `vector` flag). Softmax is
// online (running max and sum, base-2 exponentials of log2(e)-prescaled scores), the row
// reductions are shuffles among the 8 threads of a row; backward recomputes probabilities from the
// saved log-sum-exp. Accumulation is in double for f64 and float otherwise.
//
// Grouped-query heads are read in place: a query head's block loads key/value head h / group, and
// a dK/dV block takes one (batch, kv head) and walks the queries of every head of its group,
// summing in registers (no atomics, no expanded copy). Each own row sees one contiguous range of
// the other side (`keys_seen` / `queries_seeing` in attention.cuh: causal, and within its own
// sequence when packed through `cu_seqlens`), a block streams only the union of its rows' ranges
// (so packed sequences cost the sum of their own tiles, not the whole batch's), and masks element
// by element against each row's range (tiles straddling a sequence boundary included). The Rust side
// (crates/ops-cuda/src/attention/args.rs) describes operands with `AttnArgs`, field for field.
// Dropout (the `DROP` builds, `_dropout_` in their names) zeroes the probabilities whose bits
// `dropout_keeps` rejects after they enter
// the running sum, and scales the output by `dropout_scale`; backward derives the same bits:
// dV takes the dropped probabilities, dP the mask times `dropout_scale`, and Δ = dO·O is
// unchanged (O is the dropped output). The opt-in fused backward below takes no dropout.
// Built to PTX by `cargo xtask build-kernels`.

#include <math_constants.h>

#include "attention.cuh"
#include "elements.cuh"

__device__ __forceinline__ float m_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double m_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float m_log2(float x) { return log2f(x); }
__device__ __forceinline__ double m_log2(double x) { return log2(x); }
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -CUDART_INF_F; }
template <> __device__ __forceinline__ double neg_inf<double>() { return -CUDART_INF; }

#define LOG2E 1.4426950408889634
#define LN2 0.6931471805599453
// Rows of the block's own side and of each streamed tile, and threads per block.
#define BQ 32
#define BK 32
#define THREADS 64


// Four consecutive values in and out: shared memory (16-byte aligned) and global memory.
__device__ __forceinline__ void ld4(const float* p, float (&o)[4]) {
    float4 t = *reinterpret_cast<const float4*>(p);
    o[0] = t.x; o[1] = t.y; o[2] = t.z; o[3] = t.w;
}
__device__ __forceinline__ void ld4(const double* p, double (&o)[4]) {
    double2 t = *reinterpret_cast<const double2*>(p), u = *reinterpret_cast<const double2*>(p + 2);
    o[0] = t.x; o[1] = t.y; o[2] = u.x; o[3] = u.y;
}
__device__ __forceinline__ void st4(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void st4(double* p, const double (&v)[4]) {
    *reinterpret_cast<double2*>(p) = make_double2(v[0], v[1]);
    *reinterpret_cast<double2*>(p + 2) = make_double2(v[2], v[3]);
}
template <typename T, typename A> __device__ __forceinline__ void gld4(const T* p, A (&o)[4]) {
    for (int i = 0; i < 4; ++i) o[i] = ld(p + i);
}
template <> __device__ __forceinline__ void gld4<float, float>(const float* p, float (&o)[4]) { ld4(p, o); }
template <> __device__ __forceinline__ void gld4<__nv_bfloat16, float>(const __nv_bfloat16* p, float (&o)[4]) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    float2 a = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&raw.x));
    float2 b = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&raw.y));
    o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}
template <> __device__ __forceinline__ void gld4<__half, float>(const __half* p, float (&o)[4]) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    float2 a = __half22float2(*reinterpret_cast<__half2*>(&raw.x));
    float2 b = __half22float2(*reinterpret_cast<__half2*>(&raw.y));
    o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}
template <typename T, typename A> __device__ __forceinline__ void gst4(T* p, const A (&v)[4]) {
    for (int i = 0; i < 4; ++i) st(p + i, v[i]);
}
template <> __device__ __forceinline__ void gst4<float, float>(float* p, const float (&v)[4]) { st4(p, v); }
template <> __device__ __forceinline__ void gst4<__nv_bfloat16, float>(__nv_bfloat16* p, const float (&v)[4]) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
    uint2 raw;
    raw.x = *reinterpret_cast<unsigned int*>(&a);
    raw.y = *reinterpret_cast<unsigned int*>(&b);
    *reinterpret_cast<uint2*>(p) = raw;
}
template <> __device__ __forceinline__ void gst4<__half, float>(__half* p, const float (&v)[4]) {
    __half2 a = __floats2half2_rn(v[0], v[1]), b = __floats2half2_rn(v[2], v[3]);
    uint2 raw;
    raw.x = *reinterpret_cast<unsigned int*>(&a);
    raw.y = *reinterpret_cast<unsigned int*>(&b);
    *reinterpret_cast<uint2*>(p) = raw;
}

// Combines over the 8 threads of a row (adjacent lanes).
template <typename A> __device__ __forceinline__ A row_max(A v) {
    v = max(v, __shfl_xor_sync(0xffffffff, v, 1));
    v = max(v, __shfl_xor_sync(0xffffffff, v, 2));
    return max(v, __shfl_xor_sync(0xffffffff, v, 4));
}
template <typename A> __device__ __forceinline__ A row_sum(A v) {
    v += __shfl_xor_sync(0xffffffff, v, 1);
    v += __shfl_xor_sync(0xffffffff, v, 2);
    return v + __shfl_xor_sync(0xffffffff, v, 4);
}

// Rows first..first+32 of operand `op` of pair (b, h) into shared memory `dst` ([32][DP + 4]),
// times `mul`, zero past the head dim and past `limit`.
template <typename T, typename A, int DP>
__device__ __forceinline__ void load_rows(const T* src, const AttnArgs& a, int op, unsigned int b,
                                          unsigned int h, unsigned int first, unsigned int limit,
                                          A mul, A* dst) {
    constexpr int PS = DP + 4, CHUNKS = DP / 4;
    for (int idx = threadIdx.x; idx < BQ * CHUNKS; idx += THREADS) {
        int r = idx / CHUNKS, d = (idx - r * CHUNKS) * 4;
        unsigned int row = first + r;
        A v[4] = {0, 0, 0, 0};
        if (row < limit) {
            const T* p = src + row_at(a, op, b, h, row) + d;
            if (a.vector) {
                if (d < (int)a.head_dim) gld4(p, v);
            } else {
                for (int i = 0; i < 4; ++i)
                    if (d + i < (int)a.head_dim) v[i] = ld(p + i);
            }
        }
        for (int i = 0; i < 4; ++i) v[i] *= mul;
        st4(dst + r * PS + d, v);
    }
}

// acc[r][c] += Σ_d x[ty + 8r][d] · y[tx + 8c][d] over two [32][DP + 4] tiles.
template <typename A, int DP>
__device__ __forceinline__ void tile_product(const A* x, const A* y, int ty, int tx, A (&acc)[4][4]) {
    constexpr int PS = DP + 4;
#pragma unroll 2
    for (int d = 0; d < DP; d += 4) {
        A xa[4][4], yb[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r) ld4(x + (ty + 8 * r) * PS + d, xa[r]);
#pragma unroll
        for (int c = 0; c < 4; ++c) ld4(y + (tx + 8 * c) * PS + d, yb[c]);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[r][c] += xa[r][i] * yb[c][i];
    }
}

// Stores a thread's 4 × 4 tile v[r][c] (own row ty + 8r, streamed row tx + 8c) as w[streamed]
// [slot 4·ty + r] ([32][WS]), the layout `weighted_rows` reads.
#define WS 36
template <typename A>
__device__ __forceinline__ void store_weights(A* w, int ty, int tx, const A (&v)[4][4]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        A col[4] = {v[0][c], v[1][c], v[2][c], v[3][c]};
        st4(w + (tx + 8 * c) * WS + ty * 4, col);
    }
}
// The transpose: w[own row ty + 8r][slot 4·tx + c] (for a product whose output rows are the
// streamed ones).
template <typename A>
__device__ __forceinline__ void store_weights_transposed(A* w, int ty, int tx, const A (&v)[4][4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) st4(w + (ty + 8 * r) * WS + tx * 4, v[r]);
}

// out[r][4i + j] += Σ_n w[n][4·ty + r] · z[n][4·tx + 32i + j]: `w` from `store_weights`,
// `z` a [32][DP + 4] tile.
template <typename A, int DC>
__device__ __forceinline__ void weighted_rows(const A* w, const A* z, int ty, int tx, A (&out)[4][DC]) {
    constexpr int PS = 8 * DC + 4;
#pragma unroll 4
    for (int n = 0; n < BK; ++n) {
        A wa[4];
        ld4(w + n * WS + ty * 4, wa);
#pragma unroll
        for (int i = 0; i < DC / 4; ++i) {
            A zb[4];
            ld4(z + n * PS + tx * 4 + 32 * i, zb);
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int j = 0; j < 4; ++j) out[r][4 * i + j] += wa[r] * zb[j];
        }
    }
}

// Writes a thread's 4 × DC output tile (rows own0 + ty + 8r, columns 4·tx + 32i + j) times
// mul[r] to operand `op`.
template <typename T, typename A, int DC>
__device__ __forceinline__ void store_rows(T* dst, const AttnArgs& a, int op, unsigned int b,
                                           unsigned int h, unsigned int own0, unsigned int limit,
                                           int ty, int tx, const A (&val)[4][DC], const A (&mul)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        unsigned int row = own0 + ty + 8 * r;
        if (row >= limit) continue;
        T* base = dst + row_at(a, op, b, h, row);
#pragma unroll
        for (int i = 0; i < DC / 4; ++i) {
            int d = tx * 4 + 32 * i;
            A v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = val[r][4 * i + j] * mul[r];
            if (a.vector) {
                if (d < (int)a.head_dim) gst4(base + d, v);
            } else {
                for (int j = 0; j < 4; ++j)
                    if (d + j < (int)a.head_dim) st(base + d + j, v[j]);
            }
        }
    }
}

template <typename A, int R, int C> __device__ __forceinline__ void zero(A (&x)[R][C]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) x[r][c] = 0;
}

template <typename T, int DC, bool DROP>
__device__ void attention_forward(const T* q, const T* k, const T* v, T* o,
                                  typename Acc<T>::type* lse, const AttnArgs& a) {
    typedef typename Acc<T>::type A;
    constexpr int DP = 8 * DC, PS = DP + 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* qs = (A*)smem_raw;  // [32][PS]
    A* ks = qs + BQ * PS;  // [32][PS]
    A* vs = ks + BK * PS;  // [32][PS]
    A* ps = vs + BK * PS;  // [32][WS]
    const unsigned int b = blockIdx.y / a.heads, h = blockIdx.y % a.heads, kvh = h / group_size(a);
    const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
    const unsigned int q0 = blockIdx.x * BQ;
    load_rows<T, A, DP>(q, a, OP_Q, b, h, q0, a.queries, (A)(a.scale * LOG2E), qs);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;

    A acc[4][DC], m[4], l[4];
    unsigned int lo[4], hi[4];
    zero(acc);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        m[r] = neg_inf<A>();
        l[r] = 0;
        keys_seen(a, q0 + ty + 8 * r, lo[r], hi[r]);
    }
    unsigned int key_begin, key_end;
    block_range(a, true, q0, BQ, key_begin, key_end);
    for (unsigned int k0 = key_begin; k0 < key_end; k0 += BK) {
        __syncthreads();
        load_rows<T, A, DP>(k, a, OP_K, b, kvh, k0, a.keys, (A)1, ks);
        load_rows<T, A, DP>(v, a, OP_V, b, kvh, k0, a.keys, (A)1, vs);
        __syncthreads();
        A s[4][4];
        zero(s);
        tile_product<A, DP>(qs, ks, ty, tx, s);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            A tile_max = neg_inf<A>();
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                unsigned int key = k0 + tx + 8 * c;
                if (key < lo[r] || key >= hi[r]) s[r][c] = neg_inf<A>();
                tile_max = max(tile_max, s[r][c]);
            }
            tile_max = row_max(tile_max);
            A m_new = max(m[r], tile_max);
            A base = m_new == neg_inf<A>() ? (A)0 : m_new;
            A correction = m_exp2(m[r] - base);
            m[r] = m_new;
            l[r] *= correction;
#pragma unroll
            for (int c = 0; c < DC; ++c) acc[r][c] *= correction;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                s[r][c] = m_exp2(s[r][c] - base);
                l[r] += s[r][c];
                if (DROP && !dropout_keeps(a, drop_base, blockIdx.y, q0 + ty + 8 * r, k0 + tx + 8 * c))
                    s[r][c] = (A)0;
            }
        }
        store_weights(ps, ty, tx, s);
        __syncthreads();
        weighted_rows<A, DC>(ps, vs, ty, tx, acc);
    }
    A inv[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        A total = row_sum(l[r]);
        inv[r] = total > (A)0 ? (A)1 / total : (A)0;
        if constexpr (DROP) inv[r] *= (A)a.dropout_scale;
        unsigned int row = q0 + ty + 8 * r;
        if (tx == 0 && row < a.queries)
            lse[(unsigned long long)blockIdx.y * a.queries + row] = (m[r] + m_log2(total)) * (A)LN2;
    }
    store_rows<T, A, DC>(o, a, OP_O, b, h, q0, a.queries, ty, tx, acc, inv);
}

// dQ, and Δ = dO·O per query for the dK/dV kernel.
template <typename T, int DC, bool DROP>
__device__ void attention_backward_dq(const T* q, const T* k, const T* v, const T* o, const T* dout,
                                      const typename Acc<T>::type* lse, T* dq,
                                      typename Acc<T>::type* delta, const AttnArgs& a) {
    typedef typename Acc<T>::type A;
    constexpr int DP = 8 * DC, PS = DP + 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* qs = (A*)smem_raw;      // [32][PS]
    A* dos = qs + BQ * PS;     // [32][PS]
    A* ks = dos + BQ * PS;     // [32][PS]
    A* vs = ks + BK * PS;      // [32][PS]
    A* dst = vs + BK * PS;     // [32][WS]
    A* lses = dst + BK * WS;   // [32]
    A* deltas = lses + BQ;     // [32]
    const unsigned int b = blockIdx.y / a.heads, h = blockIdx.y % a.heads, kvh = h / group_size(a);
    const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
    const unsigned int q0 = blockIdx.x * BQ;
    const unsigned long long stats = (unsigned long long)blockIdx.y * a.queries;
    load_rows<T, A, DP>(q, a, OP_Q, b, h, q0, a.queries, (A)1, qs);
    load_rows<T, A, DP>(dout, a, OP_DO, b, h, q0, a.queries, (A)1, dos);
    // Δ: the 8 threads of a row each take every 8th 4-element chunk of dO·O.
    for (int i = threadIdx.x >> 3; i < BQ; i += THREADS / 8) {
        unsigned int row = q0 + i;
        A dl = 0;
        if (row < a.queries) {
            const T* op = o + row_at(a, OP_O, b, h, row);
            const T* gp = dout + row_at(a, OP_DO, b, h, row);
            for (int d = tx * 4; d < (int)a.head_dim; d += 32) {
                A ov[4] = {0, 0, 0, 0}, gv[4] = {0, 0, 0, 0};
                if (a.vector) {
                    gld4(op + d, ov);
                    gld4(gp + d, gv);
                } else {
                    for (int j = 0; j < 4; ++j)
                        if (d + j < (int)a.head_dim) {
                            ov[j] = ld(op + d + j);
                            gv[j] = ld(gp + d + j);
                        }
                }
                for (int j = 0; j < 4; ++j) dl += ov[j] * gv[j];
            }
        }
        dl = row_sum(dl);
        if (tx == 0) {
            deltas[i] = dl;
            lses[i] = row < a.queries ? lse[stats + row] * (A)LOG2E : (A)0;
            if (row < a.queries) delta[stats + row] = dl;
        }
    }
    const A scale2 = (A)(a.scale * LOG2E);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    A acc[4][DC];
    zero(acc);
    unsigned int lo[4], hi[4], key_begin, key_end;
#pragma unroll
    for (int r = 0; r < 4; ++r) keys_seen(a, q0 + ty + 8 * r, lo[r], hi[r]);
    block_range(a, true, q0, BQ, key_begin, key_end);
    for (unsigned int k0 = key_begin; k0 < key_end; k0 += BK) {
        __syncthreads();
        load_rows<T, A, DP>(k, a, OP_K, b, kvh, k0, a.keys, (A)1, ks);
        load_rows<T, A, DP>(v, a, OP_V, b, kvh, k0, a.keys, (A)1, vs);
        __syncthreads();
        A s[4][4], dp[4][4];
        zero(s);
        zero(dp);
        tile_product<A, DP>(qs, ks, ty, tx, s);
        tile_product<A, DP>(dos, vs, ty, tx, dp);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            A l2 = lses[ty + 8 * r], dl = deltas[ty + 8 * r];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                unsigned int key = k0 + tx + 8 * c;
                bool hidden = key < lo[r] || key >= hi[r];
                A p = hidden ? (A)0 : m_exp2(s[r][c] * scale2 - l2);
                A dpv = dp[r][c];
                if constexpr (DROP)
                    dpv = dropout_keeps(a, drop_base, blockIdx.y, q0 + ty + 8 * r, key) ? dpv * (A)a.dropout_scale
                                                                                       : (A)0;
                s[r][c] = p * (dpv - dl);
            }
        }
        store_weights(dst, ty, tx, s);
        __syncthreads();
        weighted_rows<A, DC>(dst, ks, ty, tx, acc);
    }
    const A scale = (A)a.scale;
    const A mul[4] = {scale, scale, scale, scale};
    store_rows<T, A, DC>(dq, a, OP_DQ, b, h, q0, a.queries, ty, tx, acc, mul);
}

// What a block of keys k0..k0 + 32 streams: each own key row k0 + ty + 8r sees queries [lo[r],
// hi[r]) of every head of the group (causal: none before it); the block's query tiles start at
// `query_begin`, and their count is returned.
__device__ __forceinline__ unsigned int key_block_queries(const AttnArgs& a, unsigned int k0, int ty,
                                                          unsigned int (&lo)[4], unsigned int (&hi)[4],
                                                          unsigned int& query_begin) {
#pragma unroll
    for (int r = 0; r < 4; ++r) queries_seeing(a, k0 + ty + 8 * r, lo[r], hi[r]);
    unsigned int query_end;
    block_range(a, false, k0, BK, query_begin, query_end);
    return (query_end - query_begin + BQ - 1) / BQ;
}

// dK and dV of 32 keys, streaming queries, dO, lse and Δ.
template <typename T, int DC, bool DROP>
__device__ void attention_backward_dkdv(const T* q, const T* k, const T* v, const T* dout,
                                        const typename Acc<T>::type* lse,
                                        const typename Acc<T>::type* delta, T* dk, T* dv,
                                        const AttnArgs& a) {
    typedef typename Acc<T>::type A;
    constexpr int DP = 8 * DC, PS = DP + 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* ks = (A*)smem_raw;      // [32][PS]
    A* vs = ks + BK * PS;      // [32][PS]
    A* qs = vs + BK * PS;      // [32][PS]
    A* dos = qs + BQ * PS;     // [32][PS]
    A* ps = dos + BQ * PS;     // [32][WS]
    A* dss = ps + BQ * WS;     // [32][WS]
    A* lses = dss + BQ * WS;   // [32]
    A* deltas = lses + BQ;     // [32]
    // One block per (batch, kv head) and 32 keys: dK and dV sum over the group's query heads.
    const unsigned int b = blockIdx.y / a.kv_heads, kvh = blockIdx.y % a.kv_heads, group = group_size(a);
    const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
    const unsigned int k0 = blockIdx.x * BK;
    load_rows<T, A, DP>(k, a, OP_K, b, kvh, k0, a.keys, (A)1, ks);
    load_rows<T, A, DP>(v, a, OP_V, b, kvh, k0, a.keys, (A)1, vs);
    const A scale2 = (A)(a.scale * LOG2E);
    const unsigned long long drop_base = DROP ? dropout_base(a) : 0;
    A dka[4][DC], dva[4][DC];
    zero(dka);
    zero(dva);
    unsigned int lo[4], hi[4], query_begin;
    const unsigned int tiles = key_block_queries(a, k0, ty, lo, hi, query_begin);
    for (unsigned int step = 0; step < group * tiles; ++step) {
        const unsigned int h = kvh * group + step / tiles, q0 = query_begin + step % tiles * BQ;
        const unsigned long long stats = ((unsigned long long)b * a.heads + h) * a.queries;
        __syncthreads();
        load_rows<T, A, DP>(q, a, OP_Q, b, h, q0, a.queries, (A)1, qs);
        load_rows<T, A, DP>(dout, a, OP_DO, b, h, q0, a.queries, (A)1, dos);
        for (int i = threadIdx.x; i < BQ; i += THREADS) {
            bool in = q0 + i < a.queries;
            lses[i] = in ? lse[stats + q0 + i] * (A)LOG2E : (A)0;
            deltas[i] = in ? delta[stats + q0 + i] : (A)0;
        }
        __syncthreads();
        // Transposed scores: own rows are keys (ty + 8r), streamed ones queries (tx + 8c).
        A s[4][4], dp[4][4];
        zero(s);
        zero(dp);
        tile_product<A, DP>(ks, qs, ty, tx, s);
        tile_product<A, DP>(vs, dos, ty, tx, dp);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            unsigned int query = q0 + tx + 8 * c;
            A l2 = lses[tx + 8 * c], dl = deltas[tx + 8 * c];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                bool hidden = query < lo[r] || query >= hi[r];
                A p = hidden ? (A)0 : m_exp2(s[r][c] * scale2 - l2);
                if constexpr (DROP) {
                    const A factor = dropout_keeps(a, drop_base, (unsigned long long)b * a.heads + h, query,
                                                   k0 + ty + 8 * r)
                                         ? (A)a.dropout_scale
                                         : (A)0;
                    s[r][c] = p * factor;
                    dp[r][c] = p * (dp[r][c] * factor - dl);
                } else {
                    s[r][c] = p;
                    dp[r][c] = p * (dp[r][c] - dl);
                }
            }
        }
        store_weights(ps, ty, tx, s);
        store_weights(dss, ty, tx, dp);
        __syncthreads();
        weighted_rows<A, DC>(ps, dos, ty, tx, dva);
        weighted_rows<A, DC>(dss, qs, ty, tx, dka);
    }
    const A scale = (A)a.scale;
    const A mul_k[4] = {scale, scale, scale, scale};
    const A one[4] = {(A)1, (A)1, (A)1, (A)1};
    store_rows<T, A, DC>(dk, a, OP_DK, b, kvh, k0, a.keys, ty, tx, dka, mul_k);
    store_rows<T, A, DC>(dv, a, OP_DV, b, kvh, k0, a.keys, ty, tx, dva, one);
}

// The backward in one pass over the keys (opt-in, f32 and f64): `attention_backward_delta_zero`
// writes Δ and zeroes dQ, then `attention_backward_fused` takes 32 keys like the dK/dV kernel and
// also adds each streamed query tile's dQ share, scale · dSᵀ·K, into dQ with atomics — five
// tile products per key and query tile instead of the two kernels' seven (no recomputed scores
// and dP for dQ), at the price of atomic adds (and a summation order that varies from run to run).

// Δ = dO·O per query (rows of pair-major [batch, heads, queries]) and dQ's row set to zero; one
// warp per row.
template <typename T>
__device__ void attention_backward_delta_zero(const T* o, const T* dout, typename Acc<T>::type* delta, T* dq,
                                              const AttnArgs& a) {
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x & 31;
    unsigned long long rows = (unsigned long long)a.batch * a.heads * a.queries;
    for (unsigned long long r = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) >> 5; r < rows;
         r += (gridDim.x * (unsigned long long)blockDim.x) >> 5) {
        unsigned int i = (unsigned int)(r % a.queries);
        unsigned long long pair = r / a.queries;
        unsigned int b = (unsigned int)(pair / a.heads), h = (unsigned int)(pair % a.heads);
        const T* op = o + row_at(a, OP_O, b, h, i);
        const T* gp = dout + row_at(a, OP_DO, b, h, i);
        T* qp = dq + row_at(a, OP_DQ, b, h, i);
        A acc = 0;
        for (unsigned int d = lane; d < a.head_dim; d += 32) {
            acc += ld(op + d) * ld(gp + d);
            qp[d] = (T)0;
        }
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
        if (lane == 0) delta[r] = acc;
    }
}

// dK and dV of 32 keys as `attention_backward_dkdv`, plus their share of dQ, added atomically
// into the zeroed dQ.
template <typename T, int DC>
__device__ void attention_backward_fused(const T* q, const T* k, const T* v, const T* dout,
                                         const typename Acc<T>::type* lse,
                                         const typename Acc<T>::type* delta, T* dq, T* dk, T* dv,
                                         const AttnArgs& a) {
    typedef typename Acc<T>::type A;
    constexpr int DP = 8 * DC, PS = DP + 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* ks = (A*)smem_raw;      // [32][PS]
    A* vs = ks + BK * PS;      // [32][PS]
    A* qs = vs + BK * PS;      // [32][PS]
    A* dos = qs + BQ * PS;     // [32][PS]
    A* ps = dos + BQ * PS;     // [32][WS]
    A* dss = ps + BQ * WS;     // [32][WS]
    A* dsq = dss + BQ * WS;    // [32][WS]: dS by key, query slots (for dQ)
    A* lses = dsq + BK * WS;   // [32]
    A* deltas = lses + BQ;     // [32]
    // One block per (batch, kv head) and 32 keys: dK and dV sum over the group's query heads.
    const unsigned int b = blockIdx.y / a.kv_heads, kvh = blockIdx.y % a.kv_heads, group = group_size(a);
    const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
    const unsigned int k0 = blockIdx.x * BK;
    load_rows<T, A, DP>(k, a, OP_K, b, kvh, k0, a.keys, (A)1, ks);
    load_rows<T, A, DP>(v, a, OP_V, b, kvh, k0, a.keys, (A)1, vs);
    const A scale2 = (A)(a.scale * LOG2E);
    const A scale = (A)a.scale;
    A dka[4][DC], dva[4][DC];
    zero(dka);
    zero(dva);
    unsigned int lo[4], hi[4], query_begin;
    const unsigned int tiles = key_block_queries(a, k0, ty, lo, hi, query_begin);
    for (unsigned int step = 0; step < group * tiles; ++step) {
        const unsigned int h = kvh * group + step / tiles, q0 = query_begin + step % tiles * BQ;
        const unsigned long long stats = ((unsigned long long)b * a.heads + h) * a.queries;
        __syncthreads();
        load_rows<T, A, DP>(q, a, OP_Q, b, h, q0, a.queries, (A)1, qs);
        load_rows<T, A, DP>(dout, a, OP_DO, b, h, q0, a.queries, (A)1, dos);
        for (int i = threadIdx.x; i < BQ; i += THREADS) {
            bool in = q0 + i < a.queries;
            lses[i] = in ? lse[stats + q0 + i] * (A)LOG2E : (A)0;
            deltas[i] = in ? delta[stats + q0 + i] : (A)0;
        }
        __syncthreads();
        A s[4][4], dp[4][4];
        zero(s);
        zero(dp);
        tile_product<A, DP>(ks, qs, ty, tx, s);
        tile_product<A, DP>(vs, dos, ty, tx, dp);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            unsigned int query = q0 + tx + 8 * c;
            A l2 = lses[tx + 8 * c], dl = deltas[tx + 8 * c];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                bool hidden = query < lo[r] || query >= hi[r];
                A p = hidden ? (A)0 : m_exp2(s[r][c] * scale2 - l2);
                s[r][c] = p;
                dp[r][c] = p * (dp[r][c] - dl);
            }
        }
        store_weights(ps, ty, tx, s);
        store_weights(dss, ty, tx, dp);
        store_weights_transposed(dsq, ty, tx, dp);
        __syncthreads();
        weighted_rows<A, DC>(ps, dos, ty, tx, dva);
        weighted_rows<A, DC>(dss, qs, ty, tx, dka);
        // This key tile's share of dQ for queries q0 + ty + 8r: Σ_key dS[key][query] · K[key].
        A dqa[4][DC];
        zero(dqa);
        weighted_rows<A, DC>(dsq, ks, ty, tx, dqa);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            unsigned int row = q0 + ty + 8 * r;
            if (row >= a.queries) continue;
            T* base = dq + row_at(a, OP_DQ, b, h, row);
#pragma unroll
            for (int i = 0; i < DC / 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int d = tx * 4 + 32 * i + j;
                    if (d < (int)a.head_dim) atomicAdd(base + d, (T)(dqa[r][4 * i + j] * scale));
                }
        }
    }
    const A mul_k[4] = {scale, scale, scale, scale};
    const A one[4] = {(A)1, (A)1, (A)1, (A)1};
    store_rows<T, A, DC>(dk, a, OP_DK, b, kvh, k0, a.keys, ty, tx, dka, mul_k);
    store_rows<T, A, DC>(dv, a, OP_DV, b, kvh, k0, a.keys, ty, tx, dva, one);
}

// The tensor-core path of 16-bit dtypes (crates/ops-cuda/src/attention/gemm.rs): cuBLAS computes
// the f32 score and dP matrices of a chunk of (batch, head) pairs, these kernels turn them into
// probabilities and score gradients in the storage dtype for the next products.

// Row r of `s` ([rows, sk] f32 scores of query r % sq, rows `ld` apart): lse[first + r] =
// log Σ exp(scale · s), p = exp(scale · s − lse), keys after the query hidden when causal. One warp
// per row.
template <typename T>
__device__ void attention_softmax(const float* s, T* p, float* lse, unsigned long long rows,
                                  unsigned int sq, unsigned int sk, unsigned int ld, float scale,
                                  unsigned int causal, unsigned long long first) {
    const int lane = threadIdx.x & 31;
    const float scale2 = scale * (float)LOG2E;
    for (unsigned long long r = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) >> 5; r < rows;
         r += (gridDim.x * (unsigned long long)blockDim.x) >> 5) {
        const float* row = s + r * ld;
        unsigned int visible = causal ? min(sk, (unsigned int)(r % sq) + 1) : sk;
        float m = -CUDART_INF_F;
        for (unsigned int j = lane; j < visible; j += 32) m = max(m, row[j] * scale2);
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffff, m, o));
        float sum = 0;
        for (unsigned int j = lane; j < visible; j += 32) sum += exp2f(row[j] * scale2 - m);
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
        float l2 = m + log2f(sum);
        if (lane == 0) lse[first + r] = l2 * (float)LN2;
        T* out = p + r * ld;
        for (unsigned int j = lane; j < sk; j += 32) st(out + j, j < visible ? exp2f(row[j] * scale2 - l2) : 0.0f);
    }
}

// Elementwise over [rows, sk] (rows `ld` apart): p = exp(scale · s − lse), ds = p · (dp − Δ)
// (zero where hidden).
template <typename T>
__device__ void attention_probs_backward(const float* s, const float* dp, const float* lse,
                                         const float* delta, T* p, T* ds, unsigned long long rows,
                                         unsigned int sq, unsigned int sk, unsigned int ld,
                                         float scale, unsigned int causal, unsigned long long first) {
    const float scale2 = scale * (float)LOG2E;
    unsigned long long n = rows * sk;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * (unsigned long long)blockDim.x) {
        unsigned long long r = i / sk;
        unsigned int key = (unsigned int)(i - r * sk);
        unsigned long long at = r * ld + key;
        bool hidden = causal && key > (unsigned int)(r % sq);
        float prob = hidden ? 0.0f : exp2f(s[at] * scale2 - lse[first + r] * (float)LOG2E);
        st(p + at, prob);
        st(ds + at, prob * (dp[at] - delta[first + r]));
    }
}

// Δ = dO·O for every query (rows of pair-major [batch, heads, queries]); one warp per row.
template <typename T>
__device__ void attention_delta(const T* o, const T* dout, float* delta, const AttnArgs& a) {
    const int lane = threadIdx.x & 31;
    unsigned long long rows = (unsigned long long)a.batch * a.heads * a.queries;
    for (unsigned long long r = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) >> 5; r < rows;
         r += (gridDim.x * (unsigned long long)blockDim.x) >> 5) {
        unsigned int i = (unsigned int)(r % a.queries);
        unsigned long long pair = r / a.queries;
        unsigned int b = (unsigned int)(pair / a.heads), h = (unsigned int)(pair % a.heads);
        const T* op = o + row_at(a, OP_O, b, h, i);
        const T* gp = dout + row_at(a, OP_DO, b, h, i);
        float acc = 0;
        for (unsigned int d = lane; d < a.head_dim; d += 32) acc += ld(op + d) * ld(gp + d);
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
        if (lane == 0) delta[r] = acc;
    }
}

#define ATTENTION_GEMM_KERNELS(T, N)                                                                      \
    extern "C" __global__ void attention_softmax_##N(const float* s, T* p, float* lse,                  \
                                                     unsigned long long rows, unsigned int sq,          \
                                                     unsigned int sk, unsigned int ld, float scale,     \
                                                     unsigned int causal, unsigned long long first) {   \
        attention_softmax<T>(s, p, lse, rows, sq, sk, ld, scale, causal, first);                        \
    }                                                                                                   \
    extern "C" __global__ void attention_probs_backward_##N(                                            \
        const float* s, const float* dp, const float* lse, const float* delta, T* p, T* ds,             \
        unsigned long long rows, unsigned int sq, unsigned int sk, unsigned int ld, float scale,        \
        unsigned int causal, unsigned long long first) {                                                \
        attention_probs_backward<T>(s, dp, lse, delta, p, ds, rows, sq, sk, ld, scale, causal, first);  \
    }                                                                                                   \
    extern "C" __global__ void attention_delta_##N(const T* o, const T* dout, float* delta, AttnArgs a) { \
        attention_delta<T>(o, dout, delta, a);                                                          \
    }

ATTENTION_GEMM_KERNELS(__half, f16)
ATTENTION_GEMM_KERNELS(__nv_bfloat16, bf16)

// Kernels per dtype and column count: `attention_forward_<dtype>_<dc>` and so on; head dims up to
// 8·DC; with dropout `attention_forward_dropout_<dtype>_<dc>` and so on (below, no fused
// backward).
// f32 and f64 only: f16 and bf16 take the tensor-core path above.
#define ATTENTION_KERNELS_OF(T, N, DC, DROP, TAG)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_forward##TAG##N##_##DC(             \
        const T* q, const T* k, const T* v, T* o, Acc<T>::type* lse, AttnArgs a) {                      \
        attention_forward<T, DC, DROP>(q, k, v, o, lse, a);                                             \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_backward_dq##TAG##N##_##DC(         \
        const T* q, const T* k, const T* v, const T* o, const T* dout, const Acc<T>::type* lse, T* dq,  \
        Acc<T>::type* delta, AttnArgs a) {                                                              \
        attention_backward_dq<T, DC, DROP>(q, k, v, o, dout, lse, dq, delta, a);                        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_backward_dkdv##TAG##N##_##DC(       \
        const T* q, const T* k, const T* v, const T* dout, const Acc<T>::type* lse,                     \
        const Acc<T>::type* delta, T* dk, T* dv, AttnArgs a) {                                          \
        attention_backward_dkdv<T, DC, DROP>(q, k, v, dout, lse, delta, dk, dv, a);                     \
    }
#define ATTENTION_KERNELS(T, N, DC)                                                                      \
    ATTENTION_KERNELS_OF(T, N, DC, false, _)                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_backward_fused_##N##_##DC(          \
        const T* q, const T* k, const T* v, const T* dout, const Acc<T>::type* lse,                     \
        const Acc<T>::type* delta, T* dq, T* dk, T* dv, AttnArgs a) {                                   \
        attention_backward_fused<T, DC>(q, k, v, dout, lse, delta, dq, dk, dv, a);                      \
    }

#define ATTENTION_WIDTHS(T, N) \
    ATTENTION_KERNELS(T, N, 4)  \
    ATTENTION_KERNELS(T, N, 8)  \
    ATTENTION_KERNELS(T, N, 12) \
    ATTENTION_KERNELS(T, N, 16)

ATTENTION_WIDTHS(float, f32)
ATTENTION_WIDTHS(double, f64)

// Dropout builds (each a whole set of unrolled kernels in the committed PTX, so only these):
// f32 at DC 8 and 16, f64 at 16; register_tiled.rs pads a dropping call's head dim to them.
ATTENTION_KERNELS_OF(float, f32, 8, true, _dropout_)
ATTENTION_KERNELS_OF(float, f32, 16, true, _dropout_)
ATTENTION_KERNELS_OF(double, f64, 16, true, _dropout_)

#define ATTENTION_DELTA_ZERO(T, N)                                                                       \
    extern "C" __global__ void attention_backward_delta_zero_##N(const T* o, const T* dout,             \
                                                                 Acc<T>::type* delta, T* dq, AttnArgs a) { \
        attention_backward_delta_zero<T>(o, dout, delta, dq, a);                                        \
    }
ATTENTION_DELTA_ZERO(float, f32)
ATTENTION_DELTA_ZERO(double, f64)
