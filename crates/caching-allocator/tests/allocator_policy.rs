//! The caching policy against PyTorch's reference figures and its documented behaviours:
//! the golden `allocator_rounding` sequence, the false-OOM case of pytorch issue 189504,
//! expandable segments, OOM recovery and history.

use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, BlockState, CachingAllocator, HistoryOptions,
    HostStorage, PoolKind, SimulatedStorage, StreamId, TraceAction,
};

const MIB: u64 = 1 << 20;
const H200_BYTES: u64 = 150_754_820_096;

fn golden() -> serde_json::Value {
    // From the crate's folder, or (a test binary carried to a GPU machine) from the repo root.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/golden_allocator.json"
    );
    let text = std::fs::read_to_string(path)
        .or_else(|_| std::fs::read_to_string("testdata/golden_allocator.json"))
        .expect("testdata/golden_allocator.json");
    serde_json::from_str(&text).expect("valid JSON")
}

fn classic(storage: SimulatedStorage) -> CachingAllocator<SimulatedStorage> {
    CachingAllocator::new(storage, AllocatorConfig::pytorch_defaults())
}

/// PyTorch's `allocated` column, step by step, and its large-pool segment layout before
/// `empty_cache`, reproduced exactly by the classic policy.
#[test]
fn golden_allocator_rounding_sequence() {
    let golden = golden();
    let rounding = &golden["allocator_rounding"];
    let allocator = classic(SimulatedStorage::new(H200_BYTES));
    let mut allocations: Vec<Option<Allocation>> = Vec::new();
    for row in rounding["rows"].as_array().unwrap() {
        let step = row["step"].as_str().unwrap();
        if let Some(bytes) = row["alloc_bytes"].as_u64() {
            allocations.push(Some(allocator.allocate(bytes, StreamId::DEFAULT).unwrap()));
        } else if let Some(index) = row["free_index"].as_u64() {
            let allocation = allocations[index as usize].take().unwrap();
            allocator.free(allocation).unwrap();
        } else {
            // PyTorch recorded the layout after the frees, then released the rest and the cache.
            check_large_layout(&allocator, &rounding["segments_before_release"]);
            for allocation in allocations.iter_mut().filter_map(Option::take) {
                allocator.free(allocation).unwrap();
            }
            allocator.empty_cache().unwrap();
        }
        assert_eq!(
            allocator.memory_allocated() as i64,
            row["allocated"].as_i64().unwrap(),
            "allocated after `{step}`"
        );
        assert_eq!(
            allocator.max_memory_allocated() as i64,
            row["max_allocated"].as_i64().unwrap(),
            "max_allocated after `{step}`"
        );
        allocator.check_invariants().unwrap();
    }
    assert_eq!(allocator.memory_reserved(), 0);
    allocator.with_storage(|storage| assert_eq!(storage.bytes_in_use(), 0));
}

/// A segment's total size and its blocks as (size, requested size, state).
type SegmentLayout = (u64, Vec<(u64, u64, String)>);

fn check_large_layout(allocator: &CachingAllocator<SimulatedStorage>, golden: &serde_json::Value) {
    let want: Vec<SegmentLayout> = golden
        .as_array()
        .unwrap()
        .iter()
        .filter(|segment| segment["segment_type"] == "large")
        .map(|segment| {
            let blocks = segment["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| {
                    (
                        b["size"].as_u64().unwrap(),
                        b["requested_size"].as_u64().unwrap(),
                        b["state"].as_str().unwrap().to_owned(),
                    )
                })
                .collect();
            (segment["total_size"].as_u64().unwrap(), blocks)
        })
        .collect();
    let have: Vec<SegmentLayout> = allocator
        .snapshot()
        .segments
        .iter()
        .filter(|segment| segment.segment_type == PoolKind::Large)
        .map(|segment| {
            let blocks = segment
                .blocks
                .iter()
                .map(|b| (b.size, b.requested_size, b.state.name().to_owned()))
                .collect();
            (segment.total_size, blocks)
        })
        .collect();
    assert_eq!(have, want);
}

