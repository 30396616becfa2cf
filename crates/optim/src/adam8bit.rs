//! bitsandbytes' `Adam8bit` / `AdamW8bit` over autograd-core parameters: the [`UpdateRule`] of
//! [`Adam8bitConfig`], whose only implementation is [`Implementation::Fused`] (its blockwise
//! kernel is one pass; the others are an [`OptimError::Unsupported`]).
//!
//! State per parameter of at least [`MIN_8BIT_SIZE`] elements: `state1`, `state2` (u8 codes
//! like the parameter) and `absmax1`, `absmax2` (one f32 per block of 256) — 2.03 bytes per
//! parameter instead of 8. Smaller parameters keep f32 `state1`, `state2`. The two
//! quantization maps are built once per process. This file holds the rule's pieces only — its
//! state and its host kernels ([`HostKernels`](crate::driver::HostKernels)); `cuda/adam8bit.rs` holds the CUDA side. The
//! state, [`BlockwiseState`], its state-dict plumbing and its host slices serve the 4-bit rule
//! (`adam4bit.rs`) too, each rule giving its [`CodeLayout`].

use std::sync::OnceLock;

use headroom_autograd_core::{DType, Tensor};

use crate::driver::Form;
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut, zeros_like, zeros_like_shape};
use crate::kernels::{
    adam8bit_blockwise, adam_bnb_32bit, dynamic_map, Adam8bitConfig, BlockwiseBuffers, GradScaling,
    QuantizationMap, BNB_BLOCK_SIZE, MIN_8BIT_SIZE,
};
use crate::optimizer::GroupOptimizer;
use crate::rule::{SavedTensors, UpdateRule};
use crate::step::{NamedTensors, StepItem};

/// 8-bit Adam over parameter groups.
pub type Adam8bit = GroupOptimizer<Adam8bitConfig>;

/// The per-parameter state of a block-wise quantised Adam — 8-bit ([`Adam8bitConfig`]) and
/// 4-bit ([`Adam4bitConfig`](crate::Adam4bitConfig)) — under the state-dict names of its fields.
#[derive(Debug)]
pub enum BlockwiseState {
    /// Block-wise quantised states.
    Quantized {
        /// First-state codes (signed map), u8: one code a byte in the parameter's shape (8-bit),
        /// or two a byte in a flat tensor of half its elements (4-bit).
        state1: Tensor,
        /// Second-state codes (unsigned map), laid out as `state1`.
        state2: Tensor,
        /// Per-block scales of the first state.
        absmax1: Tensor,
        /// Per-block scales of the second state.
        absmax2: Tensor,
    },
    /// f32 states of a parameter the rule does not quantise.
    Full {
        /// First moment.
        state1: Tensor,
        /// Second moment.
        state2: Tensor,
    },
}

/// 8-bit Adam's per-parameter state.
pub type Adam8bitState = BlockwiseState;

/// How a block-wise rule stores a parameter's quantised states.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CodeLayout {
    /// Whether a parameter of this many elements gets quantised states.
    pub(crate) quantized: fn(usize) -> bool,
    /// Codes a byte: 1 (in the parameter's shape) or 2 (packed, flat).
    pub(crate) codes_per_byte: usize,
    /// Elements per quantisation block (one scale each).
    pub(crate) block: usize,
}

/// bitsandbytes' layout: one code a byte from [`MIN_8BIT_SIZE`] elements, blocks of 256.
const BNB_LAYOUT: CodeLayout = CodeLayout {
    quantized: |n| n >= MIN_8BIT_SIZE,
    codes_per_byte: 1,
    block: BNB_BLOCK_SIZE,
};

impl CodeLayout {
    /// The shape of one state's codes and of its scales for `param`'s shape.
    fn shapes(&self, param: &[usize]) -> (Vec<usize>, [usize; 1]) {
        let n = param.iter().product::<usize>();
        let codes = match self.codes_per_byte {
            1 => param.to_vec(),
            per_byte => vec![n / per_byte],
        };
        (codes, [n.div_ceil(self.block)])
    }
}

