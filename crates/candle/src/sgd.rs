//! [`Sgd`]: PyTorch's fused SGD (`torch.optim.SGD(fused=True)`: momentum, dampening, Nesterov,
//! L2 weight decay) over candle `Var`s of f32, bf16 or f16, the momentum buffer of the weights'
//! dtype in host memory (none without momentum), each parameter updated in place in one pass
//! (optim's `sgd_fused`).
//!
//! It sits on `host_slices.rs` (slots, the in-place step) and optim's kernels; it knows nothing
//! of Adam.

use std::any::Any;

use candle_core::backprop::GradStore;
use candle_core::{DType, Var};
use headroom_optim::kernels::{sgd_fused, GradScaling, SgdBuffers, SgdConfig};

use crate::error::CandleOptimError;
use crate::host_slices::{float_vars, step_slots, typed_state, HostFloat, ParamUpdate, Slot};

/// One parameter's momentum buffer (`None` without momentum), of its dtype.
#[derive(Debug)]
struct Momentum<T>(Option<Vec<T>>);

/// PyTorch's fused SGD over candle `Var`s (configuration: optim's [`SgdConfig`]). A `Var`
/// without a gradient is left alone.
#[derive(Debug)]
pub struct Sgd {
    slots: Vec<Slot>,
    config: SgdConfig,
}

impl candle_nn::Optimizer for Sgd {
    type Config = SgdConfig;

    fn new(vars: Vec<Var>, config: SgdConfig) -> candle_core::Result<Sgd> {
        config.validate().map_err(CandleOptimError::from)?;
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        let slots = Slot::for_vars(float_vars(SgdUpdate::NAME, vars, &dtypes)?);
        Ok(Sgd { slots, config })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let config = &self.config;
        step_slots(&mut self.slots, grads, |_| SgdUpdate { config })
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// One parameter's fused SGD step.
struct SgdUpdate<'a> {
    config: &'a SgdConfig,
}

impl ParamUpdate for SgdUpdate<'_> {
    const NAME: &'static str = "headroom_candle::Sgd";

    fn update<T: HostFloat>(
        &self,
        param: &mut [T],
        grad: &[T],
        state: &mut Option<Box<dyn Any + Send>>,
    ) -> candle_core::Result<()> {
        let first_step = state.is_none();
        let with_momentum = self.config.momentum != 0.0;
        let momentum = typed_state(Self::NAME, state, || {
            Momentum(with_momentum.then(|| vec![T::from_f32(0.0); param.len()]))
        })?;
        let bufs = SgdBuffers {
            param,
            grad,
            momentum_buffer: momentum.0.as_deref_mut(),
            first_step,
        };
        sgd_fused(self.config, bufs, GradScaling::NONE).map_err(CandleOptimError::from)?;
        Ok(())
    }
}
