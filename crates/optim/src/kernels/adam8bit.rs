//! bitsandbytes' 8-bit blockwise Adam (`bnb.optim.Adam8bit`, `AdamW8bit`) on host slices, and
//! its 32-bit path for tensors under `min_8bit_size`.
//!
//! Per block of [`BNB_BLOCK_SIZE`] elements, one pass (`kOptimizerStatic8bit2StateBlockwise`):
//! dequantize `s1 = qmap1[c1]·absmax1`, `s2 = qmap2[c2]·absmax2`; update
//! `s2 = s2·β2 + (1-β2)·g·g`, `s1 = s1·β1 + (1-β1)·g` (a non-finite `g` zeroes both and leaves
//! its parameter alone); the block's new absmax of each state; the parameter
//! `θ += step_size · s1 / (√s2 + eps·c2)` with `c2 = √(1-β2^t)`, `step_size = -lr·c2/(1-β1^t)`,
//! then decoupled decay `θ *= 1 - lr·wd`; finally re-quantize each state against its **new**
//! absmax with the optimizer's nearest-code search and a sign guard that keeps a state's sign.
//! All arithmetic is float32 as in the CUDA kernel. One difference from bitsandbytes: a state is
//! scaled by the block's reciprocal `s·(1/absmax)` rather than divided, one division per block
//! instead of per element (codes then differ from bitsandbytes' in the rare case where the two
//! roundings straddle a code threshold; the golden test bounds how often). Blocks are
//! independent, so a large parameter steps in runs of whole blocks on rayon's pool
//! ([`BlockwiseBuffers::for_each_run`]) with the bits of one run on one thread. Its buffers
//! ([`BlockwiseBuffers`]) and its f32-state loop serve torchao's 4-bit Adam (`adam4bit.rs`) too.

use super::quantization::{QuantizationMap, StateCodeTable};
use super::{
    check_adam_ranges, check_host_scaling, check_len, check_step, Bf16Rounding, GradScaling,
    ParamElement, ParamRounding, StepOutcome, PARALLEL_CHUNK,
};
use crate::error::OptimError;
use rayon::prelude::*;

/// Block size of bitsandbytes' 8-bit optimizer states.
pub const BNB_BLOCK_SIZE: usize = 256;

/// Tensors with fewer elements keep 32-bit state (bitsandbytes' `min_8bit_size`).
pub const MIN_8BIT_SIZE: usize = 4096;

/// The number of absmax entries of a state of `n` elements.
pub fn n_blocks(n: usize) -> usize {
    n.div_ceil(BNB_BLOCK_SIZE)
}

/// 8-bit Adam's hyperparameters (bitsandbytes' `Adam8bit`; weight decay is always decoupled).
#[derive(Debug, Clone, PartialEq)]
pub struct Adam8bitConfig {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages.
    pub betas: (f64, f64),
    /// Added to the denominator (scaled by `√(1-β2^t)`).
    pub eps: f64,
    /// Decoupled weight decay, applied after the Adam step.
    pub weight_decay: f64,
    /// How a bf16 parameter's new value is stored (f32 parameters: exactly).
    pub bf16_rounding: Bf16Rounding,
}

impl Adam8bitConfig {
    /// `bnb.optim.Adam8bit`'s defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no decay.
    pub fn adam() -> Adam8bitConfig {
        Adam8bitConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            bf16_rounding: Bf16Rounding::Nearest,
        }
    }

    /// `bnb.optim.AdamW8bit`'s defaults: weight decay 1e-2.
    pub fn adamw() -> Adam8bitConfig {
        Adam8bitConfig {
            weight_decay: 1e-2,
            ..Adam8bitConfig::adam()
        }
    }

    /// Checks the ranges bitsandbytes checks.
    pub fn validate(&self) -> Result<(), OptimError> {
        let (lr, betas, eps, wd) = (self.lr, self.betas, self.eps, self.weight_decay);
        check_adam_ranges("Adam8bitConfig", lr, betas, eps, wd)
    }
}

