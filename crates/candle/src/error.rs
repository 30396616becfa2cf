//! The crate's typed error, and its conversion into candle's error, which
//! [`candle_nn::Optimizer`]'s methods return.
//!
//! It sits on optim's error; it knows nothing of the optimizers.

use headroom_optim::OptimError;

/// What can go wrong stepping candle `Var`s with Headroom's optimizers.
#[derive(Debug, thiserror::Error)]
pub enum CandleOptimError {
    /// The optimizer's configuration or a kernel refused (its own typed error).
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// A `Var` this crate cannot step yet, and why.
    #[error("{optimizer}: {reason}")]
    Unsupported {
        /// The optimizer.
        optimizer: &'static str,
        /// What is not supported, and what to do instead.
        reason: String,
    },
}

impl From<CandleOptimError> for candle_core::Error {
    fn from(err: CandleOptimError) -> candle_core::Error {
        candle_core::Error::wrap(err)
    }
}
