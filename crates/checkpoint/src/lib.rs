//! Activation checkpointing for Headroom: keep less of the forward, recompute it in backward.
//!
//! [`checkpoint`] runs a region (any closure from tensors to tensors) and keeps only its inputs;
//! when backward needs what the region's ops saved, the region runs again. It is PyTorch's
//! non-reentrant checkpoint without its pitfalls:
//! - inputs need not require grad (the reentrant form's "element 0 of tensors does not require
//!   grad");
//! - random draws are replayed, so dropout masks on recompute equal the forward's (and the
//!   generators end where the forward left them);
//! - a region that writes its inputs in place, a recomputation that saves other tensors than the
//!   forward, and a recomputation with other random draws are typed [`CheckpointError`]s, never
//!   silently wrong gradients;
//! - regions nest, and a recomputation stops as soon as what backward still needs is rebuilt.
//!
//! Selective checkpointing decides per saved tensor, from the [`SaveSite`](headroom_autograd_core::SaveSite)
//! autograd-core gives each save: a [`SavePolicy`] answers keep or recompute ([`RecomputeAll`],
//! [`SaveMatmuls`], or a closure in [`PolicyFn`]). A model's blocks are checkpointed without
//! editing the model by setting a [`CheckpointBlocks`] as its nn block runner;
//! [`checkpoint_sequential`] cuts a chain of blocks into segments.
//!
//! [`offload`] and [`OffloadBlocks`] keep what a region or a model's selected blocks save, but in
//! pinned host memory: copied on a side stream while the forward goes on, given back to the device
//! ahead of backward (prefetch), with no host synchronisation; an [`OffloadPool`] holds the pinned
//! memory, allocated by the first step and reused by the next. It needs a CUDA device.
//!
//! [`compress`] keeps what a region saves in 8 bits (blockwise absmax quantisation) or bf16 and
//! restores it when backward needs it; [`CompressBlocks`] does so per model block, alone or around
//! a checkpoint.
//!
//! [`Float8Blocks`] runs the selected blocks with every plain linear in fp8 (each saving its
//! input in one byte an element), a lossy strategy of its own.
//!
//! A memory budget instead of a choice: [`BlockPlanner`] measures a training step under each
//! candidate strategy (keep, recompute, compress, fp8, offload) and [`StepProfile::plan`] picks one
//! per block, the fastest step whose predicted peak fits the budget, as a [`BlockPlan`] block
//! runner that explains itself in a table.
//!
//! This crate sits on autograd-core's seams (saved-tensor hooks, grad mode, the autocast scope,
//! draw recording) and nn's block seam. Checkpointing knows no device; offload reaches one through
//! ops-cuda, and compression knows one kernel pair, its 8-bit codec: on host memory for CPU
//! tensors, and in `kernels/compress.cu` (committed PTX, launched through ops-cuda) for CUDA
//! tensors. The planner reads the caching allocator's statistics and, with the `cuda` feature,
//! times blocks with ops-cuda's events (`CudaClock`, `StepProbe::cuda`).
//!
//! # Crate features
//!
//! - `cuda`: offload's implementation on ops-cuda's backend (without it, [`offload`] and
//!   [`OffloadBlocks`] return [`CheckpointError::OffloadNeedsCuda`]) and 8-bit compression of CUDA
//!   tensors (without it, such a save is a typed error; bf16 needs no kernel of its own). It
//!   changes no result of checkpointing, and both codecs give the same bits. It also adds the
//!   planner's CUDA clock.
//!
//! # Example
//!
//! A region keeps only its output, and backward recomputes it for the same gradient; a model's
//! blocks are checkpointed by attaching a runner:
//!
//! ```
//! use std::sync::Arc;
//! use headroom_autograd_core::{DType, Generator, Tensor};
//! use headroom_checkpoint::{checkpoint, CheckpointBlocks};
//! use headroom_nn::{BlockStack, Module, VisionTransformer, VitConfig};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let allocated = || cpu.memory_stats().allocated_bytes.all.current;
//!
//! // Eight `exp`s: run plainly, each keeps its output (4 KiB) for backward.
//! let region = |x: &Tensor| -> headroom_autograd_core::Result<Tensor> {
//!     let mut y = x.clone();
//!     for _ in 0..8 {
//!         y = y.exp()?.mul_scalar(0.5)?;
//!     }
//!     Ok(y)
//! };
//! let x = Tensor::full(&cpu, &[1024], 0.01, DType::F32)?;
//! x.requires_grad_(true)?;
//! let before = allocated();
//! let plain = region(&x)?;
//! assert_eq!(allocated() - before, 8 * 4096 + 4096);
//! plain.sum_all()?.backward()?;
//! let expected = x.take_grad().unwrap().to_vec::<f32>()?;
//! drop(plain);
//!
//! // Checkpointed: only the output stays until backward runs the region again.
//! let before = allocated();
//! let out = checkpoint(move |inputs| Ok(vec![region(&inputs[0])?]), &[x.clone()])?;
//! assert_eq!(allocated() - before, 4096);
//! out[0].sum_all()?.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, expected);
//!
//! // A model's blocks, the model unedited: every block but the last is checkpointed, and the
//! // gradients equal the plain model's bit for bit.
//! let vit = || {
//!     let generator = Arc::new(Generator::new(0)); // the same weights each time
//!     VisionTransformer::new(&cpu, VitConfig::tiny(), DType::F32, &generator)
//! };
//! let (plain, mut checkpointed) = (vit()?, vit()?);
//! let runner = CheckpointBlocks::all_but_last(checkpointed.n_blocks());
//! checkpointed.set_block_runner(Some(Arc::new(runner)));
//! let images = Tensor::ones(&cpu, &[2, 3, 32, 32], DType::F32)?;
//! plain.forward(&images)?.sum_all()?.backward()?;
//! checkpointed.forward(&images)?.sum_all()?.backward()?;
//! let grads = |model: &VisionTransformer| -> Result<Vec<Vec<f32>>, _> {
//!     model.parameters().iter().map(|p| p.grad().unwrap().to_vec::<f32>()).collect()
//! };
//! assert_eq!(grads(&plain)?, grads(&checkpointed)?);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod blocks;
mod compress;
mod error;
mod float8_blocks;
mod offload;
mod planner;
mod policy;
mod region;

