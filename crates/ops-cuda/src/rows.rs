//! Launches of `kernels/rows.cu`: reductions over trailing dims, softmax along a dim (forward and
//! backward) and layer norm (forward and backward).
//!
//! Operands are described by one `RowArgs`: the outer dims that pick a row, and the inner dims
//! walked within it, with per-operand strides. One block of 256 threads handles a row at a time.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use headroom_autograd_core::{
    DType, LayerNormBackward, LayerNormForward, ReduceOp, Result, TensorError, View,
};

use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{launch_in, Param, NO_ARGS};
use crate::operands::element_address;
use crate::scratch::Scratch;

const MAX_DIMS: usize = 8;
/// Threads per block; the kernels' `THREADS`.
const THREADS: u32 = 256;
const MAX_BLOCKS: u64 = 132 * 16;

/// `RowArgs` of `rows.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RowArgs {
    outer_ndim: u32,
    inner_ndim: u32,
    rows: u64,
    len: u64,
    outer_shape: [u64; MAX_DIMS],
    outer_strides: [[u64; MAX_DIMS]; 3],
    inner_shape: [u64; MAX_DIMS],
    inner_strides: [[u64; MAX_DIMS]; 3],
    offsets: [u64; 3],
}

// SAFETY: `repr(C)`, plain integers, laid out exactly like `RowArgs` in `kernels/rows.cu`
// (two u32 then u64 fields: no padding).
unsafe impl DeviceRepr for RowArgs {}

fn too_many_dims(op: &'static str, n: usize) -> TensorError {
    TensorError::InvalidArgument {
        op,
        reason: format!("{n} dims; the CUDA kernels take {MAX_DIMS}"),
    }
}

/// Row arguments: `outer[k]` are operand k's (shape, strides) of the dims that pick a row (the
/// shape is the first operand's), `inner[k]` those walked within a row.
fn row_args(
    op: &'static str,
    outer: &[(&[usize], &[usize])],
    inner: &[(&[usize], &[usize])],
    offsets: &[usize],
) -> Result<RowArgs> {
    let (outer_shape, inner_shape) = (outer[0].0, inner[0].0);
    if outer_shape.len() > MAX_DIMS {
        return Err(too_many_dims(op, outer_shape.len()));
    }
    if inner_shape.len() > MAX_DIMS {
        return Err(too_many_dims(op, inner_shape.len()));
    }
    let mut args = RowArgs {
        outer_ndim: outer_shape.len() as u32,
        inner_ndim: inner_shape.len() as u32,
        rows: outer_shape.iter().product::<usize>() as u64,
        len: inner_shape.iter().product::<usize>() as u64,
        outer_shape: [1; MAX_DIMS],
        outer_strides: [[0; MAX_DIMS]; 3],
        inner_shape: [1; MAX_DIMS],
        inner_strides: [[0; MAX_DIMS]; 3],
        offsets: [0; 3],
    };
    for (d, &size) in outer_shape.iter().enumerate() {
        args.outer_shape[d] = size as u64;
    }
    for (d, &size) in inner_shape.iter().enumerate() {
        args.inner_shape[d] = size as u64;
    }
    for (k, (_, strides)) in outer.iter().enumerate() {
        for (d, &stride) in strides.iter().enumerate() {
            args.outer_strides[k][d] = stride as u64;
        }
    }
    for (k, (_, strides)) in inner.iter().enumerate() {
        for (d, &stride) in strides.iter().enumerate() {
            args.inner_strides[k][d] = stride as u64;
        }
    }
    for (k, &offset) in offsets.iter().enumerate() {
        args.offsets[k] = offset as u64;
    }
    Ok(args)
}

fn suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => return Err(TensorError::UnsupportedDtype { op, dtype: other }),
    })
}

fn same_dtype(op: &'static str, views: &[&View<'_>]) -> Result<()> {
    for view in &views[1..] {
        if view.dtype != views[0].dtype {
            return Err(TensorError::DtypeMismatch {
                op,
                lhs: views[0].dtype,
                rhs: view.dtype,
            });
        }
    }
    Ok(())
}

