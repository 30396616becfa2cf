//! Expandable segments on a simulated device: pages mapped as requests need them and unmapped
//! only whole, free pages moved across holes and between the pools before reserved memory grows
//! (reclaiming), without a wait for the device once the free-epoch marks have passed and with no
//! decision changed by resetting the peak statistics, and handles given back only whole. The
//! classic policy's figures are in `allocator_policy.rs`.

use headroom_caching_allocator::{
    Allocation, AllocatorConfig, CachingAllocator, SimulatedStorage, StreamId,
};

const MIB: u64 = 1 << 20;
const H200_BYTES: u64 = 150_754_820_096;

type Allocator = CachingAllocator<SimulatedStorage>;

/// `count` allocations of `size` bytes on the default stream.
fn allocate_many(allocator: &Allocator, count: usize, size: u64) -> Vec<Allocation> {
    (0..count)
        .map(|_| allocator.allocate(size, StreamId::DEFAULT).unwrap())
        .collect()
}

/// Frees each of `allocations`.
fn free_all(allocator: &Allocator, allocations: impl IntoIterator<Item = Allocation>) {
    for allocation in allocations {
        allocator.free(allocation).unwrap();
    }
}

/// Frees `allocations`, the last live ones, and empties the cache: nothing stays reserved or
/// mapped, and the books check.
fn free_and_release(allocator: &Allocator, allocations: impl IntoIterator<Item = Allocation>) {
    free_all(allocator, allocations);
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_reserved(), 0);
    allocator.with_storage(|storage| assert_eq!(storage.bytes_in_use(), 0));
    allocator.check_invariants().unwrap();
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
        let first = allocate_many(&allocator, 8, 16 * MIB);
        free_all(&allocator, first);
        let second = allocate_many(&allocator, 4, 32 * MIB);
        assert_eq!(allocator.max_memory_reserved(), reserved);
        allocator.check_invariants().unwrap();
        free_and_release(&allocator, second);
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
        free_and_release(&allocator, [a, c, d, e]);
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
            let activations = allocate_many(&allocator, 40, MIB);
            free_all(&allocator, activations);
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
        free_all(&allocator, [a, c, h]);
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
    free_and_release(&allocator, [a, c, d]);
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
        free_and_release(&allocator, [b, c]);
    }
}
