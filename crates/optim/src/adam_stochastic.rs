//! Adam and AdamW on bf16 parameters with f32 moments and stochastically rounded updates,
//! without an f32 master copy: the [`UpdateRule`] of [`AdamStochasticConfig`].
//!
//! A bf16 model trained with PyTorch's bf16 Adam loses every update smaller than half a bf16 ulp
//! of its parameter (rounded to nearest, it changes nothing), which is why mixed precision keeps
//! an f32 master copy (apex O2: 16 bytes per parameter with Adam). Rounding the updated value
//! stochastically keeps those updates on average instead; with the moments in f32 a parameter
//! costs 12 bytes (2 for it, 2 for its gradient, 4 + 4 for the moments). State per parameter:
//! [`AdamState`] with f32 tensors. One implementation, fused; the random bits are seeded and
//! counter-based ([`crate::kernels::stochastic_key`]), so a run is reproducible and the CPU and
//! CUDA kernels round alike, to the bit. This file holds the rule's pieces only; `cuda/adam.rs`
//! holds its CUDA piece.

use headroom_autograd_core::{DType, Tensor};

use crate::adam::AdamState;
use crate::driver::{host_step, Form, HostKernels};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut};
use crate::kernels::{
    adam_fused_stochastic, bf16, stochastic_key, AdamConfig, AdamStochasticBuffers,
};
use crate::optimizer::GroupOptimizer;
use crate::rule::{SavedTensors, UpdateRule};
use crate::step::{Implementation, NamedTensors, RuleCall, StepItem};

/// Adam or AdamW over bf16 parameters with stochastic rounding.
pub type AdamStochastic = GroupOptimizer<AdamStochasticConfig>;

/// Adam's hyperparameters and the seed of the rounding's random bits.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamStochasticConfig {
    /// The update (Adam or AdamW).
    pub adam: AdamConfig,
    /// Seeds the random bits: the same seed, parameters and gradients give the same bits.
    pub seed: u64,
}

impl AdamStochasticConfig {
    /// `adam` with rounding bits seeded by `seed`.
    pub fn new(adam: AdamConfig, seed: u64) -> AdamStochasticConfig {
        AdamStochasticConfig { adam, seed }
    }

    /// The key of parameter `slot`'s random stream at step `step` (`slot`: the parameter's
    /// index among the optimizer's; another engine stepping the same rule keys its streams so).
    pub fn key(&self, slot: usize, step: u64) -> u64 {
        stochastic_key(self.seed, slot as u64, step)
    }
}

impl UpdateRule for AdamStochasticConfig {
    type State = AdamState;
    const NAME: &'static str = "AdamStochastic";
    const DTYPES: &'static [DType] = &[DType::BF16];

    fn validate(&self) -> Result<(), OptimError> {
        self.adam.validate()
    }

    fn supports(&self, implementation: Implementation) -> bool {
        implementation == Implementation::Fused
    }

    fn lr(&self) -> f64 {
        self.adam.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.adam.lr = lr;
    }

    fn init_state(&self, param: &Tensor) -> Result<AdamState, OptimError> {
        let zeros = || Tensor::zeros(param.backend(), param.shape(), DType::F32);
        Ok(AdamState {
            exp_avg: zeros()?,
            exp_avg_sq: zeros()?,
            max_exp_avg_sq: self.adam.amsgrad.then(zeros).transpose()?,
        })
    }

    fn state_tensors(state: &AdamState) -> NamedTensors {
        AdamConfig::state_tensors(state)
    }

    fn host_step(&self, call: RuleCall<'_, '_, AdamState>) -> Result<(), OptimError> {
        host_step::<bf16, _>(self, call)
    }

    fn state_from_tensors(&self, saved: &mut SavedTensors) -> Result<AdamState, OptimError> {
        let shape = saved.param().shape().to_vec();
        let mut take = |name: &str| saved.take(name, &shape, DType::F32);
        Ok(AdamState {
            exp_avg: take("exp_avg")?,
            exp_avg_sq: take("exp_avg_sq")?,
            max_exp_avg_sq: match self.adam.amsgrad {
                true => Some(take("max_exp_avg_sq")?),
                false => None,
            },
        })
    }
}

impl HostKernels<bf16> for AdamStochasticConfig {
    type Buffers<'a> = (u64, usize, AdamStochasticBuffers<'a>);
    const FOREACH_KERNEL: bool = false;

    unsafe fn buffers<'a>(item: &'a StepItem<'_, AdamState>) -> Self::Buffers<'a> {
        let state = &*item.state;
        // SAFETY: forwarded from the caller (the states are this rule's f32 tensors).
        let bufs = unsafe {
            AdamStochasticBuffers {
                param: host_slice_mut(item.param),
                grad: host_slice(&item.grad),
                exp_avg: host_slice_mut(&state.exp_avg),
                exp_avg_sq: host_slice_mut(&state.exp_avg_sq),
                max_exp_avg_sq: state.max_exp_avg_sq.as_ref().map(|t| host_slice_mut(t)),
            }
        };
        (item.step, item.slot, bufs)
    }

    fn run(
        &self,
        (step, slot, bufs): Self::Buffers<'_>,
        form: Form<'_, bf16>,
    ) -> Result<(), OptimError> {
        match form {
            Form::Fused(scaling) => {
                adam_fused_stochastic(&self.adam, step, self.key(slot, step), bufs, scaling)
                    .map(drop)
            }
            Form::Single(_) => Err(OptimError::Unsupported {
                optimizer: Self::NAME,
                reason: "only the fused implementation".into(),
            }),
        }
    }
}
