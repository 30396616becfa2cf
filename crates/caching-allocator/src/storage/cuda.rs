//! Device memory from the CUDA driver API, through cudarc.
//!
//! Segments are `cuMemAlloc` allocations. Expandable segments use the virtual memory management
//! calls: `cuMemAddressReserve` for the address space, then `cuMemCreate` handles mapped with
//! `cuMemMap` and opened with `cuMemSetAccess`. By default each allocator page (2 MiB on an
//! H200) is its own handle, which lets [`Storage::unmap`] release any page-aligned sub-range of
//! earlier maps: CUDA unmaps only whole mappings, and the allocator unmaps the free pages inside
//! a segment wherever they fall. A reservation's [`MappingUnits::max_handle`] trades that for
//! fewer driver calls; the handle bookkeeping is `super::handles`. Each handle is released right
//! after it is mapped, so the mapping alone keeps the memory alive and unmapping frees it.
//!
//! Streams and events are real: `StreamId(0)` is the context's legacy default stream (or, with
//! [`CudaStorageOptions::own_default_stream`], a blocking stream the storage creates, which CUDA
//! graphs can capture), other ids are streams made by [`CudaStorage::new_stream`] or lent by
//! [`CudaStorage::register_stream`].
//! Events come from a pool created with `CU_EVENT_DISABLE_TIMING`.
//!
//! The driver library is loaded at run time. [`CudaStorage::new`] checks that it is there and
//! that the device exists before calling anything else, so a machine without CUDA gets an `Err`,
//! never a panic.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result;
use cudarc::driver::sys;

use super::driver::{
    admit_segment, alloc_error, check_segment, driver_error, DeviceContext, ErrorTally, EventPool,
    StreamTable,
};
use super::handles::{plan_handles, HandleRun, HandleTable};
use super::{EventId, MappingUnits, MemoryInfo, Storage, StorageError, StreamId};

