//! Page-locked ("pinned") host memory from the CUDA driver, as a storage: the caching policy over
//! it is PyTorch's `CachingHostAllocator`.
//!
//! Segments are `cuMemHostAlloc` allocations (`CU_MEMHOSTALLOC_PORTABLE`), zeroed once when
//! obtained so every byte a block hands out has been written; `cuMemFreeHost` returns them. The
//! copy engines read and write such memory directly, which is what makes host↔device copies
//! asynchronous and fast. The storage cannot map pages, so the policy runs its classic segments
//! (rounding, splitting, reuse and statistics unchanged).
//!
//! Streams and events are the device's: a block that an asynchronous copy on stream `s` uses is
//! marked with `record_stream(s)`; its free then records an event on `s`, and the policy reuses it
//! only once that event completes. Blocks are allocated on
//! [`PinnedHostStorage::HOST_STREAM`], a stream id no device work runs on, so even a copy on the
//! device's default stream is waited for before the host gets the block again. Device streams are
//! lent by the caller under the ids its device allocator uses
//! ([`PinnedHostStorage::register_stream`]).
//!
//! Like `CudaStorage` it loads the driver at run time and fails with an `Err`, never a panic, on a
//! machine without one. It knows nothing about blocks, pools or statistics.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result;
use cudarc::driver::sys;

use super::driver::{
    admit_segment, alloc_error, check_segment, driver_error, DeviceContext, ErrorTally, EventPool,
    StreamTable,
};
use super::{EventId, MemoryInfo, Storage, StorageError, StreamId};

