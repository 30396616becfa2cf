//! Loops of identical steps: one steady step of a trace replayed twenty times on
//! `SimulatedStorage`, counting per step the pages mapped and unmapped and the waits for the
//! device (`num_sync_all_streams`), which on a GPU are what a step pays the allocator for.
//!
//! A step is a stretch of a trace that leaves the same blocks live (by recorded address and
//! size) as it found: the test checks that, so replaying it again frees exactly what it
//! allocated and what was live before it. The trace up to the step (the first step, optimizer
//! state included) is replayed once first.
//!
//! The loops are five corpus traces' and bench-memory's own: ViT-L/16 at batch 1 with fused
//! Adam, the step in backward and checkpointing, recorded on the CPU backend by `cargo xtask
//! bench-memory --trace` (their step 2 repeated: the bench's third warm-up step, then its timed
//! steps). At batch 1 most activations are small-pool blocks and the gradients large ones, so
//! each forward fills the small pool and each backward the large one.
//!
//! For every loop:
//! - the default policy settles: after its warm-up steps no step maps, unmaps or waits (the
//!   bench loops by their step 4, the first one bench-memory times);
//! - `reclaiming()` does not on six of them: it still moves pages between the same holes in
//!   the last steps, waiting for the device each time (why it is not the default);
//! - the default's peak reserved over the loop stays within its bound of the live peak (1.5%
//!   on the corpus loops, 4.5% on the bench loops, whose settled layout without any reclaiming
//!   is already 0.4% to 2.6% over it);
//! - the default still settles when live memory creeps up by a small block every step (a new
//!   live high every step, as when a loop keeps a little history).
//!
//! The test prints the per-step counts (`-- --nocapture`).

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;

use headroom_caching_allocator::{
    read_trace_tsv, Allocation, AllocatorConfig, CachingAllocator, SimulatedStorage, StreamId,
    TraceAction, TraceEvent,
};
use rustc_hash::FxHashMap;

/// An H200's memory as `cudaMemGetInfo` reports it.
const H200_BYTES: u64 = 150_754_820_096;

/// Steps replayed after the trace's start.
const N_STEPS: usize = 20;

/// Steps of a corpus loop the default may take to settle; every later step maps, unmaps and
/// waits for nothing.
const WARM_UP_STEPS: usize = 6;

/// Steps of a bench loop the default may take to settle: the loop starts at bench-memory's step
/// 2, and its step 4 (the first timed one) must map, unmap and wait for nothing.
const BENCH_WARM_UP_STEPS: usize = 2;

/// The last steps of a loop, where `reclaiming()` is checked for waits.
const LAST_STEPS: usize = 5;

/// The default's bound on peak reserved over the live peak in a corpus loop.
const SETTLED_OVER_LIVE: f64 = 1.015;

/// The default's bound on peak reserved over the live peak in a bench loop.
const BENCH_SETTLED_OVER_LIVE: f64 = 1.045;

/// A trace and the events of one of its steady steps, `[start, end)`.
struct Workload {
    file: &'static str,
    start: usize,
    end: usize,
    /// Whether `reclaiming()` still waits for the device in the last [`LAST_STEPS`] steps.
    reclaiming_churns: bool,
    /// Steps the default may take to settle.
    warm_up_steps: usize,
    /// The default's bound on peak reserved over the live peak.
    over_live: f64,
}