impl BlockwiseState {
    /// The state's tensors by name.
    pub(crate) fn tensors(&self) -> NamedTensors {
        match self {
            BlockwiseState::Quantized {
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
            BlockwiseState::Full { state1, state2 } => {
                vec![("state1", state1.clone()), ("state2", state2.clone())]
            }
        }
    }

    /// Fresh (zero) state for `param` in `layout`.
    pub(crate) fn zeros(param: &Tensor, layout: CodeLayout) -> Result<BlockwiseState, OptimError> {
        if !(layout.quantized)(param.numel()) {
            return Ok(BlockwiseState::Full {
                state1: zeros_like(param)?,
                state2: zeros_like(param)?,
            });
        }
        let (codes, blocks) = layout.shapes(param.shape());
        let backend = param.backend();
        Ok(BlockwiseState::Quantized {
            state1: Tensor::zeros(backend, &codes, DType::U8)?,
            state2: Tensor::zeros(backend, &codes, DType::U8)?,
            absmax1: zeros_like_shape(param, &blocks)?,
            absmax2: zeros_like_shape(param, &blocks)?,
        })
    }

    /// State rebuilt from a state dict's tensors in `layout`.
    pub(crate) fn from_saved(
        saved: &mut SavedTensors,
        layout: CodeLayout,
    ) -> Result<BlockwiseState, OptimError> {
        if !(layout.quantized)(saved.param().numel()) {
            return Ok(BlockwiseState::Full {
                state1: saved.take_like("state1")?,
                state2: saved.take_like("state2")?,
            });
        }
        let (codes, blocks) = layout.shapes(saved.param().shape());
        Ok(BlockwiseState::Quantized {
            state1: saved.take("state1", &codes, DType::U8)?,
            state2: saved.take("state2", &codes, DType::U8)?,
            absmax1: saved.take("absmax1", &blocks, DType::F32)?,
            absmax2: saved.take("absmax2", &blocks, DType::F32)?,
        })
    }

    /// The host slices of `item` and its step number.
    ///
    /// # Safety
    /// As [`HostKernels::buffers`](crate::driver::HostKernels::buffers) for f32 parameters.
    pub(crate) unsafe fn slices<'a>(
        item: &'a StepItem<'_, BlockwiseState>,
    ) -> (u64, BlockwiseSlices<'a>) {
        let (param, grad) = (item.param, &item.grad);
        // SAFETY: forwarded from the caller.
        let slices = unsafe {
            match &*item.state {
                BlockwiseState::Quantized {
                    state1,
                    state2,
                    absmax1,
                    absmax2,
                } => BlockwiseSlices::Quantized(BlockwiseBuffers {
                    param: host_slice_mut(param),
                    grad: host_slice(grad),
                    state1: host_slice_mut(state1),
                    state2: host_slice_mut(state2),
                    absmax1: host_slice_mut(absmax1),
                    absmax2: host_slice_mut(absmax2),
                }),
                BlockwiseState::Full { state1, state2 } => BlockwiseSlices::Full {
                    param: host_slice_mut(param),
                    grad: host_slice(grad),
                    state1: host_slice_mut(state1),
                    state2: host_slice_mut(state2),
                },
            }
        };
        (item.step, slices)
    }
}

/// One parameter's host buffers under a [`BlockwiseState`]: quantised states, or the f32 states
/// of a parameter the rule does not quantise.
#[derive(Debug)]
pub(crate) enum BlockwiseSlices<'a> {
    Quantized(BlockwiseBuffers<'a>),
    Full {
        param: &'a mut [f32],
        grad: &'a [f32],
        state1: &'a mut [f32],
        state2: &'a mut [f32],
    },
}

