//! Headroom's optimizers inside candle training loops: [`AdamW`] (PyTorch's fused Adam/AdamW,
//! f32, bf16 or f16 weights), [`Sgd`] (PyTorch's fused SGD), [`AdamWStochastic`] (bf16 weights
//! with f32 moments and stochastic rounding, no master copy) and [`AdamW8bit`] (bitsandbytes'
//! 8-bit blockwise AdamW, f32 weights or bf16 weights with no master copy, rounded to nearest or
//! stochastically) implement [`candle_nn::Optimizer`] over candle [`Var`](candle_core::Var)s, so
//! a candle trainer swaps its optimizer and keeps its model, its autograd and its loop;
//! [`clip_grad_norm`] is PyTorch's `clip_grad_norm_` on candle's gradients. Each optimizer's
//! state saves and loads as named tensors or a safetensors file (`state_dict`, `save_state`).
//!
//! Each step updates a `Var`'s own buffer in place, one fused pass per parameter through
//! candle's in-place custom op ([`candle_core::InplaceOp2`]), with the raw-buffer kernels of
//! `headroom-optim` (`headroom_optim::kernels`): no temporaries, where `candle_nn::AdamW`
//! allocates one tensor per operation and keeps its moments as `Var`s of the weights' dtype. The
//! results are those of Headroom's own optimizers on the same values, bit for bit
//! (`tests/optimizers.rs`), so PyTorch's formulas and bitsandbytes' codes carry over.
//!
//! The optimizer state lives in host memory beside candle's CPU tensors; candle's CUDA tensors
//! are refused with a typed error ([`CandleOptimError::Unsupported`]): `headroom-candle-cuda`, a
//! package of its own (candle's `cuda` feature needs nvcc), steps them with the same names and
//! bits, one launch a step.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use candle_nn::Optimizer;
//! use headroom_candle::{AdamConfig, AdamW};
//!
//! let w = Var::new(&[[0.5f32, -0.25], [1.0, 2.0]], &Device::Cpu)?;
//! let mut adamw = AdamW::new(vec![w.clone()], AdamConfig::adamw())?;
//! let loss = w.as_tensor().sqr()?.sum_all()?;
//! adamw.backward_step(&loss)?;
//! assert!(w.as_tensor().to_vec2::<f32>()?[0][0] < 0.5);
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! This crate sits on optim's raw kernels and candle's tensors; it knows nothing of Headroom's
//! autograd, its backends or its allocator.

mod adamw;
mod adamw8bit;
mod adamw_stochastic;
mod clip;
mod error;
mod host_slices;
mod rule;
mod sgd;
mod state_dict;

pub use adamw::AdamW;
pub use adamw8bit::AdamW8bit;
pub use adamw_stochastic::AdamWStochastic;
pub use clip::clip_grad_norm;
pub use error::CandleOptimError;
pub use headroom_optim::kernels::{
    Adam8bitConfig, AdamConfig, Bf16Rounding, SgdConfig, WeightDecay,
};
pub use headroom_optim::AdamStochasticConfig;
pub use sgd::Sgd;
