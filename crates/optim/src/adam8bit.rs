//! bitsandbytes' `Adam8bit` / `AdamW8bit` over autograd-core parameters: the [`UpdateRule`] of
//! [`Adam8bitConfig`], whose only implementation is [`Implementation::Fused`] (its blockwise
//! kernel is one pass; the others are an [`OptimError::Unsupported`]).
//!
//! Parameters are f32, or bf16 with no master copy: the update runs in f32 and the new value is
//! stored by the config's [`Bf16Rounding`](crate::kernels::Bf16Rounding) (to nearest, or
//! stochastically with the bits of the parameter's index in the optimizer and the step). State per
//! parameter of at least [`MIN_8BIT_SIZE`] elements: `state1`, `state2` (u8 codes like the
//! parameter) and `absmax1`, `absmax2` (one f32 per block of 256) — 2.03 bytes per parameter
//! instead of 8. Smaller parameters keep f32 `state1`, `state2`, whatever the parameter's dtype. The two
//! quantization maps are built once per process. This file holds the rule's pieces only — its
//! state and its host kernels ([`HostKernels`](crate::driver::HostKernels)); `cuda/adam8bit.rs` holds the CUDA side. The
//! state, [`BlockwiseState`], its state-dict plumbing and its host slices serve the 4-bit rule
//! (`adam4bit.rs`) too, each rule giving its [`CodeLayout`].

use std::sync::OnceLock;

use headroom_autograd_core::{DType, Element, Tensor};

use crate::driver::Form;
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut};
use crate::kernels::{
    adam8bit_blockwise, adam_bnb_32bit, dynamic_map, Adam8bitConfig, BlockwiseBuffers, F32States,
    GradScaling, ParamElement, ParamRounding, QuantizationMap, StepOutcome, BNB_BLOCK_SIZE,
    MIN_8BIT_SIZE,
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

    /// Fresh (zero) state for `param` in `layout`: f32 scales and f32 states (never the
    /// parameter's dtype, which may be bf16).
    pub(crate) fn zeros(param: &Tensor, layout: CodeLayout) -> Result<BlockwiseState, OptimError> {
        let backend = param.backend();
        let f32_zeros = |shape: &[usize]| Tensor::zeros(backend, shape, DType::F32);
        if !(layout.quantized)(param.numel()) {
            return Ok(BlockwiseState::Full {
                state1: f32_zeros(param.shape())?,
                state2: f32_zeros(param.shape())?,
            });
        }
        let (codes, blocks) = layout.shapes(param.shape());
        Ok(BlockwiseState::Quantized {
            state1: Tensor::zeros(backend, &codes, DType::U8)?,
            state2: Tensor::zeros(backend, &codes, DType::U8)?,
            absmax1: f32_zeros(&blocks)?,
            absmax2: f32_zeros(&blocks)?,
        })
    }

    /// State rebuilt from a state dict's tensors in `layout`.
    pub(crate) fn from_saved(
        saved: &mut SavedTensors,
        layout: CodeLayout,
    ) -> Result<BlockwiseState, OptimError> {
        if !(layout.quantized)(saved.param().numel()) {
            let shape = saved.param().shape().to_vec();
            return Ok(BlockwiseState::Full {
                state1: saved.take("state1", &shape, DType::F32)?,
                state2: saved.take("state2", &shape, DType::F32)?,
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

    /// The host slices of `item`, its step number and its index in the optimizer.
    ///
    /// # Safety
    /// As [`HostKernels::buffers`](crate::driver::HostKernels::buffers) for parameters of `T`.
    pub(crate) unsafe fn slices<'a, T: ParamElement + Element>(
        item: &'a StepItem<'_, BlockwiseState>,
    ) -> (u64, usize, BlockwiseSlices<'a, T>) {
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
                BlockwiseState::Full { state1, state2 } => BlockwiseSlices::Full(F32States {
                    param: host_slice_mut(param),
                    grad: host_slice(grad),
                    state1: host_slice_mut(state1),
                    state2: host_slice_mut(state2),
                }),
            }
        };
        (item.step, item.slot, slices)
    }
}

/// One parameter's host buffers under a [`BlockwiseState`]: quantised states, or the f32 states
/// of a parameter the rule does not quantise.
#[derive(Debug)]
pub(crate) enum BlockwiseSlices<'a, T: ParamElement> {
    Quantized(BlockwiseBuffers<'a, T>),
    Full(F32States<'a, T>),
}

/// The scaling of a fused call; any other form is an [`OptimError::Unsupported`] (a block-wise
/// rule's only implementation is fused).
pub(crate) fn fused_scaling<R: UpdateRule, T>(
    form: Form<'_, T>,
) -> Result<GradScaling, OptimError> {
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
/// and bf16 parameters, fused only, a [`BlockwiseState`]) and its `HostKernels`, whose one form
/// runs `$quantized(config, step, buffers, scaling, rounding)` on quantised states and
/// `$full(config, step, f32_states, scaling, rounding)` on f32 states (the rule's raw kernels,
/// generic over the parameter's element type; the rounding is the config's `bf16_rounding` for
/// the item's slot and step).
macro_rules! blockwise_rule {
    ($config:ty, $name:literal, $layout:expr, quantized: $quantized:path, full: $full:path) => {
        impl $crate::rule::UpdateRule for $config {
            type State = $crate::adam8bit::BlockwiseState;
            $crate::rule::rule_items!(
                name: $name,
                dtypes: &[
                    headroom_autograd_core::DType::F32,
                    headroom_autograd_core::DType::BF16,
                ],
                host: $crate::driver::host_step_floats
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

        impl<T> $crate::driver::HostKernels<T> for $config
        where
            T: $crate::kernels::ParamElement + headroom_autograd_core::Element,
        {
            type Buffers<'a> = (u64, usize, $crate::adam8bit::BlockwiseSlices<'a, T>);
            const FOREACH_KERNEL: bool = false;

            unsafe fn buffers<'a>(
                item: &'a $crate::step::StepItem<'_, Self::State>,
            ) -> Self::Buffers<'a> {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::adam8bit::BlockwiseState::slices(item) }
            }

            fn run(
                &self,
                (step, slot, bufs): Self::Buffers<'_>,
                form: $crate::driver::Form<'_, T>,
            ) -> Result<(), $crate::error::OptimError> {
                let scaling = $crate::adam8bit::fused_scaling::<Self, T>(form)?;
                let rounding = $crate::kernels::ParamRounding::of(self.bf16_rounding, slot, step);
                let outcome = match bufs {
                    $crate::adam8bit::BlockwiseSlices::Quantized(bufs) => {
                        $quantized(self, step, bufs, scaling, rounding)
                    }
                    $crate::adam8bit::BlockwiseSlices::Full(states) => {
                        $full(self, step, states, scaling, rounding)
                    }
                };
                outcome.map(drop)
            }
        }
    };
}

pub(crate) use blockwise_rule;

/// [`adam8bit_blockwise`] with bitsandbytes' two maps.
fn adam8bit_with_maps<T: ParamElement>(
    cfg: &Adam8bitConfig,
    step: u64,
    bufs: BlockwiseBuffers<'_, T>,
    scaling: GradScaling,
    rounding: ParamRounding,
) -> Result<StepOutcome, OptimError> {
    let (qmap1, qmap2) = bnb_maps();
    adam8bit_blockwise(cfg, step, qmap1, qmap2, bufs, scaling, rounding)
}

blockwise_rule!(
    Adam8bitConfig,
    "Adam8bit",
    BNB_LAYOUT,
    quantized: adam8bit_with_maps,
    full: adam_bnb_32bit
);
