//! [`Sgd`]: PyTorch's fused SGD (`torch.optim.SGD(fused=True)`: momentum, dampening, Nesterov,
//! L2 weight decay) over candle `Var`s of f32, bf16 or f16, the momentum buffer of the weights'
//! dtype in host memory (none without momentum), each parameter updated in place in one pass
//! (optim's `sgd_fused`).
//!
//! It sits on `rule.rs` (the optimizer a rule makes) and optim's kernels; it knows nothing
//! of Adam.

use std::any::Any;

use candle_core::{DType, Tensor, Var};
use half::{bf16, f16};
use headroom_optim::kernels::{sgd_fused, GradScaling, SgdBuffers, SgdConfig};

use crate::error::CandleOptimError;
use crate::host_slices::{host_tensor, typed_state, HostFloat, RuleState};
use crate::rule::{candle_optimizer, CandleRule, Getter, Slices, StepAt};
use crate::state_dict::saved_vec;

/// One parameter's momentum buffer (`None` without momentum), of its dtype.
#[derive(Debug)]
struct Momentum<T>(Option<Vec<T>>);

impl<T: HostFloat> RuleState for Momentum<T> {
    fn tensors(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let buffer = self.0.as_deref().map(host_tensor).transpose()?;
        Ok(buffer.map(|t| ("momentum_buffer", t)).into_iter().collect())
    }

    fn bytes(&self) -> u64 {
        self.0
            .as_ref()
            .map_or(0, |b| (b.len() * std::mem::size_of::<T>()) as u64)
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<T: HostFloat> Momentum<T> {
    /// The buffer saved for a `Var` of `len` elements (none without momentum).
    fn restore(
        get: &dyn Fn(&str) -> candle_core::Result<Tensor>,
        len: usize,
        momentum: bool,
    ) -> candle_core::Result<Box<dyn RuleState>> {
        let take = || saved_vec::<T>(SgdConfig::NAME, get, "momentum_buffer", len);
        Ok(Box::new(Momentum(momentum.then(take).transpose()?)))
    }
}

candle_optimizer! {
    /// PyTorch's fused SGD over candle `Var`s (configuration: optim's [`SgdConfig`]). A `Var`
    /// without a gradient is left alone. State dict: `{index}.step` and, with momentum,
    /// `{index}.momentum_buffer`.
    Sgd(SgdConfig),
    lr: lr,
    check: validate,
}

impl CandleRule for SgdConfig {
    const NAME: &'static str = "headroom_candle::Sgd";
    const DTYPES: &'static [DType] = &[DType::F32, DType::BF16, DType::F16];

    fn update<T: HostFloat>(&self, _at: StepAt, slices: Slices<'_, T>) -> candle_core::Result<()> {
        let Slices { param, grad, state } = slices;
        let first_step = state.is_none();
        let with_momentum = self.momentum != 0.0;
        let momentum = typed_state(Self::NAME, state, || {
            Momentum(with_momentum.then(|| vec![T::from_f32(0.0); param.len()]))
        })?;
        let bufs = SgdBuffers {
            param,
            grad,
            momentum_buffer: momentum.0.as_deref_mut(),
            first_step,
        };
        sgd_fused(self, bufs, GradScaling::NONE).map_err(CandleOptimError::from)?;
        Ok(())
    }

    /// The `Var`'s saved `momentum_buffer` (none without momentum), of its dtype.
    fn restore(&self, var: &Var, get: &Getter<'_>) -> candle_core::Result<Box<dyn RuleState>> {
        let (n, momentum) = (var.elem_count(), self.momentum != 0.0);
        match var.dtype() {
            DType::BF16 => Momentum::<bf16>::restore(get, n, momentum),
            DType::F16 => Momentum::<f16>::restore(get, n, momentum),
            _ => Momentum::<f32>::restore(get, n, momentum),
        }
    }
}
