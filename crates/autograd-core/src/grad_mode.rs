//! Whether ops record the graph on this thread: the `no_grad` guard.
//!
//! Recording is on by default; [`no_grad`] turns it off until its guard is dropped (guards nest
//! and restore what was there before). The engine runs every backward function with recording
//! off. This module knows nothing about nodes or tensors.

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops record the graph on this thread now.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Turns recording off on this thread until the guard is dropped.
pub fn no_grad() -> GradModeGuard {
    set_grad_enabled(false)
}

/// Sets recording on or off on this thread until the guard is dropped.
pub fn set_grad_enabled(enabled: bool) -> GradModeGuard {
    let previous = GRAD_ENABLED.with(|cell| cell.replace(enabled));
    GradModeGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the previous grad mode when dropped.
#[derive(Debug)]
#[must_use = "grad mode is restored as soon as the guard is dropped"]
pub struct GradModeGuard {
    previous: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|cell| cell.set(self.previous));
    }
}
