// The fp8 kernels' bodies, built twice: float8.cu (compute_80 PTX, every GPU from the A100 on)
// and float8_sm89.cu (compute_89, Ada and Hopper, whose fp8 conversions are instructions);
// src/kernels.rs loads the second where the device has them.
//
// fp8 training's quantize and the code transpose its GEMMs need (src/float8.rs launches them).
//
// A quantize takes `v = f32(x) * premultiply[col]` (or `f32(x)`) of a strided [rows, cols]
// view, the amax of |v| over the tensor (tensorwise) or over each row (rowwise), the scale
// `f32(max_finite / max(amax, 1e-12))` (rounded down to a power of two when asked, or a given
// delayed scale), and codes `cvt(v * scale)` (round to nearest even, saturating, NaN kept:
// cuda_fp8.h's conversion with __NV_SATFINITE, as elementwise.cu's casts and the CPU's float8
// crate). The amax is reduced on the bits of |v|: for non-negative floats the unsigned order of
// the bits is the order of the values, and every NaN sorts above +inf, so a NaN anywhere makes
// the amax NaN, as on the CPU.
//
// Tensorwise runs three kernels: an amax (each block's over its share into a partial),
// float8_scale (one block: the partials' amax, the scale, its reciprocal for the GEMM), a cast
// (the codes); with a delayed scale and no amax wanted, no amax kernel (one read). Dense inputs
// take the fast ones (16-byte loads: float8_amax_dense_<T>, float8_cast_dense_<T>_<Q> for
// row-major memory, float8_cast_columns_<T>_<Q> through shared-memory tiles for column-major),
// any other view float8_amax_<T> (a block a row) and float8_cast_<T>_<Q>. Rowwise runs one,
// float8_rowwise_<T>_<Q>: a block a row, the row read twice (amax, then codes). A GELU linear's
// 16-bit input takes float8_extrema_dense_<T> and float8_scale_gelu_<T> instead of the amax and
// scale kernels (the amax from the pre-activation's extremes). float8_transpose writes a strided [rows, cols] view of codes dense;
// float8_transpose_words the transpose of a row-major matrix, four bytes a thread.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math_constants.h>
#include <stdint.h>

#define THREADS 256
#define AMAX_FLOOR 1e-12
#define CANONICAL_NAN 0x7fc00000u

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

struct E4M3 { static constexpr __nv_fp8_interpretation_t kind = __NV_E4M3; };
struct E5M2 { static constexpr __nv_fp8_interpretation_t kind = __NV_E5M2; };

// The value a code is taken from: f32(x), times the column's premultiplier when there is one.
template <typename T>
__device__ __forceinline__ float value_at(const T *x, long long row_stride, long long col_stride,
                                          const float *premultiply, long long premultiply_stride,
                                          long long row, long long col) {
    float v = widen(x[row * row_stride + col * col_stride]);
    if (premultiply != nullptr) {
        v = __fmul_rn(v, premultiply[col * premultiply_stride]);
    }
    return v;
}

