//! Tensors saved for backward: version-checked, and routed through saved-tensor hooks.
//!
//! An op that needs an input or output in its backward keeps a [`SavedTensor`]: a detached alias
//! of the tensor (so no reference cycle through the graph) together with the storage's version
//! at save time. If saved-tensor hooks are installed, the alias is handed to `pack` at once and
//! only the packed value is kept; `unpack` brings it back when backward asks. Either way,
//! [`SavedTensor::unpack`] fails with [`TensorError::ModifiedInPlace`] naming the op when the
//! storage was written in place after the save. Dropping a `SavedTensor` releases its memory,
//! which the engine does right after the node's backward.

use std::sync::Arc;

use crate::buffer::VersionCounter;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::hooks::{current_saved_tensor_hooks, Packed, SavedTensorHooks};
use crate::tensor::Tensor;

/// A tensor kept for a backward function.
pub struct SavedTensor {
    op: &'static str,
    version: Arc<VersionCounter>,
    saved_version: u64,
    data: SavedData,
}

enum SavedData {
    Plain(Tensor),
    Packed {
        packed: Packed,
        hooks: Arc<SavedTensorHooks>,
    },
}

impl std::fmt::Debug for SavedTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedTensor")
            .field("op", &self.op)
            .field("saved_version", &self.saved_version)
            .field("packed", &matches!(self.data, SavedData::Packed { .. }))
            .finish()
    }
}

impl SavedTensor {
    /// Saves `tensor` for the backward of `op`, packing it if hooks are installed.
    pub fn save(op: &'static str, tensor: &Tensor) -> Result<SavedTensor> {
        let buffer = tensor.buffer();
        let version = Arc::clone(buffer.version_counter());
        let saved_version = version.get();
        let alias = tensor.detach();
        let data = match current_saved_tensor_hooks() {
            Some(hooks) => {
                let _guard = no_grad();
                let packed = (hooks.pack)(alias)?;
                SavedData::Packed { packed, hooks }
            }
            None => SavedData::Plain(alias),
        };
        Ok(SavedTensor {
            op,
            version,
            saved_version,
            data,
        })
    }

    /// The saved tensor, or an error if its storage was modified in place since the save.
    pub fn unpack(&self) -> Result<Tensor> {
        let current_version = self.version.get();
        if current_version != self.saved_version {
            return Err(TensorError::ModifiedInPlace {
                op: self.op,
                saved_version: self.saved_version,
                current_version,
            });
        }
        match &self.data {
            SavedData::Plain(tensor) => Ok(tensor.clone()),
            SavedData::Packed { packed, hooks } => {
                let _guard = no_grad();
                (hooks.unpack)(packed)
            }
        }
    }
}