/// The scaling of a fused call; any other form is an [`OptimError::Unsupported`] (a block-wise
/// rule's only implementation is fused).
pub(crate) fn fused_scaling<R: UpdateRule>(form: Form<'_, f32>) -> Result<GradScaling, OptimError> {
    match form {
        Form::Fused(scaling) => Ok(scaling),
        Form::Single(_) => Err(OptimError::Unsupported {
            optimizer: R::NAME,
            reason: "only the fused implementation".into(),
        }),
    }
}

/// The signed and unsigned dynamic maps (`qmap1`, `qmap2`).
pub fn bnb_maps() -> &'static (QuantizationMap, QuantizationMap) {
    static MAPS: OnceLock<(QuantizationMap, QuantizationMap)> = OnceLock::new();
    MAPS.get_or_init(|| (dynamic_map(true), dynamic_map(false)))
}

/// A block-wise rule of `$config` named `$name`, its states in `$layout`: its [`UpdateRule`] (f32
/// parameters, fused only, a [`BlockwiseState`]) and its `HostKernels`, whose one form runs
/// `$quantized(config, step, buffers, scaling)` on quantised states and `$full(config, step,
/// param, grad, state1, state2, scaling)` on f32 states (the rule's raw kernels).
macro_rules! blockwise_rule {
    ($config:ty, $name:literal, $layout:expr, quantized: $quantized:expr, full: $full:expr) => {
        impl $crate::rule::UpdateRule for $config {
            type State = $crate::adam8bit::BlockwiseState;
            $crate::rule::rule_items!(
                name: $name,
                dtypes: &[headroom_autograd_core::DType::F32],
                host: $crate::driver::host_step::<f32, _>
            );

            fn supports(&self, implementation: $crate::step::Implementation) -> bool {
                implementation == $crate::step::Implementation::Fused
            }

            fn state_tensors(state: &Self::State) -> $crate::step::NamedTensors {
                state.tensors()
            }

            fn init_state(
                &self,
                param: &headroom_autograd_core::Tensor,
            ) -> Result<Self::State, $crate::error::OptimError> {
                $crate::adam8bit::BlockwiseState::zeros(param, $layout)
            }

            fn state_from_tensors(
                &self,
                saved: &mut $crate::rule::SavedTensors,
            ) -> Result<Self::State, $crate::error::OptimError> {
                $crate::adam8bit::BlockwiseState::from_saved(saved, $layout)
            }
        }

        impl $crate::driver::HostKernels<f32> for $config {
            type Buffers<'a> = (u64, $crate::adam8bit::BlockwiseSlices<'a>);
            const FOREACH_KERNEL: bool = false;

            unsafe fn buffers<'a>(
                item: &'a $crate::step::StepItem<'_, Self::State>,
            ) -> Self::Buffers<'a> {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::adam8bit::BlockwiseState::slices(item) }
            }

            fn run(
                &self,
                (step, bufs): Self::Buffers<'_>,
                form: $crate::driver::Form<'_, f32>,
            ) -> Result<(), $crate::error::OptimError> {
                let scaling = $crate::adam8bit::fused_scaling::<Self>(form)?;
                let outcome = match bufs {
                    $crate::adam8bit::BlockwiseSlices::Quantized(bufs) => {
                        $quantized(self, step, bufs, scaling)
                    }
                    $crate::adam8bit::BlockwiseSlices::Full {
                        param,
                        grad,
                        state1,
                        state2,
                    } => $full(self, step, param, grad, state1, state2, scaling),
                };
                outcome.map(drop)
            }
        }
    };
}

pub(crate) use blockwise_rule;

blockwise_rule!(
    Adam8bitConfig,
    "Adam8bit",
    BNB_LAYOUT,
    quantized: |cfg, step, bufs, scaling| {
        let (qmap1, qmap2) = bnb_maps();
        adam8bit_blockwise(cfg, step, qmap1, qmap2, bufs, scaling)
    },
    full: adam_bnb_32bit
);