/// One parameter's buffers for a block-wise quantised update: 8-bit ([`Adam8bitBuffers`], one
/// code a byte, [`n_blocks`] scales) or 4-bit
/// ([`Adam4bitBuffers`](super::Adam4bitBuffers), two codes a byte, a scale per block of 128).
/// The parameter and its gradient are f32 or bf16 (`T`); the states are not.
#[derive(Debug)]
pub struct BlockwiseBuffers<'a, T: ParamElement = f32> {
    /// The parameter, updated in place.
    pub param: &'a mut [T],
    /// Its gradient.
    pub grad: &'a [T],
    /// First-state (`exp_avg`) codes (signed map), zero before the first step.
    pub state1: &'a mut [u8],
    /// Second-state (`exp_avg_sq`) codes (unsigned map), zero before the first step.
    pub state2: &'a mut [u8],
    /// Per-block scale of the first state, zero before the first step.
    pub absmax1: &'a mut [f32],
    /// Per-block scale of the second state.
    pub absmax2: &'a mut [f32],
}

/// One parameter's buffers for an 8-bit update.
pub type Adam8bitBuffers<'a, T = f32> = BlockwiseBuffers<'a, T>;

#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConsts {
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) correction2: f32,
    pub(crate) eps: f32,
    pub(crate) step_size: f32,
    pub(crate) decay_factor: Option<f32>,
}

impl StepConsts {
    pub(crate) fn new(cfg: &Adam8bitConfig, step: u64) -> StepConsts {
        let (beta1, beta2) = (cfg.betas.0 as f32, cfg.betas.1 as f32);
        let (lr, eps, wd) = (cfg.lr as f32, cfg.eps as f32, cfg.weight_decay as f32);
        let correction1 = 1.0 - beta1.powf(step as f32);
        let correction2 = (1.0 - beta2.powf(step as f32)).sqrt();
        StepConsts {
            beta1,
            beta2,
            one_minus_beta1: 1.0 - beta1,
            one_minus_beta2: 1.0 - beta2,
            correction2,
            eps,
            step_size: -lr * correction2 / correction1,
            decay_factor: (wd > 0.0).then_some(1.0 - lr * wd),
        }
    }
}

/// The 8-bit blockwise Adam step number `step` on one parameter. `qmap1` is the signed dynamic
/// map, `qmap2` the unsigned one. The parameter and gradient are widened to f32, and the new
/// parameter is stored by `rounding` (element `i` with its bits `i`). With `scaling.found_inf`
/// set nothing is written.
pub fn adam8bit_blockwise<T: ParamElement>(
    cfg: &Adam8bitConfig,
    step: u64,
    qmap1: &QuantizationMap,
    qmap2: &QuantizationMap,
    bufs: Adam8bitBuffers<'_, T>,
    scaling: GradScaling,
    rounding: ParamRounding,
) -> Result<StepOutcome, OptimError> {
    const OP: &str = "adam8bit_blockwise";
    check_step(OP, step)?;
    check_host_scaling(OP, scaling)?;
    let n = bufs.param.len();
    check_len(OP, n, bufs.grad.len(), "grad")?;
    check_len(OP, n, bufs.state1.len(), "state1")?;
    check_len(OP, n, bufs.state2.len(), "state2")?;
    check_len(OP, n_blocks(n), bufs.absmax1.len(), "absmax1")?;
    check_len(OP, n_blocks(n), bufs.absmax2.len(), "absmax2")?;
    if scaling.skips() {
        return Ok(StepOutcome::Skipped);
    }
    let c = StepConsts::new(cfg, step);
    // The code search as a lookup (the CUDA kernel's table: the same codes, without the
    // search's eight dependent branches per code).
    let tables = (
        StateCodeTable::shared(qmap1, true),
        StateCodeTable::shared(qmap2, false),
    );
    let tables = (tables.0.as_deref(), tables.1.as_deref());
    bufs.for_each_run(1, BNB_BLOCK_SIZE, |first, run| {
        blocks_8bit(&c, (qmap1, qmap2), tables, scaling, rounding, first, run)
    });
    Ok(StepOutcome::Stepped)
}