/// Errors met while a [`CudaStorage`] was dropped, over the whole process.
static DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Settings of a [`CudaStorage`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaStorageOptions {
    /// Pretend the card has only this many bytes for this storage: segments and mapped pages
    /// beyond it fail with [`StorageError::OutOfMemory`] without asking the driver, and
    /// [`Storage::memory_info`] reports it as the total. `None`: the card's real memory.
    pub memory_limit: Option<u64>,
    /// `StreamId::DEFAULT` names a stream the storage creates with the default flags (it is
    /// ordered with the context's legacy default stream, both ways, as the legacy stream is with
    /// every blocking stream) instead of the legacy default stream itself. Work on it can be
    /// captured into a CUDA graph, which the legacy stream's cannot. `false`: the legacy stream.
    pub own_default_stream: bool,
}

#[derive(Debug, Clone, Copy)]
struct Reservation {
    /// Bytes asked for; `release_address_space` must name the same.
    requested: u64,
    /// Bytes reserved from the driver: `requested` rounded up to the granularity.
    reserved: u64,
    /// How the allocator maps this reservation.
    units: MappingUnits,
}

/// Device memory of one CUDA device, through the driver API.
#[derive(Debug)]
pub struct CudaStorage {
    context: DeviceContext,
    options: CudaStorageOptions,
    total_memory: u64,
    supports_vmm: bool,
    granularity: u64,
    /// Bytes of segments and mapped chunks held.
    held: u64,
    segments: HashMap<u64, u64>,
    reservations: BTreeMap<u64, Reservation>,
    /// Mapped handles.
    mapped: HandleTable,
    streams: StreamTable,
    events: EventPool,
}

impl CudaStorage {
    /// A storage on device `device_ordinal`, with the card's whole memory.
    ///
    /// Fails with [`StorageError::Device`] when the driver library is missing, the driver does
    /// not start, or there is no such device.
    pub fn new(device_ordinal: usize) -> Result<CudaStorage, StorageError> {
        Self::with_options(device_ordinal, CudaStorageOptions::default())
    }

    /// A storage on device `device_ordinal` with `options`.
    pub fn with_options(
        device_ordinal: usize,
        options: CudaStorageOptions,
    ) -> Result<CudaStorage, StorageError> {
        let context = DeviceContext::retain(device_ordinal)?;
        let device = context.device;
        let mut storage = CudaStorage {
            context,
            options,
            total_memory: 0,
            supports_vmm: false,
            granularity: 2 << 20,
            held: 0,
            segments: HashMap::new(),
            reservations: BTreeMap::new(),
            mapped: HandleTable::default(),
            streams: StreamTable::default(),
            events: EventPool::default(),
        };
        // From here on, dropping `storage` releases the context on any error.
        storage.bind()?;
        if storage.options.own_default_stream {
            storage.streams.create_default()?;
        }
        // SAFETY: `device` was returned by `cuDeviceGet`.
        storage.total_memory = unsafe { result::device::total_mem(device) }
            .map_err(|err| driver_error("cuDeviceTotalMem", err))?
            as u64;
        // SAFETY: `device` was returned by `cuDeviceGet`; the attribute exists since CUDA 10.2.
        let vmm = unsafe {
            result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            )
        }
        .map_err(|err| driver_error("cuDeviceGetAttribute", err))?;
        if vmm != 0 {
            let prop = storage.allocation_prop();
            let mut granularity = 0usize;
            // SAFETY: `granularity` and `prop` are valid for the duration of the call.
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            }
            .result()
            .map_err(|err| driver_error("cuMemGetAllocationGranularity", err))?;
            if granularity > 0 {
                storage.supports_vmm = true;
                storage.granularity = granularity as u64;
            }
        }
        Ok(storage)
    }

    /// The ordinal of the storage's device.
    pub fn device_ordinal(&self) -> usize {
        self.context.ordinal
    }

    /// The device's name, e.g. "NVIDIA H200"; empty if the driver cannot say.
    pub fn device_name(&self) -> String {
        self.context.device_name()
    }

    /// The settings the storage was made with.
    pub fn options(&self) -> &CudaStorageOptions {
        &self.options
    }

    /// Bytes of segments and mapped pages this storage holds now.
    pub fn bytes_in_use(&self) -> u64 {
        self.held
    }

    /// Errors met by every `CudaStorage` dropped so far in this process (a failed free, unmap,
    /// destroy or context release). `Drop` cannot return them and never prints; use
    /// [`CudaStorage::close`] to see the first one.
    pub fn drop_errors() -> u64 {
        DROP_ERRORS.load(Ordering::Relaxed)
    }

    /// Creates a non-blocking stream (`CU_STREAM_NON_BLOCKING`) and returns its id, a small
    /// integer starting at 1.
    pub fn new_stream(&mut self) -> Result<StreamId, StorageError> {
        self.bind()?;
        self.streams.create()
    }

    /// Lends an existing stream (a `CUstream`, e.g. from cudarc's `CudaStream::cu_stream`) to the
    /// storage under a new id. The storage never destroys it.
    ///
    /// # Safety
    /// `raw_stream` must be a valid stream of this device's primary context, and it must outlive
    /// the storage.
    pub unsafe fn register_stream(&mut self, raw_stream: *mut c_void) -> StreamId {
        self.streams.lend(raw_stream.cast())
    }

    /// The `CUstream` behind `stream` (null for [`StreamId::DEFAULT`] unless the storage owns it:
    /// [`CudaStorageOptions::own_default_stream`]), for launching work on it; `None` for an id
    /// the storage does not know.
    pub fn raw_stream(&self, stream: StreamId) -> Option<*mut c_void> {
        self.stream(stream).ok().map(|raw| raw.cast())
    }

    /// Waits for the work queued on `stream` (`cuStreamSynchronize`).
    pub fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), StorageError> {
        self.bind()?;
        let raw = self.stream(stream)?;
        // SAFETY: `raw` is the null stream or a live stream of the current context.
        unsafe { result::stream::synchronize(raw) }
            .map_err(|err| driver_error("cuStreamSynchronize", err))
    }

    /// Sets `size` bytes at `address` to `byte` (`cuMemsetD8`, ordered on the default stream).
    /// The range must lie inside one segment or mapped range of this storage.
    pub fn memset(&mut self, address: u64, byte: u8, size: u64) -> Result<(), StorageError> {
        self.bind()?;
        self.check_usable(address, size)?;
        // SAFETY: the range lies in memory this storage holds (checked above).
        unsafe { sys::cuMemsetD8_v2(address, byte, size as usize) }
            .result()
            .map_err(|err| driver_error("cuMemsetD8", err))
    }

    /// Queues a memset of `size` bytes at `address` on `stream` (`cuMemsetD8Async`); a way to
    /// give a stream work, for tests and benchmarks.
    pub fn memset_async(
        &mut self,
        stream: StreamId,
        address: u64,
        byte: u8,
        size: u64,
    ) -> Result<(), StorageError> {
        self.bind()?;
        self.check_usable(address, size)?;
        let raw = self.stream(stream)?;
        // SAFETY: the range lies in memory this storage holds (checked above) and `raw` is a
        // stream of the current context.
        unsafe { result::memset_d8_async(address, byte, size as usize, raw) }
            .map_err(|err| driver_error("cuMemsetD8Async", err))
    }

    /// Copies `destination.len()` bytes from device `address` to the host (`cuMemcpyDtoH`).
    pub fn copy_to_host(
        &mut self,
        address: u64,
        destination: &mut [u8],
    ) -> Result<(), StorageError> {
        self.bind()?;
        self.check_usable(address, destination.len() as u64)?;
        // SAFETY: the device range lies in memory this storage holds (checked above) and
        // `destination` is a valid host buffer of that length.
        unsafe { sys::cuMemcpyDtoH_v2(destination.as_mut_ptr().cast(), address, destination.len()) }
            .result()
            .map_err(|err| driver_error("cuMemcpyDtoH", err))
    }

    /// Copies `source` from the host to device `address` (`cuMemcpyHtoD`).
    pub fn copy_from_host(&mut self, address: u64, source: &[u8]) -> Result<(), StorageError> {
        self.bind()?;
        self.check_usable(address, source.len() as u64)?;
        // SAFETY: the device range lies in memory this storage holds (checked above) and
        // `source` is a valid host buffer of that length.
        unsafe { sys::cuMemcpyHtoD_v2(address, source.as_ptr().cast(), source.len()) }
            .result()
            .map_err(|err| driver_error("cuMemcpyHtoD", err))
    }

    /// Releases everything the storage holds and returns the first error met, where `Drop`
    /// would only count it.
    pub fn close(mut self) -> Result<(), StorageError> {
        self.teardown().first.map_or(Ok(()), Err)
    }

    /// Makes the storage's context current on the calling thread.
    fn bind(&self) -> Result<(), StorageError> {
        self.context.bind()
    }

    fn stream(&self, stream: StreamId) -> Result<sys::CUstream, StorageError> {
        self.streams.get(stream)
    }

    /// Physical memory of this device, pinned, with no shareable handle.
    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.context.device,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    fn limit(&self) -> u64 {
        self.options.memory_limit.unwrap_or(u64::MAX)
    }

    /// Whether `[address, address + size)` lies inside one segment or a fully mapped range.
    fn check_usable(&self, address: u64, size: u64) -> Result<(), StorageError> {
        let end = address
            .checked_add(size)
            .ok_or_else(|| out_of_storage(address, size))?;
        if size == 0 {
            return Ok(());
        }
        let in_segment = self
            .segments
            .iter()
            .any(|(&start, &len)| start <= address && end <= start + len);
        if in_segment {
            return Ok(());
        }
        if self.mapped.covers(address, end) {
            Ok(())
        } else {
            Err(out_of_storage(address, size))
        }
    }

    /// Checks that a map or unmap range is page aligned and inside a reservation; returns the
    /// reservation's start.
    fn check_page_range(&self, what: &str, address: u64, size: u64) -> Result<u64, StorageError> {
        if !self.supports_vmm {
            return Err(StorageError::Unsupported);
        }
        if size == 0
            || !address.is_multiple_of(self.granularity)
            || !size.is_multiple_of(self.granularity)
        {
            return Err(StorageError::InvalidRange(format!(
                "{what} of {size} bytes at {address:#x} is not aligned to {} bytes",
                self.granularity
            )));
        }
        match self.reservations.range(..=address).next_back() {
            Some((&start, r)) if address + size <= start + r.reserved => Ok(start),
            _ => Err(StorageError::InvalidRange(format!(
                "{what} of {size} bytes at {address:#x} is outside any reservation"
            ))),
        }
    }

    /// The handles for a map of `size` bytes at `address`, in the reservation at `base`.
    fn plan_map(&self, base: u64, address: u64, size: u64) -> Vec<HandleRun> {
        let units = self
            .reservations
            .get(&base)
            .map_or(MappingUnits::pages(self.granularity), |r| r.units);
        plan_handles(base, units, self.granularity, address, size)
    }

    /// Creates, maps and releases one handle of `size` bytes at `chunk`.
    fn map_chunk(
        &self,
        chunk: u64,
        size: u64,
        prop: &sys::CUmemAllocationProp,
    ) -> Result<(), StorageError> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let requested = size;
        let size = size as usize;
        // SAFETY: `handle` and `prop` are valid for the call; the size is the granularity.
        unsafe { sys::cuMemCreate(&mut handle, size, prop, 0) }
            .result()
            .map_err(|err| alloc_error("cuMemCreate", err, requested))?;
        // SAFETY: `chunk` is a granularity-aligned, unmapped chunk of a reservation of this
        // context (checked by the caller) and `handle` is a fresh allocation of that size.
        let mapped = unsafe { sys::cuMemMap(chunk, size, 0, handle, 0) }.result();
        // SAFETY: `handle` is live; releasing it now leaves the memory alive through the mapping
        // (if any) and frees it when the chunk is unmapped.
        let released = unsafe { sys::cuMemRelease(handle) }.result();
        mapped.map_err(|err| alloc_error("cuMemMap", err, requested))?;
        released.map_err(|err| driver_error("cuMemRelease", err))
    }

    fn unmap_chunk(&self, chunk: u64, size: u64) -> Result<(), StorageError> {
        // SAFETY: `chunk..chunk + size` is one whole mapped handle of this context.
        unsafe { sys::cuMemUnmap(chunk, size as usize) }
            .result()
            .map_err(|err| driver_error("cuMemUnmap", err))
    }

    /// Releases everything; returns the number of errors met and the first of them.
    fn teardown(&mut self) -> ErrorTally {
        let mut tally = ErrorTally::default();
        if self.context.is_released() {
            return tally;
        }
        tally.note(self.bind());
        tally.note(self.context.synchronize());
        self.events.destroy_all(&mut tally);
        for (address, _) in self.segments.drain() {
            // SAFETY: `address` came from `cuMemAlloc` and is freed once; the context is synced.
            tally.note(
                unsafe { result::free_sync(address) }.map_err(|err| driver_error("cuMemFree", err)),
            );
        }
        for run in self.mapped.take_all() {
            for (chunk, size) in run.handles() {
                tally.note(self.unmap_chunk(chunk, size));
            }
        }
        for (address, reservation) in std::mem::take(&mut self.reservations) {
            // SAFETY: the range was reserved by `cuMemAddressReserve` and nothing in it is mapped.
            tally.note(
                unsafe { sys::cuMemAddressFree(address, reservation.reserved as usize) }
                    .result()
                    .map_err(|err| driver_error("cuMemAddressFree", err)),
            );
        }
        self.streams.destroy_all(&mut tally);
        self.held = 0;
        tally.note(self.context.release());
        tally
    }
}

