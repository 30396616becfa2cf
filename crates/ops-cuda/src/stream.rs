//! Streams and events of a [`CudaBackend`]: where asynchronous copies run, and how one stream
//! waits for another.
//!
//! Every kernel of the backend runs on one stream, the compute stream
//! ([`CudaBackend::compute_stream`], the allocators' `StreamId::DEFAULT`: a blocking stream, so
//! work on the context's legacy default stream stays ordered with it). Side streams
//! ([`CudaBackend::new_stream`]) are non-blocking driver streams made by the device allocator's
//! storage, so the allocator knows them by id and can defer a free behind their work; they carry
//! copies (data loading, activation offload) that overlap the kernels. A [`CudaEvent`] marks a
//! point in a stream: the host can query or wait for it, another stream can wait for it
//! ([`CudaStream::wait_event`]), and two timing events give the device time between them.
//!
//! This module is ground floor: it sits on the backend's context and allocator (`device.rs`); it
//! knows nothing about kernels or tensors, and no cudarc type leaves it.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use headroom_autograd_core::{Result, TensorError};
use headroom_caching_allocator::StreamId;

use crate::device::CudaBackend;
use crate::error::device_error;

/// Events whose destruction failed, over the whole process (`Drop` cannot return the error).
static EVENT_DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Inside [`CudaBackend::allocate_on_stream`]: the backend (by address) whose allocations on
    /// this thread come from the pool of the stream named.
    static ALLOCATION_STREAM: Cell<Option<(usize, StreamId)>> = const { Cell::new(None) };
}

/// A `CUstream` of the backend's context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawStream(pub(crate) sys::CUstream);

// SAFETY: driver calls on a stream are thread-safe, and the stream belongs to the backend's
// context, not to a thread; every use binds the context first.
unsafe impl Send for RawStream {}
// SAFETY: as above; the handle is never mutated after creation.
unsafe impl Sync for RawStream {}

/// A stream of one [`CudaBackend`]: its compute stream or a side stream. Cloning it is cheap and
/// names the same stream; the stream itself lives as long as the backend.
#[derive(Clone)]
pub struct CudaStream {
    backend: Arc<CudaBackend>,
    id: StreamId,
    raw: RawStream,
}

impl std::fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStream")
            .field("device", &self.backend.ordinal)
            .field("id", &self.id)
            .finish()
    }
}

/// A marker in a stream's work, recorded with [`CudaStream::record_event`] (or
/// [`CudaStream::record_timing_event`], which can also measure device time).
pub struct CudaEvent {
    backend: Arc<CudaBackend>,
    raw: sys::CUevent,
    timing: bool,
}

