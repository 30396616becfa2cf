//! bitsandbytes' `Adam8bit` / `AdamW8bit` over autograd-core parameters: the [`UpdateRule`] of
//! [`Adam8bitConfig`] (implementation `EightBit` only).
//!
//! State per parameter of at least [`MIN_8BIT_SIZE`] elements: `state1`, `state2` (u8 codes
//! like the parameter) and `absmax1`, `absmax2` (one f32 per block of 256) — 2.03 bytes per
//! parameter instead of 8. Smaller parameters keep f32 `state1`, `state2`. The two
//! quantization maps are built once per process.

use std::collections::HashMap;
use std::sync::OnceLock;

use headroom_autograd_core::{DType, Tensor};

use crate::device::{DeviceKind, StepDevice, StepScaling};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, zeros_like_shape};
use crate::kernels::{
    adam8bit_blockwise, adam_bnb_32bit, dynamic_map, n_blocks, non_negative, Adam8bitBuffers,
    Adam8bitConfig, GradScaling, QuantizationMap, StepOutcome, MIN_8BIT_SIZE,
};
use crate::optimizer::{
    take_state, GroupOptimizer, Implementation, NamedTensors, StepItem, UpdateRule,
};

/// 8-bit Adam over parameter groups.
pub type Adam8bit = GroupOptimizer<Adam8bitConfig>;

/// 8-bit Adam's per-parameter state.
#[derive(Debug)]
pub enum Adam8bitState {
    /// Block-wise quantized states.
    Quantized {
        /// First-state codes (signed map), u8.
        state1: Tensor,
        /// Second-state codes (unsigned map), u8.
        state2: Tensor,
        /// Per-block scales of the first state.
        absmax1: Tensor,
        /// Per-block scales of the second state.
        absmax2: Tensor,
    },
    /// f32 states of a parameter under [`MIN_8BIT_SIZE`].
    Full {
        /// First moment.
        state1: Tensor,
        /// Second moment.
        state2: Tensor,
    },
}

/// The signed and unsigned dynamic maps (`qmap1`, `qmap2`).
pub fn bnb_maps() -> &'static (QuantizationMap, QuantizationMap) {
    static MAPS: OnceLock<(QuantizationMap, QuantizationMap)> = OnceLock::new();
    MAPS.get_or_init(|| (dynamic_map(true), dynamic_map(false)))
}

impl UpdateRule for Adam8bitConfig {
    type State = Adam8bitState;
    const NAME: &'static str = "Adam8bit";

    fn validate(&self) -> Result<(), OptimError> {
        if !non_negative(self.lr)
            || !(0.0..1.0).contains(&self.betas.0)
            || !(0.0..1.0).contains(&self.betas.1)
            || !non_negative(self.eps)
            || !non_negative(self.weight_decay)
        {
            return Err(OptimError::InvalidArgument {
                op: "Adam8bitConfig",
                reason: format!("invalid hyperparameters {self:?}"),
            });
        }
        Ok(())
    }

    fn supports(&self, implementation: Implementation) -> bool {
        implementation == Implementation::EightBit
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn init_state(&self, _: Implementation, param: &Tensor) -> Result<Adam8bitState, OptimError> {
        let n = param.numel();
        if n < MIN_8BIT_SIZE {
            return Ok(Adam8bitState::Full {
                state1: zeros_like_shape(param, param.shape())?,
                state2: zeros_like_shape(param, param.shape())?,
            });
        }
        let backend = param.backend();
        Ok(Adam8bitState::Quantized {
            state1: Tensor::zeros(backend, param.shape(), DType::U8)?,
            state2: Tensor::zeros(backend, param.shape(), DType::U8)?,
            absmax1: zeros_like_shape(param, &[n_blocks(n)])?,
            absmax2: zeros_like_shape(param, &[n_blocks(n)])?,
        })
    }

    fn step(
        &self,
        device: &mut StepDevice,
        _: Implementation,
        items: &mut [StepItem<'_, Adam8bitState>],
        scaling: StepScaling<'_>,
    ) -> Result<(), OptimError> {
        match &mut device.kind {
            DeviceKind::Host => {
                for it in items.iter_mut() {
                    step_on_host(self, it.step, it.param, &it.grad, it.state, scaling.host())?;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => crate::cuda::adam8bit::step(cuda, self, items, scaling),
        }
    }

    fn state_tensors(state: &Adam8bitState) -> NamedTensors {
        match state {
            Adam8bitState::Quantized {
                state1,
                state2,
                absmax1,
                absmax2,
            } => vec![
                ("state1", state1.clone()),
                ("state2", state2.clone()),
                ("absmax1", absmax1.clone()),
                ("absmax2", absmax2.clone()),
            ],
            Adam8bitState::Full { state1, state2 } => {
                vec![("state1", state1.clone()), ("state2", state2.clone())]
            }
        }
    }

    fn state_from_tensors(
        &self,
        param: &Tensor,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<Adam8bitState, OptimError> {
        let (n, shape) = (param.numel(), param.shape());
        Ok(if n < MIN_8BIT_SIZE {
            Adam8bitState::Full {
                state1: take_state(&mut tensors, "state1", shape, DType::F32)?,
                state2: take_state(&mut tensors, "state2", shape, DType::F32)?,
            }
        } else {
            Adam8bitState::Quantized {
                state1: take_state(&mut tensors, "state1", shape, DType::U8)?,
                state2: take_state(&mut tensors, "state2", shape, DType::U8)?,
                absmax1: take_state(&mut tensors, "absmax1", &[n_blocks(n)], DType::F32)?,
                absmax2: take_state(&mut tensors, "absmax2", &[n_blocks(n)], DType::F32)?,
            }
        })
    }
}

/// The host side: the `kernels` functions on one parameter's memory.
fn step_on_host(
    cfg: &Adam8bitConfig,
    step: u64,
    param: &Tensor,
    grad: &Tensor,
    state: &mut Adam8bitState,
    scaling: GradScaling,
) -> Result<StepOutcome, OptimError> {
    // SAFETY (all blocks below): the optimizer checked param and grad (CPU, f32, contiguous,
    // disjoint) and owns the state tensors; the step runs on this thread only.
    match state {
        Adam8bitState::Quantized {
            state1,
            state2,
            absmax1,
            absmax2,
        } => {
            let (qmap1, qmap2) = bnb_maps();
            // SAFETY: see above.
            let bufs = unsafe {
                Adam8bitBuffers {
                    param: host_slice_mut(param),
                    grad: host_slice(grad),
                    state1: host_slice_mut(state1),
                    state2: host_slice_mut(state2),
                    absmax1: host_slice_mut(absmax1),
                    absmax2: host_slice_mut(absmax2),
                }
            };
            adam8bit_blockwise(cfg, step, qmap1, qmap2, bufs, scaling)
        }
        Adam8bitState::Full { state1, state2 } => {
            // SAFETY: see above.
            unsafe {
                adam_bnb_32bit(
                    cfg,
                    step,
                    host_slice_mut(param),
                    host_slice(grad),
                    host_slice_mut(state1),
                    host_slice_mut(state2),
                    scaling,
                )
            }
        }
    }
}
