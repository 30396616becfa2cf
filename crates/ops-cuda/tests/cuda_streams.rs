//! Streams, events, pinned host memory and asynchronous copies on a real device: exact pinned
//! statistics and reuse, a random round trip through a side stream, overlap of a copy with a
//! running kernel (and no overlap where the destination may still be the kernels'), no early
//! reuse of pinned or device memory that a queued copy or kernel still uses, a pinned budget
//! whose exhaustion is a typed error naming it, typed errors for bad arguments, and small copies
//! through a kernel: the copy engine's bytes, and no wait behind another stream's large copy.
//! Each test is marked `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`, and
//! fails without a device where `HEADROOM_REQUIRE_GPU=1` is set (testkit's GPU gate).
//!
//! A test kernel that spins on the GPU's global timer (`spin_ns`, testkit's hand-written PTX)
//! keeps a stream busy for a known time, so what these tests assert does not depend on copy speed.
#![cfg(feature = "cuda")]

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use headroom_autograd_core::{BackendRef, DType, Tensor, TensorError, UnaryOp};
use headroom_caching_allocator::{AllocError, AllocatorConfig, PinnedHostStorage, StreamId};
use headroom_ops_cuda::{CudaBackend, CudaBackendOptions, CudaEvent, KernelArg, SmallCopies};
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device, SPIN_NS_PTX};
use headroom_testkit::inputs::uniform_f32;

const MIB: usize = 1 << 20;

/// The backend on device 0, holding the device (tests take it one at a time: the overlap and
/// reuse tests reason about what runs when), or `None` after the GPU gate's skip notice.
fn backend_or_skip(
    config: Option<AllocatorConfig>,
) -> Option<(MutexGuard<'static, ()>, Arc<CudaBackend>)> {
    let device = exclusive_device();
    let backend = match config {
        Some(config) => CudaBackend::with_config(0, config),
        None => CudaBackend::new(0),
    };
    Some((device, cuda_or_skip(backend)?))
}