// SAFETY: driver calls on an event are thread-safe, and the event belongs to the backend's
// context; every use binds the context first. `raw` is not mutated after creation.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEvent")
            .field("device", &self.backend.ordinal)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// The stream every kernel of this backend runs on (`StreamId::DEFAULT`).
    pub fn compute_stream(self: &Arc<Self>) -> CudaStream {
        CudaStream {
            backend: Arc::clone(self),
            id: StreamId::DEFAULT,
            raw: RawStream(self.stream.cu_stream()),
        }
    }

    /// Runs `f` with this thread's device allocations from this backend (`Tensor::empty` and the
    /// like inside `f`) taken from `stream`'s pool, as PyTorch does under `torch.cuda.stream(s)`.
    ///
    /// Allocate the destinations of side-stream copies this way. A block of the compute stream's
    /// pool may still be in use by kernels queued before it was freed, so a copy into it first
    /// waits for the compute stream ([`CudaBackend::copy_to_device_async`]); a block of the copy
    /// stream's own pool need not. Blocks allocated here are also marked as used by the compute
    /// stream, so their reuse waits for the kernels queued before they are freed.
    pub fn allocate_on_stream<R>(&self, stream: &CudaStream, f: impl FnOnce() -> R) -> Result<R> {
        stream.check_backend("allocate_on_stream", self)?;
        let key = self as *const CudaBackend as usize;
        let _restore = RestoreAllocationStream(ALLOCATION_STREAM.replace(Some((key, stream.id))));
        Ok(f())
    }

    /// The stream `id` of this backend: the compute stream or one made by `new_stream`.
    pub(crate) fn stream_by_id(self: &Arc<Self>, id: StreamId) -> Result<CudaStream> {
        if id == StreamId::DEFAULT {
            return Ok(self.compute_stream());
        }
        let raw = self
            .allocator()
            .with_storage(|storage| storage.raw_stream(id))
            .ok_or_else(|| TensorError::Device {
                op: "stream_by_id",
                reason: format!("stream {} is not a stream of this backend", id.0),
            })?;
        Ok(CudaStream {
            backend: Arc::clone(self),
            id,
            raw: RawStream(raw.cast()),
        })
    }

    /// A new non-blocking side stream for copies. It does not wait for the compute stream nor
    /// the compute stream for it, except through events. It lives as long as the backend, so
    /// make a few and keep them (as PyTorch's stream pool does).
    pub fn new_stream(self: &Arc<Self>) -> Result<CudaStream> {
        let stream_error =
            |e: headroom_caching_allocator::StorageError| device_error("new_stream", e);
        // SAFETY: making a stream frees nothing and writes no memory of an allocation.
        let (id, raw) = unsafe {
            self.allocator().with_storage_mut(|storage| {
                let id = storage.new_stream().map_err(stream_error)?;
                let raw = storage.raw_stream(id).ok_or_else(|| TensorError::Device {
                    op: "new_stream",
                    reason: format!("the storage does not know stream {} it made", id.0),
                })?;
                Ok::<_, TensorError>((id, raw))
            })
        }?;
        // SAFETY: registering a stream frees nothing and writes no memory of an allocation. And
        // `raw` is a stream of this device's primary context, made by the device allocator's
        // storage, which destroys it only when the backend is dropped; the pinned allocator
        // records events on it only while a `PinnedBuffer` (which holds the backend) is freed,
        // and is dropped after the device allocator without recording any.
        unsafe {
            self.pinned
                .with_storage_mut(|storage| storage.register_stream(id, raw))
        }
        .map_err(stream_error)?;
        Ok(CudaStream {
            backend: Arc::clone(self),
            id,
            raw: RawStream(raw.cast()),
        })
    }
}

impl CudaStream {
    /// The id the allocators know this stream by.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// The backend the stream belongs to.
    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.backend
    }

    /// Records an event after the work queued on this stream so far.
    pub fn record_event(&self) -> Result<CudaEvent> {
        let event = CudaEvent::create(&self.backend, false)?;
        event.record(self)?;
        Ok(event)
    }

    /// Like [`CudaStream::record_event`], for an event that can measure device time
    /// ([`CudaEvent::elapsed_ms`]); recording it costs a little more.
    pub fn record_timing_event(&self) -> Result<CudaEvent> {
        let event = CudaEvent::create(&self.backend, true)?;
        event.record(self)?;
        Ok(event)
    }

    /// Makes the work queued on this stream from now on wait until `event` completes; the host
    /// does not wait.
    pub fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        same_backend("wait_event", &self.backend, &event.backend)?;
        self.backend.bind("wait_event")?;
        // SAFETY: the stream and the event are live objects of the bound context.
        unsafe {
            result::stream::wait_event(
                self.raw.0,
                event.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| device_error("wait_event", e))
    }

    /// Makes the work queued on this stream from now on wait for the work queued on `other` so
    /// far (an event recorded on `other`, then waited for).
    pub fn wait_stream(&self, other: &CudaStream) -> Result<()> {
        self.wait_event(&other.record_event()?)
    }

    /// Blocks the host until the work queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.backend.bind("synchronize_stream")?;
        // SAFETY: the stream is a live stream of the bound context.
        unsafe { result::stream::synchronize(self.raw.0) }
            .map_err(|e| device_error("synchronize_stream", e))
    }

    /// Whether the work queued on this stream has finished.
    pub fn query(&self) -> Result<bool> {
        self.backend.bind("query_stream")?;
        // SAFETY: the stream is a live stream of the bound context.
        ready(
            unsafe { sys::cuStreamQuery(self.raw.0) }.result(),
            "query_stream",
        )
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw.0
    }

    /// `Ok` when this stream belongs to `backend`.
    pub(crate) fn check_backend(&self, op: &'static str, backend: &CudaBackend) -> Result<()> {
        if std::ptr::eq(Arc::as_ptr(&self.backend), backend) {
            Ok(())
        } else {
            Err(TensorError::InvalidArgument {
                op,
                reason: "the stream belongs to another CUDA backend".to_string(),
            })
        }
    }
}

