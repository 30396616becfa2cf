//! A group optimizer's state as safetensors bytes: every parameter's step and state tensors
//! (keys `state.{group}.{index}.{name}`, steps and hyperparameters in the metadata), and the way
//! back onto the parameters' backend.
//!
//! It sits on the optimizer's slot table (its parent module) and the rule's (`rule.rs`)
//! [`UpdateRule::state_tensors`] / [`UpdateRule::state_from_tensors`]; it knows no algorithm
//! and no device (tensors are read and created through autograd-core).

use std::borrow::Cow;
use std::collections::HashMap;

use headroom_autograd_core::{DType, Element, Tensor};
use safetensors::tensor::TensorView;

use super::GroupOptimizer;
use crate::error::OptimError;
use crate::rule::{SavedTensors, UpdateRule};

impl<R: UpdateRule> GroupOptimizer<R> {
    /// The state (steps, state tensors, hyperparameters) as safetensors bytes.
    pub(super) fn save_state(&self) -> Result<Vec<u8>, OptimError> {
        self.save_state_with(|_, state| {
            let Some(state) = state else { return Ok(None) };
            R::state_tensors(state)
                .into_iter()
                .map(|(name, tensor)| {
                    let bytes = tensor_bytes(name, &tensor)?;
                    Ok((
                        name,
                        tensor.dtype(),
                        tensor.shape().to_vec(),
                        Cow::Owned(bytes),
                    ))
                })
                .collect::<Result<Vec<_>, OptimError>>()
                .map(Some)
        })
    }

    /// [`GroupOptimizer::save_state`] with each slot's state tensors (by name, as little-endian
    /// bytes) from `state_of(slot, its state here)`: a wrapper that keeps states elsewhere (in
    /// host memory) hands them in without bringing them back.
    pub(crate) fn save_state_with<'a>(
        &self,
        mut state_of: impl FnMut(
            usize,
            Option<&R::State>,
        ) -> Result<Option<Vec<StateBytes<'a>>>, OptimError>,
    ) -> Result<Vec<u8>, OptimError> {
        let mut metadata = HashMap::new();
        metadata.insert("optimizer".to_string(), R::NAME.to_string());
        metadata.insert(
            "implementation".to_string(),
            format!("{:?}", self.implementation),
        );
        for (g, group) in self.groups.iter().enumerate() {
            metadata.insert(format!("group.{g}.lr"), format!("{:?}", group.config.lr()));
            metadata.insert(format!("group.{g}.config"), format!("{:?}", group.config));
        }
        let mut blobs: Vec<(String, StateBytes<'a>)> = Vec::new();
        let steps = self.steps_taken()?;
        for (slot_idx, slot) in self.slots.iter().enumerate() {
            let Some(tensors) = state_of(slot_idx, slot.state.as_ref())? else {
                continue;
            };
            let (g, idx) = (slot.group, slot_idx - self.group_starts[slot.group]);
            let step = steps[slot_idx];
            metadata.insert(format!("state.{g}.{idx}.step"), step.to_string());
            for tensor in tensors {
                blobs.push((format!("state.{g}.{idx}.{}", tensor.0), tensor));
            }
        }
        let views = blobs
            .iter()
            .map(|(name, (_, dtype, shape, bytes))| {
                let dtype = match dtype {
                    DType::U8 => safetensors::Dtype::U8,
                    DType::BF16 => safetensors::Dtype::BF16,
                    DType::F16 => safetensors::Dtype::F16,
                    _ => safetensors::Dtype::F32,
                };
                Ok((
                    name.clone(),
                    TensorView::new(dtype, shape.clone(), bytes.as_ref())?,
                ))
            })
            .collect::<Result<Vec<_>, OptimError>>()?;
        Ok(safetensors::serialize(views, &Some(metadata))?)
    }

    /// Restores what [`GroupOptimizer::save_state`] saved (same groups and parameter shapes).
    pub(super) fn load_state(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        self.load_state_with(bytes, |_, state| Ok(Some(state)))
    }

    /// [`GroupOptimizer::load_state`] with each loaded state handed to `place(slot, state)`,
    /// which keeps it here (`Some`) or elsewhere (`None`: a wrapper that keeps states in host
    /// memory). Nothing changes unless every slot loads.
    pub(crate) fn load_state_with(
        &mut self,
        bytes: &[u8],
        mut place: impl FnMut(usize, R::State) -> Result<Option<R::State>, OptimError>,
    ) -> Result<(), OptimError> {
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)?;
        let metadata = header.metadata().clone().unwrap_or_default();
        if metadata.get("optimizer").map(String::as_str) != Some(R::NAME) {
            return Err(OptimError::StateDict(format!(
                "saved by {:?}, loading into {}",
                metadata.get("optimizer"),
                R::NAME
            )));
        }
        let tensors = safetensors::SafeTensors::deserialize(bytes)?;
        for (g, group) in self.groups.iter_mut().enumerate() {
            if let Some(lr) = metadata.get(&format!("group.{g}.lr")) {
                let lr = lr
                    .parse::<f64>()
                    .map_err(|e| OptimError::StateDict(format!("group {g} lr {lr:?}: {e}")))?;
                group.config.set_lr(lr);
            }
        }
        let mut loaded = Vec::with_capacity(self.slots.len());
        for (slot_idx, slot) in self.slots.iter().enumerate() {
            let (g, idx) = (slot.group, slot_idx - self.group_starts[slot.group]);
            let Some(step) = metadata.get(&format!("state.{g}.{idx}.step")) else {
                loaded.push((0, None));
                continue;
            };
            let step = step
                .parse::<u64>()
                .map_err(|e| OptimError::StateDict(format!("step {step:?}: {e}")))?;
            let prefix = format!("state.{g}.{idx}.");
            let mut named = HashMap::new();
            for (name, view) in tensors.tensors() {
                let Some(key) = name.strip_prefix(&prefix) else {
                    continue;
                };
                named.insert(key.to_string(), tensor_of(&name, &view, &slot.param)?);
            }
            let mut saved = SavedTensors::new(slot.param.clone(), named);
            let state = self.groups[g].config.state_from_tensors(&mut saved)?;
            loaded.push((step, place(slot_idx, state)?));
        }
        for (slot, (step, state)) in self.slots.iter_mut().zip(loaded) {
            slot.step = step;
            slot.state = state;
        }
        // The loaded steps are exact: a graph that captured a step would replay the old ones.
        self.device
            .invalidate_captures("the optimizer's state was loaded after its step was captured");
        self.device.count_replays();
        self.device.reset_skipped_steps()
    }
}

