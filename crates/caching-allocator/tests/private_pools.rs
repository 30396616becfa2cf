//! Private pools (PyTorch's graph pools) on simulated and host memory, with classic and
//! expandable segments: requests routed to a pool are served from its own blocks and reused only
//! by later routed requests; while routing, nothing is done that a stream capture forbids (no
//! event, no wait, no release step); while a pool is live, `empty_cache`, the out-of-memory
//! ladder, garbage collection and page reclaims leave its memory alone; releasing it returns its
//! free memory, and what is freed later is ordinary cached memory. Snapshots name the pool in
//! `segment_pool_id`. A property test runs random sequences and checks that pool and ordinary
//! blocks never share addresses, that a live pool never shrinks, and that nothing records an
//! event or waits while routing.

use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, BlockState, CachingAllocator, HostStorage,
    PrivatePoolId, PrivatePoolMisuse, PrivatePoolUsage, SimulatedStorage, Storage, StreamId,
    PRIVATE_POOL_STREAM_BASE,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const H200_BYTES: u64 = 150_754_820_096;
const DEFAULT: StreamId = StreamId::DEFAULT;

type Allocator = CachingAllocator<SimulatedStorage>;

fn simulated(config: AllocatorConfig) -> Allocator {
    CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config)
}

fn no_reclaim_expandable() -> AllocatorConfig {
    AllocatorConfig::parse("reclaim_free_pages:False").expect("valid config")
}

fn usage(allocator: &CachingAllocator<impl Storage>, pool: PrivatePoolId) -> PrivatePoolUsage {
    allocator.private_pool_usage(pool).expect("a known pool")
}

fn misuse(result: Result<impl std::fmt::Debug, AllocError>) -> PrivatePoolMisuse {
    match result {
        Err(AllocError::PrivatePool { misuse, .. }) => misuse,
        other => panic!("expected a private-pool error, got {other:?}"),
    }
}

/// A block freed inside the pool is reused by the next routed request of its size; an ordinary
/// free block is not, and after the routing an ordinary request does not get the pool's block.
/// Classic segments: the pool's small segment (2 MiB) and large one (20 MiB); 2 MiB pages: one
/// small page and two large ones; PyTorch's 20 MiB pages: one of each.
#[test]
fn routed_requests_are_served_from_the_pool_only() {
    for (config, pool_reserved, ordinary_large) in [
        (AllocatorConfig::pytorch_defaults(), 22 * MIB, 20 * MIB),
        (no_reclaim_expandable(), 6 * MIB, 4 * MIB),
        (AllocatorConfig::pytorch_expandable(), 22 * MIB, 20 * MIB),
    ] {
        let allocator = simulated(config);
        let ordinary = allocator.allocate(1000, DEFAULT).unwrap();
        let ordinary_address = ordinary.address();
        allocator.free(ordinary).unwrap();

        let pool = allocator.create_private_pool();
        assert_eq!(
            pool.stream(),
            StreamId(PRIVATE_POOL_STREAM_BASE + pool.id())
        );
        assert_eq!(
            usage(&allocator, pool),
            PrivatePoolUsage {
                live: true,
                ..Default::default()
            }
        );
        allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
        let small = allocator.allocate(1000, DEFAULT).unwrap();
        assert_ne!(
            small.address(),
            ordinary_address,
            "an ordinary block served the pool"
        );
        assert_eq!(small.stream(), DEFAULT);
        assert_eq!(
            allocator.allocation_stream(small.address()).unwrap(),
            DEFAULT
        );
        let large = allocator.allocate(3 * MIB, DEFAULT).unwrap();
        let large_address = large.address();
        allocator.free(large).unwrap();
        let again = allocator.allocate(3 * MIB, DEFAULT).unwrap();
        assert_eq!(
            again.address(),
            large_address,
            "the pool's free block was not reused"
        );
        assert_eq!(
            usage(&allocator, pool),
            PrivatePoolUsage {
                live: true,
                reserved_bytes: pool_reserved,
                allocated_bytes: 1024 + 3 * MIB,
                segments: 2,
            }
        );
        assert_eq!(allocator.memory_reserved(), 2 * MIB + pool_reserved);
        assert_eq!(allocator.memory_allocated(), 1024 + 3 * MIB);
        allocator.check_invariants().unwrap();
        allocator.end_allocate_to_pool();

        allocator.free(again).unwrap();
        let ordinary = allocator.allocate(3 * MIB, DEFAULT).unwrap();
        assert_ne!(
            ordinary.address(),
            large_address,
            "an ordinary request got a pool block"
        );
        assert_eq!(
            allocator.memory_reserved(),
            2 * MIB + pool_reserved + ordinary_large
        );
        assert_eq!(usage(&allocator, pool).reserved_bytes, pool_reserved);
        allocator.check_invariants().unwrap();
    }
}

