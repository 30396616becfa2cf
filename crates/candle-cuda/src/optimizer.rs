//! [`CudaOptimizer`]: a [`CudaRule`] over candle `Var`s on one CUDA device — each `Var`'s slot
//! (its step count and state tensors, allocated by candle on the device at its first step), one
//! launch per step for every `Var` with a gradient (one per dtype and step count where they
//! differ), and the state dict as named candle tensors.
//!
//! It sits on `device.rs` (addresses, ordering) and `rules.rs`; it knows no rule.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{CudaDevice, DType, Device, Tensor, Var};

use crate::device::{address, backend, ordered, zeros};
use crate::error::CandleCudaError;
use crate::rules::{CudaRule, Item};

/// One `Var` of a CUDA optimizer: its index among the optimizer's, its step count and its state
/// tensors (in [`CudaRule::states`]' order; `None` before its first step).
#[derive(Debug)]
struct CudaSlot {
    var: Var,
    index: usize,
    step: u64,
    states: Option<Vec<Tensor>>,
}

/// A rule over candle `Var`s on one CUDA device.
#[derive(Debug)]
pub(crate) struct CudaOptimizer<R: CudaRule> {
    slots: Vec<CudaSlot>,
    pub(crate) config: R,
    device: CudaDevice,
    launcher: R::Launcher,
}

impl<R: CudaRule> CudaOptimizer<R> {
    /// The optimizer over `vars` (float `Var`s of `device`, of the rule's dtypes: checked).
    pub(crate) fn new(
        vars: Vec<Var>,
        config: R,
        device: CudaDevice,
    ) -> Result<CudaOptimizer<R>, CandleCudaError> {
        config.check()?;
        if let Some(var) = vars.iter().find(|v| !R::DTYPES.contains(&v.dtype())) {
            return Err(CandleCudaError::Unsupported {
                optimizer: R::NAME,
                reason: format!(
                    "a {:?} Var; on CUDA this optimizer takes {:?}",
                    var.dtype(),
                    R::DTYPES
                ),
            });
        }
        let ordinal = device.cuda_stream().context().ordinal();
        let launcher = R::launcher(backend(R::NAME, ordinal)?)?;
        let slots = vars
            .into_iter()
            .enumerate()
            .map(|(index, var)| CudaSlot {
                var,
                index,
                step: 0,
                states: None,
            })
            .collect();
        Ok(CudaOptimizer {
            slots,
            config,
            device,
            launcher,
        })
    }

