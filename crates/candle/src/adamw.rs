//! [`AdamW`]: PyTorch's fused Adam and AdamW (`torch.optim.AdamW(fused=True)`) over candle
//! `Var`s of f32, bf16 or f16, moments of the weights' dtype in host memory, each parameter
//! updated in place in one pass (optim's `adam_fused`).
//!
//! It sits on `host_slices.rs` (slots, the in-place step) and optim's kernels; it knows nothing
//! of 8-bit states.

use std::any::Any;

use candle_core::backprop::GradStore;
use candle_core::{DType, Var};
use half::{bf16, f16};
use headroom_optim::kernels::{adam_fused, AdamBuffers, AdamConfig, GradScaling};

use crate::error::CandleOptimError;
use crate::host_slices::{float_vars, step_slots, typed_state, HostFloat, ParamUpdate, Slot};

/// One parameter's `exp_avg`, `exp_avg_sq` and, with AMSGrad, `max_exp_avg_sq`, of its dtype.
#[derive(Debug)]
struct Moments<T> {
    exp_avg: Vec<T>,
    exp_avg_sq: Vec<T>,
    max_exp_avg_sq: Option<Vec<T>>,
}

impl<T> Moments<T> {
    fn bytes(&self) -> u64 {
        let n = self.exp_avg.len() + self.exp_avg_sq.len();
        let max = self.max_exp_avg_sq.as_ref().map_or(0, Vec::len);
        ((n + max) * std::mem::size_of::<T>()) as u64
    }
}

/// PyTorch's fused Adam/AdamW over candle `Var`s (configuration: optim's [`AdamConfig`]; AdamW
/// is [`AdamConfig::adamw`]). A `Var` without a gradient is left alone and its step count does
/// not advance, as PyTorch does.
#[derive(Debug)]
pub struct AdamW {
    slots: Vec<Slot>,
    config: AdamConfig,
}

impl AdamW {
    /// The bytes of state the optimizer holds (moments allocated so far).
    pub fn state_bytes(&self) -> u64 {
        self.slots
            .iter()
            .map(|slot| {
                let state = slot.state.lock();
                let Some(any) = state.as_deref() else {
                    return 0;
                };
                if let Some(m) = any.downcast_ref::<Moments<f32>>() {
                    m.bytes()
                } else if let Some(m) = any.downcast_ref::<Moments<bf16>>() {
                    m.bytes()
                } else {
                    any.downcast_ref::<Moments<f16>>().map_or(0, Moments::bytes)
                }
            })
            .sum()
    }

    /// The number of steps the `Var` at `index` (among the float `Var`s given) has taken.
    pub fn var_step(&self, index: usize) -> Option<u64> {
        self.slots.get(index).map(|s| s.step)
    }
}

impl candle_nn::Optimizer for AdamW {
    type Config = AdamConfig;

    fn new(vars: Vec<Var>, config: AdamConfig) -> candle_core::Result<AdamW> {
        config.validate().map_err(CandleOptimError::from)?;
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        let slots = Slot::for_vars(float_vars(AdamUpdate::NAME, vars, &dtypes)?);
        Ok(AdamW { slots, config })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let config = &self.config;
        step_slots(&mut self.slots, grads, |slot| AdamUpdate {
            config,
            step: slot.step,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// One parameter's fused Adam step number `step`.
struct AdamUpdate<'a> {
    config: &'a AdamConfig,
    step: u64,
}

impl ParamUpdate for AdamUpdate<'_> {
    const NAME: &'static str = "headroom_candle::AdamW";

    fn update<T: HostFloat>(
        &self,
        param: &mut [T],
        grad: &[T],
        state: &mut Option<Box<dyn Any + Send>>,
    ) -> candle_core::Result<()> {
        let zeros = || vec![T::from_f32(0.0); param.len()];
        let moments = typed_state(Self::NAME, state, || Moments {
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            max_exp_avg_sq: self.config.amsgrad.then(zeros),
        })?;
        let bufs = AdamBuffers {
            param,
            grad,
            exp_avg: &mut moments.exp_avg,
            exp_avg_sq: &mut moments.exp_avg_sq,
            max_exp_avg_sq: moments.max_exp_avg_sq.as_deref_mut(),
        };
        adam_fused(self.config, self.step, bufs, GradScaling::NONE)
            .map_err(CandleOptimError::from)?;
        Ok(())
    }
}
