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
//! This crate sits on autograd-core's seams (saved-tensor hooks, grad mode, the autocast scope,
//! draw recording) and nn's block seam. It knows no kernel; only offload reaches a device, through
//! ops-cuda.
//!
//! # Crate features
//!
//! - `cuda`: offload's implementation on ops-cuda's backend (without it, [`offload`] and
//!   [`OffloadBlocks`] return [`CheckpointError::OffloadNeedsCuda`]); it changes no result of
//!   checkpointing.

mod blocks;
mod error;
mod offload;
mod policy;
mod region;

pub use blocks::{block_forwards, checkpoint_sequential, BlockSelection, CheckpointBlocks};
pub use error::CheckpointError;
pub use offload::{offload, OffloadBlocks, OffloadOptions, OffloadPool, OffloadStats};
pub use policy::{Decision, PolicyFn, RecomputeAll, SaveMatmuls, SavePolicy};
pub use region::{checkpoint, checkpoint_with, CheckpointOptions, Region};