    /// One step of every `Var` with a gradient in `grads`: the step counts advance, then one
    /// launch per dtype and step count updates the buffers in place. A `Var` without a gradient
    /// keeps its buffer and step count. Nothing is written, and no count advances, when a
    /// gradient is refused (another dtype, shape or device, non-contiguous).
    pub(crate) fn step(&mut self, grads: &GradStore) -> Result<(), CandleCudaError> {
        let name = R::NAME;
        let mut groups: Vec<((DType, u64), Vec<Item>)> = Vec::new();
        let mut stepped = Vec::new();
        for (at, slot) in self.slots.iter_mut().enumerate() {
            let Some(grad) = grads.get(slot.var.as_tensor()) else {
                continue;
            };
            let (dtype, len) = (slot.var.dtype(), slot.var.elem_count());
            if grad.dtype() != dtype || grad.dims() != slot.var.dims() {
                return Err(CandleCudaError::Unsupported {
                    optimizer: name,
                    reason: format!(
                        "Var {} is {dtype:?} {:?} but its gradient {:?} {:?}",
                        slot.index,
                        slot.var.dims(),
                        grad.dtype(),
                        grad.dims()
                    ),
                });
            }
            if slot.states.is_none() {
                let fresh = self
                    .config
                    .states(dtype, len)
                    .into_iter()
                    .map(|(_, state_dtype, n)| zeros(&self.device, state_dtype, n))
                    .collect::<candle_core::Result<Vec<_>>>()
                    .map_err(|e| CandleCudaError::Device {
                        optimizer: name,
                        op: "allocate the state",
                        reason: e.to_string(),
                    })?;
                slot.states = Some(fresh);
            }
            let states = slot.states.as_deref().unwrap_or_default();
            let item = Item {
                index: slot.index,
                param: address(name, "Var", slot.var.as_tensor(), &self.device)?,
                grad: address(name, "gradient", grad, &self.device)?,
                states: states
                    .iter()
                    .map(|s| address(name, "state", s, &self.device))
                    .collect::<Result<_, _>>()?,
                len,
            };
            let key = (dtype, slot.step + 1);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, items)) => items.push(item),
                None => groups.push((key, vec![item])),
            }
            stepped.push(at);
        }
        if groups.is_empty() {
            return Ok(());
        }
        let (config, launcher) = (&self.config, &mut self.launcher);
        ordered(name, &self.device, || {
            for ((dtype, step), items) in &groups {
                // SAFETY: every address is a contiguous buffer of a live tensor held by this
                // optimizer (Vars, states) or by `grads`, of the sizes `states` gives, for the
                // call; candle's stream waits for the launch before any later work on them.
                unsafe { config.launch(launcher, *dtype, *step, items)? };
            }
            Ok(())
        })?;
        for at in stepped {
            self.slots[at].step += 1;
        }
        Ok(())
    }

    /// The bytes of state held.
    pub(crate) fn state_bytes(&self) -> u64 {
        self.slots
            .iter()
            .flat_map(|slot| slot.states.iter().flatten())
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// The step count of the `Var` at `index`.
    pub(crate) fn var_step(&self, index: usize) -> Option<u64> {
        self.slots.get(index).map(|slot| slot.step)
    }

    /// `{index}.step` (an i64 on the CPU) and `{index}.{name}` (on the device) for every `Var`
    /// that has stepped.
    pub(crate) fn state_dict(&self) -> Result<HashMap<String, Tensor>, CandleCudaError> {
        let mut dict = HashMap::new();
        for slot in &self.slots {
            let Some(states) = &slot.states else {
                continue;
            };
            let step = Tensor::new(slot.step as i64, &Device::Cpu).map_err(candle_failed)?;
            dict.insert(format!("{}.step", slot.index), step);
            let specs = self.config.states(slot.var.dtype(), slot.var.elem_count());
            for ((state_name, _, _), tensor) in specs.iter().zip(states) {
                dict.insert(format!("{}.{state_name}", slot.index), tensor.clone());
            }
        }
        Ok(dict)
    }

    /// Continues from `saved` (a state dict of this optimizer over the same `Var`s, on any
    /// device): each state copied onto the `Var`s' device after its dtype and size are
    /// checked; a `Var` without entries starts afresh.
    pub(crate) fn load_state_dict(
        &mut self,
        saved: &HashMap<String, Tensor>,
    ) -> Result<(), CandleCudaError> {
        let name = R::NAME;
        let refused = |reason: String| CandleCudaError::Unsupported {
            optimizer: name,
            reason,
        };
        if let Some(key) = saved.keys().find(|key| {
            let index = key.split('.').next().and_then(|i| i.parse::<usize>().ok());
            index.is_none_or(|i| i >= self.slots.len())
        }) {
            return Err(refused(format!(
                "the entry `{key}` names no Var of this optimizer"
            )));
        }
        let device = Device::Cuda(self.device.clone());
        let mut loaded = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let index = slot.index;
            let Some(step) = saved.get(&format!("{index}.step")) else {
                loaded.push((0, None));
                continue;
            };
            let step = step.to_scalar::<i64>().map_err(candle_failed)?;
            let step =
                u64::try_from(step).map_err(|_| refused(format!("a negative `{index}.step`")))?;
            let mut states = Vec::new();
            for (state_name, dtype, len) in
                self.config.states(slot.var.dtype(), slot.var.elem_count())
            {
                let key = format!("{index}.{state_name}");
                let tensor = saved
                    .get(&key)
                    .ok_or_else(|| refused(format!("the state dict has no `{key}`")))?;
                if tensor.dtype() != dtype || tensor.elem_count() != len {
                    return Err(refused(format!(
                        "`{key}` is {:?} of {} elements where the Var needs {dtype:?} of {len}",
                        tensor.dtype(),
                        tensor.elem_count()
                    )));
                }
                let copy = tensor
                    .flatten_all()
                    .and_then(|t| t.to_device(&device))
                    .and_then(|t| t.copy())
                    .map_err(candle_failed)?;
                states.push(copy);
            }
            loaded.push((step, Some(states)));
        }
        for (slot, (step, states)) in self.slots.iter_mut().zip(loaded) {
            slot.step = step;
            slot.states = states;
        }
        Ok(())
    }
}

/// candle's error of a state-dict operation, as this crate's.
fn candle_failed(error: candle_core::Error) -> CandleCudaError {
    CandleCudaError::Device {
        optimizer: "state dict",
        op: "a candle tensor operation",
        reason: error.to_string(),
    }
}
