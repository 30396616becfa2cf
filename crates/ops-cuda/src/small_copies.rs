//! Small copies between host and device memory that take no copy engine: a read of up to 4 KiB
//! (an index check's error word, `item`, a loss) and a write of up to 16 KiB (a step's launch
//! table, `Tensor::from_slice` of a few values) go through pinned host memory that a kernel on
//! the compute stream stores to or loads from directly. Longer copies use a copy engine.
//!
//! A synchronous `cuMemcpyDtoH` of 8 bytes issued while a side stream copied 2 GB of streamed
//! optimizer state to the host waited 41 ms on an H100 (results/2026-12-05-a3db96a): copies in
//! one direction queue on a copy engine whatever their stream, so a small copy waits for the
//! large ones queued before it, and so does the compute stream's next kernel. A kernel's loads
//! and stores over the link take no copy engine, so such a copy waits only for the compute
//! stream's earlier work. The memory is allocated mapped (`CU_MEMHOSTALLOC_DEVICEMAP`) and the
//! kernels take the device's address of it (`cuMemHostGetDevicePointer`: under unified
//! addressing, the host pointer itself).
//!
//! Writes are stream-ordered without a host wait: the bytes go into one of [`WRITE_SLOTS`]
//! pinned slots, used round-robin, each reused only after the kernel that read it last has run
//! (an event; the host waits only when it is that far ahead of the device). Reads wait for the
//! compute stream, then copy out of one pinned page.
//!
//! [`SmallCopies::CopyEngine`] puts every copy on a copy engine, as before this module, for a
//! side-by-side measurement.
//!
//! This module is ground floor: it sits on `device.rs`, `launch.rs` (the `read_back_bytes` and
//! `write_from_host_bytes` kernels of `kernels/elementwise.cu`) and cudarc, and knows no op.

use std::ffi::c_void;

use cudarc::driver::{result, sys, LaunchConfig};
use headroom_autograd_core::Result;

use crate::device::CudaBackend;
use crate::error::device_error;
use crate::kernels::Module;
use crate::launch::{launch_in, Param, NO_ARGS};

/// The most bytes a read takes through the pinned page; longer reads use a copy engine.
pub(crate) const SMALL_READ_BYTES: usize = 4096;
/// The most bytes a write takes through a pinned slot; longer writes use a copy engine.
pub(crate) const SMALL_WRITE_BYTES: usize = 16 << 10;
/// The pinned slots of writes in flight: the host may queue this many small writes ahead of the
/// device before it waits.
pub(crate) const WRITE_SLOTS: usize = 64;

/// Threads of a block of the two copy kernels.
const THREADS: u32 = 256;

/// How [`CudaBackend`] copies a few bytes between host and device memory (see
/// [`CudaBackend::set_small_copies`]). Both give the same bytes in the same stream order.
///
/// ```
/// use headroom_autograd_core::{BackendRef, Tensor};
/// use headroom_ops_cuda::{CudaBackend, SmallCopies};
///
/// // On a machine without a GPU there is nothing to compare.
/// if let Ok(cuda) = CudaBackend::new(0) {
///     let gpu: BackendRef = cuda.clone();
///     let loss = Tensor::from_slice(&gpu, &[0.25f32], &[1])?;
///     assert_eq!(cuda.small_copies(), SmallCopies::Kernel);
///     let by_kernel = loss.to_vec::<f32>()?;
///     // The copy engine's path, e.g. to measure what the kernel's saves beside it.
///     cuda.set_small_copies(SmallCopies::CopyEngine);
///     assert_eq!(loss.to_vec::<f32>()?, by_kernel);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SmallCopies {
    /// Reads of up to 4 KiB and writes of up to 16 KiB go through pinned host memory that a
    /// kernel on the compute stream stores to or loads from: they never queue on a copy engine
    /// behind another stream's large copy. The default.
    #[default]
    Kernel,
    /// Every copy goes through a copy engine (`cuMemcpyDtoH`, `cuMemcpyHtoDAsync`), where it
    /// waits for the copies queued before it in the same direction, on any stream.
    CopyEngine,
}

