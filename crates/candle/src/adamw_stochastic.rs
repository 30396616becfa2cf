//! [`AdamWStochastic`]: Adam/AdamW on bf16 `Var`s with f32 moments and stochastically rounded
//! updates, no f32 master copy (optim's `AdamStochastic`: 12 bytes a parameter where a master
//! copy costs 16), each parameter updated in place in one pass (optim's `adam_fused_stochastic`),
//! the rounding's random stream keyed by the seed, the `Var`'s index and its step.
//!
//! It sits on `host_slices.rs` (slots, the in-place step), `adamw.rs`' moments and optim's
//! kernels; it knows nothing of 8-bit states.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use headroom_optim::kernels::{
    adam_fused_stochastic, stochastic_key, AdamStochasticBuffers, GradScaling,
};
use headroom_optim::AdamStochasticConfig;

use crate::adamw::Moments;
use crate::error::CandleOptimError;
use crate::host_slices::{
    float_vars, state_bytes, step_slots, typed_state, HostFloat, ParamUpdate, RuleState, Slot,
};
use crate::state_dict;

/// Adam/AdamW on bf16 `Var`s with f32 moments and stochastic rounding (configuration: optim's
/// [`AdamStochasticConfig`]: an `AdamConfig` and the seed). A `Var` without a gradient is left
/// alone and keeps its step count.
#[derive(Debug)]
pub struct AdamWStochastic {
    slots: Vec<Slot>,
    config: AdamStochasticConfig,
}

impl AdamWStochastic {
    /// The bytes of state the optimizer holds (f32 moments allocated so far).
    pub fn state_bytes(&self) -> u64 {
        state_bytes(&self.slots)
    }

    /// The state as named tensors (`{index}.step`, `{index}.exp_avg`, `{index}.exp_avg_sq`).
    pub fn state_dict(&self) -> candle_core::Result<HashMap<String, Tensor>> {
        state_dict::state_dict(&self.slots)
    }

    /// Continues from `saved` (an earlier `state_dict` over the same `Var`s in the same order;
    /// the rounding's stream continues with the step counts).
    pub fn load_state_dict(&mut self, saved: &HashMap<String, Tensor>) -> candle_core::Result<()> {
        let amsgrad = self.config.adam.amsgrad;
        let restore = |var: &Var, get: &dyn Fn(&str) -> candle_core::Result<Tensor>| {
            Moments::<f32>::restore(StochasticUpdate::NAME, get, var.elem_count(), amsgrad)
        };
        state_dict::load_state_dict(StochasticUpdate::NAME, &mut self.slots, saved, &restore)
    }

    /// Writes [`AdamWStochastic::state_dict`] to the safetensors file `path`.
    pub fn save_state(&self, path: impl AsRef<Path>) -> candle_core::Result<()> {
        state_dict::save(&self.state_dict()?, path.as_ref())
    }

    /// [`AdamWStochastic::load_state_dict`] from the safetensors file `path`.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> candle_core::Result<()> {
        self.load_state_dict(&state_dict::load(path.as_ref())?)
    }
}

impl candle_nn::Optimizer for AdamWStochastic {
    type Config = AdamStochasticConfig;

    fn new(vars: Vec<Var>, config: AdamStochasticConfig) -> candle_core::Result<AdamWStochastic> {
        config.adam.validate().map_err(CandleOptimError::from)?;
        let slots = Slot::for_vars(float_vars(StochasticUpdate::NAME, vars, &[DType::BF16])?);
        Ok(AdamWStochastic { slots, config })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let config = &self.config;
        step_slots(&mut self.slots, grads, |slot| StochasticUpdate {
            config,
            step: slot.step,
            key: stochastic_key(config.seed, slot.index as u64, slot.step),
        })
    }

    fn learning_rate(&self) -> f64 {
        self.config.adam.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.adam.lr = lr;
    }
}

/// One bf16 parameter's step number `step`, rounding with the stream `key`.
struct StochasticUpdate<'a> {
    config: &'a AdamStochasticConfig,
    step: u64,
    key: u64,
}

impl ParamUpdate for StochasticUpdate<'_> {
    const NAME: &'static str = "headroom_candle::AdamWStochastic";

    fn update<T: HostFloat>(
        &self,
        param: &mut [T],
        grad: &[T],
        state: &mut Option<Box<dyn RuleState>>,
    ) -> candle_core::Result<()> {
        let (Some(param), Some(grad)) = (T::as_bf16(param), T::as_bf16_ref(grad)) else {
            return Err(CandleOptimError::Unsupported {
                optimizer: Self::NAME,
                reason: "a parameter that is not bf16".into(),
            }
            .into());
        };
        let (len, amsgrad) = (param.len(), self.config.adam.amsgrad);
        let moments = typed_state(Self::NAME, state, || Moments::<f32>::zeros(len, amsgrad))?;
        let bufs = AdamStochasticBuffers {
            param,
            grad,
            exp_avg: &mut moments.exp_avg,
            exp_avg_sq: &mut moments.exp_avg_sq,
            max_exp_avg_sq: moments.max_exp_avg_sq.as_deref_mut(),
        };
        adam_fused_stochastic(
            &self.config.adam,
            self.step,
            self.key,
            bufs,
            GradScaling::NONE,
        )
        .map_err(CandleOptimError::from)?;
        Ok(())
    }
}
