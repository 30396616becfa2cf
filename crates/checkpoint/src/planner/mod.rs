//! A memory-budget planner: per block, the strategy that makes the fastest training step whose
//! peak fits a budget in bytes.
//!
//! The planner measures rather than estimates. [`BlockPlanner::profile`] runs the real training
//! step (forward, backward, optimizer step) once per [`Candidate`] strategy with every block
//! under it, and reads at each block's forward and backward the caching allocator's bytes, its
//! peak, and a clock (CUDA events on the GPU, the host clock on the CPU; [`StepProbe`]). The
//! [`StepProfile`] it returns predicts the peak and the time of any choice of a candidate per
//! block ([`StepProfile::predict`]): the base (parameters, optimizer state, inputs), the stem,
//! what each block keeps until its backward, the transient of its forward and of its backward
//! (a recomputation included), and the gradients as they accumulate. [`StepProfile::plan`] then
//! finds the fastest choice within a budget by a dynamic programme over the blocks (see
//! `search.rs` for why it is exact and monotone in the budget), of the exact candidates unless a
//! lossy one is needed or clearly faster ([`LossyReason`]), or says which budget is the
//! lowest reachable ([`CheckpointError::BudgetTooSmall`]). The [`BlockPlan`] is an nn block
//! runner; its `Display` is a table that explains it.
//!
//! Candidates are nn [`BlockRunner`](headroom_nn::BlockRunner)s with a name: `keep` calls the
//! block directly ([`RunDirectly`]), `keep-intermediates` too but inside autograd-core's
//! `keep_intermediates` ([`KeepIntermediates`]: what the fused ops would recompute from a kept
//! input, a norm's or an activation's output, is kept as well), `recompute` checkpoints it
//! ([`CheckpointBlocks`](crate::CheckpointBlocks)), `recompute-attention` checkpoints it keeping
//! its MLP's saves ([`RecomputeBefore::mlp`](crate::RecomputeBefore::mlp)), `compress-int8` / `compress-bf16` keep its
//! saves encoded ([`CompressBlocks`](crate::CompressBlocks)), `offload` keeps them in pinned
//! host memory ([`OffloadBlocks`](crate::OffloadBlocks), CUDA only, its device memory given back
//! at the end of the block's own forward). [`Candidate::defaults`] are the four exact ones;
//! [`Candidate::cuda_defaults`] adds 8-bit compression, fp8 linears and offload. Any other
//! runner that handles one block at a time is one more `Candidate::new(name, runner)`, measured
//! the same way, with no model of its own to write.
//!
//! This module sits on nn's block seam, autograd-core's hooks and the caching allocator's
//! statistics; it knows no model and, outside `probe.rs`'s CUDA clock, no device.

mod measure;
mod plan;
mod probe;
mod profile;
mod search;

pub use measure::{BlockPlanner, Candidate, KeepIntermediates, RunDirectly, StepError};
pub use plan::{BlockPlan, LossyReason};
#[cfg(feature = "cuda")]
pub use probe::CudaClock;
pub use probe::{AllocatorGauge, HostClock, MemoryGauge, StepClock, StepProbe, TimePoint};
pub use profile::{BlockCost, Moment, Prediction, Segment, StepProfile};
pub use search::LOSSY_MIN_GAIN;