// The largest of the block's `bits` (every thread's), in every thread.
__device__ __forceinline__ unsigned block_max(unsigned bits) {
    __shared__ unsigned warp_max[THREADS / 32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = bits;
    __syncthreads();
    unsigned result = 0;
    for (int w = 0; w < THREADS / 32; ++w) result = max(result, warp_max[w]);
    __syncthreads();
    return result;
}

// The bits of max |v| over one row, from this thread's columns.
template <typename T>
__device__ __forceinline__ unsigned row_amax_bits(const T *x, long long row_stride,
                                                  long long col_stride, const float *premultiply,
                                                  long long premultiply_stride, long long row,
                                                  long long cols) {
    unsigned bits = 0;
    for (long long col = threadIdx.x; col < cols; col += THREADS) {
        const float v =
            value_at(x, row_stride, col_stride, premultiply, premultiply_stride, row, col);
        bits = max(bits, __float_as_uint(v) & 0x7fffffffu);
    }
    return bits;
}

// The scale for an amax (bits of a non-negative float, or a NaN): NaN for a NaN amax.
__device__ __forceinline__ float scale_from(unsigned amax_bits, double max_finite, int power_of_two) {
    if (amax_bits > 0x7f800000u) return __uint_as_float(CANONICAL_NAN);
    const double amax = (double)__uint_as_float(amax_bits);
    float scale = (float)(max_finite / fmax(amax, AMAX_FLOOR));
    const unsigned exponent = __float_as_uint(scale) & 0x7f800000u;
    if (power_of_two && exponent != 0 && exponent != 0x7f800000u) {
        scale = __uint_as_float(__float_as_uint(scale) & 0xff800000u);
    }
    return scale;
}

__device__ __forceinline__ float amax_value(unsigned amax_bits) {
    return amax_bits > 0x7f800000u ? __uint_as_float(CANONICAL_NAN) : __uint_as_float(amax_bits);
}

// One value's code. Built for compute_89 (float8_sm89.cu) this is the hardware's conversion
// (`cvt.rn.satfinite.e4m3x2.f32` / `.e5m2x2`); for compute_80 cuda_fp8.h emulates it (about 70
// instructions a value), from the value widened to double, whose one rounding is the same.
template <typename Q>
__device__ __forceinline__ __nv_fp8_storage_t encode(float scaled) {
#if __CUDA_ARCH__ >= 890
    return __nv_cvt_float_to_fp8(scaled, __NV_SATFINITE, Q::kind);
#else
    return __nv_cvt_double_to_fp8((double)scaled, __NV_SATFINITE, Q::kind);
#endif
}

// Two values' codes, `lo` in the low byte: one conversion instruction on compute_89.
template <typename Q>
__device__ __forceinline__ unsigned short encode_pair(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, Q::kind);
#else
    return (unsigned short)encode<Q>(lo) | (unsigned short)((unsigned short)encode<Q>(hi) << 8);
#endif
}

// Each block's amax over rows blockIdx.x, blockIdx.x + gridDim.x, ... into partial[blockIdx.x].
template <typename T>
__device__ void amax_partial(const T *x, long long row_stride, long long col_stride,
                             long long rows, long long cols, const float *premultiply,
                             long long premultiply_stride, unsigned *partial) {
    unsigned bits = 0;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        bits = max(bits, row_amax_bits(x, row_stride, col_stride, premultiply,
                                       premultiply_stride, row, cols));
    }
    bits = block_max(bits);
    if (threadIdx.x == 0) partial[blockIdx.x] = bits;
}

// 1 / scale, correctly rounded; the canonical NaN for a NaN scale (whatever its payload).
__device__ __forceinline__ float inverse_of(float scale) {
    return scale != scale ? __uint_as_float(CANONICAL_NAN) : __frcp_rn(scale);
}

// A tensorwise quantize's scale from its amax bits (or the delayed one), its amax and inverse
// scale where wanted.
__device__ __forceinline__ void write_scale(unsigned bits, double max_finite, int power_of_two,
                                            const float *delayed, float *scale, float *amax,
                                            float *inverse) {
    const float s = delayed != nullptr ? delayed[0] : scale_from(bits, max_finite, power_of_two);
    scale[0] = s;
    if (amax != nullptr) amax[0] = amax_value(bits);
    if (inverse != nullptr) inverse[0] = inverse_of(s);
}

// One block: the partials' amax, then the scale (or the delayed one), the amax and the inverse
// scale if wanted. With a delayed scale and no amax wanted, count is 0 (no partials were taken).
extern "C" __global__ void __launch_bounds__(THREADS)
float8_scale(const unsigned *partial, int count, double max_finite, int power_of_two,
             const float *delayed, float *scale, float *amax, float *inverse) {
    unsigned bits = 0;
    for (int i = threadIdx.x; i < count; i += THREADS) bits = max(bits, partial[i]);
    bits = block_max(bits);
    if (threadIdx.x == 0) write_scale(bits, max_finite, power_of_two, delayed, scale, amax, inverse);
}

