//! PyTorch's `GradScaler`, with its scale, growth tracker and overflow flag kept on the device:
//! a loss-scale provider (optim's [`LossScaler`]) that any step driver takes — the plain loop
//! through [`GradScaler::step`], an optimizer in backward, a sharded optimizer — never an
//! optimizer itself, so it stacks with every one of them.
//!
//! The sequence is PyTorch's (`torch/amp/grad_scaler.py`): [`GradScaler::scale`] multiplies the
//! loss by the scale (2^16 at first); [`GradScaler::unscale_`] sets `found_inf` from the gradients
//! and multiplies them by `1 / scale`, in f32 arithmetic for f16 and bf16 gradients too (where
//! PyTorch refuses: "Attempting to unscale FP16 gradients", "not implemented for 'BFloat16'");
//! [`GradScaler::step`] steps the optimizer unless `found_inf` is set; [`GradScaler::update`]
//! halves the scale after an overflow, doubles it after 2000 clean steps (growth tracker reset
//! either way), and keeps it if the doubled scale is not finite. Misuse is a typed error:
//! unscaling twice in one step, unscaling after the step, stepping twice before an update.
//!
//! Nothing here waits for the device when the stepped optimizer takes device scaling
//! ([`Optimizer::takes_device_scaling`]: fused SGD, Adam, AdamW, 8-bit Adam): `found_inf` is
//! computed on the device without unscaling (optim's [`non_finite_check_and_unscale_`], on CUDA
//! one launch per gradient dtype whatever the number of gradients), the kernels divide each
//! gradient by the scale and skip the whole step on overflow (the device counts it, so bias
//! corrections stay right), and `update` is a handful of one-element device ops — no host read
//! in a whole step. Other optimizers get PyTorch's non-fused path: `unscale_`, then one read of
//! `found_inf` to step or skip. The step's [`SkipFlag`] — on the device, or known on the host —
//! is what an [`LrScheduler`](headroom_optim::LrScheduler) honours
//! (`step_unless_skipped`).
//!
//! The device arithmetic is exact: the new scale is `f32(f64(scale) × m)` with `m` one of the
//! backoff factor, the growth factor and 1 (selected by 0/1 flags, so no rounding), as PyTorch's
//! `amp_update_scale_` computes it; the tracker is an f32 integer (exact up to the 2^22 that
//! [`GradScalerConfig`] allows as a growth interval). This module knows no kernel: it is composed
//! of autograd-core's ops and backend primitives and optim's overflow check (which falls back to
//! autograd-core's portable `non_finite_check_` where it has no kernels), so it runs on any
//! backend.

use headroom_autograd_core::{no_grad, BinaryOp, DType, Device, Tensor};
use headroom_optim::kernels::StepOutcome;
use headroom_optim::{
    non_finite_check_and_unscale_, DeviceGradScaling, LossScaler, OptimError, Optimizer, Scaling,
    SkipFlag, StepParams,
};

use crate::error::AmpError;
use crate::state::{read_state, write_state};

/// The largest growth interval: the growth tracker is an f32 integer on the device, compared
/// exactly below 2^23.
pub const MAX_GROWTH_INTERVAL: u32 = 1 << 22;