/// pytorch/pytorch issue 189504: a block freed behind an event sits in a split segment; the
/// device is full. PyTorch completes the event during its retry but then asks the device again
/// and raises OOM. We search the pool again and hand the block out.
#[test]
fn no_oom_while_a_fitting_block_is_cached() {
    let storage = SimulatedStorage::new(20 * MIB);
    let events = storage.event_control();
    let allocator = classic(storage);
    let a = allocator.allocate(5 * MIB, StreamId::DEFAULT).unwrap();
    let _b = allocator.allocate(5 * MIB, StreamId::DEFAULT).unwrap();
    let _c = allocator.allocate(10 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(allocator.memory_reserved(), 20 * MIB);
    let a_address = a.address();
    allocator.record_stream(&a, StreamId(7)).unwrap();
    allocator.free(a).unwrap();
    assert_eq!(events.n_pending(), 1);
    let snapshot = allocator.snapshot();
    let states: Vec<BlockState> = snapshot.segments[0]
        .blocks
        .iter()
        .map(|block| block.state)
        .collect();
    assert_eq!(
        states,
        [
            BlockState::ActivePendingFree,
            BlockState::ActiveAllocated,
            BlockState::ActiveAllocated
        ]
    );

    let again = allocator.allocate(5 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(again.address(), a_address);
    let stats = allocator.memory_stats();
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_sync_all_streams, 1);
    allocator.check_invariants().unwrap();
}

/// A block used by another stream is not reused before that stream's event completes.
#[test]
fn record_stream_defers_reuse_until_the_event_completes() {
    let storage = SimulatedStorage::new(H200_BYTES);
    let events = storage.event_control();
    let allocator = classic(storage);
    let a = allocator.allocate(4096, StreamId::DEFAULT).unwrap();
    let a_address = a.address();
    allocator.record_stream(&a, StreamId(3)).unwrap();
    allocator.free(a).unwrap();
    assert_eq!(allocator.memory_allocated(), 0);
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 4096);

    let b = allocator.allocate(4096, StreamId::DEFAULT).unwrap();
    assert_ne!(
        b.address(),
        a_address,
        "reused while stream 3 may still use it"
    );
    events.complete_all();
    let c = allocator.allocate(4096, StreamId::DEFAULT).unwrap();
    assert_eq!(c.address(), a_address);
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 8192);
    allocator.check_invariants().unwrap();
}

/// Cached blocks are reused by their own stream only.
#[test]
fn blocks_are_cached_per_stream() {
    let allocator = classic(SimulatedStorage::new(H200_BYTES));
    let a = allocator.allocate(3 * MIB, StreamId(1)).unwrap();
    let a_address = a.address();
    allocator.free(a).unwrap();
    let b = allocator.allocate(3 * MIB, StreamId(2)).unwrap();
    assert_ne!(b.address(), a_address);
    let c = allocator.allocate(3 * MIB, StreamId(1)).unwrap();
    assert_eq!(c.address(), a_address);
    assert_eq!(allocator.memory_reserved(), 40 * MIB);
}

/// The devlog's example: 8 × 16 MiB then 4 × 32 MiB. Classic segments reserve 256 MiB; an
/// expandable segment maps 7 pages of 20 MiB (PyTorch's) or 64 pages of 2 MiB (the default) and
/// serves the second phase without new pages.
#[test]
fn expandable_segments_reuse_pages_across_sizes() {
    for (config, reserved) in [
        (AllocatorConfig::pytorch_defaults(), 256 * MIB),
        (AllocatorConfig::pytorch_expandable(), 140 * MIB),
        (AllocatorConfig::default(), 128 * MIB),
    ] {
        let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
        let first: Vec<_> = (0..8)
            .map(|_| allocator.allocate(16 * MIB, StreamId::DEFAULT).unwrap())
            .collect();
        for allocation in first {
            allocator.free(allocation).unwrap();
        }
        let second: Vec<_> = (0..4)
            .map(|_| allocator.allocate(32 * MIB, StreamId::DEFAULT).unwrap())
            .collect();
        assert_eq!(allocator.max_memory_reserved(), reserved);
        allocator.check_invariants().unwrap();
        for allocation in second {
            allocator.free(allocation).unwrap();
        }
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.memory_reserved(), 0);
        allocator.with_storage(|storage| assert_eq!(storage.bytes_in_use(), 0));
        allocator.check_invariants().unwrap();
    }
}

