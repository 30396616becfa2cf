//! torchao's 4-bit Adam/AdamW on CUDA (`kernels/adam4bit.cu`): the rule's step over tensors —
//! one launch for the parameters with 4-bit states (one CUDA block per block of 128), one for
//! those with f32 states; each in the kernel instance of the parameters' dtype (f32 or bf16).
//!
//! It sits on the launch layer (`launch.rs`, `table.rs`), the raw kernels' step constants and
//! code tables (`kernels/adam4bit.rs`, so the GPU computes with the host's values) and the state
//! addresses, rounding fields and kernel choice of the 8-bit piece (`adam8bit.rs`); it knows
//! nothing of the host driver. [`CudaAdam4bit`] steps raw device buffers with the same launches.

use std::sync::Arc;

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cuda::{CudaBackend, KernelArg};

use super::adam8bit::{kernel_of, rounding_fields, state_spans, DeviceAdam8bitParam};
use super::launch::{
    address, check_disjoint, fused_block_elems, raw_geometry, scaling_addresses, CudaDevice, Module,
};
use super::table::{flags, PieceHead, Table};
use crate::adam8bit::BlockwiseState;
use crate::error::OptimError;
use crate::kernels::{
    code_thresholds, is_quantized_4bit, qmap4_tables, Adam4bitConfig, Adam4bitConsts, AO_BLOCK_SIZE,
};
use crate::rule::CudaKernels;
use crate::step::{RuleCall, Scaling};

/// `sizeof(Ao4Piece)` in the kernel.
const PIECE_SIZE: usize = 400;
/// The 4-bit and f32-state kernels by parameter dtype: f32, bf16.
const BLOCKWISE_KERNELS: [&str; 2] = ["adam4bit_blockwise_f32", "adam4bit_blockwise_bf16"];
const F32_STATES_KERNELS: [&str; 2] = ["adam4bit_f32_states_f32", "adam4bit_f32_states_bf16"];
/// Warps per CUDA block of the 4-bit kernel (`AO_WARPS`), and the most CUDA blocks of a launch
/// (the warps loop over the rest).
const WARPS: u64 = 8;
const MAX_GRID: u64 = 132 * 16;
/// Elements and threads per block of the f32-state kernel.
const F32_STATES: (u64, u32) = (4096, 256);

/// Writes an `Ao4Piece`: parameter, gradient, the two states and the two scale arrays (0 for f32
/// states), the step's constants, both code tables and their code thresholds (the kernel's
/// quantiser, [`crate::kernels::code_thresholds`]) and the rounding of the parameter at `slot`.
fn write_piece(
    table: &mut Table,
    cfg: &Adam4bitConfig,
    (head, slot): (PieceHead, usize),
    span: [u64; 6],
    grad_scale: Option<f32>,
) {
    let c = Adam4bitConsts::new(cfg, head.step);
    let (rounding_flag, stream) = rounding_fields(cfg.bf16_rounding, slot);
    let piece_flags = flags::when(grad_scale.is_some(), flags::HOST_SCALED)
        | flags::when(c.decoupled, flags::DECAY)
        | rounding_flag;
    let entry = table.entry(head).u64s(&span);
    entry
        .u32(piece_flags)
        .f32(c.lr)
        .f32(c.lr_wd)
        .f32(c.wd)
        .f32(c.w1)
        .f32(c.w2)
        .f32(c.bc1)
        .f32(c.sqrt_bc2)
        .f32(c.eps)
        .f32(grad_scale.unwrap_or(1.0))
        .f32(cfg.betas.0 as f32)
        .f32(cfg.betas.1 as f32);
    let (signed, unsigned) = qmap4_tables();
    let (signed_thresholds, unsigned_thresholds) = code_threshold_tables();
    for &value in signed
        .iter()
        .chain(unsigned)
        .chain(signed_thresholds)
        .chain(unsigned_thresholds)
    {
        entry.f32(value);
    }
    entry.u64s(&stream).end(PIECE_SIZE);
}

/// The code thresholds of both tables, computed once per process.
fn code_threshold_tables() -> &'static ([f32; 16], [f32; 16]) {
    static THRESHOLDS: std::sync::OnceLock<([f32; 16], [f32; 16])> = std::sync::OnceLock::new();
    THRESHOLDS.get_or_init(|| {
        let (signed, unsigned) = qmap4_tables();
        (code_thresholds(signed), code_thresholds(unsigned))
    })
}