// The codes of rows blockIdx.x, blockIdx.x + gridDim.x, ... with one scale for all.
template <typename T, typename Q>
__device__ void cast_rows(const T *x, long long row_stride, long long col_stride, long long rows,
                          long long cols, const float *premultiply, long long premultiply_stride,
                          const float *scale, __nv_fp8_storage_t *codes) {
    const float s = scale[0];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        for (long long col = threadIdx.x; col < cols; col += THREADS) {
            const float v =
                value_at(x, row_stride, col_stride, premultiply, premultiply_stride, row, col);
            codes[row * cols + col] = encode<Q>(__fmul_rn(v, s));
        }
    }
}

// A block a row: the row's amax, its scale (or the delayed one), then its codes.
template <typename T, typename Q>
__device__ void rowwise(const T *x, long long row_stride, long long col_stride, long long rows,
                        long long cols, const float *premultiply, long long premultiply_stride,
                        double max_finite, int power_of_two, const float *delayed, float *scale,
                        float *amax, float *inverse, __nv_fp8_storage_t *codes) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const unsigned bits = block_max(row_amax_bits(x, row_stride, col_stride, premultiply,
                                                      premultiply_stride, row, cols));
        const float s =
            delayed != nullptr ? delayed[row] : scale_from(bits, max_finite, power_of_two);
        if (threadIdx.x == 0) {
            scale[row] = s;
            if (amax != nullptr) amax[row] = amax_value(bits);
            if (inverse != nullptr) inverse[row] = inverse_of(s);
        }
        for (long long col = threadIdx.x; col < cols; col += THREADS) {
            const float v =
                value_at(x, row_stride, col_stride, premultiply, premultiply_stride, row, col);
            codes[row * cols + col] = encode<Q>(__fmul_rn(v, s));
        }
    }
}

#define AMAX(T, TN)                                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS) float8_amax_##TN(                       \
        const T *x, long long row_stride, long long col_stride, long long rows, long long cols,   \
        const float *premultiply, long long premultiply_stride, unsigned *partial) {              \
        amax_partial(x, row_stride, col_stride, rows, cols, premultiply, premultiply_stride,      \
                     partial);                                                                    \
    }

#define CASTS(T, TN, Q, QN)                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS) float8_cast_##TN##_##QN(                \
        const T *x, long long row_stride, long long col_stride, long long rows, long long cols,   \
        const float *premultiply, long long premultiply_stride, const float *scale,               \
        __nv_fp8_storage_t *codes) {                                                              \
        cast_rows<T, Q>(x, row_stride, col_stride, rows, cols, premultiply, premultiply_stride,   \
                        scale, codes);                                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) float8_rowwise_##TN##_##QN(             \
        const T *x, long long row_stride, long long col_stride, long long rows, long long cols,   \
        const float *premultiply, long long premultiply_stride, double max_finite,                \
        int power_of_two, const float *delayed, float *scale, float *amax, float *inverse,        \
        __nv_fp8_storage_t *codes) {                                                              \
        rowwise<T, Q>(x, row_stride, col_stride, rows, cols, premultiply, premultiply_stride,     \
                      max_finite, power_of_two, delayed, scale, amax, inverse, codes);            \
    }

#define FOR_INPUT(T, TN) AMAX(T, TN) CASTS(T, TN, E4M3, e4m3) CASTS(T, TN, E5M2, e5m2)

FOR_INPUT(float, f32)
FOR_INPUT(__nv_bfloat16, bf16)
FOR_INPUT(__half, f16)

// The fast paths for dense inputs (every input of a linear is one: activations and gradients
// row-major, a Conv1D weight's transpose column-major). `n` elements from a 16-byte aligned `x`,
// read as 16-byte vectors of VEC elements (n a multiple of VEC); the column of flat element i,
// for the premultiplier, is (i / column_step) % cols: column_step 1 for row-major memory, rows for
// column-major.
template <typename T> struct Vector { static constexpr int VEC = 16 / sizeof(T); };