// SAFETY: segments and mapped pages are device memory from the driver (`cuMemAlloc`,
// `cuMemCreate`/`cuMemMap`), owned by this storage until freed or unmapped; it does not claim
// host memory.
unsafe impl Storage for CudaStorage {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn allocate_segment(&mut self, size: u64) -> Result<u64, StorageError> {
        let bytes = admit_segment(size, self.held, self.limit())?;
        self.bind()?;
        // SAFETY: a plain allocation of the current context; the memory is only handed out.
        let address = unsafe { result::malloc_sync(bytes) }
            .map_err(|err| alloc_error("cuMemAlloc", err, size))?;
        self.segments.insert(address, size);
        self.held += size;
        Ok(address)
    }

    fn free_segment(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        check_segment(&self.segments, address, size)?;
        self.bind()?;
        // SAFETY: `address` came from `cuMemAlloc` of this context and is in the table, so it is
        // freed once.
        unsafe { result::free_sync(address) }.map_err(|err| driver_error("cuMemFree", err))?;
        self.segments.remove(&address);
        self.held -= size;
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        let (free, total) = match self.bind().ok().and_then(|()| result::mem_get_info().ok()) {
            Some((free, total)) => (free as u64, total as u64),
            None => (0, self.total_memory),
        };
        match self.options.memory_limit {
            Some(limit) => MemoryInfo {
                free: free.min(limit.saturating_sub(self.held)),
                total: total.min(limit),
            },
            None => MemoryInfo { free, total },
        }
    }

