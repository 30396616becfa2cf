//! The caching policy over `CudaStorage` on a real device: allocate, write, free, reuse, grow and
//! shrink expandable segments, and recover from a real out-of-memory. Each test needs a CUDA
//! device: marked `#[ignore = "needs a CUDA device"]`, it runs with `--include-ignored`, and
//! fails without one where `HEADROOM_REQUIRE_GPU=1` is set (testkit's GPU gate).
#![cfg(feature = "cuda")]

use std::sync::MutexGuard;

use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, CudaStorage, StreamId,
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

/// Writes the pattern of `seed` over the bytes `block` asked for.
fn fill(allocator: &CachingAllocator<CudaStorage>, block: &Allocation, seed: u8) {
    let bytes = pattern_bytes(block.requested() as usize, seed);
    write(allocator, block.address(), &bytes);
}

/// Whether `block` still holds the pattern of `seed` that [`fill`] wrote.
fn holds(allocator: &CachingAllocator<CudaStorage>, block: &Allocation, seed: u8) -> bool {
    let len = block.requested() as usize;
    read(allocator, block.address(), len) == pattern_bytes(len, seed)
}

/// Three blocks of `size` bytes, filled with the patterns of seeds 0, 1 and 2.
fn filled_blocks(allocator: &CachingAllocator<CudaStorage>, size: u64) -> Vec<Allocation> {
    let blocks: Vec<_> = (0..3)
        .map(|_| allocator.allocate(size, StreamId::DEFAULT).unwrap())
        .collect();
    for (block, seed) in blocks.iter().zip(0..) {
        fill(allocator, block, seed);
    }
    blocks
}

/// Frees `blocks`, empties the cache and checks that every byte went back to the device.
fn free_all(allocator: &CachingAllocator<CudaStorage>, blocks: Vec<Allocation>) {
    for block in blocks {
        allocator.free(block).unwrap();
    }
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
}

#[test]
#[ignore = "needs a CUDA device"]
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

/// PyTorch's expandable policy (20 MiB pages): `empty_cache` unmaps the whole free page of a
/// hole, and the hole maps again.
#[test]
#[ignore = "needs a CUDA device"]
fn expandable_segments_map_and_unmap_pages_keeping_data() {
    let Some((_device, allocator)) = allocator_or_skip(AllocatorConfig::pytorch_expandable())
    else {
        return;
    };
    assert!(
        allocator.uses_expandable_segments(),
        "the H200 supports virtual memory management"
    );
    let mut blocks = filled_blocks(&allocator, 30 * MIB);
    assert_eq!(allocator.memory_reserved(), 100 * MIB);
    let middle = blocks.remove(1);
    allocator.free(middle).unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(
        allocator.memory_reserved(),
        80 * MIB,
        "the free 20 MiB page is unmapped"
    );
    assert!(holds(&allocator, &blocks[0], 0) && holds(&allocator, &blocks[1], 2));
    // The hole is mapped again for a new block, which is usable.
    let refill = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(refill.address(), blocks[0].address() + 30 * MIB);
    fill(&allocator, &refill, 9);
    assert!(holds(&allocator, &refill, 9));
    assert_eq!(allocator.memory_reserved(), 100 * MIB);
    allocator.check_invariants().unwrap();
    blocks.push(refill);
    free_all(&allocator, blocks);
}

#[test]
#[ignore = "needs a CUDA device"]
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

