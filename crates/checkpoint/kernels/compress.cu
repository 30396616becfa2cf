// Compression of saved activations: 8-bit blockwise absmax quantisation and its inverse, one
// fused pass each way (crates/checkpoint/src/compress/codec.rs is the host codec these kernels
// repeat to the bit).
//
// quantize_int8_<T>: one warp per block of `block` consecutive elements (a power of two, 32 to
// 4096): the lanes read the block with stride 32 for its absmax (a warp shuffle reduction, and a
// vote for non-finite values), lane 0 stores it, and the lanes read the block again (from L1/L2)
// to store its codes, round_half_even((x / absmax) * 127), each an IEEE-rounded f32 operation. A
// block of zeros keeps absmax 0 and codes 0; a block with a NaN or an infinity keeps absmax NaN
// and codes 0.
//
// dequantize_int8_<T>: one thread per group of four elements: (code / 127) * absmax, stored
// rounded to nearest even (one canonical NaN per type, as the host codec writes).
//
// Instances for float, double, __nv_bfloat16 and __half elements (loaded to float, f64 rounded
// to nearest; computed in float).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Float NaN as Rust's f32::NAN.
#define RUST_NAN __int_as_float(0x7fc00000)
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(double x) { return __double2float_rn(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_f32<double>(float x) { return (double)x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return x != x ? __ushort_as_bfloat16((unsigned short)0x7fc0) : __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return x != x ? __ushort_as_half((unsigned short)0x7e00) : __float2half_rn(x);
}

template <typename T>
__device__ __forceinline__ void quantize_int8(const T* __restrict__ x, signed char* __restrict__ codes,
                                              float* __restrict__ absmax, unsigned long long n,
                                              unsigned block) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned long long warps_per_cta = blockDim.x / 32u;
    const unsigned long long n_warps = (unsigned long long)gridDim.x * warps_per_cta;
    const unsigned long long n_blocks = (n + block - 1) / block;
    for (unsigned long long b = blockIdx.x * warps_per_cta + threadIdx.x / 32u; b < n_blocks; b += n_warps) {
        const unsigned long long start = b * block;
        const unsigned long long end = start + block < n ? start + block : n;
        float m = 0.0f;
        bool finite = true;
        for (unsigned long long i = start + lane; i < end; i += 32) {
            const float v = to_f32(x[i]);
            finite = finite && isfinite(v);
            m = fmaxf(m, fabsf(v));
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, offset));
        }
        finite = __all_sync(FULL_MASK, finite);
        if (lane == 0) absmax[b] = finite ? m : RUST_NAN;
        const bool encode = finite && m > 0.0f;
        for (unsigned long long i = start + lane; i < end; i += 32) {
            signed char code = 0;
            if (encode) code = (signed char)__float2int_rn(__fmul_rn(__fdiv_rn(to_f32(x[i]), m), 127.0f));
            codes[i] = code;
        }
    }
}

template <typename T>
__device__ __forceinline__ T decode(signed char code, float absmax) {
    return from_f32<T>(__fmul_rn(__fdiv_rn((float)code, 127.0f), absmax));
}

// Group `g` of four elements of `out` (16-byte stores for float: the output is a fresh
// allocation, aligned).
template <typename T>
__device__ __forceinline__ void store4(T* out, unsigned long long g, T a, T b, T c, T d) {
    out[4 * g] = a;
    out[4 * g + 1] = b;
    out[4 * g + 2] = c;
    out[4 * g + 3] = d;
}
template <>
__device__ __forceinline__ void store4<float>(float* out, unsigned long long g, float a, float b, float c, float d) {
    ((float4*)out)[g] = make_float4(a, b, c, d);
}

template <typename T>
__device__ __forceinline__ void dequantize_int8(const signed char* __restrict__ codes,
                                                const float* __restrict__ absmax, T* __restrict__ out,
                                                unsigned long long n, unsigned block_shift) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long n_groups = (n + 3) / 4;
    for (unsigned long long g = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; g < n_groups; g += stride) {
        const unsigned long long i = g * 4;
        if (i + 4 <= n) {
            // Codes start 512-byte aligned (the allocator's rounding), so a group is a char4.
            const char4 c = ((const char4*)codes)[g];
            // The four elements of a group share one block (blocks are 32 or more, a multiple of 4).
            const float a = absmax[i >> block_shift];
            store4(out, g, decode<T>(c.x, a), decode<T>(c.y, a), decode<T>(c.z, a), decode<T>(c.w, a));
        } else {
            for (unsigned long long j = i; j < n; ++j) out[j] = decode<T>(codes[j], absmax[j >> block_shift]);
        }
    }
}

#define INSTANCES(suffix, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) quantize_int8_##suffix(                           \
        const T* x, signed char* codes, float* absmax, unsigned long long n, unsigned block) {         \
        quantize_int8<T>(x, codes, absmax, n, block);                                                   \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) dequantize_int8_##suffix(                         \
        const signed char* codes, const float* absmax, T* out, unsigned long long n, unsigned shift) { \
        dequantize_int8<T>(codes, absmax, out, n, shift);                                               \
    }

INSTANCES(f32, float)
INSTANCES(f64, double)
INSTANCES(bf16, __nv_bfloat16)
INSTANCES(f16, __half)
