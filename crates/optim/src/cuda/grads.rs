//! The launch table of kernels that treat every gradient alike — gradient clipping
//! (`clip.rs`) and a GradScaler's overflow check (`grad_scale.rs`): one `GradPiece` per
//! gradient (the header and the gradient's address, `kernels/optim.cuh`), ordered by dtype so
//! that each element type's pieces are one run of the table, with the blocks numbered across
//! the whole table (partials of every run can land in one array). One launch per run.
//!
//! It knows the table's layout and the launch arguments every such kernel starts with, not what
//! a kernel computes.

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cuda::KernelArg;

use super::launch::{address, instance, pass_block_elems, CudaDevice, ItemGeometry, Module};
use super::table::Table;
use crate::error::OptimError;

/// Bytes of a `GradPiece`.
const PIECE_SIZE: usize = 40;
/// Threads per block of every kernel over a gradient table (`CLIP_THREADS`, `CHECK_THREADS`).
pub(crate) const THREADS: u32 = 256;

/// The gradients' table, and per element type the run of pieces.
pub(crate) struct GradTable {
    pub(crate) table: Table,
    pub(crate) n_pieces: usize,
    pub(crate) n_blocks: u64,
    pub(crate) block_elems: u64,
    runs: Vec<Run>,
}

/// One element type's pieces: byte offset in the table, pieces, first block, blocks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub(crate) dtype: DType,
    offset: usize,
    n_pieces: usize,
    first_block: u64,
    n_blocks: u64,
}

/// The table of `grads` (contiguous f32, bf16 or f16 tensors of `device`), grouped by dtype.
pub(crate) fn grad_table(
    device: &mut CudaDevice,
    grads: &[Tensor],
) -> Result<GradTable, OptimError> {
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
    Ok(GradTable {
        table,
        n_pieces: ordered.len(),
        n_blocks,
        block_elems,
        runs,
    })
}

/// One launch per run of kernel `kernels` (its f32, bf16 and f16 instances) of `module` over the
/// table written at `base`, with arguments `(the run's pieces, their number, block_elems, the
/// run's first block, tail(run)...)`.
///
/// # Safety
/// The kernels must take these parameters (`GradPiece` tables), `base` must hold `grad_table`'s
/// bytes, whose gradients are live tensors of `device`'s backend, and every address in the tail
/// must be live memory of that backend that the kernel may read or write.
pub(crate) unsafe fn launch_runs(
    device: &mut CudaDevice,
    grad_table: &GradTable,
    base: u64,
    (module, kernels): (Module, [&'static str; 3]),
    tail: &dyn Fn(&Run) -> Vec<KernelArg>,
) -> Result<(), OptimError> {
    for run in grad_table.runs.iter().filter(|run| run.n_blocks > 0) {
        let mut args = vec![
            KernelArg::U64(base + run.offset as u64),
            KernelArg::U32(run.n_pieces as u32),
            KernelArg::U64(grad_table.block_elems),
            KernelArg::U64(run.first_block),
        ];
        args.extend(tail(run));
        let grid = u32::try_from(run.n_blocks).map_err(|_| OptimError::InvalidArgument {
            op: "gradient table launch",
            reason: format!("{} blocks exceed a CUDA grid", run.n_blocks),
        })?;
        let name = instance(run.dtype, kernels);
        // SAFETY: forwarded from the caller: the kernel takes these parameters, the run's pieces
        // are at its offset of the table at `base`, and the tail's addresses are live.
        unsafe { device.launch(module, name, grid, THREADS, &args) }?;
    }
    Ok(())
}
