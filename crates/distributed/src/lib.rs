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
//!
//! # Example
//!
//! ZeRO-2 on two ranks (threads): each holds AdamW's state for half of the parameter, and both
//! end where one process stepping on the mean gradient ends:
//!
//! ```
//! use std::sync::Arc;
//! use headroom_autograd_core::{DType, Tensor};
//! use headroom_distributed::{Communicator, InProcessGroup, ShardConfig, ShardedOptimizer};
//! use headroom_hooks::InBackwardConfig;
//! use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
//!
//! type Error = Box<dyn std::error::Error + Send + Sync>;
//! let inputs = [[1.0f32, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0]]; // one example per rank
//! let train_rank = |comm: headroom_distributed::InProcessComm| -> Result<_, Error> {
//!     let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//!     let w = Tensor::full(&cpu, &[4], 0.5, DType::F32)?;
//!     w.requires_grad_(true)?;
//!     let x = Tensor::from_slice(&cpu, &inputs[comm.rank()], &[4])?;
//!     let groups = vec![ParamGroup::new(vec![w.clone()], AdamConfig::adamw())];
//!     let config = ShardConfig { bucket_bytes: 1 << 20, clipping: None };
//!     let sharded = ShardedOptimizer::new(groups, Implementation::Fused, Arc::new(comm), config)?;
//!     let shard = sharded.shards()[0].numel();
//!     // Gradients are reduce-scattered inside backward, bucket by bucket, then freed.
//!     let in_backward = sharded.into_in_backward(InBackwardConfig::default())?;
//!     for _ in 0..3 {
//!         in_backward.backward(&w.mul(&x)?.sum_all()?)?;
//!     }
//!     Ok((w.to_vec::<f32>()?, shard))
//! };
//! let ranks = InProcessGroup::ranks(2)?;
//! let trained = std::thread::scope(|scope| {
//!     let threads: Vec<_> =
//!         ranks.into_iter().map(|comm| scope.spawn(move || train_rank(comm))).collect();
//!     threads.into_iter().map(|thread| thread.join().unwrap()).collect::<Result<Vec<_>, _>>()
//! })?;
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let w = Tensor::full(&cpu, &[4], 0.5, DType::F32)?;
//! w.requires_grad_(true)?;
//! let mean_input = Tensor::from_slice(&cpu, &[2.0f32; 4], &[4])?;
//! let groups = vec![ParamGroup::new(vec![w.clone()], AdamConfig::adamw())];
//! let mut adamw = Adam::new(groups, Implementation::Fused)?;
//! for _ in 0..3 {
//!     w.mul(&mean_input)?.sum_all()?.backward()?;
//!     adamw.step()?;
//!     adamw.zero_grad(true)?;
//! }
//! for (params, shard) in trained {
//!     assert_eq!((params, shard), (w.to_vec::<f32>()?, 2));
//! }
//! # Ok::<(), Error>(())
//! ```

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
