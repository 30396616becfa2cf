//! bitsandbytes' 8-bit blockwise Adam on CUDA (`kernels/adam8bit.cu`): the rule's step over
//! tensors (8-bit states, and f32 states under `MIN_8BIT_SIZE`), and [`CudaAdam8bit`] over raw
//! device buffers.
//!
//! The kernel finds codes through [`StateCodeTable`]s (exactly bitsandbytes' search, without
//! it), uploaded once per device with the two maps; warps take runs of 256-element blocks from a
//! counter stored after the tables, which the host zeroes (asynchronously) before each launch.
//! Its `state_spans` (the addresses of a [`BlockwiseState`] step), `rounding_fields` and
//! `kernel_of` serve the 4-bit piece too. The rule's parameters are f32 or bf16 (a kernel instance
//! each); the raw-buffer layer's are f32.

use std::sync::Arc;

use headroom_ops_cuda::{CudaBackend, KernelArg};

use super::launch::{
    address, check_disjoint, checked_scaling_addresses, geometry, raw_geometry, scaling_addresses,
    CudaDevice, ItemGeometry, Module,
};
use super::table::{flags, PieceHead, Table};
use crate::adam8bit::{bnb_maps, BlockwiseState};
use crate::error::OptimError;
use crate::kernels::{
    check_step, Adam8bitConfig, Adam8bitConsts, Bf16Rounding, StateCodeTable, BNB_BLOCK_SIZE,
    CODE_BINS_PER_SIGN, MIN_8BIT_SIZE,
};
use crate::rule::CudaKernels;
use crate::step::{DeviceGradScaling, RuleCall, Scaling, StepItem};
use headroom_autograd_core::DType;

const PIECE_SIZE: usize = 144;
/// The 8-bit and 32-bit kernels by parameter dtype: f32, bf16 (the 8-bit kernels of each
/// [`Adam8bitMath`]: its arithmetic is compiled in, not tested per element).
const BLOCKWISE_KERNELS: [&str; 2] = ["adam8bit_blockwise_f32", "adam8bit_blockwise_bf16"];
const BLOCKWISE_BNB_KERNELS: [&str; 2] =
    ["adam8bit_blockwise_bnb_f32", "adam8bit_blockwise_bnb_bf16"];
const BNB32_KERNELS: [&str; 2] = ["adam_bnb32_f32", "adam_bnb32_bf16"];
/// Elements and threads per block of the 32-bit kernel.
const BNB32: (u64, u32) = (4096, 256);
/// 256-element blocks a warp takes at a time, warps per CUDA block, and the most CUDA blocks.
const GRAB: u64 = 16;
const WARPS: u64 = 8;
const MAX_GRID: u64 = 2048;
/// Byte offset of the work counter in the lookup tables (`TABLE_WORDS * 4` in the kernel).
const COUNTER_OFFSET: u64 = 38944;