/// A GradScaler's settings (PyTorch's constructor arguments).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The scale at the first step (PyTorch: 2^16).
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` clean steps (2.0); above 1.
    pub growth_factor: f64,
    /// Multiplies the scale after an overflow (0.5); in (0, 1).
    pub backoff_factor: f64,
    /// Clean steps between growths (2000); 1 to [`MAX_GROWTH_INTERVAL`].
    pub growth_interval: u32,
    /// With `false` every call passes through: no scaling, no checks.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    /// PyTorch's defaults.
    fn default() -> GradScalerConfig {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    /// Checks the ranges (PyTorch asserts the first two).
    pub fn validate(&self) -> Result<(), AmpError> {
        let bad = |reason: String| Err(AmpError::InvalidScalerConfig { reason });
        if !(self.growth_factor > 1.0 && self.growth_factor.is_finite()) {
            return bad(format!(
                "the growth factor must be above 1, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(format!(
                "the backoff factor must be in (0, 1), got {}",
                self.backoff_factor
            ));
        }
        if !(1..=MAX_GROWTH_INTERVAL).contains(&self.growth_interval) {
            return bad(format!(
                "the growth interval must be 1 to {MAX_GROWTH_INTERVAL}, got {}",
                self.growth_interval
            ));
        }
        check_scale("the initial scale", self.init_scale)
    }
}

/// Checks a scale that enters the device from the host (the settings, [`GradScaler::update_to`],
/// a loaded state): the f32 it becomes must be positive and normal. Zero would turn every
/// parameter into NaN in one step; a subnormal scale's inverse overflows to infinity.
fn check_scale(what: &str, scale: f64) -> Result<(), AmpError> {
    let as_f32 = scale as f32;
    if as_f32 > 0.0 && as_f32.is_normal() {
        return Ok(());
    }
    Err(AmpError::InvalidScalerConfig {
        reason: format!(
            "{what} must be a positive normal f32 ({:e} to {:e}), got {scale:e} (as f32: {as_f32:e})",
            f32::MIN_POSITIVE,
            f32::MAX
        ),
    })
}

/// A GradScaler's state: PyTorch's `state_dict()` keys (`scale`, `growth_factor`,
/// `backoff_factor`, `growth_interval`, `_growth_tracker`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerState {
    /// The current scale.
    pub scale: f32,
    /// The growth factor.
    pub growth_factor: f64,
    /// The backoff factor.
    pub backoff_factor: f64,
    /// The growth interval.
    pub growth_interval: u32,
    /// Clean steps since the scale last changed.
    pub growth_tracker: u32,
}

/// Where the current step is (PyTorch's per-optimizer `OptState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Ready,
    Unscaled,
    Stepped,
}

/// PyTorch's GradScaler: PyTorch's sequence in the plain loop, `scaler.scale(&loss)?.backward()`,
/// optionally `scaler.unscale_(&optimizer)` (to clip), `scaler.step(&mut optimizer)`,
/// `scaler.update()`; or a [`LossScaler`] handed to another step driver (hooks'
/// `InBackward::backward_scaled`, which runs the same sequence inside backward). One scaler
/// serves one optimizer's steps.
///
/// ```
/// use headroom_amp::{GradScaler, GradScalerConfig};
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{Implementation, ParamGroup, Sgd, SgdConfig};
///
/// let cpu = CpuBackend::new_ref();
/// let p = Tensor::ones(&cpu, &[4], DType::F32)?;
/// p.requires_grad_(true)?;
/// let sgd = Sgd::new(vec![ParamGroup::new(vec![p.clone()], SgdConfig::new(0.1))], Implementation::Fused)?;
/// let mut sgd = sgd;
/// let mut scaler = GradScaler::new(GradScalerConfig::default())?;
///
/// let loss = p.sum_all()?;
/// scaler.scale(&loss)?.backward()?; // gradients of 65536 · loss
/// let skipped = scaler.step(&mut sgd)?; // the fused kernel divides by the scale
/// scaler.update()?;
/// assert!(!skipped.read()?);
/// assert_eq!(p.to_vec::<f32>()?, vec![0.9f32; 4]);
/// assert_eq!(scaler.get_scale()?, 65536.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct GradScaler {
    config: GradScalerConfig,
    /// The scale, `[]` f32 on the loss's device (created by the first `scale`).
    scale: Option<Tensor>,
    /// Clean steps since the last change, `[]` f32 beside the scale.
    growth_tracker: Option<Tensor>,
    /// The current step's overflow flag, `[1]` f32, once checked.
    found_inf: Option<Tensor>,
    stage: Stage,
    /// A state loaded before the scale existed, applied when it is created.
    loaded: Option<GradScalerState>,
    last_skip: Option<SkipFlag>,
}

impl GradScaler {
    /// A scaler with `config` (checked settings).
    pub fn new(config: GradScalerConfig) -> Result<GradScaler, AmpError> {
        config.validate()?;
        Ok(GradScaler {
            config,
            scale: None,
            growth_tracker: None,
            found_inf: None,
            stage: Stage::Ready,
            loaded: None,
            last_skip: None,
        })
    }

