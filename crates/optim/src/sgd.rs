//! `torch.optim.SGD` over autograd-core parameters: the [`UpdateRule`] of [`SgdConfig`].
//!
//! State: a momentum buffer per parameter when the momentum is non-zero, created at the first
//! step (PyTorch clones the gradient into it then). Implementations: single, foreach, fused; on
//! the CPU through `kernels`, on CUDA through `cuda/sgd.rs`.

use std::collections::HashMap;

use headroom_autograd_core::{DType, Tensor};

use crate::device::{DeviceKind, StepDevice, StepScaling};
use crate::error::OptimError;
use crate::host::{foreach_scratch, host_slice, host_slice_mut, scratch, zeros_like_shape};
use crate::kernels::{sgd_foreach, sgd_fused, sgd_single, GradScaling, SgdBuffers, SgdConfig};
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
/// `param` and `grad` are disjoint checked CPU f32 tensors; the state tensors were allocated
/// by this crate for this parameter; nothing else touches them during the step.
unsafe fn buffers<'a>(
    param: &'a Tensor,
    grad: &'a Tensor,
    state: &'a SgdState,
    step: u64,
) -> SgdBuffers<'a> {
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
                    DType::F32,
                )?)
            } else {
                None
            },
        })
    }
}

/// The host side: the `kernels` functions on the tensors' memory.
fn step_on_host(
    cfg: &SgdConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, SgdState>],
    scaling: GradScaling,
) -> Result<(), OptimError> {
    // SAFETY (every `buffers` call below): the optimizer checked each item's param and grad
    // (CPU, f32, contiguous, disjoint) and owns the state tensors; the step runs on this thread.
    match implementation {
        Implementation::Foreach { chunk } => {
            let Some(tmp) = foreach_scratch(items.iter().map(|it| it.param), chunk)? else {
                return Ok(());
            };
            let mut bufs: Vec<SgdBuffers<'_>> = items
                .iter()
                // SAFETY: see above.
                .map(|it| unsafe { buffers(it.param, &it.grad, &*it.state, it.step) })
                .collect();
            // SAFETY: the scratch is a fresh tensor of this call.
            sgd_foreach(cfg, &mut bufs, unsafe { host_slice_mut(&tmp) })
        }
        Implementation::Fused => {
            for it in items.iter() {
                // SAFETY: see above.
                let bufs = unsafe { buffers(it.param, &it.grad, &*it.state, it.step) };
                sgd_fused(cfg, bufs, scaling)?;
            }
            Ok(())
        }
        _ => {
            for it in items.iter() {
                // SAFETY: see above.
                let bufs = unsafe { buffers(it.param, &it.grad, &*it.state, it.step) };
                let tmp = scratch(it.param, it.param.numel())?;
                // SAFETY: a fresh tensor of this call, not shared.
                sgd_single(cfg, bufs, unsafe { host_slice_mut(&tmp) })?;
            }
            Ok(())
        }
    }
}
