// Elementwise kernels of the CUDA backend: strided copy/cast, fill, unary and binary math.
//
// Every kernel walks up to three strided operands of one shape (inputs already broadcast with
// zero strides) in a grid-stride loop, computing in double for f64 and in float otherwise. Op
// codes follow the order of autograd-core's `UnaryOp` and `BinaryOp`; the Rust side
// (crates/ops-cuda/src/elementwise.rs) is the only caller and must stay in step with this file.
// Built to PTX by `cargo xtask build-kernels`.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "strided.cuh"

template <typename T> struct Compute { typedef float type; };
template <> struct Compute<double> { typedef double type; };

template <typename T> __device__ __forceinline__ double to_double(T x) { return (double)x; }
template <> __device__ __forceinline__ double to_double<__half>(__half x) { return (double)__half2float(x); }
template <> __device__ __forceinline__ double to_double<__nv_bfloat16>(__nv_bfloat16 x) { return (double)__bfloat162float(x); }
template <> __device__ __forceinline__ double to_double<bool>(bool x) { return x ? 1.0 : 0.0; }

template <typename T> __device__ __forceinline__ T from_double(double x) { return (T)x; }
template <> __device__ __forceinline__ __half from_double<__half>(double x) { return __double2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double x) { return __double2bfloat16(x); }
template <> __device__ __forceinline__ bool from_double<bool>(double x) { return x != 0.0; }

// The 8-bit floats, as stored: casts only (through double, as every cast). Into them: nearest-
// even with saturation at the largest finite value and NaN kept (cuda_fp8.h's conversion with
// __NV_SATFINITE, what the CPU backend's float8 crate mirrors bit for bit); out of them exact.
struct F8E4M3 { __nv_fp8_storage_t bits; };
struct F8E5M2 { __nv_fp8_storage_t bits; };
template <> __device__ __forceinline__ double to_double<F8E4M3>(F8E4M3 x) {
    return (double)__half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3)));
}
template <> __device__ __forceinline__ double to_double<F8E5M2>(F8E5M2 x) {
    return (double)__half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E5M2)));
}
template <> __device__ __forceinline__ F8E4M3 from_double<F8E4M3>(double x) {
    return F8E4M3{__nv_cvt_double_to_fp8(x, __NV_SATFINITE, __NV_E4M3)};
}
template <> __device__ __forceinline__ F8E5M2 from_double<F8E5M2>(double x) {
    return F8E5M2{__nv_cvt_double_to_fp8(x, __NV_SATFINITE, __NV_E5M2)};
}

template <typename T> __device__ __forceinline__ typename Compute<T>::type load(const T* p) {
    return (typename Compute<T>::type)to_double(*p);
}
template <> __device__ __forceinline__ float load<__half>(const __half* p) { return __half2float(*p); }
template <> __device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T> __device__ __forceinline__ void store(T* p, typename Compute<T>::type v) { *p = (T)v; }
template <> __device__ __forceinline__ void store<__half>(__half* p, float v) { *p = __float2half(v); }
template <> __device__ __forceinline__ void store<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// Math in the compute type (float or double) by overload.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }

template <typename C> __device__ __forceinline__ C gelu(C x) {
    return (C)0.5 * x * ((C)1 + m_erf(x * (C)0.70710678118654752440));
}
template <typename C> __device__ __forceinline__ C gelu_grad(C x) {
    C cdf = (C)0.5 * ((C)1 + m_erf(x * (C)0.70710678118654752440));
    C pdf = m_exp((C)-0.5 * x * x) * (C)0.3989422804014327;
    return cdf + x * pdf;
}
template <typename C> __device__ __forceinline__ C gelu_tanh(C x) {
    C inner = (C)0.7978845608028654 * (x + (C)0.044715 * x * x * x);
    return (C)0.5 * x * ((C)1 + m_tanh(inner));
}
template <typename C> __device__ __forceinline__ C gelu_tanh_grad(C x) {
    const C beta = (C)0.7978845608028654, kappa = (C)0.044715;
    C x_sq = x * x;
    C t = m_tanh(beta * (x + kappa * x_sq * x));
    return (C)0.5 * ((C)1 + t) + (C)0.5 * x * ((C)1 - t * t) * beta * ((C)1 + (C)3 * kappa * x_sq);
}

template <typename C> __device__ __forceinline__ C unary_op(int op, C x, C c) {
    switch (op) {
        case 0: return -x;
        case 1: return m_exp(x);
        case 2: return m_log(x);
        case 3: return m_sqrt(x);
        case 4: return (C)1 / m_sqrt(x);
        case 5: return m_tanh(x);
        case 6: return x < (C)0 ? (C)0 : x;
        case 7: return gelu(x);
        case 8: return gelu_tanh(x);
        case 9: return x + c;
        case 10: return x * c;
        case 11: return x / c;
        default: return m_pow(x, c);
    }
}

