//! Property tests of the caching policy: 10,000 random sequences of alloc / free /
//! record_stream / event completion / empty_cache under five configurations (PyTorch's classic
//! and expandable policies, the default, classic with `max_split_size` and rounding, and the
//! default with physical handles of up to 8 MiB, which unmap only whole), and a
//! stress test from 8 threads that writes through every block it holds.
//!
//! After every operation: no two live blocks overlap, no new block overlaps a block whose free
//! still waits on another stream, every statistic equals its recomputation from the blocks
//! (`check_invariants`), and allocated / requested bytes equal the test's own model. At the end,
//! freeing everything and emptying the cache returns every byte to the storage.

use std::sync::Arc;

use headroom_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, HostStorage, SimulatedStorage,
    StatArray, StreamId,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
    Alloc { size: u64, stream: u64 },
    Free { pick: usize },
    RecordStream { pick: usize, stream: u64 },
    CompleteEvents,
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => 0u64..=MIB,
        3 => MIB + 1..10 * MIB,
        2 => 10 * MIB..48 * MIB,
    ];
    prop_oneof![
        10 => (size, 0u64..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0u64..4).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => Just(Op::CompleteEvents),
        1 => Just(Op::EmptyCache),
    ]
}

fn config(index: usize) -> AllocatorConfig {
    match index {
        0 => AllocatorConfig::pytorch_defaults(),
        1 => AllocatorConfig::default(),
        2 => AllocatorConfig::pytorch_expandable(),
        4 => AllocatorConfig::builder()
            .expandable_handle_size_mb(8)
            .build()
            .expect("valid config"),
        5 => AllocatorConfig::parse("caching:False").expect("valid config"),
        _ => AllocatorConfig::parse(
            "expandable_segments:False,max_split_size_mb:24,roundup_power2_divisions:4",
        )
        .expect("valid config"),
    }
}

fn check_stat_array(name: &str, array: &StatArray) -> Result<(), TestCaseError> {
    for stat in [&array.all, &array.small_pool, &array.large_pool] {
        prop_assert_eq!(stat.allocated - stat.freed, stat.current, "{}", name);
        prop_assert!(stat.peak >= stat.current, "{} peak below current", name);
        prop_assert!(stat.current >= 0, "{} negative", name);
    }
    let sum = array.small_pool.current + array.large_pool.current;
    prop_assert_eq!(sum, array.all.current, "{} pools do not add up", name);
    Ok(())
}

