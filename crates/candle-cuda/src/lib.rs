//! Headroom's optimizers for candle `Var`s on CUDA: [`AdamW`] (PyTorch's fused Adam/AdamW on
//! f32, bf16 or f16 weights), [`Sgd`] (PyTorch's fused SGD), [`AdamWStochastic`] (bf16 weights,
//! f32 moments, stochastic rounding, no master copy) and [`AdamW8bit`] (bitsandbytes' 8-bit
//! blockwise AdamW on f32 weights) implement [`candle_nn::Optimizer`]. On CUDA each step is one
//! launch of `headroom-optim`'s fused kernel for every `Var` with a gradient, updating candle's
//! device buffers in place — no temporaries, where `candle_nn::AdamW` allocates a tensor per
//! operation and parameter; on the CPU they are `headroom-candle`'s optimizers. The bits are
//! those of Headroom's own optimizers and of the CPU kernels (optim's kernels mirror the host's
//! arithmetic).
//!
//! ```no_run
//! use candle_core::{DType, Device};
//! use candle_nn::{Optimizer, VarBuilder, VarMap};
//! use headroom_candle_cuda::{AdamConfig, AdamW};
//!
//! let device = Device::new_cuda(0)?;
//! let varmap = VarMap::new();
//! let layer = candle_nn::linear(256, 64, VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
//! // The one line that changes: candle_nn::AdamW::new(varmap.all_vars(), ParamsAdamW { .. })
//! let mut optimizer = AdamW::new(varmap.all_vars(), AdamConfig { lr: 1e-3, ..AdamConfig::adamw() })?;
//! let x = candle_core::Tensor::randn(0f32, 1.0, (8, 256), &device)?;
//! let loss = candle_core::Module::forward(&layer, &x)?.sqr()?.mean_all()?;
//! optimizer.backward_step(&loss)?;
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! A separate package from `headroom-candle`: candle's `cuda` feature compiles candle's kernels
//! with nvcc and links the CUDA runtime, which Headroom's workspace builds without. Headroom's
//! kernels run on its backend's stream, ordered after candle's work and before candle's next
//! (`device.rs`), so any candle stream works; the optimizer state is candle tensors on the
//! `Var`s' device.
//!
//! This crate sits on headroom-candle (the CPU optimizers), optim's raw-buffer CUDA layer and
//! candle's CUDA storage; it knows nothing of Headroom's autograd or models.

mod device;
mod error;
mod optimizer;
mod rules;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor, Var};

pub use error::CandleCudaError;
pub use headroom_candle::{clip_grad_norm, Adam8bitConfig, AdamConfig, SgdConfig, WeightDecay};
pub use headroom_optim::AdamStochasticConfig;

use crate::optimizer::CudaOptimizer;
use crate::rules::CudaRule;

/// Where an optimizer's `Var`s live, and the optimizer for them.
#[derive(Debug)]
enum Placement<C, R: CudaRule> {
    Cpu(C),
    Cuda(CudaOptimizer<R>),
}

/// The float `Var`s of `vars` and the CUDA device they share, `None` when they are all on the
/// CPU (or there are none); `Var`s on two devices are an error.
fn cuda_placement(
    optimizer: &'static str,
    vars: &[Var],
) -> Result<Option<candle_core::CudaDevice>, CandleCudaError> {
    let mut found: Option<Device> = None;
    for var in vars.iter().filter(|v| v.dtype().is_float()) {
        match &found {
            None => found = Some(var.device().clone()),
            Some(device) if device.same_device(var.device()) => {}
            Some(device) => {
                return Err(CandleCudaError::Unsupported {
                    optimizer,
                    reason: format!(
                        "Vars on {:?} and on {:?}; give one optimizer the Vars of one device",
                        device.location(),
                        var.device().location()
                    ),
                })
            }
        }
    }
    match found {
        Some(Device::Cuda(cuda)) => Ok(Some(cuda)),
        Some(Device::Cpu) | None => Ok(None),
        Some(other) => Err(CandleCudaError::Unsupported {
            optimizer,
            reason: format!("Vars on {:?}: CPU or CUDA only", other.location()),
        }),
    }
}

