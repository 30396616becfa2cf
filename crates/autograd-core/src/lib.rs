//! Tensors, a define-by-run autograd engine with first-class hooks, and the backend trait that
//! device crates implement.
//!
//! A [`Tensor`] is a [`Layout`] (shape, strides, offset) and a run-time [`DType`] over a shared
//! [`Buffer`], which owns one allocation from its backend's caching allocator — so
//! `memory_allocated()` counts every tensor, saved activation and gradient exactly. Views
//! (reshape, permute, transpose, narrow, expand) share the buffer and its version counter.
//!
//! Ops (`crate::ops`) are written once over the [`Backend`] trait (see its module docs for the
//! method count and why it is that small) and record a graph node when an input requires grad.
//! [`Tensor::backward`] runs the graph in reverse creation order, freeing each node's saved
//! tensors and each consumed gradient as it goes, and accumulates into leaves' `.grad`.
//! In-place ops bump per-storage version counters, and a saved tensor that was overwritten is a
//! [`TensorError::ModifiedInPlace`] naming the op.
//!
//! # Seams for the technique crates
//!
//! Memory techniques (amp, checkpoint, hooks) are wrappers over these seams, never forks of the
//! engine:
//! - gradient hooks ([`Tensor::register_hook`]) and post-accumulate-grad hooks
//!   ([`Tensor::register_post_accumulate_grad_hook`]): an optimizer steps a parameter the moment
//!   its gradient is final;
//! - saved-tensor hooks ([`saved_tensor_hooks`]): `pack` sees a [`SaveSite`] (op, role, shape,
//!   dtype, bytes, and its number among this backward's saves) and decides what a saved
//!   activation becomes — kept, offloaded, compressed, or dropped and recomputed; an unpack may
//!   recompute with grad mode on;
//! - an autocast scope ([`autocast`]): thread-local and nestable; the ops in [`AUTOCAST_OPS`] ask
//!   an [`AutocastPolicy`] which dtype their inputs take, and a parameter is cast once per scope;
//! - backward-end callbacks ([`queue_backward_end_callback`] for the pass running now,
//!   [`on_backward_end`] for every pass on a thread);
//! - a non-finite check over many tensors that leaves `found_inf` on the device
//!   ([`non_finite_check_`]), with no host synchronisation.
//!
//! This crate sits on `headroom-caching-allocator` only. It knows no device API and no kernel:
//! ops-cpu and ops-cuda implement [`Backend`]; models, optimizers and techniques sit on top.
//!
//! Not supported: higher-order gradients (`create_graph`), differentiable in-place writes into
//! views, `retain_grad` on non-leaves.
//!
//! # Example
//!
//! On the CPU backend (`headroom-ops-cpu`): two of the seams, a saved-tensor hook that sees what
//! each op keeps for backward and a post-accumulate-grad hook that sees each final gradient.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use headroom_autograd_core::{saved_tensor_hooks, Packed, SaveRole, Tensor};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let w = Tensor::from_slice(&cpu, &[1.0f32, -2.0, 3.0], &[3])?;
//! w.requires_grad_(true)?;
//! let x = Tensor::from_slice(&cpu, &[0.5f32, 0.25, 2.0], &[3])?;
//!
//! let saves = Arc::new(Mutex::new(Vec::new()));
//! let loss = {
//!     let saves = Arc::clone(&saves);
//!     let _hooks = saved_tensor_hooks(
//!         move |site, tensor| {
//!             saves.lock().unwrap().push((site.op, site.role, site.bytes));
//!             Ok(Box::new(tensor) as Packed) // kept as it is
//!         },
//!         |packed| Ok(packed.downcast_ref::<Tensor>().unwrap().clone()),
//!     );
//!     w.mul(&x)?.sum_all()? // Σ w·x
//! };
//! // `mul` keeps the input its gradient needs: x (3 × f32), for w's gradient.
//! assert_eq!(*saves.lock().unwrap(), [("mul", SaveRole::Input(1), 12)]);
//!
//! let grads = Arc::new(Mutex::new(Vec::new()));
//! let seen = Arc::clone(&grads);
//! let _hook = w.register_post_accumulate_grad_hook(move |param| {
//!     seen.lock().unwrap().push(param.grad().unwrap().to_vec::<f32>()?);
//!     Ok(())
//! })?;
//! loss.backward()?;
//! assert_eq!(*grads.lock().unwrap(), [vec![0.5, 0.25, 2.0]]);
//! # Ok::<(), headroom_autograd_core::TensorError>(())
//! ```