fn same_shape(op: &'static str, views: &[&View<'_>]) -> Result<()> {
    for view in &views[1..] {
        if view.layout.shape() != views[0].layout.shape() {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: views[0].layout.shape().to_vec(),
                rhs: view.layout.shape().to_vec(),
            });
        }
    }
    Ok(())
}

fn launch(
    backend: &CudaBackend,
    op: &'static str,
    name: KernelName,
    rows: u64,
    params: &[Param],
    args: Option<RowArgs>,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let config = LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_in(backend, Module::Rows, op, name, config, params, args)
}

pub(crate) fn reduce(
    backend: &CudaBackend,
    op: ReduceOp,
    x: View<'_>,
    n_reduced: usize,
    out: View<'_>,
) -> Result<()> {
    same_dtype("reduce", &[&x, &out])?;
    let ndim = x.layout.ndim();
    if n_reduced > ndim || out.layout.shape() != &x.layout.shape()[..ndim - n_reduced] {
        return Err(TensorError::ShapeMismatch {
            op: "reduce",
            lhs: x.layout.shape().to_vec(),
            rhs: out.layout.shape().to_vec(),
        });
    }
    let suffix = suffix("reduce", x.dtype)?;
    if let Some(columns) = column_reduction(op, &x, n_reduced, &out) {
        return column_sums(backend, suffix, &x, &out, columns);
    }
    let (outer_shape, inner_shape) = x.layout.shape().split_at(ndim - n_reduced);
    let (outer_strides, inner_strides) = x.layout.strides().split_at(ndim - n_reduced);
    if inner_shape.iter().product::<usize>() == 0 && matches!(op, ReduceOp::Max | ReduceOp::Min) {
        return Err(TensorError::InvalidArgument {
            op: "reduce",
            reason: "max/min of an empty dim".into(),
        });
    }
    let args = row_args(
        "reduce",
        &[
            (outer_shape, out.layout.strides()),
            (outer_shape, outer_strides),
        ],
        &[
            (inner_shape, &[0; MAX_DIMS][..inner_shape.len()]),
            (inner_shape, inner_strides),
        ],
        &[out.layout.offset(), x.layout.offset()],
    )?;
    let code = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    };
    let params = [
        Param::I32(code),
        Param::U64(x.buffer.address()),
        Param::U64(out.buffer.address()),
    ];
    launch(
        backend,
        "reduce",
        ("reduce", suffix),
        args.rows,
        &params,
        Some(args),
    )
}

