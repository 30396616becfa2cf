//! What every room of the rows family shares: the row description of `kernels/rows.cu`
//! ([`RowArgs`]: the outer dims that pick a row and the inner dims walked within it, with
//! per-operand strides), the block-per-row launch, the operand checks, and the launch shapes of
//! two-stage column sums (reductions and the layer-norm parameter gradients both sum columns).
//!
//! This module sits on the ground floor only; the rooms (`reduce.rs`, `column_sums.rs`,
//! `softmax.rs`, `layer_norm.rs`) import it, and it imports none of them.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use headroom_autograd_core::{Result, TensorError, View};

use crate::device::CudaBackend;
use crate::kernels::{KernelName, Module};
use crate::launch::{checked_grid, launch_in, Param};

/// The kernels' dimension limit of the outer and inner dims (`MAX_DIMS` in `rows.cu`).
pub(crate) const MAX_DIMS: usize = 8;
/// Threads per block; the kernels' `THREADS`.
pub(crate) const THREADS: u32 = 256;
/// Blocks of a launch at most; the kernels loop over the rest.
pub(crate) const MAX_BLOCKS: u64 = 132 * 16;

/// `RowArgs` of `rows.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowArgs {
    outer_ndim: u32,
    inner_ndim: u32,
    pub(crate) rows: u64,
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
pub(crate) fn row_args(
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

/// `Err` unless every view has the first's dtype.
pub(crate) fn same_dtype(op: &'static str, views: &[&View<'_>]) -> Result<()> {
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

/// `Err` unless every view has the first's shape.
pub(crate) fn same_shape(op: &'static str, views: &[&View<'_>]) -> Result<()> {
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

/// Launches `name` of `rows.cu` over `rows` rows, one block of [`THREADS`] threads per row at a
/// time (nothing when there are no rows).
pub(crate) fn launch(
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

/// Launch shapes of two-stage column sums over `n` columns: stage 1 (32 × 8 blocks, one per 32
/// columns and chunk of rows) and stage 2 (one thread per column).
pub(crate) fn column_stages(
    op: &'static str,
    n: u64,
    n_chunks: u64,
) -> Result<(LaunchConfig, LaunchConfig)> {
    let stage1 = LaunchConfig {
        grid_dim: checked_grid(op, n.div_ceil(32), n_chunks, 1)?,
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
    Ok((stage1, stage2))
}

/// The bytes of a scratch buffer of `factors` multiplied, checked: an overflow is a typed error
/// naming `op`, never a short buffer.
pub(crate) fn scratch_bytes(op: &'static str, factors: &[u64]) -> Result<u64> {
    factors
        .iter()
        .try_fold(1u64, |bytes, &factor| bytes.checked_mul(factor))
        .ok_or_else(|| TensorError::SizeOverflow {
            op,
            reason: format!(
                "a scratch buffer of {factors:?} (their product in bytes) overflows u64"
            ),
        })
}

/// Rows per chunk of the first stage (`ROWS_PER_CHUNK` in `rows.cu`).
pub(crate) const ROWS_PER_CHUNK: u64 = 256;
