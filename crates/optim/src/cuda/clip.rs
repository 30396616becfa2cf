//! Gradient clipping on CUDA (`kernels/clip.cu`): `clip_grad_norm_` as three launches for any
//! number of gradients — partial reductions, the finishing kernel that leaves the total norm and
//! the clamped coefficient in device memory, the scaling that reads it — and `clip_grad_value_`
//! as one, per element type present. Nothing waits for the device, except the one read of the
//! total that `error_if_nonfinite` asks for (before any gradient changes).
//!
//! The gradients are pieces of one table (`ClipPiece`: the header and the gradient's address),
//! ordered by dtype so that each element type's pieces are one run of the table; the blocks are
//! numbered across the whole table, so the partials of every run land in one array that the
//! finishing kernel reads piece by piece. The clip's semantics and its checks are `clip.rs`'s.

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cuda::KernelArg;

use super::{address, instance, pass_block_elems, CudaDevice, ItemGeometry, Module, Table};
use crate::clip::{check_finite, NormClip, NormType};
use crate::error::OptimError;

const PIECE_SIZE: usize = 40;
/// Threads per block of every clipping kernel (`CLIP_THREADS`).
const THREADS: u32 = 256;
const PARTIALS_KERNELS: [&str; 3] = [
    "clip_partials_f32",
    "clip_partials_bf16",
    "clip_partials_f16",
];
const SCALE_KERNELS: [&str; 3] = ["clip_scale_f32", "clip_scale_bf16", "clip_scale_f16"];
const VALUE_KERNELS: [&str; 3] = ["clip_value_f32", "clip_value_bf16", "clip_value_f16"];

/// The gradients' table: its address once written, and per element type the run of pieces
/// (byte offset in the table, pieces, first block, blocks).
struct ClipTable {
    table: Table,
    n_pieces: usize,
    n_blocks: u64,
    block_elems: u64,
    runs: Vec<Run>,
}

#[derive(Debug, Clone, Copy)]
struct Run {
    dtype: DType,
    offset: usize,
    n_pieces: usize,
    first_block: u64,
    n_blocks: u64,
}

/// The table of `grads`, grouped by dtype.
fn clip_table(device: &mut CudaDevice, grads: &[Tensor]) -> Result<ClipTable, OptimError> {
    let mut ordered: Vec<&Tensor> = grads.iter().collect();
    ordered.sort_by_key(|g| {
        [DType::F32, DType::BF16, DType::F16]
            .iter()
            .position(|&d| d == g.dtype())
    });
    let total: usize = ordered.iter().map(|g| g.numel()).sum();
    let block_elems = pass_block_elems(total);
    let geometry: Vec<ItemGeometry> = ordered
        .iter()
        .map(|g| ItemGeometry {
            len: g.numel(),
            slot: 0,
            step: 0,
        })
        .collect();
    let mut runs: Vec<Run> = Vec::new();
    let (table, n_blocks) =
        device.piece_table(&geometry, block_elems, false, &mut |table, idx, head| {
            let dtype = ordered[idx].dtype();
            if runs.last().is_none_or(|run| run.dtype != dtype) {
                runs.push(Run {
                    dtype,
                    offset: table.len(),
                    n_pieces: 0,
                    first_block: head.first_block,
                    n_blocks: 0,
                });
            }
            let run = runs.last_mut().expect("pushed above");
            run.n_pieces += 1;
            run.n_blocks = head.first_block + head.len.div_ceil(block_elems) - run.first_block;
            table.entry(head).u64(address(ordered[idx])).end(PIECE_SIZE);
        })?;
    Ok(ClipTable {
        table,
        n_pieces: ordered.len(),
        n_blocks,
        block_elems,
        runs,
    })
}

