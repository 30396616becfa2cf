//! What makes a configuration of optim's into an optimizer of this crate: [`CandleRule`] (the
//! name, the dtypes it steps, one parameter's update on host slices, how a saved state is
//! rebuilt), implemented by each rule's configuration, and [`candle_optimizer!`], which declares
//! the public optimizer type over one: the struct, its [`candle_nn::Optimizer`] impl and its
//! state-dict methods; and [`step_slots`], which runs a rule on every `Var` with a gradient
//! through candle's in-place op.
//!
//! It sits on `host_slices.rs` (slots, host slices) and `state_dict.rs`; it knows no rule.

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor, Var};
use half::{bf16, f16};

use crate::error::CandleOptimError;

use crate::host_slices::{param_and_grad, HostFloat, RuleState, Slot, StateLock};

/// Where a parameter's update stands: the `Var`'s index among the optimizer's and its step
/// number (from 1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepAt {
    pub(crate) index: usize,
    pub(crate) step: u64,
}

/// An update rule as a candle optimizer runs it: implemented by the rule's configuration.
pub(crate) trait CandleRule: Sync {
    /// The optimizer's name, in errors.
    const NAME: &'static str;
    /// The dtypes of the `Var`s it steps.
    const DTYPES: &'static [DType];

    /// Updates one parameter at `at` (see [`Slices`]).
    fn update<T: HostFloat>(&self, at: StepAt, slices: Slices<'_, T>) -> candle_core::Result<()>;

    /// `var`'s state rebuilt from its saved tensors, fetched by name through `get`.
    fn restore(&self, var: &Var, get: &Getter<'_>) -> candle_core::Result<Box<dyn RuleState>>;
}

/// One parameter's update in host memory: `param` is updated in place from `grad` with the
/// parameter's `state` (`None` before its first step; `host_slices::typed_state` makes it).
pub(crate) struct Slices<'a, T> {
    pub(crate) param: &'a mut [T],
    pub(crate) grad: &'a [T],
    pub(crate) state: &'a mut Option<Box<dyn RuleState>>,
}

/// A saved state's tensor by name, or the error saying it is missing.
pub(crate) type Getter<'a> = dyn Fn(&str) -> candle_core::Result<Tensor> + 'a;

/// For every slot whose `Var` has a gradient in `grads`: its step count advances, then `rule`
/// updates its buffer in place. A `Var` without a gradient is left alone and keeps its step
/// count, as PyTorch's optimizers do.
pub(crate) fn step_slots<R: CandleRule>(
    slots: &mut [Slot],
    grads: &GradStore,
    rule: &R,
) -> candle_core::Result<()> {
    for slot in slots {
        let Some(grad) = grads.get(slot.var.as_tensor()) else {
            continue;
        };
        slot.step += 1;
        let op = InPlace {
            rule,
            at: StepAt {
                index: slot.index,
                step: slot.step,
            },
            state: &slot.state,
        };
        slot.var.as_tensor().inplace_op2(grad, &op)?;
    }
    Ok(())
}

/// A rule's update of one parameter as candle's in-place op on the parameter with its gradient.
struct InPlace<'a, R> {
    rule: &'a R,
    at: StepAt,
    state: &'a StateLock,
}

impl<R: CandleRule> InPlace<'_, R> {
    fn run<T: HostFloat>(
        &self,
        param: (&mut CpuStorage, &Layout),
        grad: (&CpuStorage, &Layout),
    ) -> candle_core::Result<()> {
        let (param, grad) = param_and_grad::<T>(R::NAME, param, grad)?;
        let state = &mut self.state.lock();
        self.rule.update(self.at, Slices { param, grad, state })
    }
}