/// `empty_cache` keeps a live pool's memory, free blocks included; releasing the pool returns
/// its free memory at once (the large segment or pages here; the small one holds a live block),
/// and the live block, freed later, is cached under the dead pool, reused by no ordinary
/// request, until `empty_cache` returns it.
#[test]
fn a_live_pool_survives_empty_cache_and_goes_back_once_released() {
    for (config, pool_reserved) in [
        (AllocatorConfig::pytorch_defaults(), 22 * MIB),
        (AllocatorConfig::default(), 6 * MIB),
    ] {
        let allocator = simulated(config);
        let pool = allocator.create_private_pool();
        allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
        let kept = allocator.allocate(1000, DEFAULT).unwrap();
        let temporary = allocator.allocate(3 * MIB, DEFAULT).unwrap();
        allocator.free(temporary).unwrap();
        allocator.end_allocate_to_pool();

        allocator.empty_cache().unwrap();
        assert_eq!(usage(&allocator, pool).reserved_bytes, pool_reserved);
        assert_eq!(allocator.memory_reserved(), pool_reserved);
        allocator.with_storage(|s| assert_eq!(s.bytes_in_use(), pool_reserved));

        allocator.release_private_pool(pool).unwrap();
        assert_eq!(
            usage(&allocator, pool),
            PrivatePoolUsage {
                live: false,
                reserved_bytes: 2 * MIB,
                allocated_bytes: 1024,
                segments: 1,
            }
        );
        allocator.with_storage(|s| assert_eq!(s.bytes_in_use(), 2 * MIB));
        let kept_address = kept.address();
        allocator.free(kept).unwrap();
        let ordinary = allocator.allocate(1000, DEFAULT).unwrap();
        assert_ne!(
            ordinary.address(),
            kept_address,
            "a dead pool's block was reused"
        );
        allocator.free(ordinary).unwrap();
        allocator.check_invariants().unwrap();

        allocator.empty_cache().unwrap();
        assert_eq!(allocator.memory_reserved(), 0);
        allocator.with_storage(|s| assert_eq!(s.bytes_in_use(), 0));
        assert_eq!(
            allocator.private_pool_usage(pool),
            None,
            "an empty dead pool is forgotten"
        );
        allocator.check_invariants().unwrap();
    }
}

/// Reclaiming never unmaps a live pool's free pages: 60 MiB freed on another stream are
/// unmapped for a 40 MiB request (reserved falls to 40 MiB), 60 MiB freed in a live pool are not
/// (100 MiB). Once the pool is released its pages go back.
#[test]
fn reclaims_leave_a_live_pools_pages_alone() {
    for config in [AllocatorConfig::default(), AllocatorConfig::reclaiming()] {
        let control = simulated(config.clone());
        let other = control.allocate(60 * MIB, StreamId(1)).unwrap();
        control.free(other).unwrap();
        let request = control.allocate(40 * MIB, DEFAULT).unwrap();
        assert_eq!(
            control.memory_reserved(),
            40 * MIB,
            "the control reclaimed nothing"
        );
        control.free(request).unwrap();

        let allocator = simulated(config);
        let pool = allocator.create_private_pool();
        allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
        let routed = allocator.allocate(60 * MIB, DEFAULT).unwrap();
        allocator.free(routed).unwrap();
        allocator.end_allocate_to_pool();
        let request = allocator.allocate(40 * MIB, DEFAULT).unwrap();
        assert_eq!(allocator.memory_reserved(), 100 * MIB);
        assert_eq!(usage(&allocator, pool).reserved_bytes, 60 * MIB);
        assert_eq!(
            allocator.memory_stats().num_device_free,
            0,
            "pages were unmapped"
        );
        allocator.check_invariants().unwrap();

        allocator.release_private_pool(pool).unwrap();
        assert_eq!(allocator.memory_reserved(), 40 * MIB);
        assert_eq!(allocator.private_pool_usage(pool), None);
        allocator.free(request).unwrap();
        allocator.check_invariants().unwrap();
    }
}

