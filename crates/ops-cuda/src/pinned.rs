//! Pinned host buffers and asynchronous host↔device copies on a [`CudaBackend`]'s streams.
//!
//! A [`PinnedBuffer`] is a block of page-locked host memory from the backend's pinned caching
//! allocator (`CachingAllocator<PinnedHostStorage>`: PyTorch's `CachingHostAllocator`, with the
//! device allocator's rounding, splitting, reuse and statistics). Copies between it and device
//! memory are queued on a [`CudaStream`] and return at once; the copy engines move the bytes while
//! kernels run (data loading now, activation offload next).
//!
//! Nothing is reused or read early:
//! - the pinned block and the device buffer of a copy are marked with the copy's stream
//!   (`record_stream`), so freeing either while the copy is in flight defers its reuse until the
//!   stream's work recorded at the free has completed;
//! - the buffer remembers an event after each copy, and host access waits for it:
//!   [`PinnedBuffer::as_slice`] for copies that write the buffer, [`PinnedBuffer::as_mut_slice`]
//!   for every copy. Copies into the buffer take it `&mut`, so no host slice is alive meanwhile.
//!
//! A device block of another stream's pool (the compute stream's, for every tensor allocated
//! outside `CudaBackend::allocate_on_stream`) may still be in use by work queued there before it
//! was freed, so a copy into it first makes its stream wait for that stream. Allocate copy
//! destinations on the copy stream to overlap the copy with the kernels already queued.
//!
//! An [`InFlight`] copy ([`CudaBackend::copy_from_tensor_in_flight`],
//! [`CudaBackend::copy_to_tensor_in_flight`]) leaves the tensor's memory unmarked instead: it holds
//! the tensor, and hands it back (or drops it) only after making the compute stream wait for the
//! copy, so the memory is reusable in stream order as soon as it is freed, without the host ever
//! seeing the copy complete (activation offload).
//!
//! Otherwise ordering between streams is the caller's, as in PyTorch: make the compute stream wait
//! for a loading copy's event before kernels read the data, and a copy stream wait for the compute
//! stream before it copies what kernels wrote. A copy into a tensor does not bump the tensor's
//! autograd version counter: copy into fresh tensors (inputs), not into tensors saved for
//! backward.
//!
//! This module sits on the backend's allocators and streams; it knows nothing about kernels.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys;
use headroom_autograd_core::{Buffer, Result, Tensor, TensorError};
use headroom_caching_allocator::{Allocation, CachingAllocator, PinnedHostStorage, StreamId};
use parking_lot::Mutex;

use crate::device::CudaBackend;
use crate::error::device_error;
use crate::stream::{CudaEvent, CudaStream};

/// Page-locked host memory from a backend's pinned caching allocator, with typed access that
/// waits for the asynchronous copies using it. Dropping it returns the block to the cache (reused
/// only once the copies queued on it have completed).
pub struct PinnedBuffer {
    backend: Arc<CudaBackend>,
    /// `None` for an empty buffer.
    allocation: Option<Allocation>,
    len: usize,
    /// The latest copy per (stream, direction) that uses this buffer.
    uses: Mutex<Vec<DeviceUse>>,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("address", &self.address())
            .field("len", &self.len)
            .field("copies_tracked", &self.uses.lock().len())
            .finish()
    }
}

/// A copy queued on `stream` that reads (host → device) or writes (device → host) the buffer,
/// and an event recorded right after it.
struct DeviceUse {
    stream: StreamId,
    writes_host: bool,
    done: CudaEvent,
}

/// What a host-to-device copy waits for first (with the calling operation's name).
#[derive(Clone, Copy)]
enum CopyOrder<'a> {
    /// The work queued so far on the stream whose pool the destination block comes from.
    AfterOwner(&'static str),
    /// An event the caller recorded.
    After(&'static str, &'a CudaEvent),
}

impl CopyOrder<'_> {
    fn op(self) -> &'static str {
        match self {
            CopyOrder::AfterOwner(op) | CopyOrder::After(op, _) => op,
        }
    }
}