/// The CUDA entry of 4-bit Adam (whose one implementation is fused).
impl CudaKernels<BlockwiseState> for Adam4bitConfig {
    fn cuda_step(
        &self,
        device: &mut CudaDevice,
        call: RuleCall<'_, '_, BlockwiseState>,
    ) -> Result<(), OptimError> {
        let RuleCall { items, scaling, .. } = call;
        // The optimizer calls a rule with parameters of one dtype at a time.
        let Some(dtype) = items.first().map(|it| it.param.dtype()) else {
            return Ok(());
        };
        let grad_scale = scaling.host().grad_scale;
        let (quantized, full) = state_spans(items);
        let count_skips = matches!(scaling, Scaling::Device(_));
        let block = AO_BLOCK_SIZE as u64;
        let (table, n_blocks) =
            device.piece_table(&quantized.0, block, count_skips, &mut |t, idx, head| {
                let at = (head, quantized.0[idx].slot);
                write_piece(t, self, at, quantized.1[idx], grad_scale)
            })?;
        // A warp per block of 128, grid-stride: the third argument is the blocks in all.
        let grid = n_blocks.div_ceil(WARPS).min(MAX_GRID);
        device.run_elementwise(
            kernel_of(Module::Adam4bit, BLOCKWISE_KERNELS, dtype),
            &table,
            quantized.0.len(),
            grid,
            (n_blocks, (WARPS * 32) as u32),
            scaling_addresses(scaling),
        )?;
        device.run_fused(
            kernel_of(Module::Adam4bit, F32_STATES_KERNELS, dtype),
            &full.0,
            F32_STATES,
            (scaling, false),
            &mut |t, idx, head| {
                let at = (head, full.0[idx].slot);
                write_piece(t, self, at, full.1[idx], grad_scale)
            },
        )
    }
}

/// torchao's 4-bit Adam/AdamW over raw device buffers given per call (a framework's tensors):
/// the launches of the rule's CUDA entry, the bits of [`crate::kernels::adam4bit_blockwise`] and
/// [`crate::kernels::adam4bit_f32_states`].
#[derive(Debug)]
pub struct CudaAdam4bit {
    device: CudaDevice,
}

impl CudaAdam4bit {
    /// 4-bit Adam launching on `backend`'s compute stream.
    pub fn new(backend: Arc<CudaBackend>) -> CudaAdam4bit {
        CudaAdam4bit {
            device: CudaDevice::new(backend, 0),
        }
    }

    /// One step of every parameter of `params` (all of `dtype`, f32 or bf16) at step number
    /// `step`: a parameter whose length [`is_quantized_4bit`] has packed 4-bit codes in `state1`
    /// and `state2` (half its length in bytes each) and one f32 scale per block of 128 in
    /// `absmax1` and `absmax2`; any other has f32 states of its length and absmax addresses of 0.
    /// `slots[i]` is parameter `i`'s index among the caller's, which keys a bf16 parameter's
    /// stochastic rounding. `scaling` holds the device addresses of a GradScaler's scale and
    /// found-inf flag (one f32 each), or `None` for each.
    ///
    /// # Safety
    /// Every address of `params` must be a live buffer of the sizes above on the backend's
    /// device until the launches complete, the buffers of different parameters not overlapping;
    /// each address of `scaling` a live f32 of the backend's device until then.
    pub unsafe fn step_buffers(
        &mut self,
        cfg: &Adam4bitConfig,
        dtype: DType,
        step: u64,
        params: &[DeviceAdam8bitParam],
        slots: &[usize],
        (grad_scale, found_inf): (Option<u64>, Option<u64>),
    ) -> Result<(), OptimError> {
        const OP: &str = "CudaAdam4bit::step_buffers";
        cfg.validate()?;
        let invalid = |reason: String| Err(OptimError::InvalidArgument { op: OP, reason });
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return invalid(format!("{dtype:?} parameters (f32 or bf16)"));
        }
        if slots.len() != params.len() {
            return invalid(format!(
                "{} slots for {} parameters",
                slots.len(),
                params.len()
            ));
        }
        if let Some(p) = params
            .iter()
            .find(|p| (p.absmax1 != 0 && p.absmax2 != 0) != is_quantized_4bit(p.len))
        {
            return invalid(format!(
                "a parameter of {} elements has {} absmax buffers",
                p.len,
                if is_quantized_4bit(p.len) {
                    "no"
                } else {
                    "unexpected"
                }
            ));
        }
        let elem = dtype.size_in_bytes() as u64;
        check_disjoint(
            OP,
            params.iter().flat_map(|p| {
                let n = p.len as u64;
                let (state, scales) = if is_quantized_4bit(p.len) {
                    (n / 2, 4 * (n / AO_BLOCK_SIZE as u64))
                } else {
                    (4 * n, 0)
                };
                [
                    (p.param, elem * n),
                    (p.grad, elem * n),
                    (p.state1, state),
                    (p.state2, state),
                    (p.absmax1, scales),
                    (p.absmax2, scales),
                ]
                .into_iter()
                .filter(|&(_, bytes)| bytes > 0)
            }),
        )?;
        let addresses = (grad_scale.unwrap_or(0), found_inf.unwrap_or(0));
        let (quantized, full): (Vec<usize>, Vec<usize>) =
            (0..params.len()).partition(|&i| is_quantized_4bit(params[i].len));
        let span =
            |p: &DeviceAdam8bitParam| [p.param, p.grad, p.state1, p.state2, p.absmax1, p.absmax2];