/// Garbage collection frees old cached large blocks, never a live pool's.
#[test]
fn garbage_collection_leaves_a_live_pool_alone() {
    let config = AllocatorConfig::builder()
        .expandable_segments(false)
        .per_process_memory_fraction(0.1)
        .garbage_collection_threshold(0.5)
        .build()
        .unwrap();
    let allocator = CachingAllocator::new(SimulatedStorage::new(1000 * MIB), config);
    let pool = allocator.create_private_pool();
    allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
    let routed = allocator.allocate(30 * MIB, DEFAULT).unwrap();
    allocator.free(routed).unwrap();
    allocator.end_allocate_to_pool();
    let ordinary = allocator.allocate(30 * MIB, DEFAULT).unwrap();
    allocator.free(ordinary).unwrap();
    // 60 MiB reserved, above half of the 100 MiB allowed: the miss collects the ordinary block.
    let larger = allocator.allocate(32 * MIB, DEFAULT).unwrap();
    assert_eq!(allocator.memory_reserved(), 62 * MIB);
    assert_eq!(usage(&allocator, pool).reserved_bytes, 30 * MIB);
    allocator.free(larger).unwrap();
    allocator.check_invariants().unwrap();
}

/// While routing, a request the pool cannot serve and the storage cannot back fails at once: the
/// ladder frees no cached memory, no page is reclaimed, nothing is waited for. After the
/// routing, the same request on another stream climbs the ladder (or, by default, reclaims the
/// cached pages first).
#[test]
fn the_out_of_memory_ladder_is_skipped_while_routing() {
    for (config, retries) in [
        (AllocatorConfig::pytorch_defaults(), 1),
        (AllocatorConfig::pytorch_expandable(), 1),
        (AllocatorConfig::default(), 0),
    ] {
        let allocator = CachingAllocator::new(SimulatedStorage::new(64 * MIB), config);
        let cached = allocator.allocate(40 * MIB, DEFAULT).unwrap();
        allocator.free(cached).unwrap();
        let pool = allocator.create_private_pool();
        allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
        let failed = allocator.allocate(30 * MIB, DEFAULT);
        assert!(
            matches!(failed, Err(AllocError::OutOfMemory(_))),
            "{failed:?}"
        );
        let stats = allocator.memory_stats();
        assert_eq!(
            (stats.num_alloc_retries, stats.num_sync_all_streams),
            (0, 0)
        );
        assert_eq!(
            allocator.memory_reserved(),
            40 * MIB,
            "cached memory was freed"
        );
        allocator.end_allocate_to_pool();

        let ordinary = allocator.allocate(30 * MIB, StreamId(1)).unwrap();
        assert_eq!(allocator.memory_stats().num_alloc_retries, retries);
        allocator.free(ordinary).unwrap();
        allocator.check_invariants().unwrap();
    }
}

