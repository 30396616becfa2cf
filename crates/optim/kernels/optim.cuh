// What the optimizer kernels share: the piece lookup of multi-tensor launches, PyTorch's float32
// helpers with explicit rounding, the device-side skip accounting of a GradScaler, and the
// parameter element types (f32, bf16, f16: loaded to f32, stored rounded to nearest even).
//
// A launch updates a list of "pieces" (a tensor, or a range of one) described by a table in
// device memory that the host writes before the launch (crates/optim/src/cuda/table.rs writes
// the same layouts). Every piece struct starts with the same header, so one lookup serves them
// all: the block (or warp) of a launch works on the last piece whose first_block is at most its
// own index.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

struct PieceHead {
    unsigned long long len;          // elements of the piece
    unsigned long long first_block;  // its first block (CUDA block, or 256-element block) in the launch
    unsigned long long skipped;      // address of the parameter's device skip counter (int), 0: none
    unsigned long long step;         // the host's step number for this update (from 1)
};

// Float NaN as Rust's f32::NAN, so NaN results compare bit for bit with the CPU's.
#define RUST_NAN __int_as_float(0x7fc00000)

// Flags shared by the piece structs.
#define FLAG_HOST_SCALED 1u    // divide gradients by the piece's grad_scale
#define FLAG_MAXIMIZE 2u
#define FLAG_L2 4u             // coupled weight decay (added to the gradient)
#define FLAG_DECAY 8u          // decoupled weight decay (parameter multiplied)
#define FLAG_CHANGES_GRAD 16u  // the foreach passes keep the modified gradient in tmp
#define FLAG_MOMENTUM 32u
#define FLAG_NESTEROV 64u
#define FLAG_BNB_ARITH 128u    // 8-bit Adam: bitsandbytes' fast-math arithmetic (adam8bit.cu)
#define FLAG_STOCHASTIC 256u   // 8- and 4-bit Adam: a bf16 parameter rounded stochastically