template <typename T>
__device__ __forceinline__ void load_vector(const T *x, long long vector, float *out) {
    const uint4 raw = reinterpret_cast<const uint4 *>(x)[vector];
    const T *elements = reinterpret_cast<const T *>(&raw);
#pragma unroll
    for (int j = 0; j < Vector<T>::VEC; ++j) out[j] = widen(elements[j]);
}

// A GELU linear's activation, applied as the quantize reads its input (a GELU linear's input in
// one pass, no activation written): elementwise.cu's unary GELU and tanh GELU, the same
// expressions in f32, each value then rounded to the input's dtype, as that kernel stores it.
// activation: 0 none, 1 GELU, 2 tanh GELU.
__device__ __forceinline__ float gelu_erf(float x) {
    return (float)0.5 * x * ((float)1 + erff(x * (float)0.70710678118654752440));
}
__device__ __forceinline__ float gelu_tanh(float x) {
    float inner = (float)0.7978845608028654 * (x + (float)0.044715 * x * x * x);
    return (float)0.5 * x * ((float)1 + tanhf(inner));
}
__device__ __forceinline__ float narrow_to(float v, const float *) { return v; }
__device__ __forceinline__ float narrow_to(float v, const __nv_bfloat16 *) {
    return __bfloat162float(__float2bfloat16(v));
}
__device__ __forceinline__ float narrow_to(float v, const __half *) {
    return __half2float(__float2half(v));
}
template <typename T>
__device__ __forceinline__ void activated(float *v, int activation) {
    if (activation == 0) return;
#pragma unroll
    for (int j = 0; j < Vector<T>::VEC; ++j) {
        const float a = activation == 1 ? gelu_erf(v[j]) : gelu_tanh(v[j]);
        v[j] = narrow_to(a, (const T *)nullptr);
    }
}

template <typename T>
__device__ __forceinline__ void premultiplied(float *v, long long first, const float *premultiply,
                                              long long premultiply_stride,
                                              long long column_step, long long cols) {
    if (premultiply == nullptr) return;
#pragma unroll
    for (int j = 0; j < Vector<T>::VEC; ++j) {
        const long long col = ((first + j) / column_step) % cols;
        v[j] = __fmul_rn(v[j], premultiply[col * premultiply_stride]);
    }
}

// The values of vector i, as a quantize takes them: loaded, premultiplied, activated. (Four
// vectors loaded a thread before any was used measured slower on the H200 than one:
// results/2026-12-05-d092c09, a bf16 [8192, 1280] quantize 38 us against 33.)
template <typename T>
__device__ __forceinline__ void dense_values(const T *x, long long i, const float *premultiply,
                                             long long premultiply_stride, long long column_step,
                                             long long cols, int activation, float *v) {
    load_vector(x, i, v);
    premultiplied<T>(v, i * Vector<T>::VEC, premultiply, premultiply_stride, column_step, cols);
    activated<T>(v, activation);
}

// Each block's amax over its share of the vectors into partial[blockIdx.x].
template <typename T>
__device__ void amax_dense(const T *x, long long n, const float *premultiply,
                           long long premultiply_stride, long long column_step, long long cols,
                           int activation, unsigned *partial) {
    constexpr int VEC = Vector<T>::VEC;
    unsigned bits = 0;
    const long long vectors = n / VEC;
    for (long long i = (long long)blockIdx.x * THREADS + threadIdx.x; i < vectors;
         i += (long long)gridDim.x * THREADS) {
        float v[VEC];
        dense_values(x, i, premultiply, premultiply_stride, column_step, cols, activation, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) bits = max(bits, __float_as_uint(v[j]) & 0x7fffffffu);
    }
    bits = block_max(bits);
    if (threadIdx.x == 0) partial[blockIdx.x] = bits;
}