template <typename C> __device__ __forceinline__ C binary_op(int op, C a, C b) {
    switch (op) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        case 3: return a / b;
        case 4: return m_pow(a, b);
        case 5: return b > (C)0 ? a : (C)0;
        case 6: return a * gelu_grad(b);
        case 7: return a * gelu_tanh_grad(b);
        case 8: return a * ((C)1 - b * b);
        case 9: return a / (b + b);
        default: return -((C)0.5 * a * b * b * b);
    }
}

template <typename T>
__device__ void unary_kernel(int op, double scalar, const T* x, T* out, StridedArgs a) {
    typedef typename Compute<T>::type C;
    C c = (C)scalar;
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        store(out + off[0], unary_op<C>(op, load(x + off[1]), c));
    }
}

template <typename T>
__device__ void binary_kernel(int op, const T* x, const T* y, T* out, StridedArgs a) {
    typedef typename Compute<T>::type C;
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        store(out + off[0], binary_op<C>(op, load(x + off[1]), load(y + off[2])));
    }
}

template <typename T>
__device__ void fill_kernel(T value, T* out, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        out[off[0]] = value;
    }
}

template <typename S, typename D>
__device__ void copy_kernel(const S* src, D* dst, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        dst[off[0]] = from_double<D>(to_double<S>(src[off[1]]));
    }
}

#define FLOAT_KERNELS(T, NAME)                                                                   \
    extern "C" __global__ void unary_##NAME(int op, double scalar, const T* x, T* out,          \
                                            StridedArgs a) {                                    \
        unary_kernel<T>(op, scalar, x, out, a);                                                 \
    }                                                                                           \
    extern "C" __global__ void binary_##NAME(int op, const T* x, const T* y, T* out,            \
                                             StridedArgs a) {                                   \
        binary_kernel<T>(op, x, y, out, a);                                                     \
    }                                                                                           \
    extern "C" __global__ void unary_dense_##NAME(int op, double scalar, const T* x, T* out,    \
                                                  unsigned long long n) {                       \
        unary_dense_kernel<T>(op, scalar, x, out, n);                                           \
    }                                                                                           \
    extern "C" __global__ void binary_dense_##NAME(int op, const T* x, const T* y, T* out,      \
                                                   unsigned long long n) {                      \
        binary_dense_kernel<T>(op, x, y, out, n);                                               \
    }

// Dense variants: every operand contiguous (one run of stride 1) at a 16-byte aligned address, as
// most activations and gradients are. Each thread moves 16 bytes per operand per step (8 f16/bf16,
// 4 f32 or 2 f64 elements), the way PyTorch's vectorized kernels do; the last n % V elements go
// one by one.
template <typename T>
__device__ void unary_dense_kernel(int op, double scalar, const T* x, T* out, unsigned long long n) {
    typedef typename Compute<T>::type C;
    constexpr int V = 16 / sizeof(T);
    C c = (C)scalar;
    unsigned long long packs = n / V;
    GRID_STRIDE_LOOP(i, packs) {
        uint4 in = reinterpret_cast<const uint4*>(x)[i], res;
        const T* a = reinterpret_cast<const T*>(&in);
        T* r = reinterpret_cast<T*>(&res);
#pragma unroll
        for (int k = 0; k < V; ++k) store(r + k, unary_op<C>(op, load(a + k), c));
        reinterpret_cast<uint4*>(out)[i] = res;
    }
    GRID_STRIDE_LOOP(i, n - packs * V) {
        unsigned long long e = packs * V + i;
        store(out + e, unary_op<C>(op, load(x + e), c));
    }
}

template <typename T>
__device__ void binary_dense_kernel(int op, const T* x, const T* y, T* out, unsigned long long n) {
    typedef typename Compute<T>::type C;
    constexpr int V = 16 / sizeof(T);
    unsigned long long packs = n / V;
    GRID_STRIDE_LOOP(i, packs) {
        uint4 in_x = reinterpret_cast<const uint4*>(x)[i], in_y = reinterpret_cast<const uint4*>(y)[i], res;
        const T* a = reinterpret_cast<const T*>(&in_x);
        const T* b = reinterpret_cast<const T*>(&in_y);
        T* r = reinterpret_cast<T*>(&res);
#pragma unroll
        for (int k = 0; k < V; ++k) store(r + k, binary_op<C>(op, load(a + k), load(b + k)));
        reinterpret_cast<uint4*>(out)[i] = res;
    }
    GRID_STRIDE_LOOP(i, n - packs * V) {
        unsigned long long e = packs * V + i;
        store(out + e, binary_op<C>(op, load(x + e), load(y + e)));
    }
}

