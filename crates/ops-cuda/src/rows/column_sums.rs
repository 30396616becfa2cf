//! Column sums: a sum or mean over the rows of a matrix with contiguous rows (the core permutes
//! the reduced dims last, so the row kernel would read it down its columns), in two deterministic,
//! coalesced stages — per-chunk partial sums into scratch, then one thread per column adds the
//! chunks — whenever the kept and the reduced dims each merge into one run.
//!
//! This room sits on the rows family's `args.rs` and the ground floor, and imports no other room;
//! the family's entry point (`mod.rs`) decides when a reduction is one ([`column_reduction`]).

use headroom_autograd_core::{DType, ReduceOp, Result, View};

use super::args::{column_stages, scratch_bytes, ROWS_PER_CHUNK};
use crate::device::CudaBackend;
use crate::kernels::Module;
use crate::launch::{launch_in, Param, NO_ARGS};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// A sum or mean over the rows of a matrix with contiguous rows, seen as `x` `[n, rows]` with
/// strides `(1, rs)` (the core permutes the reduced dim last): `(rows, n, rs, scale)`. The row
/// kernel would read such a matrix down its columns; the column kernels read it row by row.
pub(crate) fn column_reduction(
    op: ReduceOp,
    x: &View<'_>,
    n_reduced: usize,
    out: &View<'_>,
) -> Option<(u64, u64, u64, f64)> {
    if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) || n_reduced == 0 {
        return None;
    }
    let (shape, strides) = (x.layout.shape(), x.layout.strides());
    let kept = shape.len().checked_sub(n_reduced)?;
    // The kept dims must merge into one unit-stride run of `n` columns, the reduced dims into one
    // run of `rows` rows `rs` apart (a batch sum of `[batch, seq, width]` merges seq and width).
    let (n, column_stride) = merged_run(&shape[..kept], &strides[..kept])?;
    let (rows, rs) = merged_run(&shape[kept..], &strides[kept..])?;
    let fits = column_stride == 1 && rs >= n && rows >= 2 && out_column_stride(out).is_some();
    if !fits {
        return None;
    }
    let scale = if op == ReduceOp::Mean {
        1.0 / rows as f64
    } else {
        1.0
    };
    Some((rows as u64, n as u64, rs as u64, scale))
}

/// The distance between consecutive columns of a column reduction's output: its stride when it
/// is 1-D, 1 when it is dense; `None` otherwise.
fn out_column_stride(out: &View<'_>) -> Option<u64> {
    match out.layout.ndim() {
        1 => Some(out.layout.strides()[0] as u64),
        _ if out.layout.is_contiguous() => Some(1),
        _ => None,
    }
}

/// Dims (`shape`, `strides`) as one run of (elements, stride), when they are one: size-1 dims
/// dropped, each remaining dim's stride the next one's times its size. No dims is a run of one.
fn merged_run(shape: &[usize], strides: &[usize]) -> Option<(usize, usize)> {
    let mut run: Option<(usize, usize)> = None;
    for (&size, &stride) in shape.iter().zip(strides) {
        if size == 1 {
            continue;
        }
        run = match run {
            None => Some((size, stride)),
            Some((len, inner)) if inner == stride * size => Some((len * size, stride)),
            Some(_) => return None,
        };
    }
    Some(run.unwrap_or((1, 1)))
}

/// Column sums (see [`column_reduction`]) in two deterministic stages, like the layer-norm
/// parameter gradients.
pub(crate) fn column_sums(
    backend: &CudaBackend,
    suffix: &'static str,
    x: &View<'_>,
    out: &View<'_>,
    (rows, n, rs, scale): (u64, u64, u64, f64),
) -> Result<()> {
    let op = "reduce";
    if n == 0 {
        return Ok(());
    }
    let n_chunks = rows.div_ceil(ROWS_PER_CHUNK);
    let accumulator = if x.dtype == DType::F64 { 8 } else { 4 };
    let (stage1, stage2) = column_stages(op, n, n_chunks)?;
    // Returned in stream order, after the kernels that use it.
    let scratch = Scratch::new(backend, scratch_bytes(op, &[n_chunks, n, accumulator])?)?;
    let partial = scratch.address();
    let x_address = element_address(x);
    let params = [
        Param::U64(x_address),
        Param::U64(rs),
        Param::U64(partial),
        Param::U64(rows),
        Param::U64(n),
    ];
    launch_in(
        backend,
        Module::Rows,
        op,
        ("column_partials", suffix),
        stage1,
        &params,
        NO_ARGS,
    )?;
    let out_address = element_address(out);
    let params = [
        Param::U64(partial),
        Param::U64(n_chunks),
        Param::U64(out_address),
        Param::U64(out_column_stride(out).unwrap_or(1)),
        Param::F64(scale),
        Param::U64(n),
    ];
    launch_in(
        backend,
        Module::Rows,
        op,
        ("column_finish", suffix),
        stage2,
        &params,
        NO_ARGS,
    )
}
