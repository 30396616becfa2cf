//! Storages that backward rebuilds instead of keeping. An op that makes a tensor from operands
//! it keeps for its own backward anyway registers a recipe for the tensor's storage; when a
//! later op saves that storage (or a view of it) with no saved-tensor hooks installed, the saved
//! tensor keeps the recipe, not the bytes, and unpacking runs it. Views of one storage share one
//! rebuild while any of them is held. An fp8 linear registers its output: one fp8 GEMM again in
//! backward, from the input codes it keeps for its weight gradient, stands for the 16-bit
//! activation that attention (q, k and v), a GELU or a SwiGLU would otherwise keep.
//!
//! A recipe gives the storage's bytes exactly: it reruns the kernels that made them on the same
//! operands, which it holds as saved tensors (so a weight stepped in place in between is
//! [`TensorError::ModifiedInPlace`](crate::TensorError::ModifiedInPlace), never a silently
//! different value). That holds for any save of the storage while the op's backward has not run,
//! a detached alias's in another graph too: such a graph's backward after a step of the weight
//! is that error, though it reads no weight (an autocast policy that keeps outputs avoids it). The registry is thread-local and small; an entry matches only while the
//! storage is alive and unchanged since the op made it (its version), and a live weak reference
//! keeps a freed storage's address from being reused by another.
//!
//! It sits on tensors and buffers; it knows no op (the recipes are the ops') and no hook (the
//! saved-tensor machinery asks it, in `crate::saved`).

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::autocast::autocast_disabled;
use crate::buffer::Buffer;
use crate::error::Result;
use crate::grad_mode::no_grad;
use crate::tensor::Tensor;

/// How an op makes one of its outputs' storage again.
pub(crate) trait Rebuild: Send + Sync {
    /// A tensor whose buffer holds the storage's bytes at the same offsets (a dense tensor the
    /// size of the op's output).
    fn rebuild(&self) -> Result<Tensor>;
}

/// A registered storage's recipe and its last rebuild, shared by every save of the storage.
pub(crate) struct RebuiltStorage {
    recipe: Box<dyn Rebuild>,
    /// The last rebuild while something holds it: the saves of q, k and v (views of one
    /// projection's output) unpack one rebuild.
    last: Mutex<Weak<Buffer>>,
}

impl RebuiltStorage {
    /// The storage: the last rebuild if it is still held, else a new one (grad mode and autocast
    /// off, as the op ran its kernels).
    pub(crate) fn buffer(&self) -> Result<Arc<Buffer>> {
        let mut last = self.last.lock();
        if let Some(buffer) = last.upgrade() {
            return Ok(buffer);
        }
        let rebuilt = {
            let (_grad, _autocast) = (no_grad(), autocast_disabled());
            self.recipe.rebuild()?
        };
        let buffer = Arc::clone(rebuilt.buffer());
        *last = Arc::downgrade(&buffer);
        Ok(buffer)
    }
}

impl std::fmt::Debug for RebuiltStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RebuiltStorage").finish_non_exhaustive()
    }
}

/// One registered storage. The registry holds the recipe weakly: the op that registered it
/// holds it (in its backward) and so does every save of the storage, so the operands it keeps
/// live no longer than the op's own saves or those saves.
struct Entry {
    storage: Weak<Buffer>,
    version: u64,
    rebuilt: Weak<RebuiltStorage>,
}

/// Entries kept at most: a block's linears' outputs many times over. The oldest goes first.
const MAX_ENTRIES: usize = 32;

thread_local! {
    static REBUILDABLE: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// Registers `recipe` for `tensor`'s storage, as it is now, and returns it: the caller keeps it
/// alive (its backward holds it) for as long as a save may ask for it. Entries whose storage or
/// recipe is gone are dropped first.
pub(crate) fn register_rebuild(tensor: &Tensor, recipe: Box<dyn Rebuild>) -> Arc<RebuiltStorage> {
    let rebuilt = Arc::new(RebuiltStorage {
        recipe,
        last: Mutex::new(Weak::new()),
    });
    let entry = Entry {
        storage: Arc::downgrade(tensor.buffer()),
        version: tensor.version(),
        rebuilt: Arc::downgrade(&rebuilt),
    };
    REBUILDABLE.with(|entries| {
        let mut entries = entries.borrow_mut();
        entries
            .retain(|entry| entry.storage.strong_count() > 0 && entry.rebuilt.strong_count() > 0);
        if entries.len() == MAX_ENTRIES {
            entries.remove(0);
        }
        entries.push(entry);
    });
    rebuilt
}

/// The recipe registered for `tensor`'s storage, if the storage is unchanged since.
pub(crate) fn rebuild_of(tensor: &Tensor) -> Option<Arc<RebuiltStorage>> {
    REBUILDABLE.with(|entries| {
        let entries = entries.borrow();
        entries
            .iter()
            .find(|entry| {
                entry.storage.as_ptr() == Arc::as_ptr(tensor.buffer())
                    && entry.version == tensor.version()
            })
            .and_then(|entry| entry.rebuilt.upgrade())
    })
}