/// Which copies host access must wait for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// Copies that write the buffer (before the host reads it).
    Writes,
    /// Every copy (before the host writes it).
    All,
}

impl CudaBackend {
    /// A pinned host buffer of `bytes` bytes from the backend's pinned caching allocator. Its
    /// contents are what the block's previous user left (zeros for new memory).
    pub fn pinned_host(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuffer> {
        let allocation = if bytes == 0 {
            None
        } else {
            Some(
                self.pinned
                    .allocate(bytes as u64, PinnedHostStorage::HOST_STREAM)?,
            )
        };
        Ok(PinnedBuffer {
            backend: Arc::clone(self),
            allocation,
            len: bytes,
            uses: Mutex::new(Vec::new()),
        })
    }

    /// The pinned host allocator: statistics (`memory_stats`, `memory_summary`), snapshots and
    /// `empty_cache`, as for device memory.
    pub fn pinned_allocator(&self) -> &CachingAllocator<PinnedHostStorage> {
        &self.pinned
    }

    /// Queues a copy of bytes `src_range` of `src` to `dst` at byte `dst_offset` on `stream`,
    /// and returns at once. If `dst`'s block comes from another stream's pool, `stream` first
    /// waits for the work queued on that stream (see the module docs).
    pub fn copy_to_device_async(
        &self,
        src: &PinnedBuffer,
        src_range: Range<usize>,
        dst: &Buffer,
        dst_offset: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let order = CopyOrder::AfterOwner("copy_to_device_async");
        self.copy_to_device_ordered(src, src_range, dst, dst_offset, stream, order)
    }

    /// [`CudaBackend::copy_to_device_async`] ordered after `after` instead of after everything
    /// queued so far on the stream `dst`'s block comes from: for a long-lived `dst` (a
    /// parameter) whose last readers the caller recorded `after` behind, so that the copy does
    /// not also wait for the unrelated work queued on that stream since.
    pub fn copy_to_device_after(
        &self,
        src: &PinnedBuffer,
        src_range: Range<usize>,
        dst: &Buffer,
        dst_offset: usize,
        stream: &CudaStream,
        after: &CudaEvent,
    ) -> Result<()> {
        let order = CopyOrder::After("copy_to_device_after", after);
        self.copy_to_device_ordered(src, src_range, dst, dst_offset, stream, order)
    }

    /// The host-to-device copies' one body: checks, ordering as `order` says, the copy and its
    /// bookkeeping.
    fn copy_to_device_ordered(
        &self,
        src: &PinnedBuffer,
        src_range: Range<usize>,
        dst: &Buffer,
        dst_offset: usize,
        stream: &CudaStream,
        order: CopyOrder<'_>,
    ) -> Result<()> {
        let op = order.op();
        let len = self.check_copy(op, src, &src_range, dst, dst_offset, stream)?;
        if len == 0 {
            return Ok(());
        }
        match order {
            CopyOrder::After(_, event) => stream.wait_event(event)?,
            CopyOrder::AfterOwner(_) => {
                let owner = self.allocator().allocation_stream(dst.address())?;
                if owner != stream.id() {
                    stream.wait_stream(&stream.backend().stream_by_id(owner)?)?;
                }
            }
        }
        self.queue_to_device(op, src, src_range.start, dst, dst_offset, len, stream)?;
        self.record_copy(src, dst, stream)?;
        src.note_use(stream, false)
    }

    /// Queues a copy of `dst_range.len()` bytes of `src` from byte `src_offset` into bytes
    /// `dst_range` of `dst` on `stream`, and returns at once; reading `dst` waits for it.
    pub fn copy_to_host_async(
        &self,
        src: &Buffer,
        src_offset: usize,
        dst: &mut PinnedBuffer,
        dst_range: Range<usize>,
        stream: &CudaStream,
    ) -> Result<()> {
        const OP: &str = "copy_to_host_async";
        let len = self.check_copy(OP, dst, &dst_range, src, src_offset, stream)?;
        if len == 0 {
            return Ok(());
        }
        self.queue_to_host(OP, src, src_offset, dst, dst_range.start, len, stream)?;
        self.record_copy(dst, src, stream)?;
        dst.note_use(stream, true)
    }

    /// Queues a copy of `dst`'s elements (a contiguous tensor of this backend) from `src`,
    /// starting at byte `src_offset`, on `stream`.
    pub fn copy_to_tensor_async(
        &self,
        src: &PinnedBuffer,
        src_offset: usize,
        dst: &Tensor,
        stream: &CudaStream,
    ) -> Result<()> {
        let (byte_offset, len) = dense_bytes("copy_to_tensor_async", dst)?;
        let src_range = src_offset..src_offset.saturating_add(len);
        self.copy_to_device_async(src, src_range, dst.buffer(), byte_offset, stream)
    }

    /// Queues a copy of `src`'s elements (a contiguous tensor of this backend) into `dst` from
    /// byte `dst_offset` on, on `stream`.
    pub fn copy_from_tensor_async(
        &self,
        src: &Tensor,
        dst: &mut PinnedBuffer,
        dst_offset: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let (byte_offset, len) = dense_bytes("copy_from_tensor_async", src)?;
        let dst_range = dst_offset..dst_offset.saturating_add(len);
        self.copy_to_host_async(src.buffer(), byte_offset, dst, dst_range, stream)
    }

    /// Queues a copy of the contiguous tensor `src` into `dst` from byte `dst_offset` on, on
    /// `stream`, and lends `src` to it: the returned [`InFlight`] holds `src` until the compute
    /// stream has been made to wait for the copy (see [`InFlight`]). The copy first waits for the
    /// work queued so far on the compute stream (which wrote `src`) and, if `src`'s memory comes
    /// from another stream's pool, on that stream too. Unlike [`CudaBackend::copy_from_tensor_async`],
    /// `src`'s memory is not marked with `stream`: it is reusable as soon as it is freed, in
    /// stream order, and never waits for the host to see the copy complete (activation offload).
    pub fn copy_from_tensor_in_flight(
        &self,
        src: Tensor,
        dst: &mut PinnedBuffer,
        dst_offset: usize,
        stream: &CudaStream,
    ) -> Result<InFlight> {
        const OP: &str = "copy_from_tensor_in_flight";
        let (byte_offset, len) = dense_bytes(OP, &src)?;
        let dst_range = dst_offset..dst_offset.saturating_add(len);
        self.check_copy(OP, dst, &dst_range, src.buffer(), byte_offset, stream)?;
        let owner = self.order_after_tensor_users(&src, stream)?;
        if len > 0 {
            self.queue_to_host(OP, src.buffer(), byte_offset, dst, dst_offset, len, stream)?;
            self.pinned
                .record_stream_address(dst.address(), stream.id())?;
            dst.note_use(stream, true)?;
        }
        InFlight::after(src, owner, stream)
    }

    /// Queues a copy into the contiguous tensor `dst` (just allocated: its contents are
    /// overwritten) from `src`, starting at byte `src_offset`, on `stream`; the returned
    /// [`InFlight`] hands `dst` to the compute stream once the copy is done
    /// ([`InFlight::finish`]). The copy first waits for the work queued so far on the compute
    /// stream (a previous tenant of `dst`'s memory may still be read there) and, if `dst`'s
    /// memory comes from another stream's pool, on that stream too. `dst`'s memory is not marked
    /// with `stream`, as in [`CudaBackend::copy_from_tensor_in_flight`].
    pub fn copy_to_tensor_in_flight(
        &self,
        src: &PinnedBuffer,
        src_offset: usize,
        dst: Tensor,
        stream: &CudaStream,
    ) -> Result<InFlight> {
        const OP: &str = "copy_to_tensor_in_flight";
        let (byte_offset, len) = dense_bytes(OP, &dst)?;
        let src_range = src_offset..src_offset.saturating_add(len);
        self.check_copy(OP, src, &src_range, dst.buffer(), byte_offset, stream)?;
        let owner = self.order_after_tensor_users(&dst, stream)?;
        if len > 0 {
            self.queue_to_device(OP, src, src_offset, dst.buffer(), byte_offset, len, stream)?;
            self.pinned
                .record_stream_address(src.address(), stream.id())?;
            src.note_use(stream, false)?;
        }
        InFlight::after(dst, owner, stream)
    }

    /// Makes `stream` wait for the work queued so far on the compute stream and on the stream
    /// whose pool `tensor`'s memory comes from; returns that stream.
    fn order_after_tensor_users(&self, tensor: &Tensor, stream: &CudaStream) -> Result<StreamId> {
        let backend = stream.backend();
        stream.wait_stream(&backend.compute_stream())?;
        let owner = match tensor.buffer().address() {
            0 => StreamId::DEFAULT,
            address => self.allocator().allocation_stream(address)?,
        };
        if owner != StreamId::DEFAULT && owner != stream.id() {
            stream.wait_stream(&backend.stream_by_id(owner)?)?;
        }
        Ok(owner)
    }

    /// Queues `len` bytes from `src` at `src_offset` to `dst` at `dst_offset` on `stream`
    /// (ranges checked by the caller); no bookkeeping.
    #[allow(clippy::too_many_arguments)]
    fn queue_to_device(
        &self,
        op: &'static str,
        src: &PinnedBuffer,
        src_offset: usize,
        dst: &Buffer,
        dst_offset: usize,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.bind(op)?;
        // SAFETY: both ranges lie inside live memory (checked by the caller): the pinned block
        // stays allocated until its stream's work completes (the caller records the copy on it),
        // and the device buffer until the copy is done (marked with the stream, or held by an
        // `InFlight` that orders its release after the copy). Host writes to the source wait for
        // this copy (`PinnedBuffer::as_mut_slice`).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.address() + dst_offset as u64,
                (src.address() + src_offset as u64) as *const std::ffi::c_void,
                len,
                stream.raw(),
            )
        }
        .result()
        .map_err(|e| device_error(op, e))
    }

    /// Queues `len` bytes from `src` at `src_offset` to `dst` at `dst_offset` on `stream`
    /// (ranges checked by the caller); no bookkeeping.
    #[allow(clippy::too_many_arguments)]
    fn queue_to_host(
        &self,
        op: &'static str,
        src: &Buffer,
        src_offset: usize,
        dst: &mut PinnedBuffer,
        dst_offset: usize,
        len: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.bind(op)?;
        // SAFETY: both ranges lie inside live memory (checked by the caller) and stay allocated
        // until the copy is done (as in `queue_to_device`). `dst` is borrowed mutably, so no host
        // slice of it is alive, and host access later waits for this copy.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                (dst.address() + dst_offset as u64) as *mut std::ffi::c_void,
                src.address() + src_offset as u64,
                len,
                stream.raw(),
            )
        }
        .result()
        .map_err(|e| device_error(op, e))
    }

    /// Checks that `pinned[range]` and `len` bytes of `device` at `offset` exist and that all
    /// of it belongs to this backend; returns the length.
    fn check_copy(
        &self,
        op: &'static str,
        pinned: &PinnedBuffer,
        range: &Range<usize>,
        device: &Buffer,
        offset: usize,
        stream: &CudaStream,
    ) -> Result<usize> {
        self.capture.refuse(
            op,
            "copies between device and pinned host memory (activation offload)",
        )?;
        stream.check_backend(op, self)?;
        if !std::ptr::eq(Arc::as_ptr(&pinned.backend), self) {
            return Err(TensorError::InvalidArgument {
                op,
                reason: "the pinned buffer belongs to another CUDA backend".to_string(),
            });
        }
        if !std::ptr::addr_eq(Arc::as_ptr(device.backend()), self as *const CudaBackend) {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "the device buffer is on {:?}, not this backend",
                    device.device()
                ),
            });
        }
        if range.start > range.end || range.end > pinned.len {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "bytes {range:?} exceed a pinned buffer of {} bytes",
                    pinned.len
                ),
            });
        }
        let len = range.end - range.start;
        device.check_range(op, offset, len)?;
        Ok(len)
    }

    /// Marks both sides of a copy as used by `stream`, so neither is reused before it is done.
    fn record_copy(
        &self,
        pinned: &PinnedBuffer,
        device: &Buffer,
        stream: &CudaStream,
    ) -> Result<()> {
        self.pinned
            .record_stream_address(pinned.address(), stream.id())?;
        self.allocator()
            .record_stream_address(device.address(), stream.id())?;
        Ok(())
    }
}

