//! Layer norm by `kernels/rows.cu`, forward and backward, on dense `[.., n]` operands: one warp
//! per row for rows that fit in registers (f32, f16 or bf16 with f32 statistics, 16-byte aligned
//! rows of whole vectors), else one block per row. The backward computes dx and, when asked, the
//! weight and bias gradients: in one pass with the warp kernels (block sums into scratch, then a
//! finishing kernel adds the blocks), else as deterministic two-stage column sums.
//!
//! This room sits on the rows family's `args.rs` and the ground floor, and imports no other room.

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{
    DType, LayerNormBackward, LayerNormForward, Result, TensorError, View,
};

use super::args::{column_stages, launch, same_shape, scratch_bytes, MAX_BLOCKS, ROWS_PER_CHUNK};
use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{checked_grid, launch_in, Param, NO_ARGS};
use crate::operands::element_address;
use crate::scratch::Scratch;

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
    let (stage1, _) = column_stages(op, n, n_chunks)?;
    // Returned in stream order, after the kernels that use it.
    let scratch = Scratch::new(backend, scratch_bytes(op, &[2, n_chunks, n, accumulator])?)?;
    let partial = scratch.address();
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
        grid_dim: checked_grid(op, n.div_ceil(32), 1, 1)?,
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
