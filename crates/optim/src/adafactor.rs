//! `torch.optim.Adafactor` over autograd-core parameters: the [`UpdateRule`] of
//! [`AdafactorConfig`].
//!
//! State per parameter: `row_var` `[..., rows]` and `col_var` `[..., cols]` for a tensor of two
//! or more dims, `variance` for a vector. The single form holds one parameter's worth of
//! temporaries (the variance estimate and update, as PyTorch does); fused keeps O(rows + cols).
//! Adafactor has no foreach kernel (its update needs whole-tensor norms): foreach runs
//! parameters whose temporaries fit the chunk through the single form and larger ones through
//! the fused form (`driver::single_or_fused`), so its temporaries stay bounded. This file holds
//! the rule's pieces only — its state and its host kernels ([`HostKernels`]); `cuda/adafactor.rs`
//! holds the CUDA side.

use headroom_autograd_core::{DType, Tensor};

use crate::driver::{host_step, Form, HostKernels};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, zeros_like, zeros_like_shape};
use crate::kernels::{
    adafactor_fused, adafactor_scratch_len, adafactor_single, AdafactorBuffers, AdafactorConfig,
};
use crate::optimizer::GroupOptimizer;
use crate::rule::{rule_items, SavedTensors, UpdateRule};
use crate::step::{NamedTensors, StepItem};

/// Adafactor over parameter groups.
pub type Adafactor = GroupOptimizer<AdafactorConfig>;

/// Adafactor's per-parameter state.
#[derive(Debug)]
pub enum AdafactorState {
    /// Row and column second moments of a tensor of two or more dims.
    Factored {
        /// `[..., rows]`.
        row_var: Tensor,
        /// `[..., cols]`.
        col_var: Tensor,
    },
    /// Per-element second moment of a vector.
    Full {
        /// Like the parameter.
        variance: Tensor,
    },
}

fn factored_shapes(shape: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    if shape.len() < 2 {
        return None;
    }
    let lead = &shape[..shape.len() - 2];
    let mut rows = lead.to_vec();
    rows.push(shape[shape.len() - 2]);
    let mut cols = lead.to_vec();
    cols.push(shape[shape.len() - 1]);
    Some((rows, cols))
}

impl UpdateRule for AdafactorConfig {
    type State = AdafactorState;
    rule_items!(name: "Adafactor", dtypes: &[DType::F32], host: host_step::<f32, _>);

    fn state_tensors(state: &AdafactorState) -> NamedTensors {
        match state {
            AdafactorState::Factored { row_var, col_var } => {
                vec![("row_var", row_var.clone()), ("col_var", col_var.clone())]
            }
            AdafactorState::Full { variance } => vec![("variance", variance.clone())],
        }
    }

    fn init_state(&self, param: &Tensor) -> Result<AdafactorState, OptimError> {
        Ok(match factored_shapes(param.shape()) {
            Some((rows, cols)) => AdafactorState::Factored {
                row_var: zeros_like_shape(param, &rows)?,
                col_var: zeros_like_shape(param, &cols)?,
            },
            None => AdafactorState::Full {
                variance: zeros_like(param)?,
            },
        })
    }

    fn state_from_tensors(&self, saved: &mut SavedTensors) -> Result<AdafactorState, OptimError> {
        Ok(match factored_shapes(saved.param().shape()) {
            Some((rows, cols)) => AdafactorState::Factored {
                row_var: saved.take("row_var", &rows, DType::F32)?,
                col_var: saved.take("col_var", &cols, DType::F32)?,
            },
            None => AdafactorState::Full {
                variance: saved.take_like("variance")?,
            },
        })
    }
}

impl HostKernels<f32> for AdafactorConfig {
    type Buffers<'a> = (u64, AdafactorBuffers<'a>);
    const FOREACH_KERNEL: bool = false;

    unsafe fn buffers<'a>(item: &'a StepItem<'_, AdafactorState>) -> Self::Buffers<'a> {
        // SAFETY: forwarded from the caller.
        let (row_var, col_var, variance) = unsafe {
            match &*item.state {
                AdafactorState::Factored { row_var, col_var } => (
                    Some(host_slice_mut(row_var)),
                    Some(host_slice_mut(col_var)),
                    None,
                ),
                AdafactorState::Full { variance } => (None, None, Some(host_slice_mut(variance))),
            }
        };
        // SAFETY: forwarded from the caller.
        let (param, grad) = unsafe { (host_slice_mut(item.param), host_slice(&item.grad)) };
        let shape = item.param.shape();
        let bufs = AdafactorBuffers {
            param,
            grad,
            shape,
            row_var,
            col_var,
            variance,
        };
        (item.step, bufs)
    }

    fn scratch_len(param: &Tensor) -> usize {
        adafactor_scratch_len(param.shape())
    }

    fn run(&self, (step, bufs): Self::Buffers<'_>, form: Form<'_, f32>) -> Result<(), OptimError> {
        match form {
            Form::Single(scratch) => adafactor_single(self, step, bufs, scratch),
            Form::Fused(scaling) => adafactor_fused(self, step, bufs, scaling).map(drop),
        }
    }
}
