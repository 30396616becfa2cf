//! Pinned host memory under the caching policy: the host-stream rule on simulated memory (runs
//! everywhere), and `PinnedHostStorage` on a real device — zeroed segments, exact statistics and
//! reuse, limits, stream registration. The CUDA tests are marked `#[ignore = "needs a CUDA
//! device"]` and run with `--include-ignored` (testkit's GPU gate).

use headroom_caching_allocator::{
    AllocError, AllocatorConfig, CachingAllocator, SimulatedStorage, StreamId,
};

const MIB: u64 = 1 << 20;

/// The id pinned blocks live on (`PinnedHostStorage::HOST_STREAM`, spelled out so this test also
/// runs without the `cuda` feature).
const HOST: StreamId = StreamId(u64::MAX);

/// Why blocks live on a stream no device work runs on: a copy on the device's default stream must
/// still hold the block back, which `record_stream` does only for a stream other than the
/// block's own.
#[test]
fn a_block_on_the_host_stream_waits_for_a_copy_on_the_default_stream() {
    let storage = SimulatedStorage::new(64 * MIB);
    let events = storage.event_control();
    let allocator = CachingAllocator::new(storage, AllocatorConfig::pytorch_defaults());

    let staging = allocator.allocate(3000, HOST).unwrap();
    let staging_address = staging.address();
    assert_eq!(allocator.allocation_stream(staging_address).unwrap(), HOST);
    allocator
        .record_stream_address(staging_address, StreamId::DEFAULT)
        .unwrap();
    allocator.free(staging).unwrap();
    assert_eq!(events.n_pending(), 1, "one event, on the default stream");
    assert!(matches!(
        allocator.allocation_stream(staging_address),
        Err(AllocError::UnknownAddress { .. })
    ));

    let early = allocator.allocate(3000, HOST).unwrap();
    assert_ne!(early.address(), staging_address, "reused during the copy");
    events.complete_stream(StreamId::DEFAULT);
    let late = allocator.allocate(3000, HOST).unwrap();
    assert_eq!(late.address(), staging_address);

    // Had the block lived on the default stream itself, nothing would have held it back.
    let own = allocator.allocate(3000, StreamId::DEFAULT).unwrap();
    let own_address = own.address();
    allocator
        .record_stream_address(own_address, StreamId::DEFAULT)
        .unwrap();
    allocator.free(own).unwrap();
    assert_eq!(events.n_pending(), 0);
    let again = allocator.allocate(3000, StreamId::DEFAULT).unwrap();
    assert_eq!(again.address(), own_address);

    assert!(matches!(
        allocator.record_stream_address(1, StreamId(2)),
        Err(AllocError::UnknownAddress { address: 1 })
    ));
    for allocation in [early, late, again] {
        allocator.free(allocation).unwrap();
    }
    allocator.check_invariants().unwrap();
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::MutexGuard;

    use headroom_caching_allocator::{
        AllocatorConfig, CachingAllocator, CudaStorage, PinnedHostOptions, PinnedHostStorage,
        Storage, StorageError, StreamId,
    };
    use headroom_testkit::gpu::{cuda_or_skip, exclusive_device};

    use super::MIB;

    /// The pinned storage of device 0, holding the device (one test at a time, as in
    /// `cuda_storage.rs`), or `None` after the GPU gate's skip notice.
    fn pinned_or_skip(
        options: PinnedHostOptions,
    ) -> Option<(MutexGuard<'static, ()>, PinnedHostStorage)> {
        let device = exclusive_device();
        let storage = cuda_or_skip(PinnedHostStorage::with_options(0, options))?;
        Some((device, storage))
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn segments_are_zeroed_writable_and_freed_once() {
        let Some((_device, mut storage)) = pinned_or_skip(PinnedHostOptions::default()) else {
            return;
        };
        assert_eq!(storage.name(), "pinned");
        assert!(!storage.supports_expandable_segments());
        let size = 4 * MIB;
        let address = storage.allocate_segment(size).unwrap();
        assert_ne!(address, 0);
        assert_eq!(address % 4096, 0, "page aligned");
        assert_eq!(storage.bytes_in_use(), size);
        // SAFETY: the segment is `size` bytes of host memory this test owns until it frees it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, size as usize) };
        assert!(bytes.iter().all(|&b| b == 0), "zeroed when obtained");
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        assert_eq!(bytes[1000], (1000 % 251) as u8);

        assert!(matches!(
            storage.free_segment(address, size + 1),
            Err(StorageError::InvalidRange(_))
        ));
        storage.free_segment(address, size).unwrap();
        assert_eq!(storage.bytes_in_use(), 0);
        assert!(matches!(
            storage.free_segment(address, size),
            Err(StorageError::InvalidRange(_))
        ));
        storage.close().unwrap();
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn the_limit_is_an_out_of_memory_error() {
        let options = PinnedHostOptions {
            memory_limit: Some(24 * MIB),
        };
        let Some((_device, mut storage)) = pinned_or_skip(options) else {
            return;
        };
        let info = storage.memory_info();
        assert_eq!((info.free, info.total), (24 * MIB, 24 * MIB));
        let a = storage.allocate_segment(20 * MIB).unwrap();
        assert_eq!(
            storage.allocate_segment(20 * MIB),
            Err(StorageError::OutOfMemory {
                requested: 20 * MIB
            })
        );
        assert_eq!(storage.memory_info().free, 4 * MIB);
        storage.free_segment(a, 20 * MIB).unwrap();
        storage.close().unwrap();
    }

    /// The policy over pinned memory keeps PyTorch's numbers: 512-byte rounding, a 2 MiB small
    /// segment, a 20 MiB segment for a 3 MiB request, reuse of a freed block by address.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn the_policy_over_pinned_memory_has_exact_statistics() {
        let Some((_device, storage)) = pinned_or_skip(PinnedHostOptions::default()) else {
            return;
        };
        let host = PinnedHostStorage::HOST_STREAM;
        let allocator = CachingAllocator::new(storage, AllocatorConfig::pytorch_defaults());
        let small = allocator.allocate(1000, host).unwrap();
        let large = allocator.allocate(3 * MIB, host).unwrap();
        assert_eq!(small.size(), 1024);
        assert_eq!(large.size(), 3 * MIB);
        assert_eq!(allocator.memory_allocated(), 1024 + 3 * MIB);
        assert_eq!(allocator.memory_reserved(), 2 * MIB + 20 * MIB);
        let (small_address, large_address) = (small.address(), large.address());
        allocator.free(small).unwrap();
        allocator.free(large).unwrap();
        assert_eq!(allocator.memory_allocated(), 0);

        let small_again = allocator.allocate(900, host).unwrap();
        let large_again = allocator.allocate(3 * MIB - 100, host).unwrap();
        assert_eq!(small_again.address(), small_address);
        assert_eq!(large_again.address(), large_address);
        let stats = allocator.memory_stats();
        assert_eq!(stats.allocation.all.allocated, 4);
        assert_eq!(stats.allocation.all.freed, 2);
        assert_eq!(stats.segment.all.allocated, 2);
        assert_eq!(stats.reserved_bytes.all.peak, (22 * MIB) as i64);
        assert_eq!(stats.allocated_bytes.all.peak, (1024 + 3 * MIB) as i64);
        assert_eq!(
            allocator.with_storage(|storage| storage.bytes_in_use()),
            22 * MIB
        );
        allocator.free(small_again).unwrap();
        allocator.free(large_again).unwrap();
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.memory_reserved(), 0);
        assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
        allocator.check_invariants().unwrap();
    }

    /// Device streams are lent under the device allocator's ids; the default and host streams
    /// are reserved, unknown streams are errors, host-stream events are complete at once.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn streams_are_lent_by_id_and_events_complete() {
        let Some((_device, mut pinned)) = pinned_or_skip(PinnedHostOptions::default()) else {
            return;
        };
        let mut device = CudaStorage::new(0).unwrap();
        let side = device.new_stream().unwrap();
        let raw = device.raw_stream(side).unwrap();
        // SAFETY: `raw` is a stream of device 0's primary context, alive until `device` drops,
        // after `pinned` has been closed.
        unsafe {
            pinned.register_stream(side, raw).unwrap();
            assert!(pinned.register_stream(side, raw).is_err(), "twice");
            assert!(pinned.register_stream(StreamId::DEFAULT, raw).is_err());
            assert!(pinned
                .register_stream(PinnedHostStorage::HOST_STREAM, raw)
                .is_err());
        }
        let host_event = pinned.record_event(PinnedHostStorage::HOST_STREAM).unwrap();
        assert!(pinned.query_event(host_event).unwrap());
        pinned.release_event(host_event);

        let segment = device.allocate_segment(64 * MIB).unwrap();
        device.memset_async(side, segment, 1, 64 * MIB).unwrap();
        let event = pinned.record_event(side).unwrap();
        pinned.synchronize_event(event).unwrap();
        assert!(pinned.query_event(event).unwrap());
        pinned.release_event(event);
        let default_event = pinned.record_event(StreamId::DEFAULT).unwrap();
        pinned.synchronize_event(default_event).unwrap();
        pinned.release_event(default_event);
        assert!(matches!(
            pinned.record_event(StreamId(side.0 + 100)),
            Err(StorageError::InvalidRange(_))
        ));
        assert!(matches!(
            pinned.query_event(event),
            Err(StorageError::InvalidRange(_))
        ));
        pinned.close().unwrap();
        device.free_segment(segment, 64 * MIB).unwrap();
        device.close().unwrap();
    }
}
