//! Free epochs on a real device: a reclaim moves the pages of a freed block without waiting for
//! the device only once the work queued before the free has run (the epoch's mark has passed),
//! and waits for the device while that work is still in flight.
//!
//! Work in flight on a block's pages is testkit's `spin_ns` kernel followed, on the same stream,
//! by a copy that reads the block: the copy runs only when the spin ends, seconds after the host
//! has freed the block and asked for its pages. The kernel is launched through cudarc's driver
//! calls on a stream of the allocator's storage (this crate does not know ops-cuda).
//!
//! Each test needs a CUDA device that maps 2 MiB pages: marked `#[ignore = "needs a CUDA
//! device"]`, it runs with `--include-ignored`; on a device that cannot map them it skips, or
//! fails where `HEADROOM_REQUIRE_GPU=1` is set (testkit's gate); an H200 maps 2 MiB pages.
#![cfg(feature = "cuda")]

use std::ffi::{c_void, CString};
use std::sync::MutexGuard;
use std::time::Duration;

use cudarc::driver::{result, sys};
use headroom_caching_allocator::{
    AllocatorConfig, CachingAllocator, CudaStorage, EventId, Storage, StorageError,
};
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device, skip, SPIN_NS_PTX};
use headroom_testkit::inputs::pattern_bytes;

const MIB: u64 = 1 << 20;

/// Frees per free epoch: the 64th free closes the open epoch with a mark (an event on every
/// stream with a pool), as the allocator's `FREES_PER_MARK` says.
const FREES_PER_MARK: usize = 64;

/// How long the spin keeps the stream busy: far longer than the host takes from the launch to
/// the reclaim (a free, 64 small allocations and frees, one allocation), so that the copy behind
/// it is still queued when the reclaim wants the pages it reads.
const SPIN: Duration = Duration::from_secs(2);

/// The default policy (2 MiB pages, reclaiming, free epochs) over device 0, holding the device,
/// or `None` after the gate's skip notice (no device, or one that cannot map 2 MiB pages).
fn allocator_or_skip() -> Option<(MutexGuard<'static, ()>, CachingAllocator<CudaStorage>)> {
    let device = exclusive_device();
    let storage = cuda_or_skip(CudaStorage::new(0))?;
    if !storage.supports_expandable_segments() || storage.page_granularity() != 2 * MIB {
        skip(format_args!(
            "the device does not map pages of 2 MiB (mapping: {}, granularity: {} bytes)",
            storage.supports_expandable_segments(),
            storage.page_granularity()
        ));
        return None;
    }
    Some((
        device,
        CachingAllocator::new(storage, AllocatorConfig::default()),
    ))
}

/// testkit's `spin_ns` kernel, loaded into the context current on this thread.
struct Spin {
    module: sys::CUmodule,
    function: sys::CUfunction,
}

impl Spin {
    /// Loads the kernel. The storage's context must be current on this thread (each storage
    /// call makes it so).
    fn load() -> Spin {
        let ptx = CString::new(SPIN_NS_PTX).unwrap();
        // SAFETY: `ptx` is a NUL-terminated PTX image that outlives the call; a context is
        // current on this thread.
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }.expect("spin PTX");
        let name = CString::new("spin_ns").unwrap();
        // SAFETY: `module` was loaded above and is unloaded only by `Spin::unload`.
        let function = unsafe { result::module::get_function(module, name) }.expect("spin_ns");
        Spin { module, function }
    }

    /// Queues one thread of `spin_ns` for `duration` on `stream`.
    fn launch(&self, stream: sys::CUstream, duration: Duration) {
        let mut nanoseconds = u64::try_from(duration.as_nanos()).unwrap();
        let mut params = [(&mut nanoseconds as *mut u64).cast::<c_void>()];
        // SAFETY: `spin_ns` takes one u64, which `params` points at for the call (the driver
        // copies kernel arguments at launch); the function's module is loaded and `stream` is a
        // live stream of the current context.
        unsafe {
            result::launch_kernel(self.function, (1, 1, 1), (1, 1, 1), 0, stream, &mut params)
        }
        .expect("launching spin_ns");
    }

    /// Unloads the kernel's module; nothing that uses it may still be queued.
    fn unload(self) {
        // SAFETY: the module was loaded by `Spin::load` and this consumes the only handle.
        unsafe { result::module::unload(self.module) }.expect("unloading spin_ns");
    }
}

fn write(allocator: &CachingAllocator<CudaStorage>, address: u64, bytes: &[u8]) {
    // SAFETY: the copy writes memory of an allocation this test owns and frees nothing.
    unsafe { allocator.with_storage_mut(|storage| storage.copy_from_host(address, bytes)) }
        .unwrap();
}

fn read(
    allocator: &CachingAllocator<CudaStorage>,
    address: u64,
    len: u64,
) -> Result<Vec<u8>, StorageError> {
    let mut out = vec![0u8; len as usize];
    // SAFETY: the copy only reads device memory and frees nothing.
    unsafe { allocator.with_storage_mut(|storage| storage.copy_to_host(address, &mut out)) }?;
    Ok(out)
}

/// Whether the work queued before `event` has run (no waiting).
fn has_run(allocator: &CachingAllocator<CudaStorage>, event: EventId) -> bool {
    // SAFETY: querying the test's own event frees nothing.
    unsafe { allocator.with_storage_mut(|storage| storage.query_event(event)) }.unwrap()
}

