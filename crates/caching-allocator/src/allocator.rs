//! The caching policy: PyTorch's caching allocator over any [`Storage`].
//! (Being written; the public API below is fixed.)

use crate::config::AllocatorConfig;
use crate::error::AllocError;
use crate::history::HistoryOptions;
use crate::snapshot::Snapshot;
use crate::stats::{FragmentationStats, MemoryStats};
use crate::storage::{Storage, StreamId};

/// A live allocation: the block handed out by [`CachingAllocator::allocate`]. Give it back with
/// [`CachingAllocator::free`]; it is not `Clone`, so it cannot be freed twice.
#[derive(Debug, PartialEq, Eq, Hash)]
#[must_use = "an allocation that is dropped without `free` stays allocated"]
pub struct Allocation {
    address: u64,
    size: u64,
    requested: u64,
    stream: StreamId,
}

impl Allocation {
    /// Start address (device pointer, host pointer or simulated address).
    pub fn address(&self) -> u64 {
        self.address
    }
    /// Bytes reserved for it (the request rounded up, or a whole unsplit block).
    pub fn size(&self) -> u64 {
        self.size
    }
    /// Bytes the caller asked for.
    pub fn requested(&self) -> u64 {
        self.requested
    }
    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
}

/// The caching allocator.
#[derive(Debug)]
pub struct CachingAllocator<S: Storage> {
    _storage: parking_lot::Mutex<S>,
    config: AllocatorConfig,
}

/// Pops the context label pushed by [`CachingAllocator::push_context`] when dropped.
#[derive(Debug)]
pub struct ContextGuard<'a, S: Storage> {
    allocator: &'a CachingAllocator<S>,
}

impl<S: Storage> Drop for ContextGuard<'_, S> {
    fn drop(&mut self) {
        let _ = self.allocator;
    }
}

impl<S: Storage> CachingAllocator<S> {
    /// An allocator over `storage` with `config`.
    pub fn new(storage: S, config: AllocatorConfig) -> Self {
        CachingAllocator { _storage: parking_lot::Mutex::new(storage), config }
    }
    /// The settings in force.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }
    /// Allocates `size` bytes for use on `stream`.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let _ = (size, stream);
        unimplemented!()
    }
    /// Frees an allocation.
    pub fn free(&self, allocation: Allocation) -> Result<(), AllocError> {
        let _ = allocation;
        unimplemented!()
    }
    /// Frees the allocation that starts at `address`.
    pub fn free_address(&self, address: u64) -> Result<(), AllocError> {
        let _ = address;
        unimplemented!()
    }
    /// Marks the allocation as used by `stream`.
    pub fn record_stream(&self, allocation: &Allocation, stream: StreamId) -> Result<(), AllocError> {
        let _ = (allocation, stream);
        unimplemented!()
    }
    /// Returns all unused cached memory to the storage.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        unimplemented!()
    }
    /// All statistics.
    pub fn memory_stats(&self) -> MemoryStats {
        unimplemented!()
    }
    /// Bytes allocated now.
    pub fn memory_allocated(&self) -> u64 {
        unimplemented!()
    }
    /// Bytes reserved now.
    pub fn memory_reserved(&self) -> u64 {
        unimplemented!()
    }
    /// Fragmentation figures.
    pub fn fragmentation_stats(&self) -> FragmentationStats {
        unimplemented!()
    }
    /// Starts (or restarts) recording history.
    pub fn record_history(&self, options: Option<HistoryOptions>) {
        let _ = options;
    }
    /// Pushes a context label.
    pub fn push_context(&self, label: &str) -> ContextGuard<'_, S> {
        let _ = label;
        ContextGuard { allocator: self }
    }
    /// A snapshot.
    pub fn snapshot(&self) -> Snapshot {
        unimplemented!()
    }
    /// Runs `f` on the storage.
    pub fn with_storage<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self._storage.lock())
    }
}
