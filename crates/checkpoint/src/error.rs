//! The crate's one error type.
//!
//! Tensor failures arrive as [`TensorError`] unchanged; the variants here are what checkpointing
//! itself refuses: a region that writes its own inputs in place, a recomputation that does not
//! save what the forward saved (so a gradient would be silently wrong), and random draws that
//! could not be replayed; and the planner's: a budget below the lowest reachable peak, a step it
//! cannot measure. This module knows nothing about how a region is run.

use headroom_autograd_core::{DType, TensorError};
use headroom_nn::NnError;

/// Everything that can go wrong when checkpointing a region.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A tensor op failed (in the region, or around it).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A model's block failed.
    #[error(transparent)]
    Nn(#[from] NnError),
    /// The region wrote one of its inputs in place: recomputing it in backward would start from
    /// other values than the forward did.
    #[error(
        "checkpoint: the region modified its input {input} in place; recomputing it in backward \
         would start from other values. Write into a copy inside the region instead"
    )]
    RegionWritesInput {
        /// The input's position among the region's inputs.
        input: usize,
    },
    /// An input of the region was modified in place after the forward, before backward needed it.
    #[error(
        "checkpoint: input {input} of a checkpointed region was modified in place after the \
         forward (version {saved} then, {current} now); keep it unchanged until backward"
    )]
    InputModified {
        /// The input's position.
        input: usize,
        /// Its version at the forward.
        saved: u64,
        /// Its version at backward.
        current: u64,
    },
    /// The recomputation saved a tensor unlike the forward's at the same position.
    #[error(
        "checkpoint: save {index} of the recomputed region is {got_op} {got_shape:?} {got_dtype:?}, \
         but the forward saved {op} {shape:?} {dtype:?} there; the region must compute the same \
         ops on recompute (no branching on values that change between forward and backward)"
    )]
    Nondeterministic {
        /// The save's number within the region.
        index: usize,
        /// The forward's op.
        op: &'static str,
        /// The forward's shape.
        shape: Vec<usize>,
        /// The forward's dtype.
        dtype: DType,
        /// The recompute's op.
        got_op: &'static str,
        /// The recompute's shape.
        got_shape: Vec<usize>,
        /// The recompute's dtype.
        got_dtype: DType,
    },
    /// The recomputation saved fewer tensors than backward needs.
    #[error(
        "checkpoint: the recomputed region saved {got} tensors, the forward {expected}; the \
         region must compute the same ops on recompute"
    )]
    SaveCount {
        /// Saves in the forward.
        expected: usize,
        /// Saves in the recomputation.
        got: usize,
    },
    /// The recomputation drew other random numbers than the forward (another draw size, or
    /// more draws), so dropout masks would differ.
    #[error(
        "checkpoint: the recomputed region drew other random numbers than the forward (dropout \
         masks would differ); the region must make the same draws on recompute"
    )]
    RandomDrawsDiffer,
    /// Offload was asked of tensors it cannot move: not on a CUDA device, or the crate was built
    /// without its `cuda` feature. Nothing was kept on the device in its place.
    #[error(
        "offload: {reason}; offload copies saved tensors to pinned host memory with CUDA copies: \
         run the model on a CudaBackend with headroom-checkpoint's `cuda` feature on, or use \
         checkpoint to save memory on this device"
    )]
    OffloadNeedsCuda {
        /// What is missing.
        reason: String,
    },
    /// No plan's predicted peak fits the budget.
    #[error(
        "planner: no plan fits in {budget} bytes; the lowest peak the candidates reach is \
         {minimum} bytes. Give a budget of at least {minimum} bytes, or a candidate that keeps \
         less (offload, compression)"
    )]
    BudgetTooSmall {
        /// The budget asked for.
        budget: u64,
        /// The lowest budget a plan meets.
        minimum: u64,
    },
    /// The planner could not measure the step it was given.
    #[error("planner: {reason}")]
    Profile {
        /// What went wrong, and what to do.
        reason: String,
    },
    /// The training step the planner measures failed.
    #[error("planner: the training step failed: {0}")]
    Step(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// An argument is out of range.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The call.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl CheckpointError {
    /// This error as a [`TensorError`], for the trip through the autograd engine.
    pub(crate) fn into_tensor_error(self) -> TensorError {
        match self {
            CheckpointError::Tensor(err) => err,
            CheckpointError::Nn(NnError::Tensor(err)) => err,
            other => TensorError::hook("checkpoint", other),
        }
    }

    /// This error as an [`NnError`], for a block runner's answer.
    pub(crate) fn into_nn_error(self) -> NnError {
        match self {
            CheckpointError::Nn(err) => err,
            CheckpointError::Tensor(err) => NnError::Tensor(err),
            other => NnError::Tensor(TensorError::hook("checkpoint", other)),
        }
    }

    /// The error a tensor error carries back from the engine: a checkpoint error it wrapped, or
    /// the tensor error itself.
    pub(crate) fn from_engine(err: TensorError) -> CheckpointError {
        match err {
            TensorError::Hook { op, source } => match source.downcast::<CheckpointError>() {
                Ok(inner) => *inner,
                Err(source) => CheckpointError::Tensor(TensorError::Hook { op, source }),
            },
            other => CheckpointError::Tensor(other),
        }
    }
}