const WORKLOADS: [Workload; 8] = [
    Workload {
        file: "vit_l16_b32_adam_3steps.tsv.gz",
        start: 4_850,
        end: 8_808,
        reclaiming_churns: true,
        warm_up_steps: WARM_UP_STEPS,
        over_live: SETTLED_OVER_LIVE,
    },
    Workload {
        file: "vit_l16_b8_adam_3steps.tsv.gz",
        start: 4_850,
        end: 8_808,
        reclaiming_churns: true,
        warm_up_steps: WARM_UP_STEPS,
        over_live: SETTLED_OVER_LIVE,
    },
    Workload {
        file: "vit_b16_batch_change_adamw.tsv.gz",
        start: 6_498,
        end: 8_512,
        reclaiming_churns: true,
        warm_up_steps: WARM_UP_STEPS,
        over_live: SETTLED_OVER_LIVE,
    },
    Workload {
        file: "resnet50_sgd_b128_5steps.tsv.gz",
        start: 2_198,
        end: 3_910,
        reclaiming_churns: true,
        warm_up_steps: WARM_UP_STEPS,
        over_live: SETTLED_OVER_LIVE,
    },
    Workload {
        file: "llama_bf16_ckpt_adamw_8steps.tsv.gz",
        start: 6_825,
        end: 13_183,
        reclaiming_churns: false,
        warm_up_steps: WARM_UP_STEPS,
        over_live: SETTLED_OVER_LIVE,
    },
    // bench-memory's loops (testdata/README.md): building the model, step 1 (the optimizer's
    // state), then step 2 repeated.
    Workload {
        file: "bench_vit_l16_b1_adam_fused.tsv.gz",
        start: 2_567,
        end: 4_245,
        reclaiming_churns: true,
        warm_up_steps: BENCH_WARM_UP_STEPS,
        over_live: BENCH_SETTLED_OVER_LIVE,
    },
    Workload {
        file: "bench_vit_l16_b1_adam_inbwd.tsv.gz",
        start: 2_567,
        end: 4_245,
        reclaiming_churns: false,
        warm_up_steps: BENCH_WARM_UP_STEPS,
        over_live: BENCH_SETTLED_OVER_LIVE,
    },
    Workload {
        file: "bench_vit_l16_b1_adam_ckpt.tsv.gz",
        start: 3_173,
        end: 5_457,
        reclaiming_churns: true,
        warm_up_steps: BENCH_WARM_UP_STEPS,
        over_live: BENCH_SETTLED_OVER_LIVE,
    },
];

/// What one step asked of the storage and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StepCounts {
    maps: i64,
    unmaps: i64,
    syncs: i64,
}

/// A loop's per-step counts and figures.
struct LoopReport {
    steps: Vec<StepCounts>,
    peak_reserved: u64,
    peak_live: u64,
}

fn events(file: &str) -> Vec<TraceEvent> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/traces")
        .join(file);
    let reader = File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    read_trace_tsv(BufReader::new(reader)).expect("TSV")
}

/// The blocks live after `events`, by recorded address, with their requested sizes.
fn live_after(events: &[TraceEvent]) -> FxHashMap<u64, u64> {
    let mut live = FxHashMap::default();
    for event in events {
        match event.action {
            TraceAction::Alloc => {
                live.insert(event.addr, event.size);
            }
            TraceAction::FreeCompleted => {
                live.remove(&event.addr);
            }
            _ => {}
        }
    }
    live
}

/// The trace's live blocks by recorded address on one allocator.
struct Replay {
    allocator: CachingAllocator<SimulatedStorage>,
    live: FxHashMap<u64, Allocation>,
    live_rounded: u64,
    peak_live: u64,
}

impl Replay {
    fn run(&mut self, events: &[TraceEvent]) {
        for event in events {
            match event.action {
                TraceAction::Alloc => {
                    let allocation = self
                        .allocator
                        .allocate(event.size, StreamId(event.stream))
                        .expect("allocation");
                    self.live_rounded += event.size.max(1).div_ceil(512) * 512;
                    self.peak_live = self.peak_live.max(self.live_rounded);
                    let previous = self.live.insert(event.addr, allocation);
                    assert!(previous.is_none(), "{:#x} allocated twice", event.addr);
                }
                TraceAction::FreeCompleted => {
                    let allocation = self.live.remove(&event.addr).expect("a live block");
                    self.live_rounded -= allocation.requested().max(1).div_ceil(512) * 512;
                    self.allocator.free(allocation).expect("free");
                }
                _ => {}
            }
        }
    }
}