/// No event is recorded while routing: not for a free that waits for another stream (deferred
/// until the routing ends), nor for free-epoch marks (the default policy marks every 64 frees),
/// and none is ever recorded on a pool's virtual stream. `record_stream` on the allocation's own
/// stream adds nothing, for a routed block too.
#[test]
fn no_event_is_recorded_while_routing() {
    let side = StreamId(1);
    let storage = SimulatedStorage::new(H200_BYTES);
    let events = storage.event_control();
    let allocator = CachingAllocator::new(storage, AllocatorConfig::default());
    let shared = allocator.allocate(1000, DEFAULT).unwrap();
    let shared_address = shared.address();
    allocator.record_stream(&shared, side).unwrap();

    let pool = allocator.create_private_pool();
    allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
    allocator.free(shared).unwrap();
    for _ in 0..100 {
        let routed = allocator.allocate(4096, DEFAULT).unwrap();
        allocator.record_stream(&routed, DEFAULT).unwrap();
        allocator.free(routed).unwrap();
        let ordinary = allocator.allocate(4096, side).unwrap();
        allocator.free(ordinary).unwrap();
    }
    assert_eq!(events.n_pending(), 0, "an event was recorded while routing");
    assert_eq!(allocator.memory_stats().num_sync_all_streams, 0);
    let snapshot = allocator.snapshot();
    let block = snapshot
        .segments
        .iter()
        .flat_map(|segment| &segment.blocks)
        .find(|block| block.address == shared_address)
        .expect("the shared block");
    assert_eq!(block.state, BlockState::ActivePendingFree);
    allocator.check_invariants().unwrap();
    allocator.end_allocate_to_pool();

    // The next request records the deferred event; the block waits for it.
    let early = allocator.allocate(1000, DEFAULT).unwrap();
    assert_ne!(early.address(), shared_address);
    assert_eq!(events.n_pending(), 1);
    events.complete_stream(side);
    let late = allocator.allocate(1000, DEFAULT).unwrap();
    assert_eq!(
        late.address(),
        shared_address,
        "the completed free was not reused"
    );
    // The frees counted while routing close an epoch now: marks on the real streams only.
    allocator.free(late).unwrap();
    assert!(
        events.n_pending() > 0,
        "no free-epoch mark after the routing"
    );
    events.complete_stream(DEFAULT);
    events.complete_stream(side);
    assert_eq!(events.n_pending(), 0, "an event on a virtual stream");
    allocator.free(early).unwrap();
    allocator.check_invariants().unwrap();
}

/// Every refused call is a typed error that says what to do.
#[test]
fn misuse_is_refused_with_typed_errors() {
    let allocator = simulated(AllocatorConfig::default());
    let pool = allocator.create_private_pool();
    let second = allocator.create_private_pool();
    let foreign = simulated(AllocatorConfig::default()).create_private_pool();

    let unknown = allocator.begin_allocate_to_pool(DEFAULT, foreign);
    assert_eq!(misuse(unknown), PrivatePoolMisuse::NotLive);
    allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
    let twice = allocator.begin_allocate_to_pool(StreamId(1), second);
    let message = twice.as_ref().unwrap_err().to_string();
    assert!(message.contains("end_allocate_to_pool"), "{message}");
    assert_eq!(
        misuse(twice),
        PrivatePoolMisuse::RoutingActive {
            stream: DEFAULT,
            pool
        }
    );
    assert_eq!(
        misuse(allocator.release_private_pool(pool)),
        PrivatePoolMisuse::BeingRouted
    );
    assert_eq!(
        misuse(allocator.empty_cache()),
        PrivatePoolMisuse::BeingRouted
    );
    assert_eq!(
        misuse(allocator.allocate(1000, pool.stream())),
        PrivatePoolMisuse::VirtualStream
    );
    let routed = allocator.allocate(1000, DEFAULT).unwrap();
    assert_eq!(
        misuse(allocator.record_stream(&routed, second.stream())),
        PrivatePoolMisuse::VirtualStream
    );
    allocator.end_allocate_to_pool();
    allocator.end_allocate_to_pool();

    assert_eq!(
        misuse(allocator.begin_allocate_to_pool(StreamId(1), pool)),
        PrivatePoolMisuse::OtherStream(DEFAULT)
    );
    allocator.release_private_pool(pool).unwrap();
    let released = allocator.release_private_pool(pool);
    let message = released.as_ref().unwrap_err().to_string();
    assert!(message.contains("create_private_pool"), "{message}");
    assert_eq!(misuse(released), PrivatePoolMisuse::NotLive);
    assert_eq!(
        misuse(allocator.begin_allocate_to_pool(DEFAULT, pool)),
        PrivatePoolMisuse::NotLive
    );
    assert_eq!(
        misuse(allocator.release_private_pool(foreign)),
        PrivatePoolMisuse::NotLive
    );
    allocator.free(routed).unwrap();
    allocator.check_invariants().unwrap();
}

