//! What the attention paths share: the operand description of `kernels/attention.cuh`
//! ([`AttnArgs`]: sizes with the key/value head count, causal flag, scale, per operand an element
//! offset and batch, head and row strides, so strided `[batch, heads, rows, head_dim]` views are
//! read in place, the device address of packed sequences' `cu_seqlens`, and dropout's draw), the
//! order packed sequences' tiles run in (heaviest first), and the kernel parameter of a view's
//! buffer.
//!
//! This module sits on the ground floor only; the paths (`register_tiled.rs`, `tensor_core.rs`,
//! `wgmma.rs`, `gemm.rs`) import it, and it imports none of them.

use cudarc::driver::DeviceRepr;
use headroom_autograd_core::{AttentionDims, AttentionForward, DType, Result, TensorError, View};

use crate::device::CudaBackend;
use crate::launch::Param;
use crate::operands::element_address;
use crate::scratch::Scratch;

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

/// The Hopper kernels' (`wgmma.rs`, `warp_specialized.rs`) suffix and padded head dim for
/// `dtype` (f16, else bf16) and `head_dim` (at most 128): one build a dtype and padded head dim.
pub(crate) fn hopper_variant(dtype: DType, head_dim: usize) -> (&'static str, usize) {
    let padded = if head_dim <= 64 { 64 } else { 128 };
    let suffix = match (dtype == DType::F16, padded == 64) {
        (true, true) => "f16_64",
        (true, false) => "f16_128",
        (false, true) => "bf16_64",
        (false, false) => "bf16_128",
    };
    (suffix, padded)
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

/// A kernel's own rows per block and the rows of the other side it streams at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TileShape {
    pub(crate) rows: usize,
    pub(crate) streamed: usize,
}

/// The tiles of `rows` own rows, `shape.rows` a tile, heaviest first, for packed sequences
/// (`bounds`: the host's `cu_seqlens`): a tile's work is the number of streamed tiles its rows
/// meet (`block_range` of `attention.cuh`: from the first row's first to the last row's end),
/// which depends on the tile's place in its own sequence. Own rows are queries (`own_queries`,
/// the forward and dQ kernels) or keys (dK/dV). Ties keep the tiles' order.
fn packed_tile_order(
    bounds: &[i32],
    own_queries: bool,
    causal: bool,
    rows: usize,
    shape: TileShape,
) -> Vec<u32> {
    // The other side's rows that own `row` meets, as `rows_met` of attention.cuh.
    let met = |row: usize| {
        let sequence = bounds
            .partition_point(|&b| b as usize <= row)
            .saturating_sub(1);
        let (first, end) = (bounds[sequence] as usize, bounds[sequence + 1] as usize);
        match (own_queries, causal) {
            (true, true) => (first, row + 1),
            (false, true) => (row, end),
            _ => (first, end),
        }
    };
    let tiles = rows.div_ceil(shape.rows);
    let work: Vec<usize> = (0..tiles)
        .map(|tile| {
            let first = tile * shape.rows;
            let last = (first + shape.rows).min(rows) - 1;
            let (lo, _) = met(first);
            let (_, hi) = met(last);
            hi.saturating_sub(lo).div_ceil(shape.streamed)
        })
        .collect();
    let mut order: Vec<u32> = (0..tiles as u32).collect();
    order.sort_by_key(|&tile| std::cmp::Reverse(work[tile as usize]));
    order
}

/// `args` with a launch's tiles in [`packed_tile_order`] when the attention is packed (own rows
/// queries when `own_queries`, else keys; `rows` of them, `shape` the kernel's tiles), and the
/// device scratch holding the order (kept until the launch is queued; freed in stream order).
pub(crate) fn with_tiles_heaviest_first<'b>(
    backend: &'b CudaBackend,
    args: AttnArgs,
    f: &AttentionForward<'_>,
    own_queries: bool,
    rows: usize,
    shape: TileShape,
) -> Result<(AttnArgs, Option<Scratch<'b>>)> {
    let Some(packed) = f.packed else {
        return Ok((args, None));
    };
    let order = packed_tile_order(packed.host, own_queries, f.causal, rows, shape);
    let scratch = Scratch::new(backend, (order.len() * 4) as u64)?;
    // SAFETY: the scratch is live memory of this backend, `order.len()` u32 long, and stays
    // allocated until the caller has queued its launch (inside a capture it is the capture's
    // pool's, kept for the graph's life); the copy is stream-ordered before the launch.
    unsafe { backend.write_for_replays(scratch.address(), bytemuck::cast_slice(&order)) }?;
    Ok((args.with_tile_order(scratch.address()), Some(scratch)))
}

/// A kernel parameter for `view`'s buffer (the offsets travel in `AttnArgs`).
pub(crate) fn address(view: &View<'_>) -> Param {
    Param::U64(view.buffer.address())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed tiles come heaviest first, every tile once: a query tile at the end of a long
    /// sequence meets all of its keys (causal), one at the start of a sequence few; key tiles
    /// the transpose; without the causal mask a tile meets its sequences' whole length.
    #[test]
    fn packed_tiles_are_ordered_heaviest_first() {
        // Sequences of 100, 300 and 28 tokens; tiles of 64 own rows, 64 streamed.
        let bounds = [0, 100, 400, 428];
        let shape = TileShape {
            rows: 64,
            streamed: 64,
        };
        // Query tiles (causal): [0, 64) meets keys 0..64 (1 tile); [64, 128) spans sequences
        // 0 and 1: keys 0..128 (2); [128, 192) 100..192 (2); [192, 256) 100..256 (3);
        // [256, 320) 100..320 (4); [320, 384) 100..384 (5); [384, 428) 100..428 (6, past the
        // last sequence's start: its rows meet their own sequence only, the union does not).
        assert_eq!(
            packed_tile_order(&bounds, true, true, 428, shape),
            vec![6, 5, 4, 3, 1, 2, 0]
        );
        // Key tiles (causal): [0, 64) meets queries 0..100 (2); [64, 128) 64..400 (6);
        // [128, 192) 128..400 (5); [192, 256) 4 tiles; [256, 320) 3; [320, 384) 2; [384, 428)
        // 384..428 (1).
        assert_eq!(
            packed_tile_order(&bounds, false, true, 428, shape),
            vec![1, 2, 3, 4, 0, 5, 6]
        );
        // Not causal: each tile meets its first row's sequence start to its last row's end:
        // [0, 64) 0..100 (2), [64, 128) 0..400 (7), the next four 100..400 (5), [384, 428)
        // 100..428 (6).
        assert_eq!(
            packed_tile_order(&bounds, true, false, 428, shape),
            vec![1, 6, 2, 3, 4, 5, 0]
        );
    }
}
