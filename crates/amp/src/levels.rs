//! apex's opt levels O0–O3 as presets: which dtype the model is in, whether ops autocast, whether
//! the optimizer keeps f32 master weights, and which loss scale applies — and [`AmpTraining`],
//! the training step a level gives.
//!
//! The table is apex's (`apex/amp/frontend.py`, `O0`…`O3` classes):
//!
//! | level | model dtype | autocast | master weights | loss scale |
//! |---|---|---|---|---|
//! | O0 (pure f32) | f32 | no | no | 1.0 static |
//! | O1 (autocast) | f32 | yes | no | dynamic |
//! | O2 (almost half) | half | no | yes | dynamic |
//! | O3 (pure half) | half | no | no | 1.0 static |
//!
//! apex's `keep_batchnorm_fp32` (O2 keeps BatchNorm in f32) has nothing to act on in Headroom's
//! models, which have LayerNorm (apex O2 casts LayerNorm to half too); it is kept as data. The
//! dynamic loss scale is this crate's [`GradScaler`] (PyTorch's semantics: 2^16, ×2 after 2000
//! clean steps, ×½ on overflow); apex's own scaler also caps the scale at 2^24, which this one
//! does not. "half" is f16 as in apex, or bf16. This module knows no kernel.

use headroom_autograd_core::{AutocastGuard, DType, Tensor};
use headroom_optim::{OptimError, Optimizer, SkipFlag};

use crate::error::AmpError;
use crate::master::MasterWeights;
use crate::policy::AmpPolicy;
use crate::scaler::{GradScaler, GradScalerConfig};

/// apex's optimization levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptLevel {
    /// Pure f32: the baseline.
    O0,
    /// Autocast with f32 weights and dynamic loss scaling (PyTorch's native AMP).
    O1,
    /// A half model with f32 master weights in the optimizer and dynamic loss scaling.
    O2,
    /// A pure half model: no master weights, no loss scaling.
    O3,
}

/// How the loss is scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossScale {
    /// A fixed scale (apex's O0 and O3 use 1.0: none).
    Static(f32),
    /// A [`GradScaler`].
    Dynamic,
}

/// What an opt level sets (apex's `Properties`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptLevelProperties {
    /// The dtype the model's parameters must have.
    pub model_dtype: DType,
    /// Whether ops run under autocast (apex's `patch_torch_functions`).
    pub autocast: bool,
    /// apex's `keep_batchnorm_fp32` (no BatchNorm here: data only).
    pub keep_batchnorm_fp32: Option<bool>,
    /// Whether the optimizer keeps f32 master weights.
    pub master_weights: bool,
    /// The loss scale.
    pub loss_scale: LossScale,
}

impl OptLevel {
    /// Every level, in order.
    pub const ALL: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];

    /// What the level sets, with `half` (F16 as in apex, or BF16) as its half dtype.
    pub fn properties(self, half: DType) -> Result<OptLevelProperties, AmpError> {
        if !matches!(half, DType::F16 | DType::BF16) {
            return Err(AmpError::NotHalf {
                what: "an opt level's half dtype",
                dtype: half,
            });
        }
        Ok(match self {
            OptLevel::O0 => OptLevelProperties {
                model_dtype: DType::F32,
                autocast: false,
                keep_batchnorm_fp32: None,
                master_weights: false,
                loss_scale: LossScale::Static(1.0),
            },
            OptLevel::O1 => OptLevelProperties {
                model_dtype: DType::F32,
                autocast: true,
                keep_batchnorm_fp32: None,
                master_weights: false,
                loss_scale: LossScale::Dynamic,
            },
            OptLevel::O2 => OptLevelProperties {
                model_dtype: half,
                autocast: false,
                keep_batchnorm_fp32: Some(true),
                master_weights: true,
                loss_scale: LossScale::Dynamic,
            },
            OptLevel::O3 => OptLevelProperties {
                model_dtype: half,
                autocast: false,
                keep_batchnorm_fp32: Some(false),
                master_weights: false,
                loss_scale: LossScale::Static(1.0),
            },
        })
    }
}