/// Releasing a pool while another is routed to returns nothing then; `empty_cache` does.
#[test]
fn a_pool_released_during_another_routing_goes_back_with_empty_cache() {
    let allocator = simulated(AllocatorConfig::pytorch_defaults());
    let first = allocator.create_private_pool();
    allocator.begin_allocate_to_pool(DEFAULT, first).unwrap();
    let block = allocator.allocate(3 * MIB, DEFAULT).unwrap();
    allocator.free(block).unwrap();
    allocator.end_allocate_to_pool();
    let second = allocator.create_private_pool();
    allocator.begin_allocate_to_pool(DEFAULT, second).unwrap();
    allocator.release_private_pool(first).unwrap();
    assert_eq!(usage(&allocator, first).reserved_bytes, 20 * MIB);
    assert!(!usage(&allocator, first).live);
    allocator.end_allocate_to_pool();
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.private_pool_usage(first), None);
    assert_eq!(allocator.memory_reserved(), 0);
    allocator.check_invariants().unwrap();
}

/// Snapshot segments of a private pool carry `segment_pool_id` (id, 0) and the stream routed to
/// it; the default pools' carry (0, 0). It survives a pickle round trip.
#[test]
fn snapshots_name_the_private_pool() {
    for config in [
        AllocatorConfig::pytorch_defaults(),
        AllocatorConfig::default(),
    ] {
        let allocator = simulated(config);
        let ordinary = allocator.allocate(3 * MIB, StreamId(2)).unwrap();
        let pool = allocator.create_private_pool();
        allocator.begin_allocate_to_pool(StreamId(2), pool).unwrap();
        let routed = allocator.allocate(3 * MIB, StreamId(2)).unwrap();
        allocator.end_allocate_to_pool();

        let mut bytes = Vec::new();
        headroom_caching_allocator::write_pickle(&allocator.snapshot(), &mut bytes).unwrap();
        let snapshot = headroom_caching_allocator::read_pickle(bytes.as_slice()).unwrap();
        assert_eq!(snapshot.segments.len(), 2);
        for segment in &snapshot.segments {
            assert_eq!(segment.stream, 2);
            let expected = if segment.address <= routed.address()
                && routed.address() < segment.address + segment.total_size
            {
                (pool.id() as i64, 0)
            } else {
                (0, 0)
            };
            assert_eq!(segment.segment_pool_id, expected);
        }
        allocator.free(routed).unwrap();
        allocator.free(ordinary).unwrap();
    }
}

/// On real host memory: routed blocks are writable memory of the pool's own segments, and the
/// pool's segments go back to the storage once it is released.
#[test]
fn host_memory_pools_hold_real_segments() {
    let allocator = CachingAllocator::new(HostStorage::new(), AllocatorConfig::default());
    let pool = allocator.create_private_pool();
    allocator.begin_allocate_to_pool(DEFAULT, pool).unwrap();
    let routed = allocator.allocate(5 * MIB, DEFAULT).unwrap();
    // SAFETY: the block is live and lies inside a host segment of at least 5 MiB.
    unsafe { std::ptr::write_bytes(routed.address() as *mut u8, 7, (5 * MIB) as usize) };
    allocator.end_allocate_to_pool();
    let ordinary = allocator.allocate(5 * MIB, DEFAULT).unwrap();
    assert!(
        ordinary.address() + ordinary.size() <= routed.address()
            || routed.address() + routed.size() <= ordinary.address()
    );
    allocator.free(ordinary).unwrap();
    allocator.free(routed).unwrap();
    allocator.empty_cache().unwrap();
    allocator.with_storage(|s| assert_eq!(s.bytes_in_use(), 20 * MIB));
    allocator.release_private_pool(pool).unwrap();
    allocator.with_storage(|s| assert_eq!(s.bytes_in_use(), 0));
    allocator.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Alloc { size: u64, stream: u64 },
    Free { pick: usize },
    RecordStream { pick: usize, stream: u64 },
    CompleteEvents,
    EmptyCache,
    Begin { stream: u64, fresh: bool },
    End,
    Release { pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => 0u64..=MIB,
        3 => MIB + 1..10 * MIB,
        2 => 10 * MIB..40 * MIB,
    ];
    prop_oneof![
        10 => (size, 0u64..2).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), 0u64..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => Just(Op::CompleteEvents),
        1 => Just(Op::EmptyCache),
        2 => (0u64..2, any::<bool>()).prop_map(|(stream, fresh)| Op::Begin { stream, fresh }),
        2 => Just(Op::End),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
    ]
}