    /// The settings.
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// Whether the scaler scales at all.
    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    /// The scale tensor (`[]` f32 on the device), once [`GradScaler::scale`] created it.
    pub fn scale_tensor(&self) -> Option<&Tensor> {
        self.scale.as_ref()
    }

    /// The current step's overflow flag (`[1]` f32 on the device, 1 on overflow), once the
    /// gradients were checked (by `unscale_` or `step`).
    pub fn found_inf(&self) -> Option<&Tensor> {
        self.found_inf.as_ref()
    }

    /// Whether the last [`GradScaler::step`] was skipped, as it knows it (what a scheduler
    /// honours); `None` before the first step.
    pub fn last_skip(&self) -> Option<&SkipFlag> {
        self.last_skip.as_ref()
    }

    /// `loss × scale` in f32 (a bf16 or f16 loss is cast first, so the product cannot overflow
    /// the loss's own dtype); the scale is created on the loss's device at the first call. With
    /// the scaler disabled, the loss itself.
    pub fn scale(&mut self, loss: &Tensor) -> Result<Tensor, AmpError> {
        if !self.config.enabled {
            return Ok(loss.clone());
        }
        let scale = self.scale_on(loss)?;
        Ok(loss.to_dtype(DType::F32)?.mul(&scale)?)
    }

    /// The scale, created on `like`'s backend (from a loaded state, else the settings).
    fn scale_on(&mut self, like: &Tensor) -> Result<Tensor, AmpError> {
        if let Some(scale) = &self.scale {
            return Ok(scale.clone());
        }
        let (scale, tracker) = match self.loaded.take() {
            Some(state) => (f64::from(state.scale), f64::from(state.growth_tracker)),
            None => (self.config.init_scale, 0.0),
        };
        let backend = like.backend();
        let scale = Tensor::full(backend, &[], f64::from(scale as f32), DType::F32)?;
        self.growth_tracker = Some(Tensor::full(backend, &[], tracker, DType::F32)?);
        self.scale = Some(scale.clone());
        Ok(scale)
    }

    fn scale_or_err(&self) -> Result<Tensor, AmpError> {
        self.scale.clone().ok_or(AmpError::NotScaled)
    }

    /// The gradients of `optimizer`'s parameters.
    fn grads(optimizer: &dyn Optimizer) -> Vec<Tensor> {
        optimizer
            .params()
            .iter()
            .filter_map(|(_, param)| param.grad())
            .collect()
    }

    /// Unscales the gradients in place (× `1 / scale`, with `1 / scale` computed in f64 and
    /// rounded to f32, as PyTorch does) and records in `found_inf` whether any was NaN or
    /// infinite before unscaling. f16 and bf16 gradients are widened to f32, multiplied, and
    /// rounded back once. Call it at most once per step, before `step` (to clip, say), with the
    /// optimizer `step` will step.
    pub fn unscale_(&mut self, optimizer: &dyn Optimizer) -> Result<(), AmpError> {
        if !self.config.enabled {
            return Ok(());
        }
        match self.stage {
            Stage::Unscaled => return Err(AmpError::AlreadyUnscaled),
            Stage::Stepped => return Err(AmpError::UnscaleAfterStep),
            Stage::Ready => {}
        }
        let scale = self.scale_or_err()?;
        let _no_grad = no_grad();
        let grads = GradScaler::grads(optimizer);
        let found_inf = Tensor::zeros(scale.backend(), &[1], DType::F32)?;
        let inv_scale = Tensor::ones(scale.backend(), &[], DType::F64)?
            .div(&scale.to_dtype(DType::F64)?)?
            .to_dtype(DType::F32)?;
        non_finite_check_and_unscale_(&grads, &found_inf, Some(&inv_scale))?;
        self.found_inf = Some(found_inf);
        self.stage = Stage::Unscaled;
        Ok(())
    }