/// One launch per run of a partial or element-wise kernel over the table written at `base`, with
/// arguments `(the run's pieces, their number, block_elems, the run's first block, tail(run)...)`.
fn launch_runs(
    device: &mut CudaDevice,
    clip_table: &ClipTable,
    base: u64,
    kernels: [&'static str; 3],
    tail: &dyn Fn(&Run) -> Vec<KernelArg>,
) -> Result<(), OptimError> {
    for run in clip_table.runs.iter().filter(|run| run.n_blocks > 0) {
        let mut args = vec![
            KernelArg::U64(base + run.offset as u64),
            KernelArg::U32(run.n_pieces as u32),
            KernelArg::U64(clip_table.block_elems),
            KernelArg::U64(run.first_block),
        ];
        args.extend(tail(run));
        let grid = u32::try_from(run.n_blocks).map_err(|_| OptimError::InvalidArgument {
            op: "clip",
            reason: format!("{} blocks exceed a CUDA grid", run.n_blocks),
        })?;
        let name = instance(run.dtype, kernels);
        // SAFETY: the clipping kernels take these parameters (`kernels/clip.cu`); the table was
        // written at `base` and holds the run's pieces at its offset, whose gradients are live,
        // checked tensors of this backend; the tail's addresses are the caller's live buffers.
        unsafe { device.launch(Module::Clip, name, grid, THREADS, &args) }?;
    }
    Ok(())
}

/// `clip_grad_norm_` of `grads` (checked by `clip.rs`) on `device`.
pub(crate) fn clip_norm(
    device: &mut CudaDevice,
    grads: &[Tensor],
    clip: NormClip,
) -> Result<Tensor, OptimError> {
    let backend = grads[0].backend();
    let clip_table = clip_table(device, grads)?;
    let (n_pieces, n_blocks) = (clip_table.n_pieces, clip_table.n_blocks);
    let total = Tensor::empty(backend, &[1], DType::F32)?;
    // Partials, then the pieces' norms, then the coefficient (an f32 in the last slot).
    let scratch = Tensor::empty(backend, &[n_blocks as usize + n_pieces + 1], DType::F64)?;
    let partials = address(&scratch);
    let piece_norms = partials + n_blocks * 8;
    let coef = piece_norms + n_pieces as u64 * 8;
    let norm_type = KernelArg::I32(match clip.norm_type {
        NormType::L2 => 0,
        NormType::Inf => 1,
    });
    let base = device.write_table(clip_table.table.bytes())?;
    let partials_tail = |_: &Run| vec![norm_type, KernelArg::U64(partials)];
    launch_runs(device, &clip_table, base, PARTIALS_KERNELS, &partials_tail)?;
    let finish_args = [
        KernelArg::U64(base),
        KernelArg::U32(n_pieces as u32),
        KernelArg::U64(n_blocks),
        norm_type,
        KernelArg::F32(clip.max_norm),
        KernelArg::U64(partials),
        KernelArg::U64(piece_norms),
        KernelArg::U64(address(&total)),
        KernelArg::U64(coef),
    ];
    // SAFETY: `clip_finish` takes these parameters; the table is written at `base`, the partials
    // were written by the launches before it in stream order, and the scratch and total tensors
    // hold the slots it writes.
    unsafe { device.launch(Module::Clip, "clip_finish", 1, THREADS, &finish_args) }?;
    if clip.error_if_nonfinite {
        // The one host synchronisation: PyTorch reads the norm here too, before any gradient
        // changes.
        check_finite(clip, total.to_vec::<f32>()?[0])?;
    }
    let scale_tail = |_: &Run| vec![KernelArg::U64(coef)];
    launch_runs(device, &clip_table, base, SCALE_KERNELS, &scale_tail)?;
    // The scratch is freed in stream order, after the launches that read it.
    drop(scratch);
    Ok(total)
}

/// `clip_grad_value_` of `grads` (checked by `clip.rs`) on `device`.
pub(crate) fn clip_value(
    device: &mut CudaDevice,
    grads: &[Tensor],
    clip_value: f32,
) -> Result<(), OptimError> {
    let clip_table = clip_table(device, grads)?;
    let base = device.write_table(clip_table.table.bytes())?;
    // PyTorch rounds a clamp's scalar bounds to the tensor's type.
    let bounds = |run: &Run| {
        let bound = |value: f32| match run.dtype {
            DType::BF16 => half::bf16::from_f32(value).to_f32(),
            DType::F16 => half::f16::from_f32(value).to_f32(),
            _ => value,
        };
        vec![
            KernelArg::F32(bound(-clip_value)),
            KernelArg::F32(bound(clip_value)),
        ]
    };
    launch_runs(device, &clip_table, base, VALUE_KERNELS, &bounds)
}
