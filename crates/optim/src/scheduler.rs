//! Learning-rate schedules that drive an optimizer's groups, with PyTorch's closed forms.
//!
//! [`LrScheduler`] remembers each group's base learning rate when it is created, sets the
//! learning rate of step 0 at once, and on every [`LrScheduler::step`] (once per optimizer
//! step, after it, as in PyTorch) sets each group's rate for the next step. It works through
//! the object-safe [`Optimizer`] trait, so one scheduler drives any algorithm.
//!
//! A step a GradScaler skipped (its gradients overflowed) did not happen, so the schedule must
//! not advance past it: [`LrScheduler::step_unless_skipped`] takes the step's [`SkipFlag`].
//! PyTorch's schedulers advance regardless and cannot tell (pytorch issues 67590, 152279).

use headroom_autograd_core::Tensor;

use crate::error::OptimError;
use crate::optimizer::Optimizer;

/// Whether an optimizer step was skipped because its gradients overflowed: known on the host,
/// or a one-element f32 flag (non-zero: skipped) still on the device, where a GradScaler that
/// never synchronises leaves it.
#[derive(Debug, Clone)]
pub enum SkipFlag {
    /// The host knows.
    Known(bool),
    /// The device knows: reading it waits for the step to finish.
    OnDevice(Tensor),
}

impl SkipFlag {
    /// Whether the step was skipped; a flag on the device is read (one host read, which waits
    /// for the device to reach the step).
    pub fn read(&self) -> Result<bool, OptimError> {
        match self {
            SkipFlag::Known(skipped) => Ok(*skipped),
            SkipFlag::OnDevice(flag) => Ok(flag.to_vec_f64()?.first().is_some_and(|v| *v != 0.0)),
        }
    }
}

/// A schedule: the learning rate at step `t` from a group's base rate.
#[derive(Debug, Clone, PartialEq)]
pub enum Schedule {
    /// `torch.optim.lr_scheduler.LinearLR(start_factor, end_factor=1, total_iters)`: the factor
    /// goes linearly from `start_factor` to 1 over `warmup_steps`, then stays at 1.
    LinearWarmup {
        /// Factor of the base rate at step 0.
        start_factor: f64,
        /// Steps to reach the base rate.
        warmup_steps: u64,
    },
    /// `StepLR(step_size, gamma)`: `base · gamma^(t / step_size)`.
    Step {
        /// Steps between decays.
        step_size: u64,
        /// Multiplicative decay.
        gamma: f64,
    },
    /// `CosineAnnealingLR(T_max, eta_min)` (closed form):
    /// `eta_min + (base - eta_min)·(1 + cos(π·t/T_max))/2`.
    Cosine {
        /// Half-period in steps.
        t_max: u64,
        /// Floor.
        eta_min: f64,
    },
    /// `OneCycleLR(max_lr, total_steps, pct_start, anneal_strategy='cos', div_factor,
    /// final_div_factor, three_phase=False)`; the base rate is ignored.
    OneCycle {
        /// Peak learning rate.
        max_lr: f64,
        /// Length of the cycle.
        total_steps: u64,
        /// Fraction of the cycle spent increasing.
        pct_start: f64,
        /// `initial_lr = max_lr / div_factor`.
        div_factor: f64,
        /// `min_lr = initial_lr / final_div_factor`.
        final_div_factor: f64,
    },
}

impl Schedule {
    /// One-cycle with PyTorch's defaults (pct_start 0.3, div_factor 25, final_div_factor 1e4).
    pub fn one_cycle(max_lr: f64, total_steps: u64) -> Schedule {
        Schedule::OneCycle {
            max_lr,
            total_steps,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
        }
    }

