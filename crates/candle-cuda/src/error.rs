//! The crate's typed error, and its conversion into candle's error, which
//! [`candle_nn::Optimizer`]'s methods return.
//!
//! It sits on optim's error; it knows nothing of the optimizers.

use headroom_optim::OptimError;

/// What can go wrong stepping candle `Var`s on CUDA with Headroom's optimizers.
#[derive(Debug, thiserror::Error)]
pub enum CandleCudaError {
    /// The optimizer's configuration or a kernel refused (its own typed error).
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// A `Var`, gradient or saved state this crate cannot step, and what to do instead.
    #[error("{optimizer}: {reason}")]
    Unsupported {
        /// The optimizer.
        optimizer: &'static str,
        /// What is not supported, and what to do instead.
        reason: String,
    },
    /// The CUDA driver refused a call (no device, a stream or event call failed).
    #[error("{optimizer}: CUDA {op} failed: {reason}")]
    Device {
        /// The optimizer.
        optimizer: &'static str,
        /// The call.
        op: &'static str,
        /// The driver's message.
        reason: String,
    },
}

impl From<CandleCudaError> for candle_core::Error {
    fn from(err: CandleCudaError) -> candle_core::Error {
        candle_core::Error::wrap(err)
    }
}
