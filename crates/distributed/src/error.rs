//! The crate's one error type.
//!
//! Tensor, optimizer and in-backward failures arrive unchanged; the variants here are what data
//! parallelism adds: ranks that disagree about a collective, a rank that never arrives, NCCL
//! missing or failing, a rendezvous that cannot be read, and the misuses a sharded optimizer must
//! refuse rather than half-do. This module knows nothing about how collectives run.

use headroom_autograd_core::TensorError;
use headroom_hooks::HooksError;
use headroom_optim::OptimError;

/// Everything that can go wrong in data-parallel training.
#[derive(Debug, thiserror::Error)]
pub enum DistributedError {
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The wrapped optimizer failed.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The optimizer in backward failed.
    #[error(transparent)]
    Hooks(#[from] HooksError),
    /// The ranks called different collectives, or the same one with different sizes or dtypes.
    /// NCCL would hang here; the in-process communicator names the difference.
    #[error(
        "collective {call} of the group: rank {rank} called {got}, rank 0 called {expected}; every \
         rank must run the same collectives in the same order with the same sizes (same model, \
         same bucket size, same graph on every rank)"
    )]
    Mismatch {
        /// How many collectives the group had completed before this one.
        call: u64,
        /// The rank that differs from rank 0.
        rank: usize,
        /// What rank 0 called.
        expected: String,
        /// What `rank` called.
        got: String,
    },
    /// A rank did not reach a collective in time (it failed, or never called it).
    #[error(
        "rank {rank} waited {seconds} s for the other ranks at collective {call}; a rank failed or \
         runs another program (see the other ranks' errors)"
    )]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The collective's number in the group.
        call: u64,
        /// How long it waited.
        seconds: u64,
    },
    /// NCCL failed, or is not available in this build or on this machine.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// Reading or writing the rendezvous, or starting a rank, failed.
    #[error("{what} {path}: {reason}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or program.
        path: String,
        /// The operating system's error, or what was wrong with the contents.
        reason: String,
    },
    /// An argument is out of range, or a call does not fit the configuration.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The call.
        op: &'static str,
        /// What is wrong, and what to do.
        reason: String,
    },
}

impl DistributedError {
    /// The error an `Optimizer` call carries back: a distributed error it wrapped (through a
    /// [`TensorError::Hook`], the one way an `OptimError` carries a foreign error), or the
    /// optimizer error itself.
    pub(crate) fn from_optim(err: OptimError) -> DistributedError {
        match err {
            OptimError::Tensor(TensorError::Hook { op, source }) => {
                match source.downcast::<DistributedError>() {
                    Ok(inner) => *inner,
                    Err(source) => DistributedError::Optim(OptimError::Tensor(TensorError::Hook {
                        op,
                        source,
                    })),
                }
            }
            other => DistributedError::Optim(other),
        }
    }

    /// The error a backward pass carries back through the in-backward hooks.
    pub(crate) fn from_hooks(err: HooksError) -> DistributedError {
        match err {
            HooksError::Optim(err) => DistributedError::from_optim(err),
            HooksError::Tensor(TensorError::Hook { op, source }) => {
                match source.downcast::<DistributedError>() {
                    Ok(inner) => *inner,
                    Err(source) => DistributedError::Tensor(TensorError::Hook { op, source }),
                }
            }
            other => DistributedError::Hooks(other),
        }
    }

    /// This error as an optimizer error (what `Optimizer::step_with` returns).
    pub(crate) fn into_optim(self) -> OptimError {
        match self {
            DistributedError::Optim(err) => err,
            other => OptimError::Tensor(TensorError::hook("ShardedOptimizer", other)),
        }
    }
}