// The index of the piece holding block `block`: pieces are sorted by first_block.
template <typename Piece>
__device__ __forceinline__ unsigned find_piece(const Piece* pieces, unsigned n_pieces, unsigned long long block) {
    unsigned lo = 0, hi = n_pieces - 1;
    while (lo < hi) {
        unsigned mid = (lo + hi + 1) / 2;
        if (pieces[mid].head.first_block <= block) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// A gradient of a launch that treats every gradient alike (clipping, the overflow check): the
// header (len, first_block; skipped and step unused) and the gradient's address.
struct GradPiece {
    PieceHead head;
    unsigned long long grad;
};
static_assert(sizeof(GradPiece) == 40, "GradPiece layout");

// The elements of `block` (numbered across every piece of the table): the start of its range of
// its piece's gradient, and how many there are (0 past the piece's end).
template <typename T>
__device__ __forceinline__ unsigned long long grad_block(const GradPiece* pieces, unsigned n_pieces,
                                                         unsigned long long block_elems, unsigned long long block,
                                                         T** g) {
    const GradPiece& pc = pieces[find_piece(pieces, n_pieces, block)];
    unsigned long long start = (block - pc.head.first_block) * block_elems;
    *g = (T*)pc.grad + start;
    return start < pc.head.len ? min(block_elems, pc.head.len - start) : 0;
}

// With the found-inf flag set, block 0 counts one skipped step for every piece that has a
// counter, and every block returns true (nothing else is written).
template <typename Piece>
__device__ __forceinline__ bool skip_step(const Piece* pieces, unsigned n_pieces, const float* found_inf) {
    if (!found_inf || *found_inf == 0.0f) return false;
    if (blockIdx.x == 0) {
        for (unsigned i = threadIdx.x; i < n_pieces; i += blockDim.x) {
            if (pieces[i].head.skipped) atomicAdd((int*)pieces[i].head.skipped, 1);
        }
    }
    return true;
}

// The step number the update is: the host's, less the steps the device skipped.
__device__ __forceinline__ unsigned long long true_step(const PieceHead& head) {
    return head.skipped ? head.step - (unsigned long long)*(const int*)head.skipped : head.step;
}

// PyTorch's `lerp(self, end, weight)` in float32 (the scalar-weight path).
__device__ __forceinline__ float lerp_pt(float start, float end, float weight) {
    float diff = __fsub_rn(end, start);
    return fabsf(weight) < 0.5f ? fmaf(weight, diff, start) : fmaf(__fsub_rn(weight, 1.0f), diff, end);
}

// `torch.maximum`: NaN from either side.
__device__ __forceinline__ float maximum_pt(float a, float b) {
    return (a != a || b != b) ? RUST_NAN : fmaxf(a, b);
}

// The gradient scale of a launch: the device value when given, else the piece's host value.
__device__ __forceinline__ bool grad_scale_of(const float* device_scale, unsigned flags, float host_scale, float* scale) {
    if (device_scale) { *scale = *device_scale; return true; }
    *scale = host_scale;
    return (flags & FLAG_HOST_SCALED) != 0;
}

// Parameter element types. SGD and Adam kernels take parameters (and keep states and
// temporaries) as float, __nv_bfloat16 or __half and compute in float, as PyTorch's opmath does:
// a load widens exactly, a store rounds to nearest even once. NaN stores as one canonical NaN of
// the type (the bits crates/optim/src/kernels/mod.rs's ParamElement stores), so the GPU and the
// CPU agree to the bit.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return x != x ? __ushort_as_bfloat16((unsigned short)0x7fc0) : __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return x != x ? __ushort_as_half((unsigned short)0x7e00) : __float2half_rn(x);
}

// A 2-byte element's bits, and the float a 2-byte element of these bits holds.
__device__ __forceinline__ unsigned short bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ unsigned short bits16(__half x) { return __half_as_ushort(x); }
template <typename T> __device__ __forceinline__ float f32_of_bits16(unsigned short bits);
template <> __device__ __forceinline__ float f32_of_bits16<__nv_bfloat16>(unsigned short bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
}
template <> __device__ __forceinline__ float f32_of_bits16<__half>(unsigned short bits) {
    return __half2float(__ushort_as_half(bits));
}

// Four consecutive elements (the `i`-th group of four) as floats: one 16-byte access for float,
// one 8-byte access for the 2-byte types; the address must be aligned to four elements.
__device__ __forceinline__ void load4(const float* a, unsigned long long i, float r[4]) {
    float4 v = ((const float4*)a)[i];
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
}
__device__ __forceinline__ void store4(float* a, unsigned long long i, const float r[4]) {
    ((float4*)a)[i] = make_float4(r[0], r[1], r[2], r[3]);
}
template <typename T>
__device__ __forceinline__ void load4(const T* a, unsigned long long i, float r[4]) {
    uint2 v = ((const uint2*)a)[i];
    r[0] = f32_of_bits16<T>((unsigned short)(v.x & 0xffffu));
    r[1] = f32_of_bits16<T>((unsigned short)(v.x >> 16));
    r[2] = f32_of_bits16<T>((unsigned short)(v.y & 0xffffu));
    r[3] = f32_of_bits16<T>((unsigned short)(v.y >> 16));
}
template <typename T>
__device__ __forceinline__ void store4(T* a, unsigned long long i, const float r[4]) {
    unsigned s0 = bits16(from_f32<T>(r[0])), s1 = bits16(from_f32<T>(r[1]));
    unsigned s2 = bits16(from_f32<T>(r[2])), s3 = bits16(from_f32<T>(r[3]));
    ((uint2*)a)[i] = make_uint2(s0 | (s1 << 16), s2 | (s3 << 16));
}

// Eight consecutive elements (the `i`-th group of eight) as floats: two 16-byte accesses for
// float, one for the 2-byte types; the address must be aligned to 16 bytes. Twice load4's bytes
// in flight a thread, what a streaming kernel of 2-byte arrays needs to near the memory's pace.
__device__ __forceinline__ void load8(const float* a, unsigned long long i, float r[8]) {
    load4(a, 2 * i, r);
    load4(a, 2 * i + 1, r + 4);
}
__device__ __forceinline__ void store8(float* a, unsigned long long i, const float r[8]) {
    store4(a, 2 * i, r);
    store4(a, 2 * i + 1, r + 4);
}
template <typename T>
__device__ __forceinline__ void load8(const T* a, unsigned long long i, float r[8]) {
    uint4 v = ((const uint4*)a)[i];
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        r[2 * k] = f32_of_bits16<T>((unsigned short)(words[k] & 0xffffu));
        r[2 * k + 1] = f32_of_bits16<T>((unsigned short)(words[k] >> 16));
    }
}
template <typename T>
__device__ __forceinline__ void store8(T* a, unsigned long long i, const float r[8]) {
    unsigned s[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = bits16(from_f32<T>(r[k]));
    ((uint4*)a)[i] = make_uint4(s[0] | (s[1] << 16), s[2] | (s[3] << 16), s[4] | (s[5] << 16), s[6] | (s[7] << 16));
}

// Stochastic rounding (crates/optim/src/kernels/stochastic.rs computes the same bits): splitmix64
// over a key of (seed, parameter index, true step) and the element's index gives 16 random bits,
// added to the f32 bits below the bf16 cut, so the kept half rounds up with the probability of
// the dropped fraction.
#define GOLDEN_GAMMA 0x9e3779b97f4a7c15ull

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned long long stochastic_key(unsigned long long seed, unsigned long long index,
                                                             unsigned long long step) {
    return mix64(seed ^ mix64((index << 32) ^ step));
}

// Elements 4j..4j+3 share one splitmix64 output (stochastic_group(key, j)), element 4j + k taking
// its bits 63 - 16k down to 48 - 16k: a kernel that rounds four neighbours hashes once for them.
__device__ __forceinline__ unsigned long long stochastic_group(unsigned long long key, unsigned long long j) {
    return mix64(key + (j + 1) * GOLDEN_GAMMA);
}

__device__ __forceinline__ unsigned stochastic_bits_of(unsigned long long group_bits, unsigned k) {
    return (unsigned)(group_bits >> (48 - 16 * k)) & 0xffffu;
}

__device__ __forceinline__ unsigned stochastic_bits(unsigned long long key, unsigned long long i) {
    return stochastic_bits_of(stochastic_group(key, i / 4), (unsigned)(i % 4));
}

__device__ __forceinline__ __nv_bfloat16 round_bf16_stochastic(float x, unsigned random) {
    if (!isfinite(x)) return from_f32<__nv_bfloat16>(x);
    unsigned bits = (__float_as_uint(x) + (random & 0xffffu)) & 0xffff0000u;
    return __ushort_as_bfloat16((unsigned short)(bits >> 16));
}

// How a kernel stores a parameter's new value at one step (kernels/stochastic.rs's ParamRounding):
// to nearest, or stochastically with the bits of stream `key` (element i with its bits i).
struct ParamRounding {
    unsigned long long key;
    bool stochastic;
};

// The rounding of a piece flagged FLAG_STOCHASTIC (else to nearest): the stream of its seed, its
// parameter's index and its true step.
__device__ __forceinline__ ParamRounding param_rounding(const PieceHead& head, unsigned flags, unsigned long long seed,
                                                        unsigned long long param_index) {
    ParamRounding r;
    r.stochastic = (flags & FLAG_STOCHASTIC) != 0;
    r.key = r.stochastic ? stochastic_key(seed, param_index, true_step(head)) : 0;
    return r;
}

// `x` stored as element `i` of a parameter of T by `r` (f32 exactly; bf16 to nearest or
// stochastically).
template <typename T> __device__ __forceinline__ T store_rounded(float x, ParamRounding r, unsigned long long i);
template <> __device__ __forceinline__ float store_rounded<float>(float x, ParamRounding, unsigned long long) {
    return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 store_rounded<__nv_bfloat16>(float x, ParamRounding r, unsigned long long i) {
    return r.stochastic ? round_bf16_stochastic(x, stochastic_bits(r.key, i)) : from_f32<__nv_bfloat16>(x);
}

// store4 by `r`: the `i`-th group of four of `a`, whose element 0 is element `first` of its
// parameter. `first` is a multiple of four (a quantisation block's first element, in every
// caller), so the four are one group of the stream: one hash.
__device__ __forceinline__ void store4_rounded(float* a, unsigned long long i, const float v[4], ParamRounding,
                                               unsigned long long) {
    store4(a, i, v);
}
__device__ __forceinline__ void store4_rounded(__nv_bfloat16* a, unsigned long long i, const float v[4],
                                               ParamRounding r, unsigned long long first) {
    unsigned short s[4];
    if (r.stochastic) {
        const unsigned long long group = stochastic_group(r.key, first / 4 + i);
#pragma unroll
        for (int k = 0; k < 4; ++k) s[k] = bits16(round_bf16_stochastic(v[k], stochastic_bits_of(group, k)));
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) s[k] = bits16(from_f32<__nv_bfloat16>(v[k]));
    }
    ((uint2*)a)[i] = make_uint2(s[0] | ((unsigned)s[1] << 16), s[2] | ((unsigned)s[3] << 16));
}

// Every element of a thread's share of `a` (n elements of T, over blocks of THREADS threads)
// read once as float, f(x) for each, in a fixed order: four at a time with one vector load where
// `a` is aligned to four elements, then the rest one by one.
template <unsigned THREADS, typename T, typename F>
__device__ __forceinline__ void read_each(const T* a, unsigned long long n, F f) {
    unsigned long long done = 0;
    if ((((unsigned long long)a) & (4 * sizeof(T) - 1)) == 0) {
        unsigned long long n4 = n / 4;
        for (unsigned long long i = threadIdx.x; i < n4; i += THREADS) {
            float v[4];
            load4(a, i, v);
#pragma unroll
            for (unsigned k = 0; k < 4; ++k) f(v[k]);
        }
        done = n4 * 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += THREADS) f(to_f32(a[i]));
}

// Declares the three instances of kernel template `name` (with `attrs` such as launch bounds):
// `name_f32`, `name_bf16` and `name_f16`, taking `params` and passing `args` on.
#define INSTANCES(attrs, name, params, args)                                     \
    extern "C" __global__ void attrs name##_f32 params { name<float> args; }          \
    extern "C" __global__ void attrs name##_bf16 params { name<__nv_bfloat16> args; } \
    extern "C" __global__ void attrs name##_f16 params { name<__half> args; }

// One foreach op over a piece: out[i] = f(a[i], b[i], c[i]) for its n elements of T, computed in
// float (unused inputs are null and read as 0; out may be one of the inputs; the result is
// rounded to T). With every pointer aligned to four elements, a thread loads two groups of four
// before storing either, so it keeps up to six vector loads in flight.
template <typename T> struct NoDeduce { typedef T type; };
template <typename T, typename F>
__device__ __forceinline__ void pass_apply(T* out, const typename NoDeduce<T>::type* a,
                                           const typename NoDeduce<T>::type* b,
                                           const typename NoDeduce<T>::type* c, unsigned long long n, F f) {
    unsigned long long done = 0;
    if (((((unsigned long long)out) | (unsigned long long)a | (unsigned long long)b | (unsigned long long)c) & (4 * sizeof(T) - 1)) == 0) {
        unsigned long long n4 = n / 4;
        for (unsigned long long i0 = threadIdx.x; i0 < n4; i0 += 2ull * blockDim.x) {
            float x[2][4], y[2][4], z[2][4];
#pragma unroll
            for (unsigned u = 0; u < 2; ++u) {
                unsigned long long i = i0 + (unsigned long long)u * blockDim.x;
                if (i < n4) {
                    load4(a, i, x[u]);
                    if (b) load4(b, i, y[u]); else y[u][0] = y[u][1] = y[u][2] = y[u][3] = 0.0f;
                    if (c) load4(c, i, z[u]); else z[u][0] = z[u][1] = z[u][2] = z[u][3] = 0.0f;
                }
            }
#pragma unroll
            for (unsigned u = 0; u < 2; ++u) {
                unsigned long long i = i0 + (unsigned long long)u * blockDim.x;
                if (i < n4) {
                    float r[4];
#pragma unroll
                    for (unsigned k = 0; k < 4; ++k) r[k] = f(x[u][k], y[u][k], z[u][k]);
                    store4(out, i, r);
                }
            }
        }
        done = n4 * 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        out[i] = from_f32<T>(f(to_f32(a[i]), b ? to_f32(b[i]) : 0.0f, c ? to_f32(c[i]) : 0.0f));
    }
}