/// Declares the public optimizer `$optimizer` over `$config`, `$cpu` (headroom-candle's
/// optimizer) for CPU `Var`s: the struct, its [`candle_nn::Optimizer`] impl and its state
/// methods.
macro_rules! optimizer {
    ($(#[$doc:meta])* $optimizer:ident($config:ty), cpu: $cpu:ty $(,)?) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $optimizer(Placement<$cpu, $config>);

        impl candle_nn::Optimizer for $optimizer {
            type Config = $config;

            fn new(vars: Vec<Var>, config: $config) -> candle_core::Result<Self> {
                let name = <$config as CudaRule>::NAME;
                Ok($optimizer(match cuda_placement(name, &vars)? {
                    None => Placement::Cpu(<$cpu as candle_nn::Optimizer>::new(vars, config)?),
                    Some(device) => {
                        let floats = vars.into_iter().filter(|v| v.dtype().is_float()).collect();
                        Placement::Cuda(CudaOptimizer::new(floats, config, device)?)
                    }
                }))
            }

            fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
                match &mut self.0 {
                    Placement::Cpu(cpu) => cpu.step(grads),
                    Placement::Cuda(cuda) => Ok(cuda.step(grads)?),
                }
            }

            fn learning_rate(&self) -> f64 {
                match &self.0 {
                    Placement::Cpu(cpu) => cpu.learning_rate(),
                    Placement::Cuda(cuda) => cuda.config.learning_rate(),
                }
            }

            fn set_learning_rate(&mut self, lr: f64) {
                match &mut self.0 {
                    Placement::Cpu(cpu) => cpu.set_learning_rate(lr),
                    Placement::Cuda(cuda) => cuda.config.set_learning_rate(lr),
                }
            }
        }

        impl $optimizer {
            /// Whether the `Var`s are on a CUDA device (else the CPU optimizer steps them).
            pub fn on_cuda(&self) -> bool {
                matches!(self.0, Placement::Cuda(_))
            }

            /// The bytes of state held (each `Var`'s allocated at its first step).
            pub fn state_bytes(&self) -> u64 {
                match &self.0 {
                    Placement::Cpu(cpu) => cpu.state_bytes(),
                    Placement::Cuda(cuda) => cuda.state_bytes(),
                }
            }

            /// The number of steps the `Var` at `index` (among the float `Var`s given) has
            /// taken.
            pub fn var_step(&self, index: usize) -> Option<u64> {
                match &self.0 {
                    Placement::Cpu(cpu) => cpu.var_step(index),
                    Placement::Cuda(cuda) => cuda.var_step(index),
                }
            }

            /// The state as named tensors: `{index}.step` and the rule's buffers, as
            /// headroom-candle names them (on the `Var`s' device).
            pub fn state_dict(&self) -> candle_core::Result<HashMap<String, Tensor>> {
                match &self.0 {
                    Placement::Cpu(cpu) => cpu.state_dict(),
                    Placement::Cuda(cuda) => Ok(cuda.state_dict()?),
                }
            }

            /// Continues from `saved`, an earlier `state_dict` over the same `Var`s in the same
            /// order (from either device): step counts and buffers, checked against each `Var`.
            pub fn load_state_dict(&mut self, saved: &HashMap<String, Tensor>) -> candle_core::Result<()> {
                match &mut self.0 {
                    Placement::Cpu(cpu) => cpu.load_state_dict(saved),
                    Placement::Cuda(cuda) => Ok(cuda.load_state_dict(saved)?),
                }
            }

            /// Writes the state dict to the safetensors file `path`.
            pub fn save_state(&self, path: impl AsRef<Path>) -> candle_core::Result<()> {
                candle_core::safetensors::save(&self.state_dict()?, path.as_ref())
            }

            /// Loads the state dict from the safetensors file `path`.
            pub fn load_state(&mut self, path: impl AsRef<Path>) -> candle_core::Result<()> {
                let saved = candle_core::safetensors::load(path.as_ref(), &Device::Cpu)?;
                self.load_state_dict(&saved)
            }
        }
    };
}

optimizer! {
    /// PyTorch's fused Adam/AdamW (configuration: optim's [`AdamConfig`]; AdamW is
    /// [`AdamConfig::adamw`]) on f32, bf16 or f16 `Var`s, moments of the `Var`'s dtype. State
    /// dict: `{index}.step`, `{index}.exp_avg`, `{index}.exp_avg_sq` (and `max_exp_avg_sq`).
    AdamW(AdamConfig),
    cpu: headroom_candle::AdamW,
}

optimizer! {
    /// Adam/AdamW on bf16 `Var`s with f32 moments and stochastically rounded updates, no master
    /// copy (configuration: optim's [`AdamStochasticConfig`]); the rounding's stream is keyed
    /// by the seed, the `Var`'s index and its step, as on the CPU.
    AdamWStochastic(AdamStochasticConfig),
    cpu: headroom_candle::AdamWStochastic,
}

optimizer! {
    /// bitsandbytes' 8-bit blockwise AdamW (configuration: optim's [`Adam8bitConfig`]) on f32
    /// `Var`s: u8 codes and an f32 scale per block of 256 from 4096 elements, f32 moments
    /// below. State dict: `{index}.step`, `state1`, `state2`, `absmax1`, `absmax2`.
    AdamW8bit(Adam8bitConfig),
    cpu: headroom_candle::AdamW8bit,
}

optimizer! {
    /// PyTorch's fused SGD (configuration: optim's [`SgdConfig`]) on f32, bf16 or f16 `Var`s,
    /// the momentum buffer of the `Var`'s dtype. State dict: `{index}.step`,
    /// `{index}.momentum_buffer`.
    Sgd(SgdConfig),
    cpu: headroom_candle::Sgd,
}
