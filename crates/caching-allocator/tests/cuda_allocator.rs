//! The caching policy over `CudaStorage` on a real device: allocate, write, free, reuse, grow and
//! shrink expandable segments, and recover from a real out-of-memory. Each test prints a skip
//! notice (and passes) on a machine without a CUDA device, and fails instead where
//! `HEADROOM_REQUIRE_GPU=1` is set (testkit's GPU gate).
#![cfg(feature = "cuda")]

use std::sync::MutexGuard;

use headroom_caching_allocator::{
    AllocError, AllocatorConfig, CachingAllocator, CudaStorage, StreamId,
};
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device};
use headroom_testkit::inputs::pattern_bytes;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The allocator over device 0, holding the device (one test at a time: the OOM test reads the
/// free memory), or `None` after the GPU gate's skip notice.
fn allocator_or_skip(
    config: AllocatorConfig,
) -> Option<(MutexGuard<'static, ()>, CachingAllocator<CudaStorage>)> {
    let device = exclusive_device();
    let storage = cuda_or_skip(CudaStorage::new(0))?;
    Some((device, CachingAllocator::new(storage, config)))
}

fn write(allocator: &CachingAllocator<CudaStorage>, address: u64, bytes: &[u8]) {
    // SAFETY: the copy writes memory of an allocation this test owns and frees nothing.
    unsafe { allocator.with_storage_mut(|storage| storage.copy_from_host(address, bytes)) }
        .unwrap();
}

fn read(allocator: &CachingAllocator<CudaStorage>, address: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: the copy only reads device memory and frees nothing.
    unsafe { allocator.with_storage_mut(|storage| storage.copy_to_host(address, &mut out)) }
        .unwrap();
    out
}

#[test]
fn classic_segments_allocate_write_free_reuse() {
    let Some((_device, allocator)) = allocator_or_skip(AllocatorConfig::pytorch_defaults()) else {
        return;
    };
    assert!(!allocator.uses_expandable_segments());
    let sizes = [1000, 300 * 1024, 3 * MIB, 25 * MIB];
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&size| allocator.allocate(size, StreamId::DEFAULT).unwrap())
        .collect();
    for (index, block) in blocks.iter().enumerate() {
        write(
            &allocator,
            block.address(),
            &pattern_bytes(block.requested() as usize, index as u8),
        );
    }
    for (index, block) in blocks.iter().enumerate() {
        let expected = pattern_bytes(block.requested() as usize, index as u8);
        assert_eq!(read(&allocator, block.address(), expected.len()), expected);
    }
    // 2 MiB small segment, 20 MiB for 3 MiB, 26 MiB for 25 MiB.
    assert_eq!(allocator.memory_reserved(), (2 + 20 + 26) * MIB);
    let addresses: Vec<u64> = blocks.iter().map(|b| b.address()).collect();
    for block in blocks {
        allocator.free(block).unwrap();
    }
    let again: Vec<_> = sizes
        .iter()
        .map(|&size| allocator.allocate(size, StreamId::DEFAULT).unwrap())
        .collect();
    let reused: Vec<u64> = again.iter().map(|b| b.address()).collect();
    assert_eq!(reused, addresses, "cached blocks are handed out again");
    assert_eq!(allocator.memory_stats().num_device_alloc, 3);
    for block in again {
        allocator.free(block).unwrap();
    }
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
    allocator.check_invariants().unwrap();
}

#[test]
fn expandable_segments_map_and_unmap_pages_keeping_data() {
    let Some((_device, allocator)) = allocator_or_skip(AllocatorConfig::default()) else {
        return;
    };
    assert!(
        allocator.uses_expandable_segments(),
        "the H200 supports virtual memory management"
    );
    let blocks: Vec<_> = (0..3)
        .map(|_| allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap())
        .collect();
    assert_eq!(allocator.memory_reserved(), 100 * MIB);
    for (index, block) in blocks.iter().enumerate() {
        write(
            &allocator,
            block.address(),
            &pattern_bytes(30 * MIB as usize, index as u8),
        );
    }
    let mut blocks = blocks;
    let middle = blocks.remove(1);
    allocator.free(middle).unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(
        allocator.memory_reserved(),
        80 * MIB,
        "the free 20 MiB page is unmapped"
    );
    for (block, seed) in blocks.iter().zip([0u8, 2]) {
        let expected = pattern_bytes(30 * MIB as usize, seed);
        assert_eq!(read(&allocator, block.address(), expected.len()), expected);
    }
    // The hole is mapped again for a new block, which is usable.
    let refill = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(refill.address(), blocks[0].address() + 30 * MIB);
    write(
        &allocator,
        refill.address(),
        &pattern_bytes(30 * MIB as usize, 9),
    );
    assert_eq!(
        read(&allocator, refill.address(), 30 * MIB as usize),
        pattern_bytes(30 * MIB as usize, 9)
    );
    assert_eq!(allocator.memory_reserved(), 100 * MIB);
    allocator.check_invariants().unwrap();
    blocks.push(refill);
    for block in blocks {
        allocator.free(block).unwrap();
    }
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
}

#[test]
fn device_out_of_memory_is_an_error_and_the_allocator_goes_on() {
    for config in [
        AllocatorConfig::pytorch_defaults(),
        AllocatorConfig::default(),
    ] {
        let Some((_device, allocator)) = allocator_or_skip(config) else {
            return;
        };
        let kept = allocator.allocate(64 * MIB, StreamId::DEFAULT).unwrap();
        let free = allocator.with_storage(|storage| {
            use headroom_caching_allocator::Storage;
            storage.memory_info().free
        });
        let error = allocator
            .allocate(free + GIB, StreamId::DEFAULT)
            .unwrap_err();
        let AllocError::OutOfMemory(report) = &error else {
            panic!("expected OOM, got {error}")
        };
        assert_eq!(report.requested, free + GIB);
        assert_eq!(report.storage, "cuda");
        assert_eq!(report.allocated, 64 * MIB);
        println!("{error}");
        assert_eq!(allocator.memory_stats().num_ooms, 1);
        // Still working: a new block and the old one are usable.
        let next = allocator.allocate(256 * MIB, StreamId::DEFAULT).unwrap();
        write(&allocator, next.address(), &pattern_bytes(4096, 3));
        assert_eq!(
            read(&allocator, next.address(), 4096),
            pattern_bytes(4096, 3)
        );
        allocator.free(next).unwrap();
        allocator.free(kept).unwrap();
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.memory_reserved(), 0);
        allocator.check_invariants().unwrap();
    }
}
