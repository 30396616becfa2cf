//! The trace corpus (`testdata/traces/corpus.json`): every trace replayed through PyTorch's two
//! policies, the default one and [`AllocatorConfig::reclaiming`], against the figures PyTorch 2.11 reported for the same run on an
//! H200 with `expandable_segments:False` and with `True` (`scripts/traces/record.py`).
//!
//! For every trace:
//! - the replay reads every event, frees nothing twice, runs out of memory nowhere, starts from
//!   nothing (the recording began before the first allocation), and its peak of live requests
//!   (each rounded up to 512 B) is the one the recording script computed;
//! - the classic policy (`expandable_segments:False`), with its segments placed at the recorded
//!   addresses, reaches PyTorch's classic peak reserved and peak allocated to the byte (the issue
//!   asks for ±0.5% and 0.1%);
//! - PyTorch's expandable policy ([`AllocatorConfig::pytorch_expandable`]) reaches PyTorch's
//!   expandable peak reserved and peak allocated to the byte;
//! - the default policy (2 MiB pages, settling reclaims) and `reclaiming()` reserve no more than
//!   PyTorch's expandable segments did, and their peak allocated is PyTorch's expandable one;
//! - both reserve at most 1.01× the rounded live peak;
//! - the default with 8 MiB handles (`expandable_handle_size_mb:8`, the PyTorch plugin's
//!   default) replays cleanly, reserves at most 1.01× what the default does and creates at most
//!   half of its physical handles (the cost of mapping on a GPU).
//!
//! The table's `waits` columns count the waits for the device (`num_sync_all_streams`) each of
//! the two spent reclaiming; `tests/steady_state.rs` checks that the default's stop in a loop.
//!
//! The test prints the table (`-- --nocapture`) and checks every trace before failing, so a
//! failure shows the whole corpus.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;

use headroom_caching_allocator::{
    read_trace_tsv, replay_trace_at_recorded_addresses, AllocatorConfig, CachingAllocator,
    RecordedTrace, ReplayReport, SimulatedStorage,
};
use serde_json::Value;

/// An H200's memory as `cudaMemGetInfo` reports it.
const H200_BYTES: u64 = 150_754_820_096;

/// The default's and `reclaiming()`'s bound on peak reserved over the rounded live peak.
const OVER_LIVE: f64 = 1.01;

/// The bound on peak reserved with `expandable_handle_size_mb:8` over the default's (2 MiB
/// handles): only whole handles unmap, so reclaims find less (ViT-L/16 at batch 32 is the
/// corpus's worst, at 1.0088).
const LARGE_HANDLES_OVER_DEFAULT: f64 = 1.01;

/// The default policy with physical handles of up to 8 MiB (the PyTorch plugin's default).
fn large_handle_config() -> AllocatorConfig {
    AllocatorConfig::builder()
        .expandable_handle_size_mb(8)
        .build()
        .expect("a valid handle size")
}

fn testdata_dir() -> PathBuf {
    // From the crate's folder, or (a binary carried elsewhere) from the repo root.
    let from_crate = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
    if from_crate.is_dir() {
        from_crate
    } else {
        PathBuf::from("testdata")
    }
}

/// One trace of the manifest with PyTorch's figures.
struct CorpusTrace {
    name: String,
    file: PathBuf,
    events: u64,
    peak_live_rounded: u64,
    classic: TorchFigures,
    expandable: TorchFigures,
}

/// `torch.cuda.memory_stats()`'s peaks for one run.
#[derive(Debug, PartialEq)]
struct TorchFigures {
    allocated: u64,
    reserved: u64,
}

impl TorchFigures {
    fn of(report: &ReplayReport) -> TorchFigures {
        TorchFigures {
            allocated: report.peak_allocated_bytes,
            reserved: report.peak_reserved_bytes,
        }
    }
}

fn corpus() -> Vec<CorpusTrace> {
    let dir = testdata_dir();
    let path = dir.join("traces/corpus.json");
    let manifest: Value = serde_json::from_reader(BufReader::new(
        File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    ))
    .expect("valid manifest");
    let number = |value: &Value, key: &str| {
        value[key]
            .as_u64()
            .unwrap_or_else(|| panic!("manifest: `{key}` is not a number in {value}"))
    };
    let figures = |value: &Value| TorchFigures {
        allocated: number(value, "peak_allocated_bytes"),
        reserved: number(value, "peak_reserved_bytes"),
    };
    manifest["traces"]
        .as_array()
        .expect("a list of traces")
        .iter()
        .map(|trace| CorpusTrace {
            name: trace["name"].as_str().expect("a name").to_owned(),
            file: dir.join(trace["file"].as_str().expect("a file")),
            events: number(trace, "events"),
            peak_live_rounded: number(trace, "peak_live_rounded_bytes"),
            classic: figures(&trace["pytorch"]["classic"]),
            expandable: figures(&trace["pytorch"]["expandable"]),
        })
        .collect()
}

/// A replay's report and its waits for the device.
fn replay(config: AllocatorConfig, trace: &RecordedTrace) -> (ReplayReport, i64) {
    let (report, waits, _) = replay_counting_handles(config, trace);
    (report, waits)
}

