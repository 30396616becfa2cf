//! Where segments come from: the storage half of "allocator = policy × storage".
//!
//! A [`Storage`] hands out whole segments (the `cudaMalloc` level) and, where it can, reserves
//! address space and maps pages into it (the expandable-segment level). It also owns the notion of
//! streams and events, because deferring a free until other streams are done with a block is a
//! property of the device, not of the caching policy.
//!
//! The policy (`crate::allocator`) knows nothing about how a storage gets its memory; a storage
//! knows nothing about blocks, pools, rounding or statistics.
//!
//! Storages shipped here:
//! - [`HostStorage`]: real host allocations, for the CPU backend and for tests; an optional
//!   capacity makes OOM reproducible.
//! - [`SimulatedStorage`]: addresses only, nothing behind them, so a 100 GB trace replays on a
//!   laptop; events complete only when the test says so.
//! - `CudaStorage` (feature `cuda`): the CUDA driver API through cudarc.
//! - `PinnedHostStorage` (feature `cuda`): page-locked host memory for asynchronous copies,
//!   PyTorch's `CachingHostAllocator` once the policy runs over it.

mod handles;
mod host;
mod simulated;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod pinned;

pub use host::HostStorage;
pub use simulated::{EventControl, SegmentPlacement, SimulatedStorage};

#[cfg(feature = "cuda")]
pub use cuda::{CudaStorage, CudaStorageOptions};
#[cfg(feature = "cuda")]
pub use driver::cuda_library_present;
#[cfg(feature = "cuda")]
pub use pinned::{PinnedHostOptions, PinnedHostStorage};

/// A stream of work on the device. Blocks are cached per stream: a block freed on one stream is
/// reused only by allocations on the same stream. `StreamId(0)` is the default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The device's default stream.
    pub const DEFAULT: StreamId = StreamId(0);
}

/// A handle to an event a storage recorded on a stream; see [`Storage::record_event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// Free and total bytes of the device behind a storage, as `cudaMemGetInfo` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryInfo {
    /// Bytes the device could still hand out.
    pub free: u64,
    /// Bytes the device has in all.
    pub total: u64,
}

/// How the allocator maps a reservation: in whole pages of `page` bytes (a multiple of
/// [`Storage::page_granularity`]), which a storage may back with physical handles of up to
/// `max_handle` bytes (a multiple of `page`; `page` itself for one handle per page). Fewer
/// handles map faster; only whole handles unmap ([`Storage::releasable_range`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappingUnits {
    /// Bytes per page.
    pub page: u64,
    /// The most bytes one physical handle backs.
    pub max_handle: u64,
}

impl MappingUnits {
    /// Pages of `page` bytes, one handle each.
    pub fn pages(page: u64) -> MappingUnits {
        MappingUnits {
            page,
            max_handle: page,
        }
    }
}

/// Why a storage could not do what it was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StorageError {
    /// The device has no memory left for this request (`cudaErrorMemoryAllocation`). The
    /// allocator reacts by freeing cached memory and retrying.
    #[error("the device is out of memory ({requested} bytes requested)")]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
    },
    /// The storage cannot map pages (expandable segments need it).
    #[error("this storage cannot reserve address space or map pages")]
    Unsupported,
    /// An address or range that the storage did not hand out.
    #[error("{0}")]
    InvalidRange(String),
    /// The device reported an error that is not out-of-memory.
    #[error("device error: {0}")]
    Device(String),
}

/// Where an allocator's segments come from.
///
/// Addresses are plain `u64`s: device pointers for CUDA, host pointers for [`HostStorage`],
/// invented numbers for [`SimulatedStorage`]. All sizes are in bytes and already rounded by the
/// policy (segments to 2 MiB, pages to [`Storage::page_granularity`]).
///
/// # Safety
/// Code outside the allocator dereferences what a storage hands out, trusting this contract:
/// a segment (or mapped page range) is memory of `size` bytes that nobody else uses until it is
/// freed (unmapped) through this storage; segments and mapped ranges never overlap while live;
/// and when [`Storage::HOST_MEMORY`] is true, every address is host memory the process may read
/// and write, aligned to at least 512 bytes, for as long as the segment or mapping lives.
pub unsafe trait Storage: Send {
    /// Whether segments are host memory the CPU may read and write directly (the CPU backend's
    /// and the optimizers' host kernels rely on it; see the trait's safety contract).
    const HOST_MEMORY: bool = false;

    /// A short name for reports and snapshots ("host", "simulated", "cuda").
    fn name(&self) -> &'static str;

    /// Allocates one segment of `size` bytes (`cudaMalloc`).
    fn allocate_segment(&mut self, size: u64) -> Result<u64, StorageError>;

    /// Returns a segment obtained from [`Storage::allocate_segment`] (`cudaFree`).
    fn free_segment(&mut self, address: u64, size: u64) -> Result<(), StorageError>;

    /// Free and total device memory.
    fn memory_info(&self) -> MemoryInfo;

    /// Whether [`Storage::reserve_address_space`] and [`Storage::map`] work. When false, the
    /// allocator uses classic segments whatever `expandable_segments` says.
    fn supports_expandable_segments(&self) -> bool {
        false
    }

    /// The granularity that [`Storage::map`] and [`Storage::unmap`] ranges are multiples of.
    fn page_granularity(&self) -> u64 {
        2 << 20
    }

    /// Reserves `size` bytes of address space with nothing mapped (`cuMemAddressReserve`).
    ///
    /// The allocator maps and unmaps this reservation only in whole pages of `units.page` bytes
    /// aligned to the reservation's start, so a storage may back each page with one physical
    /// allocation, or a map's pages with handles of up to `units.max_handle` bytes.
    fn reserve_address_space(
        &mut self,
        size: u64,
        units: MappingUnits,
    ) -> Result<u64, StorageError> {
        let _ = (size, units);
        Err(StorageError::Unsupported)
    }

    /// Releases address space from [`Storage::reserve_address_space`]; nothing in it is mapped.
    fn release_address_space(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        let _ = (address, size);
        Err(StorageError::Unsupported)
    }

    /// Backs `[address, address + size)` of reserved space with physical memory
    /// (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`).
    fn map(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        let _ = (address, size);
        Err(StorageError::Unsupported)
    }

    /// Releases the physical memory behind `[address, address + size)`, which was mapped by one
    /// or more earlier [`Storage::map`] calls on page boundaries and is made of whole handles
    /// (see [`Storage::releasable_range`]).
    fn unmap(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        let _ = (address, size);
        Err(StorageError::Unsupported)
    }

    /// The largest part of `[address, end)` (page aligned, mapped) that [`Storage::unmap`] can
    /// release: the range shrunk to the edges of the physical handles behind it, empty
    /// (`start >= end`) when no whole handle lies inside. A storage with one handle per page
    /// returns the range as it is.
    fn releasable_range(&self, address: u64, end: u64) -> (u64, u64) {
        (address, end)
    }

    /// Records an event on `stream` after the work queued so far (`cudaEventRecord`).
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, StorageError>;

    /// Whether the work before `event` has finished (`cudaEventQuery`).
    fn query_event(&mut self, event: EventId) -> Result<bool, StorageError>;

    /// Waits for `event` to complete (`cudaEventSynchronize`).
    fn synchronize_event(&mut self, event: EventId) -> Result<(), StorageError>;

    /// Returns an event that is no longer needed to the storage's pool.
    fn release_event(&mut self, event: EventId);

    /// Waits for all work on the device (`cudaDeviceSynchronize`); called before unmapping pages.
    fn synchronize_device(&mut self) -> Result<(), StorageError> {
        Ok(())
    }
}
