//! Tensors saved for backward: version-checked, described by a [`SaveSite`], and routed through
//! saved-tensor hooks.
//!
//! An op that needs an input, an output or an intermediate in its backward keeps a
//! [`SavedTensor`]: a detached alias of the tensor (so no reference cycle through the graph)
//! together with the storage's version at save time. If saved-tensor hooks are installed, the
//! alias is handed to `pack` at once, with the [`SaveSite`] that says what it is (the op, which of
//! its tensors, shape, dtype, bytes, and its number among this backward's saves), and only the
//! packed value is kept; `unpack` brings it back when backward asks. Either way,
//! [`SavedTensor::unpack`] fails with [`TensorError::ModifiedInPlace`] naming the op when the
//! storage was written in place after the save. Dropping a `SavedTensor` releases its memory,
//! which the engine does right after the node's backward. With no hooks installed, a storage an
//! op registered as rebuildable (`crate::rebuild`) is kept as its recipe and rebuilt on unpack.
//!
//! The save numbers count the saves of this thread since its last outermost backward finished
//! (`crate::engine` resets them), so in a training loop the same save of every step has the same
//! number: what a checkpointing, offload or compression policy, or a memory planner, keys its
//! decisions on. This module knows nothing about kernels or about what hooks do with a tensor.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

use crate::buffer::VersionCounter;
use crate::dtype::{DType, Device};
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::Edge;
use crate::layout::Dims;
use crate::layout::Layout;
use crate::rebuild::{rebuild_of, RebuiltStorage};
use crate::tensor::Tensor;

/// Which of an op's tensors a save holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SaveRole {
    /// The op's `i`-th tensor argument (or a dense copy or reshape of it the op made first:
    /// layer norm saves its input as rows).
    Input(usize),
    /// The op's `i`-th output.
    Output(usize),
    /// Something the op computed only for its backward, named: layer norm's `mean` and `rstd`,
    /// the `lse` (log-sum-exp) of attention and cross-entropy, dropout's `mask`, an in-place op's
    /// `old_self`.
    Intermediate(&'static str),
}

/// What a saved tensor is, as pack hooks see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveSite {
    /// The op whose backward needs the tensor (its graph node's name: `"linear"`, `"gelu"`,
    /// `"scaled_dot_product_attention"`, ...).
    pub op: &'static str,
    /// Which of the op's tensors it is.
    pub role: SaveRole,
    /// The saved tensor's shape.
    pub shape: Dims,
    /// Its dtype.
    pub dtype: DType,
    /// Its device.
    pub device: Device,
    /// Bytes of its elements (`numel × dtype size`): what a hook frees by dropping it, when
    /// nothing else holds the storage.
    pub bytes: u64,
    /// Its number among the saves of this thread since its last outermost backward finished,
    /// from 0: the same save of every training step gets the same number.
    pub seq: u64,
    /// Whether the saved tensor's storage is a parameter's: a leaf that requires grad (a linear
    /// saves its weight; an input the user marked counts too), or a view of one (GPT-2's `Conv1D`
    /// saves its weight transposed). That memory outlives the step, so a technique that drops
    /// saved tensors to free memory gains nothing from it (offload never copies one, compression
    /// never encodes one).
    pub is_parameter: bool,
    /// Whether backward can rebuild the storage instead of keeping it (an fp8 linear's output,
    /// made again by one fp8 GEMM from the codes the linear keeps; see `crate::rebuild`). With
    /// no hooks installed such a save keeps the recipe, not the bytes; a hook that keeps the
    /// tensor keeps the bytes.
    pub rebuildable: bool,
}

thread_local! {
    static NEXT_SAVE_SEQ: Cell<u64> = const { Cell::new(0) };
}

/// Starts the save numbers again from 0 (the engine calls this when an outermost backward ends).
pub(crate) fn reset_save_seq() {
    NEXT_SAVE_SEQ.with(|next| next.set(0));
}

/// Whatever a pack hook turned a saved tensor into.
pub type Packed = Box<dyn Any + Send + Sync>;

/// A pack hook: a saved tensor and what it is in, what to keep out.
pub type PackHook = Box<dyn Fn(&SaveSite, Tensor) -> Result<Packed> + Send + Sync>;

/// An unpack hook: what a pack hook kept in, the tensor for backward out.
pub type UnpackHook = Box<dyn Fn(&Packed) -> Result<Tensor> + Send + Sync>;

/// A pair of saved-tensor hooks: `pack` runs when an op saves a tensor for backward, `unpack`
/// when backward needs it back (PyTorch's `torch.autograd.graph.saved_tensors_hooks`).
pub struct SavedTensorHooks {
    pub(crate) pack: PackHook,
    pub(crate) unpack: UnpackHook,
}

impl std::fmt::Debug for SavedTensorHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedTensorHooks").finish_non_exhaustive()
    }
}

thread_local! {
    static SAVED_TENSOR_HOOKS: RefCell<Vec<Arc<SavedTensorHooks>>> = const { RefCell::new(Vec::new()) };
}

