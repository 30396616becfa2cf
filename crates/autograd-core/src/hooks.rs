//! Hooks into the autograd engine: gradient hooks, post-accumulate-grad hooks and scoped
//! saved-tensor pack/unpack hooks.
//!
//! These are the seams every memory technique plugs into: gradient hooks rewrite a gradient in
//! flight, post-accumulate-grad hooks run an optimizer step the moment a parameter's gradient
//! is final, and saved-tensor hooks decide what a saved activation becomes between forward and
//! backward (kept, offloaded, compressed, or dropped and recomputed). This module owns the hook
//! types and the thread-local stack of saved-tensor hooks; the engine (`crate::engine`) and
//! `crate::saved` call them. It knows nothing about kernels.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::error::Result;
use crate::tensor::Tensor;

/// A gradient hook: sees a gradient, may return a replacement.
pub type GradHook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// A post-accumulate-grad hook: called with the leaf once its `.grad` is final.
pub type PostAccumulateHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// Whatever a pack hook turned a saved tensor into.
pub type Packed = Box<dyn Any + Send + Sync>;

/// A pack hook: a saved tensor in, what to keep out.
pub type PackHook = Box<dyn Fn(Tensor) -> Result<Packed> + Send + Sync>;

/// An unpack hook: what a pack hook kept in, the tensor for backward out.
pub type UnpackHook = Box<dyn Fn(&Packed) -> Result<Tensor> + Send + Sync>;

/// A list of hooks that handles can remove entries from.
pub(crate) struct HookList<H> {
    entries: Mutex<Vec<(u64, H)>>,
    next_id: Mutex<u64>,
}

impl<H> Default for HookList<H> {
    fn default() -> Self {
        HookList {
            entries: Mutex::new(Vec::new()),
            next_id: Mutex::new(0),
        }
    }
}

impl<H: Clone + Send + Sync + 'static> HookList<H> {
    pub(crate) fn push(list: &Arc<HookList<H>>, hook: H) -> HookHandle {
        let id = {
            let mut next_id = list.next_id.lock();
            *next_id += 1;
            *next_id
        };
        list.entries.lock().push((id, hook));
        let weak: Weak<HookList<H>> = Arc::downgrade(list);
        HookHandle {
            remove: Some(Box::new(move || {
                if let Some(list) = weak.upgrade() {
                    list.entries.lock().retain(|(entry_id, _)| *entry_id != id);
                }
            })),
        }
    }

    /// The hooks in registration order, cloned so none is called under the lock.
    pub(crate) fn snapshot(&self) -> Vec<H> {
        self.entries
            .lock()
            .iter()
            .map(|(_, hook)| hook.clone())
            .collect()
    }
}

/// Removes its hook when [`HookHandle::remove`] is called; dropping the handle keeps the hook.
pub struct HookHandle {
    remove: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl std::fmt::Debug for HookHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookHandle").finish_non_exhaustive()
    }
}

impl HookHandle {
    /// Unregisters the hook.
    pub fn remove(mut self) {
        if let Some(remove) = self.remove.take() {
            remove();
        }
    }
}

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
/// innermost pair packs; each saved tensor is unpacked by the pair that packed it.
pub fn saved_tensor_hooks(
    pack: impl Fn(Tensor) -> Result<Packed> + Send + Sync + 'static,
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
