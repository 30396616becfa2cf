//! Adam and AdamW on CUDA (`kernels/adam.cu`): the rule's fused, foreach and single forms over
//! tensors, and [`CudaFusedAdam`] over raw device buffers.
//!
//! Parameters may be f32, bf16 or f16 (one kernel instance per dtype, states of the parameter's
//! dtype); [`CudaFusedAdam`] takes f32 buffers. Each piece's constants are [`StepConsts`] of its
//! own step, as on the CPU. The foreach ops are
//! those of `kernels/adam.rs`'s `run_ops`, launched in its order; the fused kernel is its
//! `fused_element`. A piece that a GradScaler on the device may skip carries its skip counter
//! and the raw hyperparameters, from which the kernel recomputes the two bias corrections.

use std::sync::Arc;

use headroom_ops_cuda::CudaBackend;

use super::{
    address, blocks_for, flags, foreach_chunk, geometry, instance, CudaDevice, Module, PassOps,
    PieceHead, Table,
};
use crate::adam::AdamState;
use crate::device::StepScaling;
use crate::error::OptimError;
use crate::kernels::{AdamConfig, StepConsts, WeightDecay};
use crate::optimizer::{Implementation, StepItem};

/// Elements per block and threads of the fused kernel.
const FUSED: (u64, u32) = (1 << 16, 512);
const PIECE_SIZE: usize = 144;
const FUSED_KERNELS: [&str; 3] = ["adam_fused_f32", "adam_fused_bf16", "adam_fused_f16"];
const PASS_KERNELS: [&str; 3] = ["adam_pass_f32", "adam_pass_bf16", "adam_pass_f16"];
/// The f32 fused kernel of [`CudaFusedAdam`].
const FUSED_KERNEL: (Module, &str) = (Module::Adam, FUSED_KERNELS[0]);

// The ops of `adam_pass_f32`, in the order they run.
const GRAD: i32 = 0;
const DECAY: i32 = 1;
const LERP: i32 = 2;
const MUL_V: i32 = 3;
const ADDCMUL: i32 = 4;
const MAX: i32 = 5;
const SQRT: i32 = 6;
const DIV: i32 = 7;
const ADD_EPS: i32 = 8;
const ADDCDIV: i32 = 9;

/// The addresses of one piece (a tensor, or a range of one) and its temporary.
#[derive(Debug, Clone, Copy)]
struct Span {
    param: u64,
    grad: u64,
    exp_avg: u64,
    exp_avg_sq: u64,
    max_exp_avg_sq: u64,
    tmp: u64,
}

impl Span {
    /// The span of elements from `start` of a parameter whose buffers (of `elem`-byte elements)
    /// start at `base`.
    fn at(base: Span, start: usize, elem: u64) -> Span {
        let offset = start as u64 * elem;
        let shift = |a: u64| if a == 0 { 0 } else { a + offset };
        Span {
            param: shift(base.param),
            grad: shift(base.grad),
            exp_avg: shift(base.exp_avg),
            exp_avg_sq: shift(base.exp_avg_sq),
            max_exp_avg_sq: shift(base.max_exp_avg_sq),
            tmp: base.tmp,
        }
    }
}

fn span_of(item: &StepItem<'_, AdamState>) -> Span {
    Span {
        param: address(item.param),
        grad: address(&item.grad),
        exp_avg: address(&item.state.exp_avg),
        exp_avg_sq: address(&item.state.exp_avg_sq),
        max_exp_avg_sq: item.state.max_exp_avg_sq.as_ref().map_or(0, address),
        tmp: 0,
    }
}

/// Writes an `AdamPiece` (`kernels/adam.cu`).
fn write_piece(
    table: &mut Table,
    cfg: &AdamConfig,
    head: PieceHead,
    span: Span,
    grad_scale: Option<f32>,
) {
    let c = StepConsts::new(cfg, head.step);
    let piece_flags = flags::when(grad_scale.is_some(), flags::HOST_SCALED)
        | flags::when(c.maximize, flags::MAXIMIZE)
        | flags::when(c.l2.is_some(), flags::L2)
        | flags::when(c.decay_factor.is_some(), flags::DECAY)
        | flags::when(c.changes_grad(), flags::CHANGES_GRAD);
    table
        .entry(head)
        .u64(span.param)
        .u64(span.grad)
        .u64(span.exp_avg)
        .u64(span.exp_avg_sq)
        .u64(span.max_exp_avg_sq)
        .u64(span.tmp)
        .f64(cfg.lr)
        .f64(cfg.betas.0)
        .f64(cfg.betas.1)
        .u32(piece_flags)
        .f32(c.l2.unwrap_or(0.0))
        .f32(c.decay_factor.unwrap_or(1.0))
        .f32(c.one_minus_beta1)
        .f32(c.beta2)
        .f32(c.one_minus_beta2)
        .f32(c.bias_correction2_sqrt)
        .f32(c.eps)
        .f32(c.neg_step_size)
        .f32(grad_scale.unwrap_or(1.0))
        .end(PIECE_SIZE);
}

