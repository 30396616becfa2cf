//! torchao's `Adam4bit` / `AdamW4bit` over autograd-core parameters: the
//! [`UpdateRule`](crate::UpdateRule) of [`Adam4bitConfig`], whose only implementation is
//! [`Implementation::Fused`](crate::Implementation::Fused) (the others are an
//! [`OptimError::Unsupported`](crate::OptimError::Unsupported)), on f32 parameters or bf16 ones
//! without a master copy (stored by the config's
//! [`Bf16Rounding`](crate::kernels::Bf16Rounding), as torchao's `bf16_stochastic_round` chooses);
//! the rule's items are the block-wise ones `adam8bit.rs` writes (`blockwise_rule!`).
//!
//! State per parameter torchao quantises ([`is_quantized_4bit`]: at least 4096 elements, whole
//! blocks of 128): `state1`, `state2` (two 4-bit codes a byte, flat, half the parameter's
//! elements) and `absmax1`, `absmax2` (one f32 scale per block of 128) — 1.06 bytes per
//! parameter instead of 8. Other parameters keep f32 `state1`, `state2` (torchao keeps a bf16
//! parameter's in bf16). The state type, its state-dict plumbing and its host slices are the
//! 8-bit rule's ([`BlockwiseState`], in `adam8bit.rs`) with this rule's layout. This file sits on
//! the 8-bit front end's block-wise pieces and the raw kernels (`kernels/adam4bit.rs`); `cuda/adam4bit.rs` holds the CUDA side, which this file must not
//! know.

use crate::adam8bit::{blockwise_rule, BlockwiseState, CodeLayout};
use crate::kernels::{
    adam4bit_blockwise, adam4bit_f32_states, is_quantized_4bit, Adam4bitConfig, AO_BLOCK_SIZE,
};
use crate::optimizer::GroupOptimizer;

/// 4-bit Adam (torchao's `Adam4bit`, `AdamW4bit`) over parameter groups.
pub type Adam4bit = GroupOptimizer<Adam4bitConfig>;

/// 4-bit Adam's per-parameter state.
pub type Adam4bitState = BlockwiseState;

/// torchao's layout: two codes a byte, blocks of 128, for whole blocks from 4096 elements.
const AO_LAYOUT: CodeLayout = CodeLayout {
    quantized: is_quantized_4bit,
    codes_per_byte: 2,
    block: AO_BLOCK_SIZE,
};

blockwise_rule!(
    Adam4bitConfig,
    "Adam4bit",
    AO_LAYOUT,
    quantized: adam4bit_blockwise,
    full: adam4bit_f32_states
);
