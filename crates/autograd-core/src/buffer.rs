//! A tensor's storage: one allocation from a backend's caching allocator, shared by every view.
//!
//! A [`Buffer`] owns exactly one `Allocation` and gives it back to its backend when the last
//! tensor (or saved tensor) that shares it is dropped, so `memory_allocated()` is exact. It also
//! carries the storage's version counter, bumped by every in-place write, which is how backward
//! detects a saved tensor that was modified. It sits on the [`Backend`] trait for allocation and
//! knows nothing about shapes, dtypes or the graph.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use headroom_caching_allocator::Allocation;

use crate::backend::BackendRef;
use crate::dtype::Device;
use crate::error::{Result, TensorError};

/// Counts in-place writes to one storage. Shared by the storage and by every tensor saved from
/// it, so a saved tensor whose memory was handed to a pack hook can still be checked.
#[derive(Debug, Default)]
pub struct VersionCounter(AtomicU64);

impl VersionCounter {
    /// The number of in-place writes so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    fn bump(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// Device memory for one or more tensors. Zero-byte buffers hold no allocation, as in PyTorch.
pub struct Buffer {
    allocation: Option<Allocation>,
    len_bytes: usize,
    backend: BackendRef,
    version: Arc<VersionCounter>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("address", &self.address())
            .field("len_bytes", &self.len_bytes)
            .field("device", &self.backend.device())
            .field("version", &self.version.get())
            .finish()
    }
}

impl Buffer {
    /// Allocates `len_bytes` from `backend`'s allocator. The contents are unspecified.
    pub fn new(backend: &BackendRef, len_bytes: usize) -> Result<Buffer> {
        let allocation = if len_bytes == 0 {
            None
        } else {
            Some(backend.allocate(len_bytes as u64)?)
        };
        Ok(Buffer {
            allocation,
            len_bytes,
            backend: Arc::clone(backend),
            version: Arc::default(),
        })
    }

    /// Start address (a host pointer for the CPU backend); 0 for an empty buffer.
    pub fn address(&self) -> u64 {
        self.allocation.as_ref().map_or(0, Allocation::address)
    }

    /// Bytes usable by tensors (the request, not the allocator's rounded block size).
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// `Ok` when `len` bytes at `byte_offset` lie inside the buffer (for host transfers).
    pub fn check_range(&self, op: &'static str, byte_offset: usize, len: usize) -> Result<()> {
        if byte_offset
            .checked_add(len)
            .is_none_or(|end| end > self.len_bytes)
        {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "{len} bytes at {byte_offset} exceed a buffer of {}",
                    self.len_bytes
                ),
            });
        }
        Ok(())
    }

    /// Bytes the allocator reserved for this buffer (the rounded block size).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocation.as_ref().map_or(0, Allocation::size)
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.backend.device()
    }

    /// The backend that owns the memory and runs kernels on it.
    pub fn backend(&self) -> &BackendRef {
        &self.backend
    }

    /// The in-place write count of this storage.
    pub fn version(&self) -> u64 {
        self.version.get()
    }

    pub(crate) fn version_counter(&self) -> &Arc<VersionCounter> {
        &self.version
    }

    pub(crate) fn bump_version(&self) {
        self.version.bump();
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            // A backend records a failed free (see `Backend::free`); Drop never panics.
            self.backend.free(allocation);
        }
    }
}
