//! [`AdamWStochastic`]: Adam/AdamW on bf16 `Var`s with f32 moments and stochastically rounded
//! updates, no f32 master copy (optim's `AdamStochastic`: 12 bytes a parameter where a master
//! copy costs 16), each parameter updated in place in one pass (optim's `adam_fused_stochastic`),
//! the rounding's random stream keyed by the seed, the `Var`'s index and its step.
//!
//! It sits on `host_slices.rs` (slots, the in-place step), `adamw.rs`' moments and optim's
//! kernels; it knows nothing of 8-bit states.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use headroom_optim::kernels::{adam_fused_stochastic, AdamStochasticBuffers, GradScaling};
use headroom_optim::AdamStochasticConfig;

use crate::adamw::Moments;
use crate::error::CandleOptimError;
use crate::host_slices::{
    float_vars, step_slots, typed_state, HostFloat, ParamUpdate, RuleState, Slot,
};
use crate::state_dict::state_methods;

/// Adam/AdamW on bf16 `Var`s with f32 moments and stochastic rounding (configuration: optim's
/// [`AdamStochasticConfig`]: an `AdamConfig` and the seed). A `Var` without a gradient is left
/// alone and keeps its step count. State dict: `{index}.step`, `{index}.exp_avg`,
/// `{index}.exp_avg_sq` (f32) and, with AMSGrad, `{index}.max_exp_avg_sq`.
#[derive(Debug)]
pub struct AdamWStochastic {
    slots: Vec<Slot>,
    config: AdamStochasticConfig,
}

state_methods!(AdamWStochastic, StochasticUpdate::NAME, restore_f32_moments);

/// A `Var`'s saved f32 moments (`exp_avg`, `exp_avg_sq`, with AMSGrad `max_exp_avg_sq`).
fn restore_f32_moments(
    config: &AdamStochasticConfig,
    var: &Var,
    get: &dyn Fn(&str) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Box<dyn RuleState>> {
    let (n, amsgrad) = (var.elem_count(), config.adam.amsgrad);
    Moments::<f32>::restore(StochasticUpdate::NAME, get, n, amsgrad)
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
            key: config.key(slot.index, slot.step),
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
