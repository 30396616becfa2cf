//! torchao's 4-bit Adam and AdamW (`torchao.optim.Adam4bit`, `AdamW4bit`, torchao 0.18) on host
//! slices: its two 16-entry code tables, its block-wise 4-bit quantiser, and one step of its
//! `single_param_adam` over 4-bit states or, for a parameter torchao does not quantise, over f32
//! states.
//!
//! A parameter of at least [`MIN_4BIT_SIZE`] elements, a multiple of [`AO_BLOCK_SIZE`], keeps each
//! moment as packed 4-bit codes (two a byte, the even element in the high nibble) and one f32
//! scale per block of 128. A step, per element, in float32 as torchao's eager CPU run computes it:
//! AdamW `p -= (lr·wd)·p` or Adam `g += wd·p`; `m = lerp(q1[c1]·s1, g, 1-β1)`,
//! `v = lerp(q2[c2]·s2, g², 1-β2)` (PyTorch's lerp, a fused multiply-add); then
//! `p -= (lr·(m / (1-β1^t))) / (√v / √(1-β2^t) + eps)` with the unquantised `m`, `v`, which are
//! then re-quantised: the block's absmax (at least 1e-12) is its scale, `m / scale` takes the
//! nearest code by torchao's branchless search (ties up). Every operation is correctly rounded,
//! the square root too (PyTorch's CPU `sqrt` is not always, so a parameter can differ from
//! torchao's eager run in the last bits; the codes and scales do not: `tests/golden_adam4bit.rs`).
//! It sits on this module's shared checks
//! and on 8-bit Adam's block-wise buffers and f32-state loop (`adam8bit.rs`); it knows no tensor
//! and no device.

use super::{
    check_adam_ranges, check_host_scaling, check_len, check_step, lerp, maximum, with_fast_fma,
};
use super::{
    Bf16Rounding, BlockwiseBuffers, F32States, GradScaling, ParamElement, ParamRounding,
    StepOutcome,
};
use crate::error::OptimError;

/// Elements per quantisation block (torchao's `block_size` of the 4-bit optimizers).
pub const AO_BLOCK_SIZE: usize = 128;

/// Parameters with fewer elements keep f32 states (torchao follows bitsandbytes' 4096).
pub const MIN_4BIT_SIZE: usize = 4096;

/// A 4-bit code table: the value of each of the 16 codes, ascending.
pub type Qmap4 = [f32; 16];

/// Whether torchao keeps 4-bit states for a parameter of `n` elements: at least
/// [`MIN_4BIT_SIZE`] and whole blocks of [`AO_BLOCK_SIZE`].
pub fn is_quantized_4bit(n: usize) -> bool {
    n >= MIN_4BIT_SIZE && n.is_multiple_of(AO_BLOCK_SIZE)
}

/// `torch.linspace(start, end, steps)` in float32 as PyTorch's CPU kernel computes a short one:
/// the first half from `start`, the second from `end`.
fn linspace(start: f32, end: f32, steps: usize) -> Vec<f32> {
    let step = (end - start) / (steps - 1) as f32;
    let halfway = steps / 2;
    (0..steps)
        .map(|i| {
            if i < halfway {
                start + step * i as f32
            } else {
                end - step * (steps - i - 1) as f32
            }
        })
        .collect()
}

/// torchao's code tables: signed `create_dynamic_map(True, 3, 4)` (the first moment), else
/// `linspace(0, 1, 17)[1:]` (the second; no zero), with PyTorch's float32 arithmetic.
pub fn qmap4(signed: bool) -> Qmap4 {
    let mut data: Vec<f32> = if signed {
        let mut data = vec![0.0, 1.0];
        for i in 0..3usize {
            let bounds = linspace(0.1, 1.0, (1 << i) + 1);
            // `10 ** (i - 2)` is a Python float (an int for i = 2), rounded to f32 by the op.
            let factor = 10f64.powi(i as i32 - 2) as f32;
            for pair in bounds.windows(2) {
                let mean = (pair[0] + pair[1]) / 2.0;
                data.extend([factor * mean, -factor * mean]);
            }
        }
        data
    } else {
        linspace(0.0, 1.0, 17)[1..].to_vec()
    };
    data.sort_by(f32::total_cmp);
    let mut table = [0f32; 16];
    table.copy_from_slice(&data);
    table
}

