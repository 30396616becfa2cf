//! The CUDA driver objects both CUDA storages hold: the device's retained primary context, a
//! table of streams, a pool of events, and driver errors as [`StorageError`]s.
//!
//! `CudaStorage` (device memory) and `PinnedHostStorage` (page-locked host memory) differ only in
//! how they obtain memory; the context they run in and the way they defer a free behind a stream
//! event are the same, and live here. This module knows nothing about segments, pages or blocks.
//! Everything in it is `pub(super)`: no driver type leaves the storage module.

use std::collections::HashMap;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::{EventId, StorageError, StreamId};

/// The retained primary context of one device.
#[derive(Debug)]
pub(super) struct DeviceContext {
    pub(super) ordinal: usize,
    pub(super) device: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUDA context is not tied to the thread that retained it. Every storage method makes
// it current on the calling thread (`bind`) before any other driver call, so moving it to another
// thread is sound.
unsafe impl Send for DeviceContext {}

impl DeviceContext {
    /// Loads the driver, checks that device `ordinal` exists and retains its primary context.
    ///
    /// Fails with [`StorageError::Device`] when the driver library is missing, the driver does
    /// not start, or there is no such device; never panics.
    pub(super) fn retain(ordinal: usize) -> Result<DeviceContext, StorageError> {
        if !cuda_library_present("cuda") {
            return Err(StorageError::Device(
                "the CUDA driver library (libcuda) was not found".to_string(),
            ));
        }
        result::init().map_err(|err| driver_error("cuInit", err))?;
        let n_devices =
            result::device::get_count().map_err(|err| driver_error("cuDeviceGetCount", err))?;
        let index = i32::try_from(ordinal)
            .ok()
            .filter(|&index| index < n_devices)
            .ok_or_else(|| {
                StorageError::Device(format!(
                    "no CUDA device {ordinal}: {n_devices} device(s) present"
                ))
            })?;
        let device = result::device::get(index).map_err(|err| driver_error("cuDeviceGet", err))?;
        // SAFETY: `device` was returned by `cuDeviceGet`; the retain is undone by `release`.
        let raw = unsafe { result::primary_ctx::retain(device) }
            .map_err(|err| driver_error("cuDevicePrimaryCtxRetain", err))?;
        Ok(DeviceContext {
            ordinal,
            device,
            raw,
        })
    }

    /// Makes the context current on the calling thread.
    pub(super) fn bind(&self) -> Result<(), StorageError> {
        if self.raw.is_null() {
            return Err(StorageError::Device(
                "the storage's context was released".to_string(),
            ));
        }
        // SAFETY: the context was retained in `retain` and is released only in `release`, which
        // nulls it (checked above).
        unsafe { result::ctx::set_current(self.raw) }
            .map_err(|err| driver_error("cuCtxSetCurrent", err))
    }

    /// Waits for all work of the context (`cuCtxSynchronize`); the context must be bound.
    pub(super) fn synchronize(&self) -> Result<(), StorageError> {
        result::ctx::synchronize().map_err(|err| driver_error("cuCtxSynchronize", err))
    }

    /// Whether [`DeviceContext::release`] already ran.
    pub(super) fn is_released(&self) -> bool {
        self.raw.is_null()
    }

    /// The device's name, e.g. "NVIDIA H200"; empty if the driver cannot say.
    pub(super) fn device_name(&self) -> String {
        result::device::get_name(self.device).unwrap_or_default()
    }

    /// Releases the primary context once; later calls do nothing.
    pub(super) fn release(&mut self) -> Result<(), StorageError> {
        if self.raw.is_null() {
            return Ok(());
        }
        self.raw = std::ptr::null_mut();
        // SAFETY: `device` came from `cuDeviceGet` and its primary context was retained once
        // (`raw` is nulled above, so this runs once).
        unsafe { result::primary_ctx::release(self.device) }
            .map_err(|err| driver_error("cuDevicePrimaryCtxRelease", err))
    }
}

/// A stream of the storage's context.
#[derive(Debug)]
struct RawStream(sys::CUstream);

// SAFETY: streams belong to a context, not to a thread; the context is made current before each
// use (see `DeviceContext`).
unsafe impl Send for RawStream {}

#[derive(Debug)]
struct StreamEntry {
    raw: RawStream,
    /// Created by the storage (destroyed on teardown), as opposed to lent by the caller.
    owned: bool,
}

/// The streams a storage knows by id. `StreamId::DEFAULT` is the context's legacy default
/// stream, or the blocking stream of [`StreamTable::create_default`]; it is never in `entries`.
#[derive(Debug)]
pub(super) struct StreamTable {
    entries: HashMap<u64, StreamEntry>,
    /// The stream behind `StreamId::DEFAULT` when it is not the legacy one.
    default: Option<StreamEntry>,
    next: u64,
}

impl Default for StreamTable {
    fn default() -> Self {
        StreamTable {
            entries: HashMap::new(),
            default: None,
            next: 1,
        }
    }
}

impl StreamTable {
    /// Creates a blocking stream (default flags: ordered with the legacy default stream) and
    /// makes `StreamId::DEFAULT` name it; the context must be bound.
    pub(super) fn create_default(&mut self) -> Result<(), StorageError> {
        let raw = result::stream::create(result::stream::StreamKind::Default)
            .map_err(|err| driver_error("cuStreamCreate", err))?;
        self.default = Some(StreamEntry {
            raw: RawStream(raw),
            owned: true,
        });
        Ok(())
    }