/// With `reclaim_free_pages`, a request that fits no free block and would raise reserved memory
/// above its ceiling takes the whole free pages between live blocks (unmapped there, mapped where
/// it needs them) instead: PyTorch's expandable segments grow to 140 MiB here (d ends at 130 MiB,
/// in 20 MiB pages), 2 MiB pages without reclaiming to 130 MiB, the default and `reclaiming()`
/// stay at 100 MiB (d takes live memory to a new high, so the default's slack does not apply).
#[test]
fn expandable_segments_move_free_pages_before_growing() {
    let no_reclaim = AllocatorConfig::parse("reclaim_free_pages:False").unwrap();
    for (config, peak, unmaps) in [
        (AllocatorConfig::pytorch_expandable(), 140 * MIB, 0),
        (no_reclaim, 130 * MIB, 0),
        (AllocatorConfig::default(), 100 * MIB, 1),
        (AllocatorConfig::reclaiming(), 100 * MIB, 1),
    ] {
        let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
        let a = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        let b = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        let c = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        allocator.free(b).unwrap();
        // 40 MiB fit neither the 30 MiB hole nor what is mapped after c.
        let d = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!(allocator.max_memory_reserved(), peak);
        assert_eq!(allocator.memory_stats().num_device_free, unmaps);
        allocator.check_invariants().unwrap();
        if unmaps > 0 {
            // The hole is unmapped: 100 MiB of pages back 100 MiB of live blocks, in two
            // mapped ranges.
            assert_eq!(allocator.memory_reserved(), 100 * MIB);
            assert_eq!(allocator.memory_stats().segment.all.current, 2);
            assert_eq!(d.address(), c.address() + 30 * MIB);
        }
        // A later 30 MiB request maps the hole again, below the peak.
        let e = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!(e.address(), a.address() + 30 * MIB);
        allocator.check_invariants().unwrap();
        for allocation in [a, c, d, e] {
            allocator.free(allocation).unwrap();
        }
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.memory_reserved(), 0);
        allocator.check_invariants().unwrap();
    }
}

/// A loop whose forward fills the small pool and whose backward the large one (bench-memory's
/// ViT-L/16 at batch 1: small activations, large gradients): reclaiming moves the small pool's
/// free pages to the large pool in the backward and back in the forward. `reclaiming()` does so
/// in every step, waiting for the device each time; the default lets a pool take back the pages
/// it lent without a reclaim, so after the first step nothing moves and nothing waits, for both
/// pools' pages reserved (what no reclaiming reserves).
#[test]
fn pages_lent_to_the_other_pool_come_back_without_a_wait() {
    let no_reclaim = AllocatorConfig::parse("reclaim_free_pages:False").unwrap();
    for (config, late_syncs, peak) in [
        (AllocatorConfig::default(), 0, 180 * MIB),
        (AllocatorConfig::reclaiming(), 8, 140 * MIB),
        (no_reclaim, 0, 180 * MIB),
    ] {
        let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
        let weights = allocator.allocate(100 * MIB, StreamId::DEFAULT).unwrap();
        let mut syncs = Vec::new();
        for _ in 0..5 {
            let before = allocator.memory_stats().num_sync_all_streams;
            let activations: Vec<Allocation> = (0..40)
                .map(|_| allocator.allocate(MIB, StreamId::DEFAULT).unwrap())
                .collect();
            for allocation in activations {
                allocator.free(allocation).unwrap();
            }
            let gradients = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap();
            allocator.free(gradients).unwrap();
            syncs.push(allocator.memory_stats().num_sync_all_streams - before);
        }
        allocator.check_invariants().unwrap();
        println!(
            "syncs per step {syncs:?}, peak {}",
            allocator.max_memory_reserved()
        );
        assert_eq!(syncs[1..].iter().sum::<i64>(), late_syncs, "{syncs:?}");
        assert_eq!(allocator.max_memory_reserved(), peak);
        allocator.free(weights).unwrap();
    }
}