/// Both code tables, (signed, unsigned), built once per process: every step of every parameter
/// reads them, on the host and in each CUDA piece.
pub(crate) fn qmap4_tables() -> &'static (Qmap4, Qmap4) {
    static TABLES: std::sync::OnceLock<(Qmap4, Qmap4)> = std::sync::OnceLock::new();
    TABLES.get_or_init(|| (qmap4(true), qmap4(false)))
}

/// The code of `y` (a value already divided by its block's scale): torchao's
/// `quantize_4bit_with_qmap`, a branchless binary search, then up one code when `y` is at least
/// halfway to it. NaN takes code 0.
#[inline(always)]
pub fn code_4bit(qmap: &Qmap4, y: f32) -> u8 {
    let mut c = if y >= qmap[8] { 8 } else { 0 };
    c += if y >= qmap[c + 4] { 4 } else { 0 };
    c += if y >= qmap[c + 2] { 2 } else { 0 };
    c += if y >= qmap[c + 1] { 1 } else { 0 };
    let up = (c + 1).min(15);
    let residual = y - qmap[c];
    if residual >= (qmap[up] - qmap[c]) * 0.5 {
        up as u8
    } else {
        c as u8
    }
}

/// The code thresholds of `qmap`: entry k (1 to 15) is the least f32 whose [`code_4bit`] is k or
/// more, entry 0 is −∞ (never read). [`code_4bit`] never decreases as `y` grows (its search takes
/// the last entry at most `y`, its round-up compares `y`'s residual, which never decreases either)
/// and gives NaN code 0, so [`threshold_code`] over these — a binary search of four compares — is
/// [`code_4bit`] for every f32: the CUDA kernel quantises with it (the thresholds travel in each
/// piece) and `tests/code_thresholds.rs` checks the two agree.
pub fn code_thresholds(qmap: &Qmap4) -> [f32; 16] {
    // f32s in their order as u32 keys: negatives (bits complemented) below positives (sign set).
    let key = |x: f32| -> u32 {
        let bits = x.to_bits();
        if bits >> 31 == 1 {
            !bits
        } else {
            bits | 0x8000_0000
        }
    };
    let value = |k: u32| -> f32 { f32::from_bits(if k >> 31 == 1 { k & 0x7fff_ffff } else { !k }) };
    let mut thresholds = [f32::NEG_INFINITY; 16];
    for (k, threshold) in thresholds.iter_mut().enumerate().skip(1) {
        let (mut lo, mut hi) = (key(f32::NEG_INFINITY), key(f32::INFINITY));
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if usize::from(code_4bit(qmap, value(mid))) >= k {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        *threshold = value(lo);
    }
    thresholds
}

/// The code of `y` by [`code_thresholds`]: how many of thresholds 1 to 15 `y` reaches (none for
/// NaN), found in four compares. Equal to [`code_4bit`] on the table the thresholds came from.
#[inline(always)]
pub fn threshold_code(thresholds: &[f32; 16], y: f32) -> u8 {
    let mut c = if y >= thresholds[8] { 8 } else { 0 };
    c += if y >= thresholds[c + 4] { 4 } else { 0 };
    c += if y >= thresholds[c + 2] { 2 } else { 0 };
    c += if y >= thresholds[c + 1] { 1 } else { 0 };
    c as u8
}

/// One block's scale: the largest magnitude (NaN if any is NaN, as `amax` gives), at least
/// 1e-12 (`clip(1e-12)`).
#[inline(always)]
fn block_scale(block: &[f32]) -> f32 {
    let amax = block.iter().fold(0f32, |acc, v| maximum(acc, v.abs()));
    if amax.is_nan() {
        amax
    } else {
        amax.max(1e-12)
    }
}

/// Quantises one block of values into packed codes (`block.len() / 2` bytes); returns its scale.
#[inline(always)]
fn quantize_block(qmap: &Qmap4, block: &[f32], packed: &mut [u8]) -> f32 {
    let scale = block_scale(block);
    for (byte, pair) in packed.iter_mut().zip(block.chunks_exact(2)) {
        *byte = (code_4bit(qmap, pair[0] / scale) << 4) | code_4bit(qmap, pair[1] / scale);
    }
    scale
}

/// Checks a quantised buffer set: `n` a multiple of the block, `packed` of `n / 2` bytes,
/// `scales` of one per block.
fn check_quantized(
    op: &'static str,
    n: usize,
    packed: usize,
    scales: usize,
    what: &str,
) -> Result<(), OptimError> {
    if !n.is_multiple_of(AO_BLOCK_SIZE) {
        return Err(OptimError::InvalidArgument {
            op,
            reason: format!("{n} elements are not whole blocks of {AO_BLOCK_SIZE}"),
        });
    }
    check_len(op, n / 2, packed, what)?;
    check_len(op, n / AO_BLOCK_SIZE, scales, "scales")
}

/// torchao's quantiser (`scale_tensor`, `quantize_4bit_with_qmap`, packing) on `input`, a whole
/// number of blocks of [`AO_BLOCK_SIZE`]: two codes a byte into `packed` (`input.len() / 2`),
/// one scale a block into `scales`.
pub fn quantize_4bit(
    qmap: &Qmap4,
    input: &[f32],
    packed: &mut [u8],
    scales: &mut [f32],
) -> Result<(), OptimError> {
    check_quantized(
        "quantize_4bit",
        input.len(),
        packed.len(),
        scales.len(),
        "packed",
    )?;
    for ((block, bytes), scale) in input
        .chunks_exact(AO_BLOCK_SIZE)
        .zip(packed.chunks_exact_mut(AO_BLOCK_SIZE / 2))
        .zip(scales.iter_mut())
    {
        *scale = quantize_block(qmap, block, bytes);
    }
    Ok(())
}

/// The value of element `j` of packed codes under a block's `scale` (`dequant_with_qmap`).
#[inline(always)]
fn dequant(qmap: &Qmap4, packed: &[u8], j: usize, scale: f32) -> f32 {
    let byte = packed[j / 2];
    let code = if j.is_multiple_of(2) {
        byte >> 4
    } else {
        byte & 15
    };
    qmap[usize::from(code)] * scale
}

/// `packed` codes (two a byte) times their blocks' `scales` into `out`, one value an element.
pub fn dequantize_4bit(
    qmap: &Qmap4,
    packed: &[u8],
    scales: &[f32],
    out: &mut [f32],
) -> Result<(), OptimError> {
    check_quantized(
        "dequantize_4bit",
        out.len(),
        packed.len(),
        scales.len(),
        "packed",
    )?;
    for (j, o) in out.iter_mut().enumerate() {
        *o = dequant(qmap, packed, j, scales[j / AO_BLOCK_SIZE]);
    }
    Ok(())
}

/// 4-bit Adam's hyperparameters (torchao's `Adam4bit`, `AdamW4bit`).
#[derive(Debug, Clone, PartialEq)]
pub struct Adam4bitConfig {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: decoupled (AdamW) or added to the gradient (Adam), per `decoupled`.
    pub weight_decay: f64,
    /// AdamW's decoupled weight decay, else Adam's L2 term.
    pub decoupled: bool,
    /// torchao's third state; not supported here (a typed error from [`Adam4bitConfig::validate`]).
    pub amsgrad: bool,
    /// How a bf16 parameter's new value is stored (torchao's `bf16_stochastic_round`; f32
    /// parameters: exactly).
    pub bf16_rounding: Bf16Rounding,
}

impl Adam4bitConfig {
    /// `torchao.optim.Adam4bit`'s defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no decay.
    pub fn adam() -> Adam4bitConfig {
        Adam4bitConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            amsgrad: false,
            bf16_rounding: Bf16Rounding::Nearest,
        }
    }

    /// `torchao.optim.AdamW4bit`'s defaults: decoupled weight decay 1e-2.
    pub fn adamw() -> Adam4bitConfig {
        Adam4bitConfig {
            weight_decay: 1e-2,
            decoupled: true,
            ..Adam4bitConfig::adam()
        }
    }

    /// Checks the ranges torchao checks (and a finite, non-negative weight decay); `amsgrad` is
    /// an [`OptimError::Unsupported`].
    pub fn validate(&self) -> Result<(), OptimError> {
        if self.amsgrad {
            return Err(OptimError::Unsupported {
                optimizer: "Adam4bit",
                reason: "amsgrad (torchao's third 4-bit state) is not implemented".into(),
            });
        }
        let (lr, betas, eps, wd) = (self.lr, self.betas, self.eps, self.weight_decay);
        check_adam_ranges("Adam4bitConfig", lr, betas, eps, wd)?;
        if !wd.is_finite() {
            return Err(OptimError::InvalidArgument {
                op: "Adam4bitConfig",
                reason: format!("invalid weight_decay {wd}"),
            });
        }
        Ok(())
    }
}