/// Frees block `a` while a copy that reads it is queued behind a spin, closes the free epoch
/// with 64 more frees, lets the queued work finish first or not (`work_in_flight`), then asks
/// for a block whose pages must come from `a`'s: a reclaim.
///
/// The layout: `a` and `b` (64 MiB each) side by side in the stream's segment, a small block
/// kept live so that the small pool's page is never wholly free. The request of 96 MiB fits no
/// free block, and mapping it would take reserved memory (130 MiB + 96 MiB) above the reclaim
/// ceiling (the new live peak, 160 MiB, plus 0.5%), so `a`'s 64 MiB of pages are unmapped and
/// 96 MiB are mapped after `b`.
fn reclaim_after_a_stream_ordered_free(work_in_flight: bool) {
    let Some((_device, allocator)) = allocator_or_skip() else {
        return;
    };
    // SAFETY: creating a stream frees nothing.
    let stream = unsafe { allocator.with_storage_mut(|storage| storage.new_stream()) }.unwrap();
    let raw: sys::CUstream = allocator
        .with_storage(|storage| storage.raw_stream(stream))
        .unwrap()
        .cast();
    let spin = Spin::load();

    let small_live = allocator.allocate(4096, stream).unwrap();
    let a = allocator.allocate(64 * MIB, stream).unwrap();
    let b = allocator.allocate(64 * MIB, stream).unwrap();
    assert_eq!(b.address(), a.address() + 64 * MIB);
    let (a_address, b_address) = (a.address(), b.address());
    write(&allocator, a_address, &pattern_bytes(64 << 20, 1));
    write(&allocator, b_address, &pattern_bytes(64 << 20, 2));

    // On `stream`: the spin, then a copy that reads `a` into `b`, then an event.
    spin.launch(raw, SPIN);
    // SAFETY: both ranges are 64 MiB of mapped device memory of live allocations, and the copy
    // is ordered on the stream they were allocated on.
    unsafe { result::memcpy_dtod_async(b_address, a_address, (64 * MIB) as usize, raw) }
        .expect("cuMemcpyDtoDAsync");
    // SAFETY: recording the test's own event frees nothing.
    let copied =
        unsafe { allocator.with_storage_mut(|storage| storage.record_event(stream)) }.unwrap();

    // A stream-ordered free: the copy that reads `a` is still queued on `stream`.
    allocator.free(a).unwrap();
    for _ in 0..FREES_PER_MARK {
        let small = allocator.allocate(4096, stream).unwrap();
        allocator.free(small).unwrap();
    }
    if !work_in_flight {
        // The test waits, not the allocator: the mark recorded after the copy passes.
        // SAFETY: waiting for a stream frees nothing.
        unsafe { allocator.with_storage_mut(|storage| storage.synchronize_stream(stream)) }
            .unwrap();
    }
    assert_eq!(
        has_run(&allocator, copied),
        !work_in_flight,
        "the copy behind the spin must still be queued at the reclaim exactly when asked"
    );
    let reserved = allocator.memory_reserved();
    assert_eq!(reserved, 130 * MIB);
    assert_eq!(allocator.memory_stats().num_sync_all_streams, 0);

    let c = allocator.allocate(96 * MIB, stream).unwrap();

    let stats = allocator.memory_stats();
    assert_eq!(
        stats.num_sync_all_streams,
        i64::from(work_in_flight),
        "the reclaim waits for the device exactly when the free epoch of `a` has not passed \
         (work in flight: {work_in_flight})"
    );
    assert!(
        has_run(&allocator, copied),
        "the reclaim moved `a`'s pages before the copy that reads them had run"
    );
    // `a`'s pages moved: one unmap, reserved memory up by only 32 MiB, `c` after `b`, and
    // `a`'s addresses unmapped.
    assert_eq!(stats.num_device_free, 1, "one unmap: `a`'s pages");
    assert_eq!(allocator.memory_reserved(), reserved - 64 * MIB + 96 * MIB);
    assert_eq!(c.address(), b_address + 64 * MIB);
    assert!(matches!(
        read(&allocator, a_address, 1),
        Err(StorageError::InvalidRange(_))
    ));
    // The copy read `a`'s pages before they went: `b` holds what `a` held, and the context has
    // met no fault.
    assert_eq!(
        read(&allocator, b_address, 64 * MIB).unwrap(),
        pattern_bytes(64 << 20, 1)
    );
    write(&allocator, c.address(), &pattern_bytes(96 << 20, 3));
    assert_eq!(
        read(&allocator, c.address(), 96 * MIB).unwrap(),
        pattern_bytes(96 << 20, 3)
    );
    allocator.check_invariants().unwrap();

    // SAFETY: releasing the test's own event frees nothing of the allocator's.
    unsafe { allocator.with_storage_mut(|storage| storage.release_event(copied)) };
    for block in [b, c, small_live] {
        allocator.free(block).unwrap();
    }
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    spin.unload();
}

/// A kernel still in flight on the pages of a freed block: the reclaim that takes them waits
/// for the device first (one wait), so the queued copy reads `a` before its pages go.
#[test]
#[ignore = "needs a CUDA device"]
fn a_reclaim_waits_for_work_in_flight_on_the_pages_it_moves() {
    reclaim_after_a_stream_ordered_free(true);
}

/// The same pages once the work has run and the free epoch's mark has passed: they move with no
/// wait for the device.
#[test]
#[ignore = "needs a CUDA device"]
fn a_reclaim_moves_pages_whose_free_epoch_has_passed_without_waiting() {
    reclaim_after_a_stream_ordered_free(false);
}