/// Pinned host memory for small copies: one page for reads and [`WRITE_SLOTS`] slots for writes,
/// each slot with the event recorded after its last kernel. Allocated outside the pinned caching
/// allocator, so it counts in no pinned budget or statistic (1 MiB and 4 KiB).
pub(crate) struct SmallCopyMemory {
    read_page: MappedHost,
    write_slots: MappedHost,
    slot_events: Vec<Option<sys::CUevent>>,
    next_slot: usize,
}

// SAFETY: the memory and events belong to the backend's context, not to a thread; every use
// binds the context first and goes through the backend's mutex around this value.
unsafe impl Send for SmallCopyMemory {}

/// Pinned host memory the device addresses: the host's pointer and the device's address.
struct MappedHost {
    host: *mut u8,
    device: u64,
}

impl MappedHost {
    /// `bytes` of mapped pinned host memory; the backend's context must be bound.
    fn new(op: &'static str, bytes: usize) -> Result<MappedHost> {
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: allocates host memory; no memory of an allocation is read or written.
        let host = unsafe { result::malloc_host(bytes, flags) }.map_err(|e| device_error(op, e))?;
        let mut device = 0;
        // SAFETY: `host` is a live mapped allocation of the bound context; the call writes the
        // device's address of it to `device`.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }.result();
        if let Err(error) = mapped {
            // SAFETY: `host` came from `cuMemHostAlloc` just above and nothing uses it.
            let _ = unsafe { result::free_host(host) };
            return Err(device_error(op, error));
        }
        Ok(MappedHost {
            host: host.cast(),
            device,
        })
    }

    /// Frees the memory; the context must be bound and no kernel may still use it.
    fn free(self) {
        // SAFETY: `host` came from `cuMemHostAlloc` and is freed once (this consumes it); the
        // caller guarantees no kernel reads or writes it any more.
        let _ = unsafe { result::free_host(self.host.cast::<c_void>()) };
    }
}

impl SmallCopyMemory {
    /// The page and slots; the backend's context must be bound.
    fn new(op: &'static str) -> Result<SmallCopyMemory> {
        let read_page = MappedHost::new(op, SMALL_READ_BYTES)?;
        let write_slots = match MappedHost::new(op, SMALL_WRITE_BYTES * WRITE_SLOTS) {
            Ok(slots) => slots,
            Err(error) => {
                read_page.free();
                return Err(error);
            }
        };
        Ok(SmallCopyMemory {
            read_page,
            write_slots,
            slot_events: vec![None; WRITE_SLOTS],
            next_slot: 0,
        })
    }

    /// Frees the memory and events; the backend's context must be bound. Waits for the kernels
    /// that still read a slot.
    pub(crate) fn free(self) {
        for event in self.slot_events.into_iter().flatten() {
            // SAFETY: the event was created by `cuEventCreate` and is destroyed once, after the
            // kernel before it has run.
            unsafe {
                let _ = result::event::synchronize(event);
                let _ = result::event::destroy(event);
            }
        }
        // No kernel reads or writes them any more: the reads waited, the writes' events above.
        self.read_page.free();
        self.write_slots.free();
    }
}