/// A state tensor by name: its dtype, shape and elements as little-endian bytes.
pub(crate) type StateBytes<'a> = (&'static str, DType, Vec<usize>, Cow<'a, [u8]>);

/// A state tensor's elements as little-endian bytes.
pub(crate) fn tensor_bytes(name: &str, tensor: &Tensor) -> Result<Vec<u8>, OptimError> {
    fn le_bytes<T: Element, const N: usize>(
        tensor: &Tensor,
        to_le_bytes: fn(T) -> [u8; N],
    ) -> Result<Vec<u8>, OptimError> {
        Ok(tensor
            .to_vec::<T>()?
            .into_iter()
            .flat_map(to_le_bytes)
            .collect())
    }
    match tensor.dtype() {
        DType::F32 => le_bytes(tensor, f32::to_le_bytes),
        DType::BF16 => le_bytes(tensor, half::bf16::to_le_bytes),
        DType::F16 => le_bytes(tensor, half::f16::to_le_bytes),
        DType::U8 => Ok(tensor.to_vec::<u8>()?),
        other => Err(OptimError::StateDict(format!(
            "state tensor {name} has dtype {other:?}"
        ))),
    }
}

/// A saved tensor on `param`'s backend.
fn tensor_of(name: &str, view: &TensorView<'_>, param: &Tensor) -> Result<Tensor, OptimError> {
    fn from_le<T: Element, const N: usize>(
        view: &TensorView<'_>,
        param: &Tensor,
        from_le_bytes: fn([u8; N]) -> T,
    ) -> Result<Tensor, OptimError> {
        let values: Vec<T> = view
            .data()
            .chunks_exact(N)
            .map(|b| from_le_bytes(b.try_into().expect("chunks of N bytes")))
            .collect();
        Ok(Tensor::from_slice(param.backend(), &values, view.shape())?)
    }
    match view.dtype() {
        safetensors::Dtype::F32 => from_le(view, param, f32::from_le_bytes),
        safetensors::Dtype::BF16 => from_le(view, param, half::bf16::from_le_bytes),
        safetensors::Dtype::F16 => from_le(view, param, half::f16::from_le_bytes),
        safetensors::Dtype::U8 => from_le(view, param, u8::from_le_bytes),
        other => Err(OptimError::StateDict(format!("{name} has dtype {other:?}"))),
    }
}