impl CudaEvent {
    /// Records the event again, after the work queued on `stream` so far; waiting for it then
    /// waits for that point.
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        same_backend("record_event", &self.backend, &stream.backend)?;
        self.backend.bind("record_event")?;
        // SAFETY: the event and the stream are live objects of the bound context.
        unsafe { result::event::record(self.raw, stream.raw.0) }
            .map_err(|e| device_error("record_event", e))
    }

    /// Whether the work before the event has finished.
    pub fn query(&self) -> Result<bool> {
        self.backend.bind("query_event")?;
        // SAFETY: the event is a live event of the bound context.
        ready(unsafe { result::event::query(self.raw) }, "query_event")
    }

    /// Blocks the host until the work before the event has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.backend.bind("synchronize_event")?;
        // SAFETY: the event is a live event of the bound context.
        unsafe { result::event::synchronize(self.raw) }
            .map_err(|e| device_error("synchronize_event", e))
    }

    /// Device milliseconds from this event to `end`; both must be timing events and complete.
    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f32> {
        same_backend("elapsed_ms", &self.backend, &end.backend)?;
        if !(self.timing && end.timing) {
            return Err(TensorError::InvalidArgument {
                op: "elapsed_ms",
                reason: "both events must come from record_timing_event".to_string(),
            });
        }
        self.backend.bind("elapsed_ms")?;
        // SAFETY: both events are live, timing-enabled events of the bound context.
        unsafe { result::event::elapsed(self.raw, end.raw) }
            .map_err(|e| device_error("elapsed_ms", e))
    }

    /// Events whose destruction failed so far in this process (`Drop` cannot return errors and
    /// never prints).
    pub fn drop_errors() -> u64 {
        EVENT_DROP_ERRORS.load(Ordering::Relaxed)
    }

    fn create(backend: &Arc<CudaBackend>, timing: bool) -> Result<CudaEvent> {
        backend.bind("record_event")?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let raw = result::event::create(flags).map_err(|e| device_error("record_event", e))?;
        Ok(CudaEvent {
            backend: Arc::clone(backend),
            raw,
            timing,
        })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let destroyed = self.backend.bind("destroy_event").and_then(|()| {
            // SAFETY: the event was created by `cuEventCreate` and is destroyed once, here; an
            // event still pending is released by the driver once it completes.
            unsafe { result::event::destroy(self.raw) }
                .map_err(|e| device_error("destroy_event", e))
        });
        if destroyed.is_err() {
            EVENT_DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The stream whose pool `backend`'s allocations on this thread come from (the compute stream's
/// outside [`CudaBackend::allocate_on_stream`]).
pub(crate) fn allocation_stream(backend: &CudaBackend) -> StreamId {
    match ALLOCATION_STREAM.get() {
        Some((key, id)) if key == backend as *const CudaBackend as usize => id,
        _ => StreamId::DEFAULT,
    }
}

/// Puts back the allocation stream that was in force before `allocate_on_stream`, also when `f`
/// panics.
struct RestoreAllocationStream(Option<(usize, StreamId)>);

impl Drop for RestoreAllocationStream {
    fn drop(&mut self) {
        ALLOCATION_STREAM.set(self.0);
    }
}

/// `Ok` when two handles belong to the same backend.
fn same_backend(op: &'static str, a: &Arc<CudaBackend>, b: &Arc<CudaBackend>) -> Result<()> {
    if Arc::ptr_eq(a, b) {
        Ok(())
    } else {
        Err(TensorError::InvalidArgument {
            op,
            reason: "the stream and the event belong to different CUDA backends".to_string(),
        })
    }
}

/// A query's outcome: done, not ready, or an error.
fn ready(outcome: std::result::Result<(), DriverError>, op: &'static str) -> Result<bool> {
    match outcome {
        Ok(()) => Ok(true),
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
        Err(e) => Err(device_error(op, e)),
    }
}
