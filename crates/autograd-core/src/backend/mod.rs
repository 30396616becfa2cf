//! The backend trait: the primitives a device must run for every tensor op of the crate.
//!
//! # Design
//!
//! [`Backend`] has **37 methods**: 9 for the device and its memory (`device`, `into_any`,
//! `allocate`, `free`, `allocator_view`, `memory_stats` — a default body reading the view —,
//! `synchronize`, `write_host`, `read_host`) and 28 compute primitives, 4 of which have default
//! bodies: `linear` and `linear_weight_grad` composed of the others, `quantize_float8` and
//! `matmul_float8` answering "not here" (the fp8 ops then compose casts and f32 products). The engine
//! and every op in `crate::ops` are written once on top of it; ops-cpu and ops-cuda implement it.
//! The technique seams (autocast, saved-tensor sites, backward-end callbacks, the non-finite
//! check) added no method: they are written with these. The reasoning:
//!
//! - **Primitives take strided views and write into a caller-allocated output.** The core
//!   allocates every output from the backend's caching allocator, so memory accounting lives in
//!   one place, and the same primitive serves out-of-place ops, in-place ops (`out` is the input)
//!   and `out=` variants. Inputs arrive already broadcast (stride-0 dims), so a backend iterates
//!   one shape, never broadcasts.
//! - **dtype is a run-time value** carried by each [`View`]; a backend dispatches on it and
//!   answers [`TensorError::UnsupportedDtype`](crate::TensorError) for what it lacks.
//! - **Op families are enums, not methods.** [`UnaryOp`], [`BinaryOp`], [`ReduceOp`] and
//!   [`MaskedOp`] keep the trait small: a new activation is a variant, not a method to forward
//!   through every decorator.
//! - **A fused primitive exists only where composing primitives would cost an extra memory pass
//!   or extra saved memory**: softmax (one read, one write, and its backward), layer norm (forward
//!   saves only mean and rstd; backward is one pass), cross-entropy (saves one log-sum-exp per
//!   row instead of a log-softmax matrix), dropout (mask and output in one pass), attention
//!   (saves one log-sum-exp per query instead of a `[seq, seq]` probability matrix per head),
//!   fp8 (a quantize reads its input for the amax and again for the codes, with no widened copy;
//!   the fp8 product reads 8-bit codes, not their f32 widening), the Llama pieces (RMSNorm saves one rstd per row; SwiGLU saves only its inputs and recomputes
//!   `silu(gate)`; the rotary embedding saves nothing, its backward being the inverse rotation of
//!   the output gradient), linear
//!   (a GEMM library adds the bias and writes the bias gradient in its epilogue, saving a pass
//!   each way; the default bodies compose `copy`, `matmul`, `unary` and `reduce`, so a backend
//!   without such a library implements nothing). Everything else (mean, patch embedding,
//!   cat/split, pow backward, ...) is composed in `crate::ops`.
//! - **No device types.** Views carry a [`Buffer`], whose address is a `u64`; no CUDA stream,
//!   handle or pointer type appears here.
//!
//! Contract for implementors: the trait is safe and [`View`]'s fields are public, so a backend
//! trusts no view. Before it touches memory, every primitive runs
//! [`check_operands`](crate::check_operands) with its own allocator's id (each view inside its
//! buffer, the buffer's memory from that allocator, no output reaching an element twice, outputs
//! sharing memory with inputs only as the very same view of an elementwise primitive,
//! [`Aliasing`](crate::Aliasing)), and checks `Buffer::check_owner` in the host transfers. A
//! backend that computes on the host also claims the operands' buffers
//! ([`claim_operands`](crate::claim_operands)) for the kernel, since tensors are `Send + Sync`.
//! Output views are dense (contiguous) unless the method says otherwise; `copy`, `fill`,
//! `scatter_add` and the elementwise primitives may write through a strided view, and an
//! elementwise output may be the same view as an input.
//!
//! The trait is here; the types its primitives take (views, op families, argument structs) are
//! `args.rs`'s, and the shape rules and composed default bodies every backend shares `dims.rs`'s
//! (`llama_dims.rs`'s for the Llama primitives).

mod args;
mod cross_entropy_args;
mod dims;
mod float8_args;
mod llama_dims;

use std::sync::Arc;

use headroom_caching_allocator::{Allocation, AllocatorView, MemoryStats};

use crate::buffer::Buffer;
use crate::dtype::Device;
use crate::error::Result;
use crate::random::RandomDraw;

