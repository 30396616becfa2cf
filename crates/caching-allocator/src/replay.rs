//! Replaying a recorded allocator trace through a [`CachingAllocator`].
//!
//! A PyTorch trace (TSV or a snapshot's `device_traces`) lists every `alloc` and `free_completed`
//! of a real run. Replaying that sequence through another policy on [`crate::SimulatedStorage`]
//! measures the policy on the same workload: its peak reserved bytes against the peak of live
//! requests is its fragmentation. The original allocator's own decisions (`segment_*`, `oom`,
//! `snapshot`) are not replayed.
//!
//! This module drives the public allocator API only; it knows nothing about file formats.

use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::allocator::{Allocation, CachingAllocator};
use crate::error::AllocError;
use crate::snapshot::{TraceAction, TraceEvent};
use crate::storage::{Storage, StreamId};

/// What a replay measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    /// Events in the trace.
    pub events: u64,
    /// Allocations replayed.
    pub allocs: u64,
    /// Frees replayed.
    pub frees: u64,
    /// Frees of addresses the trace never allocated (the recording began mid-run); skipped.
    pub skipped_frees: u64,
    /// Allocations at an address the trace already held live (a trace that lost a free); the
    /// older allocation is freed first.
    pub reallocated_addresses: u64,
    /// Allocations that failed for lack of memory (the replay goes on without them).
    pub ooms: u64,
    /// Peak of the allocator's allocated bytes.
    pub peak_allocated_bytes: u64,
    /// Peak of the allocator's reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Peak of the live requests, each rounded up to 512 bytes: the floor for any allocator.
    pub peak_requested_rounded_bytes: u64,
    /// Segment allocations and page mappings asked of the storage.
    pub device_allocs: u64,
    /// Segment frees and page unmappings asked of the storage.
    pub device_frees: u64,
    /// Seconds spent in the replay loop.
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

/// Replays `events` through `allocator`: `alloc` allocates, `free_completed` (or `free`) frees.
/// When a trace has no `free_completed` at all, `free_requested` is taken as the free.
///
/// Live allocations at the end of the trace stay allocated; the allocator can be inspected or
/// snapshotted afterwards.
pub fn replay_trace<S: Storage>(
    allocator: &CachingAllocator<S>,
    events: &[TraceEvent],
) -> Result<ReplayReport, AllocError> {
    let frees_on_request = !events
        .iter()
        .any(|e| e.action == TraceAction::FreeCompleted);
    let mut live: FxHashMap<u64, Allocation> = FxHashMap::default();
    live.reserve(1 << 14);
    let mut report = ReplayReport {
        events: events.len() as u64,
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
    };
    let mut requested_rounded = 0u64;
    let started = Instant::now();
    for event in events {
        match event.action {
            TraceAction::Alloc => {
                if let Some(previous) = live.remove(&event.addr) {
                    report.reallocated_addresses += 1;
                    requested_rounded -= previous.requested().max(1).div_ceil(512) * 512;
                    allocator.free(previous)?;
                }
                match allocator.allocate(event.size, StreamId(event.stream)) {
                    Ok(allocation) => {
                        report.allocs += 1;
                        requested_rounded += event.size.max(1).div_ceil(512) * 512;
                        report.peak_requested_rounded_bytes =
                            report.peak_requested_rounded_bytes.max(requested_rounded);
                        live.insert(event.addr, allocation);
                    }
                    Err(AllocError::OutOfMemory(_)) => report.ooms += 1,
                    Err(other) => return Err(other),
                }
            }
            TraceAction::FreeCompleted | TraceAction::Free | TraceAction::FreeRequested
                if (event.action == TraceAction::FreeRequested) == frees_on_request =>
            {
                free_traced(
                    allocator,
                    &mut live,
                    event.addr,
                    &mut report,
                    &mut requested_rounded,
                )?
            }
            _ => {}
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    let stats = allocator.memory_stats();
    report.peak_allocated_bytes = stats.allocated_bytes.all.peak as u64;
    report.peak_reserved_bytes = stats.reserved_bytes.all.peak as u64;
    report.device_allocs = stats.num_device_alloc as u64;
    report.device_frees = stats.num_device_free as u64;
    // The live allocations stay allocated (dropping a handle frees nothing): the caller may
    // snapshot the end state.
    drop(live);
    Ok(report)
}

fn free_traced<S: Storage>(
    allocator: &CachingAllocator<S>,
    live: &mut FxHashMap<u64, Allocation>,
    address: u64,
    report: &mut ReplayReport,
    requested_rounded: &mut u64,
) -> Result<(), AllocError> {
    match live.remove(&address) {
        Some(allocation) => {
            report.frees += 1;
            *requested_rounded -= allocation.requested().max(1).div_ceil(512) * 512;
            allocator.free(allocation)
        }
        None => {
            report.skipped_frees += 1;
            Ok(())
        }
    }
}