/// Queues `spin_ns` for `duration` on the compute stream.
fn spin(backend: &CudaBackend, duration: Duration) {
    let kernel = backend
        .load_kernel("cuda_streams_test_spin", SPIN_NS_PTX, "spin_ns")
        .unwrap();
    // SAFETY: `spin_ns` takes one u64 and touches no memory.
    unsafe {
        backend
            .launch_kernel(
                &kernel,
                1,
                1,
                0,
                &[KernelArg::U64(duration.as_nanos() as u64)],
            )
            .unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_blocks_are_cached_with_exact_statistics() {
    let Some((_device, cuda)) = backend_or_skip(None) else {
        return;
    };
    let pinned = cuda.pinned_allocator();
    let a = cuda.pinned_host(1000).unwrap();
    assert_eq!((a.len(), a.allocated_bytes()), (1000, 1024));
    assert_eq!(pinned.memory_allocated(), 1024);
    assert_eq!(pinned.memory_reserved(), 2 * MIB as u64);
    let big = cuda.pinned_host(3 * MIB).unwrap();
    assert_eq!(pinned.memory_reserved(), 22 * MIB as u64);
    let (a_address, big_address) = (a.address(), big.address());
    assert_eq!(
        a.as_slice::<u8>().unwrap(),
        &[0u8; 1000][..],
        "new memory is zeroed"
    );
    drop(a);
    drop(big);
    assert_eq!(pinned.memory_allocated(), 0);

    let b = cuda.pinned_host(600).unwrap();
    let big_again = cuda.pinned_host(3 * MIB - 4096).unwrap();
    assert_eq!(b.address(), a_address, "the freed block is reused");
    assert_eq!(big_again.address(), big_address);
    let stats = pinned.memory_stats();
    assert_eq!(stats.allocation.all.allocated, 4);
    assert_eq!(stats.allocation.all.freed, 2);
    assert_eq!(stats.segment.all.current, 2);
    assert_eq!(stats.allocated_bytes.all.peak, (1024 + 3 * MIB) as i64);
    assert_eq!(stats.reserved_bytes.all.peak, (22 * MIB) as i64);
    drop(b);
    drop(big_again);
    pinned.empty_cache().unwrap();
    assert_eq!(pinned.memory_reserved(), 0);
    assert_eq!(pinned.with_storage(|storage| storage.bytes_in_use()), 0);

    // Device memory is untouched by all of this.
    assert_eq!(cuda.allocator().memory_allocated(), 0);
    let empty = cuda.pinned_host(0).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.as_slice::<f32>().unwrap(), &[] as &[f32]);
    pinned.check_invariants().unwrap();
}

/// A backend with a pinned budget of 24 MiB: a 3 MiB buffer takes a 20 MiB segment, so an 18 MiB
/// one (more than the segment's free 17 MiB; a segment of its own) is an out-of-memory error of
/// the `pinned` storage that names the budget (not a driver error); once the first is dropped,
/// the 18 MiB fit. The backend shows its pinned memory as its host allocator.
#[test]
#[ignore = "needs a CUDA device"]
fn exhausting_the_pinned_budget_is_a_typed_error_naming_it() {
    let options = CudaBackendOptions {
        pinned_budget: Some(24 * MIB as u64),
        ..CudaBackendOptions::default()
    };
    let Some(cuda) = cuda_or_skip(CudaBackend::with_options(0, options)) else {
        return;
    };
    let first = cuda.pinned_host(3 * MIB).unwrap();
    let err = cuda.pinned_host(18 * MIB).unwrap_err();
    let TensorError::Alloc(AllocError::OutOfMemory(report)) = &err else {
        panic!("not an out-of-memory error: {err}");
    };
    assert_eq!(report.storage, "pinned");
    assert_eq!(report.capacity, 24 * MIB as u64);
    assert_eq!(report.requested, 18 * MIB as u64);
    let message = err.to_string();
    assert!(
        message.contains("The pinned budget is 24.00 MiB of which 4.00 MiB is free"),
        "{message}"
    );
    drop(first);
    let second = cuda.pinned_host(18 * MIB).unwrap();
    assert_eq!(second.len(), 18 * MIB);
    let host = headroom_autograd_core::Backend::host_allocator_view(cuda.as_ref()).unwrap();
    assert_eq!(host.memory_allocated(), 18 * MIB as u64);
    assert_eq!(
        host.max_memory_reserved(),
        20 * MIB as u64,
        "never over the budget"
    );
    assert_eq!(
        cuda.allocator().memory_allocated(),
        0,
        "device memory untouched"
    );
}

/// Host → device on a side stream, a kernel on the compute stream after an event, device → host
/// on the side stream after the kernel: the result is bit-exact, and so are ranged copies.
#[test]
#[ignore = "needs a CUDA device"]
fn round_trip_through_a_side_stream_is_exact() {
    let Some((_device, cuda)) = backend_or_skip(None) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let n = 2 * MIB + 3;
    let data = uniform_f32(n, 7);
    let mut staging = cuda.pinned_host(n * 4).unwrap();
    staging
        .as_mut_slice::<f32>()
        .unwrap()
        .copy_from_slice(&data);
    let compute = cuda.compute_stream();
    let side = cuda.new_stream().unwrap();
    assert_eq!(compute.id(), StreamId::DEFAULT);
    assert_ne!(side.id(), StreamId::DEFAULT);

    let x = Tensor::empty(&gpu, &[n], DType::F32).unwrap();
    cuda.copy_to_tensor_async(&staging, 0, &x, &side).unwrap();
    compute.wait_event(&side.record_event().unwrap()).unwrap();
    let doubled = Tensor::empty(&gpu, &[n], DType::F32).unwrap();
    gpu.unary(UnaryOp::MulScalar(2.0), x.view(), doubled.view())
        .unwrap();
    side.wait_stream(&compute).unwrap();
    let mut back = cuda.pinned_host(n * 4).unwrap();
    cuda.copy_from_tensor_async(&doubled, &mut back, 0, &side)
        .unwrap();
    let expected: Vec<u32> = data.iter().map(|v| (v * 2.0).to_bits()).collect();
    let got: Vec<u32> = back
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert!(got == expected, "device → host differs from 2·x");
    assert!(back.is_idle().unwrap());

    // Ranged: bytes 4000..1_004_000 of the staging buffer to byte 8192 of a device buffer, and
    // back into the middle of a poisoned pinned buffer. `y` is of the compute stream's pool, so
    // the copy waits for the compute stream, where `full` wrote it.
    let y = Tensor::full(&gpu, &[MIB], -1.0, DType::F32).unwrap();
    cuda.copy_to_device_async(&staging, 4000..1_004_000, y.buffer(), 8192, &side)
        .unwrap();
    let mut window = cuda.pinned_host(1_100_000).unwrap();
    window.as_mut_slice::<u8>().unwrap().fill(0xA5);
    cuda.copy_to_host_async(y.buffer(), 8192, &mut window, 50_000..1_050_000, &side)
        .unwrap();
    let window = window.as_slice::<u8>().unwrap();
    let staged = staging.as_slice::<u8>().unwrap();
    assert!(window[..50_000].iter().all(|&b| b == 0xA5));
    assert!(window[50_000..1_050_000] == staged[4000..1_004_000]);
    assert!(window[1_050_000..].iter().all(|&b| b == 0xA5));
    let untouched = y.to_vec::<f32>().unwrap();
    assert!(untouched[..2048].iter().all(|&v| v == -1.0));
    assert!(untouched[(8192 + 1_000_000) / 4..]
        .iter()
        .all(|&v| v == -1.0));
}

/// A copy on a side stream into memory of the side stream's pool finishes while a kernel still
/// runs on the compute stream: the side stream does not wait for it. A copy into memory of the
/// compute stream's pool waits for the kernel. Timings are printed, not asserted.
#[test]
#[ignore = "needs a CUDA device"]
fn a_copy_on_a_side_stream_overlaps_a_running_kernel() {
    let Some((_device, cuda)) = backend_or_skip(None) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let compute = cuda.compute_stream();
    let side = cuda.new_stream().unwrap();
    let bytes = 64 * MIB;
    let mut staging = cuda.pinned_host(bytes).unwrap();
    let data = uniform_f32(bytes / 4, 11);
    staging
        .as_mut_slice::<f32>()
        .unwrap()
        .copy_from_slice(&data);
    let device = cuda
        .allocate_on_stream(&side, || Tensor::empty(&gpu, &[bytes / 4], DType::F32))
        .unwrap()
        .unwrap();
    let address = device.buffer().address();
    assert_eq!(
        cuda.allocator().allocation_stream(address).unwrap(),
        side.id()
    );
    // Warm up: module load, first copy.
    spin(&cuda, Duration::from_millis(1));
    cuda.copy_to_tensor_async(&staging, 0, &device, &side)
        .unwrap();
    side.synchronize().unwrap();
    compute.synchronize().unwrap();

    let alone_start = side.record_timing_event().unwrap();
    cuda.copy_to_tensor_async(&staging, 0, &device, &side)
        .unwrap();
    let alone_end = side.record_timing_event().unwrap();
    alone_end.synchronize().unwrap();
    let alone_ms = alone_start.elapsed_ms(&alone_end).unwrap();

    let kernel = Duration::from_millis(300);
    let started = Instant::now();
    spin(&cuda, kernel);
    let kernel_done = compute.record_event().unwrap();
    let copy_start = side.record_timing_event().unwrap();
    cuda.copy_to_tensor_async(&staging, 0, &device, &side)
        .unwrap();
    let copy_end = side.record_timing_event().unwrap();
    copy_end.synchronize().unwrap();
    let copy_seen = started.elapsed();
    let kernel_still_running = !kernel_done.query().unwrap();
    kernel_done.synchronize().unwrap();
    let kernel_seen = started.elapsed();
    let during_ms = copy_start.elapsed_ms(&copy_end).unwrap();
    println!(
        "64 MiB host→device: {alone_ms:.3} ms alone ({:.1} GB/s), {during_ms:.3} ms during a \
         300 ms kernel; copy done after {:.1} ms, kernel after {:.1} ms (host clock)",
        bytes as f64 / alone_ms as f64 / 1e6,
        copy_seen.as_secs_f64() * 1e3,
        kernel_seen.as_secs_f64() * 1e3
    );
    assert!(
        kernel_still_running,
        "the side stream's copy waited for the compute stream's kernel"
    );
    assert!(kernel_seen >= kernel);
    let back = device.to_vec::<f32>().unwrap();
    assert!(back
        .iter()
        .zip(&data)
        .all(|(a, b)| a.to_bits() == b.to_bits()));

    // Into a tensor of the compute stream's pool, the copy waits for the kernel.
    let shared = Tensor::empty(&gpu, &[bytes / 4], DType::F32).unwrap();
    assert_eq!(
        cuda.allocator()
            .allocation_stream(shared.buffer().address())
            .unwrap(),
        StreamId::DEFAULT
    );
    spin(&cuda, Duration::from_millis(100));
    let kernel_done = compute.record_event().unwrap();
    cuda.copy_to_tensor_async(&staging, 0, &shared, &side)
        .unwrap();
    side.record_event().unwrap().synchronize().unwrap();
    assert!(
        kernel_done.query().unwrap(),
        "the copy ran beside the kernel"
    );
    let back = shared.to_vec::<f32>().unwrap();
    assert!(back
        .iter()
        .zip(&data)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Freeing a pinned block and a device buffer while a queued copy still uses them does not let
/// the next allocation of that size take them: the host and a kernel write the new blocks while
/// the old copy is pending, and those writes survive it. Once the copy is done, the blocks come
/// back.
#[test]
#[ignore = "needs a CUDA device"]
fn blocks_of_a_copy_in_flight_are_not_reused() {
    let Some((_device, cuda)) = backend_or_skip(Some(AllocatorConfig::pytorch_defaults())) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let compute = cuda.compute_stream();
    let side = cuda.new_stream().unwrap();
    let n = MIB;
    let source = Tensor::from_slice(&gpu, &uniform_f32(n, 3), &[n]).unwrap();
    let mut incoming = cuda.pinned_host(n * 4).unwrap();
    let mut outgoing = cuda.pinned_host(n * 4).unwrap();
    outgoing
        .as_mut_slice::<f32>()
        .unwrap()
        .copy_from_slice(&uniform_f32(n, 5));
    let target = Tensor::empty(&gpu, &[n], DType::F32).unwrap();
    let (incoming_address, target_address) = (incoming.address(), target.buffer().address());
    // Load the elementwise kernels now: compiling their module on first use can outlast a spin.
    let _loaded = source.mul_scalar(1.0).unwrap();
    compute.synchronize().unwrap();

    // Hold the side stream back behind a kernel, then queue both copies on it.
    spin(&cuda, Duration::from_millis(300));
    side.wait_stream(&compute).unwrap();
    cuda.copy_from_tensor_async(&source, &mut incoming, 0, &side)
        .unwrap();
    cuda.copy_to_tensor_async(&outgoing, 0, &target, &side)
        .unwrap();
    drop(incoming);
    drop(target);
    assert!(
        !side.query().unwrap(),
        "the copies ran before the kernel ended"
    );

    let mut host_next = cuda.pinned_host(n * 4).unwrap();
    assert_ne!(
        host_next.address(),
        incoming_address,
        "pinned block reused early"
    );
    host_next.as_mut_slice::<u32>().unwrap().fill(0x1234_5678);
    let device_next = Tensor::full(&gpu, &[n], 7.0, DType::F32).unwrap();
    assert_ne!(
        device_next.buffer().address(),
        target_address,
        "device block reused early"
    );
    assert_eq!(
        cuda.pinned_allocator()
            .memory_stats()
            .active_bytes
            .all
            .current,
        3 * 4 * n as i64,
        "the freed pinned block stays active until its copy is done"
    );

    side.synchronize().unwrap();
    compute.synchronize().unwrap();
    assert!(host_next
        .as_slice::<u32>()
        .unwrap()
        .iter()
        .all(|&v| v == 0x1234_5678));
    assert!(device_next
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|&v| v == 7.0));
    let host_later = cuda.pinned_host(n * 4).unwrap();
    let device_later = Tensor::empty(&gpu, &[n], DType::F32).unwrap();
    assert_eq!(
        host_later.address(),
        incoming_address,
        "reused once the copy is done"
    );
    assert_eq!(device_later.buffer().address(), target_address);
    drop(outgoing);

    // A block of the side stream's pool is used by kernels too: freed while a kernel is queued,
    // it is not reused by the side stream until the kernel is done.
    let on_side = || {
        cuda.allocate_on_stream(&side, || Tensor::empty(&gpu, &[n], DType::F32))
            .unwrap()
            .unwrap()
    };
    let staged = on_side();
    let staged_address = staged.buffer().address();
    spin(&cuda, Duration::from_millis(300));
    let _reads = staged.mul_scalar(2.0).unwrap();
    drop(staged);
    let next = on_side();
    assert!(
        !compute.query().unwrap(),
        "the kernel ended before the allocation"
    );
    assert_ne!(
        next.buffer().address(),
        staged_address,
        "reused while a kernel may read it"
    );
    compute.synchronize().unwrap();
    let after = on_side();
    assert_eq!(after.buffer().address(), staged_address);
    // Outside the closure, allocations come from the compute stream's pool again.
    let outside = Tensor::empty(&gpu, &[n], DType::F32).unwrap();
    assert_eq!(
        cuda.allocator()
            .allocation_stream(outside.buffer().address())
            .unwrap(),
        StreamId::DEFAULT
    );
    cuda.pinned_allocator().check_invariants().unwrap();
    cuda.allocator().check_invariants().unwrap();
}

/// Timing events measure at least the time a kernel spins; events and streams refuse what they
/// cannot do with typed errors.
#[test]
#[ignore = "needs a CUDA device"]
fn events_time_work_and_bad_arguments_are_typed_errors() {
    let Some((_device, cuda)) = backend_or_skip(None) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let compute = cuda.compute_stream();
    spin(&cuda, Duration::from_millis(1));
    let start = compute.record_timing_event().unwrap();
    spin(&cuda, Duration::from_millis(20));
    let end = compute.record_timing_event().unwrap();
    end.synchronize().unwrap();
    assert!(end.query().unwrap());
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(ms >= 20.0, "{ms} ms for a 20 ms spin");
    let plain = compute.record_event().unwrap();
    assert!(matches!(
        start.elapsed_ms(&plain),
        Err(TensorError::InvalidArgument {
            op: "elapsed_ms",
            ..
        })
    ));
    // Re-recording moves the event to the stream's current end.
    spin(&cuda, Duration::from_millis(50));
    plain.record(&compute).unwrap();
    assert!(!plain.query().unwrap());
    plain.synchronize().unwrap();
    assert!(compute.query().unwrap());

    let side = cuda.new_stream().unwrap();
    let pinned = cuda.pinned_host(4096).unwrap();
    let mut pinned_out = cuda.pinned_host(4096).unwrap();
    let device = Tensor::zeros(&gpu, &[1024], DType::F32).unwrap();
    let invalid =
        |r: Result<(), TensorError>| matches!(r, Err(TensorError::InvalidArgument { .. }));
    assert!(invalid(cuda.copy_to_device_async(
        &pinned,
        0..4097,
        device.buffer(),
        0,
        &side
    )));
    assert!(invalid(cuda.copy_to_device_async(
        &pinned,
        std::ops::Range { start: 8, end: 4 },
        device.buffer(),
        0,
        &side
    )));
    assert!(invalid(cuda.copy_to_device_async(
        &pinned,
        0..4096,
        device.buffer(),
        4,
        &side
    )));
    assert!(invalid(cuda.copy_to_host_async(
        device.buffer(),
        1,
        &mut pinned_out,
        0..4096,
        &side
    )));
    let transposed = Tensor::zeros(&gpu, &[32, 32], DType::F32)
        .unwrap()
        .t()
        .unwrap();
    assert!(invalid(cuda.copy_to_tensor_async(
        &pinned,
        0,
        &transposed,
        &side
    )));

    let other = CudaBackend::new(0).unwrap();
    let other_stream = other.new_stream().unwrap();
    assert!(invalid(cuda.copy_to_device_async(
        &pinned,
        0..16,
        device.buffer(),
        0,
        &other_stream
    )));
    assert!(invalid(other_stream.wait_event(&plain)));
    let other_pinned = other.pinned_host(16).unwrap();
    assert!(invalid(cuda.copy_to_device_async(
        &other_pinned,
        0..16,
        device.buffer(),
        0,
        &side
    )));

    let odd = cuda.pinned_host(1001).unwrap();
    assert!(matches!(
        odd.as_slice::<f32>(),
        Err(TensorError::InvalidArgument { .. })
    ));
    assert_eq!(CudaEvent::drop_errors(), 0);
    assert_eq!(PinnedHostStorage::drop_errors(), 0);
    assert_eq!(cuda.free_errors().0, 0);
}

/// Small copies give the same bytes through a kernel as through a copy engine, in the compute
/// stream's order: reads of every length around the 4 KiB limit at odd offsets, and more small
/// writes queued behind a busy compute stream than there are pinned write slots (so slots are
/// reused while earlier writes wait), mixed with writes past the 16 KiB limit, all into
/// overlapping ranges whose final bytes follow the order of the writes.
#[test]
#[ignore = "needs a CUDA device"]
fn small_copies_through_a_kernel_equal_the_copy_engine() {
    let Some((_device, cuda)) = backend_or_skip(None) else {
        return;
    };
    assert_eq!(cuda.small_copies(), SmallCopies::Kernel);
    let source: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 + i / 251) as u8).collect();
    for mode in [SmallCopies::Kernel, SmallCopies::CopyEngine] {
        cuda.set_small_copies(mode);
        let uploaded = cuda.upload(&source).unwrap();
        for (offset, len) in [
            (0, 0),
            (3, 1),
            (5, 7),
            (8, 8),
            (1, 4095),
            (0, 4096),
            (9, 4097),
        ] {
            let mut out = vec![0xA5u8; len];
            // SAFETY: `offset + len` lies inside the 64 KiB upload, which is live.
            unsafe { cuda.download(uploaded.address() + offset, &mut out) }.unwrap();
            let offset = offset as usize;
            assert!(
                out == source[offset..offset + len],
                "{mode:?}: {len} bytes at {offset}"
            );
        }

        const REGION: usize = 48 * 1024;
        let target = cuda.upload(&vec![0u8; REGION]).unwrap();
        let mut expected = vec![0u8; REGION];
        spin(&cuda, Duration::from_millis(20));
        for k in 0..200usize {
            let len = match k % 5 {
                0 => 1,
                1 => 4096,
                2 => 16 * 1024,
                3 => 16 * 1024 + 1,
                _ => 1000 + 37 * k,
            };
            let at = (k * 4093) % (REGION - len);
            let bytes: Vec<u8> = (0..len).map(|i| (i + 31 * k) as u8).collect();
            // SAFETY: `at + len` ≤ REGION, inside the live target.
            unsafe { cuda.write_async(target.address() + at as u64, &bytes) }.unwrap();
            expected[at..at + len].copy_from_slice(&bytes);
        }
        let mut got = vec![0u8; REGION];
        // SAFETY: the whole live target.
        unsafe { cuda.download(target.address(), &mut got) }.unwrap();
        assert!(got == expected, "{mode:?}: the writes' final bytes");

        let gpu: BackendRef = cuda.clone();
        let values = [1.5f32, -2.0, 3.25];
        let tensor = Tensor::from_slice(&gpu, &values, &[3]).unwrap();
        assert_eq!(tensor.to_vec::<f32>().unwrap(), values, "{mode:?}");
        for allocation in [uploaded, target] {
            cuda.allocator().free(allocation).unwrap();
        }
    }
    cuda.set_small_copies(SmallCopies::Kernel);
    assert_eq!(cuda.free_errors().0, 0);
}