/// Replays the trace up to the step, then the step [`N_STEPS`] times, each time first allocating
/// `leaked_per_step` bytes that are never freed (none when 0).
fn replay_loop(
    config: AllocatorConfig,
    events: &[TraceEvent],
    workload: &Workload,
    leaked_per_step: u64,
) -> LoopReport {
    let mut replay = Replay {
        allocator: CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config),
        live: FxHashMap::default(),
        live_rounded: 0,
        peak_live: 0,
    };
    replay.run(&events[..workload.start]);
    let step = &events[workload.start..workload.end];
    let mut leaked = Vec::new();
    let steps = (0..N_STEPS)
        .map(|_| {
            let before = replay.allocator.memory_stats();
            if leaked_per_step > 0 {
                let allocation = replay
                    .allocator
                    .allocate(leaked_per_step, StreamId::DEFAULT)
                    .expect("allocation");
                replay.live_rounded += leaked_per_step.div_ceil(512) * 512;
                leaked.push(allocation);
            }
            replay.run(step);
            let after = replay.allocator.memory_stats();
            StepCounts {
                maps: after.num_device_alloc - before.num_device_alloc,
                unmaps: after.num_device_free - before.num_device_free,
                syncs: after.num_sync_all_streams - before.num_sync_all_streams,
            }
        })
        .collect();
    replay
        .allocator
        .check_invariants()
        .expect("consistent after the loop");
    LoopReport {
        steps,
        peak_reserved: replay.allocator.max_memory_reserved(),
        peak_live: replay.peak_live,
    }
}

fn describe(report: &LoopReport) -> String {
    let steps: Vec<String> = report
        .steps
        .iter()
        .map(|c| format!("{}/{}/{}", c.maps, c.unmaps, c.syncs))
        .collect();
    format!(
        "{:.4}× live; maps/unmaps/waits per step: {}",
        report.peak_reserved as f64 / report.peak_live as f64,
        steps.join(" ")
    )
}

#[test]
fn the_default_settles_in_a_loop_of_identical_steps() {
    let settled = StepCounts {
        maps: 0,
        unmaps: 0,
        syncs: 0,
    };
    let mut failures = Vec::new();
    for workload in &WORKLOADS {
        let events = events(workload.file);
        assert_eq!(
            live_after(&events[..workload.start]),
            live_after(&events[..workload.end]),
            "{}: events {}..{} are not a step that repeats",
            workload.file,
            workload.start,
            workload.end
        );
        let default = replay_loop(AllocatorConfig::default(), &events, workload, 0);
        let reclaiming = replay_loop(AllocatorConfig::reclaiming(), &events, workload, 0);
        let no_reclaim = AllocatorConfig::parse("reclaim_free_pages:False").expect("config");
        let no_reclaim = replay_loop(no_reclaim, &events, workload, 0);
        println!("{}", workload.file);
        println!("  default             {}", describe(&default));
        println!("  reclaiming()        {}", describe(&reclaiming));
        println!("  no reclaim          {}", describe(&no_reclaim));

        let late = &default.steps[workload.warm_up_steps..];
        if late.iter().any(|&counts| counts != settled) {
            failures.push(format!(
                "{}: the default still maps, unmaps or waits after {} steps",
                workload.file, workload.warm_up_steps
            ));
        }
        let over_live = default.peak_reserved as f64 / default.peak_live as f64;
        if over_live > workload.over_live {
            failures.push(format!(
                "{}: the default reserves {over_live:.4}× the live peak",
                workload.file
            ));
        }
        let reclaiming_late_syncs: i64 = reclaiming.steps[N_STEPS - LAST_STEPS..]
            .iter()
            .map(|counts| counts.syncs)
            .sum();
        if (reclaiming_late_syncs > 0) != workload.reclaiming_churns {
            failures.push(format!(
                "{}: reclaiming() waits {reclaiming_late_syncs} times in the last {LAST_STEPS} steps",
                workload.file
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A loop that leaks 4 KiB a step reaches a new live high every step: the default settles all
/// the same (its ceiling rises with every reclaim, not only with reclaims below the live high).
#[test]
fn the_default_settles_when_live_memory_creeps() {
    let mut failures = Vec::new();
    for workload in &WORKLOADS {
        let events = events(workload.file);
        let default = replay_loop(AllocatorConfig::default(), &events, workload, 4 << 10);
        println!("{}: default {}", workload.file, describe(&default));
        if default.steps[workload.warm_up_steps..]
            .iter()
            .any(|counts| counts.unmaps > 0 || counts.syncs > 0)
        {
            failures.push(format!(
                "{}: the default still unmaps or waits after {} steps",
                workload.file, workload.warm_up_steps
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
