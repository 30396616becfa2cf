//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`) on host slices.
//!
//! Per element, in float32 and in this order (PyTorch's `_single_tensor_adam`): `g = -g` if
//! maximizing; coupled L2 `g = g + wd·θ` or decoupled `θ = θ·(1 - lr·wd)`;
//! `m = lerp(m, g, 1-β1)`; `v = v·β2`, `v = v + (1-β2)·g·g`; amsgrad `v̂ = max(v̂, v)`;
//! `d = sqrt(v or v̂)`, `d = d / sqrt(1-β2^t)`, `d = d + eps`; `θ = θ + (-lr/(1-β1^t))·m / d`.
//! The single and foreach forms materialise `g` (when changed) and `d` in the scratch slice; the
//! fused form keeps them in registers.
//!
//! Parameters may be f32, bf16 or f16 ([`ParamElement`]): arithmetic in f32, states and
//! temporaries in the parameter's type. The fused form rounds p, m, v (and v̂) once each at the
//! end of the element's update, as PyTorch's fused Adam does; single and foreach round every op's
//! result, as PyTorch's op-by-op Adam does.
//!
//! [`adam_fused_stochastic`] is the fused update of bf16 parameters with f32 moments whose new
//! value is rounded stochastically ([`round_bf16_stochastic`]): 12 bytes per parameter (2 for
//! it, 2 for its gradient, 8 for the moments) where a bf16 model with an f32 master copy needs
//! 16, with small updates kept on average instead of lost to rounding; with bf16 moments
//! (torchao's `_AdamW` layout) 8 bytes.

use rayon::prelude::*;

use super::{
    check_adam_ranges, check_host_scaling, check_len, check_step, lerp, maximum,
    round_bf16_stochastic, stochastic_bits, with_fast_fma, GradScaling, ParamElement, StepOutcome,
    PARALLEL_CHUNK,
};
use crate::error::OptimError;
use half::bf16;

/// How weight decay enters the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDecay {
    /// `torch.optim.Adam`: `g += wd·θ` before the moments.
    L2,
    /// `torch.optim.AdamW` (`decoupled_weight_decay=True`): `θ *= 1 - lr·wd` before the moments.
    Decoupled,
}

/// Adam's hyperparameters (one parameter group's).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay coefficient.
    pub weight_decay: f64,
    /// How the weight decay is applied.
    pub decay: WeightDecay,
    /// Use the maximum of past second moments (AMSGrad).
    pub amsgrad: bool,
    /// Ascend instead of descend.
    pub maximize: bool,
}

impl AdamConfig {
    /// `torch.optim.Adam`'s defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam() -> AdamConfig {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decay: WeightDecay::L2,
            amsgrad: false,
            maximize: false,
        }
    }

    /// `torch.optim.AdamW`'s defaults: Adam's with decoupled weight decay 1e-2.
    pub fn adamw() -> AdamConfig {
        AdamConfig {
            weight_decay: 1e-2,
            decay: WeightDecay::Decoupled,
            ..AdamConfig::adam()
        }
    }

    /// Checks the ranges PyTorch checks.
    pub fn validate(&self) -> Result<(), OptimError> {
        let (lr, betas, eps, wd) = (self.lr, self.betas, self.eps, self.weight_decay);
        check_adam_ranges("AdamConfig", lr, betas, eps, wd)
    }
}

/// One parameter's buffers for an Adam update, all of the parameter's length and of element
/// type `T` (f32, bf16 or f16).
#[derive(Debug)]
pub struct AdamBuffers<'a, T = f32> {
    /// The parameter, updated in place.
    pub param: &'a mut [T],
    /// Its gradient.
    pub grad: &'a [T],
    /// First moment (`exp_avg`), zero before the first step.
    pub exp_avg: &'a mut [T],
    /// Second moment (`exp_avg_sq`), zero before the first step.
    pub exp_avg_sq: &'a mut [T],
    /// `max_exp_avg_sq`, present exactly when `amsgrad` is set.
    pub max_exp_avg_sq: Option<&'a mut [T]>,
}