/// Max or min over the last dim of `x` with the index of the first such element (a NaN wins).
pub(crate) fn reduce_with_index(
    backend: &CudaBackend,
    op: ReduceOp,
    x: View<'_>,
    values: View<'_>,
    indices: View<'_>,
) -> Result<()> {
    let name = "reduce_with_index";
    let is_max = match op {
        ReduceOp::Max => 1,
        ReduceOp::Min => 0,
        other => {
            return Err(TensorError::InvalidArgument {
                op: name,
                reason: format!("{other:?} has no index"),
            })
        }
    };
    same_dtype(name, &[&x, &values])?;
    if indices.dtype != DType::I64 {
        return Err(TensorError::UnsupportedDtype {
            op: name,
            dtype: indices.dtype,
        });
    }
    let ndim = x.layout.ndim();
    let outer = &x.layout.shape()[..ndim.saturating_sub(1)];
    if ndim == 0
        || values.layout.shape() != outer
        || indices.layout.shape() != outer
        || x.layout.shape()[ndim - 1] == 0
    {
        return Err(TensorError::ShapeMismatch {
            op: name,
            lhs: x.layout.shape().to_vec(),
            rhs: values.layout.shape().to_vec(),
        });
    }
    let suffix = suffix(name, x.dtype)?;
    let lane = [x.layout.shape()[ndim - 1]];
    let zero = [0usize];
    let args = row_args(
        name,
        &[
            (outer, values.layout.strides()),
            (outer, indices.layout.strides()),
            (outer, &x.layout.strides()[..ndim - 1]),
        ],
        &[
            (&lane, &zero),
            (&lane, &zero),
            (&lane, &x.layout.strides()[ndim - 1..]),
        ],
        &[
            values.layout.offset(),
            indices.layout.offset(),
            x.layout.offset(),
        ],
    )?;
    let params = [
        Param::I32(is_max),
        Param::U64(x.buffer.address()),
        Param::U64(values.buffer.address()),
        Param::U64(indices.buffer.address()),
    ];
    // One thread per row: rows / THREADS blocks.
    let blocks = args.rows.div_ceil(u64::from(THREADS));
    let config = LaunchConfig {
        grid_dim: (blocks.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    if args.rows == 0 {
        return Ok(());
    }
    launch_in(
        backend,
        Module::Rows,
        name,
        ("arg_reduce", suffix),
        config,
        &params,
        Some(args),
    )
}

/// Splits `view` into (outer shape, outer strides) without `dim`, and its stride along `dim`.
fn lanes(view: &View<'_>, dim: usize) -> (Vec<usize>, Vec<usize>, [usize; 1]) {
    let mut shape = view.layout.shape().to_vec();
    let mut strides = view.layout.strides().to_vec();
    shape.remove(dim);
    let lane = strides.remove(dim);
    (shape, strides, [lane])
}

pub(crate) fn softmax(
    backend: &CudaBackend,
    x: View<'_>,
    dim: usize,
    log: bool,
    out: View<'_>,
) -> Result<()> {
    same_dtype("softmax", &[&x, &out])?;
    same_shape("softmax", &[&x, &out])?;
    if dim >= x.layout.ndim() {
        return Err(TensorError::InvalidArgument {
            op: "softmax",
            reason: format!("dim {dim} of shape {:?}", x.layout.shape()),
        });
    }
    let suffix = suffix("softmax", x.dtype)?;
    let len = [x.layout.shape()[dim]];
    let (o, x_lanes) = (lanes(&out, dim), lanes(&x, dim));
    let args = row_args(
        "softmax",
        &[(&o.0, &o.1), (&x_lanes.0, &x_lanes.1)],
        &[(&len, &o.2), (&len, &x_lanes.2)],
        &[out.layout.offset(), x.layout.offset()],
    )?;
    let params = [
        Param::I32(i32::from(log)),
        Param::U64(x.buffer.address()),
        Param::U64(out.buffer.address()),
    ];
    launch(
        backend,
        "softmax",
        ("softmax", suffix),
        args.rows,
        &params,
        Some(args),
    )
}

pub(crate) fn softmax_backward(
    backend: &CudaBackend,
    y: View<'_>,
    dy: View<'_>,
    dim: usize,
    log: bool,
    dx: View<'_>,
) -> Result<()> {
    same_dtype("softmax_backward", &[&y, &dy, &dx])?;
    same_shape("softmax_backward", &[&y, &dy, &dx])?;
    if dim >= y.layout.ndim() {
        return Err(TensorError::InvalidArgument {
            op: "softmax_backward",
            reason: format!("dim {dim} of shape {:?}", y.layout.shape()),
        });
    }
    let suffix = suffix("softmax_backward", y.dtype)?;
    let len = [y.layout.shape()[dim]];
    let (d, yl, gl) = (lanes(&dx, dim), lanes(&y, dim), lanes(&dy, dim));
    let args = row_args(
        "softmax_backward",
        &[(&d.0, &d.1), (&yl.0, &yl.1), (&gl.0, &gl.1)],
        &[(&len, &d.2), (&len, &yl.2), (&len, &gl.2)],
        &[dx.layout.offset(), y.layout.offset(), dy.layout.offset()],
    )?;
    let params = [
        Param::I32(i32::from(log)),
        Param::U64(y.buffer.address()),
        Param::U64(dy.buffer.address()),
        Param::U64(dx.buffer.address()),
    ];
    launch(
        backend,
        "softmax_backward",
        ("softmax_backward", suffix),
        args.rows,
        &params,
        Some(args),
    )
}

/// Rows and width of a dense `[.., n]` operand, and its element address (offset applied).
fn dense_rows(op: &'static str, view: &View<'_>) -> Result<(u64, u64, u64)> {
    if !view.layout.is_contiguous() || view.layout.ndim() == 0 {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "expects a dense operand, got strides {:?}",
                view.layout.strides()
            ),
        });
    }
    let n = *view.layout.shape().last().unwrap_or(&1) as u64;
    let rows = (view.layout.numel() as u64).checked_div(n).unwrap_or(0);
    Ok((rows, n, element_address(view)))
}

