//! The caching policy against PyTorch's reference figures and its documented behaviours:
//! the golden `allocator_rounding` sequence, the false-OOM case of pytorch issue 189504, streams,
//! OOM recovery, history, the split and fraction limits, snapshots and statistics. Expandable
//! segments (pages, reclaiming, handles) are in `expandable_segments.rs`.

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

/// `caching:False` (`HEADROOM_NO_CUDA_MEMORY_CACHING=1`, PyTorch's
/// `PYTORCH_NO_CUDA_MEMORY_CACHING=1`): each request is a segment of its rounded size, returned
/// to the storage when its free completes — at once, or once the events of the streams that used
/// it have passed — so reserved memory is allocated memory. Expandable segments are not used even
/// when the config asks for them; a private pool keeps caching its blocks; a full storage is the
/// typed out-of-memory error, and room freed makes the next request succeed.
#[test]
fn without_caching_every_request_is_its_own_segment_freed_at_once() {
    let storage = SimulatedStorage::new(64 * MIB);
    let events = storage.event_control();
    let config = AllocatorConfig::builder().caching(false).build().unwrap();
    assert!(
        config.expandable_segments(),
        "the default asks for expandable segments"
    );
    let allocator = CachingAllocator::new(storage, config);

    let small = allocator.allocate(1000, StreamId::DEFAULT).unwrap();
    let large = allocator.allocate(3 * MIB + 1, StreamId::DEFAULT).unwrap();
    assert_eq!((small.size(), large.size()), (1024, 3 * MIB + 512));
    assert_eq!(allocator.memory_reserved(), 1024 + 3 * MIB + 512);
    assert_eq!(allocator.memory_stats().segment.all.current, 2);
    allocator.free(small).unwrap();
    assert_eq!(allocator.memory_reserved(), 3 * MIB + 512);
    assert_eq!(allocator.memory_stats().num_device_free, 1);

    // Another stream used it: the segment stays until that stream's event has passed.
    allocator.record_stream(&large, StreamId(3)).unwrap();
    allocator.free(large).unwrap();
    assert_eq!(allocator.memory_reserved(), 3 * MIB + 512);
    events.complete_all();
    let next = allocator.allocate(512, StreamId::DEFAULT).unwrap();
    assert_eq!(allocator.memory_reserved(), 512);
    assert_eq!(allocator.memory_allocated(), 512);
    allocator.free(next).unwrap();
    assert_eq!(allocator.memory_reserved(), 0);

    // A private pool caches as usual: its freed block stays reserved, and is reused.
    let pool = allocator.create_private_pool();
    allocator
        .begin_allocate_to_pool(StreamId::DEFAULT, pool)
        .unwrap();
    let routed = allocator.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    let routed_address = routed.address();
    allocator.free(routed).unwrap();
    let again = allocator.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(again.address(), routed_address);
    allocator.end_allocate_to_pool();
    allocator.free(again).unwrap();
    assert_eq!(allocator.memory_reserved(), 20 * MIB, "the pool's segment");
    allocator.release_private_pool(pool).unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);

    // Out of memory is the typed error; freeing makes room.
    let first = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap();
    let error = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap_err();
    assert!(matches!(error, AllocError::OutOfMemory(_)), "{error:?}");
    allocator.free(first).unwrap();
    let second = allocator.allocate(40 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(allocator.memory_reserved(), 40 * MIB);
    allocator.free(second).unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    allocator.check_invariants().unwrap();
}