/// A replay's report, its waits for the device and the physical handles its maps created.
fn replay_counting_handles(
    config: AllocatorConfig,
    trace: &RecordedTrace,
) -> (ReplayReport, i64, u64) {
    let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
    let report = replay_trace_at_recorded_addresses(&allocator, trace).expect("replay");
    allocator
        .check_invariants()
        .expect("consistent after replay");
    let handles = allocator.with_storage(|storage| storage.handles_mapped());
    (
        report,
        allocator.memory_stats().num_sync_all_streams,
        handles,
    )
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b as f64
}

#[test]
fn every_corpus_trace_meets_the_figures() {
    let corpus = corpus();
    assert!(corpus.len() >= 8, "the corpus has {} traces", corpus.len());
    let mut failures = Vec::new();
    println!(
        "{:<33} {:>7} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14} {:>7} {:>7} {:>7} {:>7} {:>7} {:>6} {:>6} {:>7} {:>7} {:>6}",
        "trace",
        "events",
        "live (512)",
        "torch classic",
        "torch ES",
        "ours classic",
        "ours default",
        "reclaiming",
        "ES/L",
        "def/L",
        "def/ES",
        "recl/L",
        "recl/ES",
        "waits",
        "recl",
        "8M/def",
        "handles",
        "8M h"
    );
    for entry in &corpus {
        let file =
            File::open(&entry.file).unwrap_or_else(|e| panic!("{}: {e}", entry.file.display()));
        let trace = RecordedTrace::from_events(read_trace_tsv(BufReader::new(file)).expect("TSV"));
        let mut check = |ok: bool, what: String| {
            if !ok {
                failures.push(format!("{}: {what}", entry.name));
            }
        };
        check(
            trace.live_before.is_empty(),
            format!("{} blocks live before recording", trace.live_before.len()),
        );
        let (classic, _) = replay(AllocatorConfig::pytorch_defaults(), &trace);
        let (torch_expandable, _) = replay(AllocatorConfig::pytorch_expandable(), &trace);
        let (default, default_waits, default_handles) =
            replay_counting_handles(AllocatorConfig::default(), &trace);
        let (large_handles, _, large_handle_count) =
            replay_counting_handles(large_handle_config(), &trace);
        let (reclaiming, reclaiming_waits) = replay(AllocatorConfig::reclaiming(), &trace);
        for (policy, report) in [
            ("classic", &classic),
            ("PyTorch's expandable", &torch_expandable),
            ("default", &default),
            ("reclaiming", &reclaiming),
            ("8 MiB handles", &large_handles),
        ] {
            check(
                report.events == entry.events,
                format!("{policy}: {} events, not {}", report.events, entry.events),
            );
            check(
                (report.skipped_frees, report.ooms) == (0, 0),
                format!(
                    "{policy}: {} frees not replayed, {} OOMs",
                    report.skipped_frees, report.ooms
                ),
            );
            check(
                report.peak_requested_rounded_bytes == entry.peak_live_rounded,
                format!(
                    "{policy}: live peak {} B, not {} B",
                    report.peak_requested_rounded_bytes, entry.peak_live_rounded
                ),
            );
        }
        for (policy, report, torch) in [
            ("classic", &classic, &entry.classic),
            ("PyTorch's expandable", &torch_expandable, &entry.expandable),
        ] {
            let ours = TorchFigures::of(report);
            check(
                ours == *torch,
                format!("{policy} policy reaches {ours:?}, PyTorch {torch:?}"),
            );
        }
        for (policy, report) in [("default", &default), ("reclaiming", &reclaiming)] {
            check(
                report.peak_allocated_bytes == entry.expandable.allocated,
                format!(
                    "{policy}: peak allocated {} B, PyTorch's expandable run {} B",
                    report.peak_allocated_bytes, entry.expandable.allocated
                ),
            );
            check(
                report.peak_reserved_bytes <= entry.expandable.reserved,
                format!(
                    "{policy} reserves {} B, more than PyTorch's expandable segments ({} B)",
                    report.peak_reserved_bytes, entry.expandable.reserved
                ),
            );
        }
        for (policy, report) in [("default", &default), ("reclaiming", &reclaiming)] {
            let over_live = report.reserved_over_requested();
            check(
                over_live <= OVER_LIVE,
                format!(
                    "{policy} reserves {} B, {over_live:.5}× the live peak",
                    report.peak_reserved_bytes
                ),
            );
        }
        let over_default = ratio(
            large_handles.peak_reserved_bytes,
            default.peak_reserved_bytes,
        );
        check(
            over_default <= LARGE_HANDLES_OVER_DEFAULT,
            format!("8 MiB handles reserve {over_default:.4}× the default's"),
        );
        check(
            large_handle_count * 2 <= default_handles,
            format!("8 MiB handles: {large_handle_count} handles, 2 MiB: {default_handles}"),
        );
        println!(
            "{:<33} {:>7} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>6} {:>6} {:>7.4} {:>7} {:>6}",
            entry.name,
            entry.events,
            entry.peak_live_rounded,
            entry.classic.reserved,
            entry.expandable.reserved,
            classic.peak_reserved_bytes,
            default.peak_reserved_bytes,
            reclaiming.peak_reserved_bytes,
            ratio(entry.expandable.reserved, entry.peak_live_rounded),
            default.reserved_over_requested(),
            ratio(default.peak_reserved_bytes, entry.expandable.reserved),
            reclaiming.reserved_over_requested(),
            ratio(reclaiming.peak_reserved_bytes, entry.expandable.reserved),
            default_waits,
            reclaiming_waits,
            ratio(large_handles.peak_reserved_bytes, default.peak_reserved_bytes),
            default_handles,
            large_handle_count,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