/// Element address (offset applied) of a dense operand.
fn address_of(op: &'static str, view: &View<'_>) -> Result<u64> {
    dense_rows(op, view).map(|(_, _, address)| address)
}

/// An optional `[n]` parameter as (address with offset, stride), or (0, 0).
fn optional(view: Option<View<'_>>) -> (u64, u64) {
    view.map_or((0, 0), |v| {
        let stride = v.layout.strides().first().copied().unwrap_or(1) as u64;
        (element_address(&v), stride)
    })
}

/// The warp-per-row layer-norm kernels by vectors per lane (1, 2, 4, 8): forward, backward.
const LN_WARP_FORWARD: [&str; 4] = [
    "layer_norm_warp1",
    "layer_norm_warp2",
    "layer_norm_warp4",
    "layer_norm_warp8",
];
const LN_WARP_BACKWARD: [&str; 4] = [
    "layer_norm_backward_warp1",
    "layer_norm_backward_warp2",
    "layer_norm_backward_warp4",
    "layer_norm_backward_warp8",
];
/// The backward kernels that also sum the parameter gradients, by vectors per lane (1, 2, 4).
const LN_WARP_BACKWARD_PARAMS: [&str; 3] = [
    "layer_norm_backward_params_warp1",
    "layer_norm_backward_params_warp2",
    "layer_norm_backward_params_warp4",
];
/// Rows per block, and blocks at most, of the backward kernels that sum the parameter gradients:
/// enough warps to stream dy and x at full speed, few enough blocks that adding their partial
/// sums stays cheap.
const PARAM_ROWS_PER_BLOCK: u64 = 16;
const PARAM_BLOCKS: u64 = 264;
/// Warps per block of the warp-per-row kernels.
const ROW_WARPS: u32 = 4;

/// The slot (vectors per lane 1, 2, 4 or 8 → 0..4) of the warp-per-row layer-norm kernels for
/// rows of `n` elements of `dtype`, when they apply: f32, f16 or bf16 with f32 statistics, rows of
/// whole 16-byte vectors (at most 32 · 8 per row, so a lane holds at most 8), every row operand in
/// `addresses` 16-byte aligned and every present parameter in `params` (address, stride) dense and
/// aligned.
fn warp_slot(
    dtype: DType,
    stats: DType,
    n: u64,
    addresses: &[u64],
    params: &[(u64, u64)],
) -> Option<usize> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || stats != DType::F32 {
        return None;
    }
    let per_vector = (16 / dtype.size_in_bytes()) as u64;
    let aligned = |address: u64| address.is_multiple_of(16);
    let params_fit = params
        .iter()
        .all(|&(address, stride)| address == 0 || (stride == 1 && aligned(address)));
    if n == 0
        || !n.is_multiple_of(per_vector)
        || !addresses.iter().all(|&a| aligned(a))
        || !params_fit
    {
        return None;
    }
    let per_lane = (n / per_vector).div_ceil(32);
    match per_lane {
        1 => Some(0),
        2 => Some(1),
        3 | 4 => Some(2),
        5..=8 => Some(3),
        _ => None,
    }
}