/// One parameter's buffers for a 4-bit update: whole blocks of [`AO_BLOCK_SIZE`], the codes
/// packed two a byte (half the parameter's length), one scale per block.
pub type Adam4bitBuffers<'a, T = f32> = BlockwiseBuffers<'a, T>;

/// A step's float32 constants, as torchao's tensors hold them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConsts {
    pub(crate) lr: f32,
    /// `lr * weight_decay` (a 0-d f32 tensor times a Python float).
    pub(crate) lr_wd: f32,
    pub(crate) wd: f32,
    /// `1 - β1`, `1 - β2` in f64 (Python), rounded to f32 by `lerp`.
    pub(crate) w1: f32,
    pub(crate) w2: f32,
    /// `1 - β1^t`.
    pub(crate) bc1: f32,
    /// `√(1 - β2^t)`.
    pub(crate) sqrt_bc2: f32,
    pub(crate) eps: f32,
    pub(crate) decoupled: bool,
}

impl StepConsts {
    pub(crate) fn new(cfg: &Adam4bitConfig, step: u64) -> StepConsts {
        let (lr, wd) = (cfg.lr as f32, cfg.weight_decay as f32);
        let t = step as f32;
        StepConsts {
            lr,
            lr_wd: lr * wd,
            wd,
            w1: (1.0 - cfg.betas.0) as f32,
            w2: (1.0 - cfg.betas.1) as f32,
            bc1: 1.0 - (cfg.betas.0 as f32).powf(t),
            sqrt_bc2: (1.0 - (cfg.betas.1 as f32).powf(t)).sqrt(),
            eps: cfg.eps as f32,
            decoupled: cfg.decoupled,
        }
    }

