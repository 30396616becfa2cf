//! PyTorch's own traces replayed through the policy: the classic policy must land where PyTorch
//! landed, and the default policy must leave almost nothing to fragmentation.
//!
//! `testdata/bert_varlen_adamw_30steps.tsv.gz`: BERT with AdamW, variable batch and sequence
//! length, 95,164 events; PyTorch 2.11 reported a peak reserved of 25,608,323,072 B with its
//! default settings, and the sum of live requests rounded to 512 B peaks at 14,851,701,760 B.

use std::fs::File;
use std::io::BufReader;

use headroom_caching_allocator::{
    read_pickle, read_trace_tsv, replay_trace, trace_events_from_snapshot, AllocatorConfig,
    CachingAllocator, ReplayReport, SimulatedStorage, TraceEvent,
};

const H200_BYTES: u64 = 150_754_820_096;
const TORCH_PEAK_RESERVED: f64 = 25_608_323_072.0;
const PEAK_LIVE_ROUNDED: u64 = 14_851_701_760;

fn testdata(name: &str) -> BufReader<File> {
    // From the crate's folder, or (a binary carried elsewhere) from the repo root.
    let path = format!("{}/../../testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    let file = File::open(&path).or_else(|_| File::open(format!("testdata/{name}")));
    BufReader::new(file.unwrap_or_else(|e| panic!("{path}: {e}")))
}

fn bert_events() -> Vec<TraceEvent> {
    read_trace_tsv(testdata("bert_varlen_adamw_30steps.tsv.gz")).expect("valid trace")
}

fn replay(config: AllocatorConfig, events: &[TraceEvent]) -> ReplayReport {
    let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
    let report = replay_trace(&allocator, events).expect("replay");
    allocator
        .check_invariants()
        .expect("consistent after replay");
    report
}

#[test]
fn bert_trace_classic_policy_matches_pytorch() {
    let events = bert_events();
    let report = replay(
        AllocatorConfig::parse("expandable_segments:False").unwrap(),
        &events,
    );
    assert_eq!(report.events, 95_164);
    assert_eq!(report.skipped_frees, 0);
    assert_eq!(report.ooms, 0);
    assert_eq!(report.peak_requested_rounded_bytes, PEAK_LIVE_ROUNDED);
    let ratio = report.peak_reserved_bytes as f64 / TORCH_PEAK_RESERVED;
    assert!(
        (ratio - 1.0).abs() <= 0.02,
        "classic peak reserved {} B is {ratio:.4}× PyTorch's",
        report.peak_reserved_bytes
    );
}

#[test]
fn bert_trace_default_policy_barely_fragments() {
    let events = bert_events();
    let report = replay(AllocatorConfig::default(), &events);
    assert_eq!(report.peak_requested_rounded_bytes, PEAK_LIVE_ROUNDED);
    let ratio = report.reserved_over_requested();
    assert!(
        ratio <= 1.01,
        "default peak reserved {} B is {ratio:.4}× the live peak",
        report.peak_reserved_bytes
    );
}

#[test]
fn pytorch_snapshot_trace_replays() {
    let snapshot = read_pickle(testdata("vit_l16_b8_adam_3steps.pickle")).expect("valid pickle");
    let events = trace_events_from_snapshot(&snapshot);
    assert_eq!(events.len(), 18_737);
    let report = replay(AllocatorConfig::pytorch_defaults(), &events);
    // Counted with Python's pickle module from the same file.
    assert_eq!(
        (report.allocs, report.frees, report.skipped_frees),
        (6_532, 5_937, 0)
    );
    eprintln!("vit replay: {report:?}");
}

/// A recording that starts mid-run frees blocks it never saw allocated: skipped and counted.
#[test]
fn frees_from_before_the_recording_are_skipped() {
    let events = bert_events();
    let report = replay(AllocatorConfig::default(), &events[40_000..]);
    assert!(report.skipped_frees > 0);
    assert_eq!(report.events, 55_164);
    assert_eq!(report.ooms, 0);
}