pub use blocks::{
    block_forwards, checkpoint_sequential, BlockSelection, CheckpointBlocks, SplitBlocks,
};
pub use compress::{
    compress, dequantize_int8_blockwise, quantize_int8_blockwise, CodecElement,
    CompressActivations, CompressBlocks, CompressFn, CompressOptions, CompressPolicy, Compression,
    DEFAULT_BLOCK, DEFAULT_MIN_ELEMENTS, INT8_BLOCK_RANGE, INT8_ERROR_BOUND, INT8_LEVELS,
};
#[cfg(feature = "cuda")]
pub use compress::{dequantize_int8_device, quantize_int8_device};
pub use error::CheckpointError;
pub use float8_blocks::Float8Blocks;
pub use offload::{offload, OffloadBlocks, OffloadOptions, OffloadPool, OffloadStats};
#[cfg(feature = "cuda")]
pub use planner::CudaClock;
pub use planner::{
    AllocatorGauge, BlockCost, BlockPlan, BlockPlanner, Candidate, HostClock, KeepIntermediates,
    LossyReason, MemoryGauge, Moment, Prediction, RunDirectly, Segment, StepClock, StepError,
    StepProbe, StepProfile, TimePoint, LOSSY_MIN_GAIN,
};
pub use policy::{Decision, PolicyFn, RecomputeAll, RecomputeBefore, SaveMatmuls, SavePolicy};
pub use region::{checkpoint, checkpoint_with, CheckpointOptions, Region};
