//! A tensor's storage: one allocation from a backend's caching allocator, shared by every view.
//!
//! A [`Buffer`] owns exactly one `Allocation` and gives it back to its backend when the last
//! tensor (or saved tensor) that shares it is dropped, so `memory_allocated()` is exact. It also
//! carries the storage's version counter, bumped by every in-place write, which is how backward
//! detects a saved tensor that was modified, and its host-access claim: [`HostAccess`] is how a
//! host computation (the CPU backend's kernels, the optimizers' host updates) gets a buffer alone
//! for a write or shared for a read, so two threads sharing `Send + Sync` tensors never race on
//! host memory. It sits on the [`Backend`] trait for allocation and knows nothing about shapes,
//! dtypes or the graph.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use headroom_caching_allocator::{Allocation, AllocatorId};
use smallvec::SmallVec;

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
    /// Host threads' claim: 0 free, [`WRITER`] one writer, else the number of readers.
    host_claim: AtomicUsize,
}

/// The host claim of a buffer that one writer holds.
const WRITER: usize = usize::MAX;

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
        if allocation
            .as_ref()
            .is_some_and(|a| a.size() < len_bytes as u64)
        {
            return Err(TensorError::Device {
                op: "allocate",
                reason: format!(
                    "the backend handed out fewer than the {len_bytes} bytes asked for"
                ),
            });
        }
        Ok(Buffer {
            allocation,
            len_bytes,
            backend: Arc::clone(backend),
            version: Arc::default(),
            host_claim: AtomicUsize::new(0),
        })
    }

    /// The allocator that handed out the memory (`None` for an empty buffer, which has none). A
    /// backend compares it with its own allocator's before it touches the memory.
    pub fn allocator(&self) -> Option<AllocatorId> {
        self.allocation.as_ref().map(Allocation::allocator)
    }

    /// `Ok` when the memory came from the allocator `owner` (a backend's own), or there is no
    /// memory (an empty buffer): what a backend checks before it reads or writes a buffer.
    pub fn check_owner(&self, op: &'static str, owner: AllocatorId) -> Result<()> {
        if self.allocation.is_none() || self.allocator() == Some(owner) {
            return Ok(());
        }
        Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "a {:?} buffer of another backend (or allocator) was passed to this one; move \
                 the tensor to this backend first",
                self.device()
            ),
        })
    }

    /// Whether the bytes are host memory the process may read and write directly (they come from
    /// a host storage; false for an empty buffer).
    pub fn is_host_memory(&self) -> bool {
        self.allocation
            .as_ref()
            .is_some_and(Allocation::is_host_memory)
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

/// What a host computation does with a buffer it claims through [`HostAccess`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads only: other readers may hold the buffer at the same time.
    Read,
    /// Writes (and may read): the buffer is held alone.
    Write,
}

/// Buffers claimed for one host computation, released when dropped.
///
/// [`Tensor`](crate::Tensor) is `Send + Sync`, and host memory is written through raw pointers,
/// so a CPU kernel (or an optimizer's host update) claims every buffer it touches for its
/// duration: a write alone, a read with other readers only. A claim never waits: when another
/// thread holds a buffer in a conflicting way, [`HostAccess::claim`] fails with
/// [`TensorError::ConcurrentAccess`] and nothing is touched. Waiting could deadlock, as a thread
/// that holds claims and waits inside rayon may run another task that needs them.
#[derive(Debug)]
#[must_use = "the buffers are released as soon as the claim is dropped"]
pub struct HostAccess<'a> {
    held: SmallVec<[(&'a Buffer, Access); 8]>,
}

impl<'a> HostAccess<'a> {
    /// Claims `buffers` for `op`, each for its [`Access`]; a buffer named more than once is
    /// claimed once, for writing if any entry writes it. Empty buffers have no memory and are
    /// not claimed.
    pub fn claim(
        op: &'static str,
        buffers: impl IntoIterator<Item = (&'a Buffer, Access)>,
    ) -> Result<HostAccess<'a>> {
        let mut wanted: SmallVec<[(&'a Buffer, Access); 8]> = SmallVec::new();
        for (buffer, access) in buffers {
            if buffer.len_bytes == 0 {
                continue;
            }
            match wanted.iter_mut().find(|(b, _)| std::ptr::eq(*b, buffer)) {
                Some((_, held)) if access == Access::Write => *held = Access::Write,
                Some(_) => {}
                None => wanted.push((buffer, access)),
            }
        }
        let mut res = HostAccess {
            held: SmallVec::with_capacity(wanted.len()),
        };
        for (buffer, access) in wanted {
            if !buffer.try_claim(access) {
                // `res` releases what was claimed so far.
                return Err(TensorError::ConcurrentAccess {
                    op,
                    what: match access {
                        Access::Read => "an input",
                        Access::Write => "an output",
                    },
                });
            }
            res.held.push((buffer, access));
        }
        Ok(res)
    }
}

impl Drop for HostAccess<'_> {
    fn drop(&mut self) {
        for (buffer, access) in &self.held {
            buffer.release_claim(*access);
        }
    }
}

impl Buffer {
    fn try_claim(&self, access: Access) -> bool {
        match access {
            Access::Write => self
                .host_claim
                .compare_exchange(0, WRITER, Ordering::Acquire, Ordering::Relaxed)
                .is_ok(),
            Access::Read => self
                .host_claim
                .fetch_update(Ordering::Acquire, Ordering::Relaxed, |held| {
                    (held < WRITER - 1).then(|| held + 1)
                })
                .is_ok(),
        }
    }

    fn release_claim(&self, access: Access) {
        match access {
            Access::Write => self.host_claim.store(0, Ordering::Release),
            Access::Read => {
                self.host_claim.fetch_sub(1, Ordering::Release);
            }
        }
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