    /// One element of `single_param_adam`: the new parameter and the unquantised `m`, `v`.
    #[inline(always)]
    fn update(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let (p, g) = if self.decoupled {
            (p - self.lr_wd * p, g)
        } else {
            (p, g + self.wd * p)
        };
        let m = lerp(m, g, self.w1);
        let v = lerp(v, g * g, self.w2);
        let denom = v.sqrt() / self.sqrt_bc2 + self.eps;
        (p - (self.lr * (m / self.bc1)) / denom, m, v)
    }
}

/// The 4-bit Adam step number `step` (from 1) on one parameter: the parameter and gradient
/// widened to f32 (`p.float()`, `grad.float()`), the new parameter stored by `rounding` (element
/// `i` with its bits `i`; torchao's `p.copy_` rounds to nearest). With `scaling.found_inf` set
/// nothing is written.
pub fn adam4bit_blockwise<T: ParamElement>(
    cfg: &Adam4bitConfig,
    step: u64,
    bufs: Adam4bitBuffers<'_, T>,
    scaling: GradScaling,
    rounding: ParamRounding,
) -> Result<StepOutcome, OptimError> {
    const OP: &str = "adam4bit_blockwise";
    check_step(OP, step)?;
    check_host_scaling(OP, scaling)?;
    let n = bufs.param.len();
    check_len(OP, n, bufs.grad.len(), "grad")?;
    check_quantized(OP, n, bufs.state1.len(), bufs.absmax1.len(), "state1")?;
    check_quantized(OP, n, bufs.state2.len(), bufs.absmax2.len(), "state2")?;
    if scaling.skips() {
        return Ok(StepOutcome::Skipped);
    }
    let c = StepConsts::new(cfg, step);
    bufs.for_each_run(2, AO_BLOCK_SIZE, |first, run| {
        blocks_4bit(&c, scaling, rounding, first, run)
    });
    Ok(StepOutcome::Stepped)
}

