// bitsandbytes' 8-bit blockwise Adam on the GPU, for a whole list of parameters in one launch.
//
// One warp handles one 256-element quantization block at a time: dequantize both states
// with the block's absmax, update them, take the block's new absmax (a warp reduction), update
// the parameter, and re-quantize with bitsandbytes' nearest-code search and sign guard. The float
// operations are those of crates/optim/src/kernels/adam8bit.rs in the same order, with rounding
// made explicit, so the GPU and the CPU agree to the bit. The gradient scale and found-inf flag
// are read from device memory. Launch side: crates/optim/src/cuda.rs.
// Built to PTX by `cargo xtask build-kernels`.

#define QBLOCK 256

struct Tensor8 {
    unsigned long long param, grad, state1, state2, absmax1, absmax2;  // addresses
    unsigned long long len, first_block;  // elements; index of its first block in the launch
};

__device__ __forceinline__ unsigned char quantize_code(const float* map, bool is_signed, float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = is_signed ? -1.0f : 0.0f, upper = 1.0f;
    float val = map[pivot];
    for (int step = 64; step > 0; step >>= 1) {
        if (x > val) { lower_pivot = pivot; lower = val; pivot += step; }
        else { upper_pivot = pivot; upper = val; pivot -= step; }
        val = map[pivot];
    }
    int res;
    if (x > val) {
        float mid = __fmul_rn(__fadd_rn(upper, val), 0.5f);
        res = x > mid ? upper_pivot : pivot;
    } else {
        float mid = __fmul_rn(__fadd_rn(lower, val), 0.5f);
        res = x < mid ? lower_pivot : pivot;
    }
    return (unsigned char)res;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

#define WARPS 8
#define PER_LANE (QBLOCK / 32)

// One warp per quantization block, each lane holding 8 elements (lane, lane + 32, ...), so loads
// coalesce, the absmax is a warp shuffle, and no block-wide barrier is needed.
extern "C" __global__ void adam8bit_blockwise_f32(
    const Tensor8* tensors, unsigned int n_tensors, unsigned long long n_blocks, const float* qmap1,
    const float* qmap2, float beta1, float beta2, float one_minus_beta1, float one_minus_beta2,
    float correction2, float eps, float step_size, int has_decay, float decay_factor,
    const float* grad_scale, const float* found_inf) {
    if (found_inf && *found_inf != 0.0f) return;
    __shared__ float map1[256], map2[256];
    for (int k = threadIdx.x; k < 256; k += blockDim.x) { map1[k] = qmap1[k]; map2[k] = qmap2[k]; }
    __syncthreads();
    bool scaled = grad_scale != 0;
    float inv = scaled ? *grad_scale : 1.0f;
    float eps2 = __fmul_rn(correction2, eps);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (unsigned long long b = (unsigned long long)blockIdx.x * WARPS + warp; b < n_blocks;
         b += (unsigned long long)gridDim.x * WARPS) {
        // The tensor holding block b: the last whose first block is at most b.
        unsigned int lo = 0, hi = n_tensors - 1;
        while (lo < hi) {
            unsigned int mid = (lo + hi + 1) / 2;
            if (tensors[mid].first_block <= b) lo = mid; else hi = mid - 1;
        }
        const Tensor8 t = tensors[lo];
        unsigned long long block = b - t.first_block;
        unsigned long long base = block * QBLOCK;
        float* p = (float*)t.param + base;
        const float* gp = (const float*)t.grad + base;
        unsigned char* c1 = (unsigned char*)t.state1 + base;
        unsigned char* c2 = (unsigned char*)t.state2 + base;
        float* a1 = (float*)t.absmax1 + block;
        float* a2 = (float*)t.absmax2 + block;
        unsigned long long remaining = t.len - base;
        float old1 = *a1, old2 = *a2;
        float s1[PER_LANE], s2[PER_LANE];
        bool finite[PER_LANE];
        float max1 = 0.0f, max2 = 0.0f;
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            unsigned int j = lane + 32 * k;
            s1[k] = 0.0f;
            s2[k] = 0.0f;
            finite[k] = false;
            if (j < remaining) {
                float g = gp[j];
                if (scaled) g = __fdiv_rn(g, inv);
                finite[k] = isfinite(g);
                if (finite[k]) {
                    float v = __fmul_rn(map2[c2[j]], old2);
                    s2[k] = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(__fmul_rn(one_minus_beta2, g), g));
                    float m = __fmul_rn(map1[c1[j]], old1);
                    s1[k] = __fadd_rn(__fmul_rn(m, beta1), __fmul_rn(one_minus_beta1, g));
                }
            }
            max1 = fmaxf(max1, fabsf(s1[k]));
            max2 = fmaxf(max2, fabsf(s2[k]));
        }
        max1 = warp_max(max1);
        max2 = warp_max(max2);
        if (lane == 0) { *a1 = max1; *a2 = max2; }
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            unsigned int j = lane + 32 * k;
            if (j >= remaining) continue;
            if (finite[k]) {
                float pv = p[j];
                pv = __fadd_rn(pv, __fmul_rn(step_size, __fdiv_rn(s1[k], __fadd_rn(__fsqrt_rn(s2[k]), eps2))));
                if (has_decay) pv = __fmul_rn(pv, decay_factor);
                p[j] = pv;
            }
            unsigned char code1 = quantize_code(map1, true, __fdiv_rn(s1[k], max1));
            if (signbit(map1[code1]) != signbit(s1[k])) code1 = s1[k] > 0.0f ? (unsigned char)(code1 + 1) : (unsigned char)(code1 - 1);
            c1[j] = code1;
            c2[j] = quantize_code(map2, false, __fdiv_rn(s2[k], max2));
        }
    }
}