// Codes of VEC values (VEC even) into vector i of `codes` (one 8- or 4-byte store), converted
// two at a time.
template <typename Q, int VEC>
__device__ __forceinline__ void store_codes(const float *v, float s, long long i,
                                            __nv_fp8_storage_t *codes) {
    __align__(8) unsigned short out[VEC / 2];
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j)
        out[j] = encode_pair<Q>(__fmul_rn(v[2 * j], s), __fmul_rn(v[2 * j + 1], s));
    if (VEC == 8) {
        reinterpret_cast<uint2 *>(codes)[i] = *reinterpret_cast<const uint2 *>(out);
    } else {
        reinterpret_cast<unsigned *>(codes)[i] = *reinterpret_cast<const unsigned *>(out);
    }
}

// The codes of a row-major dense input, a vector of VEC values a thread.
template <typename T, typename Q>
__device__ void cast_dense(const T *x, long long n, const float *premultiply,
                           long long premultiply_stride, long long cols, int activation,
                           const float *scale, __nv_fp8_storage_t *codes) {
    constexpr int VEC = Vector<T>::VEC;
    const float s = scale[0];
    const long long vectors = n / VEC;
    for (long long i = (long long)blockIdx.x * THREADS + threadIdx.x; i < vectors;
         i += (long long)gridDim.x * THREADS) {
        float v[VEC];
        dense_values(x, i, premultiply, premultiply_stride, 1, cols, activation, v);
        store_codes<Q, VEC>(v, s, i, codes);
    }
}

// The codes, dense row-major [rows, cols], of a column-major input (element (r, c) at
// r + c * col_stride: a transposed view of a row-major matrix) in 32 x 32 tiles: loads walk
// the input's columns, stores the codes' rows.
#define CAST_TILE 32
#define CAST_TILE_ROWS 8
template <typename T, typename Q>
__device__ void cast_columns(const T *x, long long rows, long long cols, long long col_stride,
                             const float *premultiply, long long premultiply_stride,
                             const float *scale, __nv_fp8_storage_t *codes) {
    __shared__ __nv_fp8_storage_t tile[CAST_TILE][CAST_TILE + 4];
    const float s = scale[0];
    const long long row0 = (long long)blockIdx.x * CAST_TILE, col0 = (long long)blockIdx.y * CAST_TILE;
    for (int c = threadIdx.y; c < CAST_TILE; c += CAST_TILE_ROWS) {
        const long long row = row0 + threadIdx.x, col = col0 + c;
        if (row < rows && col < cols) {
            float v = widen(x[row + col * col_stride]);
            if (premultiply != nullptr) v = __fmul_rn(v, premultiply[col * premultiply_stride]);
            tile[c][threadIdx.x] = encode<Q>(__fmul_rn(v, s));
        }
    }
    __syncthreads();
    for (int r = threadIdx.y; r < CAST_TILE; r += CAST_TILE_ROWS) {
        const long long row = row0 + r, col = col0 + threadIdx.x;
        if (row < rows && col < cols) codes[row * cols + col] = tile[threadIdx.x][r];
    }
}

#define DENSE(T, TN)                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) float8_amax_dense_##TN(                 \
        const T *x, long long n, const float *premultiply, long long premultiply_stride,          \
        long long column_step, long long cols, int activation, unsigned *partial) {               \
        amax_dense(x, n, premultiply, premultiply_stride, column_step, cols, activation,          \
                   partial);                                                                      \
    }

#define DENSE_CASTS(T, TN, Q, QN)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) float8_cast_dense_##TN##_##QN(          \
        const T *x, long long n, const float *premultiply, long long premultiply_stride,          \
        long long cols, int activation, const float *scale, __nv_fp8_storage_t *codes) {          \
        cast_dense<T, Q>(x, n, premultiply, premultiply_stride, cols, activation, scale, codes);  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(CAST_TILE * CAST_TILE_ROWS)                      \
        float8_cast_columns_##TN##_##QN(const T *x, long long rows, long long cols,               \
                                        long long col_stride, const float *premultiply,           \
                                        long long premultiply_stride, const float *scale,         \
                                        __nv_fp8_storage_t *codes) {                              \
        cast_columns<T, Q>(x, rows, cols, col_stride, premultiply, premultiply_stride, scale,     \
                           codes);                                                                \
    }

