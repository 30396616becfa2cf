//! The crate's one error type.
//!
//! Tensor-level failures (shapes, dtypes, allocation) arrive as [`TensorError`] unchanged; the
//! variants added here are about parameters by name — a weight file that lacks one, has one too
//! many, or has one of the wrong shape says which — and about configurations that cannot build a
//! model. This module knows nothing about any particular model.

use headroom_autograd_core::TensorError;

/// Everything that can go wrong when building, running, loading or saving a module.
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// A tensor op failed (shape, dtype, device, allocation, autograd misuse).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The weights lack a parameter the module has.
    #[error("missing parameter `{name}` in the weights")]
    MissingParameter {
        /// The parameter's name (without the file's prefix).
        name: String,
    },
    /// The weights hold a tensor the module has no parameter for.
    #[error(
        "unexpected parameter `{name}` in the weights: the module has no parameter of that name"
    )]
    UnexpectedParameter {
        /// The tensor's name (without the file's prefix).
        name: String,
    },
    /// A tensor in the weights has another shape than the module's parameter.
    #[error(
        "parameter `{name}` has shape {expected:?} in the module but {found:?} in the weights"
    )]
    ParameterShape {
        /// The parameter's name.
        name: String,
        /// The module's shape.
        expected: Vec<usize>,
        /// The shape in the weights.
        found: Vec<usize>,
    },
    /// A tensor in the weights has an element type this crate does not read.
    #[error("tensor `{name}` has dtype {dtype}, which is not supported")]
    UnsupportedDtype {
        /// The tensor's name.
        name: String,
        /// The safetensors dtype, as text.
        dtype: String,
    },
    /// The safetensors data is malformed.
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// Reading or writing a weight file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A configuration that cannot build the model (heads that do not divide the width, ...).
    #[error("invalid configuration: {reason}")]
    InvalidConfig {
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A module was called with an input of the wrong shape or dtype.
    #[error("{module}: {reason}")]
    InvalidInput {
        /// The module that was called.
        module: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
}

/// Shorthand for this crate's results.
pub type Result<T, E = NnError> = std::result::Result<T, E>;