/// Resetting the peak statistics is a measurement: it does not change what the allocator does
/// next. Reclaiming free pages keeps reserved memory under the most it has ever been, not under
/// the statistics' peak since the last reset (which a training loop resets every step: keeping
/// to that, the default waited for the device and moved pages in every step).
#[test]
fn resetting_the_peak_statistics_changes_no_decision() {
    let run = |reset: bool| {
        let allocator = CachingAllocator::new(
            SimulatedStorage::new(H200_BYTES),
            AllocatorConfig::default(),
        );
        let a = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        let b = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        let c = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        let x = allocator.allocate(60 * MIB, StreamId::DEFAULT).unwrap();
        allocator.free(x).unwrap();
        allocator.free(b).unwrap();
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.memory_reserved(), 60 * MIB);
        if reset {
            allocator.reset_peak_stats();
        }
        // 30 MiB mapped again in b's place, then a free mapped hole there.
        let g = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
        allocator.free(g).unwrap();
        // 40 MiB fit no hole: mapping them after c reaches 130 MiB, under the 150 MiB reserved
        // before, so no page moves and nothing waits.
        let before = allocator.memory_stats();
        let h = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap();
        let after = allocator.memory_stats();
        allocator.check_invariants().unwrap();
        let figures = (
            allocator.memory_reserved(),
            after.num_device_free - before.num_device_free,
            after.num_sync_all_streams - before.num_sync_all_streams,
            h.address() - a.address(),
        );
        for allocation in [a, c, h] {
            allocator.free(allocation).unwrap();
        }
        figures
    };
    assert_eq!(run(false), (130 * MIB, 0, 0, 90 * MIB));
    assert_eq!(run(true), run(false));
}

/// An expandable segment is reported as one segment per contiguous mapped range, and
/// `empty_cache` unmaps only whole free pages (here PyTorch's pages of 20 MiB).
#[test]
fn expandable_segments_unmap_whole_free_pages() {
    let allocator = CachingAllocator::new(
        SimulatedStorage::new(H200_BYTES),
        AllocatorConfig::pytorch_expandable(),
    );
    assert!(allocator.uses_expandable_segments());
    let a = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    let b = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    let c = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    // 90 MiB in 20 MiB pages.
    assert_eq!(allocator.memory_reserved(), 100 * MIB);
    assert_eq!(allocator.memory_stats().segment.all.current, 1);
    allocator.free(b).unwrap();
    allocator.empty_cache().unwrap();
    // b spans [30, 60) MiB: only the page [40, 60) lies wholly inside it.
    assert_eq!(allocator.memory_reserved(), 80 * MIB);
    let snapshot = allocator.snapshot();
    assert_eq!(snapshot.segments.len(), 2);
    assert!(snapshot.segments.iter().all(|s| s.is_expandable));
    assert_eq!(allocator.memory_stats().segment.all.current, 2);
    // Partial pages: [30, 40) MiB before the hole and [90, 100) MiB after c.
    assert_eq!(
        allocator.fragmentation_stats().stranded_free_bytes,
        20 * MIB
    );
    allocator.check_invariants().unwrap();
    // A new 30 MiB request fills the hole again: [30, 40) is mapped, [40, 60) is mapped anew.
    let d = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(d.address(), a.address() + 30 * MIB);
    assert_eq!(allocator.memory_reserved(), 100 * MIB);
    assert_eq!(allocator.memory_stats().segment.all.current, 1);
    allocator.check_invariants().unwrap();
    for allocation in [a, c, d] {
        allocator.free(allocation).unwrap();
    }
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    allocator.check_invariants().unwrap();
}

/// Out-of-memory is a typed error with the figures, and the allocator keeps working after it.
#[test]
fn out_of_memory_is_an_error_and_recoverable() {
    let allocator = CachingAllocator::new(
        HostStorage::with_capacity(64 * MIB),
        AllocatorConfig::default(),
    );
    let held: Vec<_> = (0..3)
        .map(|_| allocator.allocate(20 * MIB, StreamId::DEFAULT).unwrap())
        .collect();
    let error = allocator.allocate(20 * MIB, StreamId::DEFAULT).unwrap_err();
    let AllocError::OutOfMemory(report) = &error else {
        panic!("expected OOM, got {error}")
    };
    assert_eq!(report.requested, 20 * MIB);
    assert_eq!(report.attempted, 20 * MIB);
    assert_eq!(report.capacity, 64 * MIB);
    assert_eq!(report.free, 4 * MIB);
    assert_eq!(report.allocated, 60 * MIB);
    assert_eq!(report.reserved_unallocated, 0);
    assert!(!report.suggest_expandable_segments);
    assert!(error.to_string().contains("20.00 MiB"), "{error}");
    assert_eq!(allocator.memory_stats().num_ooms, 1);
    allocator.check_invariants().unwrap();

    let mut held = held;
    allocator.free(held.pop().unwrap()).unwrap();
    let again = allocator.allocate(20 * MIB, StreamId::DEFAULT).unwrap();
    allocator.free(again).unwrap();
    for allocation in held {
        allocator.free(allocation).unwrap();
    }
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
}

