// The Hopper wgmma pieces the attention kernels share (attention_wgmma_sm90a.cu's one-warpgroup
// kernels, attention_ws_sm90a.cu's warp-specialised forward): the storage dtype's products with
// f32 accumulators (Wg), the 128-byte-swizzled atoms they read, the fences and the shared-memory
// matrix descriptor. Hopper only (compute_90a).

#pragma once

#include "attention_tc.cuh"

// The three wgmma products of one storage dtype, f32 accumulators (`SUFFIX` names them, `TYPE` is
// the PTX type of both operands):
// - ss_n64: d (m64n64) = A · Bᵀ (+ d when `accumulate`), both from shared memory, K-major
//   (128-byte swizzle);
// - rs_n64 / rs_n128: d (m64n64 / m64n128) += A · B, A from registers (the m64k16 fragment), B
//   from shared memory MN-major (transposed; 128-byte swizzle).
#define WGMMA_PRODUCTS(SUFFIX, TYPE) \
__device__ __forceinline__ void wgmma_ss_n64_##SUFFIX(float (&d)[8][4], unsigned long long desc_a, \
                                            unsigned long long desc_b, int accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
} \
__device__ __forceinline__ void wgmma_ss_n128_##SUFFIX(float (&d)[16][4], unsigned long long desc_a, \
                                            unsigned long long desc_b, int accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
} \
__device__ __forceinline__ void wgmma_rs_n64_##SUFFIX(float (&d)[8][4], const unsigned int (&a)[4], \
                                            unsigned long long desc_b) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)); \
} \
__device__ __forceinline__ void wgmma_rs_n128_##SUFFIX(float (&d)[16][4], const unsigned int (&a)[4], \
                                            unsigned long long desc_b) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)); \
}

WGMMA_PRODUCTS(bf16, "bf16")
WGMMA_PRODUCTS(f16, "f16")

// The storage dtype's wgmma products.
template <typename T> struct Wg;
#define WGMMA_DTYPE(T, SUFFIX)                                                                              \
    template <> struct Wg<T> {                                                                             \
        static __device__ __forceinline__ void ss_n64(float (&d)[8][4], unsigned long long a,             \
                                                      unsigned long long b, int accumulate) {             \
            wgmma_ss_n64_##SUFFIX(d, a, b, accumulate);                                                    \
        }                                                                                                  \
        static __device__ __forceinline__ void ss_n128(float (&d)[16][4], unsigned long long a,           \
                                                       unsigned long long b, int accumulate) {            \
            wgmma_ss_n128_##SUFFIX(d, a, b, accumulate);                                                   \
        }                                                                                                  \
        static __device__ __forceinline__ void rs_n64(float (&d)[8][4], const unsigned int (&a)[4],       \
                                                      unsigned long long b) {                             \
            wgmma_rs_n64_##SUFFIX(d, a, b);                                                                \
        }                                                                                                  \
        static __device__ __forceinline__ void rs_n128(float (&d)[16][4], const unsigned int (&a)[4],     \
                                                       unsigned long long b) {                            \
            wgmma_rs_n128_##SUFFIX(d, a, b);                                                               \
        }                                                                                                  \
    };
WGMMA_DTYPE(__nv_bfloat16, bf16)
WGMMA_DTYPE(__half, f16)