impl<T> AdamBuffers<'_, T> {
    fn check(&self, op: &'static str, cfg: &AdamConfig) -> Result<(), OptimError> {
        let n = self.param.len();
        check_len(op, n, self.grad.len(), "grad")?;
        check_len(op, n, self.exp_avg.len(), "exp_avg")?;
        check_len(op, n, self.exp_avg_sq.len(), "exp_avg_sq")?;
        match (&self.max_exp_avg_sq, cfg.amsgrad) {
            (Some(vmax), true) => check_len(op, n, vmax.len(), "max_exp_avg_sq"),
            (None, false) => Ok(()),
            _ => Err(OptimError::InvalidArgument {
                op,
                reason: "max_exp_avg_sq must be given exactly when amsgrad is set".into(),
            }),
        }
    }
}

/// The per-step scalars, computed as Python computes them and rounded to f32 where a tensor op
/// receives them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConsts {
    pub(crate) maximize: bool,
    pub(crate) l2: Option<f32>,
    pub(crate) decay_factor: Option<f32>,
    pub(crate) one_minus_beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) bias_correction2_sqrt: f32,
    pub(crate) eps: f32,
    pub(crate) neg_step_size: f32,
}

impl StepConsts {
    pub(crate) fn new(cfg: &AdamConfig, step: u64) -> StepConsts {
        let (beta1, beta2) = cfg.betas;
        let t = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        let decays = cfg.weight_decay != 0.0;
        StepConsts {
            maximize: cfg.maximize,
            l2: (decays && cfg.decay == WeightDecay::L2).then_some(cfg.weight_decay as f32),
            decay_factor: (decays && cfg.decay == WeightDecay::Decoupled)
                .then_some((1.0 - cfg.lr * cfg.weight_decay) as f32),
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: cfg.eps as f32,
            neg_step_size: (-(cfg.lr / bias_correction1)) as f32,
        }
    }

    pub(crate) fn changes_grad(&self) -> bool {
        self.maximize || self.l2.is_some()
    }
}

/// Scratch elements [`adam_single`] needs for a parameter of `n` elements (one temporary).
pub fn adam_scratch_len(n: usize) -> usize {
    n
}

/// PyTorch's single-tensor Adam step number `step` (1 for the first) on one parameter, op by op.
/// `scratch` holds the temporaries and must have at least `param.len()` elements.
pub fn adam_single<T: ParamElement>(
    cfg: &AdamConfig,
    step: u64,
    bufs: AdamBuffers<'_, T>,
    scratch: &mut [T],
) -> Result<(), OptimError> {
    bufs.check("adam_single", cfg)?;
    check_step("adam_single", step)?;
    let n = bufs.param.len();
    if scratch.len() < n {
        return Err(OptimError::LengthMismatch {
            op: "adam_single",
            expected: n,
            got: scratch.len(),
            detail: "scratch".into(),
        });
    }
    let consts = StepConsts::new(cfg, step);
    let mut pieces = [Piece {
        consts,
        param: bufs.param,
        grad: bufs.grad,
        exp_avg: bufs.exp_avg,
        exp_avg_sq: bufs.exp_avg_sq,
        max_exp_avg_sq: bufs.max_exp_avg_sq,
        tmp: &mut scratch[..n],
    }];
    run_ops(&mut pieces);
    Ok(())
}

