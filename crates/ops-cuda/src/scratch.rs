//! [`Scratch`]: device memory a launch needs for its own duration (partial sums, error words,
//! dense copies of strided operands), taken from the backend's caching allocator and returned
//! when dropped.
//!
//! The block is returned in stream order: kernels queued on the default stream that use it run
//! before any later reuse, so a launch may drop its scratch as soon as its kernels are queued.
//! Scratch counts in `memory_allocated()` like any other allocation.
//!
//! This module is ground floor: it sits on `device.rs` (the allocator) and knows no kernel.

use headroom_autograd_core::Result;
use headroom_caching_allocator::{Allocation, StreamId};

use crate::device::CudaBackend;

/// Device scratch from the backend's caching allocator (at least 8 bytes), returned when
/// dropped: in stream order, so kernels queued on the default stream that use it run before any
/// later reuse; a failed free is recorded like `Backend::free`'s.
pub(crate) struct Scratch<'a> {
    backend: &'a CudaBackend,
    allocation: Option<Allocation>,
}

impl<'a> Scratch<'a> {
    /// At least `bytes` (and 8) bytes of device memory, on the compute stream's pool.
    pub(crate) fn new(backend: &'a CudaBackend, bytes: u64) -> Result<Scratch<'a>> {
        let allocation = backend
            .allocator()
            .allocate(bytes.max(8), StreamId::DEFAULT)?;
        Ok(Scratch {
            backend,
            allocation: Some(allocation),
        })
    }

    /// The device address of the scratch memory.
    pub(crate) fn address(&self) -> u64 {
        self.allocation.as_ref().map_or(0, Allocation::address)
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            self.backend.free_quietly(allocation);
        }
    }
}