/// Reclaiming (`AllocatorConfig::reclaiming()`: 2 MiB pages): a request that fits no hole and
/// would raise reserved memory above its peak moves the hole's pages to the end of the segment.
/// The live blocks keep their data, the new block and a later one in the hole are usable, and the
/// 40 MiB block raises reserved memory by only the 10 MiB it needs beyond the hole's pages.
#[test]
#[ignore = "needs a CUDA device"]
fn reclaiming_moves_free_pages_keeping_data() {
    let Some((_device, allocator)) = allocator_or_skip(AllocatorConfig::reclaiming()) else {
        return;
    };
    assert!(allocator.uses_expandable_segments());
    let mut blocks = filled_blocks(&allocator, 30 * MIB);
    assert_eq!(allocator.memory_reserved(), 90 * MIB);
    let middle = blocks.remove(1);
    let hole = middle.address();
    allocator.free(middle).unwrap();
    let moved = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(moved.address(), blocks[1].address() + 30 * MIB);
    assert_eq!(allocator.memory_reserved(), 100 * MIB);
    assert_eq!(allocator.max_memory_reserved(), 100 * MIB);
    assert_eq!(allocator.memory_stats().num_device_free, 1, "one unmap");
    fill(&allocator, &moved, 7);
    assert!(holds(&allocator, &blocks[0], 0) && holds(&allocator, &blocks[1], 2));
    let refill = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(refill.address(), hole);
    fill(&allocator, &refill, 9);
    assert!(holds(&allocator, &refill, 9) && holds(&allocator, &moved, 7));
    assert_eq!(allocator.max_memory_reserved(), 130 * MIB);
    allocator.check_invariants().unwrap();
    blocks.extend([moved, refill]);
    free_all(&allocator, blocks);
}

/// Corpus traces replayed on the device: real segments, real page mapping. The expandable
/// policies reach the peaks their replays on simulated memory reach (an expandable segment's
/// layout does not depend on where the device puts it, so the corpus figures hold on the H200),
/// and the time each replay takes, driver calls included, is printed: what 2 MiB pages and
/// reclaiming cost against PyTorch's 20 MiB pages. The classic policy is printed only: best fit
/// among equal blocks depends on the addresses `cuMemAlloc` returns.
#[test]
#[ignore = "needs a CUDA device"]
fn corpus_traces_replay_on_the_device_as_simulated() {
    use headroom_caching_allocator::{
        read_trace_tsv, replay_trace, RecordedTrace, SimulatedStorage, Storage,
    };
    let Some((_device, probe)) = allocator_or_skip(AllocatorConfig::default()) else {
        return;
    };
    let capacity = probe.with_storage(|storage| storage.memory_info().total);
    drop(probe);
    for name in [
        "gpt2_medium_varlen_adamw_16steps",
        "llama_bf16_ckpt_adamw_8steps",
    ] {
        let path = format!(
            "{}/../../testdata/traces/{name}.tsv.gz",
            env!("CARGO_MANIFEST_DIR")
        );
        let file = std::fs::File::open(&path)
            .or_else(|_| std::fs::File::open(format!("testdata/traces/{name}.tsv.gz")))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let trace = RecordedTrace::from_events(read_trace_tsv(file).unwrap());
        for (policy, config) in [
            ("classic", AllocatorConfig::pytorch_defaults()),
            ("pytorch_expandable", AllocatorConfig::pytorch_expandable()),
            ("default", AllocatorConfig::default()),
            ("reclaiming", AllocatorConfig::reclaiming()),
        ] {
            let simulated = CachingAllocator::new(SimulatedStorage::new(capacity), config.clone());
            let expected = replay_trace(&simulated, &trace).unwrap();
            let storage = cuda_or_skip(CudaStorage::new(0)).expect("the device answered above");
            let allocator = CachingAllocator::new(storage, config);
            let started = std::time::Instant::now();
            let report = replay_trace(&allocator, &trace).unwrap();
            allocator.empty_cache().unwrap();
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "{name} {policy}: peak reserved {} B, peak allocated {} B, {} maps or segments, \
                 {} unmaps or frees, {seconds:.3} s on the device ({:.3} s simulated)",
                report.peak_reserved_bytes,
                report.peak_allocated_bytes,
                report.device_allocs,
                report.device_frees,
                expected.seconds
            );
            assert_eq!(report.ooms, 0, "{name} {policy}");
            if policy == "classic" {
                continue;
            }
            assert_eq!(
                (report.peak_reserved_bytes, report.peak_allocated_bytes),
                (expected.peak_reserved_bytes, expected.peak_allocated_bytes),
                "{name} {policy}"
            );
        }
    }
}
