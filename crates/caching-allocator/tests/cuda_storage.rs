//! The CUDA storage alone, on a real device: segments, mapped pages, streams, events and
//! out-of-memory. Each test needs a CUDA device: marked `#[ignore = "needs a CUDA device"]`, it
//! runs with `--include-ignored`. On a device that cannot map pages (of 2 MiB, for the
//! large-handle test) it skips, or fails where `HEADROOM_REQUIRE_GPU=1` is set (testkit's gate):
//! an H200 maps 2 MiB pages, so on the GPU machine every test runs.
#![cfg(feature = "cuda")]

use std::sync::MutexGuard;

use headroom_caching_allocator::{
    CudaStorage, CudaStorageOptions, MappingUnits, Storage, StorageError, StreamId,
};
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device, skip};
use headroom_testkit::inputs::pattern_bytes;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The storage on device 0, holding the device (tests take it one at a time: the out-of-memory
/// test reads the free memory and must not see another test's allocations come and go), or
/// `None` after the GPU gate's skip notice.
fn storage_or_skip(options: CudaStorageOptions) -> Option<(MutexGuard<'static, ()>, CudaStorage)> {
    let device = exclusive_device();
    let storage = cuda_or_skip(CudaStorage::with_options(0, options))?;
    Some((device, storage))
}

#[test]
#[ignore = "needs a CUDA device"]
fn segment_write_read_free() {
    let Some((_device, mut storage)) = storage_or_skip(CudaStorageOptions::default()) else {
        return;
    };
    assert_eq!(storage.name(), "cuda");
    println!("device: {}", storage.device_name());
    let size = 4 * MIB;
    let address = storage.allocate_segment(size).unwrap();
    assert_ne!(address, 0);
    assert_eq!(storage.bytes_in_use(), size);

    storage.memset(address, 0xAB, size).unwrap();
    let mut back = vec![0u8; size as usize];
    storage.copy_to_host(address, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0xAB));

    let data = pattern_bytes(size as usize, 7);
    storage.copy_from_host(address, &data).unwrap();
    let mut back = vec![0u8; size as usize];
    storage.copy_to_host(address, &mut back).unwrap();
    assert_eq!(back, data);

    // Outside the segment: refused before the driver sees it.
    assert!(matches!(
        storage.copy_to_host(address + size - 1, &mut [0u8; 2]),
        Err(StorageError::InvalidRange(_))
    ));
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
fn expandable_map_write_unmap_remap() {
    let Some((_device, mut storage)) = storage_or_skip(CudaStorageOptions::default()) else {
        return;
    };
    if !storage.supports_expandable_segments() {
        skip("the device cannot map pages");
        return;
    }
    let page = storage.page_granularity();
    assert!(
        page.is_power_of_two() && page >= 64 * 1024,
        "granularity {page}"
    );
    println!("granularity: {page}");
    let reserved = 64 * page;
    let base = storage
        .reserve_address_space(reserved, MappingUnits::pages(storage.page_granularity()))
        .unwrap();
    assert_eq!(base % page, 0);

    // Two map calls: 8 pages, then 4 more right behind.
    storage.map(base, 8 * page).unwrap();
    storage.map(base + 8 * page, 4 * page).unwrap();
    assert_eq!(storage.bytes_in_use(), 12 * page);
    assert!(matches!(
        storage.map(base + 4 * page, page),
        Err(StorageError::InvalidRange(_))
    ));
    assert!(matches!(
        storage.map(base + 1, page),
        Err(StorageError::InvalidRange(_))
    ));

    // One write across both map calls.
    let data = pattern_bytes((12 * page) as usize, 3);
    storage.copy_from_host(base, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    storage.copy_to_host(base, &mut back).unwrap();
    assert_eq!(back, data);

    // Unmap a range that cuts through both map calls: pages 6..10.
    storage.unmap(base + 6 * page, 4 * page).unwrap();
    assert_eq!(storage.bytes_in_use(), 8 * page);
    assert!(matches!(
        storage.unmap(base + 6 * page, page),
        Err(StorageError::InvalidRange(_))
    ));
    assert!(matches!(
        storage.copy_to_host(base + 5 * page, &mut vec![0u8; 2 * page as usize]),
        Err(StorageError::InvalidRange(_))
    ));

    // What was kept still holds its data.
    let mut kept = vec![0u8; (6 * page) as usize];
    storage.copy_to_host(base, &mut kept).unwrap();
    assert_eq!(kept, data[..(6 * page) as usize]);
    let mut kept = vec![0u8; (2 * page) as usize];
    storage.copy_to_host(base + 10 * page, &mut kept).unwrap();
    assert_eq!(kept, data[(10 * page) as usize..(12 * page) as usize]);

    // Map the hole again and write through it.
    storage.map(base + 6 * page, 4 * page).unwrap();
    let fresh = pattern_bytes((4 * page) as usize, 99);
    storage.copy_from_host(base + 6 * page, &fresh).unwrap();
    let mut whole = vec![0u8; (12 * page) as usize];
    storage.copy_to_host(base, &mut whole).unwrap();
    assert_eq!(whole[..(6 * page) as usize], data[..(6 * page) as usize]);
    assert_eq!(whole[(6 * page) as usize..(10 * page) as usize], fresh[..]);
    assert_eq!(whole[(10 * page) as usize..], data[(10 * page) as usize..]);

    // A reservation with mapped pages cannot be released.
    assert!(matches!(
        storage.release_address_space(base, reserved),
        Err(StorageError::InvalidRange(_))
    ));
    storage.synchronize_device().unwrap();
    storage.unmap(base, 12 * page).unwrap();
    assert_eq!(storage.bytes_in_use(), 0);
    storage.release_address_space(base, reserved).unwrap();
    storage.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn larger_handles_map_and_unmap_whole() {
    let granularity = 2 * MIB;
    let Some((_device, mut storage)) = storage_or_skip(CudaStorageOptions::default()) else {
        return;
    };
    if !storage.supports_expandable_segments() || storage.page_granularity() != granularity {
        skip(format_args!(
            "the device does not map pages of {granularity} bytes (its granularity: {} bytes)",
            storage.page_granularity()
        ));
        return;
    }
    let page = granularity;
    let base = storage
        .reserve_address_space(
            64 * page,
            MappingUnits {
                page,
                max_handle: 10 * page,
            },
        )
        .unwrap();
    // 23 pages at offset 0: two handles of 10 pages, then one of 3.
    storage.map(base, 23 * page).unwrap();
    let data = pattern_bytes((23 * page) as usize, 42);
    storage.copy_from_host(base, &data).unwrap();
    assert_eq!(
        storage.releasable_range(base + page, base + 23 * page),
        (base + 10 * page, base + 23 * page)
    );
    assert_eq!(
        storage.releasable_range(base + page, base + 19 * page),
        (base + 10 * page, base + 10 * page)
    );
    // Cutting through a handle is refused and unmaps nothing.
    for (start, pages) in [(3, 1), (0, 15), (20, 2)] {
        assert!(matches!(
            storage.unmap(base + start * page, pages * page),
            Err(StorageError::InvalidRange(_))
        ));
    }
    assert_eq!(storage.bytes_in_use(), 23 * page);
    let mut back = vec![0u8; data.len()];
    storage.copy_to_host(base, &mut back).unwrap();
    assert_eq!(back, data);
    // Whole handles unmap, alone or together; the rest keeps its data.
    storage.unmap(base + 10 * page, 13 * page).unwrap();
    assert_eq!(storage.bytes_in_use(), 10 * page);
    let mut front = vec![0u8; (10 * page) as usize];
    storage.copy_to_host(base, &mut front).unwrap();
    assert_eq!(front, data[..front.len()]);
    // The freed range maps again, in handles of its own.
    storage.map(base + 10 * page, 4 * page).unwrap();
    storage.unmap(base, 14 * page).unwrap();
    assert_eq!(storage.bytes_in_use(), 0);
    storage.release_address_space(base, 64 * page).unwrap();
    storage.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn events_on_two_streams() {
    let Some((_device, mut storage)) = storage_or_skip(CudaStorageOptions::default()) else {
        return;
    };
    let busy = storage.new_stream().unwrap();
    let idle = storage.new_stream().unwrap();
    assert_ne!(busy, idle);
    assert!(
        busy.0 > 0 && busy.0 < 16 && idle.0 < 16,
        "stream ids stay small"
    );

    // About 40 GB of memset (some 10 ms on an H200) queued on `busy`.
    let size = 2 * GIB;
    let address = storage.allocate_segment(size).unwrap();
    for i in 0..20 {
        storage.memset_async(busy, address, i as u8, size).unwrap();
    }
    let busy_event = storage.record_event(busy).unwrap();
    let idle_event = storage.record_event(idle).unwrap();
    assert!(
        !storage.query_event(busy_event).unwrap(),
        "the memsets cannot be done yet"
    );
    storage.synchronize_event(idle_event).unwrap();
    assert!(storage.query_event(idle_event).unwrap());

    storage.synchronize_event(busy_event).unwrap();
    assert!(storage.query_event(busy_event).unwrap());
    let mut last = [0u8; 16];
    storage
        .copy_to_host(address + size - 16, &mut last)
        .unwrap();
    assert_eq!(last, [19u8; 16]);

    // Released events are reused, and a reused event tracks its new record.
    storage.release_event(busy_event);
    storage.release_event(idle_event);
    assert!(matches!(
        storage.query_event(busy_event),
        Err(StorageError::InvalidRange(_))
    ));
    storage.memset_async(busy, address, 1, size).unwrap();
    let again = storage.record_event(busy).unwrap();
    storage.synchronize_stream(busy).unwrap();
    assert!(storage.query_event(again).unwrap());

    // The default stream works too; unknown streams are refused.
    let on_default = storage.record_event(StreamId::DEFAULT).unwrap();
    storage.synchronize_event(on_default).unwrap();
    assert!(matches!(
        storage.record_event(StreamId(1000)),
        Err(StorageError::InvalidRange(_))
    ));
    storage.free_segment(address, size).unwrap();
    storage.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn memory_limit_gives_out_of_memory() {
    let limit = 64 * MIB;
    let options = CudaStorageOptions {
        memory_limit: Some(limit),
        ..CudaStorageOptions::default()
    };
    let Some((_device, mut storage)) = storage_or_skip(options) else {
        return;
    };
    let info = storage.memory_info();
    assert_eq!(info.total, limit);
    assert!(info.free <= limit);

    let first = storage.allocate_segment(40 * MIB).unwrap();
    assert_eq!(storage.memory_info().free, 24 * MIB);
    assert_eq!(
        storage.allocate_segment(40 * MIB),
        Err(StorageError::OutOfMemory {
            requested: 40 * MIB
        })
    );
    if storage.supports_expandable_segments() {
        let page = storage.page_granularity();
        let base = storage
            .reserve_address_space(64 * page, MappingUnits::pages(page))
            .unwrap();
        assert_eq!(
            storage.map(base, 32 * page),
            Err(StorageError::OutOfMemory {
                requested: 32 * page
            })
        );
        storage.release_address_space(base, 64 * page).unwrap();
    } else {
        skip("the device cannot map pages, so a map beyond the limit is not tried");
    }
    storage.free_segment(first, 40 * MIB).unwrap();
    let second = storage.allocate_segment(40 * MIB).unwrap();
    storage.free_segment(second, 40 * MIB).unwrap();
    storage.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_out_of_memory_then_recovers() {
    let Some((_device, mut storage)) = storage_or_skip(CudaStorageOptions::default()) else {
        return;
    };
    let info = storage.memory_info();
    assert!(info.total > 0 && info.free <= info.total);
    let too_much = info.free + GIB;
    assert_eq!(
        storage.allocate_segment(too_much),
        Err(StorageError::OutOfMemory {
            requested: too_much
        })
    );
    if storage.supports_expandable_segments() {
        let page = storage.page_granularity();
        let size = too_much.div_ceil(page) * page;
        let base = storage
            .reserve_address_space(size, MappingUnits::pages(page))
            .unwrap();
        assert_eq!(
            storage.map(base, size),
            Err(StorageError::OutOfMemory { requested: size })
        );
        assert_eq!(
            storage.bytes_in_use(),
            0,
            "a failed map leaves nothing mapped"
        );
        storage.release_address_space(base, size).unwrap();
    } else {
        skip("the device cannot map pages, so a map beyond its memory is not tried");
    }
    let small = storage.allocate_segment(2 * MIB).unwrap();
    storage.memset(small, 1, 2 * MIB).unwrap();
    storage.free_segment(small, 2 * MIB).unwrap();
    storage.close().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn storage_moves_between_threads() {
    let Some((_device, mut storage)) = storage_or_skip(CudaStorageOptions::default()) else {
        return;
    };
    let address = storage.allocate_segment(2 * MIB).unwrap();
    let mut storage = std::thread::spawn(move || {
        storage.memset(address, 5, 2 * MIB).unwrap();
        storage
    })
    .join()
    .unwrap();
    let mut back = [0u8; 8];
    storage.copy_to_host(address, &mut back).unwrap();
    assert_eq!(back, [5u8; 8]);
    storage.free_segment(address, 2 * MIB).unwrap();
    drop(storage);
    assert_eq!(CudaStorage::drop_errors(), 0);
}