pub use args::{
    AttentionBackward, AttentionForward, BinaryOp, DropoutDraw, LayerNormBackward,
    LayerNormForward, LinearEpilogue, LinearForward, LinearWeightGrad, MaskedOp, Operands,
    PackedBounds, ReduceOp, ReduceWithIndex, Reduction, SoftmaxBackward, UnaryOp, View,
};
pub use args::{
    GateUp, RmsNormBackward, RmsNormForward, RotaryArgs, SwiGluBackward, SwiGluForward,
};
pub use cross_entropy_args::{
    cross_entropy_tile_dims, CrossEntropyArgs, CrossEntropyBackward, CrossEntropyForward,
    CrossEntropyTile, CrossEntropyTileBackward, LogitTile,
};
pub use dims::{
    attention_dims, check_cu_seqlens, compose_linear, compose_linear_weight_grad, index_strides,
    linear_dims, linear_weight_grad_dims, matmul_dims, AttentionDims,
};
pub use float8_args::{
    float8_matmul_dims, float8_quantize_dims, Float8Granularity, Float8Matmul, Float8Quantize,
};
pub use llama_dims::RotaryDims;

/// A shared handle to a backend; tensors hold one through their storage.
pub type BackendRef = Arc<dyn Backend>;

/// A device that stores tensors and runs the core's primitives. See the module docs.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// The device this backend drives.
    fn device(&self) -> Device;

    /// The backend as `Any`, so a crate with kernels of its own for one device (optim's CUDA
    /// updates) can reach the concrete backend: `backend.clone().into_any().downcast::<T>()`.
    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;

    /// Allocates `bytes` from this backend's caching allocator.
    fn allocate(&self, bytes: u64) -> Result<Allocation>;

    /// Returns an allocation. Called from `Drop`, so it cannot fail: a backend records an error
    /// from its allocator where the user can query it, and never panics.
    fn free(&self, allocation: Allocation);

    /// The caching allocator this backend allocates from, seen without its storage type: its
    /// statistics and their peaks, emptying its cache, its history and snapshots — what a
    /// measurement reads, the same way on every device.
    fn allocator_view(&self) -> &dyn AllocatorView;

    /// The caching allocator of this backend's pinned host memory (offloaded activations and
    /// state), seen as [`Backend::allocator_view`] sees device memory, so a report can put host
    /// bytes beside device bytes; `None` for a backend without one (the CPU's).
    fn host_allocator_view(&self) -> Option<&dyn AllocatorView> {
        None
    }

    /// The allocator's statistics (`allocated_bytes.all.current` is `memory_allocated()`): the
    /// [`Backend::allocator_view`]'s.
    fn memory_stats(&self) -> MemoryStats {
        self.allocator_view().memory_stats()
    }

    /// Bytes of this backend's allocator that its next matrix product may still take as a
    /// workspace: taken by the first product and kept for the backend's life (cuBLAS's, 32 MiB by
    /// default on CUDA), so 0 once taken, and 0 when products take none (the CPU's). An op that
    /// bounds what it allocates by a byte budget (`linear_cross_entropy`'s tiles) leaves this
    /// much of the budget to the workspace, so the bound holds on a backend whose first product
    /// it runs.
    fn matmul_workspace_bytes(&self) -> usize {
        0
    }

    /// Waits until the device has run everything queued on this backend, then returns the error
    /// of a check the device deferred, if one is pending. A backend whose primitives finish
    /// before they return (the CPU's) has nothing to wait for.
    fn synchronize(&self) -> Result<()>;

    /// Copies host bytes into `dst` starting `byte_offset` bytes in.
    fn write_host(&self, dst: &Buffer, byte_offset: usize, data: &[u8]) -> Result<()>;

    /// Copies bytes of `src` starting `byte_offset` bytes in to the host.
    fn read_host(&self, src: &Buffer, byte_offset: usize, out: &mut [u8]) -> Result<()>;

    /// `dst = src` elementwise, converting dtype; `dst` may be strided, shapes are equal.
    fn copy(&self, src: View<'_>, dst: View<'_>) -> Result<()>;

    /// Sets every element of `dst` (possibly strided) to `value` converted to its dtype.
    fn fill(&self, dst: View<'_>, value: f64) -> Result<()>;

    /// `out = op(x)`; shapes and dtypes are equal.
    fn unary(&self, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()>;

    /// `out = op(a, b)`; shapes and dtypes are equal.
    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()>;

    /// `out = op(x, mask)`; `mask` is Bool or U8 of the same shape.
    fn masked(&self, op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()>;

    /// Reduces the last `n_reduced` dims of `x` into dense `out`, whose shape is the leading
    /// dims of `x`.
    fn reduce(&self, op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()>;

    /// Max or min over the last dim of `x`, with the index (I64) of the first extreme element.
    fn reduce_with_index(&self, args: ReduceWithIndex<'_>) -> Result<()>;

    /// Batched matrix product over equal batch dims: `out[.., m, n] (+)= a[.., m, k] b[.., k, n]`.
    /// Inputs may be strided (transposes are free); `accumulate` adds to `out`. `out` has the
    /// inputs' dtype, or f32 for f16/bf16 inputs (the f32 accumulation, not rounded to them).
    fn matmul(&self, a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()>;

    /// `out = epilogue(input weightᵀ + bias)`: the forward of a linear layer, optionally followed
    /// by GELU (see [`LinearForward`]). The default body is [`compose_linear`].
    fn linear(&self, args: LinearForward<'_>) -> Result<()> {
        compose_linear(self, args)
    }

    /// A linear layer's weight gradient and, if asked, its bias gradient in one call (see
    /// [`LinearWeightGrad`]). The default body is [`compose_linear_weight_grad`].
    fn linear_weight_grad(&self, args: LinearWeightGrad<'_>) -> Result<()> {
        compose_linear_weight_grad(self, args)
    }

    /// An fp8 tensor's scales and codes from `x` in one call (see [`Float8Quantize`]). Answers
    /// `Ok(false)`, writing nothing, where the backend has no such kernel (the default): the op
    /// then composes reductions and casts, for tensorwise scales without a premultiplier, and
    /// refuses the others.
    fn quantize_float8(&self, args: Float8Quantize<'_>) -> Result<bool> {
        float8_quantize_dims(&args)?;
        Ok(false)
    }

    /// The product of two scaled fp8 operands (see [`Float8Matmul`]). Answers `Ok(false)`,
    /// writing nothing, where the backend has no fp8 GEMM (the default): the op then widens the
    /// codes to f32 and multiplies those.
    fn matmul_float8(&self, args: Float8Matmul<'_>) -> Result<bool> {
        float8_matmul_dims(&args)?;
        Ok(false)
    }

    /// Softmax (or log-softmax) of `x` along `dim` into dense `out`.
    fn softmax(&self, x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()>;

    /// Gradient of softmax (or log-softmax) from its output and output gradient (see
    /// [`SoftmaxBackward`]).
    fn softmax_backward(&self, args: SoftmaxBackward<'_>) -> Result<()>;

    /// Fused layer-norm forward.
    fn layer_norm(&self, args: LayerNormForward<'_>) -> Result<()>;

    /// Fused layer-norm backward.
    fn layer_norm_backward(&self, args: LayerNormBackward<'_>) -> Result<()>;

    /// Fused RMSNorm forward (see [`RmsNormForward`]).
    fn rms_norm(&self, args: RmsNormForward<'_>) -> Result<()>;

    /// Fused RMSNorm backward (see [`RmsNormBackward`]).
    fn rms_norm_backward(&self, args: RmsNormBackward<'_>) -> Result<()>;

    /// Fused SwiGLU forward, `silu(gate) · up` (see [`SwiGluForward`]).
    fn swiglu(&self, args: SwiGluForward<'_>) -> Result<()>;

    /// Fused SwiGLU backward, recomputing `silu(gate)` (see [`SwiGluBackward`]).
    fn swiglu_backward(&self, args: SwiGluBackward<'_>) -> Result<()>;

    /// Rotary embedding of `x` into `out`, or its transpose (see [`RotaryArgs`]).
    fn rotary_embedding(&self, args: RotaryArgs<'_>) -> Result<()>;

    /// Fused cross-entropy: writes the reduced loss (a 0-dim view) and each row's log-sum-exp
    /// (see [`CrossEntropyForward`]).
    fn cross_entropy(&self, args: CrossEntropyForward<'_>) -> Result<()>;

    /// Gradient of fused cross-entropy w.r.t. the logits, scaled by the 0-dim `dloss` (see
    /// [`CrossEntropyBackward`]).
    fn cross_entropy_backward(&self, args: CrossEntropyBackward<'_>) -> Result<()>;

    /// Folds one tile of logits (rows × a range of classes) into each row's running
    /// log-sum-exp statistics and picks the target's logit (see [`CrossEntropyTile`]).
    fn cross_entropy_tile(&self, args: CrossEntropyTile<'_>) -> Result<()>;

    /// Overwrites one tile of logits with their gradient (see [`CrossEntropyTileBackward`]).
    fn cross_entropy_tile_backward(&self, args: CrossEntropyTileBackward<'_>) -> Result<()>;

    /// `out[i][j] = x[i][index[i][j]]` along `dim` (PyTorch's `gather`); `index` is I64 with
    /// `out`'s shape (often expanded).
    fn gather(&self, x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()>;

    /// `dst[i][index[i][j]] += src[i][j]` along `dim` (PyTorch's `scatter_add_`).
    fn scatter_add(&self, dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()>;

    /// Fused scaled-dot-product attention: no `[queries, keys]` matrix reaches memory.
    fn attention(&self, args: AttentionForward<'_>) -> Result<()>;

    /// Gradients of fused attention, recomputing the probabilities from `lse`.
    fn attention_backward(&self, args: AttentionBackward<'_>) -> Result<()>;

    /// Dropout in one pass: element `i` is kept when [`DropoutDraw::keeps`] it (probability
    /// `1 - p`); `out = kept ? x * draw.scale() : 0` and `mask` (Bool) records which were kept.
    fn dropout(&self, x: View<'_>, draw: DropoutDraw, out: View<'_>, mask: View<'_>) -> Result<()>;

    /// Fills `dst` (a float tensor, possibly strided) with random values: its element `i` in
    /// row-major order is [`RandomDraw::value`]`(i)` rounded to the dtype. Parameters are
    /// initialised through it, on the device that holds them.
    fn random(&self, dst: View<'_>, draw: RandomDraw) -> Result<()>;
}