    /// Steps `optimizer` unless the gradients overflowed, and says whether it was skipped.
    /// With device scaling the kernels unscale and skip (the flag stays on the device, nothing
    /// waits); otherwise the gradients are unscaled (unless `unscale_` did it) and the flag is
    /// read once, as PyTorch's non-fused path does.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<SkipFlag, AmpError> {
        if !self.config.enabled {
            optimizer.step()?;
            return Ok(SkipFlag::Known(false));
        }
        if self.stage == Stage::Stepped {
            return Err(AmpError::StepTwice);
        }
        let scale = self.scale_or_err()?;
        let flag = if optimizer.takes_device_scaling() {
            let grad_scale = match self.stage {
                Stage::Ready => {
                    let _no_grad = no_grad();
                    let found_inf = Tensor::zeros(scale.backend(), &[1], DType::F32)?;
                    non_finite_check_and_unscale_(&GradScaler::grads(optimizer), &found_inf, None)?;
                    self.found_inf = Some(found_inf);
                    Some(scale)
                }
                // The gradients are unscaled already: only the flag.
                Stage::Unscaled | Stage::Stepped => None,
            };
            let found_inf = self
                .found_inf
                .clone()
                .expect("checked above or by unscale_");
            let scaling = DeviceGradScaling {
                grad_scale,
                found_inf: Some(found_inf.clone()),
            };
            let outcome = optimizer.step_with(StepParams::All, Scaling::Device(&scaling))?;
            match found_inf.device() {
                // The host kernels read the flag in place: the outcome says it.
                Device::Cpu => SkipFlag::Known(outcome == StepOutcome::Skipped),
                Device::Cuda(_) => SkipFlag::OnDevice(found_inf),
            }
        } else {
            if self.stage == Stage::Ready {
                self.unscale_(optimizer)?;
            }
            let found_inf = self.found_inf.as_ref().expect("set by unscale_");
            let skipped = found_inf.item()? != 0.0;
            if !skipped {
                optimizer.step_with(StepParams::All, Scaling::None)?;
            }
            SkipFlag::Known(skipped)
        };
        self.stage = Stage::Stepped;
        self.last_skip = Some(flag.clone());
        Ok(flag)
    }

    /// Updates the scale from this step's overflow flag: × backoff after an overflow (tracker
    /// reset), else the tracker counts the step and, at the growth interval, the scale grows by
    /// the growth factor where the result is finite (tracker reset). On the device, without
    /// waiting for it.
    pub fn update(&mut self) -> Result<(), AmpError> {
        if !self.config.enabled {
            return Ok(());
        }
        let found_inf = self.found_inf.take().ok_or(AmpError::UpdateWithoutCheck)?;
        let (Some(scale), Some(tracker)) = (&self.scale, &self.growth_tracker) else {
            return Err(AmpError::NotScaled);
        };
        update_scale(scale, tracker, &found_inf, &self.config)?;
        self.stage = Stage::Ready;
        Ok(())
    }

    /// Sets the scale to `new_scale` instead of updating it (PyTorch's `update(new_scale)`); the
    /// growth tracker is left as it is.
    pub fn update_to(&mut self, new_scale: f32) -> Result<(), AmpError> {
        if !self.config.enabled {
            return Ok(());
        }
        let scale = self.scale_or_err()?;
        check_scale("a new scale", f64::from(new_scale))?;
        scale.backend().fill(scale.view(), f64::from(new_scale))?;
        self.found_inf = None;
        self.stage = Stage::Ready;
        Ok(())
    }

    /// The current scale (one host read; the initial scale before the first `scale`, 1 when
    /// disabled).
    pub fn get_scale(&self) -> Result<f32, AmpError> {
        Ok(self.state()?.scale)
    }

    /// The state, as PyTorch's `state_dict()` (reads the scale and tracker from the device).
    pub fn state(&self) -> Result<GradScalerState, AmpError> {
        let (scale, growth_tracker) = match (&self.scale, &self.growth_tracker, &self.loaded) {
            _ if !self.config.enabled => (1.0, 0),
            (Some(scale), Some(tracker), _) => (scale.item()? as f32, tracker.item()? as u32),
            (_, _, Some(loaded)) => (loaded.scale, loaded.growth_tracker),
            _ => (self.config.init_scale as f32, 0),
        };
        Ok(GradScalerState {
            scale,
            growth_factor: self.config.growth_factor,
            backoff_factor: self.config.backoff_factor,
            growth_interval: self.config.growth_interval,
            growth_tracker,
        })
    }

    /// Restores a state (its factors and interval too); applied to the device tensors now, or
    /// when the first `scale` creates them.
    pub fn load_state(&mut self, state: GradScalerState) -> Result<(), AmpError> {
        let config = GradScalerConfig {
            growth_factor: state.growth_factor,
            backoff_factor: state.backoff_factor,
            growth_interval: state.growth_interval,
            init_scale: f64::from(state.scale),
            ..self.config
        };
        config.validate()?;
        if state.growth_tracker > MAX_GROWTH_INTERVAL {
            return Err(AmpError::InvalidScalerConfig {
                reason: format!(
                    "the growth tracker must be at most {MAX_GROWTH_INTERVAL} (it is an f32 \
                     integer on the device), got {}",
                    state.growth_tracker
                ),
            });
        }
        self.config = config;
        match (&self.scale, &self.growth_tracker) {
            (Some(scale), Some(tracker)) => {
                scale.backend().fill(scale.view(), f64::from(state.scale))?;
                tracker
                    .backend()
                    .fill(tracker.view(), f64::from(state.growth_tracker))?;
            }
            _ => self.loaded = Some(state),
        }
        self.found_inf = None;
        self.stage = Stage::Ready;
        Ok(())
    }
}

