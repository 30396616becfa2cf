//! Hooks into the autograd engine: gradient hooks, post-accumulate-grad hooks and backward-end
//! callbacks.
//!
//! These are seams the memory techniques plug into: gradient hooks rewrite a gradient in flight,
//! post-accumulate-grad hooks run an optimizer step the moment a parameter's gradient is final,
//! and backward-end callbacks run once a backward pass has finished — where an
//! optimizer-in-backward steps its last bucket, a GradScaler updates its scale, and activation
//! checkpointing drops what it recomputed. (Saved-tensor hooks, the fourth seam, live with the
//! saved tensors in `crate::saved`.) This module owns the hook types, removable hook lists and the
//! thread's stack of running backward passes; the engine (`crate::engine`) calls them. It knows
//! nothing about kernels or about the graph.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::error::{Result, TensorError};
use crate::tensor::Tensor;

/// A gradient hook: sees a gradient, may return a replacement.
pub type GradHook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// A post-accumulate-grad hook: called with the leaf once its `.grad` is final.
pub type PostAccumulateHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

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

/// A callback queued for the end of the backward pass running now: runs once, then is gone.
pub type BackwardEndCallback = Box<dyn FnOnce() -> Result<()> + Send>;

/// A hook run at the end of every outermost backward pass on the thread that registered it.
pub type BackwardEndHook = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// The number the next backward pass gets (process-wide, so it names a pass uniquely).
static NEXT_PASS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    /// Per backward pass running on this thread, innermost last: its number and callback queue.
    static RUNNING_BACKWARDS: RefCell<Vec<(u64, Vec<BackwardEndCallback>)>> =
        const { RefCell::new(Vec::new()) };
    static BACKWARD_END_HOOKS: Arc<HookList<BackwardEndHook>> = Arc::default();
}

/// Queues `callback` to run once when the backward pass running on this thread finishes
/// (PyTorch's `Variable._execution_engine.queue_callback`): called from a gradient hook, a
/// post-accumulate-grad hook, an unpack hook or a backward function. Callbacks run in the order
/// they were queued, after every node and leaf of the pass, with grad mode and autocast off; one
/// may queue another, which runs in the same pass. If the pass fails, its queued callbacks are
/// dropped without running. Outside a backward pass this is an error.
pub fn queue_backward_end_callback(
    callback: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<()> {
    RUNNING_BACKWARDS.with(|running| match running.borrow_mut().last_mut() {
        Some((_, queue)) => {
            queue.push(Box::new(callback));
            Ok(())
        }
        None => Err(TensorError::Autograd {
            op: "queue_backward_end_callback",
            reason: "no backward pass is running on this thread; queue callbacks from a hook \
                     or use on_backward_end"
                .into(),
        }),
    })
}

/// Runs `hook` at the end of every outermost backward pass on this thread (after the pass's
/// queued callbacks) until the handle removes it. Hooks run in registration order; a nested
/// backward (one started from inside another) does not run them.
pub fn on_backward_end(hook: impl Fn() -> Result<()> + Send + Sync + 'static) -> HookHandle {
    BACKWARD_END_HOOKS.with(|hooks| HookList::push(hooks, Arc::new(hook) as BackwardEndHook))
}

/// Whether a backward pass is running on this thread.
pub fn is_backward_running() -> bool {
    RUNNING_BACKWARDS.with(|running| !running.borrow().is_empty())
}

/// The number of the innermost backward pass running on this thread (unique in the process), if
/// one is: a hook that keeps state per pass tells a new pass from the one it last saw by it, also
/// when that one failed and never finished.
pub fn backward_pass_id() -> Option<u64> {
    RUNNING_BACKWARDS.with(|running| running.borrow().last().map(|(id, _)| *id))
}

/// A backward pass running on this thread: its callback queue. Made by the engine when a pass
/// starts; [`BackwardPass::finish`] runs the callbacks, dropping it unfinished discards them.
pub(crate) struct BackwardPass {
    depth: usize,
}

impl BackwardPass {
    /// Opens the callback queue of a new backward pass on this thread.
    pub(crate) fn start() -> BackwardPass {
        let id = NEXT_PASS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let depth = RUNNING_BACKWARDS.with(|running| {
            let mut running = running.borrow_mut();
            running.push((id, Vec::new()));
            running.len()
        });
        BackwardPass { depth }
    }

    /// Whether this is the outermost pass on the thread.
    pub(crate) fn is_outermost(&self) -> bool {
        self.depth == 1
    }

    /// Runs the queued callbacks (and those they queue), then, for an outermost pass, the
    /// thread's backward-end hooks (and what they queue). The first error stops the rest.
    pub(crate) fn finish(self) -> Result<()> {
        let mut hooks_ran = !self.is_outermost();
        loop {
            let queued = RUNNING_BACKWARDS
                .with(|running| std::mem::take(&mut running.borrow_mut()[self.depth - 1].1));
            if !queued.is_empty() {
                for callback in queued {
                    callback()?;
                }
            } else if !hooks_ran {
                hooks_ran = true;
                for hook in BACKWARD_END_HOOKS.with(|hooks| hooks.snapshot()) {
                    hook()?;
                }
            } else {
                return Ok(());
            }
        }
    }
}

impl Drop for BackwardPass {
    fn drop(&mut self) {
        let discarded = RUNNING_BACKWARDS.with(|running| {
            let mut running = running.borrow_mut();
            let discarded: Vec<_> = running.drain(self.depth - 1..).collect();
            discarded
        });
        drop(discarded);
    }
}
