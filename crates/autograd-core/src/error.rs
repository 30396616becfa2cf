//! The crate's one error type, shared by every backend.
//!
//! Every fallible call of autograd-core, and every primitive a backend implements, returns
//! [`TensorError`]. Variants name the op and carry the shapes, dtypes or devices involved, so a
//! message says what went wrong where without a debugger. This module knows nothing about
//! kernels or the graph.

use headroom_caching_allocator::AllocError;

use crate::dtype::{DType, Device};

/// Everything that can go wrong when building or differentiating tensors.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// Operand shapes do not fit together (broadcasting, matmul, cat, ...).
    #[error("{op}: shape mismatch between {lhs:?} and {rhs:?}")]
    ShapeMismatch {
        /// The op that was called.
        op: &'static str,
        /// The first shape involved.
        lhs: Vec<usize>,
        /// The second shape involved.
        rhs: Vec<usize>,
    },
    /// Operands have different dtypes where the op needs one.
    #[error("{op}: dtype mismatch between {lhs:?} and {rhs:?}")]
    DtypeMismatch {
        /// The op that was called.
        op: &'static str,
        /// The first dtype.
        lhs: DType,
        /// The second dtype.
        rhs: DType,
    },
    /// The op does not exist for this dtype (on this backend, or at all).
    #[error("{op}: dtype {dtype:?} is not supported")]
    UnsupportedDtype {
        /// The op that was called.
        op: &'static str,
        /// The dtype it was called with.
        dtype: DType,
    },
    /// Operands live on different devices.
    #[error("{op}: device mismatch between {lhs:?} and {rhs:?}")]
    DeviceMismatch {
        /// The op that was called.
        op: &'static str,
        /// The first device.
        lhs: Device,
        /// The second device.
        rhs: Device,
    },
    /// An argument is out of range or malformed (a dim, a size, a probability, ...).
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The op that was called.
        op: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A size, extent or byte count computed from the arguments does not fit in `usize` (or in
    /// what a device can address): the tensor is too large to exist.
    #[error("{op}: {reason}; the tensor is too large")]
    SizeOverflow {
        /// The op that was called.
        op: &'static str,
        /// The sizes involved.
        reason: String,
    },
    /// A write whose output reaches one element twice (an expanded, stride-0 or `as_strided`
    /// view), or whose output shares memory with an input other than as the very same view
    /// (PyTorch's "unsupported operation: some elements of the input tensor and the written-to
    /// tensor refer to a single memory location").
    #[error("{op}: {reason}; clone() the tensor (or write into a contiguous copy) first")]
    Overlap {
        /// The op that was called.
        op: &'static str,
        /// Which operands overlap and how.
        reason: String,
    },
    /// Another thread is using this storage on the host in a way that excludes this call: a
    /// write needs the storage alone, a read needs no writer. Tensors are `Send + Sync`, but two
    /// threads may not write (or write and read) one CPU storage at the same time.
    #[error(
        "{op}: another thread is using the storage of {what} (a host write needs it alone, a \
         read needs no writer); order the threads that share these tensors"
    )]
    ConcurrentAccess {
        /// The op that was called.
        op: &'static str,
        /// The operand that was busy.
        what: &'static str,
    },
    /// The device failed, or the backend cannot run this op on it (yet).
    #[error("{op} on the device: {reason}")]
    Device {
        /// The op that was called.
        op: &'static str,
        /// What the device or backend reported.
        reason: String,
    },
    /// A tensor saved for backward was modified in place after it was saved.
    #[error(
        "{op}: a tensor saved for backward was modified by an in-place operation \
         (saved at version {saved_version}, now at version {current_version})"
    )]
    ModifiedInPlace {
        /// The op whose backward needed the tensor.
        op: &'static str,
        /// The storage's version when the tensor was saved.
        saved_version: u64,
        /// The storage's version at backward time.
        current_version: u64,
    },
    /// The graph's saved tensors were already released by an earlier backward.
    #[error(
        "{op}: trying to backward through the graph a second time; its saved tensors were \
         freed (pass retain_graph to the first backward)"
    )]
    GraphFreed {
        /// The op whose backward was asked for twice.
        op: &'static str,
    },
    /// A use of autograd that is not allowed (in-place on a leaf that requires grad, backward
    /// from a tensor that does not require grad, out= with grad, ...).
    #[error("{op}: {reason}")]
    Autograd {
        /// The op or call involved.
        op: &'static str,
        /// Why it is not allowed.
        reason: String,
    },
    /// The allocator could not serve a tensor's storage.
    #[error("allocation failed: {0}")]
    Alloc(#[from] AllocError),
    /// An error of code the engine called — a hook, a backward-end callback, a region being
    /// recomputed — carried through unchanged: `source` is that code's own error, which it can
    /// get back by downcasting.
    #[error("{op}: {source}")]
    Hook {
        /// The hook or technique that failed.
        op: &'static str,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl TensorError {
    /// Wraps another crate's error for the trip through the engine (see [`TensorError::Hook`]).
    pub fn hook(op: &'static str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        TensorError::Hook {
            op,
            source: Box::new(source),
        }
    }

    /// The wrapped error of a [`TensorError::Hook`], if it is an `E`.
    pub fn hook_source<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            TensorError::Hook { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }
}

/// Shorthand used throughout the crate and by backends.
pub type Result<T, E = TensorError> = std::result::Result<T, E>;