/// Freeing an address this allocator did not hand out is an error, not a corruption.
#[test]
fn freeing_an_unknown_address_is_an_error() {
    let allocator = classic(SimulatedStorage::new(H200_BYTES));
    let a = allocator.allocate(100, StreamId::DEFAULT).unwrap();
    let address = a.address();
    allocator.free(a).unwrap();
    // SAFETY: simulated memory, and no allocation of this allocator is live.
    let again = unsafe { allocator.free_address(address) };
    assert!(matches!(
        again,
        Err(AllocError::UnknownAddress { address: reported }) if reported == address
    ));
    // SAFETY: as above.
    let unknown = unsafe { allocator.free_address(12345) };
    assert!(matches!(unknown, Err(AllocError::UnknownAddress { .. })));
    // An allocation of another allocator, even at an address this one handed out, is refused.
    let other = classic(SimulatedStorage::new(H200_BYTES));
    let mine = allocator.allocate(100, StreamId::DEFAULT).unwrap();
    let theirs = other.allocate(100, StreamId::DEFAULT).unwrap();
    assert_eq!(
        mine.address(),
        theirs.address(),
        "both simulated from the same start"
    );
    assert_ne!(mine.allocator(), theirs.allocator());
    assert!(matches!(
        allocator.record_stream(&theirs, StreamId(1)),
        Err(AllocError::UnknownAddress { .. })
    ));
    assert!(matches!(
        allocator.free(theirs),
        Err(AllocError::UnknownAddress { .. })
    ));
    assert_eq!(allocator.memory_allocated(), mine.size());
    allocator.free(mine).unwrap();
    allocator.check_invariants().unwrap();
}

/// History records every action with the context stack as frames, innermost first.
#[test]
fn history_records_actions_and_context() {
    let storage = SimulatedStorage::new(H200_BYTES);
    let allocator = classic(storage);
    allocator.record_history(Some(HistoryOptions::default()));
    let block = {
        let _forward = allocator.push_context("forward");
        let _layer = allocator.push_context("encoder.3");
        allocator.allocate(3 * MIB, StreamId::DEFAULT).unwrap()
    };
    allocator.free(block).unwrap();
    allocator.empty_cache().unwrap();
    let snapshot = allocator.snapshot();
    let trace = &snapshot.device_traces[0];
    let actions: Vec<TraceAction> = trace.iter().map(|entry| entry.action).collect();
    assert_eq!(
        actions,
        [
            TraceAction::SegmentAlloc,
            TraceAction::Alloc,
            TraceAction::FreeRequested,
            TraceAction::FreeCompleted,
            TraceAction::SegmentFree
        ]
    );
    let names: Vec<&str> = trace[1]
        .frames
        .iter()
        .map(|frame| frame.name.as_str())
        .collect();
    assert_eq!(names, ["encoder.3", "forward"]);
    assert_eq!(trace[1].size, 3 * MIB);
    assert!(trace[3].frames.is_empty());

    allocator.record_history(Some(HistoryOptions {
        max_entries: 2,
        record_context: false,
    }));
    for _ in 0..3 {
        let block = allocator.allocate(512, StreamId::DEFAULT).unwrap();
        allocator.free(block).unwrap();
    }
    let snapshot = allocator.snapshot();
    assert_eq!(snapshot.device_traces[0].len(), 2);
    let overflowed = snapshot
        .allocator_settings
        .iter()
        .find(|(key, _)| key == "trace_alloc_overflowed")
        .map(|(_, value)| value.clone());
    assert_eq!(
        overflowed,
        Some(headroom_caching_allocator::Value::Bool(true))
    );
}

