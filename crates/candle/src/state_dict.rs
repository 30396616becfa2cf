//! Optimizer state as named candle tensors, and as safetensors files: for the `Var` at `index`
//! (among the optimizer's float `Var`s, in the order given), `{index}.step` (an i64 scalar) and
//! `{index}.{name}` for each of its state buffers (`exp_avg`, `momentum_buffer`, `state1`...), as
//! PyTorch's `state_dict()["state"]` keys them; a `Var` that has not stepped has no entry.
//!
//! It sits on `host_slices.rs`' slots and candle's safetensors; each rule rebuilds its own state
//! from its tensors.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor, Var, WithDType};

use crate::error::CandleOptimError;
use crate::host_slices::{RuleState, Slot};

/// How a rule rebuilds one `Var`'s state from its saved tensors (fetched by name).
pub(crate) type Restore<'a> = dyn Fn(
        &Var,
        &dyn Fn(&str) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Box<dyn RuleState>>
    + 'a;

/// The state dict of `slots`.
pub(crate) fn state_dict(slots: &[Slot]) -> candle_core::Result<HashMap<String, Tensor>> {
    let mut dict = HashMap::new();
    for slot in slots {
        let state = slot.state.lock();
        let Some(state) = state.as_deref() else {
            continue;
        };
        let step = Tensor::new(slot.step as i64, &Device::Cpu)?;
        dict.insert(format!("{}.step", slot.index), step);
        for (name, tensor) in state.tensors()? {
            dict.insert(format!("{}.{name}", slot.index), tensor);
        }
    }
    Ok(dict)
}

/// Replaces the state of `slots` by `saved`'s (a `Var` without entries starts afresh), each
/// rebuilt by `restore`; an entry for no `Var` of the optimizer is an error.
pub(crate) fn load_state_dict(
    optimizer: &'static str,
    slots: &mut [Slot],
    saved: &HashMap<String, Tensor>,
    restore: &Restore<'_>,
) -> candle_core::Result<()> {
    let unknown = saved.keys().find(|key| {
        let index = key.split('.').next().and_then(|i| i.parse::<usize>().ok());
        index.is_none_or(|i| i >= slots.len())
    });
    if let Some(key) = unknown {
        return Err(refused(
            optimizer,
            format!("the entry `{key}` names no Var of this optimizer"),
        ));
    }
    for slot in slots {
        let index = slot.index;
        let Some(step) = saved.get(&format!("{index}.step")) else {
            slot.step = 0;
            *slot.state.lock() = None;
            continue;
        };
        let get = |name: &str| -> candle_core::Result<Tensor> {
            saved
                .get(&format!("{index}.{name}"))
                .cloned()
                .ok_or_else(|| {
                    refused(optimizer, format!("the state dict has no `{index}.{name}`"))
                })
        };
        let state = restore(&slot.var, &get)?;
        slot.step = u64::try_from(step.to_scalar::<i64>()?)
            .map_err(|_| refused(optimizer, format!("a negative `{index}.step`")))?;
        *slot.state.lock() = Some(state);
    }
    Ok(())
}

/// Saved buffer `name` of `get` as a vector of `T` of `len` elements, or an error naming what
/// does not match.
pub(crate) fn saved_vec<T: WithDType>(
    optimizer: &'static str,
    get: &dyn Fn(&str) -> candle_core::Result<Tensor>,
    name: &str,
    len: usize,
) -> candle_core::Result<Vec<T>> {
    let tensor = get(name)?;
    if tensor.dtype() != T::DTYPE || tensor.elem_count() != len {
        return Err(refused(
            optimizer,
            format!(
                "`{name}` is {:?} of {} elements where the Var needs {:?} of {len}",
                tensor.dtype(),
                tensor.elem_count(),
                T::DTYPE
            ),
        ));
    }
    tensor.flatten_all()?.to_vec1::<T>()
}

/// Writes `dict` to the safetensors file `path`.
pub(crate) fn save(dict: &HashMap<String, Tensor>, path: &Path) -> candle_core::Result<()> {
    candle_core::safetensors::save(dict, path)
}

/// Reads a state dict from the safetensors file `path` onto the CPU.
pub(crate) fn load(path: &Path) -> candle_core::Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(path, &Device::Cpu)
}

fn refused(optimizer: &'static str, reason: String) -> candle_core::Error {
    CandleOptimError::Unsupported { optimizer, reason }.into()
}

/// The state methods of an optimizer `$optimizer` of this crate (fields `slots` and `config`):
/// `state_bytes`, `var_step`, `state_dict`, `load_state_dict` (each `Var`'s state rebuilt by
/// `$restore(&config, var, get)`, named `$name` in errors), `save_state` and `load_state`.
macro_rules! state_methods {
    ($optimizer:ident, $name:expr, $restore:path) => {
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
                let config = &self.config;
                let restore =
                    |var: &candle_core::Var,
                     get: &dyn Fn(&str) -> candle_core::Result<candle_core::Tensor>| {
                        $restore(config, var, get)
                    };
                $crate::state_dict::load_state_dict($name, &mut self.slots, saved, &restore)
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

pub(crate) use state_methods;
