//! [`AdamW`]: PyTorch's fused Adam and AdamW (`torch.optim.AdamW(fused=True)`) over candle
//! `Var`s of f32, bf16 or f16, moments of the weights' dtype in host memory, each parameter
//! updated in place in one pass (optim's `adam_fused`).
//!
//! It sits on `host_slices.rs` and optim's kernels; it knows nothing of 8-bit states.

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Var};
use half::{bf16, f16};
use headroom_optim::kernels::{adam_fused, AdamBuffers, AdamConfig, GradScaling};

use crate::error::CandleOptimError;
use crate::host_slices::{float_vars, param_and_grad, typed_state, HostFloat, Slot, StateLock};

const NAME: &str = "headroom_candle::AdamW";

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
        let slots = Slot::for_vars(float_vars(NAME, vars, &dtypes)?);
        Ok(AdamW { slots, config })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        for slot in &mut self.slots {
            let Some(grad) = grads.get(slot.var.as_tensor()) else {
                continue;
            };
            slot.step += 1;
            let op = FusedStep {
                config: &self.config,
                step: slot.step,
                state: &slot.state,
            };
            slot.var.as_tensor().inplace_op2(grad, &op)?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// One parameter's fused step, as candle's in-place op on the parameter with its gradient.
struct FusedStep<'a> {
    config: &'a AdamConfig,
    step: u64,
    state: &'a StateLock,
}

impl FusedStep<'_> {
    fn run<T: HostFloat>(
        &self,
        param: (&mut CpuStorage, &Layout),
        grad: (&CpuStorage, &Layout),
    ) -> candle_core::Result<()> {
        let (param, grad) = param_and_grad::<T>(NAME, param, grad)?;
        let mut state = self.state.lock();
        let zeros = || vec![T::from_f32(0.0); param.len()];
        let moments = typed_state(NAME, &mut state, || Moments {
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

impl InplaceOp2 for FusedStep<'_> {
    fn name(&self) -> &'static str {
        "headroom-adamw"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        grad: &CpuStorage,
        grad_l: &Layout,
    ) -> candle_core::Result<()> {
        let grad = (grad, grad_l);
        match dst.dtype() {
            DType::F32 => self.run::<f32>((dst, dst_l), grad),
            DType::BF16 => self.run::<bf16>((dst, dst_l), grad),
            DType::F16 => self.run::<f16>((dst, dst_l), grad),
            other => Err(CandleOptimError::Unsupported {
                optimizer: NAME,
                reason: format!("a {other:?} parameter"),
            }
            .into()),
        }
    }
}