impl<R: CandleRule> InplaceOp2 for InPlace<'_, R> {
    fn name(&self) -> &'static str {
        R::NAME
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        grad: &CpuStorage,
        grad_l: &Layout,
    ) -> candle_core::Result<()> {
        let grad = (grad, grad_l);
        match dst.dtype() {
            DType::F32 => self.run::<f32>((dst, dst_l), grad),
            DType::BF16 => self.run::<bf16>((dst, dst_l), grad),
            DType::F16 => self.run::<f16>((dst, dst_l), grad),
            other => Err(CandleOptimError::Unsupported {
                optimizer: R::NAME,
                reason: format!("a {other:?} parameter"),
            }
            .into()),
        }
    }
}

/// Declares the public optimizer `$optimizer` over the [`CandleRule`] `$config`, whose learning
/// rate is the field `$lr` and whose check is the method `$check`: the struct (its `Var`s' slots
/// and the configuration), its [`candle_nn::Optimizer`] impl and the state methods
/// `state_bytes`, `var_step`, `state_dict`, `load_state_dict`, `save_state` and `load_state`.
macro_rules! candle_optimizer {
    ($(#[$doc:meta])* $optimizer:ident($config:ty), lr: $($lr:ident).+, check: $($check:ident).+ $(,)?) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $optimizer {
            slots: Vec<$crate::host_slices::Slot>,
            config: $config,
        }

        impl candle_nn::Optimizer for $optimizer {
            type Config = $config;

            fn new(vars: Vec<candle_core::Var>, config: $config) -> candle_core::Result<Self> {
                use $crate::rule::CandleRule;
                let name = <$config as CandleRule>::NAME;
                config.$($check).+().map_err($crate::error::CandleOptimError::from)?;
                let vars = $crate::host_slices::float_vars(name, vars, <$config>::DTYPES)?;
                let slots = $crate::host_slices::Slot::for_vars(vars);
                Ok($optimizer { slots, config })
            }

            fn step(
                &mut self,
                grads: &candle_core::backprop::GradStore,
            ) -> candle_core::Result<()> {
                $crate::rule::step_slots(&mut self.slots, grads, &self.config)
            }

            fn learning_rate(&self) -> f64 {
                self.config.$($lr).+
            }

            fn set_learning_rate(&mut self, lr: f64) {
                self.config.$($lr).+ = lr;
            }
        }

        impl $optimizer {
            /// The bytes of state the optimizer holds (allocated at each `Var`'s first step).
            pub fn state_bytes(&self) -> u64 {
                $crate::host_slices::state_bytes(&self.slots)
            }

            /// The number of steps the `Var` at `index` (among the float `Var`s given) has
            /// taken.
            pub fn var_step(&self, index: usize) -> Option<u64> {
                self.slots.get(index).map(|s| s.step)
            }

            /// The state as named tensors: `{index}.step` and the rule's buffers (the type's
            /// documentation names them) for each `Var` that has stepped.
            pub fn state_dict(
                &self,
            ) -> candle_core::Result<std::collections::HashMap<String, candle_core::Tensor>> {
                $crate::state_dict::state_dict(&self.slots)
            }

            /// Continues from `saved` (an earlier `state_dict` of this optimizer over the same
            /// `Var`s in the same order): step counts and buffers, checked against each `Var`'s
            /// dtype and size.
            pub fn load_state_dict(
                &mut self,
                saved: &std::collections::HashMap<String, candle_core::Tensor>,
            ) -> candle_core::Result<()> {
                $crate::state_dict::load_state_dict(&self.config, &mut self.slots, saved)
            }

            /// Writes the state dict to the safetensors file `path`.
            pub fn save_state(&self, path: impl AsRef<std::path::Path>) -> candle_core::Result<()> {
                $crate::state_dict::save(&self.state_dict()?, path.as_ref())
            }

            /// Loads the state dict from the safetensors file `path`.
            pub fn load_state(
                &mut self,
                path: impl AsRef<std::path::Path>,
            ) -> candle_core::Result<()> {
                self.load_state_dict(&$crate::state_dict::load(path.as_ref())?)
            }
        }
    };
}

pub(crate) use candle_optimizer;
