//! [`Sgd`]: PyTorch's fused SGD (`torch.optim.SGD(fused=True)`: momentum, dampening, Nesterov,
//! L2 weight decay) over candle `Var`s of f32, bf16 or f16, the momentum buffer of the weights'
//! dtype in host memory (none without momentum), each parameter updated in place in one pass
//! (optim's `sgd_fused`).
//!
//! It sits on `host_slices.rs` and optim's kernels; it knows nothing of Adam.

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Var};
use half::{bf16, f16};
use headroom_optim::kernels::{sgd_fused, GradScaling, SgdBuffers, SgdConfig};

use crate::error::CandleOptimError;
use crate::host_slices::{float_vars, param_and_grad, typed_state, HostFloat, Slot, StateLock};

const NAME: &str = "headroom_candle::Sgd";

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
        let slots = Slot::for_vars(float_vars(NAME, vars, &dtypes)?);
        Ok(Sgd { slots, config })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        for slot in &mut self.slots {
            let Some(grad) = grads.get(slot.var.as_tensor()) else {
                continue;
            };
            slot.step += 1;
            let op = SgdStep {
                config: &self.config,
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

/// One parameter's fused SGD step, as candle's in-place op on the parameter with its gradient.
struct SgdStep<'a> {
    config: &'a SgdConfig,
    state: &'a StateLock,
}

impl SgdStep<'_> {
    fn run<T: HostFloat>(
        &self,
        param: (&mut CpuStorage, &Layout),
        grad: (&CpuStorage, &Layout),
    ) -> candle_core::Result<()> {
        let (param, grad) = param_and_grad::<T>(NAME, param, grad)?;
        let mut state = self.state.lock();
        let first_step = state.is_none();
        let with_momentum = self.config.momentum != 0.0;
        let momentum = typed_state(NAME, &mut state, || {
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

impl InplaceOp2 for SgdStep<'_> {
    fn name(&self) -> &'static str {
        "headroom-sgd"
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