/// PyTorch's multi-tensor (foreach) Adam over a list of parameters, each with its own step
/// number. Each op runs across all tensors of a chunk before the next op starts; a chunk holds
/// at most `scratch.len()` elements (a longer tensor spans several chunks), so the temporaries
/// never exceed the scratch slice. A scratch as long as all tensors together reproduces
/// PyTorch's behaviour (one temporary list of the size of all parameters).
pub fn adam_foreach<T: ParamElement>(
    cfg: &AdamConfig,
    tensors: &mut [(u64, AdamBuffers<'_, T>)],
    scratch: &mut [T],
) -> Result<(), OptimError> {
    for (step, bufs) in tensors.iter() {
        bufs.check("adam_foreach", cfg)?;
        check_step("adam_foreach", *step)?;
    }
    let lens: Vec<usize> = tensors.iter().map(|(_, b)| b.param.len()).collect();
    for chunk in foreach_chunks(&lens, scratch.len())? {
        let mut tmp_rest = &mut scratch[..];
        let mut pieces = Vec::with_capacity(chunk.len());
        let mut chunk_iter = chunk.iter().peekable();
        for (tensor_idx, (step, bufs)) in tensors.iter_mut().enumerate() {
            let Some(&&(idx, ref range)) = chunk_iter.peek() else {
                break;
            };
            if idx != tensor_idx {
                continue;
            }
            chunk_iter.next();
            let (tmp, rest) = tmp_rest.split_at_mut(range.len());
            tmp_rest = rest;
            pieces.push(Piece {
                consts: StepConsts::new(cfg, *step),
                param: &mut bufs.param[range.clone()],
                grad: &bufs.grad[range.clone()],
                exp_avg: &mut bufs.exp_avg[range.clone()],
                exp_avg_sq: &mut bufs.exp_avg_sq[range.clone()],
                max_exp_avg_sq: bufs
                    .max_exp_avg_sq
                    .as_deref_mut()
                    .map(|vmax| &mut vmax[range.clone()]),
                tmp,
            });
        }
        run_ops(&mut pieces);
    }
    Ok(())
}

/// Pieces of tensors processed together: (tensor index, element range).
pub(crate) type Chunk = Vec<(usize, std::ops::Range<usize>)>;

/// Splits tensors of lengths `lens` into chunks of at most `chunk_len` elements: each chunk is
/// a list of (tensor index, element range), in order, at most one range per tensor.
pub(crate) fn foreach_chunks(lens: &[usize], chunk_len: usize) -> Result<Vec<Chunk>, OptimError> {
    let total: usize = lens.iter().sum();
    if total == 0 {
        return Ok(Vec::new());
    }
    if chunk_len == 0 {
        return Err(OptimError::InvalidArgument {
            op: "foreach",
            reason: "the scratch (chunk) must hold at least one element".into(),
        });
    }
    let mut res = Vec::new();
    let mut current = Vec::new();
    let mut room = chunk_len;
    for (idx, &len) in lens.iter().enumerate() {
        let mut start = 0;
        while start < len {
            let take = room.min(len - start);
            current.push((idx, start..start + take));
            start += take;
            room -= take;
            if room == 0 {
                res.push(std::mem::take(&mut current));
                room = chunk_len;
            }
        }
    }
    if !current.is_empty() {
        res.push(current);
    }
    Ok(res)
}

struct Piece<'a, T> {
    consts: StepConsts,
    param: &'a mut [T],
    grad: &'a [T],
    exp_avg: &'a mut [T],
    exp_avg_sq: &'a mut [T],
    max_exp_avg_sq: Option<&'a mut [T]>,
    tmp: &'a mut [T],
}

/// `x = f(x)` over a slice of `T`, in f32, each result rounded to `T`.
#[inline(always)]
fn apply<T: ParamElement>(xs: &mut [T], f: impl Fn(f32) -> f32) {
    xs.iter_mut().for_each(|x| *x = T::from_f32(f(x.to_f32())));
}

/// `x = f(x, y)` over two slices of `T`, in f32, each result rounded to `T`.
#[inline(always)]
fn apply2<T: ParamElement>(xs: &mut [T], ys: &[T], f: impl Fn(f32, f32) -> f32) {
    for (x, &y) in xs.iter_mut().zip(ys) {
        *x = T::from_f32(f(x.to_f32(), y.to_f32()));
    }
}

/// The op sequence of PyTorch's single-tensor and foreach paths, each op one pass over every
/// piece, each result rounded to `T`.
fn run_ops<T: ParamElement>(pieces: &mut [Piece<'_, T>]) {
    // grad = -grad; grad = grad.add(param, alpha=wd)
    for pc in pieces.iter_mut().filter(|pc| pc.consts.changes_grad()) {
        let c = pc.consts;
        for ((t, &g), &p) in pc.tmp.iter_mut().zip(pc.grad).zip(pc.param.iter()) {
            let g = if c.maximize { -g.to_f32() } else { g.to_f32() };
            *t = T::from_f32(match c.l2 {
                Some(wd) => wd.mul_add(p.to_f32(), g),
                None => g,
            });
        }
    }
    // param.mul_(1 - lr * wd)
    for pc in pieces.iter_mut() {
        if let Some(factor) = pc.consts.decay_factor {
            apply(pc.param, |p| p * factor);
        }
    }
    // exp_avg.lerp_(grad, 1 - beta1)
    for pc in pieces.iter_mut() {
        let w = pc.consts.one_minus_beta1;
        let grad: &[T] = if pc.consts.changes_grad() {
            pc.tmp
        } else {
            pc.grad
        };
        apply2(pc.exp_avg, grad, |m, g| lerp(m, g, w));
    }
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    for pc in pieces.iter_mut() {
        let beta2 = pc.consts.beta2;
        apply(pc.exp_avg_sq, |v| v * beta2);
    }
    for pc in pieces.iter_mut() {
        let w = pc.consts.one_minus_beta2;
        let grad: &[T] = if pc.consts.changes_grad() {
            pc.tmp
        } else {
            pc.grad
        };
        apply2(pc.exp_avg_sq, grad, |v, g| v + w * g * g);
    }
    // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
    for pc in pieces.iter_mut() {
        if let Some(vmax) = pc.max_exp_avg_sq.as_deref_mut() {
            apply2(vmax, pc.exp_avg_sq, maximum);
        }
    }
    // denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    for pc in pieces.iter_mut() {
        let v: &[T] = pc.max_exp_avg_sq.as_deref().unwrap_or(pc.exp_avg_sq);
        apply2(pc.tmp, v, |_, v| v.sqrt());
    }
    for pc in pieces.iter_mut() {
        let c = pc.consts.bias_correction2_sqrt;
        apply(pc.tmp, |t| t / c);
    }
    for pc in pieces.iter_mut() {
        let eps = pc.consts.eps;
        apply(pc.tmp, |t| t + eps);
    }
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    for pc in pieces.iter_mut() {
        let value = pc.consts.neg_step_size;
        for ((p, &m), &d) in pc
            .param
            .iter_mut()
            .zip(pc.exp_avg.iter())
            .zip(pc.tmp.iter())
        {
            *p = T::from_f32(p.to_f32() + value * m.to_f32() / d.to_f32());
        }
    }
}

/// One element of the fused update in f32; every intermediate stays in registers. The caller
/// loads the values and stores the results.
#[inline(always)]
fn fused_element(
    c: &StepConsts,
    inv_scale: Option<f32>,
    p: &mut f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    vmax: Option<&mut f32>,
) {
    let mut g = match inv_scale {
        Some(scale) => g / scale,
        None => g,
    };
    if c.maximize {
        g = -g;
    }
    if let Some(wd) = c.l2 {
        g = wd.mul_add(*p, g);
    }
    if let Some(factor) = c.decay_factor {
        *p *= factor;
    }
    *m = lerp(*m, g, c.one_minus_beta1);
    *v *= c.beta2;
    *v += c.one_minus_beta2 * g * g;
    let second = match vmax {
        Some(vmax) => {
            *vmax = maximum(*vmax, *v);
            *vmax
        }
        None => *v,
    };
    let denom = second.sqrt() / c.bias_correction2_sqrt + c.eps;
    *p += c.neg_step_size * *m / denom;
}

/// The fused update of one element of `T`: loaded to f32, updated, each value stored once.
#[inline(always)]
fn fused_element_of<T: ParamElement>(
    c: &StepConsts,
    scale: Option<f32>,
    p: &mut T,
    g: T,
    m: &mut T,
    v: &mut T,
    vmax: Option<&mut T>,
) {
    let mut pv = p.to_f32();
    fused_element_stored(c, scale, &mut pv, g.to_f32(), m, v, vmax);
    *p = T::from_f32(pv);
}

/// The fused update of one element whose moments are of `M`: they are loaded to f32, updated
/// with `p`, and stored once (rounded to nearest-even); the caller stores `p`.
#[inline(always)]
fn fused_element_stored<M: ParamElement>(
    c: &StepConsts,
    scale: Option<f32>,
    p: &mut f32,
    g: f32,
    m: &mut M,
    v: &mut M,
    vmax: Option<&mut M>,
) {
    let (mut mv, mut vv) = (m.to_f32(), v.to_f32());
    match vmax {
        Some(vmax) => {
            let mut vmv = vmax.to_f32();
            fused_element(c, scale, p, g, &mut mv, &mut vv, Some(&mut vmv));
            *vmax = M::from_f32(vmv);
        }
        None => fused_element(c, scale, p, g, &mut mv, &mut vv, None),
    }
    *m = M::from_f32(mv);
    *v = M::from_f32(vv);
}

fn fused_range<T: ParamElement>(
    c: &StepConsts,
    scale: Option<f32>,
    param: &mut [T],
    grad: &[T],
    exp_avg: &mut [T],
    exp_avg_sq: &mut [T],
    max_exp_avg_sq: Option<&mut [T]>,
) {
    with_fast_fma(|| match max_exp_avg_sq {
        Some(vmax) => {
            for ((((p, &g), m), v), vm) in param
                .iter_mut()
                .zip(grad)
                .zip(exp_avg.iter_mut())
                .zip(exp_avg_sq.iter_mut())
                .zip(vmax.iter_mut())
            {
                fused_element_of(c, scale, p, g, m, v, Some(vm));
            }
        }
        None => {
            for (((p, &g), m), v) in param
                .iter_mut()
                .zip(grad)
                .zip(exp_avg.iter_mut())
                .zip(exp_avg_sq.iter_mut())
            {
                fused_element_of(c, scale, p, g, m, v, None);
            }
        }
    })
}

/// Fused Adam step number `step` on one parameter: one pass, no temporaries, gradients divided
/// by `scaling.grad_scale` in the kernel, nothing written when `scaling.found_inf` is set.
/// Large tensors are split over rayon's pool.
pub fn adam_fused<T: ParamElement>(
    cfg: &AdamConfig,
    step: u64,
    bufs: AdamBuffers<'_, T>,
    scaling: GradScaling,
) -> Result<StepOutcome, OptimError> {
    bufs.check("adam_fused", cfg)?;
    check_step("adam_fused", step)?;
    check_host_scaling("adam_fused", scaling)?;
    if scaling.skips() {
        return Ok(StepOutcome::Skipped);
    }
    let c = StepConsts::new(cfg, step);
    let scale = scaling.grad_scale;
    let AdamBuffers {
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
    } = bufs;
    if param.len() < 2 * PARALLEL_CHUNK {
        fused_range(&c, scale, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq);
        return Ok(StepOutcome::Stepped);
    }
    let base = param
        .par_chunks_mut(PARALLEL_CHUNK)
        .zip(grad.par_chunks(PARALLEL_CHUNK))
        .zip(exp_avg.par_chunks_mut(PARALLEL_CHUNK))
        .zip(exp_avg_sq.par_chunks_mut(PARALLEL_CHUNK));
    match max_exp_avg_sq {
        Some(vmax) => base
            .zip(vmax.par_chunks_mut(PARALLEL_CHUNK))
            .for_each(|((((p, g), m), v), vm)| fused_range(&c, scale, p, g, m, v, Some(vm))),
        None => base.for_each(|(((p, g), m), v)| fused_range(&c, scale, p, g, m, v, None)),
    }
    Ok(StepOutcome::Stepped)
}

/// One bf16 parameter's buffers for [`adam_fused_stochastic`]: the moments are f32.
#[derive(Debug)]
pub struct AdamStochasticBuffers<'a, M: ParamElement = f32> {
    /// The parameter, updated in place.
    pub param: &'a mut [bf16],
    /// Its gradient.
    pub grad: &'a [bf16],
    /// First moment, zero before the first step: f32, or bf16 (rounded to nearest-even as it is
    /// stored; the update reads the value before that rounding, as torchao's `_AdamW` does).
    pub exp_avg: &'a mut [M],
    /// Second moment, zero before the first step, of the first moment's type.
    pub exp_avg_sq: &'a mut [M],
    /// `max_exp_avg_sq`, present exactly when `amsgrad` is set.
    pub max_exp_avg_sq: Option<&'a mut [M]>,
}

