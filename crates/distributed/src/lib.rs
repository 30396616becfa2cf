//! Sharded data-parallel training for Headroom: ZeRO-1 and ZeRO-2 inside the in-backward
//! buckets, over a small communicator trait.
//!
//! One process (or, on the CPU, one thread) per rank trains the same model on its part of the
//! global batch. [`ShardedOptimizer`] wraps any element-wise optim rule so that each rank keeps
//! the optimizer state of its shard of every parameter only (`1 / world_size` of it):
//! - **ZeRO-1**: stepped after a plain backward, it reduce-scatters the gradients in buckets,
//!   updates its shards and all-gathers the parameters;
//! - **ZeRO-2**: handed to hooks' `InBackward` ([`ShardedOptimizer::into_in_backward`]), each
//!   bucket is reduce-scattered the moment its gradients are final and the full gradients are
//!   freed at once, so they never exist all together; gradient accumulation runs no-sync
//!   micro-steps;
//! - in both, exact global-norm clipping across ranks ([`ShardConfig::clipping`]).
//!
//! The bytes moved per step are one reduce-scatter and one all-gather of the parameters, as in
//! plain data parallelism's all-reduce; every [`Communicator`] counts them ([`CommStats`]).
//!
//! Communicators:
//! - [`InProcessGroup`]: `n` ranks on threads of one process, with exactly the collectives'
//!   semantics and a fixed reduction order (deterministic). The tests run the sharding on the CPU
//!   backend with it.
//! - `NcclComm` (feature `nccl`): NCCL through cudarc, loaded at run time, one rank per GPU.
//!
//! Starting ranks: `headroom-launch --nproc N -- PROGRAM ARGS` starts `N` processes on one host,
//! each with [`RankEnv`] in its environment and a file rendezvous for the group's id
//! (`crate::rendezvous` documents the multi-host path).
//!
//! # Crate features
//! - `nccl`: adds `NcclComm`, `nccl_unique_id`, `nccl_available` and `visible_gpus` (API only; results are the
//!   collectives' whichever communicator runs them). Builds without NCCL installed.
//! - no `cuda` feature: the GPU tests take ops-cuda with `cuda` as a dev-dependency and skip
//!   through testkit's gate without a device.
//!
//! It sits on autograd-core's tensors and backward callbacks, optim's `Optimizer` trait and
//! hooks' `InBackward`; it knows no kernel, and the device only through the communicator.

mod comm;
mod error;
mod in_process;
mod layout;
#[cfg(feature = "nccl")]
mod nccl;
mod rendezvous;
mod zero;

pub use comm::{Collective, CollectiveCount, CommStats, Communicator, ReduceOp};
pub use error::DistributedError;
pub use in_process::{InProcessComm, InProcessGroup, DEFAULT_TIMEOUT, MAX_RANKS};
pub use layout::{ParamShard, ShardLayout};
#[cfg(feature = "nccl")]
pub use nccl::{nccl_available, nccl_unique_id, visible_gpus, NcclComm};
pub use rendezvous::{
    FileRendezvous, RankEnv, UniqueId, DEFAULT_WAIT, ENV_LOCAL_RANK, ENV_RANK, ENV_RENDEZVOUS,
    ENV_WORLD_SIZE,
};
pub use zero::{ShardClipping, ShardConfig, ShardStats, ShardedHandle, ShardedOptimizer};
