//! Optimizer state as named candle tensors, and as safetensors files: for the `Var` at `index`
//! (among the optimizer's float `Var`s, in the order given), `{index}.step` (an i64 scalar) and
//! `{index}.{name}` for each of its state buffers (`exp_avg`, `momentum_buffer`, `state1`...), as
//! PyTorch's `state_dict()["state"]` keys them; a `Var` that has not stepped has no entry.
//!
//! It sits on `host_slices.rs`' slots and candle's safetensors; each rule rebuilds its own state
//! from its tensors.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor, WithDType};

use crate::error::CandleOptimError;
use crate::host_slices::Slot;
use crate::rule::CandleRule;

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
/// rebuilt by `rule`; an entry for no `Var` of the optimizer is an error.
pub(crate) fn load_state_dict<R: CandleRule>(
    rule: &R,
    slots: &mut [Slot],
    saved: &HashMap<String, Tensor>,
) -> candle_core::Result<()> {
    let optimizer = R::NAME;
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
        let state = rule.restore(&slot.var, &get)?;
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