mod autocast;
mod backend;
mod buffer;
mod dtype;
mod engine;
mod error;
mod grad_mode;
mod graph;
mod hooks;
mod intermediates;
mod layout;
mod non_finite;
mod ops;
mod overlap;
mod random;
mod rebuild;
mod saved;
mod tensor;

pub use autocast::{
    autocast, autocast_disabled, autocast_policy, autocast_stats, AutocastGuard, AutocastPolicy,
    AutocastStats, CastPolicy, AUTOCAST_OPS,
};
pub use backend::{
    attention_dims, check_cu_seqlens, compose_linear, compose_linear_weight_grad, index_strides,
    linear_dims, linear_weight_grad_dims, matmul_dims, AttentionBackward, AttentionDims,
    AttentionForward, Backend, BackendRef, BinaryOp, CrossEntropyArgs, DropoutDraw,
    LayerNormBackward, LayerNormForward, LinearEpilogue, LinearForward, LinearWeightGrad, MaskedOp,
    Operands, PackedBounds, ReduceOp, ReduceWithIndex, Reduction, SoftmaxBackward, UnaryOp, View,
};
pub use backend::{
    cross_entropy_tile_dims, CrossEntropyBackward, CrossEntropyForward, CrossEntropyTile,
    CrossEntropyTileBackward, LogitTile,
};
pub use backend::{
    float8_matmul_dims, float8_quantize_dims, Float8Granularity, Float8Matmul, Float8Quantize,
};
pub use backend::{
    GateUp, RmsNormBackward, RmsNormForward, RotaryArgs, RotaryDims, SwiGluBackward, SwiGluForward,
};
pub use buffer::{Access, Buffer, HostAccess, VersionCounter};
pub use dtype::{DType, Device};
pub use engine::{run_backward, BackwardOptions};
pub use error::{Result, TensorError};
pub use grad_mode::{is_grad_enabled, no_grad, set_grad_enabled, GradModeGuard};
pub use graph::needs_grad;
pub use hooks::{
    backward_pass_id, is_backward_running, on_backward_end, queue_backward_end_callback,
    BackwardEndCallback, BackwardEndHook, GradHook, HookHandle, PostAccumulateHook,
};
pub use intermediates::{are_intermediates_kept, keep_intermediates, KeepIntermediatesGuard};
pub use layout::{
    broadcast_shapes, checked_numel, contiguous_strides, normalize_dim, Dims, Layout,
};
pub use non_finite::{found_non_finite, non_finite_check_};
pub use ops::{
    cat, cross_entropy, cross_entropy_f32, dropout, embedding, layer_norm, layer_norm_linear,
    linear_cross_entropy, patch_embedding, scaled_dot_product_attention,
    scaled_dot_product_attention_dropout, scaled_dot_product_attention_varlen,
    scaled_dot_product_attention_varlen_dropout, LinearCrossEntropyOptions, PackedSequences,
};
pub use ops::{
    rms_norm, rotary_embedding, swiglu, Float8History, Float8Linear, Float8Recipe, Float8Role,
    Float8Tensor,
};
pub use overlap::{check_operands, claim_operands, overlap, Aliasing, Overlap};
pub use random::{
    record_draws, replay_draws, uniform, Distribution, DrawRecording, DrawReplay, Generator,
    GeneratorState, RandomDraw, RecordedDraws,
};
pub use saved::{
    saved_tensor_hooks, PackHook, Packed, SaveRole, SaveSite, SavedTensor, SavedTensorHooks,
    SavedTensorHooksGuard, UnpackHook,
};
pub use tensor::{Element, Tensor};