FLOAT_KERNELS(float, f32)
FLOAT_KERNELS(double, f64)
FLOAT_KERNELS(__half, f16)
FLOAT_KERNELS(__nv_bfloat16, bf16)

// Fill by element size: the Rust side passes the value's bit pattern.
extern "C" __global__ void fill_b8(unsigned long long v, unsigned long long* out, StridedArgs a) { fill_kernel(v, out, a); }
extern "C" __global__ void fill_b4(unsigned int v, unsigned int* out, StridedArgs a) { fill_kernel(v, out, a); }
extern "C" __global__ void fill_b2(unsigned short v, unsigned short* out, StridedArgs a) { fill_kernel(v, out, a); }
extern "C" __global__ void fill_b1(unsigned char v, unsigned char* out, StridedArgs a) { fill_kernel(v, out, a); }

// Copies of equal dtypes move bits; casts go through double.
extern "C" __global__ void copy_b8(const unsigned long long* s, unsigned long long* d, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) { unsigned long long off[3]; element_offsets(a, i, off); d[off[0]] = s[off[1]]; }
}
extern "C" __global__ void copy_b4(const unsigned int* s, unsigned int* d, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) { unsigned long long off[3]; element_offsets(a, i, off); d[off[0]] = s[off[1]]; }
}
extern "C" __global__ void copy_b2(const unsigned short* s, unsigned short* d, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) { unsigned long long off[3]; element_offsets(a, i, off); d[off[0]] = s[off[1]]; }
}
extern "C" __global__ void copy_b1(const unsigned char* s, unsigned char* d, StridedArgs a) {
    GRID_STRIDE_LOOP(i, a.numel) { unsigned long long off[3]; element_offsets(a, i, off); d[off[0]] = s[off[1]]; }
}

#define CAST(S, SN, D, DN)                                                                       \
    extern "C" __global__ void cast_##SN##_##DN(const S* s, D* d, StridedArgs a) {              \
        copy_kernel<S, D>(s, d, a);                                                             \
    }
#define CASTS_FROM(S, SN)                                                                        \
    CAST(S, SN, float, f32) CAST(S, SN, double, f64) CAST(S, SN, __half, f16)                   \
    CAST(S, SN, __nv_bfloat16, bf16) CAST(S, SN, long long, i64) CAST(S, SN, int, i32)          \
    CAST(S, SN, unsigned char, u8) CAST(S, SN, bool, bool) CAST(S, SN, F8E4M3, f8e4m3)          \
    CAST(S, SN, F8E5M2, f8e5m2)

CASTS_FROM(float, f32)
CASTS_FROM(double, f64)
CASTS_FROM(__half, f16)
CASTS_FROM(__nv_bfloat16, bf16)
CASTS_FROM(long long, i64)
CASTS_FROM(int, i32)
CASTS_FROM(unsigned char, u8)
CASTS_FROM(bool, bool)
CASTS_FROM(F8E4M3, f8e4m3)
CASTS_FROM(F8E5M2, f8e5m2)

// Masked ops: op 0 = fill (mask ? c : x), 1 = scale (mask ? x·c : 0). Operands: out, x, mask.
template <typename T>
__device__ void masked_kernel(int op, double c, const T* x, const unsigned char* mask, T* out, StridedArgs a) {
    typedef typename Compute<T>::type C;
    GRID_STRIDE_LOOP(i, a.numel) {
        unsigned long long off[3];
        element_offsets(a, i, off);
        bool set = mask[off[2]] != 0;
        C v = op == 0 ? (set ? (C)c : load(x + off[1])) : (set ? load(x + off[1]) * (C)c : (C)0);
        store(out + off[0], v);
    }
}
#define MASKED(T, N)                                                                             \
    extern "C" __global__ void masked_##N(int op, double c, const T* x, const unsigned char* m,   \
                                          T* out, StridedArgs a) {                               \
        masked_kernel<T>(op, c, x, m, out, a);                                                   \
    }
MASKED(float, f32)
MASKED(double, f64)
MASKED(__half, f16)
MASKED(__nv_bfloat16, bf16)

// Small copies without a copy engine (small_copies.rs): n bytes from device memory into pinned
// host memory the device addresses directly, and back.
extern "C" __global__ void read_back_bytes(const unsigned char* src, unsigned char* host, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) host[i] = src[i];
}
extern "C" __global__ void write_from_host_bytes(const unsigned char* host, unsigned char* dst, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = host[i];
}
