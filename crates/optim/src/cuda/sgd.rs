//! SGD on CUDA (`kernels/sgd.cu`): the rule's fused, foreach and single forms over tensors, with
//! the constants and op order of `kernels/sgd.rs`, for f32, bf16 and f16 parameters (one kernel
//! instance per dtype; the optimizer steps one dtype at a time). A piece's first step (the momentum buffer
//! takes the gradient) is its step number 1, counted on the device after GradScaler skips.

use super::{
    address, flags, foreach_chunk, geometry, instance, CudaDevice, Module, PassOps, PieceHead,
    Table,
};
use crate::device::StepScaling;
use crate::error::OptimError;
use crate::kernels::{SgdConfig, SgdConsts};
use crate::optimizer::{Implementation, StepItem};
use crate::sgd::SgdState;

const FUSED: (u64, u32) = (4096, 256);
const PIECE_SIZE: usize = 88;
const FUSED_KERNELS: [&str; 3] = ["sgd_fused_f32", "sgd_fused_bf16", "sgd_fused_f16"];
const PASS_KERNELS: [&str; 3] = ["sgd_pass_f32", "sgd_pass_bf16", "sgd_pass_f16"];

// The ops of `sgd_pass_f32`, in the order they run.
const GRAD: i32 = 0;
const BUF: i32 = 1;
const BUF_ADD: i32 = 2;
const USE_BUF: i32 = 3;
const PARAM: i32 = 4;

/// Addresses of one piece: parameter, gradient, momentum buffer (0: none), temporary.
type Span = [u64; 4];

/// Writes an `SgdPiece` (`kernels/sgd.cu`).
fn write_piece(
    table: &mut Table,
    c: &SgdConsts,
    head: PieceHead,
    span: Span,
    grad_scale: Option<f32>,
) {
    let piece_flags = flags::when(grad_scale.is_some(), flags::HOST_SCALED)
        | flags::when(c.maximize, flags::MAXIMIZE)
        | flags::when(c.weight_decay.is_some(), flags::L2)
        | flags::when(c.momentum.is_some(), flags::MOMENTUM)
        | flags::when(c.nesterov, flags::NESTEROV);
    let entry = table.entry(head);
    for address in span {
        entry.u64(address);
    }
    entry
        .u32(piece_flags)
        .f32(c.weight_decay.unwrap_or(0.0))
        .f32(c.momentum.unwrap_or(0.0))
        .f32(c.one_minus_dampening)
        .f32(c.neg_lr)
        .f32(grad_scale.unwrap_or(1.0))
        .end(PIECE_SIZE);
}

/// One step of the rule's `items` on the device.
pub(crate) fn step(
    device: &mut CudaDevice,
    cfg: &SgdConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, SgdState>],
    scaling: StepScaling<'_>,
) -> Result<(), OptimError> {
    let Some(first) = items.first() else {
        return Ok(());
    };
    let like = first.param.clone();
    let dtype = like.dtype();
    let elem = dtype.size_in_bytes() as u64;
    let c = SgdConsts::new(cfg);
    let geometry = geometry(items);
    let spans: Vec<Span> = items
        .iter()
        .map(|it| {
            let buffer = it.state.momentum_buffer.as_ref().map_or(0, address);
            [address(it.param), address(&it.grad), buffer, 0]
        })
        .collect();
    if implementation == Implementation::Fused {
        let grad_scale = scaling.host().grad_scale;
        return device.run_fused(
            (Module::Sgd, instance(dtype, FUSED_KERNELS)),
            &geometry,
            FUSED,
            scaling,
            &mut |table, idx, head| write_piece(table, &c, head, spans[idx], grad_scale),
        );
    }
    // Every op reads or writes the temporary (the modified gradient).
    let mut ops = PassOps::default();
    ops.chunked.push(GRAD);
    if c.momentum.is_some() {
        ops.chunked.extend([BUF, BUF_ADD, USE_BUF]);
    }
    ops.chunked.push(PARAM);
    let lens: Vec<usize> = geometry.iter().map(|g| g.len).collect();
    device.run_unfused(
        (Module::Sgd, instance(dtype, PASS_KERNELS)),
        &like,
        &lens,
        foreach_chunk(implementation),
        &ops,
        &mut |table, idx, range, tmp, first_block| {
            let offset = range.start as u64 * elem;
            let [param, grad, buffer, _] = spans[idx];
            let buffer = if buffer == 0 { 0 } else { buffer + offset };
            let head = PieceHead {
                len: range.len() as u64,
                first_block,
                skipped: 0,
                step: geometry[idx].step,
            };
            write_piece(
                table,
                &c,
                head,
                [param + offset, grad + offset, buffer, tmp],
                None,
            );
        },
    )
}
