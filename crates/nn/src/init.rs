//! Parameter initialisation: PyTorch's schemes over the crate's seeded generator.
//!
//! Values are drawn by the backend that holds the parameter ([`Tensor::random_`]: a
//! counter-based stream, so a model built twice from the same generator state is identical, the
//! CPU splits one parameter's draws across rayon's threads and the GPU draws in a kernel, with
//! no host copy of a 68B-parameter model) into a fresh leaf that requires grad.
//! The schemes follow `torch.nn.init`: uniform bounds for `Linear` (`kaiming_uniform_` with
//! `a = sqrt(5)`, which is U(±1/sqrt(fan_in))), normal for embeddings and GPT-2 (Box–Muller),
//! constants for norms. They match PyTorch's distributions, not its exact numbers; golden tests
//! load PyTorch's weights instead.

use headroom_autograd_core::{BackendRef, DType, Distribution, Generator, Tensor};

use crate::error::Result;

/// How a parameter's initial values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Every element is this value.
    Constant(f64),
    /// Uniform on `[low, high)`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Normal with this mean and standard deviation.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

/// A new leaf parameter of `shape` and `dtype`, initialised by `init` with draws from
/// `generator`, that requires grad. The values are drawn where the backend keeps them
/// ([`Tensor::random_`]): a CUDA model's parameters never cross the host link.
pub fn parameter(
    backend: &BackendRef,
    shape: &[usize],
    dtype: DType,
    init: Init,
    generator: &Generator,
) -> Result<Tensor> {
    let res = Tensor::empty(backend, shape, dtype)?;
    match init {
        Init::Constant(value) => res.fill_(value)?,
        Init::Uniform { low, high } => {
            res.random_(Distribution::Uniform { low, high }, generator)?
        }
        Init::Normal { mean, std } => res.random_(Distribution::Normal { mean, std }, generator)?,
    };
    res.requires_grad_(true)?;
    Ok(res)
}
