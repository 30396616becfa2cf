// Attention forward for bf16 and f16 on Hopper, warp-specialised (issue 35; FlashAttention-3's
// layout): a block of three warpgroups takes 128 queries of one (batch, head) pair. Warpgroup 0 is
// the producer: one thread loads Q once and K and V 128 keys a tile with the tensor memory
// accelerator (`cp.async.bulk.tensor`, tensor maps built by crates/ops-cuda/src/attention/
// warp_specialized.rs), into two stages each for K and V, every stage behind a "full" and an
// "empty" mbarrier; it then gives its registers up (`setmaxnreg`). Warpgroups 1 and 2 are the
// consumers, 64 queries each: S = Q·Kᵀ by one m64n128 wgmma a 16-element step from the swizzled
// Q and K tiles, the online softmax of attention_flash.cuh, O += P·V with P from registers and V
// read transposed, releasing each stage as soon as its last product has read it. The tiles are
// attention_wgmma.cuh's 128-byte-swizzled atoms, which is also the layout the tensor maps'
// 128-byte swizzle writes (rows of 64 elements, 1024-byte aligned), so one descriptor form
// serves both.
//
// The backward's kernels have the same layout: dK/dV over 128 keys, then dQ over 128 queries,
// which runs first and writes Δ (the end of this file). No dropout and no packed sequences here (the
// wgmma kernels take those); the saved log-sum-exp is theirs, so either path's backward follows
// either forward. Built for compute_90a by `cargo xtask build-kernels`.

#include "attention_wgmma.cuh"

#define WS_ROWS 128      // queries a block: two consumer warpgroups of 64
#define WS_KEYS 128      // keys a streamed tile
#define WS_HALF 16384    // one 64-column half of a 128-row tile (128 rows of 128 bytes)
#define WS_THREADS 384   // the producer warpgroup and two consumers
#define WS_CONSUMER_WARPS 8

// A tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned), read by the TMA unit from the
// kernel's parameter space.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// The kernel's one parameter after the pointers: Q's, K's and V's tensor maps (dims head dim,
// rows, heads, batch; boxes of 64 × 128 × 1 × 1 with the 128-byte swizzle) and the attention's
// arguments (crates/ops-cuda/src/attention/warp_specialized.rs' `WsParams`, field for field).
struct alignas(64) WsParams {
    TensorMap q, k, v;
    AttnArgs a;
};
static_assert(sizeof(TensorMap) == 128, "TensorMap layout");
static_assert(sizeof(AttnArgs) == 352, "AttnArgs layout");
static_assert(sizeof(WsParams) == 768, "WsParams layout");

__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the barrier's phase of parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int phase) {
    unsigned int done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(phase)
            : "memory");
    }
}
// Box (c0, c1, c2, c3) of `map` into shared memory at `dst`, completing `bytes` of `bar`'s
// transaction count.
__device__ __forceinline__ void tma_load_4d(unsigned int dst, const TensorMap& map, int c0, int c1, int c2, int c3,
                                            unsigned int bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Rows `row`.. (the map's box of them: 128, or 64 for the backward's maps) of one (head, batch) of
// a tensor map into the DP / 64 column halves at `tile`, HALF bytes apart (one box's bytes), on
// `bar`.
template <int DP, int HALF = WS_HALF>
__device__ __forceinline__ void tma_tile(unsigned char* tile, const TensorMap& map, unsigned int row, unsigned int h,
                                         unsigned int b, unsigned int bar) {
#pragma unroll
    for (int half = 0; half < DP / 64; ++half)
        tma_load_4d(smem_address(tile + half * HALF), map, half * 64, (int)row, (int)h, (int)b, bar);
}

// S (64 queries × 128 keys) = the warpgroup's Q rows · the K tile's rows, over the head dim:
// issued and committed; the caller waits.
template <typename T, int DP>
__device__ __forceinline__ void issue_scores(float (&sc)[WS_KEYS / 8][4], const unsigned char* own_q,
                                             const unsigned char* kt) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        const int offset = (kk >> 2) * WS_HALF + (kk & 3) * 32;
        Wg<T>::ss_n128(sc, sw128_desc(own_q + offset, 1024, 16), sw128_desc(kt + offset, 1024, 16), kk > 0);
    }
    wgmma_commit();
}

