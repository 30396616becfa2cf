//! SGD with momentum, dampening, Nesterov and weight decay (`torch.optim.SGD`) on host slices.
//!
//! Per element, in float32 and in PyTorch's order (`_single_tensor_sgd`): `g = -g` if
//! maximizing; `g = g + wd·θ`; with momentum μ, `b = g` on the first step, else `b = b·μ`,
//! `b = b + (1-τ)·g`; Nesterov `g = g + μ·b`, otherwise `g = b`; `θ = θ + (-lr)·g`. The buffer
//! keeps lr outside (`b = μb + g`), unlike Sutskever's form.
//!
//! Parameters may be f32, bf16 or f16 ([`ParamElement`]): arithmetic in f32, the momentum buffer
//! and temporaries in the parameter's type. The fused form rounds the buffer when it stores it
//! and the parameter at the end (the update reads the stored buffer back, as PyTorch's fused SGD
//! does); single and foreach round every op's result, as PyTorch's op-by-op SGD does.

use rayon::prelude::*;

use super::adam::foreach_chunks;
use super::{
    check_host_scaling, check_len, non_negative, with_fast_fma, GradScaling, ParamElement,
    StepOutcome, PARALLEL_CHUNK,
};
use crate::error::OptimError;

/// SGD's hyperparameters (one parameter group's).
#[derive(Debug, Clone, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor μ (0: none, and no buffer is kept).
    pub momentum: f64,
    /// Dampening τ of the momentum.
    pub dampening: f64,
    /// L2 weight decay, added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs μ > 0 and τ = 0).
    pub nesterov: bool,
    /// Ascend instead of descend.
    pub maximize: bool,
}

impl SgdConfig {
    /// `torch.optim.SGD`'s defaults with learning rate `lr`.
    pub fn new(lr: f64) -> SgdConfig {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }

    /// Checks the ranges PyTorch checks.
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |reason: String| {
            Err(OptimError::InvalidArgument {
                op: "SgdConfig",
                reason,
            })
        };
        if !non_negative(self.lr)
            || !non_negative(self.momentum)
            || !non_negative(self.weight_decay)
        {
            return bad(format!(
                "invalid lr {}, momentum {} or weight_decay {}",
                self.lr, self.momentum, self.weight_decay
            ));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad("Nesterov momentum requires a momentum and zero dampening".into());
        }
        Ok(())
    }

    /// Whether a momentum buffer is kept.
    pub fn has_momentum(&self) -> bool {
        self.momentum != 0.0
    }
}

/// One parameter's buffers for an SGD update, of element type `T` (f32, bf16 or f16).
#[derive(Debug)]
pub struct SgdBuffers<'a, T = f32> {
    /// The parameter, updated in place.
    pub param: &'a mut [T],
    /// Its gradient.
    pub grad: &'a [T],
    /// The momentum buffer, present exactly when the momentum is non-zero.
    pub momentum_buffer: Option<&'a mut [T]>,
    /// Whether the momentum buffer is still uninitialised (it is then set to the gradient).
    pub first_step: bool,
}

