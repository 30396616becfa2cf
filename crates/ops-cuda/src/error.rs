//! Why the CUDA backend could not be created or could not run a kernel.

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
    /// Loading the embedded PTX or one of its kernels failed.
    #[error("loading kernel `{kernel}`: {reason}")]
    Kernel {
        /// The kernel's name.
        kernel: String,
        /// What the driver said.
        reason: String,
    },
}
