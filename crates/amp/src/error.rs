//! The crate's one error type.
//!
//! Optimizer and tensor failures arrive unchanged; the variants here are the misuses mixed
//! precision must refuse rather than half-do: unscaling twice in one step, stepping twice
//! without an update, an op name no policy knows, a model in the wrong dtype for an opt level.
//! This module knows nothing about how a scale is computed.

use headroom_autograd_core::{DType, TensorError};
use headroom_optim::OptimError;

/// Everything that can go wrong with mixed precision.
#[derive(Debug, thiserror::Error)]
pub enum AmpError {
    /// The wrapped optimizer failed.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// `unscale_` ran twice in one step.
    #[error(
        "unscale_() has already been called since the last update(): the gradients are unscaled \
         once per step (call step() and update() before unscaling again)"
    )]
    AlreadyUnscaled,
    /// `unscale_` ran after `step` in the same step.
    #[error(
        "unscale_() is being called after step(): the step used the gradients already (call \
         update() first, then unscale the next step's gradients)"
    )]
    UnscaleAfterStep,
    /// Gradients were unscaled or stepped before any loss was scaled.
    #[error(
        "the GradScaler has no scale yet: call scale(&loss) and backward on the scaled loss          before unscale_() or step()"
    )]
    NotScaled,
    /// `step` ran twice without an `update` between them.
    #[error("step() has already been called since the last update(): call update() first")]
    StepTwice,
    /// `update` ran without a `step` (or `unscale_`) that checked the gradients.
    #[error(
        "no inf checks were recorded prior to update(): call step() (or unscale_()) after \
         backward and before update()"
    )]
    UpdateWithoutCheck,
    /// A GradScaler setting is out of range.
    #[error("GradScaler: {reason}")]
    InvalidScalerConfig {
        /// What is wrong.
        reason: String,
    },
    /// An op name that no autocast policy is asked about.
    #[error(
        "no autocast op named `{op}`: the ops that consult autocast are listed in \
         headroom_autograd_core::AUTOCAST_OPS"
    )]
    UnknownOp {
        /// The name given.
        op: String,
    },
    /// A dtype that cannot be the autocast or half dtype.
    #[error("{what} must be F16 or BF16, got {dtype:?}")]
    NotHalf {
        /// What the dtype was given for.
        what: &'static str,
        /// The dtype given.
        dtype: DType,
    },
    /// A parameter whose dtype does not fit the opt level or decorator.
    #[error("parameter {index} is {got:?}, but {why}")]
    ParameterDType {
        /// Its position among the parameters.
        index: usize,
        /// Its dtype.
        got: DType,
        /// What was expected and how to get it.
        why: String,
    },
    /// A state dict that does not fit.
    #[error("state dict: {0}")]
    StateDict(String),
}

impl From<AmpError> for OptimError {
    /// An amp error through the `Optimizer` trait: wrapped as a technique's error
    /// ([`TensorError::Hook`]), from which `hook_source::<AmpError>()` gets it back.
    fn from(error: AmpError) -> OptimError {
        match error {
            AmpError::Optim(error) => error,
            other => OptimError::Tensor(TensorError::hook("amp", other)),
        }
    }
}

impl From<safetensors::SafeTensorError> for AmpError {
    fn from(error: safetensors::SafeTensorError) -> AmpError {
        AmpError::Optim(OptimError::SafeTensors(error))
    }
}
