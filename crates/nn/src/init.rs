//! Parameter initialisation: PyTorch's schemes over the crate's seeded generator.
//!
//! Values are drawn on the host from [`uniform`] (a counter-based stream, so a model built twice
//! from the same generator state is identical) and written into a fresh leaf that requires grad.
//! The schemes follow `torch.nn.init`: uniform bounds for `Linear` (`kaiming_uniform_` with
//! `a = sqrt(5)`, which is U(±1/sqrt(fan_in))), normal for embeddings and GPT-2 (Box–Muller),
//! constants for norms. They match PyTorch's distributions, not its exact numbers; golden tests
//! load PyTorch's weights instead.

use headroom_autograd_core::{uniform, BackendRef, DType, Generator, Tensor};

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
/// `generator`, that requires grad.
pub fn parameter(
    backend: &BackendRef,
    shape: &[usize],
    dtype: DType,
    init: Init,
    generator: &Generator,
) -> Result<Tensor> {
    let numel: usize = shape.iter().product();
    let values: Vec<f64> = match init {
        Init::Constant(value) => vec![value; numel],
        Init::Uniform { low, high } => {
            let (seed, offset) = generator.advance(numel as u64);
            (0..numel as u64)
                .map(|i| low + (high - low) * uniform(seed, offset + i))
                .collect()
        }
        Init::Normal { mean, std } => {
            let (seed, offset) = generator.advance(2 * numel as u64);
            (0..numel as u64)
                .map(|i| {
                    // Box–Muller; 1 - u keeps the logarithm's argument in (0, 1].
                    let u1 = 1.0 - uniform(seed, offset + 2 * i);
                    let u2 = uniform(seed, offset + 2 * i + 1);
                    let radius = (-2.0 * u1.ln()).sqrt();
                    mean + std * radius * (std::f64::consts::TAU * u2).cos()
                })
                .collect()
        }
    };
    let res = Tensor::from_f64s(backend, &values, shape, dtype)?;
    res.requires_grad_(true)?;
    Ok(res)
}