#define FOR_DENSE_INPUT(T, TN) DENSE(T, TN) DENSE_CASTS(T, TN, E4M3, e4m3) DENSE_CASTS(T, TN, E5M2, e5m2)

FOR_DENSE_INPUT(float, f32)
FOR_DENSE_INPUT(__nv_bfloat16, bf16)
FOR_DENSE_INPUT(__half, f16)

// The amax of a GELU linear's activation from its pre-activation's extremes (16-bit inputs,
// dense, row-major): one read with no GELU per element. For x <= 0, |gelu(x)| is at most 0.1700
// (0.1701 for the tanh form), 0.1709 once narrowed to bf16; for 0 <= a < b two 16-bit values lie
// at least 2^-12 · b apart, so gelu(a) < gelu(b) in f32 arithmetic too (gelu' >= 0.5 there, f32's
// error ~2^-22 · b). Hence when g = |narrow(gelu(max x))| >= GELU_FAST_BOUND, g is the amax of
// the activation bit for bit. Otherwise (small or no positive values, a NaN, -inf, whose GELU is
// NaN) float8_scale_gelu takes the exact amax itself, one block over every element: slow, rare.
#define GELU_FAST_BOUND 0.1875f

// An unsigned key of a float whose order is the floats' (NaNs beyond ±inf), and back.
__device__ __forceinline__ unsigned ordered_key(float v) {
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_ordered_key(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Each block's largest and smallest value (as keys; the smallest as its complement, so both
// reduce by max) into partial[2·blockIdx.x] and partial[2·blockIdx.x + 1].
template <typename T>
__device__ void extrema_dense(const T *x, long long n, unsigned *partial) {
    constexpr int VEC = Vector<T>::VEC;
    unsigned high = 0, low = 0;
    const long long vectors = n / VEC;
    for (long long i = (long long)blockIdx.x * THREADS + threadIdx.x; i < vectors;
         i += (long long)gridDim.x * THREADS) {
        float v[VEC];
        load_vector(x, i, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const unsigned key = ordered_key(v[j]);
            high = max(high, key);
            low = max(low, ~key);
        }
    }
    high = block_max(high);
    low = block_max(low);
    if (threadIdx.x == 0) {
        partial[2 * blockIdx.x] = high;
        partial[2 * blockIdx.x + 1] = low;
    }
}

// float8_scale for a GELU linear's activation (activation 1 GELU, 2 tanh GELU) of the 16-bit
// dense x (n elements): its amax from the partials of extrema_dense when GELU_FAST_BOUND allows,
// else from every element; then the scale (or the delayed one), the amax and the inverse scale.
template <typename T>
__device__ void scale_gelu(const unsigned *partial, int count, const T *x, long long n,
                           int activation, double max_finite, int power_of_two,
                           const float *delayed, float *scale, float *amax, float *inverse) {
    unsigned high = 0, low = 0;
    for (int i = threadIdx.x; i < count; i += THREADS) {
        high = max(high, partial[2 * i]);
        low = max(low, partial[2 * i + 1]);
    }
    high = block_max(high);
    low = block_max(low);
    const float top = from_ordered_key(high), bottom = from_ordered_key(~low);
    const float gelu_top = narrow_to(activation == 1 ? gelu_erf(top) : gelu_tanh(top), (const T *)nullptr);
    unsigned bits;
    if (top == top && bottom == bottom && bottom != -CUDART_INF_F && gelu_top >= GELU_FAST_BOUND) {
        bits = __float_as_uint(gelu_top);
    } else {
        constexpr int VEC = Vector<T>::VEC;
        bits = 0;
        for (long long i = threadIdx.x; i < n / VEC; i += THREADS) {
            float v[VEC];
            dense_values(x, i, nullptr, 0, 1, 1, activation, v);
#pragma unroll
            for (int j = 0; j < VEC; ++j) bits = max(bits, __float_as_uint(v[j]) & 0x7fffffffu);
        }
        bits = block_max(bits);
    }
    if (threadIdx.x == 0) write_scale(bits, max_finite, power_of_two, delayed, scale, amax, inverse);
}

#define GELU_AMAX(T, TN)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) float8_extrema_dense_##TN(              \
        const T *x, long long n, unsigned *partial) {                                             \
        extrema_dense(x, n, partial);                                                             \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) float8_scale_gelu_##TN(                 \
        const unsigned *partial, int count, const T *x, long long n, int activation,              \
        double max_finite, int power_of_two, const float *delayed, float *scale, float *amax,     \
        float *inverse) {                                                                         \
        scale_gelu(partial, count, x, n, activation, max_finite, power_of_two, delayed, scale,    \
                   amax, inverse);                                                                \
    }

