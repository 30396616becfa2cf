// What the optimizer kernels share: the piece lookup of multi-tensor launches, PyTorch's float32
// helpers with explicit rounding, and the device-side skip accounting of a GradScaler.
//
// A launch updates a list of "pieces" (a tensor, or a range of one) described by a table in
// device memory that the host writes before the launch (crates/optim/src/cuda/table.rs writes
// the same layouts). Every piece struct starts with the same header, so one lookup serves them
// all: the block (or warp) of a launch works on the last piece whose first_block is at most its
// own index.

#pragma once

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

// One foreach op over a piece: out[i] = f(a[i], b[i], c[i]) for its n elements (unused inputs
// are null and read as 0; out may be one of the inputs). With every pointer 16-byte aligned the
// elements go as float4, two per thread loaded before either is stored, so a thread keeps up
// to six 16-byte loads in flight.
template <typename F>
__device__ __forceinline__ void pass_apply(float* out, const float* a, const float* b, const float* c,
                                           unsigned long long n, F f) {
    unsigned long long done = 0;
    if (((((unsigned long long)out) | (unsigned long long)a | (unsigned long long)b | (unsigned long long)c) & 15) == 0) {
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        unsigned long long n4 = n / 4;
        for (unsigned long long i0 = threadIdx.x; i0 < n4; i0 += 2ull * blockDim.x) {
            float4 x[2], y[2], z[2];
#pragma unroll
            for (unsigned u = 0; u < 2; ++u) {
                unsigned long long i = i0 + (unsigned long long)u * blockDim.x;
                if (i < n4) {
                    x[u] = ((const float4*)a)[i];
                    y[u] = b ? ((const float4*)b)[i] : zero;
                    z[u] = c ? ((const float4*)c)[i] : zero;
                }
            }
#pragma unroll
            for (unsigned u = 0; u < 2; ++u) {
                unsigned long long i = i0 + (unsigned long long)u * blockDim.x;
                if (i < n4) {
                    float4 r;
                    r.x = f(x[u].x, y[u].x, z[u].x);
                    r.y = f(x[u].y, y[u].y, z[u].y);
                    r.z = f(x[u].z, y[u].z, z[u].z);
                    r.w = f(x[u].w, y[u].w, z[u].w);
                    ((float4*)out)[i] = r;
                }
            }
        }
        done = n4 * 4;
    }
    for (unsigned long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        out[i] = f(a[i], b ? b[i] : 0.0f, c ? c[i] : 0.0f);
    }
}
