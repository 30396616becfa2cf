// Fused scaled-dot-product attention on tensor cores for f16 and bf16 (FlashAttention-2 style):
// forward, and the backward as two kernels (dQ with each query's Δ = dO·O, then dK and dV).
//
// The kernel bodies are attention_flash.cuh's; this file is their 16-bit policy. The other side
// streams 64 rows at a time. Tiles sit in shared memory as [rows][DP + 8] (DP = the head dim
// rounded up to 32; the 8-element pad makes `ldmatrix` conflict-free). Every product is
// `mma.sync.m16n8k16` (16-bit operands, f32 accumulators), operands fetched with `ldmatrix`
// (`.trans` where the tile is stored k-major). The accumulator layout of one product is the
// operand layout of the next, so probabilities (and score gradients) are rounded to the storage
// dtype and fed straight back.
//
// Needs: head dims a multiple of 8 up to 128, every operand's offset and strides multiples of 8
// elements and 16-byte aligned buffers (crates/ops-cuda/src/attention/tensor_core.rs checks; other shapes
// take the cuBLAS path). Built to compute_80 PTX by `cargo xtask build-kernels`.

#include "attention_tc.cuh"

// attention_tc_forward_<dtype>_<DP> and so on. At head dims up to 64 (TC_NARROW; tensor_core.rs's
// TC_NARROW_SHAPES say the same) the forward holds 32 queries a warp (223 registers, 2 blocks an
// SM) and the dK/dV kernel is bounded to 3 blocks an SM (168 registers and no spills, where
// unbounded it takes 228 and fits 2). On the H200 at Llama-3.2-1B's shape each kernel ran slower
// with 32 streamed rows (forward at 3 blocks an SM 345 against 314 µs, dK/dV at 4 blocks 665
// against 595 µs) and the dQ kernel with 32 queries a warp (450 against 420 µs). Above 64 a warp
// holds 16 queries, which keeps the forward off spills.
// Dropout builds for bf16 at 64 and 128 only (each is a whole set of unrolled kernels in the
// committed PTX): tensor_core.rs pads a dropping call's head dim to one of them.
#define TC_NARROW(M, SUFFIX, DP) FLASH_KERNELS(M, tc, SUFFIX, DP, 2, 64, 1, 64, 64, 3)
#define TC_WIDE(M, SUFFIX, DP) FLASH_KERNELS(M, tc, SUFFIX, DP, 1, 64, 1, 64, 64, 1)
#define TC_NARROW_DROPOUT(M, SUFFIX, DP) FLASH_KERNELS_WITH_DROPOUT(M, tc, SUFFIX, DP, 2, 64, 1, 64, 64, 3)
#define TC_WIDE_DROPOUT(M, SUFFIX, DP) FLASH_KERNELS_WITH_DROPOUT(M, tc, SUFFIX, DP, 1, 64, 1, 64, 64, 1)
TC_NARROW(TcBf16, bf16_32, 32)
TC_NARROW_DROPOUT(TcBf16, bf16_64, 64)
TC_WIDE(TcBf16, bf16_96, 96)
TC_WIDE_DROPOUT(TcBf16, bf16_128, 128)
TC_NARROW(TcF16, f16_32, 32)
TC_NARROW(TcF16, f16_64, 64)
TC_WIDE(TcF16, f16_96, 96)
TC_WIDE(TcF16, f16_128, 128)