/// [`adam8bit_blockwise`]'s update of `run`, whose element 0 is element `first` of the
/// parameter (the rounding's index).
fn blocks_8bit<T: ParamElement>(
    c: &StepConsts,
    (qmap1, qmap2): (&QuantizationMap, &QuantizationMap),
    (table1, table2): (Option<&StateCodeTable>, Option<&StateCodeTable>),
    scaling: GradScaling,
    rounding: ParamRounding,
    first: usize,
    run: BlockwiseBuffers<'_, T>,
) {
    let mut s1 = [0f32; BNB_BLOCK_SIZE];
    let mut s2 = [0f32; BNB_BLOCK_SIZE];
    for (block, ((((p, g), c1), c2), (a1, a2))) in run
        .param
        .chunks_mut(BNB_BLOCK_SIZE)
        .zip(run.grad.chunks(BNB_BLOCK_SIZE))
        .zip(run.state1.chunks_mut(BNB_BLOCK_SIZE))
        .zip(run.state2.chunks_mut(BNB_BLOCK_SIZE))
        .zip(run.absmax1.iter_mut().zip(run.absmax2.iter_mut()))
        .enumerate()
    {
        let len = p.len();
        let (mut max1, mut max2) = (0f32, 0f32);
        for j in 0..len {
            let g = scaling.unscale(g[j].to_f32());
            if g.is_finite() {
                let v = qmap2[usize::from(c2[j])] * *a2;
                s2[j] = v * c.beta2 + c.one_minus_beta2 * g * g;
                let m = qmap1[usize::from(c1[j])] * *a1;
                s1[j] = m * c.beta1 + c.one_minus_beta1 * g;
            } else {
                s1[j] = 0.0;
                s2[j] = 0.0;
            }
            max1 = max1.max(s1[j].abs());
            max2 = max2.max(s2[j].abs());
        }
        *a1 = max1;
        *a2 = max2;
        for j in 0..len {
            let g = scaling.unscale(g[j].to_f32());
            if g.is_finite() {
                let mut x = p[j].to_f32();
                x += c.step_size * (s1[j] / (s2[j].sqrt() + c.correction2 * c.eps));
                if let Some(factor) = c.decay_factor {
                    x *= factor;
                }
                p[j] = rounding.store(x, first + block * BNB_BLOCK_SIZE + j);
            }
        }
        // One reciprocal per block (1/0 = inf turns an all-zero block into NaN, as 0/0 would).
        let (inv1, inv2) = (1.0 / max1, 1.0 / max2);
        for j in 0..len {
            let mut code1 = StateCodeTable::code_or_search(table1, qmap1, true, s1[j] * inv1);
            if qmap1[usize::from(code1)].is_sign_negative() != s1[j].is_sign_negative() {
                code1 = if s1[j] > 0.0 {
                    code1.wrapping_add(1)
                } else {
                    code1.wrapping_sub(1)
                };
            }
            c1[j] = code1;
            c2[j] = StateCodeTable::code_or_search(table2, qmap2, false, s2[j] * inv2);
        }
    }
}

impl<T: ParamElement> BlockwiseBuffers<'_, T> {
    /// `update(first, run)` on runs of [`PARALLEL_CHUNK`] elements (whole blocks of `block`;
    /// `codes_per_byte` codes a byte; the last run shorter), `first` the run's first element: on
    /// rayon's pool from two runs up, else on this thread. Blocks are independent, so the bits do
    /// not depend on how the runs are scheduled.
    pub(crate) fn for_each_run(
        self,
        codes_per_byte: usize,
        block: usize,
        update: impl Fn(usize, BlockwiseBuffers<'_, T>) + Sync + Send,
    ) {
        if self.param.len() < 2 * PARALLEL_CHUNK {
            update(0, self);
            return;
        }
        let (run, codes, scales) = (
            PARALLEL_CHUNK,
            PARALLEL_CHUNK / codes_per_byte,
            PARALLEL_CHUNK / block,
        );
        self.param
            .par_chunks_mut(run)
            .zip(self.grad.par_chunks(run))
            .zip(self.state1.par_chunks_mut(codes))
            .zip(self.state2.par_chunks_mut(codes))
            .zip(self.absmax1.par_chunks_mut(scales))
            .zip(self.absmax2.par_chunks_mut(scales))
            .enumerate()
            .for_each(
                |(k, (((((param, grad), state1), state2), absmax1), absmax2))| {
                    let buffers = BlockwiseBuffers {
                        param,
                        grad,
                        state1,
                        state2,
                        absmax1,
                        absmax2,
                    };
                    update(k * run, buffers)
                },
            );
    }
}

