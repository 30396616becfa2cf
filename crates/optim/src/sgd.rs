//! `torch.optim.SGD` over autograd-core parameters: the [`UpdateRule`] of [`SgdConfig`].
//!
//! State: a momentum buffer per parameter when the momentum is non-zero, created at the first
//! step (PyTorch clones the gradient into it then). Implementations: single, foreach, fused; on
//! the CPU through `kernels`, on CUDA through `cuda/sgd.rs`. Parameters may be f32, bf16 or f16;
//! the buffer has the parameter's dtype (2 bytes per element for bf16), arithmetic is f32.

use std::collections::HashMap;

use headroom_autograd_core::{DType, Element, Tensor};

use crate::device::{DeviceKind, StepDevice, StepScaling};
use crate::error::OptimError;
use crate::host::{foreach_scratch, host_slice, host_slice_mut, scratch, zeros_like_shape};
use crate::kernels::{
    bf16, f16, sgd_foreach, sgd_fused, sgd_single, GradScaling, ParamElement, SgdBuffers, SgdConfig,
};
use crate::optimizer::{
    take_state, GroupOptimizer, Implementation, NamedTensors, StepItem, UpdateRule,
};

/// SGD over parameter groups.
pub type Sgd = GroupOptimizer<SgdConfig>;

/// SGD's per-parameter state.
#[derive(Debug)]
pub struct SgdState {
    /// `momentum_buffer`, when the momentum is non-zero.
    pub momentum_buffer: Option<Tensor>,
}

/// The buffers of one parameter.
///
/// # Safety
/// `param` and `grad` are disjoint checked CPU tensors of `T`; the state tensors were allocated
/// by this crate for this parameter; nothing else touches them during the step.
unsafe fn buffers<'a, T: ParamElement + Element>(
    param: &'a Tensor,
    grad: &'a Tensor,
    state: &'a SgdState,
    step: u64,
) -> SgdBuffers<'a, T> {
    // SAFETY: forwarded from the caller.
    unsafe {
        SgdBuffers {
            param: host_slice_mut(param),
            grad: host_slice(grad),
            momentum_buffer: state.momentum_buffer.as_ref().map(|b| host_slice_mut(b)),
            first_step: step == 1,
        }
    }
}

impl UpdateRule for SgdConfig {
    type State = SgdState;
    const NAME: &'static str = "SGD";
    const DTYPES: &'static [DType] = &[DType::F32, DType::BF16, DType::F16];

    fn validate(&self) -> Result<(), OptimError> {
        SgdConfig::validate(self)
    }

    fn supports(&self, implementation: Implementation) -> bool {
        implementation != Implementation::EightBit
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn init_state(&self, _: Implementation, param: &Tensor) -> Result<SgdState, OptimError> {
        Ok(SgdState {
            momentum_buffer: if self.has_momentum() {
                Some(zeros_like_shape(param, param.shape())?)
            } else {
                None
            },
        })
    }

    fn step(
        &self,
        device: &mut StepDevice,
        implementation: Implementation,
        items: &mut [StepItem<'_, SgdState>],
        scaling: StepScaling<'_>,
    ) -> Result<(), OptimError> {
        match &mut device.kind {
            DeviceKind::Host => step_on_host(self, implementation, items, scaling.host()),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => {
                crate::cuda::sgd::step(cuda, self, implementation, items, scaling)
            }
        }
    }

    fn state_tensors(state: &SgdState) -> NamedTensors {
        state
            .momentum_buffer
            .iter()
            .map(|b| ("momentum_buffer", b.clone()))
            .collect()
    }

    fn state_from_tensors(
        &self,
        param: &Tensor,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<SgdState, OptimError> {
        Ok(SgdState {
            momentum_buffer: if self.has_momentum() {
                Some(take_state(
                    &mut tensors,
                    "momentum_buffer",
                    param.shape(),
                    param.dtype(),
                )?)
            } else {
                None
            },
        })
    }
}

/// The host side: the `kernels` functions on the tensors' memory, for the items' dtype.
fn step_on_host(
    cfg: &SgdConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, SgdState>],
    scaling: GradScaling,
) -> Result<(), OptimError> {
    match items.first().map(|it| it.param.dtype()) {
        Some(DType::BF16) => step_host::<bf16>(cfg, implementation, items, scaling),
        Some(DType::F16) => step_host::<f16>(cfg, implementation, items, scaling),
        _ => step_host::<f32>(cfg, implementation, items, scaling),
    }
}

/// [`step_on_host`] for items of element type `T`.
fn step_host<T: ParamElement + Element>(
    cfg: &SgdConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, SgdState>],
    scaling: GradScaling,
) -> Result<(), OptimError> {
    // SAFETY (every `buffers` call below): the optimizer checked each item's param and grad
    // (CPU, of `T`, contiguous, disjoint) and owns the state tensors; the step runs on this thread.
    match implementation {
        Implementation::Foreach { chunk } => {
            let Some(tmp) = foreach_scratch(items.iter().map(|it| it.param), chunk)? else {
                return Ok(());
            };
            let mut bufs: Vec<SgdBuffers<'_, T>> = items
                .iter()
                // SAFETY: see above.
                .map(|it| unsafe { buffers::<T>(it.param, &it.grad, &*it.state, it.step) })
                .collect();
            // SAFETY: the scratch is a fresh tensor of this call.
            sgd_foreach(cfg, &mut bufs, unsafe { host_slice_mut(&tmp) })
        }
        Implementation::Fused => {
            for it in items.iter() {
                // SAFETY: see above.
                let bufs = unsafe { buffers::<T>(it.param, &it.grad, &*it.state, it.step) };
                sgd_fused(cfg, bufs, scaling)?;
            }
            Ok(())
        }
        _ => {
            for it in items.iter() {
                // SAFETY: see above.
                let bufs = unsafe { buffers::<T>(it.param, &it.grad, &*it.state, it.step) };
                let tmp = scratch(it.param, it.param.numel())?;
                // SAFETY: a fresh tensor of this call, not shared.
                sgd_single(cfg, bufs, unsafe { host_slice_mut(&tmp) })?;
            }
            Ok(())
        }
    }
}