/// [`adam4bit_blockwise`]'s update of `run` (whole blocks), whose element 0 is element `first`
/// of the parameter (the rounding's index).
fn blocks_4bit<T: ParamElement>(
    c: &StepConsts,
    scaling: GradScaling,
    rounding: ParamRounding,
    first: usize,
    run: Adam4bitBuffers<'_, T>,
) {
    with_fast_fma(|| blocks_4bit_body(c, scaling, rounding, first, run))
}

/// [`blocks_4bit`]'s loop, inlined where the CPU's FMA instructions are on.
#[inline(always)]
fn blocks_4bit_body<T: ParamElement>(
    c: &StepConsts,
    scaling: GradScaling,
    rounding: ParamRounding,
    first: usize,
    run: Adam4bitBuffers<'_, T>,
) {
    let (qmap1, qmap2) = qmap4_tables();
    let (mut m, mut v) = ([0f32; AO_BLOCK_SIZE], [0f32; AO_BLOCK_SIZE]);
    let half = AO_BLOCK_SIZE / 2;
    for (block, ((((p, g), (c1, c2)), s1), s2)) in run
        .param
        .chunks_exact_mut(AO_BLOCK_SIZE)
        .zip(run.grad.chunks_exact(AO_BLOCK_SIZE))
        .zip(
            run.state1
                .chunks_exact_mut(half)
                .zip(run.state2.chunks_exact_mut(half)),
        )
        .zip(run.absmax1.iter_mut())
        .zip(run.absmax2.iter_mut())
        .enumerate()
    {
        for j in 0..AO_BLOCK_SIZE {
            let g = scaling.unscale(g[j].to_f32());
            let (m_old, v_old) = (dequant(qmap1, c1, j, *s1), dequant(qmap2, c2, j, *s2));
            let x;
            (x, m[j], v[j]) = c.update(p[j].to_f32(), g, m_old, v_old);
            p[j] = rounding.store(x, first + block * AO_BLOCK_SIZE + j);
        }
        *s1 = quantize_block(qmap1, &m, c1);
        *s2 = quantize_block(qmap2, &v, c2);
    }
}

/// The same step over f32 states (`state1` = `exp_avg`, `state2` = `exp_avg_sq`, of the
/// parameter's length), as torchao keeps them for an f32 parameter it does not quantise
/// ([`is_quantized_4bit`]; for a bf16 one torchao keeps bf16 states, this kernel f32).
pub fn adam4bit_f32_states<T: ParamElement>(
    cfg: &Adam4bitConfig,
    step: u64,
    bufs: F32States<'_, T>,
    scaling: GradScaling,
    rounding: ParamRounding,
) -> Result<StepOutcome, OptimError> {
    let c = StepConsts::new(cfg, step);
    bufs.update(
        "adam4bit_f32_states",
        step,
        scaling,
        rounding,
        |p, g, m, v| {
            (*p, *m, *v) = c.update(*p, g, *m, *v);
        },
    )
}
