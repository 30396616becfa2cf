//! What the optimizers share: each one's per-`Var` [`Slot`] with its state of the parameter's
//! element type; a parameter and its gradient as host slices of that type; and
//! the checks that keep the optimizers to what they can step.
//!
//! It sits on candle's CPU storage, layouts and in-place ops; it knows nothing of the update
//! rules.

use std::any::Any;

use candle_core::{CpuStorage, DType, Layout, Tensor, Var, WithDType};
use half::{bf16, f16};
use headroom_optim::kernels::ParamElement;
use parking_lot::Mutex;

use crate::error::CandleOptimError;

/// A float element both candle and optim's kernels take: f32, bf16, f16.
pub(crate) trait HostFloat: ParamElement + WithDType {
    /// The storage's vector when it holds this type.
    fn vec_mut(storage: &mut CpuStorage) -> Option<&mut Vec<Self>>;
    /// `values` as bf16, when this type is bf16 (for the kernels that take bf16 only).
    fn as_bf16(values: &mut [Self]) -> Option<&mut [bf16]>;
    /// `values` as bf16, when this type is bf16.
    fn as_bf16_ref(values: &[Self]) -> Option<&[bf16]>;
}

macro_rules! host_float {
    ($ty:ty, $variant:ident, $bf16:expr, $bf16_ref:expr) => {
        impl HostFloat for $ty {
            fn vec_mut(storage: &mut CpuStorage) -> Option<&mut Vec<$ty>> {
                match storage {
                    CpuStorage::$variant(values) => Some(values),
                    _ => None,
                }
            }
            fn as_bf16(values: &mut [$ty]) -> Option<&mut [bf16]> {
                $bf16(values)
            }
            fn as_bf16_ref(values: &[$ty]) -> Option<&[bf16]> {
                $bf16_ref(values)
            }
        }
    };
}

host_float!(f32, F32, |_| None, |_| None);
host_float!(bf16, BF16, Some, Some);
host_float!(f16, F16, |_| None, |_| None);

/// The contiguous range of `layout`, or candle's error saying the optimizer needs one.
fn range(optimizer: &'static str, layout: &Layout) -> candle_core::Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| {
        CandleOptimError::Unsupported {
            optimizer,
            reason: "a non-contiguous parameter or gradient; step contiguous Vars".into(),
        }
        .into()
    })
}

/// The parameter's elements in `param` and its gradient's in `grad`, as slices of `T`.
pub(crate) fn param_and_grad<'a, T: HostFloat>(
    optimizer: &'static str,
    (param, param_layout): (&'a mut CpuStorage, &Layout),
    (grad, grad_layout): (&'a CpuStorage, &Layout),
) -> candle_core::Result<(&'a mut [T], &'a [T])> {
    let (p0, p1) = range(optimizer, param_layout)?;
    let (g0, g1) = range(optimizer, grad_layout)?;
    let grad = &grad.as_slice::<T>()?[g0..g1];
    let param = T::vec_mut(param).ok_or_else(|| CandleOptimError::Unsupported {
        optimizer,
        reason: format!("a parameter that is not {:?}", <T as WithDType>::DTYPE),
    })?;
    Ok((&mut param[p0..p1], grad))
}

/// `vars` without the ones no float optimizer steps (candle's own optimizers skip non-float
/// `Var`s too); a `Var` off the CPU is an error.
pub(crate) fn float_vars(
    optimizer: &'static str,
    vars: Vec<Var>,
    dtypes: &[DType],
) -> Result<Vec<Var>, CandleOptimError> {
    let mut kept = Vec::new();
    for var in vars {
        if !var.dtype().is_float() {
            continue;
        }
        if !var.device().is_cpu() {
            return Err(CandleOptimError::Unsupported {
                optimizer,
                reason: format!(
                    "a Var on {:?}: this crate steps CPU Vars; for CUDA Vars use the \
                     optimizer of the same name in headroom-candle-cuda",
                    var.device().location()
                ),
            });
        }
        if !dtypes.contains(&var.dtype()) {
            return Err(CandleOptimError::Unsupported {
                optimizer,
                reason: format!("a {:?} Var; this optimizer takes {dtypes:?}", var.dtype()),
            });
        }
        kept.push(var);
    }
    Ok(kept)
}

/// A `Var`'s optimizer state, of the type the optimizer keeps for its element type; `None`
/// before its first step.
pub(crate) type StateLock = Mutex<Option<Box<dyn RuleState>>>;

/// One parameter's state of some rule: its tensors by name for a state dict, its bytes.
pub(crate) trait RuleState: Any + Send + std::fmt::Debug {
    /// The state's buffers as CPU tensors, by PyTorch's names (`exp_avg`, `momentum_buffer`...).
    fn tensors(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>>;
    /// The bytes it holds.
    fn bytes(&self) -> u64;
    /// Itself, to be downcast to the rule's type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// One `Var` of an optimizer: the `Var`, its index among the optimizer's, its state (allocated at
/// its first step, of a type the optimizer picks for the parameter's element type) and how many
/// steps it has taken.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) var: Var,
    pub(crate) index: usize,
    pub(crate) state: StateLock,
    pub(crate) step: u64,
}

impl Slot {
    /// Slots for `vars`, in order, without state.
    pub(crate) fn for_vars(vars: Vec<Var>) -> Vec<Slot> {
        vars.into_iter()
            .enumerate()
            .map(|(index, var)| Slot {
                var,
                index,
                state: Mutex::new(None),
                step: 0,
            })
            .collect()
    }
}

/// `state`'s value of type `S`, made by `fresh` at the first step; an error if the `Var` changed
/// its element type since (its state is of another type).
pub(crate) fn typed_state<'a, S: RuleState>(
    optimizer: &'static str,
    state: &'a mut Option<Box<dyn RuleState>>,
    fresh: impl FnOnce() -> S,
) -> candle_core::Result<&'a mut S> {
    state
        .get_or_insert_with(|| Box::new(fresh()))
        .as_any_mut()
        .downcast_mut::<S>()
        .ok_or_else(|| {
            CandleOptimError::Unsupported {
                optimizer,
                reason: "a Var whose dtype changed after its first step".into(),
            }
            .into()
        })
}

/// A state buffer as a 1-d CPU tensor.
pub(crate) fn host_tensor<T: WithDType>(values: &[T]) -> candle_core::Result<Tensor> {
    Tensor::from_slice(values, values.len(), &candle_core::Device::Cpu)
}

/// The bytes of the optimizers' states over `slots`.
pub(crate) fn state_bytes(slots: &[Slot]) -> u64 {
    slots
        .iter()
        .map(|slot| slot.state.lock().as_deref().map_or(0, RuleState::bytes))
        .sum()
}
