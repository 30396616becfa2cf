//! What the attention paths share: the operand description of `kernels/attention.cuh`
//! ([`AttnArgs`]: sizes with the key/value head count, causal flag, scale, per operand an element
//! offset and batch, head and row strides, so strided `[batch, heads, rows, head_dim]` views are
//! read in place, the device address of packed sequences' `cu_seqlens`, and dropout's draw), and
//! the kernel parameter of a view's buffer.
//!
//! This module sits on the ground floor only; the paths (`register_tiled.rs`, `tensor_core.rs`,
//! `gemm.rs`) import it, and it imports none of them.

use cudarc::driver::DeviceRepr;
use headroom_autograd_core::{AttentionDims, AttentionForward, Result, TensorError, View};

use crate::launch::Param;
use crate::operands::element_address;

/// One operand: element offset and batch/head/row strides.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AttnOperand {
    offset: u64,
    strides: [u64; 3],
}

/// `AttnArgs` of `attention.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct AttnArgs {
    batch: u32,
    heads: u32,
    queries: u32,
    keys: u32,
    head_dim: u32,
    causal: u32,
    /// Every operand's rows start 4-element aligned: the kernels move 4 elements at a time.
    vector: u32,
    kv_heads: u32,
    scale: f64,
    /// q, k, v, out, dout, dq, dk, dv.
    ops: [AttnOperand; 8],
    /// Device address of packed sequences' I32 `cu_seqlens`, or 0.
    cu_seqlens: u64,
    n_seqs: u32,
    pad: u32,
    /// Device address of the launch's tile order (the tensor-core kernels, packed sequences), or 0.
    tile_order: u64,
    /// Dropout's stream, the draw's first counter and the kept probabilities' factor.
    dropout_seed: u64,
    dropout_offset: u64,
    dropout_scale: f64,
    /// `DropoutDraw::keep_threshold`; 0 without dropout.
    dropout_threshold: u32,
    dropout_pad: u32,
}

impl AttnArgs {
    /// The same arguments with the launch's tiles taken in the order of the U32 array at device
    /// address `address` (a permutation of the grid's x extent).
    pub(crate) fn with_tile_order(mut self, address: u64) -> AttnArgs {
        self.tile_order = address;
        self
    }
}

// SAFETY: `repr(C)`, plain integers and a double, laid out exactly like `AttnArgs` in
// `kernels/attention.cu`; passed by value as a kernel parameter.
unsafe impl DeviceRepr for AttnArgs {}

fn operand(view: &View<'_>) -> AttnOperand {
    let s = view.layout.strides();
    AttnOperand {
        offset: view.layout.offset() as u64,
        strides: [s[0] as u64, s[1] as u64, s[2] as u64],
    }
}

/// `value` as one of the kernels' 32-bit sizes.
pub(crate) fn to_u32(value: usize) -> Result<u32> {
    value.try_into().map_err(|_| TensorError::InvalidArgument {
        op: "attention",
        reason: format!("size {value} exceeds the kernels' 32-bit sizes"),
    })
}

/// `AttnArgs` for `views` (in the order of its operand slots: q, k, v, out, dout, dq, dk, dv),
/// with the 4-element vector flag set when every operand allows it.
pub(crate) fn attn_args(
    dims: &AttentionDims,
    forward: &AttentionForward<'_>,
    views: &[View<'_>],
) -> Result<AttnArgs> {
    let mut args = AttnArgs {
        batch: to_u32(dims.batch)?,
        heads: to_u32(dims.heads)?,
        queries: to_u32(dims.queries)?,
        keys: to_u32(dims.keys)?,
        head_dim: to_u32(dims.head_dim)?,
        causal: u32::from(forward.causal),
        vector: 0,
        kv_heads: to_u32(dims.kv_heads)?,
        scale: forward.scale,
        ops: [AttnOperand::default(); 8],
        cu_seqlens: forward
            .packed
            .map_or(0, |packed| element_address(&packed.cu_seqlens)),
        n_seqs: to_u32(forward.packed.map_or(0, |packed| packed.host.len() - 1))?,
        pad: 0,
        tile_order: 0,
        dropout_seed: forward.dropout.map_or(0, |draw| draw.seed),
        dropout_offset: forward.dropout.map_or(0, |draw| draw.offset),
        dropout_scale: forward.dropout.map_or(1.0, |draw| draw.scale()),
        dropout_threshold: forward.dropout.map_or(0, |draw| draw.keep_threshold()),
        dropout_pad: 0,
    };
    let element = forward.q.dtype.size_in_bytes() as u64;
    let mut aligned = dims.head_dim.is_multiple_of(4);
    for (slot, view) in args.ops.iter_mut().zip(views) {
        *slot = operand(view);
        aligned &= slot.offset.is_multiple_of(4)
            && slot.strides.iter().all(|s| s.is_multiple_of(4))
            && view.buffer.address().is_multiple_of(4 * element);
    }
    args.vector = u32::from(aligned);
    Ok(args)
}

/// A kernel parameter for `view`'s buffer (the offsets travel in `AttnArgs`).
pub(crate) fn address(view: &View<'_>) -> Param {
    Param::U64(view.buffer.address())
}
