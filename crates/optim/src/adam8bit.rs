//! bitsandbytes' `Adam8bit` / `AdamW8bit` over autograd-core parameters: the [`UpdateRule`] of
//! [`Adam8bitConfig`], whose only implementation is [`Implementation::Fused`] (its blockwise
//! kernel is one pass; the others are an [`OptimError::Unsupported`]).
//!
//! State per parameter of at least [`MIN_8BIT_SIZE`] elements: `state1`, `state2` (u8 codes
//! like the parameter) and `absmax1`, `absmax2` (one f32 per block of 256) — 2.03 bytes per
//! parameter instead of 8. Smaller parameters keep f32 `state1`, `state2`. The two
//! quantization maps are built once per process. This file holds the rule's pieces only — its
//! state and its host kernels ([`HostKernels`]); `cuda/adam8bit.rs` holds the CUDA side.

use std::sync::OnceLock;

use headroom_autograd_core::{DType, Tensor};

use crate::driver::{host_step, Form, HostKernels};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, zeros_like, zeros_like_shape};
use crate::kernels::{
    adam8bit_blockwise, adam_bnb_32bit, dynamic_map, n_blocks, Adam8bitBuffers, Adam8bitConfig,
    QuantizationMap, MIN_8BIT_SIZE,
};
use crate::optimizer::GroupOptimizer;
use crate::rule::{rule_items, SavedTensors, UpdateRule};
use crate::step::{Implementation, NamedTensors, StepItem};

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
    rule_items!(name: "Adam8bit", dtypes: &[DType::F32], host: host_step::<f32, _>);

    fn supports(&self, implementation: Implementation) -> bool {
        implementation == Implementation::Fused
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

    fn init_state(&self, param: &Tensor) -> Result<Adam8bitState, OptimError> {
        let n = param.numel();
        if n < MIN_8BIT_SIZE {
            return Ok(Adam8bitState::Full {
                state1: zeros_like(param)?,
                state2: zeros_like(param)?,
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

    fn state_from_tensors(&self, saved: &mut SavedTensors) -> Result<Adam8bitState, OptimError> {
        let (n, shape) = (saved.param().numel(), saved.param().shape().to_vec());
        if n < MIN_8BIT_SIZE {
            return Ok(Adam8bitState::Full {
                state1: saved.take_like("state1")?,
                state2: saved.take_like("state2")?,
            });
        }
        Ok(Adam8bitState::Quantized {
            state1: saved.take("state1", &shape, DType::U8)?,
            state2: saved.take("state2", &shape, DType::U8)?,
            absmax1: saved.take("absmax1", &[n_blocks(n)], DType::F32)?,
            absmax2: saved.take("absmax2", &[n_blocks(n)], DType::F32)?,
        })
    }
}

/// One parameter's buffers: blockwise 8-bit states, or the f32 states of a small parameter
/// (bitsandbytes' 32-bit path).
#[derive(Debug)]
pub(crate) enum Adam8bitSlices<'a> {
    Quantized(Adam8bitBuffers<'a>),
    Full {
        param: &'a mut [f32],
        grad: &'a [f32],
        state1: &'a mut [f32],
        state2: &'a mut [f32],
    },
}

impl HostKernels<f32> for Adam8bitConfig {
    type Buffers<'a> = (u64, Adam8bitSlices<'a>);
    const FOREACH_KERNEL: bool = false;

    unsafe fn buffers<'a>(item: &'a StepItem<'_, Adam8bitState>) -> Self::Buffers<'a> {
        let (param, grad) = (item.param, &item.grad);
        // SAFETY: forwarded from the caller.
        let slices = unsafe {
            match &*item.state {
                Adam8bitState::Quantized {
                    state1,
                    state2,
                    absmax1,
                    absmax2,
                } => Adam8bitSlices::Quantized(Adam8bitBuffers {
                    param: host_slice_mut(param),
                    grad: host_slice(grad),
                    state1: host_slice_mut(state1),
                    state2: host_slice_mut(state2),
                    absmax1: host_slice_mut(absmax1),
                    absmax2: host_slice_mut(absmax2),
                }),
                Adam8bitState::Full { state1, state2 } => Adam8bitSlices::Full {
                    param: host_slice_mut(param),
                    grad: host_slice(grad),
                    state1: host_slice_mut(state1),
                    state2: host_slice_mut(state2),
                },
            }
        };
        (item.step, slices)
    }

    /// The blockwise kernel (or the 32-bit one); the optimizer admits no other form.
    fn run(&self, (step, bufs): Self::Buffers<'_>, form: Form<'_, f32>) -> Result<(), OptimError> {
        let Form::Fused(scaling) = form else {
            return Err(OptimError::Unsupported {
                optimizer: Self::NAME,
                reason: "only the fused implementation".into(),
            });
        };
        let outcome = match bufs {
            Adam8bitSlices::Quantized(bufs) => {
                let (qmap1, qmap2) = bnb_maps();
                adam8bit_blockwise(self, step, qmap1, qmap2, bufs, scaling)
            }
            Adam8bitSlices::Full {
                param,
                grad,
                state1,
                state2,
            } => adam_bnb_32bit(self, step, param, grad, state1, state2, scaling),
        };
        outcome.map(drop)
    }
}
