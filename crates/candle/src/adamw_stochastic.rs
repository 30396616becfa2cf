//! [`AdamWStochastic`]: Adam/AdamW on bf16 `Var`s with f32 moments and stochastically rounded
//! updates, no f32 master copy (optim's `AdamStochastic`: 12 bytes a parameter where a master
//! copy costs 16), each parameter updated in place in one pass (optim's `adam_fused_stochastic`),
//! the rounding's random stream keyed by the seed, the `Var`'s index and its step.
//!
//! It sits on `rule.rs` (the optimizer a rule makes), `adamw.rs`' moments and optim's
//! kernels; it knows nothing of 8-bit states.

use candle_core::{DType, Var};
use headroom_optim::kernels::{adam_fused_stochastic, AdamStochasticBuffers, GradScaling};
use headroom_optim::AdamStochasticConfig;

use crate::adamw::Moments;
use crate::error::CandleOptimError;
use crate::host_slices::{typed_state, HostFloat, RuleState};
use crate::rule::{candle_optimizer, CandleRule, Getter, Slices, StepAt};

candle_optimizer! {
    /// Adam/AdamW on bf16 `Var`s with f32 moments and stochastic rounding (configuration:
    /// optim's [`AdamStochasticConfig`]: an `AdamConfig` and the seed). A `Var` without a
    /// gradient is left alone and keeps its step count. State dict: `{index}.step`,
    /// `{index}.exp_avg`, `{index}.exp_avg_sq` (f32) and, with AMSGrad, `{index}.max_exp_avg_sq`.
    AdamWStochastic(AdamStochasticConfig),
    lr: adam.lr,
    check: adam.validate,
}

impl CandleRule for AdamStochasticConfig {
    const NAME: &'static str = "headroom_candle::AdamWStochastic";
    const DTYPES: &'static [DType] = &[DType::BF16];

    /// One bf16 parameter's step, rounding with the stream keyed by the seed, the `Var`'s index
    /// and the step.
    fn update<T: HostFloat>(&self, at: StepAt, slices: Slices<'_, T>) -> candle_core::Result<()> {
        let Slices { param, grad, state } = slices;
        let (Some(param), Some(grad)) = (T::as_bf16(param), T::as_bf16_ref(grad)) else {
            return Err(CandleOptimError::Unsupported {
                optimizer: Self::NAME,
                reason: "a parameter that is not bf16".into(),
            }
            .into());
        };
        let (len, amsgrad) = (param.len(), self.adam.amsgrad);
        let moments = typed_state(Self::NAME, state, || Moments::<f32>::zeros(len, amsgrad))?;
        let bufs = AdamStochasticBuffers {
            param,
            grad,
            exp_avg: &mut moments.exp_avg,
            exp_avg_sq: &mut moments.exp_avg_sq,
            max_exp_avg_sq: moments.max_exp_avg_sq.as_deref_mut(),
        };
        let key = self.key(at.index, at.step);
        adam_fused_stochastic(&self.adam, at.step, key, bufs, GradScaling::NONE)
            .map_err(CandleOptimError::from)?;
        Ok(())
    }

    /// The `Var`'s saved f32 moments (`exp_avg`, `exp_avg_sq`, with AMSGrad `max_exp_avg_sq`).
    fn restore(&self, var: &Var, get: &Getter<'_>) -> candle_core::Result<Box<dyn RuleState>> {
        let (n, amsgrad) = (var.elem_count(), self.adam.amsgrad);
        Moments::<f32>::restore(Self::NAME, get, n, amsgrad)
    }
}
