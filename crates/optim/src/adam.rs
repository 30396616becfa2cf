//! `torch.optim.Adam` and `AdamW` over autograd-core parameters: the [`UpdateRule`] of
//! [`AdamConfig`].
//!
//! State per parameter: `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad), of the
//! parameter's dtype (f32, bf16 or f16; arithmetic is f32), created at its first step — AdamW's
//! first step on a 1024×1024 f32 weight adds exactly 8,388,608 bytes, on a bf16 one 4,194,304.
//! Implementations: single (a temporary of one parameter), foreach (temporaries bounded by the
//! chunk, or not), fused (none). This file holds the rule's pieces only — its state, and which
//! slices go to which `kernels` function on the host ([`HostKernels`]); the shared driver
//! (`driver.rs`) does the rest, and `cuda/adam.rs` holds the CUDA pieces.

use headroom_autograd_core::{Element, Tensor};

use crate::driver::{host_step_floats, Form, HostKernels, FLOATS};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, zeros_like};
use crate::kernels::{
    adam_foreach, adam_fused, adam_single, AdamBuffers, AdamConfig, ParamElement,
};
use crate::optimizer::GroupOptimizer;
use crate::rule::{rule_items, SavedTensors, UpdateRule};
use crate::step::{NamedTensors, StepItem};

/// Adam or AdamW over parameter groups.
pub type Adam = GroupOptimizer<AdamConfig>;

/// Adam's per-parameter state.
#[derive(Debug)]
pub struct AdamState {
    /// First moment.
    pub exp_avg: Tensor,
    /// Second moment.
    pub exp_avg_sq: Tensor,
    /// Running maximum of the second moment (amsgrad).
    pub max_exp_avg_sq: Option<Tensor>,
}

impl UpdateRule for AdamConfig {
    type State = AdamState;
    rule_items!(name: "Adam", dtypes: FLOATS, host: host_step_floats);

    fn state_tensors(state: &AdamState) -> NamedTensors {
        let mut res = vec![
            ("exp_avg", state.exp_avg.clone()),
            ("exp_avg_sq", state.exp_avg_sq.clone()),
        ];
        if let Some(vmax) = &state.max_exp_avg_sq {
            res.push(("max_exp_avg_sq", vmax.clone()));
        }
        res
    }

    fn init_state(&self, param: &Tensor) -> Result<AdamState, OptimError> {
        Ok(AdamState {
            exp_avg: zeros_like(param)?,
            exp_avg_sq: zeros_like(param)?,
            max_exp_avg_sq: self.amsgrad.then(|| zeros_like(param)).transpose()?,
        })
    }

    fn state_from_tensors(&self, saved: &mut SavedTensors) -> Result<AdamState, OptimError> {
        Ok(AdamState {
            exp_avg: saved.take_like("exp_avg")?,
            exp_avg_sq: saved.take_like("exp_avg_sq")?,
            max_exp_avg_sq: saved.take_like_if(self.amsgrad, "max_exp_avg_sq")?,
        })
    }
}

impl<T: ParamElement + Element> HostKernels<T> for AdamConfig {
    type Buffers<'a> = (u64, AdamBuffers<'a, T>);
    const FOREACH_KERNEL: bool = true;

    unsafe fn buffers<'a>(item: &'a StepItem<'_, AdamState>) -> (u64, AdamBuffers<'a, T>) {
        let state = &*item.state;
        // SAFETY: forwarded from the caller.
        let bufs = unsafe {
            AdamBuffers {
                param: host_slice_mut(item.param),
                grad: host_slice(&item.grad),
                exp_avg: host_slice_mut(&state.exp_avg),
                exp_avg_sq: host_slice_mut(&state.exp_avg_sq),
                max_exp_avg_sq: state.max_exp_avg_sq.as_ref().map(|t| host_slice_mut(t)),
            }
        };
        (item.step, bufs)
    }

    fn run(&self, (step, bufs): Self::Buffers<'_>, form: Form<'_, T>) -> Result<(), OptimError> {
        match form {
            Form::Single(scratch) => adam_single(self, step, bufs, scratch),
            Form::Fused(scaling) => adam_fused(self, step, bufs, scaling).map(drop),
        }
    }

    fn foreach(
        &self,
        mut bufs: Vec<Self::Buffers<'_>>,
        scratch: &mut [T],
    ) -> Result<(), OptimError> {
        adam_foreach(self, &mut bufs, scratch)
    }
}