/// bitsandbytes' 32-bit Adam (`kOptimizer32bit2State`), used for tensors under
/// [`MIN_8BIT_SIZE`]: the same update on float32 states, decay after the step; an f32 or bf16
/// parameter stored by `rounding`.
pub fn adam_bnb_32bit<T: ParamElement>(
    cfg: &Adam8bitConfig,
    step: u64,
    bufs: F32States<'_, T>,
    scaling: GradScaling,
    rounding: ParamRounding,
) -> Result<StepOutcome, OptimError> {
    let c = StepConsts::new(cfg, step);
    bufs.update("adam_bnb_32bit", step, scaling, rounding, |p, g, m, v| {
        *m = *m * c.beta1 + c.one_minus_beta1 * g;
        *v = *v * c.beta2 + c.one_minus_beta2 * (g * g);
        *p += c.step_size * (*m / (v.sqrt() + c.eps * c.correction2));
        if let Some(factor) = c.decay_factor {
            *p *= factor;
        }
    })
}

/// The buffers of a block-wise rule's f32-state form (a parameter it does not quantise): the
/// parameter and its gradient (f32 or bf16) and two f32 states of its length.
#[derive(Debug)]
pub struct F32States<'a, T: ParamElement = f32> {
    /// The parameter, updated in place.
    pub param: &'a mut [T],
    /// Its gradient.
    pub grad: &'a [T],
    /// First moment.
    pub state1: &'a mut [f32],
    /// Second moment.
    pub state2: &'a mut [f32],
}

impl<T: ParamElement> F32States<'_, T> {
    /// Checks the step, the scaling and the lengths (as `op`), then, unless `scaling` skips the
    /// step, runs `element(p, g, m, v)` on each element in f32 with its gradient unscaled, and
    /// stores the parameter by `rounding`.
    pub(crate) fn update(
        self,
        op: &'static str,
        step: u64,
        scaling: GradScaling,
        rounding: ParamRounding,
        element: impl Fn(&mut f32, f32, &mut f32, &mut f32) + Sync,
    ) -> Result<StepOutcome, OptimError> {
        check_step(op, step)?;
        check_host_scaling(op, scaling)?;
        let n = self.param.len();
        check_len(op, n, self.grad.len(), "grad")?;
        check_len(op, n, self.state1.len(), "state1")?;
        check_len(op, n, self.state2.len(), "state2")?;
        if scaling.skips() {
            return Ok(StepOutcome::Skipped);
        }
        let run = |first: usize, p: &mut [T], g: &[T], m: &mut [f32], v: &mut [f32]| {
            for (i, (((p, &g), m), v)) in p.iter_mut().zip(g).zip(m).zip(v).enumerate() {
                let mut x = p.to_f32();
                element(&mut x, scaling.unscale(g.to_f32()), m, v);
                *p = rounding.store(x, first + i);
            }
        };
        if n < 2 * PARALLEL_CHUNK {
            run(0, self.param, self.grad, self.state1, self.state2);
        } else {
            self.param
                .par_chunks_mut(PARALLEL_CHUNK)
                .zip(self.grad.par_chunks(PARALLEL_CHUNK))
                .zip(self.state1.par_chunks_mut(PARALLEL_CHUNK))
                .zip(self.state2.par_chunks_mut(PARALLEL_CHUNK))
                .enumerate()
                .for_each(|(k, (((p, g), m), v))| run(k * PARALLEL_CHUNK, p, g, m, v));
        }
        Ok(StepOutcome::Stepped)
    }
}