    /// Checks the settings as PyTorch's schedulers do, and what PyTorch leaves to arithmetic:
    /// a warmup factor in (0, 1]; a finite, non-negative decay and floor; one-cycle's
    /// `pct_start` in [0, 1], a finite non-negative peak, positive finite divisors and at least
    /// 2 steps. Anything else would give negative, infinite or NaN rates.
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |reason: String| {
            Err(OptimError::InvalidArgument {
                op: "LrScheduler",
                reason,
            })
        };
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let non_negative = |x: f64| x.is_finite() && x >= 0.0;
        match *self {
            Schedule::LinearWarmup { start_factor, .. } => {
                if !(start_factor > 0.0 && start_factor <= 1.0) {
                    return bad(format!(
                        "the warmup's start factor must be in (0, 1], got {start_factor}"
                    ));
                }
            }
            Schedule::Step { gamma, .. } => {
                if !non_negative(gamma) {
                    return bad(format!("gamma must be finite and at least 0, got {gamma}"));
                }
            }
            Schedule::Cosine { eta_min, .. } => {
                if !non_negative(eta_min) {
                    return bad(format!(
                        "eta_min must be finite and at least 0, got {eta_min}"
                    ));
                }
            }
            Schedule::OneCycle {
                max_lr,
                total_steps,
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                if total_steps < 2 {
                    return bad(format!(
                        "one-cycle needs at least 2 steps, got {total_steps}"
                    ));
                }
                if !(0.0..=1.0).contains(&pct_start) {
                    return bad(format!("pct_start must be in [0, 1], got {pct_start}"));
                }
                if !non_negative(max_lr) {
                    return bad(format!(
                        "max_lr must be finite and at least 0, got {max_lr}"
                    ));
                }
                if !positive(div_factor) || !positive(final_div_factor) {
                    return bad(format!(
                        "div_factor and final_div_factor must be finite and above 0, got \
                         {div_factor} and {final_div_factor}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The learning rate at step `t` for a group whose base rate is `base`.
    pub fn lr_at(&self, base: f64, t: u64) -> f64 {
        match *self {
            Schedule::LinearWarmup {
                start_factor,
                warmup_steps,
            } => {
                if warmup_steps == 0 {
                    return base;
                }
                let progress = t.min(warmup_steps) as f64 / warmup_steps as f64;
                base * (start_factor + (1.0 - start_factor) * progress)
            }
            Schedule::Step { step_size, gamma } => base * gamma.powi((t / step_size.max(1)) as i32),
            Schedule::Cosine { t_max, eta_min } => {
                let phase = std::f64::consts::PI * t as f64 / t_max.max(1) as f64;
                eta_min + (base - eta_min) * (1.0 + phase.cos()) / 2.0
            }
            Schedule::OneCycle {
                max_lr,
                total_steps,
                pct_start,
                div_factor: initial_div,
                final_div_factor: final_div,
            } => {
                let initial = max_lr / initial_div;
                let min_lr = initial / final_div;
                let end_up = pct_start * total_steps as f64 - 1.0;
                let end_down = total_steps as f64 - 1.0;
                let anneal = |start: f64, end: f64, pct: f64| {
                    end + (start - end) / 2.0 * ((std::f64::consts::PI * pct).cos() + 1.0)
                };
                let t = t as f64;
                if t <= end_up {
                    anneal(initial, max_lr, t / end_up)
                } else {
                    anneal(max_lr, min_lr, (t - end_up) / (end_down - end_up))
                }
            }
        }
    }
}

/// Drives the learning rates of an optimizer's groups along a [`Schedule`].
#[derive(Debug, Clone)]
pub struct LrScheduler {
    schedule: Schedule,
    base_lrs: Vec<f64>,
    last_step: u64,
}

impl LrScheduler {
    /// Records the groups' current rates as base rates and sets the rate of step 0.
    pub fn new(
        schedule: Schedule,
        optimizer: &mut dyn Optimizer,
    ) -> Result<LrScheduler, OptimError> {
        schedule.validate()?;
        let base_lrs = (0..optimizer.n_groups()).map(|g| optimizer.lr(g)).collect();
        let res = LrScheduler {
            schedule,
            base_lrs,
            last_step: 0,
        };
        res.apply(optimizer);
        Ok(res)
    }

    /// Advances one step and sets every group's rate.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) {
        self.last_step += 1;
        self.apply(optimizer);
    }

    /// Advances one step, as [`LrScheduler::step`], unless `skipped` says the optimizer step
    /// was skipped; returns whether it advanced. A flag still on the device is read here, which
    /// waits for the device to finish the step: pass [`SkipFlag::Known`] where the host knows.
    pub fn step_unless_skipped(
        &mut self,
        optimizer: &mut dyn Optimizer,
        skipped: &SkipFlag,
    ) -> Result<bool, OptimError> {
        if skipped.read()? {
            return Ok(false);
        }
        self.step(optimizer);
        Ok(true)
    }

    /// Steps taken so far.
    pub fn last_step(&self) -> u64 {
        self.last_step
    }

    /// The rates the groups have now (PyTorch's `get_last_lr()`).
    pub fn last_lrs(&self) -> Vec<f64> {
        self.base_lrs
            .iter()
            .map(|&base| self.schedule.lr_at(base, self.last_step))
            .collect()
    }

    fn apply(&self, optimizer: &mut dyn Optimizer) {
        for (group, lr) in self.last_lrs().into_iter().enumerate() {
            optimizer.set_lr(group, lr);
        }
    }
}