fn config(index: usize) -> AllocatorConfig {
    match index {
        0 => AllocatorConfig::pytorch_defaults(),
        1 => AllocatorConfig::default(),
        _ => AllocatorConfig::reclaiming(),
    }
}

/// What the test knows of a pool: its id, the stream routed to it, whether it is live, and its
/// reserved bytes after the last operation.
struct PoolModel {
    id: PrivatePoolId,
    stream: Option<StreamId>,
    live: bool,
    reserved: u64,
}

fn fail(error: AllocError) -> TestCaseError {
    TestCaseError::fail(error.to_string())
}

fn run_sequence(config_index: usize, ops: &[Op]) -> Result<(), TestCaseError> {
    let storage = SimulatedStorage::new(200 * MIB);
    let events = storage.event_control();
    let allocator = CachingAllocator::new(storage, config(config_index));
    let mut live: Vec<(Allocation, Option<PrivatePoolId>)> = Vec::new();
    let mut pools: Vec<PoolModel> = Vec::new();
    let mut routing: Option<(StreamId, PrivatePoolId)> = None;
    // Every range a block ever occupied, with its owner (a pool, or none for ordinary memory).
    // The simulated storage never hands out an address twice, so a block never overlaps a range
    // of another owner.
    let mut ranges: Vec<(u64, u64, Option<PrivatePoolId>)> = Vec::new();

    for op in ops {
        let (pending_before, syncs_before) = (
            events.n_pending(),
            allocator.memory_stats().num_sync_all_streams,
        );
        match *op {
            Op::Alloc { size, stream } => {
                let stream = StreamId(stream);
                let owner = routing.filter(|&(s, _)| s == stream).map(|(_, p)| p);
                match allocator.allocate(size, stream) {
                    Ok(allocation) => {
                        prop_assert_eq!(allocation.stream(), stream);
                        let address = allocation.address();
                        prop_assert_eq!(
                            allocator.allocation_stream(address).map_err(fail)?,
                            stream
                        );
                        let end = address + allocation.size();
                        for &(start, stop, other) in &ranges {
                            prop_assert!(
                                other == owner || end <= start || stop <= address,
                                "a block of {:?} overlaps memory of {:?}",
                                owner,
                                other
                            );
                        }
                        ranges.push((address, end, owner));
                        live.push((allocation, owner));
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(other) => return Err(fail(other)),
                }
            }
            Op::Free { pick } if !live.is_empty() => {
                let (allocation, _) = live.swap_remove(pick % live.len());
                allocator.free(allocation).map_err(fail)?;
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                let (allocation, _) = &live[pick % live.len()];
                allocator
                    .record_stream(allocation, StreamId(stream))
                    .map_err(fail)?;
            }
            Op::CompleteEvents => events.complete_all(),
            Op::EmptyCache => match (allocator.empty_cache(), routing) {
                (Ok(()), None) => {}
                (Err(AllocError::PrivatePool { misuse, .. }), Some(_)) => {
                    prop_assert_eq!(misuse, PrivatePoolMisuse::BeingRouted);
                }
                (result, _) => prop_assert!(false, "empty_cache: {:?}", result),
            },
            Op::Begin { stream, fresh } => {
                let stream = StreamId(stream);
                if fresh || !pools.iter().any(|p| p.live) {
                    let id = allocator.create_private_pool();
                    pools.push(PoolModel {
                        id,
                        stream: None,
                        live: true,
                        reserved: 0,
                    });
                }
                let pool = pools
                    .iter_mut()
                    .rev()
                    .find(|p| p.live)
                    .expect("a live pool");
                let result = allocator.begin_allocate_to_pool(stream, pool.id);
                match (routing, pool.stream) {
                    (Some((routed, routed_pool)), _) => prop_assert_eq!(
                        misuse(result),
                        PrivatePoolMisuse::RoutingActive {
                            stream: routed,
                            pool: routed_pool
                        }
                    ),
                    (None, Some(served)) if served != stream => {
                        prop_assert_eq!(misuse(result), PrivatePoolMisuse::OtherStream(served));
                    }
                    (None, _) => {
                        result.map_err(fail)?;
                        pool.stream = Some(stream);
                        routing = Some((stream, pool.id));
                    }
                }
            }
            Op::End => {
                allocator.end_allocate_to_pool();
                routing = None;
            }
            Op::Release { pick } if !pools.is_empty() => {
                let count = pools.len();
                let pool = &mut pools[pick % count];
                let result = allocator.release_private_pool(pool.id);
                if !pool.live {
                    prop_assert_eq!(misuse(result), PrivatePoolMisuse::NotLive);
                } else if routing.is_some_and(|(_, routed)| routed == pool.id) {
                    prop_assert_eq!(misuse(result), PrivatePoolMisuse::BeingRouted);
                } else {
                    result.map_err(fail)?;
                    pool.live = false;
                }
            }
            Op::Free { .. } | Op::RecordStream { .. } | Op::Release { .. } => {}
        }

        allocator.check_invariants().map_err(TestCaseError::fail)?;
        if routing.is_some() {
            prop_assert!(
                events.n_pending() <= pending_before,
                "an event while routing"
            );
            prop_assert_eq!(
                allocator.memory_stats().num_sync_all_streams,
                syncs_before,
                "a wait while routing"
            );
        }
        for pool in &mut pools {
            let Some(usage) = allocator.private_pool_usage(pool.id) else {
                prop_assert!(!pool.live, "a live pool is unknown");
                continue;
            };
            prop_assert_eq!(usage.live, pool.live);
            if pool.live {
                prop_assert!(usage.reserved_bytes >= pool.reserved, "a live pool shrank");
            }
            pool.reserved = usage.reserved_bytes;
            let allocated: u64 = live
                .iter()
                .filter(|(_, owner)| *owner == Some(pool.id))
                .map(|(allocation, _)| allocation.size())
                .sum();
            prop_assert_eq!(usage.allocated_bytes, allocated);
            prop_assert!(usage.reserved_bytes >= allocated);
        }
        let stats = allocator.memory_stats();
        let allocated: u64 = live.iter().map(|(a, _)| a.size()).sum();
        prop_assert_eq!(stats.allocated_bytes.all.current as u64, allocated);
        let in_use = allocator.with_storage(|storage| storage.bytes_in_use());
        prop_assert_eq!(in_use, stats.reserved_bytes.all.current as u64);
    }

    allocator.end_allocate_to_pool();
    for pool in pools.iter().filter(|p| p.live) {
        allocator.release_private_pool(pool.id).map_err(fail)?;
    }
    for (allocation, _) in live {
        allocator.free(allocation).map_err(fail)?;
    }
    allocator.empty_cache().map_err(fail)?;
    allocator.check_invariants().map_err(TestCaseError::fail)?;
    prop_assert_eq!(allocator.memory_reserved(), 0);
    prop_assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
    for pool in &pools {
        prop_assert_eq!(allocator.private_pool_usage(pool.id), None);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_pools_apart(
        config_index in 0usize..3,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run_sequence(config_index, &ops)?;
    }
}