/// Installs saved-tensor hooks on this thread until the guard is dropped. Scopes nest: the
/// innermost pair packs; each saved tensor is unpacked by the pair that packed it. `pack` sees
/// the [`SaveSite`] of each save (op, role, shape, dtype, bytes, number), so a policy can decide
/// per saved tensor.
pub fn saved_tensor_hooks(
    pack: impl Fn(&SaveSite, Tensor) -> Result<Packed> + Send + Sync + 'static,
    unpack: impl Fn(&Packed) -> Result<Tensor> + Send + Sync + 'static,
) -> SavedTensorHooksGuard {
    let hooks = Arc::new(SavedTensorHooks {
        pack: Box::new(pack),
        unpack: Box::new(unpack),
    });
    SAVED_TENSOR_HOOKS.with(|stack| stack.borrow_mut().push(hooks));
    let depth = SAVED_TENSOR_HOOKS.with(|stack| stack.borrow().len());
    SavedTensorHooksGuard {
        depth,
        _not_send: std::marker::PhantomData,
    }
}

/// Pops the hooks pushed by [`saved_tensor_hooks`] when dropped.
#[derive(Debug)]
#[must_use = "the hooks are removed as soon as the guard is dropped"]
pub struct SavedTensorHooksGuard {
    depth: usize,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for SavedTensorHooksGuard {
    fn drop(&mut self) {
        SAVED_TENSOR_HOOKS.with(|stack| stack.borrow_mut().truncate(self.depth - 1));
    }
}

/// The innermost saved-tensor hooks of this thread, if any.
pub(crate) fn current_saved_tensor_hooks() -> Option<Arc<SavedTensorHooks>> {
    SAVED_TENSOR_HOOKS.with(|stack| stack.borrow().last().cloned())
}

/// Views followed back from a saved tensor to the leaf whose storage it shares.
const MAX_VIEW_CHAIN: usize = 16;

/// Whether `tensor`'s storage is that of a leaf requiring grad: the tensor itself is one, or it is
/// a view and following the first input of each recorded op back from it (a view op's only
/// input) reaches such a leaf with the same storage.
fn holds_parameter_storage(tensor: &Tensor) -> bool {
    let Some((mut node, _)) = tensor.grad_fn() else {
        return tensor.requires_grad();
    };
    if !tensor.is_view() {
        return false;
    }
    for _ in 0..MAX_VIEW_CHAIN {
        let next = match node.next().first() {
            Some(Some(Edge::Leaf(leaf))) => return Arc::ptr_eq(leaf.buffer(), tensor.buffer()),
            Some(Some(Edge::Node { node, .. })) => Arc::clone(node),
            _ => return false,
        };
        node = next;
    }
    false
}

/// A tensor kept for a backward function.
pub struct SavedTensor {
    op: &'static str,
    version: Arc<VersionCounter>,
    saved_version: u64,
    data: SavedData,
}

enum SavedData {
    Plain(Tensor),
    /// A storage backward rebuilds (`crate::rebuild`), seen through the saved view's layout.
    Rebuilt {
        storage: Arc<RebuiltStorage>,
        layout: Layout,
        dtype: DType,
    },
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
    /// Saves `tensor`, the `role` of `op`, for its backward, packing it if hooks are installed;
    /// with none, a storage backward can rebuild (`crate::rebuild`) is kept as its recipe.
    pub fn save(op: &'static str, role: SaveRole, tensor: &Tensor) -> Result<SavedTensor> {
        let buffer = tensor.buffer();
        let version = Arc::clone(buffer.version_counter());
        let saved_version = version.get();
        let seq = NEXT_SAVE_SEQ.with(|next| next.replace(next.get() + 1));
        let alias = tensor.detach();
        let rebuild = rebuild_of(tensor);
        let data = match current_saved_tensor_hooks() {
            Some(hooks) => {
                let site = SaveSite {
                    op,
                    role,
                    shape: tensor.shape().into(),
                    dtype: tensor.dtype(),
                    device: tensor.device(),
                    bytes: (tensor.numel() * tensor.dtype().size_in_bytes()) as u64,
                    seq,
                    is_parameter: holds_parameter_storage(tensor),
                    rebuildable: rebuild.is_some(),
                };
                let _guard = no_grad();
                let packed = (hooks.pack)(&site, alias)?;
                SavedData::Packed { packed, hooks }
            }
            None => match rebuild {
                Some(storage) => SavedData::Rebuilt {
                    storage,
                    layout: tensor.layout().clone(),
                    dtype: tensor.dtype(),
                },
                None => SavedData::Plain(alias),
            },
        };
        Ok(SavedTensor {
            op,
            version,
            saved_version,
            data,
        })
    }

    /// `tensor` kept as it is, version-checked, for `op`: no hook sees it and it takes no save
    /// number (a rebuild recipe's alias of operands its op saves as well).
    pub(crate) fn alias(op: &'static str, tensor: &Tensor) -> SavedTensor {
        let version = Arc::clone(tensor.buffer().version_counter());
        SavedTensor {
            op,
            saved_version: version.get(),
            version,
            data: SavedData::Plain(tensor.detach()),
        }
    }

    /// The saved tensor, or an error if its storage was modified in place since the save.
    ///
    /// An unpack hook runs with grad mode off, as backward does; a hook that recomputes the
    /// forward to rebuild the tensor (activation checkpointing) turns it on for the
    /// recomputation with [`set_grad_enabled`](crate::set_grad_enabled).
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
            SavedData::Rebuilt {
                storage,
                layout,
                dtype,
            } => Ok(Tensor::from_parts(
                storage.buffer()?,
                layout.clone(),
                *dtype,
                true,
            )),
            SavedData::Packed { packed, hooks } => {
                let _guard = no_grad();
                (hooks.unpack)(packed)
            }
        }
    }
}