/// Launches a warp-per-row kernel over `rows` rows.
fn launch_warp_rows(
    backend: &CudaBackend,
    op: &'static str,
    name: KernelName,
    rows: u64,
    params: &[Param],
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let config = LaunchConfig {
        grid_dim: (
            rows.div_ceil(u64::from(ROW_WARPS)).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (32 * ROW_WARPS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_in(backend, Module::Rows, op, name, config, params, NO_ARGS)
}

fn stats_suffix(op: &'static str, x: DType, stats: DType) -> Result<&'static str> {
    Ok(match (x, stats) {
        (DType::F32, DType::F32) => "f32_f32",
        (DType::F64, DType::F64) => "f64_f64",
        (DType::F16, DType::F32) => "f16_f32",
        (DType::BF16, DType::F32) => "bf16_f32",
        (_, stats) => return Err(TensorError::UnsupportedDtype { op, dtype: stats }),
    })
}

pub(crate) fn layer_norm(backend: &CudaBackend, args: LayerNormForward<'_>) -> Result<()> {
    let op = "layer_norm";
    same_shape(op, &[&args.x, &args.out])?;
    let suffix = stats_suffix(op, args.x.dtype, args.mean.dtype)?;
    let (rows, n, x) = dense_rows(op, &args.x)?;
    let out = address_of(op, &args.out)?;
    let (mean, rstd) = (address_of(op, &args.mean)?, address_of(op, &args.rstd)?);
    let (w, ws) = optional(args.weight);
    let (b, bs) = optional(args.bias);
    if let Some(slot) = warp_slot(
        args.x.dtype,
        args.mean.dtype,
        n,
        &[x, out],
        &[(w, ws), (b, bs)],
    ) {
        let params = [
            Param::U64(x),
            Param::U64(w),
            Param::U64(b),
            Param::U64(out),
            Param::U64(mean),
            Param::U64(rstd),
            Param::F64(args.eps),
            Param::U64(rows),
            Param::U64(n),
        ];
        let name = (LN_WARP_FORWARD[slot], suffix);
        return launch_warp_rows(backend, op, name, rows, &params);
    }
    let params = [
        Param::U64(x),
        Param::U64(w),
        Param::U64(ws),
        Param::U64(b),
        Param::U64(bs),
        Param::U64(out),
        Param::U64(mean),
        Param::U64(rstd),
        Param::F64(args.eps),
        Param::U64(rows),
        Param::U64(n),
    ];
    launch(backend, op, ("layer_norm", suffix), rows, &params, None)
}

pub(crate) fn layer_norm_backward(
    backend: &CudaBackend,
    args: LayerNormBackward<'_>,
) -> Result<()> {
    let op = "layer_norm_backward";
    same_shape(op, &[&args.x, &args.dy])?;
    let suffix = stats_suffix(op, args.x.dtype, args.mean.dtype)?;
    let (rows, n, x) = dense_rows(op, &args.x)?;
    let dy = address_of(op, &args.dy)?;
    let (mean, rstd) = (address_of(op, &args.mean)?, address_of(op, &args.rstd)?);
    let (w, ws) = optional(args.weight);
    let dx = args.dx.map(|dx| address_of(op, &dx)).transpose()?;
    let wants_params = args.dweight.is_some() || args.dbias.is_some();
    let mut row_operands = vec![dy, x];
    row_operands.extend(dx);
    let slot = warp_slot(args.x.dtype, args.mean.dtype, n, &row_operands, &[(w, ws)]);
    if let (Some(slot), true) = (slot, wants_params) {
        if let Some(&family) = LN_WARP_BACKWARD_PARAMS.get(slot) {
            // One pass for all three gradients: block sums of the parameter gradients, then the
            // finishing kernel adds the blocks.
            let blocks = rows.div_ceil(PARAM_ROWS_PER_BLOCK).clamp(1, PARAM_BLOCKS);
            let scratch = Scratch::new(backend, 2 * blocks * n * 4)?;
            let params = [
                Param::U64(dy),
                Param::U64(x),
                Param::U64(mean),
                Param::U64(rstd),
                Param::U64(w),
                Param::U64(dx.unwrap_or(0)),
                Param::U64(scratch.address()),
                Param::U64(rows),
                Param::U64(n),
            ];
            let config = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (32 * ROW_WARPS, 1, 1),
                shared_mem_bytes: (2 * n * 4) as u32,
            };
            let name = (family, suffix);
            launch_in(backend, Module::Rows, op, name, config, &params, NO_ARGS)?;
            return param_finish(backend, &args, suffix, scratch.address(), blocks, n);
        }
    }
    if let Some(dx) = dx {
        if let Some(slot) = slot {
            let params = [
                Param::U64(dy),
                Param::U64(x),
                Param::U64(mean),
                Param::U64(rstd),
                Param::U64(w),
                Param::U64(dx),
                Param::U64(rows),
                Param::U64(n),
            ];
            let name = (LN_WARP_BACKWARD[slot], suffix);
            launch_warp_rows(backend, op, name, rows, &params)?;
        } else {
            let params = [
                Param::U64(dy),
                Param::U64(x),
                Param::U64(mean),
                Param::U64(rstd),
                Param::U64(w),
                Param::U64(ws),
                Param::U64(dx),
                Param::U64(rows),
                Param::U64(n),
            ];
            launch(
                backend,
                op,
                ("layer_norm_backward", suffix),
                rows,
                &params,
                None,
            )?;
        }
    }
    if wants_params {
        param_grads(backend, &args, suffix, (dy, x, mean, rstd), rows, n)?;
    }
    Ok(())
}

/// A sum or mean over the rows of a matrix with contiguous rows, seen as `x` `[n, rows]` with
/// strides `(1, rs)` (the core permutes the reduced dim last): `(rows, n, rs, scale)`. The row
/// kernel would read such a matrix down its columns; the column kernels read it row by row.
fn column_reduction(
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
fn column_sums(
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
    // Returned in stream order, after the kernels that use it.
    let scratch = Scratch::new(backend, n_chunks * n * accumulator)?;
    let partial = scratch.address();
    let x_address = element_address(x);
    let (stage1, stage2) = column_stages(n, n_chunks);
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

/// Launch shapes of two-stage column sums over `n` columns: stage 1 (32 × 8 blocks, one per 32
/// columns and chunk of rows) and stage 2 (one thread per column).
fn column_stages(n: u64, n_chunks: u64) -> (LaunchConfig, LaunchConfig) {
    let stage1 = LaunchConfig {
        grid_dim: (n.div_ceil(32) as u32, n_chunks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let stage2 = LaunchConfig {
        grid_dim: (
            n.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    (stage1, stage2)
}

/// Rows per chunk of the first stage (`ROWS_PER_CHUNK` in `rows.cu`).
const ROWS_PER_CHUNK: u64 = 256;

/// Weight and bias gradients of layer norm in two deterministic stages: per-chunk column sums
/// into scratch from the caching allocator, then one thread per column adds the chunks.
fn param_grads(
    backend: &CudaBackend,
    args: &LayerNormBackward<'_>,
    suffix: &'static str,
    (dy, x, mean, rstd): (u64, u64, u64, u64),
    rows: u64,
    n: u64,
) -> Result<()> {
    let op = "layer_norm_backward";
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let n_chunks = rows.div_ceil(ROWS_PER_CHUNK);
    let accumulator = if args.mean.dtype == DType::F64 { 8 } else { 4 };
    // Returned in stream order, after the kernels that use it.
    let scratch = Scratch::new(backend, 2 * n_chunks * n * accumulator)?;
    let partial = scratch.address();
    let (stage1, _) = column_stages(n, n_chunks);
    let params = [
        Param::U64(dy),
        Param::U64(x),
        Param::U64(mean),
        Param::U64(rstd),
        Param::U64(partial),
        Param::U64(rows),
        Param::U64(n),
    ];
    let name = ("layer_norm_param_partials", suffix);
    launch_in(backend, Module::Rows, op, name, stage1, &params, NO_ARGS)?;
    param_finish(backend, args, suffix, partial, n_chunks, n)
}

/// The second stage of the layer-norm parameter gradients: adds `n_chunks` partial sums
/// (`partial` `[2, n_chunks, n]`, weight then bias) into the gradients `args` asks for.
fn param_finish(
    backend: &CudaBackend,
    args: &LayerNormBackward<'_>,
    suffix: &'static str,
    partial: u64,
    n_chunks: u64,
    n: u64,
) -> Result<()> {
    let op = "layer_norm_backward";
    // 32 columns per block, 8 threads sharing each column's chunks.
    let stage2 = LaunchConfig {
        grid_dim: (n.div_ceil(32) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let (dw, dws) = optional(args.dweight);
    let (db, dbs) = optional(args.dbias);
    let params = [
        Param::U64(partial),
        Param::U64(n_chunks),
        Param::U64(dw),
        Param::U64(dws),
        Param::U64(db),
        Param::U64(dbs),
        Param::U64(n),
    ];
    let name = ("layer_norm_param_finish", suffix);
    launch_in(backend, Module::Rows, op, name, stage2, &params, NO_ARGS)
}