/// Errors met while a [`PinnedHostStorage`] was dropped, over the whole process.
static DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Settings of a [`PinnedHostStorage`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PinnedHostOptions {
    /// Fail with [`StorageError::OutOfMemory`] once this many bytes of segments are held, without
    /// asking the driver; [`Storage::memory_info`] reports it as the total. `None`: no limit but
    /// the machine's (pinned memory cannot be swapped out, so a limit is a kindness to the host).
    pub memory_limit: Option<u64>,
}

/// Page-locked host memory of one CUDA device's context, through the driver API.
#[derive(Debug)]
pub struct PinnedHostStorage {
    context: DeviceContext,
    options: PinnedHostOptions,
    /// Bytes of segments held.
    held: u64,
    /// Segments: start address → bytes.
    segments: HashMap<u64, u64>,
    streams: StreamTable,
    events: EventPool,
}

impl PinnedHostStorage {
    /// The stream id pinned blocks are allocated on: host work, so an event recorded on it is
    /// complete at once, and it is never a device stream.
    pub const HOST_STREAM: StreamId = StreamId(u64::MAX);

    /// Pinned memory for device `device_ordinal`, with no limit.
    ///
    /// Fails with [`StorageError::Device`] when the driver library is missing, the driver does
    /// not start, or there is no such device.
    pub fn new(device_ordinal: usize) -> Result<PinnedHostStorage, StorageError> {
        Self::with_options(device_ordinal, PinnedHostOptions::default())
    }

    /// Pinned memory for device `device_ordinal` with `options`.
    pub fn with_options(
        device_ordinal: usize,
        options: PinnedHostOptions,
    ) -> Result<PinnedHostStorage, StorageError> {
        let context = DeviceContext::retain(device_ordinal)?;
        Ok(PinnedHostStorage {
            context,
            options,
            held: 0,
            segments: HashMap::new(),
            streams: StreamTable::default(),
            events: EventPool::default(),
        })
    }

    /// The ordinal of the device whose context the memory is pinned for.
    pub fn device_ordinal(&self) -> usize {
        self.context.ordinal
    }

    /// The settings the storage was made with.
    pub fn options(&self) -> &PinnedHostOptions {
        &self.options
    }

    /// Bytes of segments this storage holds now.
    pub fn bytes_in_use(&self) -> u64 {
        self.held
    }

    /// Errors met by every `PinnedHostStorage` dropped so far in this process. `Drop` cannot
    /// return them and never prints; use [`PinnedHostStorage::close`] to see the first one.
    pub fn drop_errors() -> u64 {
        DROP_ERRORS.load(Ordering::Relaxed)
    }

    /// Lends device stream `raw_stream` to the storage under `id`, so blocks used on it can be
    /// freed behind its events. Use the id the device allocator knows the stream by.
    /// [`StreamId::DEFAULT`] (the legacy default stream) is always known; it and
    /// [`PinnedHostStorage::HOST_STREAM`] cannot be registered, nor an id twice.
    ///
    /// # Safety
    /// `raw_stream` must be a valid stream (a `CUstream`) of this device's primary context, and it
    /// must stay valid for as long as blocks recorded on it may be freed, i.e. until the
    /// allocator over this storage is dropped.
    pub unsafe fn register_stream(
        &mut self,
        id: StreamId,
        raw_stream: *mut c_void,
    ) -> Result<(), StorageError> {
        self.streams
            .lend_as(id, raw_stream.cast(), &[Self::HOST_STREAM])
    }

    /// Releases everything the storage holds and returns the first error met, where `Drop`
    /// would only count it.
    pub fn close(mut self) -> Result<(), StorageError> {
        self.teardown().first.map_or(Ok(()), Err)
    }

    fn limit(&self) -> u64 {
        self.options.memory_limit.unwrap_or(u64::MAX)
    }

    /// Waits for the device, then frees every segment and event; returns the errors met.
    fn teardown(&mut self) -> ErrorTally {
        let mut tally = ErrorTally::default();
        if self.context.is_released() {
            return tally;
        }
        tally.note(self.context.bind());
        tally.note(self.context.synchronize());
        self.events.destroy_all(&mut tally);
        for (address, _) in self.segments.drain() {
            // SAFETY: `address` came from `cuMemHostAlloc` and is freed once; the context is
            // synchronized, so no copy uses it any more.
            tally.note(
                unsafe { result::free_host(address as *mut c_void) }
                    .map_err(|err| driver_error("cuMemFreeHost", err)),
            );
        }
        // Lent streams only: the table destroys nothing it did not create.
        self.streams.destroy_all(&mut tally);
        self.held = 0;
        tally.note(self.context.release());
        tally
    }
}

// SAFETY: segments are page-locked host allocations from the driver, owned by this storage until
// `free_segment`; it maps no pages.
unsafe impl Storage for PinnedHostStorage {
    const HOST_MEMORY: bool = true;

    fn name(&self) -> &'static str {
        "pinned"
    }

    fn allocate_segment(&mut self, size: u64) -> Result<u64, StorageError> {
        let bytes = admit_segment(size, self.held, self.limit())?;
        self.context.bind()?;
        // SAFETY: a plain allocation of the current context; the memory is only handed out.
        let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|err| alloc_error("cuMemHostAlloc", err, size))?;
        if ptr.is_null() {
            return Err(StorageError::OutOfMemory { requested: size });
        }
        // SAFETY: `ptr` is a fresh host allocation of `bytes` bytes that nothing else uses yet.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        let address = ptr as u64;
        self.segments.insert(address, size);
        self.held += size;
        Ok(address)
    }

    fn free_segment(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        check_segment(&self.segments, address, size)?;
        self.context.bind()?;
        // SAFETY: `address` came from `cuMemHostAlloc` of this storage and is in the table, so it
        // is freed once; the policy frees a segment only when no block of it is in use or pending.
        unsafe { result::free_host(address as *mut c_void) }
            .map_err(|err| driver_error("cuMemFreeHost", err))?;
        self.segments.remove(&address);
        self.held -= size;
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        let total = self.limit();
        MemoryInfo {
            free: total.saturating_sub(self.held),
            total,
        }
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, StorageError> {
        if stream == Self::HOST_STREAM {
            return Ok(self.events.record_complete());
        }
        self.context.bind()?;
        let raw_stream = self.streams.get(stream)?;
        self.events.record(raw_stream)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, StorageError> {
        self.context.bind()?;
        self.events.query(event)
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), StorageError> {
        self.context.bind()?;
        self.events.synchronize(event)
    }

    fn release_event(&mut self, event: EventId) {
        self.events.release(event);
    }

    fn synchronize_device(&mut self) -> Result<(), StorageError> {
        self.context.bind()?;
        self.context.synchronize()
    }
}

impl Drop for PinnedHostStorage {
    fn drop(&mut self) {
        DROP_ERRORS.fetch_add(self.teardown().count, Ordering::Relaxed);
    }
}
