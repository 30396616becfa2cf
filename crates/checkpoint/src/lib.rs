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
//! A memory budget instead of a choice: [`BlockPlanner`] measures a training step under each
//! candidate strategy (keep, recompute, ...) and [`StepProfile::plan`] picks one per block, the
//! fastest step whose predicted peak fits the budget, as a [`BlockPlan`] block runner that
//! explains itself in a table.
//!
//! This crate sits on autograd-core's seams (saved-tensor hooks, grad mode, the autocast scope,
//! draw recording) and nn's block seam. It knows no kernel and no device; the planner reads the
//! caching allocator's statistics, and, with the `cuda` feature, times blocks with ops-cuda's
//! events (`CudaClock`, `StepProbe::cuda`).

mod blocks;
mod error;
mod planner;
mod policy;
mod region;

pub use blocks::{block_forwards, checkpoint_sequential, BlockSelection, CheckpointBlocks};
pub use error::CheckpointError;
#[cfg(feature = "cuda")]
pub use planner::CudaClock;
pub use planner::{
    AllocatorGauge, BlockCost, BlockPlan, BlockPlanner, Candidate, HostClock, MemoryGauge, Moment,
    Prediction, RunDirectly, Segment, StepClock, StepError, StepProbe, StepProfile, TimePoint,
};
pub use policy::{Decision, PolicyFn, RecomputeAll, SaveMatmuls, SavePolicy};
pub use region::{checkpoint, checkpoint_with, CheckpointOptions, Region};
