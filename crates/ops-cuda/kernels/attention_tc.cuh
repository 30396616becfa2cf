// The 16-bit tensor-core pieces of the attention kernels: ldmatrix loads, the storage dtype's
// mma.sync product and its two-value packing (Tc), fragment loads, and attention_flash.cuh's
// 16-bit policy (Tc16). attention_tc.cu builds the FlashAttention-2-style kernels from them;
// attention_wgmma_sm90a.cu takes Tc's packing and Tc16's stores.

#pragma once

#include "attention_flash.cuh"
#include "elements.cuh"

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

// The 16-bit policy of attention_flash.cuh for storage type T.
template <typename T> struct Tc16 {
    typedef T Elem;
    static constexpr int PAD = 8;

    // acc[n] (NB n-tiles of 8 columns) += the warp's 16 rows of `x` (rows row0..) times the 8·NB
    // rows of `y` as columns: x·yᵀ over DP.
    template <int DP, int NB>
    static __device__ __forceinline__ void rows_by_rows(float (&acc)[NB][4], const T* x, int row0, const T* y) {
        constexpr int S = DP + 8;
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) {
            unsigned int a[4];
            frag_a<S>(a, x, row0, kk * 16);
#pragma unroll
            for (int nn = 0; nn < NB / 2; ++nn) {
                unsigned int b[4];
                frag_b_nk<S>(b, y, nn * 16, kk * 16);
                Tc<T>::mma(acc[2 * nn], a, b[0], b[1]);
                Tc<T>::mma(acc[2 * nn + 1], a, b[2], b[3]);
            }
        }
    }

    // out += w·z: w the warp's 16 × 8·NB weights in accumulator layout (rounded to T here), z a
    // [8·NB][DP + 8] tile (its rows are w's columns).
    template <int DP, int NB>
    static __device__ __forceinline__ void weights_by_rows(float (&out)[DP / 8][4], const float (&w)[NB][4],
                                                           const T* z) {
        constexpr int S = DP + 8;
#pragma unroll
        for (int kk = 0; kk < NB / 2; ++kk) {
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

    // The same for MW fragments of 16 rows (rows row0.., row0 + 16.., ...): each B fragment of y
    // is read once for all of them.
    template <int DP, int NB, int MW>
    static __device__ __forceinline__ void rows_by_rows_wide(float (&acc)[MW][NB][4], const T* x, int row0,
                                                             const T* y) {
        constexpr int S = DP + 8;
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) {
            unsigned int a[MW][4];
#pragma unroll
            for (int mw = 0; mw < MW; ++mw) frag_a<S>(a[mw], x, row0 + 16 * mw, kk * 16);
#pragma unroll
            for (int nn = 0; nn < NB / 2; ++nn) {
                unsigned int b[4];
                frag_b_nk<S>(b, y, nn * 16, kk * 16);
#pragma unroll
                for (int mw = 0; mw < MW; ++mw) {
                    Tc<T>::mma(acc[mw][2 * nn], a[mw], b[0], b[1]);
                    Tc<T>::mma(acc[mw][2 * nn + 1], a[mw], b[2], b[3]);
                }
            }
        }
    }

    // weights_by_rows for MW fragments of 16 rows of weights, each B fragment of z read once.
    template <int DP, int NB, int MW>
    static __device__ __forceinline__ void weights_by_rows_wide(float (&out)[MW][DP / 8][4],
                                                                const float (&w)[MW][NB][4], const T* z) {
        constexpr int S = DP + 8;
#pragma unroll
        for (int kk = 0; kk < NB / 2; ++kk) {
            unsigned int a[MW][4];
#pragma unroll
            for (int mw = 0; mw < MW; ++mw) {
                a[mw][0] = Tc<T>::pack(w[mw][2 * kk][0], w[mw][2 * kk][1]);
                a[mw][1] = Tc<T>::pack(w[mw][2 * kk][2], w[mw][2 * kk][3]);
                a[mw][2] = Tc<T>::pack(w[mw][2 * kk + 1][0], w[mw][2 * kk + 1][1]);
                a[mw][3] = Tc<T>::pack(w[mw][2 * kk + 1][2], w[mw][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dn = 0; dn < DP / 16; ++dn) {
                unsigned int b[4];
                frag_b_kn<S>(b, z, kk * 16, dn * 16);
#pragma unroll
                for (int mw = 0; mw < MW; ++mw) {
                    Tc<T>::mma(out[mw][2 * dn], a[mw], b[0], b[1]);
                    Tc<T>::mma(out[mw][2 * dn + 1], a[mw], b[2], b[3]);
                }
            }
        }
    }

    static __device__ __forceinline__ void store2(T* p, float lo, float hi) {
        *reinterpret_cast<unsigned int*>(p) = Tc<T>::pack(lo, hi);
    }

    template <int N> static __device__ __forceinline__ float dot(const T* x, const T* y) {
        const unsigned int* xp = reinterpret_cast<const unsigned int*>(x);
        const unsigned int* yp = reinterpret_cast<const unsigned int*>(y);
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < N / 2; ++c) {
            const float2 u = Tc<T>::unpack(xp[c]), v = Tc<T>::unpack(yp[c]);
            sum += u.x * v.x + u.y * v.y;
        }
        return sum;
    }
};
typedef Tc16<__nv_bfloat16> TcBf16;
typedef Tc16<__half> TcF16;