    /// Creates a non-blocking stream (`CU_STREAM_NON_BLOCKING`) under the next free id; the
    /// context must be bound.
    pub(super) fn create(&mut self) -> Result<StreamId, StorageError> {
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|err| driver_error("cuStreamCreate", err))?;
        Ok(self.insert_next(StreamEntry {
            raw: RawStream(raw),
            owned: true,
        }))
    }

    /// Lends `raw` to the table under the next free id; the table never destroys it.
    pub(super) fn lend(&mut self, raw: sys::CUstream) -> StreamId {
        self.insert_next(StreamEntry {
            raw: RawStream(raw),
            owned: false,
        })
    }

    /// Lends `raw` to the table under `id`, which must be free and not reserved by `reserved`
    /// (the default stream is always reserved).
    pub(super) fn lend_as(
        &mut self,
        id: StreamId,
        raw: sys::CUstream,
        reserved: &[StreamId],
    ) -> Result<(), StorageError> {
        if id == StreamId::DEFAULT || reserved.contains(&id) || self.entries.contains_key(&id.0) {
            return Err(StorageError::InvalidRange(format!(
                "stream id {} is reserved or already registered",
                id.0
            )));
        }
        self.entries.insert(
            id.0,
            StreamEntry {
                raw: RawStream(raw),
                owned: false,
            },
        );
        Ok(())
    }

    /// The `CUstream` behind `id` (null for the legacy default stream).
    pub(super) fn get(&self, id: StreamId) -> Result<sys::CUstream, StorageError> {
        if id == StreamId::DEFAULT {
            return Ok(self
                .default
                .as_ref()
                .map_or(result::stream::null(), |entry| entry.raw.0));
        }
        self.entries
            .get(&id.0)
            .map(|entry| entry.raw.0)
            .ok_or_else(|| {
                StorageError::InvalidRange(format!("stream {} is not known to this storage", id.0))
            })
    }

    /// Destroys the streams the table created and forgets every stream; the context must be
    /// bound and idle.
    pub(super) fn destroy_all(&mut self, tally: &mut ErrorTally) {
        let entries = self.entries.drain().map(|(_, entry)| entry);
        for entry in entries.chain(self.default.take()) {
            if entry.owned {
                // SAFETY: the stream was created by `cuStreamCreate` and is destroyed once.
                tally.note(
                    unsafe { result::stream::destroy(entry.raw.0) }
                        .map_err(|err| driver_error("cuStreamDestroy", err)),
                );
            }
        }
    }

    fn insert_next(&mut self, entry: StreamEntry) -> StreamId {
        while self.entries.contains_key(&self.next) {
            self.next += 1;
        }
        let id = self.next;
        self.next += 1;
        self.entries.insert(id, entry);
        StreamId(id)
    }
}

/// An event of the storage's context.
#[derive(Debug)]
struct RawEvent(sys::CUevent);

// SAFETY: events belong to a context, not to a thread; the context is made current before each
// use (see `DeviceContext`).
unsafe impl Send for RawEvent {}

/// Events handed out as [`EventId`]s, recycled through a pool (`CU_EVENT_DISABLE_TIMING`).
#[derive(Debug, Default)]
pub(super) struct EventPool {
    /// Live events by id; `None` is an event of host work, complete when recorded.
    live: HashMap<u64, Option<RawEvent>>,
    idle: Vec<RawEvent>,
    next: u64,
}