/// A training step at an opt level: the autocast scope (O1), the loss scale (O1, O2), the
/// master weights (O2), over the optimizer the caller builds.
///
/// ```
/// use headroom_amp::{AmpTraining, OptLevel};
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
///
/// let cpu = CpuBackend::new_ref();
/// let w = Tensor::full(&cpu, &[3, 4], 0.5, DType::BF16)?; // O2: the model is half
/// w.requires_grad_(true)?;
/// let mut amp = AmpTraining::new(OptLevel::O2, DType::BF16, vec![w.clone()], |masters| {
///     let groups = vec![ParamGroup::new(masters, AdamConfig::adamw())];
///     Ok(Box::new(Adam::new(groups, Implementation::Fused)?) as Box<dyn Optimizer>)
/// })?;
/// let x = Tensor::ones(&cpu, &[2, 4], DType::BF16)?;
/// let loss = {
///     let _autocast = amp.autocast(); // None at O2
///     x.linear(&w, None)?.to_dtype(DType::F32)?.sum_all()?
/// };
/// amp.backward(&loss)?;
/// let skipped = amp.step()?;
/// amp.zero_grad()?;
/// assert!(!skipped.read()?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct AmpTraining {
    level: OptLevel,
    properties: OptLevelProperties,
    policy: Option<AmpPolicy>,
    optimizer: Box<dyn Optimizer>,
    scaler: GradScaler,
}

impl std::fmt::Debug for AmpTraining {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmpTraining")
            .field("level", &self.level)
            .field("properties", &self.properties)
            .field("optimizer", &self.optimizer.name())
            .field("scaler", self.scaler.config())
            .finish_non_exhaustive()
    }
}

impl AmpTraining {
    /// The level's training step over `params` (the model's parameters, already in the level's
    /// model dtype: f32 at O0 and O1, `half` at O2 and O3), with the optimizer `build` makes —
    /// over the f32 masters at O2, over `params` otherwise.
    pub fn new(
        level: OptLevel,
        half: DType,
        params: Vec<Tensor>,
        build: impl FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>, OptimError>,
    ) -> Result<AmpTraining, AmpError> {
        let properties = level.properties(half)?;
        for (index, param) in params.iter().enumerate() {
            if param.dtype() != properties.model_dtype {
                return Err(AmpError::ParameterDType {
                    index,
                    got: param.dtype(),
                    why: format!(
                        "{level:?} trains a {:?} model (build the model with DType::{:?})",
                        properties.model_dtype, properties.model_dtype
                    ),
                });
            }
        }
        let inner: Box<dyn Optimizer> = match properties.master_weights {
            true => Box::new(MasterWeights::new(params, build)?),
            false => build(params)?,
        };
        let config = GradScalerConfig {
            enabled: properties.loss_scale == LossScale::Dynamic,
            ..GradScalerConfig::default()
        };
        let policy = match properties.autocast {
            true => Some(AmpPolicy::torch_cuda(half)?),
            false => None,
        };
        Ok(AmpTraining {
            level,
            properties,
            policy,
            optimizer: inner,
            scaler: GradScaler::new(config)?,
        })
    }

    /// The level.
    pub fn level(&self) -> OptLevel {
        self.level
    }

    /// What the level sets.
    pub fn properties(&self) -> &OptLevelProperties {
        &self.properties
    }

    /// The autocast policy (O1), if any.
    pub fn policy(&self) -> Option<&AmpPolicy> {
        self.policy.as_ref()
    }

    /// Enters the level's autocast scope for the forward (O1); `None` at other levels.
    pub fn autocast(&self) -> Option<AutocastGuard> {
        self.policy.as_ref().map(AmpPolicy::enter)
    }

    /// Backward of the loss, scaled when the level scales it.
    pub fn backward(&mut self, loss: &Tensor) -> Result<(), AmpError> {
        self.scaler.scale(loss)?.backward()?;
        Ok(())
    }

    /// The optimizer step (skipped on overflow) and the scale's update.
    pub fn step(&mut self) -> Result<SkipFlag, AmpError> {
        let skipped = self.scaler.step(self.optimizer.as_mut())?;
        self.scaler.update()?;
        Ok(skipped)
    }

    /// Drops (`set_to_none`) every gradient of the model.
    pub fn zero_grad(&self) -> Result<(), AmpError> {
        self.optimizer.zero_grad(true)?;
        Ok(())
    }

    /// The loss scaler (disabled at O0 and O3).
    pub fn scaler(&self) -> &GradScaler {
        &self.scaler
    }

    /// The optimizer the level steps (over the f32 masters at O2).
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// The scaler and the optimizer, to unscale before clipping or to step them by hand
    /// (`scaler.unscale_(optimizer)`, `scaler.step(optimizer)`, `scaler.update()`).
    pub fn scaler_and_optimizer(&mut self) -> (&mut GradScaler, &mut dyn Optimizer) {
        (&mut self.scaler, self.optimizer.as_mut())
    }
}
