//! [`Plugin`]: one caching allocator as an external framework sees it — raw addresses in, raw
//! addresses out, streams named by their raw handles.
//!
//! PyTorch's pluggable interface hands over a size and a `cudaStream_t` and takes back a bare
//! pointer; it frees by pointer. The caching allocator works with [`Allocation`] values (not
//! `Clone`, so never freed twice) and [`StreamId`]s. A plugin keeps the live allocations by
//! address and gives each raw stream handle an id the first time it sees it ([`StreamSource`]
//! says how a storage names one). Everything else — statistics, summaries, history, snapshots,
//! `empty_cache` — is the caching allocator's own.
//!
//! This module sits on headroom-caching-allocator; it knows nothing about PyTorch or C, and
//! nothing about how a storage obtains memory.

use std::io::{BufWriter, Write};
use std::path::Path;

use headroom_caching_allocator::{
    write_pickle, Allocation, AllocatorConfig, CachingAllocator, HistoryOptions, HostStorage,
    Storage, StreamId,
};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::error::PluginError;

/// How a storage names a stream handle it is given as a raw integer (a `cudaStream_t`).
pub trait StreamSource: Storage + Sized {
    /// The id under which `allocator`'s storage knows `raw` from now on. `next` is an id not
    /// given out before (1, 2, ... in order of first sight), for storages without streams of
    /// their own. Called once per handle; handle 0 (the legacy default stream) is always
    /// [`StreamId::DEFAULT`] and never reaches this.
    ///
    /// # Safety
    /// `raw` must be a stream of the storage's device that stays valid for as long as the
    /// allocator lives (PyTorch's streams do: its pool never destroys them).
    unsafe fn lend_stream(allocator: &CachingAllocator<Self>, raw: usize, next: u64) -> StreamId;
}

impl StreamSource for HostStorage {
    /// Host memory has no streams; an id per handle keeps PyTorch's per-stream pools apart.
    unsafe fn lend_stream(_: &CachingAllocator<Self>, _: usize, next: u64) -> StreamId {
        StreamId(next)
    }
}

#[cfg(feature = "cuda")]
impl StreamSource for headroom_caching_allocator::CudaStorage {
    /// Lends the stream to the storage, which records events on it for `record_stream`.
    unsafe fn lend_stream(allocator: &CachingAllocator<Self>, raw: usize, _: u64) -> StreamId {
        // SAFETY: lending a stream frees nothing and writes no memory of an allocation; the
        // caller guarantees the stream is valid for the allocator's life.
        unsafe { allocator.with_storage_mut(|storage| storage.register_stream(raw as *mut _)) }
    }
}

/// A caching allocator serving raw addresses on raw stream handles.
#[derive(Debug)]
pub struct Plugin<S: StreamSource> {
    allocator: CachingAllocator<S>,
    live: Mutex<FxHashMap<u64, Allocation>>,
    streams: Mutex<FxHashMap<usize, StreamId>>,
}

impl<S: StreamSource> Plugin<S> {
    /// A plugin over `storage` with `config`.
    pub fn new(storage: S, config: AllocatorConfig) -> Plugin<S> {
        Plugin {
            allocator: CachingAllocator::new(storage, config),
            live: Mutex::new(FxHashMap::default()),
            streams: Mutex::new(FxHashMap::default()),
        }
    }

    /// The caching allocator behind it (statistics, history, snapshots).
    pub fn allocator(&self) -> &CachingAllocator<S> {
        &self.allocator
    }

    /// The id of raw stream handle `raw` (0: the default stream).
    ///
    /// # Safety
    /// As [`StreamSource::lend_stream`]: `raw` must outlive the allocator.
    pub unsafe fn stream(&self, raw: usize) -> StreamId {
        if raw == 0 {
            return StreamId::DEFAULT;
        }
        let mut streams = self.streams.lock();
        let next = streams.len() as u64 + 1;
        *streams
            .entry(raw)
            // SAFETY: forwarded from the caller.
            .or_insert_with(|| unsafe { S::lend_stream(&self.allocator, raw, next) })
    }

    /// `size` bytes on raw stream `raw`, as an address; 0 bytes give address 0, as PyTorch's
    /// own allocator gives a null pointer.
    ///
    /// # Safety
    /// As [`StreamSource::lend_stream`]: `raw` must outlive the allocator.
    pub unsafe fn allocate(&self, size: u64, raw: usize) -> Result<u64, PluginError> {
        if size == 0 {
            return Ok(0);
        }
        // SAFETY: forwarded from the caller.
        let stream = unsafe { self.stream(raw) };
        let allocation = self.allocator.allocate(size, stream)?;
        let address = allocation.address();
        self.live.lock().insert(address, allocation);
        Ok(address)
    }

    /// Frees the allocation at `address` (0 is a no-op); it returns to the pool of the stream it
    /// was allocated on, reused once the streams recorded on it are done.
    pub fn free(&self, address: u64) -> Result<(), PluginError> {
        if address == 0 {
            return Ok(());
        }
        let allocation = self
            .live
            .lock()
            .remove(&address)
            .ok_or(headroom_caching_allocator::AllocError::UnknownAddress { address })?;
        self.allocator.free(allocation)?;
        Ok(())
    }

    /// Marks the allocation at `address` as used by raw stream `raw` too (`Tensor.record_stream`):
    /// its memory is reused only after the work queued on `raw` up to its free completes.
    ///
    /// # Safety
    /// As [`StreamSource::lend_stream`]: `raw` must outlive the allocator.
    pub unsafe fn record_stream(&self, address: u64, raw: usize) -> Result<(), PluginError> {
        // SAFETY: forwarded from the caller.
        let stream = unsafe { self.stream(raw) };
        self.allocator.record_stream_address(address, stream)?;
        Ok(())
    }

    /// Allocations handed out and not yet freed.
    pub fn live_allocations(&self) -> usize {
        self.live.lock().len()
    }

    /// Every statistic of `torch.cuda.memory_stats()`, as a JSON object of flat keys
    /// (`"allocated_bytes.all.peak"`, ...).
    pub fn memory_stats_json(&self) -> String {
        let map = self.allocator.memory_stats().to_flat_map();
        serde_json::to_string(&map).expect("a map of strings to integers serialises")
    }

    /// `torch.cuda.memory_summary()`'s table, with Headroom's fragmentation lines.
    pub fn memory_summary(&self, abbreviated: bool) -> String {
        self.allocator.memory_summary(abbreviated)
    }

    /// Starts (`Some`) or stops (`None`) recording history for snapshots.
    pub fn record_history(&self, options: Option<HistoryOptions>) {
        self.allocator.record_history(options);
    }

    /// Writes the allocator's snapshot as a pickle that <https://pytorch.org/memory_viz> opens.
    pub fn write_snapshot(&self, path: &Path) -> Result<(), PluginError> {
        let io = headroom_caching_allocator::AllocError::Io;
        let mut writer = BufWriter::new(std::fs::File::create(path).map_err(io)?);
        write_pickle(&self.allocator.snapshot(), &mut writer)?;
        writer.flush().map_err(io)?;
        Ok(())
    }
}