fn run_sequence(config_index: usize, ops: &[Op]) -> Result<(), TestCaseError> {
    let storage = SimulatedStorage::new(160 * MIB);
    let events = storage.event_control();
    let allocator = CachingAllocator::new(storage, config(config_index));
    let mut live: Vec<Allocation> = Vec::new();
    // Blocks freed while other streams may still use them: (address, size).
    let mut pending: Vec<(u64, u64)> = Vec::new();
    let mut recorded: Vec<bool> = Vec::new();

    for op in ops {
        let syncs = allocator.memory_stats().num_sync_all_streams;
        match *op {
            Op::Alloc { size, stream } => match allocator.allocate(size, StreamId(stream)) {
                Ok(allocation) => {
                    // A retry after a failed storage allocation waits for every pending event.
                    if allocator.memory_stats().num_sync_all_streams > syncs {
                        pending.clear();
                    }
                    let syncs_after = allocator.memory_stats().num_sync_all_streams;
                    prop_assert!(syncs_after >= syncs);
                    prop_assert!(allocation.size() >= size.max(1));
                    let (start, end) = (
                        allocation.address(),
                        allocation.address() + allocation.size(),
                    );
                    for &(address, bytes) in &pending {
                        prop_assert!(
                            end <= address || address + bytes <= start,
                            "block reused before its stream event completed"
                        );
                    }
                    live.push(allocation);
                    recorded.push(false);
                }
                Err(AllocError::OutOfMemory(report)) => {
                    // The out-of-memory ladder waited for every pending event.
                    pending.clear();
                    prop_assert_eq!(report.requested, size);
                    prop_assert!(report.capacity == 160 * MIB);
                }
                Err(other) => return Err(TestCaseError::fail(format!("unexpected error {other}"))),
            },
            Op::Free { pick } if !live.is_empty() => {
                let index = pick % live.len();
                let allocation = live.swap_remove(index);
                if recorded.swap_remove(index) {
                    pending.push((allocation.address(), allocation.size()));
                }
                allocator
                    .free(allocation)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                let index = pick % live.len();
                allocator
                    .record_stream(&live[index], StreamId(stream))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                if live[index].stream() != StreamId(stream) {
                    recorded[index] = true;
                }
            }
            Op::CompleteEvents => {
                events.complete_all();
                pending.clear();
            }
            Op::EmptyCache => {
                allocator
                    .empty_cache()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                // empty_cache waits for every pending event.
                pending.clear();
            }
            Op::Free { .. } | Op::RecordStream { .. } => {}
        }

        allocator.check_invariants().map_err(TestCaseError::fail)?;
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .map(|a| (a.address(), a.address() + a.size()))
            .collect();
        spans.sort_unstable();
        for pair in spans.windows(2) {
            prop_assert!(pair[0].1 <= pair[1].0, "live blocks overlap: {:?}", pair);
        }
        let stats = allocator.memory_stats();
        let allocated: u64 = live.iter().map(Allocation::size).sum();
        let requested: u64 = live.iter().map(Allocation::requested).sum();
        prop_assert_eq!(stats.allocated_bytes.all.current as u64, allocated);
        prop_assert_eq!(stats.allocation.all.current as usize, live.len());
        prop_assert!(stats.requested_bytes.all.current as u64 >= requested);
        prop_assert!(stats.reserved_bytes.all.current as u64 <= 160 * MIB);
        for (name, array) in stats.named_arrays() {
            check_stat_array(name, array)?;
        }
        let in_use = allocator.with_storage(|storage| storage.bytes_in_use());
        prop_assert_eq!(in_use, stats.reserved_bytes.all.current as u64);
        if !allocator.config().caching() {
            // Nothing is cached: every segment is a block in use or waiting for its events.
            prop_assert_eq!(
                stats.reserved_bytes.all.current,
                stats.active_bytes.all.current
            );
            prop_assert_eq!(stats.segment.all.current, stats.active.all.current);
        }
    }

    for allocation in live {
        allocator
            .free(allocation)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    allocator
        .empty_cache()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    allocator.check_invariants().map_err(TestCaseError::fail)?;
    let stats = allocator.memory_stats();
    prop_assert_eq!(stats.reserved_bytes.all.current, 0);
    prop_assert_eq!(stats.active_bytes.all.current, 0);
    prop_assert_eq!(stats.segment.all.current, 0);
    prop_assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_every_invariant(
        config_index in 0usize..6,
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run_sequence(config_index, &ops)?;
    }
}

/// Eight threads allocate, fill, check and free blocks of one shared allocator over real host
/// memory: a block handed to two threads at once would show up as a corrupted fill pattern.
/// The capacity covers the worst interleaving (8 threads × 16 blocks × 20 MiB = 2.5 GiB live)
/// with room for the cache's segments: at 1 GiB an unlucky schedule ran out of memory (897 MB
/// live), which says nothing about sharing. Only the filled bytes are touched.
#[test]
fn eight_threads_share_one_allocator() {
    let allocator = Arc::new(CachingAllocator::new(
        HostStorage::with_capacity(4 << 30),
        AllocatorConfig::default(),
    ));
    let threads: Vec<_> = (0..8u64)
        .map(|thread| {
            let allocator = Arc::clone(&allocator);
            std::thread::spawn(move || {
                let mut seed = thread.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let mut held: Vec<(Allocation, u8)> = Vec::new();
                for step in 0..3_000u64 {
                    if held.len() < 16 && next() % 3 != 0 {
                        let size = match next() % 4 {
                            0 => next() % 4096 + 1,
                            1 => next() % MIB + 1,
                            2 => next() % (4 * MIB) + MIB,
                            _ => next() % (12 * MIB) + 8 * MIB,
                        };
                        let stream = StreamId(thread % 2);
                        let allocation =
                            allocator.allocate(size, stream).expect("capacity suffices");
                        let pattern = (thread as u8) ^ (step as u8);
                        fill(&allocation, pattern);
                        held.push((allocation, pattern));
                    } else if !held.is_empty() {
                        let index = (next() as usize) % held.len();
                        let (allocation, pattern) = held.swap_remove(index);
                        assert!(
                            holds(&allocation, pattern),
                            "block overwritten by another thread"
                        );
                        allocator.free(allocation).expect("live allocation");
                    }
                }
                for (allocation, pattern) in held {
                    assert!(
                        holds(&allocation, pattern),
                        "block overwritten by another thread"
                    );
                    allocator.free(allocation).expect("live allocation");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread panicked");
    }
    allocator.check_invariants().unwrap();
    assert_eq!(allocator.memory_allocated(), 0);
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    assert_eq!(allocator.with_storage(|storage| storage.bytes_in_use()), 0);
}

/// Writes `pattern` at the start, middle and end of the block (whole-block fills would make the
/// test slow in debug builds without finding more).
fn fill(allocation: &Allocation, pattern: u8) {
    for offset in probe_offsets(allocation) {
        // SAFETY: the block is live, owned by this thread, and `offset` < its requested size,
        // which lies inside a real host segment of HostStorage.
        unsafe { *((allocation.address() + offset) as *mut u8) = pattern };
    }
}

fn holds(allocation: &Allocation, pattern: u8) -> bool {
    probe_offsets(allocation).all(|offset| {
        // SAFETY: as in `fill`; the block is still live.
        unsafe { *((allocation.address() + offset) as *const u8) == pattern }
    })
}

fn probe_offsets(allocation: &Allocation) -> impl Iterator<Item = u64> {
    let last = allocation.requested().max(1) - 1;
    [0, last / 2, last].into_iter()
}
