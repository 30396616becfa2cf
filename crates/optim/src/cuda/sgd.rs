//! SGD's CUDA pieces (`kernels/sgd.cu`) for the multi-tensor driver (`multi_tensor.rs`): the
//! kernel names, the momentum buffer's address, the pass ops and the `SgdPiece` layout, with
//! the constants and op order of `kernels/sgd.rs`, for f32, bf16 and f16 parameters. A piece's
//! first step (the momentum buffer takes the gradient) is its step number 1, counted on the
//! device after GradScaler skips.

use super::launch::{address, CudaDevice, Module, PassOps};
use super::multi_tensor::{self, PieceKernels, Span};
use super::table::{flags, PieceHead, Table};
use crate::error::OptimError;
use crate::kernels::{SgdConfig, SgdConsts};
use crate::rule::CudaKernels;
use crate::sgd::SgdState;
use crate::step::RuleCall;

const PIECE_SIZE: usize = 88;

impl CudaKernels<SgdState> for SgdConfig {
    fn cuda_step(
        &self,
        device: &mut CudaDevice,
        call: RuleCall<'_, '_, SgdState>,
    ) -> Result<(), OptimError> {
        multi_tensor::step(self, device, call)
    }
}

impl PieceKernels for SgdConfig {
    const MODULE: Module = Module::Sgd;
    const FUSED_KERNELS: [&'static str; 3] = ["sgd_fused_f32", "sgd_fused_bf16", "sgd_fused_f16"];
    const PASS_KERNELS: [&'static str; 3] = ["sgd_pass_f32", "sgd_pass_bf16", "sgd_pass_f16"];
    const FUSED_BLOCK: (u64, u32) = (4096, 256);

    fn state_addresses(state: &SgdState) -> [u64; 3] {
        [state.momentum_buffer.as_ref().map_or(0, address), 0, 0]
    }

    /// Every op reads or writes the temporary (the modified gradient), so all run chunk by
    /// chunk.
    fn pass_ops(&self) -> PassOps {
        let mut chunked = vec![GRAD];
        if self.has_momentum() {
            chunked.extend([BUF, BUF_ADD, USE_BUF]);
        }
        chunked.push(PARAM);
        PassOps {
            whole: Vec::new(),
            chunked,
        }
    }

    /// Writes an `SgdPiece` (`kernels/sgd.cu`).
    fn write_piece(&self, table: &mut Table, head: PieceHead, span: Span, grad_scale: Option<f32>) {
        let c = SgdConsts::new(self);
        let piece_flags = flags::when(grad_scale.is_some(), flags::HOST_SCALED)
            | flags::when(c.maximize, flags::MAXIMIZE)
            | flags::when(c.weight_decay.is_some(), flags::L2)
            | flags::when(c.momentum.is_some(), flags::MOMENTUM)
            | flags::when(c.nesterov, flags::NESTEROV);
        table
            .entry(head)
            .u64(span.param)
            .u64(span.grad)
            .u64(span.states[0])
            .u64(span.tmp)
            .u32(piece_flags)
            .f32(c.weight_decay.unwrap_or(0.0))
            .f32(c.momentum.unwrap_or(0.0))
            .f32(c.one_minus_dampening)
            .f32(c.neg_lr)
            .f32(grad_scale.unwrap_or(1.0))
            .end(PIECE_SIZE);
    }
}

// The ops of `sgd_pass_f32`, in the order they run.
const GRAD: i32 = 0;
const BUF: i32 = 1;
const BUF_ADD: i32 = 2;
const USE_BUF: i32 = 3;
const PARAM: i32 = 4;