impl EventPool {
    /// Records an event on `stream` after the work queued so far; the context must be bound.
    pub(super) fn record(&mut self, stream: sys::CUstream) -> Result<EventId, StorageError> {
        let event = match self.idle.pop() {
            Some(event) => event,
            None => RawEvent(
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|err| driver_error("cuEventCreate", err))?,
            ),
        };
        // SAFETY: `event` and `stream` are live objects of the current context.
        if let Err(err) = unsafe { result::event::record(event.0, stream) } {
            self.idle.push(event);
            return Err(driver_error("cuEventRecord", err));
        }
        Ok(self.insert(Some(event)))
    }

    /// An event that is complete already: the work it stands for ran on the host.
    pub(super) fn record_complete(&mut self) -> EventId {
        self.insert(None)
    }

    /// Whether the work before `event` has finished; the context must be bound.
    pub(super) fn query(&self, event: EventId) -> Result<bool, StorageError> {
        let Some(raw) = self.raw(event)? else {
            return Ok(true);
        };
        // SAFETY: `raw` is a live event of the current context.
        match unsafe { result::event::query(raw) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(err) => Err(driver_error("cuEventQuery", err)),
        }
    }

    /// Waits for `event`; the context must be bound.
    pub(super) fn synchronize(&self, event: EventId) -> Result<(), StorageError> {
        let Some(raw) = self.raw(event)? else {
            return Ok(());
        };
        // SAFETY: `raw` is a live event of the current context.
        unsafe { result::event::synchronize(raw) }
            .map_err(|err| driver_error("cuEventSynchronize", err))
    }

    /// Returns `event` to the pool. A pending event may be recorded again: the new record
    /// replaces the old one.
    pub(super) fn release(&mut self, event: EventId) {
        if let Some(Some(raw)) = self.live.remove(&event.0) {
            self.idle.push(raw);
        }
    }

    /// Destroys every event, live or idle; the context must be bound and idle.
    pub(super) fn destroy_all(&mut self, tally: &mut ErrorTally) {
        let live = self.live.drain().filter_map(|(_, event)| event);
        for event in live.chain(self.idle.drain(..)) {
            // SAFETY: every event here was created by `cuEventCreate` and is destroyed once.
            tally.note(
                unsafe { result::event::destroy(event.0) }
                    .map_err(|err| driver_error("cuEventDestroy", err)),
            );
        }
    }

    fn insert(&mut self, event: Option<RawEvent>) -> EventId {
        self.next += 1;
        self.live.insert(self.next, event);
        EventId(self.next)
    }

    fn raw(&self, event: EventId) -> Result<Option<sys::CUevent>, StorageError> {
        self.live
            .get(&event.0)
            .map(|raw| raw.as_ref().map(|raw| raw.0))
            .ok_or_else(|| StorageError::InvalidRange(format!("no live event {}", event.0)))
    }
}

/// The errors met while tearing a storage down: how many, and the first.
#[derive(Debug, Default)]
pub(super) struct ErrorTally {
    pub(super) count: u64,
    pub(super) first: Option<StorageError>,
}

impl ErrorTally {
    pub(super) fn note(&mut self, outcome: Result<(), StorageError>) {
        if let Err(err) = outcome {
            self.count += 1;
            self.first.get_or_insert(err);
        }
    }
}

/// Checks a new segment of `size` bytes for a storage that holds `held` of at most `limit` bytes;
/// returns the size as a `usize`.
pub(super) fn admit_segment(size: u64, held: u64, limit: u64) -> Result<usize, StorageError> {
    if size == 0 {
        return Err(StorageError::InvalidRange(
            "a segment of 0 bytes".to_string(),
        ));
    }
    if held.saturating_add(size) > limit {
        return Err(StorageError::OutOfMemory { requested: size });
    }
    usize::try_from(size).map_err(|_| StorageError::OutOfMemory { requested: size })
}

/// Checks that `segments` (start → bytes) holds a segment of exactly `size` bytes at `address`.
pub(super) fn check_segment(
    segments: &HashMap<u64, u64>,
    address: u64,
    size: u64,
) -> Result<(), StorageError> {
    match segments.get(&address) {
        Some(&held) if held == size => Ok(()),
        Some(&held) => Err(StorageError::InvalidRange(format!(
            "segment at {address:#x} has {held} bytes, not {size}"
        ))),
        None => Err(StorageError::InvalidRange(format!(
            "no segment at {address:#x}"
        ))),
    }
}

/// A driver error as a [`StorageError::Device`] naming the call.
pub(super) fn driver_error(call: &str, err: DriverError) -> StorageError {
    let name = err.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = err.error_string().map(|s| s.to_string_lossy().into_owned());
    StorageError::Device(match (name, text) {
        (Ok(name), Ok(text)) => format!("{call} failed: {name} ({text})"),
        _ => format!("{call} failed: CUresult {:?}", err.0),
    })
}

/// Like [`driver_error`], but out-of-memory becomes [`StorageError::OutOfMemory`].
pub(super) fn alloc_error(call: &str, err: DriverError, requested: u64) -> StorageError {
    if err.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        StorageError::OutOfMemory { requested }
    } else {
        driver_error(call, err)
    }
}

/// Whether the CUDA library `name` (`"cuda"` for the driver, `"cublasLt"`...) can be opened under
/// one of the names it is installed by (`libcuda.so.1`, `libcublasLt.so.13`, `nvcuda.dll`...),
/// whether cudarc loads it at run time or the binary links it (as candle's `cuda` feature makes
/// cudarc do): a check that never panics, before a first call that would.
pub fn cuda_library_present(name: &str) -> bool {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    let plain = format!("{DLL_PREFIX}{name}{DLL_SUFFIX}");
    let mut candidates = vec![plain.clone(), format!("{plain}.1")];
    candidates.extend(["13", "12", "11"].map(|major| format!("{plain}.{major}")));
    candidates.extend(
        ["13", "12", "11"].map(|major| format!("{DLL_PREFIX}{name}64_{major}{DLL_SUFFIX}")),
    );
    if name == "cuda" {
        candidates.push(format!("{DLL_PREFIX}nvcuda{DLL_SUFFIX}"));
    }
    candidates.iter().any(|candidate| {
        // SAFETY: opening a CUDA library by name runs its initialisers, which have no
        // preconditions; nothing in it is called here.
        unsafe { libloading::Library::new(candidate) }.is_ok()
    })
}