impl PinnedBuffer {
    /// Bytes usable (the request, not the allocator's rounded block).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the pinned allocator reserved for it (the rounded block size).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocation.as_ref().map_or(0, Allocation::size)
    }

    /// The host address of the first byte (0 when empty).
    pub fn address(&self) -> u64 {
        self.allocation.as_ref().map_or(0, Allocation::address)
    }

    /// The contents as `T`s, after the queued copies into the buffer have completed. An error if
    /// the length is not a multiple of `T`'s size (the address is 512-byte aligned).
    pub fn as_slice<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        self.wait(Waiting::Writes)?;
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: the block is `len` (≤ its size) bytes of live pinned memory owned by this
        // buffer; every byte was written (segments are zeroed when obtained); no copy writes it
        // any more (waited above, and new ones need `&mut self`), and no `&mut` slice of it is
        // alive while `&self` is borrowed.
        let bytes = unsafe { std::slice::from_raw_parts(self.address() as *const u8, self.len) };
        bytemuck::try_cast_slice(bytes).map_err(|e| cast_error("PinnedBuffer::as_slice", e))
    }

    /// The contents as mutable `T`s, after every queued copy using the buffer has completed.
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        self.wait(Waiting::All)?;
        self.uses.get_mut().clear();
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`; in addition no copy reads it any more (waited above) and
        // `&mut self` makes this the only slice.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.address() as *mut u8, self.len) };
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error("PinnedBuffer::as_mut_slice", e))
    }

    /// Blocks the host until every copy queued on the buffer has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.wait(Waiting::All)
    }

    /// Whether every copy queued on the buffer has completed.
    pub fn is_idle(&self) -> Result<bool> {
        for device_use in self.uses.lock().iter() {
            if !device_use.done.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Remembers a copy just queued on `stream`: its event replaces the previous one of the same
    /// stream and direction, which it follows in stream order.
    fn note_use(&self, stream: &CudaStream, writes_host: bool) -> Result<()> {
        let mut uses = self.uses.lock();
        let same = |u: &&mut DeviceUse| u.stream == stream.id() && u.writes_host == writes_host;
        if let Some(device_use) = uses.iter_mut().find(same) {
            return device_use.done.record(stream);
        }
        let done = stream.record_event()?;
        uses.push(DeviceUse {
            stream: stream.id(),
            writes_host,
            done,
        });
        Ok(())
    }

    fn wait(&self, waiting: Waiting) -> Result<()> {
        let mut uses = self.uses.lock();
        let mut outcome = Ok(());
        uses.retain(|u| {
            if (waiting == Waiting::Writes && !u.writes_host) || outcome.is_err() {
                return true;
            }
            outcome = u.done.synchronize();
            outcome.is_err()
        });
        outcome
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            // Blocks used by copies are held back by the allocator until their streams are done.
            if let Err(error) = self.backend.pinned.free(allocation) {
                self.backend.note_free_error(error);
            }
        }
    }
}

/// A tensor that an asynchronous copy on a side stream reads or writes, handed back to the
/// compute stream in stream order.
///
/// [`CudaBackend::copy_from_tensor_in_flight`] lends a tensor to a copy to the host;
/// [`CudaBackend::copy_to_tensor_in_flight`] fills a fresh one from the host. Neither marks the
/// tensor's memory with the copy's stream (`record_stream`). Instead [`InFlight::finish`] makes the
/// compute stream (and the stream whose pool owns the memory, if another) wait for the copy and
/// returns the tensor; dropping an `InFlight` does the same and drops the tensor. Every kernel
/// queued afterwards runs after the copy — those of a later tenant of the memory too, once the
/// tensor is freed — so the memory is reusable as soon as it is freed, and the host never waits.
/// (Memory freed after `record_stream` is reused only once the host has seen the copy complete,
/// which a host running ahead of the device sees late: the allocator then maps more memory.)
///
/// If the driver refuses the wait when an `InFlight` is dropped, the host waits for the copy
/// instead; if that fails too, the tensor is leaked rather than reused early.
pub struct InFlight {
    /// `None` once finished.
    tensor: Option<Tensor>,
    done: CudaEvent,
    backend: Arc<CudaBackend>,
    /// The stream whose pool the tensor's memory comes from.
    owner: StreamId,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("tensor", &self.tensor)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl InFlight {
    /// `tensor`, used by the copy just queued on `stream`.
    fn after(tensor: Tensor, owner: StreamId, stream: &CudaStream) -> Result<InFlight> {
        Ok(InFlight {
            tensor: Some(tensor),
            done: stream.record_event()?,
            backend: Arc::clone(stream.backend()),
            owner,
        })
    }

    /// The tensor, without waiting. Kernels may read the source of a copy to the host meanwhile
    /// (the copy only reads it too); the destination of a copy to the device holds its contents
    /// only after [`InFlight::finish`].
    pub fn tensor(&self) -> &Tensor {
        self.tensor
            .as_ref()
            .expect("an InFlight holds its tensor until finished")
    }

    /// The event recorded right after the copy.
    pub fn event(&self) -> &CudaEvent {
        &self.done
    }

    /// Whether the copy has completed (a query: the host does not wait).
    pub fn is_done(&self) -> Result<bool> {
        self.done.query()
    }

    /// Makes the compute stream, and the stream whose pool owns the tensor's memory, wait for the
    /// copy (the host does not wait), and returns the tensor: kernels queued from now on see the
    /// copy complete. Drop the tensor to free its memory, reusable at once in stream order.
    pub fn finish(mut self) -> Result<Tensor> {
        self.order_after_copy()?;
        Ok(self
            .tensor
            .take()
            .expect("an InFlight holds its tensor until finished"))
    }

    fn order_after_copy(&self) -> Result<()> {
        self.backend.compute_stream().wait_event(&self.done)?;
        if self.owner != StreamId::DEFAULT {
            self.backend
                .stream_by_id(self.owner)?
                .wait_event(&self.done)?;
        }
        Ok(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(tensor) = self.tensor.take() else {
            return;
        };
        if self.order_after_copy().is_ok() || self.done.synchronize().is_ok() {
            drop(tensor);
        } else {
            // Neither the device nor the host could be ordered after the copy: never reuse the
            // memory it may still use.
            std::mem::forget(tensor);
        }
    }
}

/// The byte offset and length of a contiguous tensor's elements in its buffer.
fn dense_bytes(op: &'static str, tensor: &Tensor) -> Result<(usize, usize)> {
    if !tensor.is_contiguous() {
        return Err(TensorError::InvalidArgument {
            op,
            reason: "asynchronous copies take contiguous tensors".to_string(),
        });
    }
    let size = tensor.dtype().size_in_bytes();
    Ok((tensor.layout().offset() * size, tensor.numel() * size))
}

fn cast_error(op: &'static str, error: bytemuck::PodCastError) -> TensorError {
    TensorError::InvalidArgument {
        op,
        reason: format!("cannot view the pinned bytes as the element type: {error:?}"),
    }
}