/// `max_split_size_mb`: oversize blocks are never split and small requests never take them.
#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let config = AllocatorConfig::parse("expandable_segments:False,max_split_size_mb:20").unwrap();
    let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
    let big = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap();
    allocator.free(big).unwrap();
    // A 5 MiB request may not take the cached 40 MiB block.
    let small = allocator.allocate(5 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(allocator.memory_reserved(), 60 * MIB);
    // A 30 MiB request takes it whole (within 20 MiB of rounding).
    let mid = allocator.allocate(30 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(mid.size(), 40 * MIB);
    assert_eq!(allocator.memory_stats().oversize_allocations.current, 1);
    // The 20 MiB segment of the 5 MiB request is oversize too (size >= max_split_size).
    assert_eq!(allocator.memory_stats().oversize_segments.current, 2);
    allocator.free(small).unwrap();
    allocator.free(mid).unwrap();
    allocator.check_invariants().unwrap();
}

/// `per_process_memory_fraction` caps reserved memory, and with `garbage_collection_threshold`
/// old cached blocks are released before the cap is reached.
#[test]
fn memory_fraction_and_garbage_collection() {
    let capacity = 1000 * MIB;
    let config =
        AllocatorConfig::parse("expandable_segments:False,per_process_memory_fraction:0.5")
            .unwrap();
    let allocator = CachingAllocator::new(SimulatedStorage::new(capacity), config);
    let held: Vec<_> = (0..11)
        .map(|_| allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap())
        .collect();
    // 440 MiB reserved; 100 MiB more would pass the 500 MiB allowed.
    let error = allocator
        .allocate(100 * MIB, StreamId::DEFAULT)
        .unwrap_err();
    let AllocError::OutOfMemory(report) = &error else {
        panic!("expected OOM, got {error}")
    };
    assert_eq!(report.allowed, Some(500 * MIB));
    assert!(error.to_string().contains("allowed"), "{error}");
    for allocation in held {
        allocator.free(allocation).unwrap();
    }
    // The cached 40 MiB segments are released to make room, within the fraction.
    let big = allocator.allocate(300 * MIB, StreamId::DEFAULT).unwrap();
    assert!(allocator.memory_reserved() <= 500 * MIB);
    allocator.free(big).unwrap();
    allocator.check_invariants().unwrap();

    let config = AllocatorConfig::parse(
        "expandable_segments:False,per_process_memory_fraction:0.5,garbage_collection_threshold:0.6",
    )
    .unwrap();
    let allocator = CachingAllocator::new(SimulatedStorage::new(capacity), config);
    // Cache 8 × 40 MiB = 320 MiB (above 0.6 × 500 MiB = 300 MiB).
    let held: Vec<_> = (0..8)
        .map(|_| allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap())
        .collect();
    for allocation in held {
        allocator.free(allocation).unwrap();
    }
    assert_eq!(allocator.memory_reserved(), 320 * MIB);
    // A request that the cache cannot serve triggers collection first: reserved drops to the
    // threshold before the new segment is added, with no OOM retry.
    let other = allocator.allocate(60 * MIB, StreamId::DEFAULT).unwrap();
    let stats = allocator.memory_stats();
    assert_eq!(stats.num_alloc_retries, 0);
    assert!(
        stats.num_device_free > 0,
        "collection released cached segments"
    );
    assert!(allocator.memory_reserved() <= 300 * MIB + 60 * MIB);
    allocator.free(other).unwrap();
    allocator.check_invariants().unwrap();
}

/// The allocator can be shared across threads whatever the storage.
#[test]
fn allocators_are_send_and_sync() {
    fn shareable<T: Send + Sync>() {}
    shareable::<CachingAllocator<HostStorage>>();
    shareable::<CachingAllocator<SimulatedStorage>>();
}

/// A snapshot of a live allocator, as `--snapshot` writes it: a protocol-4 pickle within the
/// viewer's opcodes, with PyTorch's keys and all three block states; Python's `pickle` reads it.
#[test]
fn live_snapshot_pickle_has_every_block_state_and_loads_in_python() {
    use headroom_caching_allocator::{pickle_opcodes, read_pickle, write_pickle, VIEWER_OPCODES};

    let allocator = classic(SimulatedStorage::new(H200_BYTES));
    allocator.record_history(Some(HistoryOptions::default()));
    let pending = allocator.allocate(4096, StreamId::DEFAULT).unwrap();
    let freed = allocator.allocate(4096, StreamId::DEFAULT).unwrap();
    let _kept = allocator.allocate(4096, StreamId::DEFAULT).unwrap();
    allocator.record_stream(&pending, StreamId(5)).unwrap();
    allocator.free(pending).unwrap();
    allocator.free(freed).unwrap();
    let snapshot = allocator.snapshot();
    let mut bytes = Vec::new();
    write_pickle(&snapshot, &mut bytes).unwrap();
    assert_eq!(&bytes[..2], &[0x80, 4], "protocol 4");
    let opcodes = pickle_opcodes(&bytes).unwrap();
    assert!(
        opcodes.iter().all(|op| VIEWER_OPCODES.contains(op)),
        "{opcodes:?}"
    );
    assert_eq!(read_pickle(bytes.as_slice()).unwrap(), snapshot);

    let path = std::env::temp_dir().join(format!("headroom_live_{}.pickle", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let script = "import pickle,sys\n\
        s = pickle.load(open(sys.argv[1], 'rb'))\n\
        print(sorted(s))\n\
        print(sorted({b['state'] for seg in s['segments'] for b in seg['blocks']}))\n\
        print(sorted({e['action'] for e in s['device_traces'][0]}))";
    let output = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&path)
        .output();
    let _ = std::fs::remove_file(&path);
    match output {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            headroom_testkit::gpu::skip("python3 is not on PATH");
        }
        Err(err) => panic!("running python3: {err}"),
        Ok(output) => {
            let stdout = String::from_utf8_lossy(&output.stdout);
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            assert_eq!(
                stdout.lines().collect::<Vec<_>>(),
                [
                    "['allocator_settings', 'device_traces', 'external_annotations', 'segments']",
                    "['active_allocated', 'active_pending_free', 'inactive']",
                    "['alloc', 'free_completed', 'free_requested', 'segment_alloc']",
                ]
            );
        }
    }
}

/// `memory_stats()` flattens to PyTorch's 122 keys; resetting peaks and accumulated figures
/// behaves like `reset_peak_memory_stats` and `reset_accumulated_memory_stats`.
#[test]
fn statistics_flatten_and_reset_like_pytorch() {
    let allocator = classic(SimulatedStorage::new(H200_BYTES));
    let a = allocator.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    let b = allocator.allocate(1000, StreamId::DEFAULT).unwrap();
    allocator.free(a).unwrap();
    let flat = allocator.memory_stats().to_flat_map();
    assert_eq!(flat.len(), 122);
    assert_eq!(flat["allocated_bytes.all.current"], 1024);
    assert_eq!(flat["allocated_bytes.all.peak"], (3 * MIB + 1024) as i64);
    assert_eq!(flat["allocated_bytes.large_pool.freed"], (3 * MIB) as i64);
    assert_eq!(flat["requested_bytes.small_pool.current"], 1000);
    assert_eq!(flat["reserved_bytes.all.current"], (22 * MIB) as i64);
    assert_eq!(flat["segment.large_pool.current"], 1);
    assert_eq!(
        flat["inactive_split_bytes.small_pool.current"],
        (2 * MIB - 1024) as i64
    );
    assert_eq!(flat["num_device_alloc"], 2);
    assert_eq!(flat["max_split_size"], -1);

    allocator.reset_peak_stats();
    let stats = allocator.memory_stats();
    assert_eq!(stats.allocated_bytes.all.peak, 1024);
    assert_eq!(stats.allocated_bytes.all.allocated, (3 * MIB + 1024) as i64);
    allocator.reset_accumulated_stats();
    let stats = allocator.memory_stats();
    assert_eq!(stats.allocated_bytes.all.allocated, 0);
    assert_eq!(stats.allocated_bytes.all.freed, 0);
    assert_eq!(stats.allocated_bytes.all.current, 1024);
    assert_eq!(stats.num_device_alloc, 0);
    allocator.free(b).unwrap();
    assert_eq!(allocator.memory_stats().allocated_bytes.all.freed, 1024);
}

/// The default policy's reclaim waits for the device only when a page it moves may still be in
/// use: pages of blocks freed before a free-epoch mark that has passed (every 64 frees, an
/// event on each stream) move at once, those of a block freed since wait, as before.
#[test]
fn reclaims_move_pages_the_device_is_done_with_without_waiting() {
    for marks_passed in [true, false] {
        let storage = SimulatedStorage::new(H200_BYTES);
        let events = storage.event_control();
        let allocator = CachingAllocator::new(storage, AllocatorConfig::default());
        let stream = StreamId::DEFAULT;
        // A small block stays live, so that the small pool's page is never wholly free.
        let small_live = allocator.allocate(4096, stream).unwrap();
        let a = allocator.allocate(64 * MIB, stream).unwrap();
        let b = allocator.allocate(64 * MIB, stream).unwrap();
        allocator.free(a).unwrap();
        // 64 frees close the free epoch in which `a` was freed.
        for _ in 0..64 {
            let small = allocator.allocate(4096, stream).unwrap();
            allocator.free(small).unwrap();
        }
        assert!(events.n_pending() >= 1, "no mark was recorded");
        if marks_passed {
            events.complete_all();
        }
        let reserved = allocator.memory_reserved();
        // 96 MiB fits no free block, and mapping it would take reserved memory 65 MiB over the
        // ceiling (the new live peak, 160 MiB, plus 0.5%): `a`'s 64 MiB of pages move.
        let c = allocator.allocate(96 * MIB, stream).unwrap();
        let stats = allocator.memory_stats();
        assert_eq!(
            stats.num_sync_all_streams,
            if marks_passed { 0 } else { 1 },
            "marks passed: {marks_passed}"
        );
        assert!(
            allocator.memory_reserved() < reserved + 96 * MIB,
            "no pages moved: {} B reserved",
            allocator.memory_reserved()
        );
        allocator.check_invariants().unwrap();
        allocator.free(b).unwrap();
        allocator.free(c).unwrap();
        allocator.free(small_live).unwrap();
    }
    // PyTorch's policies record no marks.
    let storage = SimulatedStorage::new(H200_BYTES);
    let events = storage.event_control();
    let allocator = CachingAllocator::new(storage, AllocatorConfig::pytorch_expandable());
    for _ in 0..200 {
        let small = allocator.allocate(4096, StreamId::DEFAULT).unwrap();
        allocator.free(small).unwrap();
    }
    assert_eq!(events.n_pending(), 0);
}

/// With `expandable_handle_size_mb:32`, each map is backed by handles of up to 32 MiB and only
/// whole handles come back: the allocator asks the storage what it can release and keeps the
/// rest mapped, cached and usable.
#[test]
fn larger_handles_give_back_only_whole_handles() {
    for (max_handle, handles, reserved_after_release) in
        [(None, 50, 10 * MIB), (Some(32), 4, 32 * MIB)]
    {
        let mut config = AllocatorConfig::builder();
        if let Some(mib) = max_handle {
            config = config.expandable_handle_size_mb(mib);
        }
        let config = config.build().unwrap();
        let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
        // 100 MiB: handles of 32, 32, 32 and 4 MiB (or fifty of 2 MiB).
        let a = allocator.allocate(100 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!(allocator.memory_reserved(), 100 * MIB);
        assert_eq!(allocator.with_storage(|s| s.handles_mapped()), handles);
        let base = a.address();
        allocator.free(a).unwrap();
        let b = allocator.allocate(10 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!(b.address(), base);
        // The free [10, 100) MiB: with 32 MiB handles, [10, 32) shares a handle with b.
        allocator.empty_cache().unwrap();
        assert_eq!(
            allocator.memory_reserved(),
            reserved_after_release,
            "{max_handle:?}"
        );
        allocator.check_invariants().unwrap();
        // 22 MiB more fits right after b: in what stayed mapped, or in pages mapped anew.
        let maps = allocator.memory_stats().num_device_alloc;
        let c = allocator.allocate(22 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!(c.address(), base + 10 * MIB);
        let new_maps = allocator.memory_stats().num_device_alloc - maps;
        assert_eq!(new_maps, i64::from(max_handle.is_none()), "{max_handle:?}");
        for allocation in [b, c] {
            allocator.free(allocation).unwrap();
        }
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.memory_reserved(), 0);
        assert_eq!(allocator.with_storage(|s| s.bytes_in_use()), 0);
        allocator.check_invariants().unwrap();
    }
}
