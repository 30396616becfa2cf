//! What a rule is to the optimizer: [`UpdateRule`] (its hyperparameters, per-parameter state and
//! host entry) with [`CudaKernels`] (its CUDA entry), and the state-dict view a rule rebuilds its
//! state from ([`SavedTensors`]).
//!
//! The optimizer calls a rule through these traits only — [`UpdateRule::host_step`] on the host,
//! [`CudaKernels`]`::cuda_step` on a CUDA device ([`StepDevice`](crate::StepDevice) picks one) —
//! so go-to-definition leads from a step to every rule's entry. A rule of this crate implements
//! `UpdateRule` in its front end (`sgd.rs`, `adam.rs`, ...: its state, and its host entry
//! calling the shared host driver, `driver.rs`) and `CudaKernels` in its CUDA piece (`cuda/`). A
//! rule of the user's own is an [`ElementwiseRule`](crate::ElementwiseRule), which gets both
//! through blanket implementations.
//!
//! It sits on the step vocabulary (`step.rs`) and, with the `cuda` feature, names the CUDA
//! device a CUDA entry launches on (`cuda/launch.rs`); it knows no algorithm.

use std::collections::HashMap;

use headroom_autograd_core::{DType, Tensor};

use crate::error::OptimError;
use crate::step::{Implementation, NamedTensors, RuleCall};

/// One algorithm: its hyperparameters (the implementing type), its per-parameter state, and
/// its entries on each device — [`UpdateRule::host_step`] here, [`CudaKernels`]`::cuda_step` (a
/// supertrait) on CUDA.
///
/// Implemented by this crate's rules (SGD, Adam, Adafactor, 8-bit and 4-bit Adam,
/// stochastic-rounding Adam) and, through a blanket implementation, by every
/// [`ElementwiseRule`](crate::ElementwiseRule): a rule of your own implements that trait (its
/// per-element update), not this one, whose entries take this crate's step types. Code outside
/// names `UpdateRule` as a bound (`fn run<R: UpdateRule>(config: R)`).
pub trait UpdateRule:
    Clone + std::fmt::Debug + Send + 'static + CudaKernels<<Self as UpdateRule>::State>
{
    /// The per-parameter state.
    type State: std::fmt::Debug + Send;
    /// Name used in errors and state dicts.
    const NAME: &'static str;
    /// The parameter dtypes the rule takes (the first is named in the error for any other);
    /// gradients are of the parameter's dtype.
    const DTYPES: &'static [DType];

    /// Checks the hyperparameters.
    fn validate(&self) -> Result<(), OptimError>;
    /// Whether the rule has this implementation (all of them unless the rule says otherwise).
    fn supports(&self, implementation: Implementation) -> bool {
        let _ = implementation;
        true
    }
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate.
    fn set_lr(&mut self, lr: f64);
    /// Fresh state for `param`, on its device.
    fn init_state(&self, param: &Tensor) -> Result<Self::State, OptimError>;
    /// The state's tensors by name.
    fn state_tensors(state: &Self::State) -> NamedTensors;
    /// State rebuilt from a state dict's tensors of one parameter.
    fn state_from_tensors(&self, saved: &mut SavedTensors) -> Result<Self::State, OptimError>;
    /// One call of the rule's kernels on the host, over tensors the optimizer checked (host
    /// memory, contiguous, disjoint, of the call's one dtype among [`UpdateRule::DTYPES`]) and
    /// claimed for the step.
    fn host_step(&self, call: RuleCall<'_, '_, Self::State>) -> Result<(), OptimError>;
}

/// A rule's CUDA entry for its state `S`: one call of its kernels on a CUDA device, and whether
/// they read a GradScaler's device tensors. A supertrait of [`UpdateRule`], implemented in the
/// rule's CUDA piece (`cuda/sgd.rs`, `cuda/adam.rs`, ...), so the front end that defines the
/// state knows nothing of CUDA.
#[cfg(feature = "cuda")]
pub trait CudaKernels<S> {
    /// Whether the kernels read a [`DeviceGradScaling`](crate::DeviceGradScaling) (else the
    /// optimizer refuses one on a CUDA device).
    const READS_DEVICE_SCALING: bool = true;

    /// One call on `device`, over tensors the optimizer checked (of the device's backend,
    /// contiguous, disjoint, of one dtype the rule takes).
    fn cuda_step(
        &self,
        device: &mut crate::cuda::launch::CudaDevice,
        call: RuleCall<'_, '_, S>,
    ) -> Result<(), OptimError>;
}

/// Without the `cuda` feature a rule has no CUDA entry to supply: every type has this one.
#[cfg(not(feature = "cuda"))]
pub trait CudaKernels<S> {}

#[cfg(not(feature = "cuda"))]
impl<R, S> CudaKernels<S> for R {}

/// The [`UpdateRule`] items every rule of this crate spells the same way: its name, the dtypes
/// it takes, its config's own `validate`, the learning rate in its config's `lr` field, and its
/// host entry — `host_step_floats` for a rule of f32, bf16 and f16 parameters, `host_step::<T,
/// _>` for one element type (`driver.rs`).
macro_rules! rule_items {
    (name: $name:literal, dtypes: $dtypes:expr, host: $host:expr) => {
        const NAME: &'static str = $name;
        const DTYPES: &'static [headroom_autograd_core::DType] = $dtypes;

        fn validate(&self) -> Result<(), $crate::error::OptimError> {
            Self::validate(self)
        }

        fn lr(&self) -> f64 {
            self.lr
        }

        fn set_lr(&mut self, lr: f64) {
            self.lr = lr;
        }

        fn host_step(
            &self,
            call: $crate::step::RuleCall<'_, '_, Self::State>,
        ) -> Result<(), $crate::error::OptimError> {
            $host(self, call)
        }
    };
}

pub(crate) use rule_items;

/// One parameter's saved state tensors by name, already on the parameter's backend; its rule
/// takes them one by one as it rebuilds the state ([`UpdateRule::state_from_tensors`]).
#[derive(Debug)]
pub struct SavedTensors {
    param: Tensor,
    tensors: HashMap<String, Tensor>,
}

impl SavedTensors {
    /// The saved `tensors` of `param`'s state.
    pub(crate) fn new(param: Tensor, tensors: HashMap<String, Tensor>) -> SavedTensors {
        SavedTensors { param, tensors }
    }

    /// The parameter whose state this is.
    pub(crate) fn param(&self) -> &Tensor {
        &self.param
    }

    /// Takes tensor `name`, which must be of `dtype` and `shape`.
    pub(crate) fn take(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor, OptimError> {
        let tensor = self
            .tensors
            .remove(name)
            .ok_or_else(|| OptimError::StateDict(format!("missing {name}")))?;
        if tensor.shape() != shape || tensor.dtype() != dtype {
            return Err(OptimError::StateDict(format!(
                "{name} is {:?} {:?}, expected {dtype:?} {shape:?}",
                tensor.dtype(),
                tensor.shape()
            )));
        }
        Ok(tensor)
    }

    /// Takes tensor `name`, which must be of the parameter's dtype and shape.
    pub(crate) fn take_like(&mut self, name: &str) -> Result<Tensor, OptimError> {
        let (shape, dtype) = (self.param.shape().to_vec(), self.param.dtype());
        self.take(name, &shape, dtype)
    }

    /// Takes tensor `name` like [`SavedTensors::take_like`] when `kept` (an optional state).
    pub(crate) fn take_like_if(
        &mut self,
        kept: bool,
        name: &str,
    ) -> Result<Option<Tensor>, OptimError> {
        kept.then(|| self.take_like(name)).transpose()
    }
}