/// Queues `kernel` (`read_back_bytes` or `write_from_host_bytes`) on the compute stream to copy
/// `bytes` bytes from `src` to `dst`, a thread a byte.
fn launch_copy(
    backend: &CudaBackend,
    op: &'static str,
    kernel: &'static str,
    src: u64,
    dst: u64,
    bytes: usize,
) -> Result<()> {
    let config = LaunchConfig {
        grid_dim: ((bytes as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = [Param::U64(src), Param::U64(dst), Param::U32(bytes as u32)];
    launch_in(
        backend,
        Module::Elementwise,
        op,
        (kernel, ""),
        config,
        &params,
        NO_ARGS,
    )
}

impl CudaBackend {
    /// Chooses how a few bytes are copied between host and device memory
    /// ([`SmallCopies::Kernel`] by default).
    pub fn set_small_copies(&self, copies: SmallCopies) {
        *self.small_copies.lock() = copies;
    }

    /// How a few bytes are copied between host and device memory (see
    /// [`CudaBackend::set_small_copies`]).
    pub fn small_copies(&self) -> SmallCopies {
        *self.small_copies.lock()
    }

    /// The pinned memory of small copies, allocated on first use, under its mutex.
    fn small_copy_memory(
        &self,
        op: &'static str,
    ) -> Result<parking_lot::MappedMutexGuard<'_, SmallCopyMemory>> {
        let mut memory = self.small_copy_memory.lock();
        if memory.is_none() {
            *memory = Some(SmallCopyMemory::new(op)?);
        }
        Ok(parking_lot::MutexGuard::map(memory, |memory| {
            memory.as_mut().expect("allocated above")
        }))
    }

    /// Copies `out.len()` bytes at device address `address` to `out`, after the work queued on
    /// the compute stream (through a copy engine: on every blocking stream).
    ///
    /// # Safety
    /// `address .. address + out.len()` must be live device memory of this backend.
    pub(crate) unsafe fn read_back(
        &self,
        op: &'static str,
        address: u64,
        out: &mut [u8],
    ) -> Result<()> {
        self.bind(op)?;
        if self.small_copies() == SmallCopies::CopyEngine || out.len() > SMALL_READ_BYTES {
            // SAFETY: the caller guarantees the range is live device memory; the synchronous copy
            // on the legacy default stream runs after the queued kernels.
            return unsafe { result::memcpy_dtoh_sync(out, address) }
                .map_err(|e| device_error(op, e));
        }
        if out.is_empty() {
            return Ok(());
        }
        let memory = self.small_copy_memory(op)?;
        let page = &memory.read_page;
        launch_copy(self, op, "read_back_bytes", address, page.device, out.len())?;
        self.stream.synchronize().map_err(|e| device_error(op, e))?;
        // SAFETY: the page holds `SMALL_READ_BYTES` ≥ `out.len()` bytes, the kernel that wrote
        // them has completed (the stream is synchronised), and the mutex keeps every other copy
        // away from the page until this one is done.
        unsafe { std::ptr::copy_nonoverlapping(page.host, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `bytes` to device address `address` in the compute stream's order, without a host
    /// wait (unless the host is [`WRITE_SLOTS`] small writes ahead of the device); `bytes` may be
    /// dropped at once. Through a copy engine: `cuMemcpyHtoDAsync` on the compute stream.
    ///
    /// # Safety
    /// `address .. address + bytes.len()` must be live device memory of this backend until the
    /// copy has run (memory freed to the allocator after this call qualifies: its reuse is
    /// stream-ordered).
    pub(crate) unsafe fn write_in_order(
        &self,
        op: &'static str,
        address: u64,
        bytes: &[u8],
    ) -> Result<()> {
        self.bind(op)?;
        if bytes.is_empty() {
            return Ok(());
        }
        if self.small_copies() == SmallCopies::CopyEngine || bytes.len() > SMALL_WRITE_BYTES {
            // SAFETY: the caller guarantees the destination range; the source is a live host
            // slice that the driver copies to its staging memory before returning (pageable
            // memory).
            return unsafe { result::memcpy_htod_async(address, bytes, self.stream.cu_stream()) }
                .map_err(|e| device_error(op, e));
        }
        let mut memory = self.small_copy_memory(op)?;
        let slot = memory.next_slot;
        memory.next_slot = (slot + 1) % WRITE_SLOTS;
        let event = match memory.slot_events[slot] {
            Some(event) => {
                // SAFETY: the event is a live event of the bound context; it follows the last
                // kernel that read this slot.
                unsafe { result::event::synchronize(event) }.map_err(|e| device_error(op, e))?;
                event
            }
            None => {
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
                let event = result::event::create(flags).map_err(|e| device_error(op, e))?;
                memory.slot_events[slot] = Some(event);
                event
            }
        };
        // SAFETY: slot `slot` lies inside the slots' allocation and holds `SMALL_WRITE_BYTES` ≥
        // `bytes.len()` bytes; the last kernel that read it has run (its event, above), and the
        // mutex keeps every other copy away from it.
        let source = unsafe { memory.write_slots.host.add(slot * SMALL_WRITE_BYTES) };
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), source, bytes.len()) };
        let device = memory.write_slots.device + (slot * SMALL_WRITE_BYTES) as u64;
        launch_copy(
            self,
            op,
            "write_from_host_bytes",
            device,
            address,
            bytes.len(),
        )?;
        // SAFETY: the event and the compute stream are live objects of the bound context.
        unsafe { result::event::record(event, self.stream.cu_stream()) }
            .map_err(|e| device_error(op, e))
    }
}