// O += P · the V tile over its 128 keys, 16 a step (P as A fragments, V read transposed):
// issued and committed; the caller waits.
template <typename T, int DP>
__device__ __forceinline__ void issue_values(float (&acc)[DP / 8][4], const unsigned int (&pa)[WS_KEYS / 16][4],
                                             const unsigned char* vt) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < WS_KEYS / 16; ++kk) {
        const unsigned long long dz = sw128_desc(vt + kk * 2048, 1024, WS_HALF);
        if constexpr (DP == 64) Wg<T>::rs_n64(acc, pa[kk], dz);
        else Wg<T>::rs_n128(acc, pa[kk], dz);
    }
    wgmma_commit();
}

// The probabilities P (accumulator layout) rounded to T as the A fragments of issue_values.
template <typename T>
__device__ __forceinline__ void pack_weights(const float (&sc)[WS_KEYS / 8][4], unsigned int (&pa)[WS_KEYS / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < WS_KEYS / 16; ++kk) {
        pa[kk][0] = Tc<T>::pack(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = Tc<T>::pack(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = Tc<T>::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = Tc<T>::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
}

// attention_flash.cuh's online_softmax without the output's rescaling, which it leaves to the
// caller (`correction`, a factor per row): the running maximum m and sum l move to the tile's, and
// the raw scores become probabilities.
__device__ __forceinline__ void softmax_scores(float (&sc)[WS_KEYS / 8][4], float (&m)[2], float (&l)[2], float scale2,
                                               float (&correction)[2]) {
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -CUDART_INF_F;
#pragma unroll
        for (int n = 0; n < WS_KEYS / 8; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[r], mx * scale2);
        base[r] = m_new == -CUDART_INF_F ? 0.f : m_new;
        correction[r] = fast_exp2(m[r] - base[r]);
        m[r] = m_new;
        l[r] *= correction[r];
    }
#pragma unroll
    for (int n = 0; n < WS_KEYS / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const float p = fast_exp2(fmaf(sc[n][e], scale2, -base[r]));
            l[r] += p;
            sc[n][e] = p;
        }
}

// The output's rows times their corrections.
template <int NT>
__device__ __forceinline__ void rescale_rows(float (&acc)[NT][4], const float (&correction)[2]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] *= correction[e >> 1];
}

// FlashAttention-3's ping-pong between the two consumer warpgroups: a warpgroup issues its
// products only in its turn (named barrier 2 + its index, both warpgroups' 256 threads: its own
// sync, the other's arrive), and hands the turn over once they are issued, so one warpgroup's
// softmax runs while the other's products do.
__device__ __forceinline__ void take_turn(int cw) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(2 + cw) : "memory");
}
__device__ __forceinline__ void hand_turn_over(int cw) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(2 + (cw ^ 1)) : "memory");
}

