//! `torch.optim.SGD` over autograd-core parameters: the [`UpdateRule`] of [`SgdConfig`].
//!
//! State: a momentum buffer per parameter when the momentum is non-zero, created at the first
//! step (PyTorch clones the gradient into it then). Implementations: single, foreach (bounded
//! or not), fused. This file holds the rule's pieces only — its state, and which slices go to
//! which `kernels` function on the host ([`HostKernels`]); the shared driver (`driver.rs`) does
//! the rest, and `cuda/sgd.rs` holds the CUDA pieces. Parameters may be f32, bf16 or f16; the
//! buffer has the parameter's dtype (2 bytes per element for bf16), arithmetic is f32.

use headroom_autograd_core::{Element, Tensor};

use crate::driver::{host_step_floats, Form, HostKernels, FLOATS};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, zeros_like};
use crate::kernels::{sgd_foreach, sgd_fused, sgd_single, ParamElement, SgdBuffers, SgdConfig};
use crate::optimizer::GroupOptimizer;
use crate::rule::{rule_items, SavedTensors, UpdateRule};
use crate::step::{NamedTensors, StepItem};

/// SGD over parameter groups.
pub type Sgd = GroupOptimizer<SgdConfig>;

/// SGD's per-parameter state.
#[derive(Debug)]
pub struct SgdState {
    /// `momentum_buffer`, when the momentum is non-zero.
    pub momentum_buffer: Option<Tensor>,
}

impl UpdateRule for SgdConfig {
    type State = SgdState;
    rule_items!(name: "SGD", dtypes: FLOATS, host: host_step_floats);

    fn state_tensors(state: &SgdState) -> NamedTensors {
        state
            .momentum_buffer
            .iter()
            .map(|b| ("momentum_buffer", b.clone()))
            .collect()
    }

    fn init_state(&self, param: &Tensor) -> Result<SgdState, OptimError> {
        let momentum_buffer = self.has_momentum().then(|| zeros_like(param));
        Ok(SgdState {
            momentum_buffer: momentum_buffer.transpose()?,
        })
    }

    fn state_from_tensors(&self, saved: &mut SavedTensors) -> Result<SgdState, OptimError> {
        Ok(SgdState {
            momentum_buffer: saved.take_like_if(self.has_momentum(), "momentum_buffer")?,
        })
    }
}

impl<T: ParamElement + Element> HostKernels<T> for SgdConfig {
    /// SGD's kernels need of the step number only whether it is the first (in the buffers).
    type Buffers<'a> = SgdBuffers<'a, T>;
    const FOREACH_KERNEL: bool = true;

    unsafe fn buffers<'a>(item: &'a StepItem<'_, SgdState>) -> SgdBuffers<'a, T> {
        let momentum_buffer = item.state.momentum_buffer.as_ref();
        // SAFETY: forwarded from the caller.
        unsafe {
            SgdBuffers {
                param: host_slice_mut(item.param),
                grad: host_slice(&item.grad),
                momentum_buffer: momentum_buffer.map(|b| host_slice_mut(b)),
                first_step: item.step == 1,
            }
        }
    }

    fn run(&self, bufs: SgdBuffers<'_, T>, form: Form<'_, T>) -> Result<(), OptimError> {
        match form {
            Form::Single(scratch) => sgd_single(self, bufs, scratch),
            Form::Fused(scaling) => sgd_fused(self, bufs, scaling).map(drop),
        }
    }

    fn foreach(
        &self,
        mut bufs: Vec<SgdBuffers<'_, T>>,
        scratch: &mut [T],
    ) -> Result<(), OptimError> {
        sgd_foreach(self, &mut bufs, scratch)
    }
}