impl<T> SgdBuffers<'_, T> {
    fn check(&self, op: &'static str, cfg: &SgdConfig) -> Result<(), OptimError> {
        let n = self.param.len();
        check_len(op, n, self.grad.len(), "grad")?;
        match (&self.momentum_buffer, cfg.has_momentum()) {
            (Some(buf), true) => check_len(op, n, buf.len(), "momentum_buffer"),
            (None, false) => Ok(()),
            _ => Err(OptimError::InvalidArgument {
                op,
                reason: "momentum_buffer must be given exactly when momentum is non-zero".into(),
            }),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConsts {
    pub(crate) maximize: bool,
    pub(crate) weight_decay: Option<f32>,
    pub(crate) momentum: Option<f32>,
    pub(crate) one_minus_dampening: f32,
    pub(crate) nesterov: bool,
    pub(crate) neg_lr: f32,
}

impl StepConsts {
    pub(crate) fn new(cfg: &SgdConfig) -> StepConsts {
        StepConsts {
            maximize: cfg.maximize,
            weight_decay: (cfg.weight_decay != 0.0).then_some(cfg.weight_decay as f32),
            momentum: cfg.has_momentum().then_some(cfg.momentum as f32),
            one_minus_dampening: (1.0 - cfg.dampening) as f32,
            nesterov: cfg.nesterov,
            neg_lr: (-cfg.lr) as f32,
        }
    }
}

/// One element: returns nothing, updates `p` and the buffer (stored, then read back, so the
/// update uses the buffer's stored value).
#[inline(always)]
fn element<T: ParamElement>(c: &StepConsts, first: bool, p: &mut T, g: f32, buf: Option<&mut T>) {
    let pv = p.to_f32();
    let mut g = if c.maximize { -g } else { g };
    if let Some(wd) = c.weight_decay {
        g = wd.mul_add(pv, g);
    }
    if let (Some(mu), Some(b)) = (c.momentum, buf) {
        let bv = if first {
            g
        } else {
            b.to_f32() * mu + c.one_minus_dampening * g
        };
        *b = T::from_f32(bv);
        let bv = b.to_f32();
        g = if c.nesterov { mu.mul_add(bv, g) } else { bv };
    }
    *p = T::from_f32(c.neg_lr.mul_add(g, pv));
}

/// PyTorch's single-tensor SGD on one parameter, op by op; `scratch` (at least `param.len()`
/// elements) holds the modified gradient.
pub fn sgd_single<T: ParamElement>(
    cfg: &SgdConfig,
    bufs: SgdBuffers<'_, T>,
    scratch: &mut [T],
) -> Result<(), OptimError> {
    sgd_foreach(cfg, &mut [bufs], scratch)
}

/// PyTorch's foreach SGD over a list of parameters in chunks of at most `scratch.len()`
/// elements (see `adam_foreach`).
pub fn sgd_foreach<T: ParamElement>(
    cfg: &SgdConfig,
    tensors: &mut [SgdBuffers<'_, T>],
    scratch: &mut [T],
) -> Result<(), OptimError> {
    for bufs in tensors.iter() {
        bufs.check("sgd_foreach", cfg)?;
    }
    let c = StepConsts::new(cfg);
    let lens: Vec<usize> = tensors.iter().map(|b| b.param.len()).collect();
    for chunk in foreach_chunks(&lens, scratch.len())? {
        // Pieces of this chunk, each with its slice of the scratch.
        let mut tmp_rest = &mut scratch[..];
        let mut pieces = Vec::with_capacity(chunk.len());
        for (idx, range) in chunk {
            let (tmp, rest) = tmp_rest.split_at_mut(range.len());
            tmp_rest = rest;
            pieces.push((idx, range, tmp));
        }
        // grad = -grad; grad = grad.add(param, alpha=wd)
        for (idx, range, tmp) in pieces.iter_mut() {
            let bufs = &tensors[*idx];
            for ((t, &g), &p) in tmp
                .iter_mut()
                .zip(&bufs.grad[range.clone()])
                .zip(&bufs.param[range.clone()])
            {
                let g = if c.maximize { -g.to_f32() } else { g.to_f32() };
                *t = T::from_f32(match c.weight_decay {
                    Some(wd) => wd.mul_add(p.to_f32(), g),
                    None => g,
                });
            }
        }
        // buf = clone(grad) | buf.mul_(momentum).add_(grad, alpha=1-dampening);
        // grad = grad.add(buf, alpha=momentum) | grad = buf
        if let Some(mu) = c.momentum {
            for (idx, range, tmp) in pieces.iter_mut() {
                let bufs = &mut tensors[*idx];
                let first = bufs.first_step;
                let buf = &mut bufs.momentum_buffer.as_deref_mut().expect("checked")[range.clone()];
                if first {
                    buf.copy_from_slice(tmp);
                } else {
                    buf.iter_mut()
                        .for_each(|b| *b = T::from_f32(b.to_f32() * mu));
                    for (b, &g) in buf.iter_mut().zip(tmp.iter()) {
                        *b = T::from_f32(b.to_f32() + c.one_minus_dampening * g.to_f32());
                    }
                }
                for (t, &b) in tmp.iter_mut().zip(buf.iter()) {
                    *t = if c.nesterov {
                        T::from_f32(mu.mul_add(b.to_f32(), t.to_f32()))
                    } else {
                        b
                    };
                }
            }
        }
        // param.add_(grad, alpha=-lr)
        for (idx, range, tmp) in pieces.iter_mut() {
            let bufs = &mut tensors[*idx];
            for (p, &g) in bufs.param[range.clone()].iter_mut().zip(tmp.iter()) {
                *p = T::from_f32(c.neg_lr.mul_add(g.to_f32(), p.to_f32()));
            }
        }
    }
    Ok(())
}

/// Fused SGD on one parameter: one pass, no temporaries, in-kernel unscale and skip.
pub fn sgd_fused<T: ParamElement>(
    cfg: &SgdConfig,
    bufs: SgdBuffers<'_, T>,
    scaling: GradScaling,
) -> Result<StepOutcome, OptimError> {
    bufs.check("sgd_fused", cfg)?;
    check_host_scaling("sgd_fused", scaling)?;
    if scaling.skips() {
        return Ok(StepOutcome::Skipped);
    }
    let c = StepConsts::new(cfg);
    let scale = scaling.grad_scale;
    let first = bufs.first_step;
    let unscale = |g: T| match scale {
        Some(s) => g.to_f32() / s,
        None => g.to_f32(),
    };
    let run = |param: &mut [T], grad: &[T], buf: Option<&mut [T]>| {
        with_fast_fma(|| match buf {
            Some(buf) => {
                for ((p, &g), b) in param.iter_mut().zip(grad).zip(buf.iter_mut()) {
                    element(&c, first, p, unscale(g), Some(b));
                }
            }
            None => {
                for (p, &g) in param.iter_mut().zip(grad) {
                    element(&c, first, p, unscale(g), None);
                }
            }
        })
    };
    let SgdBuffers {
        param,
        grad,
        momentum_buffer,
        ..
    } = bufs;
    if param.len() < 2 * PARALLEL_CHUNK {
        run(param, grad, momentum_buffer);
        return Ok(StepOutcome::Stepped);
    }
    let base = param
        .par_chunks_mut(PARALLEL_CHUNK)
        .zip(grad.par_chunks(PARALLEL_CHUNK));
    match momentum_buffer {
        Some(buf) => base
            .zip(buf.par_chunks_mut(PARALLEL_CHUNK))
            .for_each(|((p, g), b)| run(p, g, Some(b))),
        None => base.for_each(|(p, g)| run(p, g, None)),
    }
    Ok(StepOutcome::Stepped)
}