    fn supports_expandable_segments(&self) -> bool {
        self.supports_vmm
    }

    fn page_granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve_address_space(
        &mut self,
        size: u64,
        units: MappingUnits,
    ) -> Result<u64, StorageError> {
        if !self.supports_vmm {
            return Err(StorageError::Unsupported);
        }
        if size == 0 {
            return Err(StorageError::InvalidRange(
                "a reservation of 0 bytes".to_string(),
            ));
        }
        let reserved = size.div_ceil(self.granularity) * self.granularity;
        self.bind()?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: `address` is valid for the call; the size is a multiple of the granularity.
        unsafe { sys::cuMemAddressReserve(&mut address, reserved as usize, 0, 0, 0) }
            .result()
            .map_err(|err| alloc_error("cuMemAddressReserve", err, size))?;
        // A page or handle that is not whole granules falls back to one handle per granule.
        let granules = |bytes: u64| bytes > 0 && bytes.is_multiple_of(self.granularity);
        let page = if granules(units.page) {
            units.page
        } else {
            self.granularity
        };
        let max_handle = if granules(units.max_handle) && units.max_handle >= page {
            units.max_handle
        } else {
            page
        };
        self.reservations.insert(
            address,
            Reservation {
                requested: size,
                reserved,
                units: MappingUnits { page, max_handle },
            },
        );
        Ok(address)
    }

