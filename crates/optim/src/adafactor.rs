//! `torch.optim.Adafactor` over autograd-core parameters: the [`UpdateRule`] of
//! [`AdafactorConfig`].
//!
//! State per parameter: `row_var` `[..., rows]` and `col_var` `[..., cols]` for a tensor of two
//! or more dims, `variance` for a vector. The single form holds one parameter's worth of
//! temporaries (the variance estimate and update, as PyTorch does); foreach runs parameters
//! whose temporaries fit the chunk through the single form and larger ones through the fused
//! form, so its temporaries stay bounded; fused keeps O(rows + cols).

use std::collections::HashMap;

use headroom_autograd_core::{DType, Tensor};

use crate::device::{DeviceKind, StepDevice, StepScaling};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, scratch, zeros_like_shape};
use crate::kernels::{
    adafactor_fused, adafactor_scratch_len, adafactor_single, AdafactorBuffers, AdafactorConfig,
    GradScaling,
};
use crate::optimizer::{
    take_state, GroupOptimizer, Implementation, NamedTensors, StepItem, UpdateRule,
};

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

/// # Safety
/// As for SGD's `buffers`: checked, disjoint tensors used by this thread only.
unsafe fn buffers<'a>(
    param: &'a Tensor,
    grad: &'a Tensor,
    state: &'a AdafactorState,
) -> AdafactorBuffers<'a> {
    // SAFETY: forwarded from the caller.
    unsafe {
        let (row_var, col_var, variance) = match state {
            AdafactorState::Factored { row_var, col_var } => (
                Some(host_slice_mut(row_var)),
                Some(host_slice_mut(col_var)),
                None,
            ),
            AdafactorState::Full { variance } => (None, None, Some(host_slice_mut(variance))),
        };
        AdafactorBuffers {
            param: host_slice_mut(param),
            grad: host_slice(grad),
            shape: param.shape(),
            row_var,
            col_var,
            variance,
        }
    }
}

impl UpdateRule for AdafactorConfig {
    type State = AdafactorState;
    const NAME: &'static str = "Adafactor";

    fn validate(&self) -> Result<(), OptimError> {
        AdafactorConfig::validate(self)
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

    fn init_state(&self, _: Implementation, param: &Tensor) -> Result<AdafactorState, OptimError> {
        Ok(match factored_shapes(param.shape()) {
            Some((rows, cols)) => AdafactorState::Factored {
                row_var: zeros_like_shape(param, &rows)?,
                col_var: zeros_like_shape(param, &cols)?,
            },
            None => AdafactorState::Full {
                variance: zeros_like_shape(param, param.shape())?,
            },
        })
    }

    fn step(
        &self,
        device: &mut StepDevice,
        implementation: Implementation,
        items: &mut [StepItem<'_, AdafactorState>],
        scaling: StepScaling<'_>,
    ) -> Result<(), OptimError> {
        match &mut device.kind {
            DeviceKind::Host => step_on_host(self, implementation, items, scaling.host()),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => {
                crate::cuda::adafactor::step(cuda, self, implementation, items, scaling)
            }
        }
    }

    fn state_tensors(state: &AdafactorState) -> NamedTensors {
        match state {
            AdafactorState::Factored { row_var, col_var } => {
                vec![("row_var", row_var.clone()), ("col_var", col_var.clone())]
            }
            AdafactorState::Full { variance } => vec![("variance", variance.clone())],
        }
    }

    fn state_from_tensors(
        &self,
        param: &Tensor,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<AdafactorState, OptimError> {
        Ok(match factored_shapes(param.shape()) {
            Some((rows, cols)) => AdafactorState::Factored {
                row_var: take_state(&mut tensors, "row_var", &rows, DType::F32)?,
                col_var: take_state(&mut tensors, "col_var", &cols, DType::F32)?,
            },
            None => AdafactorState::Full {
                variance: take_state(&mut tensors, "variance", param.shape(), DType::F32)?,
            },
        })
    }
}

/// The host side: the `kernels` functions on the tensors' memory.
fn step_on_host(
    cfg: &AdafactorConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, AdafactorState>],
    scaling: GradScaling,
) -> Result<(), OptimError> {
    match implementation {
        Implementation::Foreach { chunk } => foreach_on_host(cfg, chunk, items),
        Implementation::Fused => {
            for it in items.iter() {
                // SAFETY: the optimizer checked param and grad (CPU, f32, contiguous, disjoint)
                // and owns the state tensors; the step runs on this thread only.
                let bufs = unsafe { buffers(it.param, &it.grad, &*it.state) };
                adafactor_fused(cfg, it.step, bufs, scaling)?;
            }
            Ok(())
        }
        _ => {
            for it in items.iter() {
                // SAFETY: as above.
                let bufs = unsafe { buffers(it.param, &it.grad, &*it.state) };
                let tmp = scratch(it.param, adafactor_scratch_len(it.param.shape()))?;
                // SAFETY: a fresh tensor of this call, not shared.
                adafactor_single(cfg, it.step, bufs, unsafe { host_slice_mut(&tmp) })?;
            }
            Ok(())
        }
    }
}

/// Foreach on the host: parameters whose temporaries fit the chunk through the single form,
/// larger ones through the fused form.
fn foreach_on_host(
    cfg: &AdafactorConfig,
    chunk: Option<usize>,
    items: &mut [StepItem<'_, AdafactorState>],
) -> Result<(), OptimError> {
    // Unbounded: every temporary is allocated before any is used, as a tensor list would.
    let scratches = items
        .iter()
        .map(|it| {
            let len = adafactor_scratch_len(it.param.shape());
            if chunk.is_some_and(|c| len > c) {
                Ok(None)
            } else if chunk.is_none() {
                scratch(it.param, len).map(Some)
            } else {
                Ok(None)
            }
        })
        .collect::<Result<Vec<_>, OptimError>>()?;
    for (it, pre) in items.iter_mut().zip(scratches) {
        // SAFETY: the item's tensors were checked by the optimizer and are distinct.
        let bufs = unsafe { buffers(it.param, &it.grad, &*it.state) };
        let len = adafactor_scratch_len(it.param.shape());
        match (pre, chunk) {
            (Some(tmp), _) => {
                // SAFETY: a fresh tensor of this call, not shared.
                adafactor_single(cfg, it.step, bufs, unsafe { host_slice_mut(&tmp) })?;
            }
            (None, Some(c)) if len <= c => {
                let tmp = scratch(it.param, len)?;
                // SAFETY: a fresh tensor of this call, not shared.
                adafactor_single(cfg, it.step, bufs, unsafe { host_slice_mut(&tmp) })?;
            }
            _ => {
                adafactor_fused(cfg, it.step, bufs, GradScaling::NONE)?;
            }
        }
    }
    Ok(())
}
