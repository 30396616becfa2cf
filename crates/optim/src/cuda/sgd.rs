//! SGD's CUDA pieces (`kernels/sgd.cu`) for the multi-tensor driver (`multi_tensor.rs`): the
//! kernel names, the momentum buffer's address, the pass ops and the `SgdPiece` layout, with
//! the constants and op order of `kernels/sgd.rs`, for f32, bf16 and f16 parameters. A piece's
//! first step (the momentum buffer takes the gradient) is its step number 1, counted on the
//! device after GradScaler skips. [`CudaSgd`] steps raw device buffers with the fused kernel.

use std::sync::Arc;

use headroom_autograd_core::DType;
use headroom_ops_cuda::CudaBackend;

use super::launch::{
    address, check_disjoint, fused_block_elems, instance, raw_geometry, CudaDevice, Module, PassOps,
};
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
    const REPLAYED: bool = false;

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

/// One parameter's device buffers for a raw SGD step (`len` elements of the step's dtype each),
/// by address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSgdParam {
    /// The parameter.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// The momentum buffer, present exactly when the momentum is non-zero.
    pub momentum_buffer: Option<u64>,
    /// Elements.
    pub len: usize,
}

/// Fused SGD over raw device buffers given per call (a framework's tensors): one launch of
/// `sgd_fused_*` for every parameter, the bits of [`crate::kernels::sgd_fused`].
#[derive(Debug)]
pub struct CudaSgd {
    device: CudaDevice,
}

impl CudaSgd {
    /// Fused SGD launching on `backend`'s compute stream.
    pub fn new(backend: Arc<CudaBackend>) -> CudaSgd {
        CudaSgd {
            device: CudaDevice::new(backend, 0),
        }
    }

    /// One step of every parameter of `params`, all of `dtype` (f32, bf16 or f16), at step
    /// number `step` (1: the momentum buffers take the gradients). `scaling` holds the device
    /// addresses of a GradScaler's scale and found-inf flag (one f32 each), or `None` for each.
    ///
    /// # Safety
    /// Every address of `params` must be a live buffer of `len` elements of `dtype` on the
    /// backend's device until the launch completes, the buffers of different parameters not
    /// overlapping; each address of `scaling` a live f32 of the backend's device until then.
    pub unsafe fn step_buffers(
        &mut self,
        cfg: &SgdConfig,
        dtype: DType,
        step: u64,
        params: &[DeviceSgdParam],
        (grad_scale, found_inf): (Option<u64>, Option<u64>),
    ) -> Result<(), OptimError> {
        const OP: &str = "CudaSgd::step_buffers";
        cfg.validate()?;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(OptimError::InvalidArgument {
                op: OP,
                reason: format!("{dtype:?} parameters (f32, bf16 or f16)"),
            });
        }
        if !params
            .iter()
            .all(|p| p.momentum_buffer.is_some() == cfg.has_momentum())
        {
            return Err(OptimError::InvalidArgument {
                op: OP,
                reason: "a momentum buffer must be given exactly when the momentum is non-zero"
                    .into(),
            });
        }
        let elem = dtype.size_in_bytes() as u64;
        check_disjoint(
            OP,
            params.iter().flat_map(|p| {
                let bytes = p.len as u64 * elem;
                [p.param, p.grad]
                    .into_iter()
                    .chain(p.momentum_buffer)
                    .map(move |address| (address, bytes))
            }),
        )?;
        let geometry = raw_geometry(OP, params.iter().map(|p| p.len), step)?;
        let total_len = params.iter().map(|p| p.len).sum();
        let block = (
            fused_block_elems(total_len, SgdConfig::FUSED_BLOCK),
            SgdConfig::FUSED_BLOCK.1,
        );
        let (table, n_blocks) =
            self.device
                .piece_table(&geometry, block.0, false, &mut |t, idx, head| {
                    let p = &params[idx];
                    let span = Span {
                        param: p.param,
                        grad: p.grad,
                        states: [p.momentum_buffer.unwrap_or(0), 0, 0],
                        tmp: 0,
                    };
                    cfg.write_piece(t, head, span, None);
                })?;
        let kernel = (Module::Sgd, instance(dtype, SgdConfig::FUSED_KERNELS));
        let addresses = (grad_scale.unwrap_or(0), found_inf.unwrap_or(0));
        self.device
            .run_elementwise(kernel, &table, params.len(), n_blocks, block, addresses)
    }
}