    fn release_address_space(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        let reservation = match self.reservations.get(&address) {
            Some(r) if r.requested == size || r.reserved == size => *r,
            _ => {
                return Err(StorageError::InvalidRange(format!(
                    "no reservation of {size} bytes at {address:#x}"
                )))
            }
        };
        if self
            .mapped
            .overlaps(address, address + reservation.reserved)
        {
            return Err(StorageError::InvalidRange(format!(
                "reservation at {address:#x} still has mapped pages"
            )));
        }
        self.bind()?;
        // SAFETY: the range was reserved by `cuMemAddressReserve` and nothing in it is mapped.
        unsafe { sys::cuMemAddressFree(address, reservation.reserved as usize) }
            .result()
            .map_err(|err| driver_error("cuMemAddressFree", err))?;
        self.reservations.remove(&address);
        Ok(())
    }

    fn map(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        let base = self.check_page_range("map", address, size)?;
        if self.mapped.overlaps(address, address + size) {
            return Err(StorageError::InvalidRange(format!(
                "map of {size} bytes at {address:#x} overlaps mapped pages"
            )));
        }
        if self.held.saturating_add(size) > self.limit() {
            return Err(StorageError::OutOfMemory { requested: size });
        }
        self.bind()?;
        let prop = self.allocation_prop();
        let runs = self.plan_map(base, address, size);
        let mut mapped = Vec::new();
        let mut outcome = Ok(());
        'runs: for run in &runs {
            for (chunk, bytes) in run.handles() {
                outcome = self.map_chunk(chunk, bytes, &prop);
                if outcome.is_err() {
                    break 'runs;
                }
                mapped.push((chunk, bytes));
            }
        }
        if outcome.is_ok() {
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the whole range is mapped (above) and `access` is valid for the call.
            outcome = unsafe { sys::cuMemSetAccess(address, size as usize, &access, 1) }
                .result()
                .map_err(|err| alloc_error("cuMemSetAccess", err, size));
        }
        if let Err(err) = outcome {
            // Roll back: unmap what this call mapped. A failure here leaves nothing to do
            // better than report the first error.
            for (chunk, bytes) in mapped {
                let _ = self.unmap_chunk(chunk, bytes);
            }
            return Err(match err {
                StorageError::OutOfMemory { .. } => StorageError::OutOfMemory { requested: size },
                other => other,
            });
        }
        for run in runs {
            self.mapped.insert(run);
        }
        self.held += size;
        Ok(())
    }

    fn unmap(&mut self, address: u64, size: u64) -> Result<(), StorageError> {
        self.check_page_range("unmap", address, size)?;
        let end = address + size;
        let pieces = self.mapped.whole_handles(address, end).map_err(|reason| {
            StorageError::InvalidRange(format!(
                "unmap of {size} bytes at {address:#x} is not whole mapped handles ({reason}); \
                 ask releasable_range for the part that is"
            ))
        })?;
        self.bind()?;
        for (chunk, bytes) in pieces.iter().flat_map(HandleRun::handles) {
            if let Err(err) = self.unmap_chunk(chunk, bytes) {
                // What was unmapped before the failure is gone; the rest stays mapped.
                self.mapped.remove(address, chunk);
                self.held -= chunk - address;
                return Err(err);
            }
        }
        self.mapped.remove(address, end);
        self.held -= size;
        Ok(())
    }

    fn releasable_range(&self, address: u64, end: u64) -> (u64, u64) {
        self.mapped.releasable(address, end)
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, StorageError> {
        self.bind()?;
        let raw_stream = self.stream(stream)?;
        self.events.record(raw_stream)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, StorageError> {
        self.bind()?;
        self.events.query(event)
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), StorageError> {
        self.bind()?;
        self.events.synchronize(event)
    }

    fn release_event(&mut self, event: EventId) {
        self.events.release(event);
    }

    fn synchronize_device(&mut self) -> Result<(), StorageError> {
        self.bind()?;
        self.context.synchronize()
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        DROP_ERRORS.fetch_add(self.teardown().count, Ordering::Relaxed);
    }
}

fn out_of_storage(address: u64, size: u64) -> StorageError {
    StorageError::InvalidRange(format!(
        "{size} bytes at {address:#x} are not inside one segment or mapped range of this storage"
    ))
}
