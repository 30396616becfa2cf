//! State dicts of the decorators: the wrapped optimizer's safetensors bytes with the
//! decorator's own entries added (metadata keys and tensors under its prefix), and the way back.
//!
//! A decorator's `state_dict` is one safetensors file, loadable by the same decorator over the
//! same optimizer; what the wrapped optimizer saved passes through unchanged. This module knows
//! no decorator: it only merges and splits entries by prefix.

use std::collections::HashMap;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::AmpError;

/// A saved tensor's raw entry: dtype, shape and little-endian bytes.
#[derive(Debug, Clone)]
pub(crate) struct RawTensor {
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: Vec<u8>,
}

/// A state dict split by prefix: the wrapped optimizer's bytes, and the decorator's metadata and
/// tensors (full keys).
#[derive(Debug)]
pub(crate) struct SplitState {
    pub(crate) inner: Vec<u8>,
    pub(crate) metadata: HashMap<String, String>,
    pub(crate) tensors: HashMap<String, RawTensor>,
}

/// `inner` (a safetensors state dict) with `metadata` and `tensors` added.
pub(crate) fn write_state(
    inner: &[u8],
    metadata: &[(&str, String)],
    tensors: Vec<(String, RawTensor)>,
) -> Result<Vec<u8>, AmpError> {
    let (_, header) = SafeTensors::read_metadata(inner)?;
    let mut merged = header.metadata().clone().unwrap_or_default();
    for (key, value) in metadata {
        merged.insert((*key).to_string(), value.clone());
    }
    let saved = SafeTensors::deserialize(inner)?;
    let mut views: Vec<(String, TensorView<'_>)> = saved.tensors();
    for (name, raw) in &tensors {
        views.push((
            name.clone(),
            TensorView::new(raw.dtype, raw.shape.clone(), &raw.bytes)?,
        ));
    }
    Ok(safetensors::serialize(views, &Some(merged))?)
}

/// Splits what [`write_state`] wrote: entries under `prefix` out, the rest back as the wrapped
/// optimizer's bytes.
pub(crate) fn read_state(bytes: &[u8], prefix: &str) -> Result<SplitState, AmpError> {
    let (_, header) = SafeTensors::read_metadata(bytes)?;
    let all = header.metadata().clone().unwrap_or_default();
    let (metadata, rest): (HashMap<_, _>, HashMap<_, _>) = all
        .into_iter()
        .partition(|(key, _)| key.starts_with(prefix));
    let saved = SafeTensors::deserialize(bytes)?;
    let mut tensors = HashMap::new();
    let mut views = Vec::new();
    for (name, view) in saved.tensors() {
        if name.starts_with(prefix) {
            let raw = RawTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                bytes: view.data().to_vec(),
            };
            tensors.insert(name, raw);
        } else {
            views.push((name, view));
        }
    }
    let inner = safetensors::serialize(views, &Some(rest))?;
    Ok(SplitState {
        inner,
        metadata,
        tensors,
    })
}