        let geometry = raw_geometry(OP, quantized.iter().map(|&i| params[i].len), step)?;
        let (table, n_blocks) = self.device.piece_table(
            &geometry,
            AO_BLOCK_SIZE as u64,
            false,
            &mut |t, idx, head| {
                let i = quantized[idx];
                write_piece(t, cfg, (head, slots[i]), span(&params[i]), None)
            },
        )?;
        // A warp per block of 128, grid-stride: the third argument is the blocks in all.
        let grid = n_blocks.div_ceil(WARPS).min(MAX_GRID);
        self.device.run_elementwise(
            kernel_of(Module::Adam4bit, BLOCKWISE_KERNELS, dtype),
            &table,
            quantized.len(),
            grid,
            (n_blocks, (WARPS * 32) as u32),
            addresses,
        )?;

        let geometry = raw_geometry(OP, full.iter().map(|&i| params[i].len), step)?;
        let total_len = full.iter().map(|&i| params[i].len).sum();
        let block = (fused_block_elems(total_len, F32_STATES), F32_STATES.1);
        let (table, n_blocks) =
            self.device
                .piece_table(&geometry, block.0, false, &mut |t, idx, head| {
                    let i = full[idx];
                    write_piece(t, cfg, (head, slots[i]), span(&params[i]), None)
                })?;
        self.device.run_elementwise(
            kernel_of(Module::Adam4bit, F32_STATES_KERNELS, dtype),
            &table,
            full.len(),
            n_blocks,
            block,
            addresses,
        )
    }
}

/// Test support for the 4-bit kernel's fast arithmetic (`kernels/adam4bit.cu` writes out the
/// instructions of a correctly rounded division and square root, with its own range checks):
/// over every float of biased exponent `exponent` (both signs, every significand) that the fast
/// path admits as a dividend, how many quotients by each of `divisors` (a contiguous f32 CUDA
/// tensor; those out of the fast path's range are skipped) differ in bits from `div.rn`'s, and
/// over those it admits as a radicand, how many square roots differ from `sqrt.rn`'s. Not part of
/// the optimizer's interface: `tests/cuda_adam4bit.rs` sweeps every exponent with it.
#[doc(hidden)]
pub fn fast_arithmetic_mismatches(divisors: &Tensor, exponent: u8) -> Result<[u32; 2], OptimError> {
    const OP: &str = "fast_arithmetic_mismatches";
    if divisors.dtype() != DType::F32 || !divisors.is_contiguous() {
        return Err(OptimError::InvalidArgument {
            op: OP,
            reason: format!(
                "divisors must be a contiguous f32 tensor, not {:?}",
                divisors.dtype()
            ),
        });
    }
    let mut device = CudaDevice::of(OP, divisors, 0)?;
    let counts = Tensor::zeros(divisors.backend(), &[2], DType::I32)?;
    let n = u32::try_from(divisors.numel()).map_err(|_| OptimError::InvalidArgument {
        op: OP,
        reason: format!("{} divisors: at most u32::MAX", divisors.numel()),
    })?;
    let args = [
        KernelArg::U64(address(divisors)),
        KernelArg::U32(n),
        KernelArg::U32(u32::from(exponent)),
        KernelArg::U64(address(&counts)),
    ];
    // SAFETY: the arguments match adam4bit_fast_arithmetic_mismatches' parameters (a pointer to
    // n floats, their count, the exponent, a pointer to two unsigned counters); `divisors` and
    // `counts` are live contiguous tensors of this backend for the launch, which reads n floats
    // and adds to two 4-byte counters. One thread per sign and significand: 2^24 threads.
    unsafe {
        device.launch(
            Module::Adam4bit,
            "adam4bit_fast_arithmetic_mismatches",
            1 << 16,
            256,
            &args,
        )
    }?;
    let counts = counts.to_vec::<i32>()?;
    Ok([counts[0] as u32, counts[1] as u32])
}
