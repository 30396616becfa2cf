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
//! A memory budget instead of a choice: [`BlockPlanner`] measures a training step under each
//! candidate strategy (keep, recompute, compress, offload) and [`StepProfile::plan`] picks one
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

mod blocks;
mod compress;
mod error;
mod offload;
mod planner;
mod policy;
mod region;

pub use blocks::{block_forwards, checkpoint_sequential, BlockSelection, CheckpointBlocks};
pub use compress::{
    compress, dequantize_int8_blockwise, quantize_int8_blockwise, CodecElement,
    CompressActivations, CompressBlocks, CompressFn, CompressOptions, CompressPolicy, Compression,
    DEFAULT_BLOCK, DEFAULT_MIN_ELEMENTS, INT8_BLOCK_RANGE, INT8_ERROR_BOUND, INT8_LEVELS,
};
pub use error::CheckpointError;
pub use offload::{offload, OffloadBlocks, OffloadOptions, OffloadPool, OffloadStats};
#[cfg(feature = "cuda")]
pub use planner::CudaClock;
pub use planner::{
    AllocatorGauge, BlockCost, BlockPlan, BlockPlanner, Candidate, HostClock, MemoryGauge, Moment,
    Prediction, RunDirectly, Segment, StepClock, StepError, StepProbe, StepProfile, TimePoint,
};
pub use policy::{Decision, PolicyFn, RecomputeAll, SaveMatmuls, SavePolicy};
pub use region::{checkpoint, checkpoint_with, CheckpointOptions, Region};
