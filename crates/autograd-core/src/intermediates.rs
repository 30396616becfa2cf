//! Whether the fused ops that can recompute an intermediate keep it instead, on this thread: the
//! `keep_intermediates` guard.
//!
//! [`Tensor::gelu_linear`](crate::Tensor::gelu_linear) and
//! [`layer_norm_linear`](crate::layer_norm_linear) feed a linear from a cheap op (a GELU, a
//! layer norm) and by default keep only that op's inputs, running it again in backward for
//! the linear's weight gradient: less memory for one pass over the inputs. Inside
//! [`keep_intermediates`] they keep the intermediate too, as the two ops written apart do, and
//! backward reads it instead: more memory, no pass. Values and gradients are the same bits
//! either way; only what is kept differs, so a memory planner can choose per block
//! (checkpoint's `keep-intermediates` candidate). Guards nest and restore what was there before.
//! A checkpointed region must run its recomputation under the same choice as its forward (a
//! different choice saves other tensors, which the checkpoint reports). This module knows
//! nothing about ops or tensors.

use std::cell::Cell;

thread_local! {
    static KEEP: Cell<bool> = const { Cell::new(false) };
}

/// Whether the fused ops keep their recomputable intermediates on this thread now.
pub fn are_intermediates_kept() -> bool {
    KEEP.with(Cell::get)
}

/// Makes the fused ops keep their recomputable intermediates on this thread until the guard is
/// dropped.
pub fn keep_intermediates() -> KeepIntermediatesGuard {
    let previous = KEEP.with(|cell| cell.replace(true));
    KeepIntermediatesGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the previous choice when dropped.
#[derive(Debug)]
#[must_use = "the choice is restored as soon as the guard is dropped"]
pub struct KeepIntermediatesGuard {
    previous: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for KeepIntermediatesGuard {
    fn drop(&mut self) {
        KEEP.with(|cell| cell.set(self.previous));
    }
}
