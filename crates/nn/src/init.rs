//! Parameter initialisation: PyTorch's schemes over the crate's seeded generator.
//!
//! Values are drawn on the host from [`uniform`] (a counter-based stream, so a model built twice
//! from the same generator state is identical, and the draws of one parameter split across
//! rayon's threads) and written into a fresh leaf that requires grad.
//! The schemes follow `torch.nn.init`: uniform bounds for `Linear` (`kaiming_uniform_` with
//! `a = sqrt(5)`, which is U(±1/sqrt(fan_in))), normal for embeddings and GPT-2 (Box–Muller),
//! constants for norms. They match PyTorch's distributions, not its exact numbers; golden tests
//! load PyTorch's weights instead.

use headroom_autograd_core::{uniform, BackendRef, DType, Generator, Tensor};
use rayon::prelude::*;

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
    let value_at: Box<dyn Fn(u64) -> f64 + Sync> = match init {
        Init::Constant(value) => Box::new(move |_| value),
        Init::Uniform { low, high } => {
            let (seed, offset) = generator.advance(numel as u64);
            Box::new(move |i| low + (high - low) * uniform(seed, offset + i))
        }
        Init::Normal { mean, std } => {
            let (seed, offset) = generator.advance(2 * numel as u64);
            Box::new(move |i| {
                // Box–Muller; 1 - u keeps the logarithm's argument in (0, 1].
                let u1 = 1.0 - uniform(seed, offset + 2 * i);
                let u2 = uniform(seed, offset + 2 * i + 1);
                let radius = (-2.0 * u1.ln()).sqrt();
                mean + std * radius * (std::f64::consts::TAU * u2).cos()
            })
        }
    };
    // Each element is a pure function of its index, so the draws split across threads and
    // give the same values as one thread (a ViT-L/16 is 304M draws). The draws round to the
    // parameter's dtype on those threads too (the same rounding `Tensor::from_f64s` applies):
    // a 68B-parameter bf16 model is built in seconds, not the minutes one thread's conversion
    // took.
    let res = match dtype {
        DType::F32 => Tensor::from_slice(backend, &draw(numel, |i| value_at(i) as f32), shape)?,
        DType::BF16 => {
            let values = draw(numel, |i| half::bf16::from_f64(value_at(i)));
            Tensor::from_slice(backend, &values, shape)?
        }
        DType::F16 => {
            let values = draw(numel, |i| half::f16::from_f64(value_at(i)));
            Tensor::from_slice(backend, &values, shape)?
        }
        _ => Tensor::from_f64s(backend, &draw(numel, &*value_at), shape, dtype)?,
    };
    res.requires_grad_(true)?;
    Ok(res)
}

/// `value_at(i)` for `i` in `0..numel`, in order, computed on rayon's threads.
fn draw<T: Send>(numel: usize, value_at: impl Fn(u64) -> T + Sync) -> Vec<T> {
    (0..numel)
        .into_par_iter()
        .with_min_len(1 << 15)
        .map(|i| value_at(i as u64))
        .collect()
}