/// The pass ops `cfg` needs, in launch order. Those that need no temporary (v's two ops and m's
/// lerp, unless the gradient is modified into the temporary first; AMSGrad's maximum) run over
/// whole tensors, as PyTorch runs every op; the rest chunk by chunk, decay just before p's
/// update, so that a chunk's arrays are reused while they are still in the L2.
fn ops(cfg: &AdamConfig) -> PassOps {
    let c = StepConsts::new(cfg, 1);
    let mut ops = PassOps::default();
    if c.changes_grad() {
        ops.whole.push(MUL_V);
        ops.chunked.extend([GRAD, ADDCMUL, LERP]);
        if cfg.amsgrad {
            ops.chunked.push(MAX);
        }
    } else {
        ops.whole.extend([MUL_V, ADDCMUL, LERP]);
        if cfg.amsgrad {
            ops.whole.push(MAX);
        }
    }
    ops.chunked.extend([SQRT, DIV, ADD_EPS]);
    if cfg.weight_decay != 0.0 && cfg.decay == WeightDecay::Decoupled {
        ops.chunked.push(DECAY);
    }
    ops.chunked.push(ADDCDIV);
    ops
}

/// One step of the rule's `items` on the device.
pub(crate) fn step(
    device: &mut CudaDevice,
    cfg: &AdamConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, AdamState>],
    scaling: StepScaling<'_>,
) -> Result<(), OptimError> {
    let Some(first) = items.first() else {
        return Ok(());
    };
    let like = first.param.clone();
    let dtype = like.dtype();
    let elem = dtype.size_in_bytes() as u64;
    let geometry = geometry(items);
    let spans: Vec<Span> = items.iter().map(span_of).collect();
    if implementation == Implementation::Fused {
        let grad_scale = scaling.host().grad_scale;
        return device.run_fused(
            (Module::Adam, instance(dtype, FUSED_KERNELS)),
            &geometry,
            FUSED,
            scaling,
            &mut |table, idx, head| write_piece(table, cfg, head, spans[idx], grad_scale),
        );
    }
    let lens: Vec<usize> = geometry.iter().map(|g| g.len).collect();
    device.run_unfused(
        (Module::Adam, instance(dtype, PASS_KERNELS)),
        &like,
        &lens,
        foreach_chunk(implementation),
        &ops(cfg),
        &mut |table, idx, range, tmp, first_block| {
            let head = PieceHead {
                len: range.len() as u64,
                first_block,
                skipped: 0,
                step: geometry[idx].step,
            };
            let span = Span {
                tmp,
                ..Span::at(spans[idx], range.start, elem)
            };
            write_piece(table, cfg, head, span, None);
        },
    )
}

/// One parameter's device buffers (f32, `len` elements each), by address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAdamParam {
    /// The parameter.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// First moment.
    pub exp_avg: u64,
    /// Second moment.
    pub exp_avg_sq: u64,
    /// Running maximum of the second moment (AMSGrad), if used.
    pub max_exp_avg_sq: Option<u64>,
    /// Elements.
    pub len: usize,
}

/// Fused Adam over a fixed list of device buffers: one launch per step for the whole list, the
/// same kernel as the optimizer's fused implementation (bit-identical to
/// [`crate::kernels::adam_fused`]).
#[derive(Debug)]
pub struct CudaFusedAdam {
    device: CudaDevice,
    params: Vec<DeviceAdamParam>,
    amsgrad: bool,
}

impl CudaFusedAdam {
    /// Fused Adam over `params` on `backend`.
    ///
    /// # Safety
    /// Every address in `params` must be a live f32 buffer of `len` elements on `backend`'s
    /// device for as long as this value is used, and the buffers of different parameters must
    /// not overlap.
    pub unsafe fn new(
        backend: Arc<CudaBackend>,
        params: &[DeviceAdamParam],
    ) -> Result<CudaFusedAdam, OptimError> {
        let amsgrad = params.iter().any(|p| p.max_exp_avg_sq.is_some());
        if amsgrad && !params.iter().all(|p| p.max_exp_avg_sq.is_some()) {
            return Err(OptimError::InvalidArgument {
                op: "CudaFusedAdam",
                reason: "either every parameter or none has an AMSGrad buffer".into(),
            });
        }
        Ok(CudaFusedAdam {
            device: CudaDevice::new(backend, 0),
            params: params.to_vec(),
            amsgrad,
        })
    }

    /// Adam step number `step` (counted from 1) on every parameter. `grad_scale` and
    /// `found_inf` are device addresses of one f32 each (the GradScaler's): gradients are divided
    /// by the scale, and nothing is written when the flag is non-zero (the caller does not count
    /// such a step).
    pub fn step(
        &mut self,
        cfg: &AdamConfig,
        step: u64,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
    ) -> Result<(), OptimError> {
        if cfg.amsgrad != self.amsgrad {
            return Err(OptimError::InvalidArgument {
                op: "CudaFusedAdam::step",
                reason: "amsgrad differs from the buffers given at creation".into(),
            });
        }
        let mut table = Table::default();
        let mut first_block = 0;
        for p in &self.params {
            let head = PieceHead {
                len: p.len as u64,
                first_block,
                skipped: 0,
                step,
            };
            let span = Span {
                param: p.param,
                grad: p.grad,
                exp_avg: p.exp_avg,
                exp_avg_sq: p.exp_avg_sq,
                max_exp_avg_sq: p.max_exp_avg_sq.unwrap_or(0),
                tmp: 0,
            };
            write_piece(&mut table, cfg, head, span, None);
            first_block += blocks_for(p.len, FUSED.0);
        }
        self.device.run_elementwise(
            FUSED_KERNEL,
            &table,
            self.params.len(),
            first_block,
            FUSED,
            (grad_scale.unwrap_or(0), found_inf.unwrap_or(0)),
        )
    }
}
