//! `torch.optim.Adam` and `AdamW` over autograd-core parameters: the [`UpdateRule`] of
//! [`AdamConfig`].
//!
//! State per parameter: `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad), of the
//! parameter's dtype (f32, bf16 or f16; arithmetic is f32), created at its first step — AdamW's
//! first step on a 1024×1024 f32 weight adds exactly 8,388,608 bytes, on a bf16 one 4,194,304. Implementations: single (a temporary of one parameter), foreach
//! (temporaries bounded by the chunk), fused (none); on the CPU through `kernels`, on CUDA
//! through `cuda/adam.rs` with the same operations.

use std::collections::HashMap;

use headroom_autograd_core::{DType, Element, Tensor};

use crate::device::{DeviceKind, StepDevice, StepScaling};
use crate::error::OptimError;
use crate::host::{foreach_scratch, host_slice, host_slice_mut, scratch, zeros_like_shape};
use crate::kernels::{
    adam_foreach, adam_fused, adam_scratch_len, adam_single, bf16, f16, AdamBuffers, AdamConfig,
    GradScaling, ParamElement,
};
use crate::optimizer::{
    take_state, GroupOptimizer, Implementation, NamedTensors, StepItem, UpdateRule,
};

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

/// # Safety
/// As for SGD's `buffers`: checked, disjoint tensors used by this thread only.
unsafe fn buffers<'a, T: ParamElement + Element>(
    param: &'a Tensor,
    grad: &'a Tensor,
    state: &'a AdamState,
) -> AdamBuffers<'a, T> {
    // SAFETY: forwarded from the caller.
    unsafe {
        AdamBuffers {
            param: host_slice_mut(param),
            grad: host_slice(grad),
            exp_avg: host_slice_mut(&state.exp_avg),
            exp_avg_sq: host_slice_mut(&state.exp_avg_sq),
            max_exp_avg_sq: state.max_exp_avg_sq.as_ref().map(|t| host_slice_mut(t)),
        }
    }
}

impl UpdateRule for AdamConfig {
    type State = AdamState;
    const NAME: &'static str = "Adam";
    const DTYPES: &'static [DType] = &[DType::F32, DType::BF16, DType::F16];

    fn validate(&self) -> Result<(), OptimError> {
        AdamConfig::validate(self)
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

    fn init_state(&self, _: Implementation, param: &Tensor) -> Result<AdamState, OptimError> {
        Ok(AdamState {
            exp_avg: zeros_like_shape(param, param.shape())?,
            exp_avg_sq: zeros_like_shape(param, param.shape())?,
            max_exp_avg_sq: if self.amsgrad {
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
        items: &mut [StepItem<'_, AdamState>],
        scaling: StepScaling<'_>,
    ) -> Result<(), OptimError> {
        match &mut device.kind {
            DeviceKind::Host => step_on_host(self, implementation, items, scaling.host()),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => {
                crate::cuda::adam::step(cuda, self, implementation, items, scaling)
            }
        }
    }

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

    fn state_from_tensors(
        &self,
        param: &Tensor,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<AdamState, OptimError> {
        let (shape, dtype) = (param.shape(), param.dtype());
        Ok(AdamState {
            exp_avg: take_state(&mut tensors, "exp_avg", shape, dtype)?,
            exp_avg_sq: take_state(&mut tensors, "exp_avg_sq", shape, dtype)?,
            max_exp_avg_sq: if self.amsgrad {
                Some(take_state(&mut tensors, "max_exp_avg_sq", shape, dtype)?)
            } else {
                None
            },
        })
    }
}

/// The host side: the `kernels` functions on the tensors' memory, for the items' dtype.
fn step_on_host(
    cfg: &AdamConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, AdamState>],
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
    cfg: &AdamConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, AdamState>],
    scaling: GradScaling,
) -> Result<(), OptimError> {
    match implementation {
        Implementation::Foreach { chunk } => {
            let Some(tmp) = foreach_scratch(items.iter().map(|it| it.param), chunk)? else {
                return Ok(());
            };
            let mut bufs: Vec<(u64, AdamBuffers<'_, T>)> = items
                .iter()
                .map(|it| {
                    // SAFETY: every item's tensors were checked by the optimizer and are
                    // distinct; the scratch is a fresh tensor of this call.
                    let bufs = unsafe { buffers::<T>(it.param, &it.grad, &*it.state) };
                    (it.step, bufs)
                })
                .collect();
            // SAFETY: as above.
            adam_foreach(cfg, &mut bufs, unsafe { host_slice_mut(&tmp) })
        }
        Implementation::Fused => {
            for it in items.iter() {
                // SAFETY: the optimizer checked param and grad (CPU, of `T`, contiguous, disjoint)
                // and owns the state tensors; the step runs on this thread only.
                let bufs = unsafe { buffers::<T>(it.param, &it.grad, &*it.state) };
                adam_fused(cfg, it.step, bufs, scaling)?;
            }
            Ok(())
        }
        _ => {
            for it in items.iter() {
                // SAFETY: as above.
                let bufs = unsafe { buffers::<T>(it.param, &it.grad, &*it.state) };
                let tmp = scratch(it.param, adam_scratch_len(it.param.numel()))?;
                // SAFETY: a fresh tensor of this call, not shared.
                adam_single(cfg, it.step, bufs, unsafe { host_slice_mut(&tmp) })?;
            }
            Ok(())
        }
    }
}