template <typename T, int DP, bool OVERLAP, bool PINGPONG>
__device__ void ws_forward(T* o, float* lse, const WsParams& p) {
    const AttnArgs& a = p.a;
    constexpr int TILE = DP / 64 * WS_HALF, NB = WS_KEYS / 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
    unsigned char* qs = base;              // 128 queries
    unsigned char* ks = qs + TILE;         // 2 stages of 128 keys
    unsigned char* vs = ks + 2 * TILE;     // 2 stages of 128 values
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(vs + 2 * TILE);
    // q_full, k_full[2], v_full[2], k_empty[2], v_empty[2]
    const unsigned int q_full = smem_address(bars), k_full = q_full + 8, v_full = q_full + 24,
                       k_empty = q_full + 40, v_empty = q_full + 56;
    unsigned int tile, pair;
    block_tile(a, true, tile, pair);
    const unsigned int b = pair / a.heads, h = pair % a.heads, kvh = h / group_size(a);
    const unsigned int q0 = tile * WS_ROWS;
    unsigned int key_begin, key_end;
    block_range(a, true, q0, WS_ROWS, key_begin, key_end);
    const int tiles = (key_end - key_begin + WS_KEYS - 1) / WS_KEYS;
    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < 2; ++s) {
            mbar_init(k_full + 8 * s, 1);
            mbar_init(v_full + 8 * s, 1);
            mbar_init(k_empty + 8 * s, WS_CONSUMER_WARPS);
            mbar_init(v_empty + 8 * s, WS_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int group = threadIdx.x / 128;
    if (group == 0) {
        // The producer: one thread issues every load; the warpgroup's registers go to the consumers.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(q_full, TILE);
            tma_tile<DP>(qs, p.q, q0, h, b, q_full);
            for (int j = 0; j < tiles; ++j) {
                const int s = j & 1;
                const unsigned int phase = (j >> 1) & 1, k0 = key_begin + j * WS_KEYS;
                // Stage s was last filled for tile j - 2: its consumers must have released it.
                if (j >= 2) mbar_wait(k_empty + 8 * s, phase ^ 1);
                mbar_arrive_expect_tx(k_full + 8 * s, TILE);
                tma_tile<DP>(ks + s * TILE, p.k, k0, kvh, b, k_full + 8 * s);
                if (j >= 2) mbar_wait(v_empty + 8 * s, phase ^ 1);
                mbar_arrive_expect_tx(v_full + 8 * s, TILE);
                tma_tile<DP>(vs + s * TILE, p.v, k0, kvh, b, v_full + 8 * s);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    // A consumer: 64 queries (rows 64·(group - 1).. of the block), each warp 16 in wgmma's
    // accumulator rows.
    const int cw = group - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned int warp_row0 = cw * 64 + warp * 16;
    unsigned int lo[2], hi[2], common_lo, common_hi;
#pragma unroll
    for (int r = 0; r < 2; ++r) keys_seen(a, q0 + warp_row0 + 8 * r + g, lo[r], hi[r]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    float acc[DP / 8][4] = {}, m[2], l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m[r] = -CUDART_INF_F;
        l[r] = 0.f;
    }
    const unsigned char* own_q = qs + cw * (WS_HALF / 2);  // this warpgroup's 64 rows of each half
    mbar_wait(q_full, 0);
    float sc[WS_KEYS / 8][4], correction[2];
    unsigned int pa[WS_KEYS / 16][4];
    if constexpr (!OVERLAP) {
        for (int j = 0; j < tiles; ++j) {
            const int s = j & 1;
            const unsigned int phase = (j >> 1) & 1, k0 = key_begin + j * WS_KEYS;
            mbar_wait(k_full + 8 * s, phase);
            issue_scores<T, DP>(sc, own_q, ks + s * TILE);
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(k_empty + 8 * s);
            if (k0 < common_lo || k0 + WS_KEYS > common_hi) hide_unseen_keys<NB>(sc, k0, t, lo, hi);
            softmax_scores(sc, m, l, scale2, correction);
            rescale_rows(acc, correction);
            pack_weights<T>(sc, pa);
            mbar_wait(v_full + 8 * s, phase);
            issue_values<T, DP>(acc, pa, vs + s * TILE);
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(v_empty + 8 * s);
        }
    } else if (tiles > 0) {
        // FlashAttention-3's intra-warpgroup overlap: tile j's scores are issued with tile j - 1's
        // P·V, and their softmax runs while that product does; the output is rescaled once it is
        // done. Tile 0's scores come first, tile tiles - 1's P·V last. With PINGPONG the first
        // consumer takes the first turn (the second hands it over up front), each issue of
        // products is a turn, and the first consumer takes one more turn at the end, so every
        // arrival on its barrier is matched.
        if (PINGPONG && cw == 1) hand_turn_over(cw);
        mbar_wait(k_full, 0);
        if (PINGPONG) take_turn(cw);
        issue_scores<T, DP>(sc, own_q, ks);
        if (PINGPONG) hand_turn_over(cw);
        wgmma_wait<0>();
        if (lane == 0) mbar_arrive(k_empty);
        if (key_begin < common_lo || key_begin + WS_KEYS > common_hi) hide_unseen_keys<NB>(sc, key_begin, t, lo, hi);
        softmax_scores(sc, m, l, scale2, correction);
        pack_weights<T>(sc, pa);
        for (int j = 1; j < tiles; ++j) {
            const int s = j & 1, before = s ^ 1;
            const unsigned int phase = (j >> 1) & 1, before_phase = ((j - 1) >> 1) & 1,
                               k0 = key_begin + j * WS_KEYS;
            mbar_wait(k_full + 8 * s, phase);
            mbar_wait(v_full + 8 * before, before_phase);
            if (PINGPONG) take_turn(cw);
            issue_scores<T, DP>(sc, own_q, ks + s * TILE);
            issue_values<T, DP>(acc, pa, vs + before * TILE);
            if (PINGPONG) hand_turn_over(cw);
            wgmma_wait<1>();  // the scores (the older group); P·V may still run
            if (lane == 0) mbar_arrive(k_empty + 8 * s);
            if (k0 < common_lo || k0 + WS_KEYS > common_hi) hide_unseen_keys<NB>(sc, k0, t, lo, hi);
            softmax_scores(sc, m, l, scale2, correction);
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(v_empty + 8 * before);
            rescale_rows(acc, correction);
            pack_weights<T>(sc, pa);
        }
        const int last = (tiles - 1) & 1;
        mbar_wait(v_full + 8 * last, ((tiles - 1) >> 1) & 1);
        issue_values<T, DP>(acc, pa, vs + last * TILE);
        wgmma_wait<0>();
        if (lane == 0) mbar_arrive(v_empty + 8 * last);
        if (PINGPONG && cw == 0) take_turn(cw);
    }
    float inv[2];
    finish_rows<false>(m, l, inv, lse, a, pair, q0 + warp_row0, g, t);
    // Staged through the K stages, which both consumers have finished reading once they pass
    // this barrier (named barrier 1, the 256 consumer threads): each warp its own 16 rows of
    // [128][DP + 8].
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    T* stage = reinterpret_cast<T*>(ks) + warp_row0 * (DP + Tc16<T>::PAD);
    store_rows<Tc16<T>, DP>(o, a, OP_O, b, h, q0 + warp_row0, a.queries, acc, inv, stage);
}

// attention_ws_forward_<dtype>_<DP>, attention_ws_overlap_forward_<dtype>_<DP> (the
// intra-warpgroup overlap) and attention_ws_pingpong_forward_<dtype>_<DP> (the overlap and the
// ping-pong between consumers): 384 threads, 128 queries a block; dynamic shared memory 1024 bytes
// of alignment slack, five tiles of DP / 64 · 16 KiB (Q, two stages each of K and V) and 128 bytes
// of mbarriers (attention/warp_specialized.rs says the same).
#define WS_KERNEL(T, SUFFIX, DP)                                                                             \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                             \
        attention_ws_forward_##SUFFIX(T* o, float* lse, const __grid_constant__ WsParams p) {               \
        ws_forward<T, DP, false, false>(o, lse, p);                                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                             \
        attention_ws_overlap_forward_##SUFFIX(T* o, float* lse, const __grid_constant__ WsParams p) {       \
        ws_forward<T, DP, true, false>(o, lse, p);                                                           \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                             \
        attention_ws_pingpong_forward_##SUFFIX(T* o, float* lse, const __grid_constant__ WsParams p) {      \
        ws_forward<T, DP, true, true>(o, lse, p);                                                            \
    }
WS_KERNEL(__nv_bfloat16, bf16_64, 64)
WS_KERNEL(__nv_bfloat16, bf16_128, 128)
WS_KERNEL(__half, f16_64, 64)
WS_KERNEL(__half, f16_128, 128)

// ---- Backward: dK and dV, warp-specialised ------------------------------------------------------

// The dK/dV kernel's one parameter after the pointers: Q's, K's, V's and dO's tensor maps (boxes of
// 64 × 64 × 1 × 1: one 64-row atom a load) and the arguments (warp_specialized.rs'
// `WsBackwardParams`, field for field).
struct alignas(64) WsBackwardParams {
    TensorMap q, k, v, dout;
    AttnArgs a;
};
static_assert(sizeof(WsBackwardParams) == 896, "WsBackwardParams layout");

// dK and dV of 128 keys of one (batch, kv head) pair: the producer loads each consumer's 64 keys
// and values once, then the group's query heads' queries 64 a tile with their dO, two stages
// behind full/empty mbarriers, the producer's first warp writing each tile's log-sum-exps (times
// log2 e) and Δ into the stage beside them; each consumer computes Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for
// its keys, P and dS from those, and dV += Pᵀ·dO,
// dK += dSᵀ·Q with the weights from registers: wgmma_backward_dkdv's arithmetic (without
// dropout), so its results are that kernel's.
template <typename T, int DP>
__device__ void ws_backward_dkdv(const float* lse, const float* delta, T* dk, T* dv, const WsBackwardParams& p) {
    const AttnArgs& a = p.a;
    constexpr int ATOMS = DP / 64 * WG_ATOM_BYTES, NB = 8;  // one 64-row tile's atoms
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
    unsigned char* ks = base;              // two consumers' 64 keys
    unsigned char* vs = ks + 2 * ATOMS;    // their values
    unsigned char* qs = vs + 2 * ATOMS;    // 2 stages of 64 queries
    unsigned char* dos = qs + 2 * ATOMS;   // 2 stages of their dO
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(dos + 2 * ATOMS);
    // 2 stages of the tile's 64 log-sum-exps (times log2 e), then its 64 Δ
    float* stats_s = reinterpret_cast<float*>(dos + 2 * ATOMS + 128);
    // kv_full, qdo_full[2], qdo_empty[2]
    const unsigned int kv_full = smem_address(bars), qdo_full = kv_full + 8, qdo_empty = kv_full + 24;
    unsigned int tile, pair;
    block_tile(a, false, tile, pair);
    const unsigned int b = pair / a.kv_heads, kvh = pair % a.kv_heads, group = group_size(a);
    const unsigned int k0 = tile * WS_ROWS;
    unsigned int query_begin, query_end;
    block_range(a, false, k0, WS_ROWS, query_begin, query_end);
    const unsigned int tiles = (query_end - query_begin + WG_ROWS - 1) / WG_ROWS, steps = group * tiles;
    auto head_of = [&](unsigned int step) { return kvh * group + step / tiles; };
    auto first_query = [&](unsigned int step) { return query_begin + step % tiles * WG_ROWS; };
    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < 2; ++s) {
            mbar_init(qdo_full + 8 * s, 32);
            mbar_init(qdo_empty + 8 * s, 32 * WS_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int group_of_thread = threadIdx.x / 128;
    if (group_of_thread == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x < 32) {
            const unsigned int lane = threadIdx.x;
            if (lane == 0) {
                mbar_arrive_expect_tx(kv_full, 4 * ATOMS);
                for (int c = 0; c < 2; ++c) {
                    tma_tile<DP, WG_ATOM_BYTES>(ks + c * ATOMS, p.k, k0 + c * WG_ROWS, kvh, b, kv_full);
                    tma_tile<DP, WG_ATOM_BYTES>(vs + c * ATOMS, p.v, k0 + c * WG_ROWS, kvh, b, kv_full);
                }
            }
            for (unsigned int j = 0; j < steps; ++j) {
                const int s = j & 1;
                const unsigned int phase = (j >> 1) & 1, h = head_of(j), q0 = first_query(j);
                if (j >= 2) mbar_wait(qdo_empty + 8 * s, phase ^ 1);
                // Each lane two queries' statistics, then its own arrival on the stage's full barrier
                // (a release of its writes, which the consumers' wait acquires).
                const unsigned long long stats = ((unsigned long long)b * a.heads + h) * a.queries;
                float* st = stats_s + s * 2 * WG_ROWS;
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const unsigned int r = 2 * lane + c, query = q0 + r;
                    const bool in = query < a.queries;
                    st[r] = in ? lse[stats + query] * FA_LOG2E : 0.f;
                    st[WG_ROWS + r] = in ? delta[stats + query] : 0.f;
                }
                if (lane == 0) {
                    mbar_arrive_expect_tx(qdo_full + 8 * s, 2 * ATOMS);
                    tma_tile<DP, WG_ATOM_BYTES>(qs + s * ATOMS, p.q, q0, h, b, qdo_full + 8 * s);
                    tma_tile<DP, WG_ATOM_BYTES>(dos + s * ATOMS, p.dout, q0, h, b, qdo_full + 8 * s);
                } else {
                    mbar_arrive(qdo_full + 8 * s);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int cw = group_of_thread - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
              t = lane & 3;
    const unsigned int own0 = k0 + cw * WG_ROWS, key0 = own0 + warp * 16 + g;
    unsigned int lo[2], hi[2], common_lo, common_hi;
    queries_seeing(a, key0, lo[0], hi[0]);
    queries_seeing(a, key0 + 8, lo[1], hi[1]);
    warp_common_range(lo, hi, common_lo, common_hi);
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    const unsigned char* own_k = ks + cw * ATOMS;
    const unsigned char* own_v = vs + cw * ATOMS;
    float dka[DP / 8][4] = {}, dva[DP / 8][4] = {};
    mbar_wait(kv_full, 0);
    for (unsigned int j = 0; j < steps; ++j) {
        const int s = j & 1;
        const unsigned int phase = (j >> 1) & 1, q0 = first_query(j);
        const unsigned char* qt = qs + s * ATOMS;
        const unsigned char* dot = dos + s * ATOMS;
        const float* st = stats_s + s * 2 * WG_ROWS;
        mbar_wait(qdo_full + 8 * s, phase);
        // Transposed: rows are the warpgroup's keys, columns the tile's queries.
        float sc[NB][4] = {}, dp[NB][4] = {};
        rows_by_rows<T, DP>(sc, own_k, qt);
        rows_by_rows<T, DP>(dp, own_v, dot);
        wgmma_wait<0>();
        const bool crossing = q0 < common_lo || q0 + WG_ROWS > common_hi;
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int r = n * 8 + 2 * t + (e & 1), query = q0 + r;
                const float l2 = st[r], dl = st[WG_ROWS + r];
                const bool hidden = crossing && (query < lo[e >> 1] || query >= hi[e >> 1]);
                const float pr = hidden ? 0.f : fast_exp2(fmaf(sc[n][e], scale2, -l2));
                sc[n][e] = pr;
                dp[n][e] = pr * (dp[n][e] - dl);
            }
        weights_by_rows<T, DP>(dva, sc, dot);
        weights_by_rows<T, DP>(dka, dp, qt);
        wgmma_wait<0>();
        // Every thread arrives (a release of its own reads of the stage's statistics, which the
        // producer's wait acquires before it overwrites them).
        mbar_arrive(qdo_empty + 8 * s);
    }
    // Staged through the query stages, which both consumers have finished reading once they pass
    // this barrier (named barrier 1, the 256 consumer threads): each warp its own 16 rows of
    // [128][DP + 8], dK first, then dV.
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    const float scale = (float)a.scale, mul_k[2] = {scale, scale}, one[2] = {1.f, 1.f};
    T* stage = reinterpret_cast<T*>(qs) + (cw * WG_ROWS + warp * 16) * (DP + Tc16<T>::PAD);
    store_rows<Tc16<T>, DP>(dk, a, OP_DK, b, kvh, own0 + warp * 16, a.keys, dka, mul_k, stage);
    __syncwarp();
    store_rows<Tc16<T>, DP>(dv, a, OP_DV, b, kvh, own0 + warp * 16, a.keys, dva, one, stage);
}

// attention_ws_backward_dkdv_<dtype>_<DP>: 384 threads, 128 keys a block; dynamic shared memory
// 1024 bytes of alignment slack, eight 64-row tiles of DP / 64 · 8 KiB (two consumers' keys and
// values, two stages each of queries and dO), 128 bytes of mbarriers and two stages of 64
// log-sum-exps and 64 Δ (1 KiB).
#define WS_DKDV_KERNEL(T, SUFFIX, DP)                                                                        \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) attention_ws_backward_dkdv_##SUFFIX(         \
        const float* lse, const float* delta, T* dk, T* dv, const __grid_constant__ WsBackwardParams p) {    \
        ws_backward_dkdv<T, DP>(lse, delta, dk, dv, p);                                                      \
    }
WS_DKDV_KERNEL(__nv_bfloat16, bf16_64, 64)
WS_DKDV_KERNEL(__nv_bfloat16, bf16_128, 128)
WS_DKDV_KERNEL(__half, f16_64, 64)
WS_DKDV_KERNEL(__half, f16_128, 128)

// ---- Backward: dQ, warp-specialised -------------------------------------------------------------

// Δ = dO·O of query `row` of pair (b, h), by the 4 lanes t = 0..3 of a row group of the
// accumulator layout (each 16 bytes of the row at a time, 64 bytes apart), summed over them.
template <typename T>
__device__ __forceinline__ float row_delta(const T* o, const T* dout, const AttnArgs& a, unsigned int b,
                                           unsigned int h, unsigned int row, int t) {
    float sum = 0.f;
    if (row < a.queries) {
        const T* op = o + row_at(a, OP_O, b, h, row);
        const T* gp = dout + row_at(a, OP_DO, b, h, row);
        for (int c = t * 8; c < (int)a.head_dim; c += 32) {
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
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    return sum;
}

// dQ of 128 queries of one (batch, head) pair, 64 a consumer: the producer loads each consumer's
// queries and dO once, then the keys and values 64 a tile, two stages behind full/empty
// mbarriers (every consumer thread arrives on a stage's empty barrier once its products have read
// the stage); each consumer first writes Δ = dO·O of its queries (for the dK/dV kernel), then
// computes S = Q·Kᵀ and dP = dO·Vᵀ, dS = P (dP − Δ) in registers and dQ += dS·K with dS from
// registers: wgmma_backward_dq's arithmetic (without dropout), so its results are that kernel's.
// No thread writes shared memory another reads but through the tensor memory accelerator, until
// each consumer stages its own dQ in its own query and dO tiles.
template <typename T, int DP>
__device__ void ws_backward_dq(const T* o, const T* dout, const float* lse, T* dq, float* delta,
                               const WsBackwardParams& p) {
    const AttnArgs& a = p.a;
    constexpr int ATOMS = DP / 64 * WG_ATOM_BYTES, NB = 8;  // one 64-row tile's atoms
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
    unsigned char* own = base;             // per consumer: its 64 queries, then their dO
    unsigned char* ks = own + 4 * ATOMS;   // 2 stages of 64 keys
    unsigned char* vs = ks + 2 * ATOMS;    // 2 stages of their values
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(vs + 2 * ATOMS);
    // qdo_full, kv_full[2], kv_empty[2]
    const unsigned int qdo_full = smem_address(bars), kv_full = qdo_full + 8, kv_empty = qdo_full + 24;
    unsigned int tile, pair;
    block_tile(a, true, tile, pair);
    const unsigned int b = pair / a.heads, h = pair % a.heads, kvh = h / group_size(a);
    const unsigned int q0 = tile * WS_ROWS;
    unsigned int key_begin, key_end;
    block_range(a, true, q0, WS_ROWS, key_begin, key_end);
    const unsigned int steps = (key_end - key_begin + WG_ROWS - 1) / WG_ROWS;
    if (threadIdx.x == 0) {
        mbar_init(qdo_full, 1);
        for (int s = 0; s < 2; ++s) {
            mbar_init(kv_full + 8 * s, 1);
            mbar_init(kv_empty + 8 * s, 32 * WS_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int group_of_thread = threadIdx.x / 128;
    if (group_of_thread == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(qdo_full, 4 * ATOMS);
            for (int c = 0; c < 2; ++c) {
                tma_tile<DP, WG_ATOM_BYTES>(own + 2 * c * ATOMS, p.q, q0 + c * WG_ROWS, h, b, qdo_full);
                tma_tile<DP, WG_ATOM_BYTES>(own + (2 * c + 1) * ATOMS, p.dout, q0 + c * WG_ROWS, h, b, qdo_full);
            }
            for (unsigned int j = 0; j < steps; ++j) {
                const int s = j & 1;
                const unsigned int phase = (j >> 1) & 1, k0 = key_begin + j * WG_ROWS;
                if (j >= 2) mbar_wait(kv_empty + 8 * s, phase ^ 1);
                mbar_arrive_expect_tx(kv_full + 8 * s, 2 * ATOMS);
                tma_tile<DP, WG_ATOM_BYTES>(ks + s * ATOMS, p.k, k0, kvh, b, kv_full + 8 * s);
                tma_tile<DP, WG_ATOM_BYTES>(vs + s * ATOMS, p.v, k0, kvh, b, kv_full + 8 * s);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int cw = group_of_thread - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
              t = lane & 3;
    const unsigned int own0 = q0 + cw * WG_ROWS, warp_row0 = warp * 16;
    const unsigned long long stats = (unsigned long long)pair * a.queries;
    unsigned int lo[2], hi[2], common_lo, common_hi, own_begin, own_end;
    float l2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const unsigned int row = own0 + warp_row0 + 8 * r + g;
        keys_seen(a, row, lo[r], hi[r]);
        dl[r] = row_delta(o, dout, a, b, h, row, t);
        l2[r] = row < a.queries ? lse[stats + row] * FA_LOG2E : 0.f;
        if (t == 0 && row < a.queries) delta[stats + row] = dl[r];
    }
    warp_common_range(lo, hi, common_lo, common_hi);
    // The keys this consumer's queries meet: the block's other tiles are waited on and released
    // without products.
    block_range(a, true, own0, WG_ROWS, own_begin, own_end);
    const float scale2 = (float)(a.scale * 1.4426950408889634);
    const unsigned char* own_q = own + 2 * cw * ATOMS;
    const unsigned char* own_do = own_q + ATOMS;
    float acc[DP / 8][4] = {};
    mbar_wait(qdo_full, 0);
    for (unsigned int j = 0; j < steps; ++j) {
        const int s = j & 1;
        const unsigned int phase = (j >> 1) & 1, k0 = key_begin + j * WG_ROWS;
        mbar_wait(kv_full + 8 * s, phase);
        if (k0 < own_end && k0 + WG_ROWS > own_begin) {
            const unsigned char* kt = ks + s * ATOMS;
            const unsigned char* vt = vs + s * ATOMS;
            float sc[NB][4] = {}, dp[NB][4] = {};
            rows_by_rows<T, DP>(sc, own_q, kt);
            rows_by_rows<T, DP>(dp, own_do, vt);
            wgmma_wait<0>();
            const bool crossing = k0 < common_lo || k0 + WG_ROWS > common_hi;
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
                    const bool hidden = crossing && (key < lo[r] || key >= hi[r]);
                    const float pr = hidden ? 0.f : fast_exp2(fmaf(sc[n][e], scale2, -l2[r]));
                    sc[n][e] = pr * (dp[n][e] - dl[r]);
                }
            weights_by_rows<T, DP>(acc, sc, kt);
            wgmma_wait<0>();
        }
        // Every thread arrives: a release of its own products' reads of the stage.
        mbar_arrive(kv_empty + 8 * s);
    }
    // Staged through the consumer's own query and dO tiles, which its four warps have finished
    // reading once they pass this barrier (named barrier 2 + cw, the consumer's 128 threads): each
    // warp its own 16 rows of [64][DP + 8].
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
    const float scale = (float)a.scale, mul[2] = {scale, scale};
    T* stage = reinterpret_cast<T*>(own + 2 * cw * ATOMS) + warp_row0 * (DP + Tc16<T>::PAD);
    store_rows<Tc16<T>, DP>(dq, a, OP_DQ, b, h, own0 + warp_row0, a.queries, acc, mul, stage);
}

// attention_ws_backward_dq_<dtype>_<DP>: 384 threads, 128 queries a block; dynamic shared memory
// 1024 bytes of alignment slack, eight 64-row tiles of DP / 64 · 8 KiB (two consumers' queries
// and dO, two stages each of keys and values) and 128 bytes of mbarriers.
#define WS_DQ_KERNEL(T, SUFFIX, DP)                                                                          \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) attention_ws_backward_dq_##SUFFIX(           \
        const T* o, const T* dout, const float* lse, T* dq, float* delta,                                    \
        const __grid_constant__ WsBackwardParams p) {                                                        \
        ws_backward_dq<T, DP>(o, dout, lse, dq, delta, p);                                                   \
    }
WS_DQ_KERNEL(__nv_bfloat16, bf16_64, 64)
WS_DQ_KERNEL(__nv_bfloat16, bf16_128, 128)
WS_DQ_KERNEL(__half, f16_64, 64)
WS_DQ_KERNEL(__half, f16_128, 128)