/// Elements `base..base + param.len()` of a stochastic-rounding update.
#[allow(clippy::too_many_arguments)]
fn fused_stochastic_range<M: ParamElement>(
    c: &StepConsts,
    scale: Option<f32>,
    key: u64,
    base: usize,
    param: &mut [bf16],
    grad: &[bf16],
    exp_avg: &mut [M],
    exp_avg_sq: &mut [M],
    mut max_exp_avg_sq: Option<&mut [M]>,
) {
    with_fast_fma(|| {
        for (i, ((p, &g), (m, v))) in param
            .iter_mut()
            .zip(grad)
            .zip(exp_avg.iter_mut().zip(exp_avg_sq.iter_mut()))
            .enumerate()
        {
            let mut pv = p.to_f32();
            let vmax = max_exp_avg_sq.as_deref_mut().map(|vmax| &mut vmax[i]);
            fused_element_stored(c, scale, &mut pv, g.to_f32(), m, v, vmax);
            *p = round_bf16_stochastic(pv, stochastic_bits(key, (base + i) as u64));
        }
    })
}

/// Fused Adam step number `step` on one bf16 parameter with f32 or bf16 moments (`M`): the update
/// is the f32 arithmetic of [`adam_fused`] (from bf16 moments widened, their new values rounded
/// to nearest-even only as they are stored), and the new parameter is rounded to bf16
/// stochastically, element
/// `i` with [`stochastic_bits`]`(key, i)` (`key` from [`stochastic_key`](super::stochastic_key)
/// of the seed, the parameter's index and the step). Gradients are divided by
/// `scaling.grad_scale`; nothing is written when `scaling.found_inf` is set. The CUDA kernel
/// computes the same bits.
pub fn adam_fused_stochastic<M: ParamElement>(
    cfg: &AdamConfig,
    step: u64,
    key: u64,
    bufs: AdamStochasticBuffers<'_, M>,
    scaling: GradScaling,
) -> Result<StepOutcome, OptimError> {
    let op = "adam_fused_stochastic";
    check_step(op, step)?;
    check_host_scaling(op, scaling)?;
    let n = bufs.param.len();
    check_len(op, n, bufs.grad.len(), "grad")?;
    check_len(op, n, bufs.exp_avg.len(), "exp_avg")?;
    check_len(op, n, bufs.exp_avg_sq.len(), "exp_avg_sq")?;
    match (&bufs.max_exp_avg_sq, cfg.amsgrad) {
        (Some(vmax), true) => check_len(op, n, vmax.len(), "max_exp_avg_sq")?,
        (None, false) => {}
        _ => {
            return Err(OptimError::InvalidArgument {
                op,
                reason: "max_exp_avg_sq must be given exactly when amsgrad is set".into(),
            })
        }
    }
    if scaling.skips() {
        return Ok(StepOutcome::Skipped);
    }
    let c = StepConsts::new(cfg, step);
    let scale = scaling.grad_scale;
    let AdamStochasticBuffers {
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
    } = bufs;
    if n < 2 * PARALLEL_CHUNK {
        fused_stochastic_range(
            &c,
            scale,
            key,
            0,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
        );
        return Ok(StepOutcome::Stepped);
    }
    let base = param
        .par_chunks_mut(PARALLEL_CHUNK)
        .zip(grad.par_chunks(PARALLEL_CHUNK))
        .zip(exp_avg.par_chunks_mut(PARALLEL_CHUNK))
        .zip(exp_avg_sq.par_chunks_mut(PARALLEL_CHUNK))
        .enumerate();
    match max_exp_avg_sq {
        Some(vmax) => base.zip(vmax.par_chunks_mut(PARALLEL_CHUNK)).for_each(
            |((idx, (((p, g), m), v)), vm)| {
                let start = idx * PARALLEL_CHUNK;
                fused_stochastic_range(&c, scale, key, start, p, g, m, v, Some(vm))
            },
        ),
        None => base.for_each(|(idx, (((p, g), m), v))| {
            let start = idx * PARALLEL_CHUNK;
            fused_stochastic_range(&c, scale, key, start, p, g, m, v, None)
        }),
    }
    Ok(StepOutcome::Stepped)
}
