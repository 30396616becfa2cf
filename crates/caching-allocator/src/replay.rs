//! Replaying a recorded allocator trace through a [`CachingAllocator`].
//!
//! A PyTorch trace (TSV or a snapshot's `device_traces`) lists every `alloc` and `free_completed`
//! of a real run. Replaying that sequence through another policy on [`crate::SimulatedStorage`]
//! measures the policy on the same workload: its peak reserved bytes against the peak of live
//! requests is its fragmentation. The original allocator's own decisions (`segment_*`, `oom`,
//! `snapshot`) are not replayed.
//!
//! # The baseline: what was live before recording
//!
//! A recording rarely starts with an empty allocator: the model's parameters (and whatever the
//! run allocated before `_record_memory_history`) are live throughout and never appear in the
//! trace, or appear only as frees. Left out, they make every replayed peak too low (by 19% on
//! the ViT-L/16 snapshot in `testdata`). A [`RecordedTrace`] therefore carries, besides its
//! events, the blocks live before its first event ([`LiveBlock`]), and [`replay_trace`]
//! allocates them first, under the context label [`BASELINE_LABEL`]:
//! - blocks the trace frees without having allocated them (from any input, TSV included);
//! - with a snapshot's segments ([`RecordedTrace::from_snapshot`]): the active blocks that the
//!   trace never allocates.
//!
//! Each is allocated with its requested size on its stream; its address in the recording only
//! names it for the trace's later free, since the replaying policy places it where it decides.
//! [`ReplayReport`] states the baseline's blocks and bytes; every peak includes it.
//!
//! This module drives the public allocator API only; it knows the snapshot model but nothing
//! about file formats.

use std::time::Instant;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::allocator::{Allocation, CachingAllocator};
use crate::error::AllocError;
use crate::snapshot::{
    trace_events_from_snapshot, BlockState, SegmentSnapshot, Snapshot, TraceAction, TraceEvent,
};
use crate::storage::{SegmentPlacement, SimulatedStorage, Storage, StreamId};

/// The context label the baseline's allocations carry in a replay's recorded history (their
/// frame in PyTorch's viewer).
pub const BASELINE_LABEL: &str = "live before recording";

/// A block that was live before a trace's first event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    /// Its address in the recording: the key the trace's free of it uses.
    pub addr: u64,
    /// Bytes its client asked for.
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: u64,
    /// Whether the trace frees it (otherwise it is live to the end).
    pub freed_by_trace: bool,
}

/// A recorded trace: the blocks live before its first event, then its events, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordedTrace {
    /// The baseline, in address order.
    pub live_before: Vec<LiveBlock>,
    /// The events.
    pub events: Vec<TraceEvent>,
}

impl RecordedTrace {
    /// A trace without segments (a TSV file): the baseline is the blocks the trace frees
    /// without having allocated them, each with the size its free records.
    pub fn from_events(events: Vec<TraceEvent>) -> Self {
        Self::from_events_and_segments(events, &[])
    }

    /// Device 0's history of `snapshot` (as [`trace_events_from_snapshot`] reads it) with the
    /// baseline that device's segments and the history imply.
    pub fn from_snapshot(snapshot: &Snapshot) -> Self {
        Self::with_baseline(
            trace_events_from_snapshot(snapshot),
            snapshot
                .segments
                .iter()
                .filter(|segment| segment.device == 0),
        )
    }

    /// `events` with the baseline they and `segments` (the allocator's state at the end of the
    /// recording) imply:
    /// - a free whose address the trace has not allocated before, nor freed before, frees a
    ///   block live before recording (a second such free of the same address is left to the
    ///   replay, which counts it in [`ReplayReport::skipped_frees`]);
    /// - an active block of `segments` (allocated or pending free) at an address the trace never
    ///   allocates was live from before the first event to the end; it is taken with its
    ///   `requested_size` (its `size` when that is 0) and its segment's stream.
    pub fn from_events_and_segments(events: Vec<TraceEvent>, segments: &[SegmentSnapshot]) -> Self {
        Self::with_baseline(events, segments)
    }