/// 1 where `x > 0`, else 0 (also for NaN): the backend's relu-gradient primitive on ones.
fn positive(x: &Tensor) -> Result<Tensor, AmpError> {
    let ones = Tensor::ones(x.backend(), x.shape(), x.dtype())?;
    let res = Tensor::empty(x.backend(), x.shape(), x.dtype())?;
    x.backend()
        .binary(BinaryOp::ReluBackward, ones.view(), x.view(), res.view())?;
    Ok(res)
}

/// PyTorch's `_amp_update_scale_` on the device: `scale` and `tracker` (`[]` f32) updated in
/// place from `found_inf` (0 or 1).
fn update_scale(
    scale: &Tensor,
    tracker: &Tensor,
    found_inf: &Tensor,
    config: &GradScalerConfig,
) -> Result<(), AmpError> {
    let _no_grad = no_grad();
    let found = found_inf.reshape(&[])?;
    let clean = found.neg()?.add_scalar(1.0)?;
    // The tracker counts clean steps; it reaches the interval exactly (integers below 2^23).
    let counted = tracker.add_scalar(1.0)?.mul(&clean)?;
    let due = positive(&counted.add_scalar(0.5 - f64::from(config.growth_interval))?)?;
    let new_tracker = counted.mul(&due.neg()?.add_scalar(1.0)?)?;
    // The grown scale as PyTorch rounds it (f32 of the f64 product), kept only if finite:
    // `0 · x` is 0 for finite x and NaN otherwise, and NaN is not positive.
    let scale64 = scale.to_dtype(DType::F64)?;
    let grown = scale64
        .mul_scalar(config.growth_factor)?
        .to_dtype(DType::F32)?;
    let finite = positive(&grown.mul_scalar(0.0)?.neg()?.add_scalar(0.5)?)?;
    let grows = due.mul(&finite)?.to_dtype(DType::F64)?;
    let found64 = found.to_dtype(DType::F64)?;
    // m = found·backoff + grows·growth + (1 − found − grows): one term is non-zero, exactly.
    let factor = found64
        .mul_scalar(config.backoff_factor)?
        .add(&grows.mul_scalar(config.growth_factor)?)?
        .add(&found64.add(&grows)?.neg()?.add_scalar(1.0)?)?;
    let new_scale = scale64.mul(&factor)?.to_dtype(DType::F32)?;
    scale.copy_(&new_scale)?;
    tracker.copy_(&new_tracker)?;
    Ok(())
}

