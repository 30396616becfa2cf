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
    /// Draws from a distribution (autograd-core's counter-based uniform or normal).
    Random(Distribution),
}

impl Init {
    /// Uniform on `[low, high)`.
    pub fn uniform(low: f64, high: f64) -> Init {
        Init::Random(Distribution::Uniform { low, high })
    }

    /// Normal with this mean and standard deviation.
    pub fn normal(mean: f64, std: f64) -> Init {
        Init::Random(Distribution::Normal { mean, std })
    }
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
        Init::Random(distribution) => res.random_(distribution, generator)?,
    };
    res.requires_grad_(true)?;
    Ok(res)
}
