//! Adafactor as `torch.optim.Adafactor` computes it, on host slices.
//!
//! Per step t: `1-β2_t = t^beta2_decay`, `ρ = min(lr, 1/√t)`, `α = max(eps2, RMS(θ))·ρ`,
//! `θ *= 1 - lr·wd`. A tensor of two or more dims keeps a row and a column second moment over
//! its last two dims (`R ← lerp(R, mean(g², -1))`, `C ← lerp(C, mean(g², -2))`) and estimates
//! `V = R·C / max(mean(R), eps1)`; a vector keeps `V ← lerp(V, g²)`. Then
//! `U = rsqrt(max(V, eps1²))·g`, `θ += (-α / max(1, RMS(U)/d))·U`. Norms are accumulated in
//! f64 and rounded to f32, as `.item()` of a float32 norm gives them.
//!
//! [`adafactor_single`] materialises `V` and `U` (one parameter's size) in the scratch, as
//! PyTorch does; [`adafactor_fused`] recomputes `U` in two passes and keeps only the per-row and
//! per-column means (O(rows + cols)).

use super::{
    check_host_scaling, check_len, check_step, lerp, non_negative, GradScaling, StepOutcome,
};
use crate::error::OptimError;

/// Adafactor's hyperparameters (one parameter group's).
#[derive(Debug, Clone, PartialEq)]
pub struct AdafactorConfig {
    /// Learning rate (also caps the relative step size ρ).
    pub lr: f64,
    /// Exponent of the second-moment decay: `1 - β2_t = t^beta2_decay`.
    pub beta2_decay: f64,
    /// `eps1` (floor of the second moment; `None`: float32's machine epsilon) and `eps2` (floor
    /// of the parameter RMS).
    pub eps: (Option<f64>, f64),
    /// Clipping threshold of the update RMS.
    pub d: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Ascend instead of descend.
    pub maximize: bool,
}

impl AdafactorConfig {
    /// `torch.optim.Adafactor`'s defaults: lr 1e-2, beta2_decay -0.8, eps (None, 1e-3), d 1.
    pub fn new() -> AdafactorConfig {
        AdafactorConfig {
            lr: 1e-2,
            beta2_decay: -0.8,
            eps: (None, 1e-3),
            d: 1.0,
            weight_decay: 0.0,
            maximize: false,
        }
    }

    /// Checks the ranges PyTorch checks.
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |reason: String| {
            Err(OptimError::InvalidArgument {
                op: "AdafactorConfig",
                reason,
            })
        };
        if !non_negative(self.lr) || !non_negative(-self.beta2_decay) || !non_negative(self.d - 1.0)
        {
            return bad(format!(
                "invalid lr {}, beta2_decay {} or d {}",
                self.lr, self.beta2_decay, self.d
            ));
        }
        if !self.eps.0.is_none_or(non_negative) || !non_negative(self.eps.1) {
            return bad(format!("invalid eps {:?}", self.eps));
        }
        if !non_negative(self.weight_decay) {
            return bad(format!("invalid weight_decay {}", self.weight_decay));
        }
        Ok(())
    }
}

impl Default for AdafactorConfig {
    fn default() -> Self {
        AdafactorConfig::new()
    }
}

/// One parameter's buffers for an Adafactor update.
#[derive(Debug)]
pub struct AdafactorBuffers<'a> {
    /// The parameter, updated in place.
    pub param: &'a mut [f32],
    /// Its gradient.
    pub grad: &'a [f32],
    /// The parameter's shape; with two or more dims the second moment is factored.
    pub shape: &'a [usize],
    /// Row moments, `[..., rows]` (factored only).
    pub row_var: Option<&'a mut [f32]>,
    /// Column moments, `[..., cols]` (factored only).
    pub col_var: Option<&'a mut [f32]>,
    /// Per-element moment (vectors only).
    pub variance: Option<&'a mut [f32]>,
}

