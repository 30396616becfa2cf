//! Why the CUDA backend could not be created or could not run a kernel, and how a driver failure
//! becomes autograd-core's error (`device_error`, with the `cuda` feature).
//!
//! This module is the bottom of the ground floor: it imports nothing of this crate, so every
//! other module, the BLAS state included, may name its errors.

/// The crate's error type (ops report failures as autograd-core's `TensorError::Device`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// This build has no CUDA support.
    #[error("headroom-ops-cuda was built without the `cuda` feature")]
    NotCompiled,
    /// No usable device: no driver, no GPU, or a bad ordinal.
    #[error("no CUDA device {ordinal}: {reason}")]
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// What the driver said.
        reason: String,
    },
    /// The allocator settings (`HEADROOM_ALLOC_CONF`) are malformed: a configuration error to
    /// fix, not a missing device (no fallback should hide it).
    #[error("invalid allocator settings: {reason}")]
    Config {
        /// What the settings parser said, naming the key.
        reason: String,
    },
    /// Loading the embedded PTX or one of its kernels failed.
    #[error("loading kernel `{kernel}`: {reason}")]
    Kernel {
        /// The kernel's name.
        kernel: String,
        /// What the driver said.
        reason: String,
    },
}

/// A driver error as the core's error type.
#[cfg(feature = "cuda")]
pub(crate) fn device_error(
    op: &'static str,
    error: impl std::fmt::Display,
) -> headroom_autograd_core::TensorError {
    headroom_autograd_core::TensorError::Device {
        op,
        reason: error.to_string(),
    }
}