// The swizzled shared-memory tiles wgmma reads: an "atom" is 64 rows of 64 16-bit elements (128
// bytes a row, 8 KiB), 1024-byte aligned, whose row r holds its 16-byte chunk c at chunk c ^ (r % 8)
// (the 128-byte swizzle, CUTLASS's Swizzle<3,4,3>). Head dims above 64 take a second atom for
// elements 64..127 of every row.
#define WG_ROWS 64
#define WG_ATOM_BYTES 8192

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup's wgmma products are still running.
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// A 128-byte-swizzled matrix descriptor at `p`: `sbo` bytes between 8-row groups, `lbo` bytes
// between atoms along the other dimension (MN-major operands wider than one atom; unused for
// K-major ones).
__device__ __forceinline__ unsigned long long sw128_desc(const void* p, unsigned int sbo, unsigned int lbo) {
    const unsigned long long address = smem_address(p);
    return ((address & 0x3FFFFull) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// Hides the scores of the keys a thread's two rows do not see (-inf): its scores of the 64 × 8·NB
// accumulator tile of keys k0.. (thread column t), row r seeing keys [lo[r], hi[r]).
template <int NB>
__device__ __forceinline__ void hide_unseen_keys(float (&s)[NB][4], unsigned int k0, int t, const unsigned int (&lo)[2],
                                                 const unsigned int (&hi)[2]) {
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned int key = k0 + n * 8 + 2 * t + (e & 1);
            const int r = e >> 1;
            if (key < lo[r] || key >= hi[r]) s[n][e] = -CUDART_INF_F;
        }
}

// The end of a forward's online softmax for a thread's two rows (rows q0 + row0 + g and + 8 of
// pair `pair`): inv = 1 / each row's sum over its four threads (times the dropout scale with
// DROP), and the row's log-sum-exp saved for the backward by its first thread.
template <bool DROP>
__device__ __forceinline__ void finish_rows(const float (&m)[2], const float (&l)[2], float (&inv)[2], float* lse,
                                            const AttnArgs& a, unsigned int pair, unsigned int first_row, int g,
                                            int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = l[r];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        inv[r] = total > 0.f ? 1.f / total : 0.f;
        if constexpr (DROP) inv[r] *= (float)a.dropout_scale;
        const unsigned int row = first_row + 8 * r + g;
        if (t == 0 && row < a.queries) lse[(unsigned long long)pair * a.queries + row] = (m[r] + log2f(total)) * FA_LN2;
    }
}

// acc (64 × 64) = x · yᵀ over the head dim: the 64 rows of two swizzled tiles (Q and K, K and Q,
// dO and V, V and dO), 16 elements a step; within an atom a step moves the descriptors 32 bytes
// along the swizzled rows. Issued and committed; the caller waits (wgmma_wait0).
template <typename T, int DP>
__device__ __forceinline__ void rows_by_rows(float (&acc)[8][4], const unsigned char* x, const unsigned char* y) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        const int offset = (kk >> 2) * WG_ATOM_BYTES + (kk & 3) * 32;
        const unsigned long long dx = sw128_desc(x + offset, 1024, 16), dy = sw128_desc(y + offset, 1024, 16);
        Wg<T>::ss_n64(acc, dx, dy, kk > 0);
    }
    wgmma_commit();
}

// out (64 × DP) += w · z over 64 streamed rows, 16 a step: w (64 × 64, accumulator layout: P,
// Pᵀ, dS or dSᵀ) rounded to T as A fragments, z a swizzled tile read transposed (MN-major: V, dO,
// Q or K), 16 rows = two 8-row groups = 2048 bytes a step, its second atom (head dims above 64)
// LBO = 8 KiB along N. Issued and committed; the caller waits.
template <typename T, int DP>
__device__ __forceinline__ void weights_by_rows(float (&out)[DP / 8][4], const float (&w)[8][4],
                                                const unsigned char* z) {
    // Every A fragment packed before the fence, so no register of a wgmma in flight is written.
    unsigned int a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        a[kk][0] = Tc<T>::pack(w[2 * kk][0], w[2 * kk][1]);
        a[kk][1] = Tc<T>::pack(w[2 * kk][2], w[2 * kk][3]);
        a[kk][2] = Tc<T>::pack(w[2 * kk + 1][0], w[2 * kk + 1][1]);
        a[kk][3] = Tc<T>::pack(w[2 * kk + 1][2], w[2 * kk + 1][3]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const unsigned long long dz = sw128_desc(z + kk * 2048, 1024, WG_ATOM_BYTES);
        if constexpr (DP == 64) Wg<T>::rs_n64(out, a[kk], dz);
        else Wg<T>::rs_n128(out, a[kk], dz);
    }
    wgmma_commit();
}
