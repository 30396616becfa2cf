//! `torch.optim.SGD` over autograd-core parameters: the [`UpdateRule`] of [`SgdConfig`].
//!
//! State: a momentum buffer per parameter when the momentum is non-zero, created at the first
//! step (PyTorch clones the gradient into it then). Implementations: single, foreach, fused.

use std::collections::HashMap;

use headroom_autograd_core::{DType, Tensor};

use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, scratch, zeros_like_shape};
use crate::kernels::{
    sgd_foreach, sgd_fused, sgd_single, GradScaling, SgdBuffers, SgdConfig, StepOutcome,
};
use crate::optimizer::{
    take_state, ForeachItem, GroupOptimizer, Implementation, NamedTensors, UpdateRule,
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

    fn step_one(
        &self,
        implementation: Implementation,
        step: u64,
        param: &Tensor,
        grad: &Tensor,
        state: &mut SgdState,
        scaling: GradScaling,
    ) -> Result<StepOutcome, OptimError> {
        // SAFETY: the optimizer checked param and grad (CPU, f32, contiguous, disjoint) and owns
        // the state tensors; the step runs on this thread only.
        let bufs = unsafe { buffers(param, grad, state, step) };
        match implementation {
            Implementation::Fused => sgd_fused(self, bufs, scaling),
            _ => {
                let tmp = scratch(param, param.numel())?;
                // SAFETY: a fresh tensor of this call, not shared.
                sgd_single(self, bufs, unsafe { host_slice_mut(&tmp) })?;
                Ok(StepOutcome::Stepped)
            }
        }
    }

    fn step_foreach(
        &self,
        chunk: Option<usize>,
        items: &mut [ForeachItem<'_, SgdState>],
    ) -> Result<(), OptimError> {
        let total: usize = items.iter().map(|it| it.param.numel()).sum();
        let len = chunk.map_or(total, |c| c.min(total));
        let Some(first) = items.first() else {
            return Ok(());
        };
        let tmp = scratch(first.param, len)?;
        // SAFETY: every item's tensors were checked by the optimizer and are distinct; the
        // scratch is a fresh tensor of this call.
        let mut bufs: Vec<SgdBuffers<'_>> = items
            .iter()
            .map(|it| unsafe { buffers(it.param, &it.grad, &*it.state, it.step) })
            .collect();
        // SAFETY: as above.
        sgd_foreach(self, &mut bufs, unsafe { host_slice_mut(&tmp) })
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