/// The provider side: what an optimizer in backward or any other step driver asks of a scaler.
impl LossScaler for GradScaler {
    fn scale_loss(&mut self, loss: &Tensor) -> Result<Tensor, OptimError> {
        Ok(self.scale(loss)?)
    }

    /// The scale and a zeroed flag beside it. Refused when the step is already open (unscaled
    /// or stepped and not updated) or nothing was scaled yet.
    fn begin_step(&mut self) -> Result<Option<DeviceGradScaling>, OptimError> {
        if !self.config.enabled {
            return Ok(None);
        }
        match self.stage {
            Stage::Unscaled => return Err(AmpError::AlreadyUnscaled.into()),
            Stage::Stepped => return Err(AmpError::StepTwice.into()),
            Stage::Ready => {}
        }
        let scale = self.scale_or_err()?;
        let found_inf = Tensor::zeros(scale.backend(), &[1], DType::F32).map_err(AmpError::from)?;
        self.found_inf = Some(found_inf.clone());
        self.stage = Stage::Stepped;
        Ok(Some(DeviceGradScaling {
            grad_scale: Some(scale),
            found_inf: Some(found_inf),
        }))
    }

    fn end_step(&mut self, scaling: &DeviceGradScaling) -> Result<(), OptimError> {
        if !self.config.enabled {
            return Ok(());
        }
        let open = self.found_inf.as_ref();
        let same = match (open, scaling.found_inf.as_ref()) {
            (Some(open), Some(given)) => open.same_tensor(given),
            _ => false,
        };
        if !same {
            return Err(AmpError::UpdateWithoutCheck.into());
        }
        let found_inf = scaling.found_inf.clone().expect("compared above");
        self.last_skip = Some(match found_inf.device() {
            Device::Cpu => SkipFlag::Known(found_inf.item().map_err(AmpError::from)? != 0.0),
            Device::Cuda(_) => SkipFlag::OnDevice(found_inf),
        });
        Ok(self.update()?)
    }
}

impl GradScaler {
    /// `optimizer`'s state dict with the scaler's state in its metadata (`grad_scaler.*`, the
    /// keys of PyTorch's `GradScaler.state_dict()`), one file for both.
    pub fn state_dict(&self, optimizer: &dyn Optimizer) -> Result<Vec<u8>, AmpError> {
        let inner = optimizer.state_dict()?;
        let state = self.state()?;
        let metadata = [
            ("grad_scaler.scale", format!("{:?}", state.scale)),
            (
                "grad_scaler.growth_factor",
                format!("{:?}", state.growth_factor),
            ),
            (
                "grad_scaler.backoff_factor",
                format!("{:?}", state.backoff_factor),
            ),
            (
                "grad_scaler.growth_interval",
                state.growth_interval.to_string(),
            ),
            (
                "grad_scaler._growth_tracker",
                state.growth_tracker.to_string(),
            ),
        ];
        write_state(&inner, &metadata, Vec::new())
    }

    /// Restores what [`GradScaler::state_dict`] saved: `optimizer`'s state and the scaler's.
    pub fn load_state_dict(
        &mut self,
        optimizer: &mut dyn Optimizer,
        bytes: &[u8],
    ) -> Result<(), AmpError> {
        let saved = read_state(bytes, "grad_scaler.")?;
        let get = |key: &str| -> Result<String, AmpError> {
            saved
                .metadata
                .get(&format!("grad_scaler.{key}"))
                .cloned()
                .ok_or_else(|| AmpError::StateDict(format!("no grad_scaler.{key}")))
        };
        let parse = |key: &str| -> Result<f64, AmpError> {
            get(key)?
                .parse::<f64>()
                .map_err(|e| AmpError::StateDict(format!("grad_scaler.{key}: {e}")))
        };
        let state = GradScalerState {
            scale: parse("scale")? as f32,
            growth_factor: parse("growth_factor")?,
            backoff_factor: parse("backoff_factor")?,
            growth_interval: parse("growth_interval")? as u32,
            growth_tracker: parse("_growth_tracker")? as u32,
        };
        optimizer.load_state_dict(&saved.inner)?;
        self.load_state(state)
    }
}
