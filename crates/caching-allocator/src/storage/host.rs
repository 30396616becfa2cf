//! Host memory as a storage: real, zero-initialised allocations from the global allocator.
//!
//! This is the storage of the CPU backend and of tests that need to write through the
//! addresses they get. Work on the host is synchronous, so every event is complete as soon as it is
//! recorded. It cannot map pages, so the allocator runs the classic segment policy on it.

use std::alloc::Layout;
use std::collections::HashMap;

use super::{EventId, MemoryInfo, Storage, StorageError, StreamId};

/// Alignment of every host segment: a cache line and a SIMD register are far below it, and it
/// matches the 512-byte granularity of the policy.
const HOST_SEGMENT_ALIGN: usize = 4096;

/// Real host allocations, with an optional capacity so out-of-memory can be exercised.
#[derive(Debug)]
pub struct HostStorage {
    capacity: u64,
    in_use: u64,
    segments: HashMap<u64, Layout>,
    next_event: u64,
}

impl HostStorage {
    /// A host storage limited only by the machine.
    pub fn new() -> Self {
        Self::with_capacity(u64::MAX)
    }

    /// A host storage that reports out-of-memory once `capacity` bytes of segments are live.
    pub fn with_capacity(capacity: u64) -> Self {
        HostStorage {
            capacity,
            in_use: 0,
            segments: HashMap::new(),
            next_event: 0,
        }
    }

    /// Bytes of segments currently allocated.
    pub fn bytes_in_use(&self) -> u64 {
        self.in_use
    }
}

impl Default for HostStorage {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: segments are `std::alloc` allocations of exactly the requested size and 4096-byte
// alignment (looked up again to free them), owned by this storage until `free_segment`; it maps
// no pages.
unsafe impl Storage for HostStorage {
    const HOST_MEMORY: bool = true;

    fn name(&self) -> &'static str {
        "host"
    }

    fn allocate_segment(&mut self, size: u64) -> Result<u64, StorageError> {
        if size == 0 || self.in_use.saturating_add(size) > self.capacity {
            return Err(StorageError::OutOfMemory { requested: size });
        }
        let layout = usize::try_from(size)
            .ok()
            .and_then(|size| Layout::from_size_align(size, HOST_SEGMENT_ALIGN).ok())
            .ok_or(StorageError::OutOfMemory { requested: size })?;
        // SAFETY: `layout` has a non-zero size (checked above) and a valid power-of-two alignment.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(StorageError::OutOfMemory { requested: size });
        }
        let address = ptr as u64;
        self.segments.insert(address, layout);
        self.in_use += size;
        Ok(address)
    }

    fn free_segment(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        let layout = self.segments.remove(&address).ok_or_else(|| {
            StorageError::InvalidRange(format!("no host segment at {address:#x}"))
        })?;
        if layout.size() as u64 != size {
            self.segments.insert(address, layout);
            return Err(StorageError::InvalidRange(format!(
                "host segment at {address:#x} has {} bytes, not {size}",
                layout.size()
            )));
        }
        // SAFETY: `address` came from `alloc_zeroed` with exactly this layout (looked up above)
        // and is removed from the table, so it is freed once.
        unsafe { std::alloc::dealloc(address as *mut u8, layout) };
        self.in_use -= size;
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        MemoryInfo {
            free: self.capacity.saturating_sub(self.in_use),
            total: self.capacity,
        }
    }

    fn record_event(&mut self, _stream: StreamId) -> Result<EventId, StorageError> {
        self.next_event += 1;
        Ok(EventId(self.next_event))
    }

    fn query_event(&mut self, _event: EventId) -> Result<bool, StorageError> {
        Ok(true)
    }

    fn synchronize_event(&mut self, _event: EventId) -> Result<(), StorageError> {
        Ok(())
    }

    fn release_event(&mut self, _event: EventId) {}
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        for (address, layout) in self.segments.drain() {
            // SAFETY: every entry was allocated with this layout and is freed exactly once here.
            unsafe { std::alloc::dealloc(address as *mut u8, layout) };
        }
    }
}