    fn with_baseline<'a>(
        events: Vec<TraceEvent>,
        segments: impl IntoIterator<Item = &'a SegmentSnapshot>,
    ) -> Self {
        let frees_on_request = frees_on_request(&events);
        let mut allocated = FxHashSet::default();
        let mut live_before = Vec::new();
        let mut seeded = FxHashSet::default();
        for event in &events {
            if event.action == TraceAction::Alloc {
                allocated.insert(event.addr);
            } else if is_free(event.action, frees_on_request)
                && !allocated.contains(&event.addr)
                && seeded.insert(event.addr)
            {
                live_before.push(LiveBlock {
                    addr: event.addr,
                    requested: event.size,
                    stream: event.stream,
                    freed_by_trace: true,
                });
            }
        }
        for segment in segments {
            for block in &segment.blocks {
                if block.state != BlockState::Inactive
                    && !allocated.contains(&block.address)
                    && seeded.insert(block.address)
                {
                    live_before.push(LiveBlock {
                        addr: block.address,
                        requested: if block.requested_size > 0 {
                            block.requested_size
                        } else {
                            block.size
                        },
                        stream: segment.stream,
                        freed_by_trace: false,
                    });
                }
            }
        }
        live_before.sort_unstable_by_key(|block| block.addr);
        RecordedTrace {
            live_before,
            events,
        }
    }

    /// Σ of the baseline's requested bytes.
    pub fn baseline_requested_bytes(&self) -> u64 {
        self.live_before.iter().map(|block| block.requested).sum()
    }
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    /// Events in the trace (the baseline not included).
    pub events: u64,
    /// Blocks live before recording, allocated before the first event.
    pub baseline_blocks: u64,
    /// Of those, the ones the trace frees.
    pub baseline_freed_blocks: u64,
    /// Allocated bytes the baseline took, rounded by the replaying policy: the replay's
    /// starting figure.
    pub baseline_bytes: u64,
    /// Σ of the baseline's requested bytes.
    pub baseline_requested_bytes: u64,
    /// Allocations replayed.
    pub allocs: u64,
    /// Frees replayed (of blocks the trace allocated, or of the baseline).
    pub frees: u64,
    /// Frees of addresses neither live nor in the baseline (freed twice: a trace that lost an
    /// allocation); skipped.
    pub skipped_frees: u64,
    /// Allocations at an address the trace already held live (a trace that lost a free); the
    /// older allocation is freed first.
    pub reallocated_addresses: u64,
    /// Allocations that failed for lack of memory, the baseline's included (the replay goes on
    /// without them).
    pub ooms: u64,
    /// Peak of the allocator's allocated bytes, the baseline included.
    pub peak_allocated_bytes: u64,
    /// Peak of the allocator's reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Peak of the live requests, each rounded up to 512 bytes, the baseline included: the
    /// floor for any allocator.
    pub peak_requested_rounded_bytes: u64,
    /// Segment allocations and page mappings asked of the storage.
    pub device_allocs: u64,
    /// Segment frees and page unmappings asked of the storage.
    pub device_frees: u64,
    /// Seconds spent replaying the events (the baseline's allocation not included).
    pub seconds: f64,
}

impl ReplayReport {
    /// Replayed events per second.
    pub fn events_per_second(&self) -> f64 {
        self.events as f64 / self.seconds.max(1e-12)
    }

    /// Peak reserved over the peak of live rounded requests (1.0 = no fragmentation).
    pub fn reserved_over_requested(&self) -> f64 {
        self.peak_reserved_bytes as f64 / self.peak_requested_rounded_bytes.max(1) as f64
    }
}

/// Replays `trace` through `allocator`: first its baseline (each block allocated with its
/// requested size on its stream, under the context label [`BASELINE_LABEL`]), then its events:
/// `alloc` allocates, `free_completed` (or `free`) frees. When a trace has no `free_completed`
/// at all, `free_requested` is taken as the free.
///
/// Live allocations at the end of the trace stay allocated; the allocator can be inspected or
/// snapshotted afterwards (with history recorded, the baseline shows as the first allocations).
pub fn replay_trace<S: Storage>(
    allocator: &CachingAllocator<S>,
    trace: &RecordedTrace,
) -> Result<ReplayReport, AllocError> {
    replay_placed(allocator, trace, None)
}

/// [`replay_trace`] on simulated memory whose segments land where the recording's did: before
/// each allocation the storage is told the address at which the recorded allocator's block came
/// out ([`SegmentPlacement`]), and a segment the allocation obtains starts there when the range
/// is free. A policy that takes a new segment for the same request as the recorded one (the
/// classic policy replaying PyTorch's classic run) then sees the device's addresses, which
/// decide best fit among blocks of equal size; other segments are placed as usual.
///
/// Recorded addresses are device addresses: they do not say where pages of an expandable
/// segment go, so an expandable policy replays as with [`replay_trace`].
///
/// ```
/// use headroom_caching_allocator::{
///     read_trace_tsv, replay_trace_at_recorded_addresses, AllocatorConfig, CachingAllocator,
///     RecordedTrace, SimulatedStorage,
/// };
///
/// // One 3,000,000-byte request that PyTorch served from a new segment at 0x7fec_1a80_0000.
/// let tsv = "action\taddr\tsize\nalloc\t140652033605632\t3000000\n";
/// let trace = RecordedTrace::from_events(read_trace_tsv(tsv.as_bytes())?);
/// let allocator = CachingAllocator::new(
///     SimulatedStorage::new(1 << 34),
///     AllocatorConfig::pytorch_defaults(),
/// );
/// let report = replay_trace_at_recorded_addresses(&allocator, &trace)?;
/// assert_eq!(report.peak_reserved_bytes, 20 << 20);
/// assert_eq!(allocator.snapshot().segments[0].address, 0x7fec_1a80_0000);
/// # Ok::<(), headroom_caching_allocator::AllocError>(())
/// ```
pub fn replay_trace_at_recorded_addresses(
    allocator: &CachingAllocator<SimulatedStorage>,
    trace: &RecordedTrace,
) -> Result<ReplayReport, AllocError> {
    let placement = allocator.with_storage(SimulatedStorage::segment_placement);
    replay_placed(allocator, trace, Some(&placement))
}

