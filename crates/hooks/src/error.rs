//! The crate's one error type.
//!
//! Optimizer and tensor failures arrive unchanged; the variants here are the misuses an
//! optimizer-in-backward must refuse rather than half-do: a parameter registered twice, one
//! that does not require grad, a plain `backward()` where the configuration needs two passes,
//! stepping the wrapped optimizer by hand. This module knows nothing about how updates run.

use headroom_autograd_core::TensorError;
use headroom_optim::OptimError;

/// Everything that can go wrong with an optimizer in backward.
#[derive(Debug, thiserror::Error)]
pub enum HooksError {
    /// The wrapped optimizer failed (a bad dtype, mixed devices, an unsupported scaling, ...).
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A parameter is already stepped in backward by another `InBackward`.
    #[error(
        "parameter {index} of the optimizer is already stepped in backward by another \
         InBackward; a parameter can have one optimizer in backward (drop the other first)"
    )]
    AlreadyRegistered {
        /// Its position among the optimizer's parameters.
        index: usize,
    },
    /// A parameter does not require grad, so no gradient would ever reach its hook.
    #[error(
        "parameter {index} of the optimizer does not require grad: it would never be updated \
         in backward (call requires_grad_(true) on it, or leave it out of the optimizer)"
    )]
    DoesNotRequireGrad {
        /// Its position among the optimizer's parameters.
        index: usize,
    },
    /// The configuration needs `InBackward::backward` (two passes), but a plain backward ran.
    #[error(
        "this optimizer in backward clips exactly or unscales an fp16 loss, which needs the norm \
         or the overflow flag before any update: run backward through InBackward::backward(&loss) \
         instead of loss.backward()"
    )]
    NeedsTwoPasses,
    /// The wrapped optimizer was asked to step outside backward.
    #[error(
        "the optimizer steps inside backward; stepping it by hand would update parameters twice \
         (call InBackward::backward, or drop the InBackward to step by hand)"
    )]
    StepOutsideBackward,
    /// An argument is out of range.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The call.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl HooksError {
    /// The error a tensor error carries back from the engine: a hooks error it wrapped, or the
    /// tensor error itself.
    pub(crate) fn from_engine(err: TensorError) -> HooksError {
        match err {
            TensorError::Hook { op, source } => match source.downcast::<HooksError>() {
                Ok(inner) => *inner,
                Err(source) => match source.downcast::<OptimError>() {
                    Ok(inner) => HooksError::Optim(*inner),
                    Err(source) => HooksError::Tensor(TensorError::Hook { op, source }),
                },
            },
            other => HooksError::Tensor(other),
        }
    }
}
