//! [`AdamW`]: PyTorch's fused Adam and AdamW (`torch.optim.AdamW(fused=True)`) over candle
//! `Var`s of f32, bf16 or f16, moments of the weights' dtype in host memory, each parameter
//! updated in place in one pass (optim's `adam_fused`).
//!
//! It sits on `rule.rs` (the optimizer a rule makes) and optim's kernels; it knows nothing
//! of 8-bit states.

use std::any::Any;

use candle_core::{DType, Tensor, Var};
use half::{bf16, f16};
use headroom_optim::kernels::{adam_fused, AdamBuffers, AdamConfig, GradScaling};

use crate::error::CandleOptimError;
use crate::host_slices::{host_tensor, typed_state, HostFloat, RuleState};
use crate::rule::{candle_optimizer, CandleRule, Getter, Slices, StepAt};
use crate::state_dict::saved_vec;

/// One parameter's `exp_avg`, `exp_avg_sq` and, with AMSGrad, `max_exp_avg_sq`, of its dtype
/// (f32 for `AdamWStochastic`'s bf16 parameters).
#[derive(Debug)]
pub(crate) struct Moments<T> {
    pub(crate) exp_avg: Vec<T>,
    pub(crate) exp_avg_sq: Vec<T>,
    pub(crate) max_exp_avg_sq: Option<Vec<T>>,
}

impl<T: HostFloat> RuleState for Moments<T> {
    fn tensors(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let mut tensors = vec![
            ("exp_avg", host_tensor(&self.exp_avg)?),
            ("exp_avg_sq", host_tensor(&self.exp_avg_sq)?),
        ];
        if let Some(max) = &self.max_exp_avg_sq {
            tensors.push(("max_exp_avg_sq", host_tensor(max)?));
        }
        Ok(tensors)
    }

    fn bytes(&self) -> u64 {
        let n = self.exp_avg.len() + self.exp_avg_sq.len();
        let max = self.max_exp_avg_sq.as_ref().map_or(0, Vec::len);
        ((n + max) * std::mem::size_of::<T>()) as u64
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<T: HostFloat> Moments<T> {
    /// Zero moments of `len` elements (and the AMSGrad maximum with `amsgrad`).
    pub(crate) fn zeros(len: usize, amsgrad: bool) -> Moments<T> {
        let zeros = || vec![T::from_f32(0.0); len];
        Moments {
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            max_exp_avg_sq: amsgrad.then(zeros),
        }
    }

    /// The moments `optimizer` saved for a `Var` of `len` elements.
    pub(crate) fn restore(
        optimizer: &'static str,
        get: &dyn Fn(&str) -> candle_core::Result<Tensor>,
        len: usize,
        amsgrad: bool,
    ) -> candle_core::Result<Box<dyn RuleState>> {
        let take = |name: &str| saved_vec::<T>(optimizer, get, name, len);
        Ok(Box::new(Moments {
            exp_avg: take("exp_avg")?,
            exp_avg_sq: take("exp_avg_sq")?,
            max_exp_avg_sq: amsgrad.then(|| take("max_exp_avg_sq")).transpose()?,
        }))
    }
}

candle_optimizer! {
    /// PyTorch's fused Adam/AdamW over candle `Var`s (configuration: optim's [`AdamConfig`];
    /// AdamW is [`AdamConfig::adamw`]). A `Var` without a gradient is left alone and its step
    /// count does not advance, as PyTorch does. State dict: `{index}.step`, `{index}.exp_avg`,
    /// `{index}.exp_avg_sq` and, with AMSGrad, `{index}.max_exp_avg_sq`.
    AdamW(AdamConfig),
    lr: lr,
    check: validate,
}

impl CandleRule for AdamConfig {
    const NAME: &'static str = "headroom_candle::AdamW";
    const DTYPES: &'static [DType] = &[DType::F32, DType::BF16, DType::F16];

    fn update<T: HostFloat>(&self, at: StepAt, slices: Slices<'_, T>) -> candle_core::Result<()> {
        let Slices { param, grad, state } = slices;
        let (len, amsgrad) = (param.len(), self.amsgrad);
        let moments = typed_state(Self::NAME, state, || Moments::<T>::zeros(len, amsgrad))?;
        let bufs = AdamBuffers {
            param,
            grad,
            exp_avg: &mut moments.exp_avg,
            exp_avg_sq: &mut moments.exp_avg_sq,
            max_exp_avg_sq: moments.max_exp_avg_sq.as_deref_mut(),
        };
        adam_fused(self, at.step, bufs, GradScaling::NONE).map_err(CandleOptimError::from)?;
        Ok(())
    }

    /// The `Var`'s saved moments (`exp_avg`, `exp_avg_sq`, with AMSGrad `max_exp_avg_sq`), of
    /// its dtype.
    fn restore(&self, var: &Var, get: &Getter<'_>) -> candle_core::Result<Box<dyn RuleState>> {
        let (n, amsgrad, name) = (var.elem_count(), self.amsgrad, Self::NAME);
        match var.dtype() {
            DType::BF16 => Moments::<bf16>::restore(name, get, n, amsgrad),
            DType::F16 => Moments::<f16>::restore(name, get, n, amsgrad),
            _ => Moments::<f32>::restore(name, get, n, amsgrad),
        }
    }
}