/// The lookup tables in the kernel's layout: both maps, the signed map's code bins (both signs),
/// the unsigned map's (positive values only: its states are never negative), both NaN codes,
/// then the zeroed work counter.
fn code_table_bytes() -> Vec<u8> {
    let (signed, unsigned) = bnb_maps();
    let (table1, table2) = (
        StateCodeTable::new(signed, true),
        StateCodeTable::new(unsigned, false),
    );
    let mut words: Vec<u32> = Vec::with_capacity(COUNTER_OFFSET as usize / 4 + 2);
    words.extend(signed.iter().chain(unsigned.iter()).map(|v| v.to_bits()));
    words.extend(&table1.bins);
    words.extend(&table2.bins[..CODE_BINS_PER_SIGN]);
    words.extend([u32::from(table1.nan_code), u32::from(table2.nan_code)]);
    assert_eq!(
        words.len() as u64 * 4,
        COUNTER_OFFSET,
        "8-bit lookup table layout"
    );
    words.extend([0, 0]);
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The arithmetic of an 8-bit Adam step on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Adam8bitMath {
    /// bitsandbytes' operations in its source's order, each rounded correctly: the same bits on
    /// the CPU ([`crate::kernels::adam8bit_blockwise`]) and the GPU, within 3e-5 of
    /// bitsandbytes' own step.
    #[default]
    Portable,
    /// The instructions bitsandbytes 0.50's CUDA build executes (it is compiled with fast math):
    /// `powf` as `ex2(step · lg2(β))`, approximate square root and reciprocal, its fused
    /// multiply-adds, denormals flushed, in the same order, so the same bits as
    /// `bitsandbytes.optim.Adam8bit` on the same GPU (on an H200 against bitsandbytes 0.50.2:
    /// every ViT-L/16 parameter after 20 steps, and `tests/cuda_bnb_adam8bit.rs`'s golden data).
    /// GPU only: no CPU has these instructions.
    Bitsandbytes,
}

/// The kernel of `module` among `names` (f32, bf16) for parameters of `dtype`.
pub(super) fn kernel_of(
    module: Module,
    names: [&'static str; 2],
    dtype: DType,
) -> (Module, &'static str) {
    (module, names[usize::from(dtype == DType::BF16)])
}

/// A block-wise piece's rounding: its flag, and the seed and parameter index (`slot`) that key
/// its stream (zero when it rounds to nearest).
pub(super) fn rounding_fields(rounding: Bf16Rounding, slot: usize) -> (u32, [u64; 2]) {
    match rounding {
        Bf16Rounding::Nearest => (0, [0, 0]),
        Bf16Rounding::Stochastic { seed } => (flags::STOCHASTIC, [seed, slot as u64]),
    }
}

/// Writes a `Bnb8Piece` (`kernels/adam8bit.cu`): parameter, gradient, the two states and the
/// two absmax buffers (0 for f32 states), and the rounding of the parameter at `slot`.
fn write_piece(
    table: &mut Table,
    cfg: &Adam8bitConfig,
    (head, slot): (PieceHead, usize),
    span: [u64; 6],
    grad_scale: Option<f32>,
    math: Adam8bitMath,
) {
    let c = Adam8bitConsts::new(cfg, head.step);
    let (rounding_flag, stream) = rounding_fields(cfg.bf16_rounding, slot);
    let piece_flags = flags::when(grad_scale.is_some(), flags::HOST_SCALED)
        | flags::when(c.decay_factor.is_some(), flags::DECAY)
        | flags::when(math == Adam8bitMath::Bitsandbytes, flags::BNB_ARITH)
        | rounding_flag;
    let entry = table.entry(head).u64s(&span);
    entry
        .u32(piece_flags)
        .f32(c.beta1)
        .f32(c.beta2)
        .f32(c.one_minus_beta1)
        .f32(c.one_minus_beta2)
        .f32(c.correction2)
        .f32(c.eps)
        .f32(c.step_size)
        .f32(c.decay_factor.unwrap_or(1.0))
        .f32(grad_scale.unwrap_or(1.0))
        .f32(cfg.lr as f32)
        .f32(cfg.weight_decay as f32)
        .u64s(&stream)
        .end(PIECE_SIZE);
}

/// One launch of the blockwise kernel `kernel` over `table`'s pieces (`n_blocks` 256-element
/// blocks).
fn launch_blockwise(
    device: &mut CudaDevice,
    kernel: (Module, &'static str),
    table: &Table,
    n_pieces: usize,
    n_blocks: u64,
    (grad_scale, found_inf): (u64, u64),
) -> Result<(), OptimError> {
    if n_pieces == 0 {
        return Ok(());
    }
    let tables = device.code_tables(code_table_bytes)?;
    // SAFETY: the lookup tables hold the counter at COUNTER_OFFSET (8 bytes); the copy is
    // ordered after the previous launch that used it.
    unsafe {
        device
            .backend()
            .write_async(tables + COUNTER_OFFSET, &[0u8; 8])
    }?;
    let [table_at, n_pieces] = device.table_args(table, n_pieces)?;
    let addresses = [n_blocks, tables, grad_scale, found_inf].map(KernelArg::U64);
    let args = [
        table_at,
        n_pieces,
        addresses[0],
        addresses[1],
        addresses[2],
        addresses[3],
    ];
    let grid = n_blocks.div_ceil(GRAB * WARPS).clamp(1, MAX_GRID) as u32;
    // SAFETY: `adam8bit_blockwise_*` take these parameters; the table was just written with
    // live tensors of the step (or the raw layer's buffers, live by its contract) of the
    // kernel's dtype, the lookup tables are owned by the device, the scale and flag are live
    // f32s or 0.
    unsafe { device.launch(kernel.0, kernel.1, grid, BNB_BLOCK_SIZE as u32, &args) }
}

/// The CUDA entry of 8-bit Adam (whose one implementation is fused): one launch for the 8-bit
/// states, one for the f32 states of small tensors.
impl CudaKernels<BlockwiseState> for Adam8bitConfig {
    fn cuda_step(
        &self,
        device: &mut CudaDevice,
        call: RuleCall<'_, '_, BlockwiseState>,
    ) -> Result<(), OptimError> {
        let RuleCall { items, scaling, .. } = call;
        step(self, device, items, scaling)
    }
}

/// The parameters of a block-wise rule's step (8-bit or 4-bit) with quantised states, then those
/// with f32 states: each list's geometry and, per parameter, the addresses of its parameter,
/// gradient, two states and two scale arrays (0 for f32 states).
pub(super) type StateSpans = (Vec<ItemGeometry>, Vec<[u64; 6]>);

/// [`StateSpans`] of `items`: `(quantised, f32 states)`.
pub(super) fn state_spans(items: &[StepItem<'_, BlockwiseState>]) -> (StateSpans, StateSpans) {
    let mut quantized = (Vec::new(), Vec::new());
    let mut full = (Vec::new(), Vec::new());
    for (it, g) in items.iter().zip(geometry(items)) {
        let (param, grad) = (address(it.param), address(&it.grad));
        let (list, span) = match &*it.state {
            BlockwiseState::Quantized {
                state1,
                state2,
                absmax1,
                absmax2,
            } => {
                let (state1, state2) = (address(state1), address(state2));
                let span = [
                    param,
                    grad,
                    state1,
                    state2,
                    address(absmax1),
                    address(absmax2),
                ];
                (&mut quantized, span)
            }
            BlockwiseState::Full { state1, state2 } => (
                &mut full,
                [param, grad, address(state1), address(state2), 0, 0],
            ),
        };
        list.0.push(g);
        list.1.push(span);
    }
    (quantized, full)
}

fn step(
    cfg: &Adam8bitConfig,
    device: &mut CudaDevice,
    items: &mut [StepItem<'_, BlockwiseState>],
    scaling: Scaling<'_>,
) -> Result<(), OptimError> {
    // The optimizer calls a rule with parameters of one dtype at a time.
    let Some(dtype) = items.first().map(|it| it.param.dtype()) else {
        return Ok(());
    };
    let grad_scale = scaling.host().grad_scale;
    let (quantized, full) = state_spans(items);
    let count_skips = matches!(scaling, Scaling::Device(_));
    let math = Adam8bitMath::Portable;
    let (table, n_blocks) = device.piece_table(
        &quantized.0,
        BNB_BLOCK_SIZE as u64,
        count_skips,
        &mut |t, idx, head| {
            let at = (head, quantized.0[idx].slot);
            write_piece(t, cfg, at, quantized.1[idx], grad_scale, math)
        },
    )?;
    let addresses = scaling_addresses(scaling);
    let blockwise = kernel_of(Module::Adam8bit, BLOCKWISE_KERNELS, dtype);
    launch_blockwise(
        device,
        blockwise,
        &table,
        quantized.0.len(),
        n_blocks,
        addresses,
    )?;
    device.run_fused(
        kernel_of(Module::Adam8bit, BNB32_KERNELS, dtype),
        &full.0,
        BNB32,
        (scaling, false),
        &mut |t, idx, head| {
            let at = (head, full.0[idx].slot);
            write_piece(t, cfg, at, full.1[idx], grad_scale, math)
        },
    )
}

/// One parameter's device buffers for 8-bit Adam, by address: f32 parameter and gradient of
/// `len` elements, u8 state codes of `len`, f32 absmax of `len.div_ceil(256)` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAdam8bitParam {
    /// The parameter.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// First-state codes (signed map).
    pub state1: u64,
    /// Second-state codes (unsigned map).
    pub state2: u64,
    /// Per-block scales of the first state.
    pub absmax1: u64,
    /// Per-block scales of the second state.
    pub absmax2: u64,
    /// Elements (at least `MIN_8BIT_SIZE`; smaller tensors keep 32-bit state in bitsandbytes).
    pub len: usize,
}

/// bitsandbytes' 8-bit blockwise Adam over a fixed list of device buffers: one launch per step,
/// the same kernel as the optimizer's 8-bit implementation, in the arithmetic of
/// [`Adam8bitMath`] (by default bit-identical to [`crate::kernels::adam8bit_blockwise`]).
#[derive(Debug)]
pub struct CudaAdam8bit {
    device: CudaDevice,
    params: Vec<DeviceAdam8bitParam>,
    math: Adam8bitMath,
}

impl CudaAdam8bit {
    /// 8-bit Adam over `params` on `backend`.
    ///
    /// # Safety
    /// Every address in `params` must be live memory of `backend`'s device of the sizes
    /// [`DeviceAdam8bitParam`] describes, for as long as this value is used, and the buffers
    /// of different parameters must not overlap.
    pub unsafe fn new(
        backend: Arc<CudaBackend>,
        params: &[DeviceAdam8bitParam],
    ) -> Result<CudaAdam8bit, OptimError> {
        if let Some(small) = params.iter().find(|p| p.len < MIN_8BIT_SIZE) {
            return Err(OptimError::InvalidArgument {
                op: "CudaAdam8bit",
                reason: format!(
                    "a parameter of {} elements is under min_8bit_size ({MIN_8BIT_SIZE}); \
                     bitsandbytes keeps 32-bit state for it",
                    small.len
                ),
            });
        }
        check_disjoint("CudaAdam8bit", buffer_ranges(params))?;
        Ok(CudaAdam8bit {
            device: CudaDevice::new(backend, 0),
            params: params.to_vec(),
            math: Adam8bitMath::default(),
        })
    }

    /// The same optimizer stepping with `math`.
    pub fn with_math(mut self, math: Adam8bitMath) -> CudaAdam8bit {
        self.math = math;
        self
    }

    /// 8-bit Adam step number `step` (from 1) on every buffer given at creation; `scaling` as
    /// in [`CudaFusedAdam::step`](crate::cuda::CudaFusedAdam::step) (checked one-element f32
    /// tensors of this backend).
    pub fn step(
        &mut self,
        cfg: &Adam8bitConfig,
        step: u64,
        scaling: Option<&DeviceGradScaling>,
    ) -> Result<(), OptimError> {
        let addresses = checked_scaling_addresses(&self.device, "CudaAdam8bit::step", scaling)?;
        launch_8bit(
            &mut self.device,
            self.math,
            cfg,
            step,
            &self.params,
            addresses,
        )
    }

    /// [`CudaAdam8bit::step`] over `params` given for this step alone (a framework's
    /// gradients move between steps), with bitsandbytes' rule for small tensors: a parameter
    /// of fewer than `MIN_8BIT_SIZE` elements has f32 states (`state1`, `state2` of `len`
    /// f32s; its absmax addresses are ignored) and steps in bitsandbytes' 32-bit kernel. At most
    /// two launches (8-bit, 32-bit) on the backend's stream; nothing copied. The buffers given at
    /// creation are kept for [`CudaAdam8bit::step`]; `params` are not. `scaling` holds the
    /// device addresses of a GradScaler's scale and found-inf flag (one f32 each), or `None`.
    ///
    /// # Safety
    /// As [`CudaAdam8bit::new`] for `params`, the small ones' states being f32 buffers of `len`
    /// elements, all live until the launches complete; each address of `scaling` a live f32 of
    /// the backend's device until the launches complete.
    pub unsafe fn step_buffers(
        &mut self,
        cfg: &Adam8bitConfig,
        step: u64,
        params: &[DeviceAdam8bitParam],
        scaling: (Option<u64>, Option<u64>),
    ) -> Result<(), OptimError> {
        check_disjoint("CudaAdam8bit::step_buffers", buffer_ranges(params))?;
        cfg.validate()?;
        check_step("CudaAdam8bit::step_buffers", step)?;
        let addresses = (scaling.0.unwrap_or(0), scaling.1.unwrap_or(0));
        let (small, large): (Vec<_>, Vec<_>) = params.iter().partition(|p| p.len < MIN_8BIT_SIZE);
        launch_8bit(&mut self.device, self.math, cfg, step, &large, addresses)?;
        if small.is_empty() {
            return Ok(());
        }
        let op = "CudaAdam8bit::step_buffers";
        let geometry = raw_geometry(op, small.iter().map(|p| p.len), step)?;
        let math = self.math;
        let (table, n_blocks) =
            self.device
                .piece_table(&geometry, BNB32.0, false, &mut |t, idx, head| {
                    let p = &small[idx];
                    let span = [p.param, p.grad, p.state1, p.state2, 0, 0];
                    write_piece(t, cfg, (head, idx), span, None, math);
                })?;
        self.device.run_elementwise(
            kernel_of(Module::Adam8bit, BNB32_KERNELS, DType::F32),
            &table,
            small.len(),
            n_blocks,
            BNB32,
            addresses,
        )
    }
}

/// The byte ranges of an 8-bit step's buffers, per parameter: f32 parameter and gradient, the
/// two states (u8 codes, or f32 under `MIN_8BIT_SIZE`) and, for codes, the two absmax arrays.
fn buffer_ranges(params: &[DeviceAdam8bitParam]) -> impl Iterator<Item = (u64, u64)> + '_ {
    params.iter().flat_map(|p| {
        let len = p.len as u64;
        let small = p.len < MIN_8BIT_SIZE;
        let state_bytes = if small { len * 4 } else { len };
        let absmax_bytes = if small {
            0
        } else {
            len.div_ceil(BNB_BLOCK_SIZE as u64) * 4
        };
        [
            (p.param, len * 4),
            (p.grad, len * 4),
            (p.state1, state_bytes),
            (p.state2, state_bytes),
            (p.absmax1, absmax_bytes),
            (p.absmax2, absmax_bytes),
        ]
    })
}

/// One blockwise launch over `params` (all of at least `MIN_8BIT_SIZE` elements), reading the
/// scale and flag at `addresses` (0: none).
fn launch_8bit(
    device: &mut CudaDevice,
    math: Adam8bitMath,
    cfg: &Adam8bitConfig,
    step: u64,
    params: &[DeviceAdam8bitParam],
    addresses: (u64, u64),
) -> Result<(), OptimError> {
    cfg.validate()?;
    let geometry = raw_geometry("CudaAdam8bit", params.iter().map(|p| p.len), step)?;
    let (table, n_blocks) = device.piece_table(
        &geometry,
        BNB_BLOCK_SIZE as u64,
        false,
        &mut |t, idx, head| {
            let p = &params[idx];
            let span = [p.param, p.grad, p.state1, p.state2, p.absmax1, p.absmax2];
            write_piece(t, cfg, (head, idx), span, None, math);
        },
    )?;
    let kernels = match math {
        Adam8bitMath::Portable => BLOCKWISE_KERNELS,
        Adam8bitMath::Bitsandbytes => BLOCKWISE_BNB_KERNELS,
    };
    let blockwise = kernel_of(Module::Adam8bit, kernels, DType::F32);
    launch_blockwise(device, blockwise, &table, params.len(), n_blocks, addresses)
}