GELU_AMAX(__nv_bfloat16, bf16)
GELU_AMAX(__half, f16)

// dst (dense [rows, cols]) = src (a [rows, cols] view with strides row_stride, col_stride), in
// 32 x 32 tiles through shared memory: loads walk the source's rows (threads along a column, so
// consecutive threads read consecutive bytes of a column-major source), stores walk the
// destination's columns.
#define TILE 32
#define TILE_ROWS 8
extern "C" __global__ void __launch_bounds__(TILE * TILE_ROWS)
float8_transpose(const unsigned char *src, long long rows, long long cols, long long row_stride,
                 long long col_stride, unsigned char *dst) {
    __shared__ unsigned char tile[TILE][TILE + 1];
    const long long row0 = (long long)blockIdx.y * TILE, col0 = (long long)blockIdx.x * TILE;
    for (int c = threadIdx.y; c < TILE; c += TILE_ROWS) {
        const long long row = row0 + threadIdx.x, col = col0 + c;
        if (row < rows && col < cols) tile[c][threadIdx.x] = src[row * row_stride + col * col_stride];
    }
    __syncthreads();
    for (int r = threadIdx.y; r < TILE; r += TILE_ROWS) {
        const long long row = row0 + r, col = col0 + threadIdx.x;
        if (row < rows && col < cols) dst[row * cols + col] = tile[threadIdx.x][r];
    }
}

// dst (dense [cols, rows]) = the transpose of src (a row-major [rows, cols] matrix of codes,
// rows ld bytes apart), in 64 x 64 tiles moved four bytes a thread each way: rows, cols and ld
// multiples of 4, src and dst 4-byte aligned (what the fp8 GEMMs' sizes, multiples of 16,
// give).
#define WIDE_TILE 64
extern "C" __global__ void __launch_bounds__(256)
float8_transpose_words(const unsigned char *src, long long rows, long long cols, long long ld,
                       unsigned char *dst) {
    __shared__ unsigned char tile[WIDE_TILE][WIDE_TILE + 4];
    const long long row0 = (long long)blockIdx.y * WIDE_TILE, col0 = (long long)blockIdx.x * WIDE_TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;  // 16 x 16
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int r = ty + 16 * k;
        const long long row = row0 + r, col = col0 + 4 * tx;
        if (row < rows && col < cols) {
            const unsigned word = *reinterpret_cast<const unsigned *>(src + row * ld + col);
            *reinterpret_cast<unsigned *>(&tile[r][4 * tx]) = word;
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int c = ty + 16 * k;
        const long long col = col0 + c, row = row0 + 4 * tx;
        if (col < cols && row < rows) {
            const unsigned word = (unsigned)tile[4 * tx][c] | ((unsigned)tile[4 * tx + 1][c] << 8) |
                                  ((unsigned)tile[4 * tx + 2][c] << 16) |
                                  ((unsigned)tile[4 * tx + 3][c] << 24);
            *reinterpret_cast<unsigned *>(dst + col * rows + row) = word;
        }
    }
}