fn replay_placed<S: Storage>(
    allocator: &CachingAllocator<S>,
    trace: &RecordedTrace,
    placement: Option<&SegmentPlacement>,
) -> Result<ReplayReport, AllocError> {
    let frees_on_request = frees_on_request(&trace.events);
    let mut replay = Replay {
        allocator,
        placement,
        live: FxHashMap::default(),
        requested_rounded: 0,
        report: ReplayReport {
            events: trace.events.len() as u64,
            baseline_blocks: trace.live_before.len() as u64,
            baseline_freed_blocks: trace
                .live_before
                .iter()
                .filter(|block| block.freed_by_trace)
                .count() as u64,
            baseline_bytes: 0,
            baseline_requested_bytes: trace.baseline_requested_bytes(),
            allocs: 0,
            frees: 0,
            skipped_frees: 0,
            reallocated_addresses: 0,
            ooms: 0,
            peak_allocated_bytes: 0,
            peak_reserved_bytes: 0,
            peak_requested_rounded_bytes: 0,
            device_allocs: 0,
            device_frees: 0,
            seconds: 0.0,
        },
    };
    replay.live.reserve(1 << 14);
    let allocated_before = allocator.memory_allocated();
    {
        let _context = allocator.push_context(BASELINE_LABEL);
        for block in &trace.live_before {
            replay.allocate(block.addr, block.requested, block.stream)?;
        }
    }
    replay.report.baseline_bytes = allocator.memory_allocated() - allocated_before;
    let started = Instant::now();
    for event in &trace.events {
        match event.action {
            TraceAction::Alloc => {
                let allocated = replay.allocate(event.addr, event.size, event.stream)?;
                replay.report.allocs += u64::from(allocated);
            }
            action if is_free(action, frees_on_request) => replay.free(event.addr)?,
            _ => {}
        }
    }
    let mut report = replay.report;
    report.seconds = started.elapsed().as_secs_f64();
    let stats = allocator.memory_stats();
    report.peak_allocated_bytes = stats.allocated_bytes.all.peak as u64;
    report.peak_reserved_bytes = stats.reserved_bytes.all.peak as u64;
    report.device_allocs = stats.num_device_alloc as u64;
    report.device_frees = stats.num_device_free as u64;
    // The live allocations stay allocated (dropping a handle frees nothing): the caller may
    // snapshot the end state.
    drop(replay.live);
    Ok(report)
}

/// Whether the trace's frees are its `free_requested` entries (it has no `free_completed`).
fn frees_on_request(events: &[TraceEvent]) -> bool {
    !events
        .iter()
        .any(|event| event.action == TraceAction::FreeCompleted)
}

/// Whether `action` frees a block in a trace whose frees are (or are not) its requests.
fn is_free(action: TraceAction, frees_on_request: bool) -> bool {
    match action {
        TraceAction::FreeCompleted | TraceAction::Free => !frees_on_request,
        TraceAction::FreeRequested => frees_on_request,
        _ => false,
    }
}

/// The replay's running state: the trace's live blocks by recorded address.
struct Replay<'a, S: Storage> {
    allocator: &'a CachingAllocator<S>,
    /// Where to tell the storage the recorded address of each allocation.
    placement: Option<&'a SegmentPlacement>,
    live: FxHashMap<u64, Allocation>,
    /// Σ of the live requests, each rounded up to 512 bytes.
    requested_rounded: u64,
    report: ReplayReport,
}

impl<S: Storage> Replay<'_, S> {
    /// Allocates `size` bytes on `stream` for the recorded address `addr`; `false` when the
    /// allocator ran out of memory (counted).
    fn allocate(&mut self, addr: u64, size: u64, stream: u64) -> Result<bool, AllocError> {
        if let Some(previous) = self.live.remove(&addr) {
            self.report.reallocated_addresses += 1;
            self.requested_rounded -= rounded_request(previous.requested());
            self.allocator.free(previous)?;
        }
        if let Some(placement) = self.placement {
            placement.place_next_at(addr);
        }
        let result = self.allocator.allocate(size, StreamId(stream));
        if let Some(placement) = self.placement {
            placement.clear();
        }
        match result {
            Ok(allocation) => {
                self.requested_rounded += rounded_request(size);
                self.report.peak_requested_rounded_bytes = self
                    .report
                    .peak_requested_rounded_bytes
                    .max(self.requested_rounded);
                self.live.insert(addr, allocation);
                Ok(true)
            }
            Err(AllocError::OutOfMemory(_)) => {
                self.report.ooms += 1;
                Ok(false)
            }
            Err(other) => Err(other),
        }
    }

    fn free(&mut self, addr: u64) -> Result<(), AllocError> {
        match self.live.remove(&addr) {
            Some(allocation) => {
                self.report.frees += 1;
                self.requested_rounded -= rounded_request(allocation.requested());
                self.allocator.free(allocation)
            }
            None => {
                self.report.skipped_frees += 1;
                Ok(())
            }
        }
    }
}

/// `bytes` rounded up to 512, at least 512: the floor any policy rounds a request to.
fn rounded_request(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(512) * 512
}
