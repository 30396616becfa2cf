//! The crate's one error type.
//!
//! Every fallible call of the raw kernels and of the optimizers returns [`OptimError`]. Variants
//! name the call and carry the lengths, names or values involved. Errors of the tensor layer
//! (allocation, dtype) and of safetensors pass through unchanged.

use headroom_autograd_core::{DType, Device, TensorError};

/// Everything that can go wrong when stepping, saving or loading an optimizer.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// Buffers handed to a kernel do not have the lengths it needs.
    #[error("{op}: expected {expected} elements, got {got} ({detail})")]
    LengthMismatch {
        /// The kernel or call.
        op: &'static str,
        /// The length it needed.
        expected: usize,
        /// The length it got.
        got: usize,
        /// Which buffer, or more context.
        detail: String,
    },
    /// An argument or hyperparameter is out of range.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The call.
        op: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A tensor the optimizer must update cannot be updated (shared storage, a gradient of
    /// another shape, a device this build cannot reach).
    #[error("{op}: unsupported tensor: {reason}")]
    UnsupportedTensor {
        /// The call.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// A parameter, gradient or scale tensor is not on the optimizer's device (or, on CUDA, not
    /// of its backend).
    #[error("{op}: a tensor on {got:?} among tensors on {expected:?}")]
    MixedDevices {
        /// The call.
        op: &'static str,
        /// The optimizer's device (its first parameter's).
        expected: Device,
        /// The tensor's device.
        got: Device,
    },
    /// A tensor has a dtype the kernels do not take.
    #[error("{op}: dtype {got:?}, expected {expected:?}")]
    DType {
        /// The call.
        op: &'static str,
        /// The dtype needed.
        expected: DType,
        /// The tensor's.
        got: DType,
    },
    /// A tensor is a non-contiguous view; the kernels update contiguous memory in place.
    #[error("{op}: non-contiguous tensor (shape {shape:?}, strides {strides:?})")]
    NonContiguous {
        /// The call.
        op: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// Its strides.
        strides: Vec<usize>,
    },
    /// The optimizer has no such implementation, or the implementation cannot do what was asked
    /// (a gradient scale for a non-fused update, for example).
    #[error("{optimizer}: {reason}")]
    Unsupported {
        /// The optimizer's name.
        optimizer: &'static str,
        /// What is not supported.
        reason: String,
    },
    /// A tensor that is in none of the optimizer's groups, or a [`ParamId`](crate::ParamId)
    /// the optimizer has not given out.
    #[error("{optimizer}: not a parameter of this optimizer")]
    UnknownParameter {
        /// The optimizer's name.
        optimizer: &'static str,
    },
    /// `clip_grad_norm_` with `error_if_nonfinite`: the gradients' total norm is NaN or
    /// infinite; no gradient was changed.
    #[error(
        "clip_grad_norm_: the total norm of order {norm_type:?} of the gradients is non-finite \
         ({total}); no gradient was changed"
    )]
    NonFiniteNorm {
        /// The norm asked for.
        norm_type: crate::clip::norm::NormType,
        /// The total norm.
        total: f32,
    },
    /// A state dict does not fit this optimizer (missing or malformed entries).
    #[error("state dict: {0}")]
    StateDict(String),
    /// A tensor operation or allocation failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The safetensors encoding failed.
    #[error("safetensors: {0}")]
    SafeTensors(#[from] safetensors::SafeTensorError),
}
