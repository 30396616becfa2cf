//! [`AllocatorView`]: what a caller that measures or inspects memory asks of a caching allocator —
//! its statistics and their peaks, emptying its cache, its history, context labels and
//! snapshots — without naming its storage type. Every [`CachingAllocator`] is one (its own
//! methods, forwarded), so a backend hands its allocator out as `&dyn AllocatorView`
//! (autograd-core's `Backend::allocator_view`) and a measurement runs the same on every device.
//!
//! It sits on the allocator's public methods; it knows no backend.

use crate::allocator::{CachingAllocator, ContextGuard};
use crate::error::AllocError;
use crate::history::HistoryOptions;
use crate::snapshot::Snapshot;
use crate::stats::MemoryStats;
use crate::storage::Storage;

/// A caching allocator seen without its storage type: the [`CachingAllocator`] methods a
/// measurement uses (see each there).
///
/// ```
/// use headroom_caching_allocator::{
///     AllocatorConfig, AllocatorView, CachingAllocator, HostStorage, StreamId,
/// };
///
/// let allocator = CachingAllocator::new(HostStorage::new(), AllocatorConfig::default());
/// let view: &dyn AllocatorView = &allocator;
/// let block = allocator.allocate(4096, StreamId::DEFAULT)?;
/// assert_eq!(view.memory_allocated(), 4096);
/// allocator.free(block)?;
/// assert_eq!((view.memory_allocated(), view.max_memory_allocated()), (0, 4096));
/// view.reset_peak_stats();
/// assert_eq!(view.max_memory_allocated(), 0);
/// # Ok::<(), headroom_caching_allocator::AllocError>(())
/// ```
pub trait AllocatorView: Send + Sync {
    /// All statistics (`torch.cuda.memory_stats`).
    fn memory_stats(&self) -> MemoryStats;
    /// Bytes allocated now (`torch.cuda.memory_allocated`).
    fn memory_allocated(&self) -> u64;
    /// Peak of allocated bytes since the last reset (`torch.cuda.max_memory_allocated`).
    fn max_memory_allocated(&self) -> u64;
    /// Bytes reserved now (`torch.cuda.memory_reserved`).
    fn memory_reserved(&self) -> u64;
    /// Peak of reserved bytes since the last reset (`torch.cuda.max_memory_reserved`).
    fn max_memory_reserved(&self) -> u64;
    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    fn reset_peak_stats(&self);
    /// Returns all unused cached memory to the storage (`torch.cuda.empty_cache`).
    fn empty_cache(&self) -> Result<(), AllocError>;
    /// Starts recording history with `options`, or stops and clears it with `None`.
    fn record_history(&self, options: Option<HistoryOptions>);
    /// Pushes a context label until the guard is dropped.
    fn push_context(&self, label: &str) -> ContextGuard<'_>;
    /// The allocator's state in PyTorch's snapshot structure, with the recorded history.
    fn snapshot(&self) -> Snapshot;
}

impl<S: Storage> AllocatorView for CachingAllocator<S> {
    fn memory_stats(&self) -> MemoryStats {
        CachingAllocator::memory_stats(self)
    }
    fn memory_allocated(&self) -> u64 {
        CachingAllocator::memory_allocated(self)
    }
    fn max_memory_allocated(&self) -> u64 {
        CachingAllocator::max_memory_allocated(self)
    }
    fn memory_reserved(&self) -> u64 {
        CachingAllocator::memory_reserved(self)
    }
    fn max_memory_reserved(&self) -> u64 {
        CachingAllocator::max_memory_reserved(self)
    }
    fn reset_peak_stats(&self) {
        CachingAllocator::reset_peak_stats(self);
    }
    fn empty_cache(&self) -> Result<(), AllocError> {
        CachingAllocator::empty_cache(self)
    }
    fn record_history(&self, options: Option<HistoryOptions>) {
        CachingAllocator::record_history(self, options);
    }
    fn push_context(&self, label: &str) -> ContextGuard<'_> {
        CachingAllocator::push_context(self, label)
    }
    fn snapshot(&self) -> Snapshot {
        CachingAllocator::snapshot(self)
    }
}
