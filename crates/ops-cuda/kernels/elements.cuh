// Element loads and stores in the accumulation type: f64 accumulates in double, every other float
// type (f32, f16, bf16) in float. Included by rows.cu, index.cu and attention.cu.

#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type ld(const T* p) { return (typename Acc<T>::type)(*p); }
template <> __device__ __forceinline__ float ld<__half>(const __half* p) { return __half2float(*p); }
template <> __device__ __forceinline__ float ld<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <typename T, typename V> __device__ __forceinline__ void st(T* p, V v) { *p = (T)v; }
template <> __device__ __forceinline__ void st<__half, float>(__half* p, float v) { *p = __float2half(v); }
template <> __device__ __forceinline__ void st<__nv_bfloat16, float>(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
template <> __device__ __forceinline__ void st<__half, double>(__half* p, double v) { *p = __double2half(v); }
template <> __device__ __forceinline__ void st<__nv_bfloat16, double>(__nv_bfloat16* p, double v) { *p = __double2bfloat16(v); }