/// A small read or write through a kernel does not wait for a large copy another stream has
/// under way in the same direction: with a 1 GiB copy to the host (then one to the device)
/// running on a side stream, reading 8 bytes and writing 12 returns while that copy is still
/// under way (about 20 ms at the link's 55 GB/s). What the copy engine path does under the same
/// load is printed (whether it waited for the large copy), and so is whether a memset and a
/// device-to-device copy on the compute stream wait for it.
#[test]
#[ignore = "needs a CUDA device"]
fn small_copies_do_not_wait_behind_a_side_streams_large_copy() {
    let Some((_device, cuda)) = backend_or_skip(None) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let side = cuda.new_stream().unwrap();
    let big = Tensor::zeros(&gpu, &[256 * MIB], DType::F32).unwrap();
    let mut pinned = cuda.pinned_host(1024 * MIB).unwrap();
    let small = Tensor::from_slice(&gpu, &[7.0f32, 8.0], &[2]).unwrap();
    for mode in [SmallCopies::Kernel, SmallCopies::CopyEngine] {
        cuda.set_small_copies(mode);
        // One read and one write before the timed ones: a kernel's first launch loads it, and
        // loading may wait for the whole context (the side stream's copy included).
        assert_eq!(small.to_vec::<f32>().unwrap(), [7.0, 8.0]);
        drop(Tensor::from_slice(&gpu, &[0.0f32; 3], &[3]).unwrap());
        cuda.synchronize().unwrap();
        cuda.copy_from_tensor_async(&big, &mut pinned, 0, &side)
            .unwrap();
        let started = Instant::now();
        assert_eq!(small.to_vec::<f32>().unwrap(), [7.0, 8.0]);
        let read_ms = started.elapsed().as_secs_f64() * 1e3;
        let read_waited = pinned.is_idle().unwrap();
        // A memset and a device-to-device copy on the compute stream, observed only.
        let started = Instant::now();
        let zeros = Tensor::zeros(&gpu, &[MIB], DType::F32).unwrap();
        let copied = Tensor::empty(&gpu, &[MIB], DType::F32).unwrap();
        copied.copy_(&zeros).unwrap();
        cuda.compute_stream().synchronize().unwrap();
        let device_ms = started.elapsed().as_secs_f64() * 1e3;
        let device_waited = pinned.is_idle().unwrap();
        side.synchronize().unwrap();

        cuda.copy_to_tensor_async(&pinned, 0, &big, &side).unwrap();
        let started = Instant::now();
        let written = Tensor::from_slice(&gpu, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
        let doubled = written.add(&written).unwrap();
        let write_ms = started.elapsed().as_secs_f64() * 1e3;
        let write_waited = pinned.is_idle().unwrap();
        assert_eq!(doubled.to_vec::<f32>().unwrap(), [2.0, 4.0, 6.0]);
        side.synchronize().unwrap();
        println!(
            "{mode:?}: an 8-byte read took {read_ms:.3} ms (waited for the 1 GiB copy out: \
             {read_waited}); a 4 MiB memset and device copy {device_ms:.3} ms (waited for it: \
             {device_waited}); a 12-byte write {write_ms:.3} ms (waited for the copy in: \
             {write_waited})"
        );
        if mode == SmallCopies::Kernel {
            assert!(
                !read_waited,
                "the small read waited for the side stream's copy out"
            );
            assert!(
                !write_waited,
                "the small write waited for the side stream's copy in"
            );
        }
    }
    cuda.set_small_copies(SmallCopies::Kernel);
}
