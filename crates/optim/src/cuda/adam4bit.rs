//! torchao's 4-bit Adam/AdamW on CUDA (`kernels/adam4bit.cu`): the rule's step over tensors —
//! one launch for the parameters with 4-bit states (one CUDA block per block of 128), one for
//! those with f32 states; each in the kernel instance of the parameters' dtype (f32 or bf16).
//!
//! It sits on the launch layer (`launch.rs`, `table.rs`), the raw kernels' step constants and
//! code tables (`kernels/adam4bit.rs`, so the GPU computes with the host's values) and the state
//! addresses, rounding fields and kernel choice of the 8-bit piece (`adam8bit.rs`); it knows
//! nothing of the host driver.

use super::adam8bit::{kernel_of, rounding_fields, state_spans};
use super::launch::{scaling_addresses, CudaDevice, Module};
use super::table::{flags, PieceHead, Table};
use crate::adam8bit::BlockwiseState;
use crate::error::OptimError;
use crate::kernels::{qmap4_tables, Adam4bitConfig, Adam4bitConsts, AO_BLOCK_SIZE};
use crate::rule::CudaKernels;
use crate::step::{RuleCall, Scaling};

/// `sizeof(Ao4Piece)` in the kernel.
const PIECE_SIZE: usize = 272;
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
/// states), the step's constants, both code tables and the rounding of the parameter at `slot`.
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
    for &value in signed.iter().chain(unsigned) {
        entry.f32(value);
    }
    entry.u64s(&stream).end(PIECE_SIZE);
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
            scaling,
            &mut |t, idx, head| {
                let at = (head, full.0[idx].slot);
                write_piece(t, self, at, full.1[idx], grad_scale)
            },
        )
    }
}