/// (batch, rows, cols) of a factored shape.
pub(crate) fn factors(shape: &[usize]) -> Option<(usize, usize, usize)> {
    if shape.len() < 2 {
        return None;
    }
    let rows = shape[shape.len() - 2];
    let cols = shape[shape.len() - 1];
    let batch = shape[..shape.len() - 2].iter().product();
    Some((batch, rows, cols))
}

/// Scratch elements [`adafactor_single`] needs for a parameter of this shape.
pub fn adafactor_scratch_len(shape: &[usize]) -> usize {
    let numel: usize = shape.iter().product();
    match factors(shape) {
        Some((batch, rows, cols)) => numel + batch * (rows + cols),
        None => numel,
    }
}

/// The per-step scalars; `alpha` needs the parameter's norm, which the CUDA kernels compute on
/// the device from `rho` and the `eps` pair.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConsts {
    pub(crate) maximize: bool,
    pub(crate) weight: f32,
    pub(crate) decay_factor: Option<f32>,
    pub(crate) eps1: f32,
    pub(crate) eps1_sq: f32,
    pub(crate) rho: f64,
    pub(crate) alpha: f64,
    pub(crate) d: f64,
}

fn f32_norm(values: impl Iterator<Item = f32>) -> f32 {
    values
        .map(|v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt() as f32
}

impl StepConsts {
    fn new(cfg: &AdafactorConfig, step: u64, param: &[f32]) -> StepConsts {
        let mut c = StepConsts::without_norm(cfg, step);
        let param_rms = f64::from(f32_norm(param.iter().copied())) / (param.len() as f64).sqrt();
        c.alpha = cfg.eps.1.max(param_rms) * c.rho;
        c
    }

    /// Everything but `alpha` (left 0).
    pub(crate) fn without_norm(cfg: &AdafactorConfig, step: u64) -> StepConsts {
        let t = step as f64;
        let eps1 = cfg.eps.0.unwrap_or(f64::from(f32::EPSILON));
        StepConsts {
            maximize: cfg.maximize,
            weight: t.powf(cfg.beta2_decay) as f32,
            decay_factor: (cfg.weight_decay != 0.0)
                .then_some((1.0 - cfg.lr * cfg.weight_decay) as f32),
            eps1: eps1 as f32,
            eps1_sq: (eps1 * eps1) as f32,
            rho: cfg.lr.min(1.0 / t.sqrt()),
            alpha: 0.0,
            d: cfg.d,
        }
    }

    fn grad(&self, g: f32, scale: Option<f32>) -> f32 {
        let g = match scale {
            Some(s) => g / s,
            None => g,
        };
        if self.maximize {
            -g
        } else {
            g
        }
    }

    /// The update's multiplier `-α / max(1, RMS(U)/d)` as a float32 `alpha=` argument.
    fn update_scale(&self, update_norm: f32, numel: usize) -> f32 {
        let denom = 1f64.max(f64::from(update_norm) / ((numel as f64).sqrt() * self.d));
        (-self.alpha / denom) as f32
    }
}

fn check(op: &'static str, bufs: &AdafactorBuffers<'_>) -> Result<(), OptimError> {
    let numel: usize = bufs.shape.iter().product();
    check_len(op, numel, bufs.param.len(), "param")?;
    check_len(op, numel, bufs.grad.len(), "grad")?;
    match (
        factors(bufs.shape),
        &bufs.row_var,
        &bufs.col_var,
        &bufs.variance,
    ) {
        (Some((batch, rows, cols)), Some(r), Some(c), None) => {
            check_len(op, batch * rows, r.len(), "row_var")?;
            check_len(op, batch * cols, c.len(), "col_var")
        }
        (None, None, None, Some(v)) => check_len(op, numel, v.len(), "variance"),
        _ => Err(OptimError::InvalidArgument {
            op,
            reason: "a tensor of two or more dims needs row_var and col_var, a vector variance"
                .into(),
        }),
    }
}

/// Updates the row and column moments of a factored parameter (shared by both forms).
/// `row_mean` and `col_mean` are scratch of `batch·rows` and `batch·cols` elements.
#[allow(clippy::too_many_arguments)]
fn update_factors(
    c: &StepConsts,
    scale: Option<f32>,
    grad: &[f32],
    (batch, rows, cols): (usize, usize, usize),
    row_var: &mut [f32],
    col_var: &mut [f32],
    row_mean: &mut [f32],
    col_mean: &mut [f32],
) {
    // torch.norm(grad, dim=-1, keepdim=True).square_().div_(cols), then row_var.lerp_.
    for b in 0..batch {
        let mat = &grad[b * rows * cols..(b + 1) * rows * cols];
        for i in 0..rows {
            let norm = f32_norm(
                mat[i * cols..(i + 1) * cols]
                    .iter()
                    .map(|&g| c.grad(g, scale)),
            );
            row_mean[b * rows + i] = norm * norm / cols as f32;
        }
        for j in 0..cols {
            let norm = f32_norm((0..rows).map(|i| c.grad(mat[i * cols + j], scale)));
            col_mean[b * cols + j] = norm * norm / rows as f32;
        }
    }
    for (r, &mean) in row_var.iter_mut().zip(row_mean.iter()) {
        *r = lerp(*r, mean, c.weight);
    }
    for (v, &mean) in col_var.iter_mut().zip(col_mean.iter()) {
        *v = lerp(*v, mean, c.weight);
    }
}

/// `max(mean(row_var over rows), eps1)` per batch entry, as float32.
fn row_var_floor(c: &StepConsts, row_var: &[f32], rows: usize, b: usize) -> f32 {
    let sum: f64 = row_var[b * rows..(b + 1) * rows]
        .iter()
        .map(|&v| f64::from(v))
        .sum();
    let mean = (sum / rows as f64) as f32;
    mean.max(c.eps1)
}

/// PyTorch's single-tensor Adafactor step number `step` on one parameter; `scratch` has at
/// least [`adafactor_scratch_len`] elements.
pub fn adafactor_single(
    cfg: &AdafactorConfig,
    step: u64,
    bufs: AdafactorBuffers<'_>,
    scratch: &mut [f32],
) -> Result<(), OptimError> {
    check("adafactor_single", &bufs)?;
    check_step("adafactor_single", step)?;
    let need = adafactor_scratch_len(bufs.shape);
    if scratch.len() < need {
        return Err(OptimError::LengthMismatch {
            op: "adafactor_single",
            expected: need,
            got: scratch.len(),
            detail: "scratch".into(),
        });
    }
    let c = StepConsts::new(cfg, step, bufs.param);
    let numel = bufs.param.len();
    if let Some(factor) = c.decay_factor {
        bufs.param.iter_mut().for_each(|p| *p *= factor);
    }
    let (update, rest) = scratch.split_at_mut(numel);
    match factors(bufs.shape) {
        Some(dims @ (batch, rows, cols)) => {
            let row_var = bufs.row_var.expect("checked");
            let col_var = bufs.col_var.expect("checked");
            let (row_mean, rest) = rest.split_at_mut(batch * rows);
            let col_mean = &mut rest[..batch * cols];
            update_factors(
                &c, None, bufs.grad, dims, row_var, col_var, row_mean, col_mean,
            );
            // var_estimate = row_var @ col_var; var_estimate.div_(row_mean.clamp_(eps1))
            for b in 0..batch {
                for i in 0..rows {
                    let r = row_var[b * rows + i];
                    let out = &mut update[(b * rows + i) * cols..(b * rows + i + 1) * cols];
                    for (u, &cv) in out.iter_mut().zip(&col_var[b * cols..(b + 1) * cols]) {
                        *u = r * cv;
                    }
                }
            }
            for b in 0..batch {
                let floor = row_var_floor(&c, row_var, rows, b);
                update[b * rows * cols..(b + 1) * rows * cols]
                    .iter_mut()
                    .for_each(|u| *u /= floor);
            }
        }
        None => {
            // variance.lerp_(grad * grad, 1-β2_t); var_estimate = variance.clone()
            let variance = bufs.variance.expect("checked");
            for (u, &g) in update.iter_mut().zip(bufs.grad) {
                let g = c.grad(g, None);
                *u = g * g;
            }
            for (v, &g2) in variance.iter_mut().zip(update.iter()) {
                *v = lerp(*v, g2, c.weight);
            }
            update.copy_from_slice(variance);
        }
    }
    // update = var_estimate.clamp_(min=eps1²).rsqrt_(); update.mul_(grad)
    for u in update.iter_mut() {
        *u = 1.0 / u.max(c.eps1_sq).sqrt();
    }
    for (u, &g) in update.iter_mut().zip(bufs.grad) {
        *u *= c.grad(g, None);
    }
    let value = c.update_scale(f32_norm(update.iter().copied()), numel);
    for (p, &u) in bufs.param.iter_mut().zip(update.iter()) {
        *p = value.mul_add(u, *p);
    }
    Ok(())
}

/// Fused Adafactor: the update is recomputed per element in two passes (its RMS, then the
/// write), with in-kernel unscale and skip; temporaries are O(rows + cols) per parameter.
pub fn adafactor_fused(
    cfg: &AdafactorConfig,
    step: u64,
    bufs: AdafactorBuffers<'_>,
    scaling: GradScaling,
) -> Result<StepOutcome, OptimError> {
    check("adafactor_fused", &bufs)?;
    check_step("adafactor_fused", step)?;
    check_host_scaling("adafactor_fused", scaling)?;
    if scaling.skips() {
        return Ok(StepOutcome::Skipped);
    }
    let scale = scaling.grad_scale;
    let c = StepConsts::new(cfg, step, bufs.param);
    let numel = bufs.param.len();
    if let Some(factor) = c.decay_factor {
        bufs.param.iter_mut().for_each(|p| *p *= factor);
    }
    let rsqrt = |v: f32| 1.0 / v.max(c.eps1_sq).sqrt();
    match factors(bufs.shape) {
        Some(dims @ (batch, rows, cols)) => {
            let row_var = bufs.row_var.expect("checked");
            let col_var = bufs.col_var.expect("checked");
            let mut row_mean = vec![0f32; batch * rows];
            let mut col_mean = vec![0f32; batch * cols];
            update_factors(
                &c,
                scale,
                bufs.grad,
                dims,
                row_var,
                col_var,
                &mut row_mean,
                &mut col_mean,
            );
            let floors: Vec<f32> = (0..batch)
                .map(|b| row_var_floor(&c, row_var, rows, b))
                .collect();
            let update_at = |b: usize, i: usize, j: usize| -> f32 {
                let v = row_var[b * rows + i] * col_var[b * cols + j] / floors[b];
                rsqrt(v) * c.grad(bufs.grad[(b * rows + i) * cols + j], scale)
            };
            let mut sum_sq = 0f64;
            for b in 0..batch {
                for i in 0..rows {
                    for j in 0..cols {
                        let u = f64::from(update_at(b, i, j));
                        sum_sq += u * u;
                    }
                }
            }
            let value = c.update_scale(sum_sq.sqrt() as f32, numel);
            for b in 0..batch {
                for i in 0..rows {
                    for j in 0..cols {
                        let p = &mut bufs.param[(b * rows + i) * cols + j];
                        *p = value.mul_add(update_at(b, i, j), *p);
                    }
                }
            }
        }
        None => {
            let variance = bufs.variance.expect("checked");
            for (v, &g) in variance.iter_mut().zip(bufs.grad) {
                let g = c.grad(g, scale);
                *v = lerp(*v, g * g, c.weight);
            }
            let update = |idx: usize| rsqrt(variance[idx]) * c.grad(bufs.grad[idx], scale);
            let sum_sq: f64 = (0..numel).map(|idx| f64::from(update(idx)).powi(2)).sum();
            let value = c.update_scale(sum_sq.sqrt() as f32, numel);
            for (idx, p) in bufs.param.iter_mut().enumerate() {
                *p = value.mul_add(update(idx), *p);
            }
        }
    }
    Ok(StepOutcome::Stepped)
}
