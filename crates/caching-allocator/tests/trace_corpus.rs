//! The trace corpus (`testdata/traces/corpus.json`): every trace replayed through the classic
//! policy and the default one, against the figures PyTorch 2.11 reported for the same run on an
//! H200 with `expandable_segments:False` and with `True`.
//!
//! For every trace:
//! - the replay reads every event, frees nothing twice, runs out of memory nowhere, and its peak
//!   of live requests (each rounded up to 512 B) is the one the recording script computed;
//! - the classic policy reserves within ±0.5% of PyTorch's classic figure, and its peak
//!   allocated is within 0.1% of PyTorch's;
//! - the default policy reserves at most 1.01× the rounded live peak and no more than PyTorch's
//!   expandable segments did, and its peak allocated is within 0.1% of PyTorch's expandable run.
//!
//! The test prints the table (`-- --nocapture`) and checks every trace before failing, so a
//! failure shows the whole corpus.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;

use headroom_caching_allocator::{
    read_trace_tsv, replay_trace_at_recorded_addresses, AllocatorConfig, CachingAllocator, RecordedTrace, ReplayReport,
    SimulatedStorage,
};
use serde_json::Value;

/// An H200's memory as `cudaMemGetInfo` reports it.
const H200_BYTES: u64 = 150_754_820_096;

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
struct TorchFigures {
    allocated: u64,
    reserved: u64,
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

fn replay(config: AllocatorConfig, trace: &RecordedTrace) -> ReplayReport {
    let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
    let report = replay_trace_at_recorded_addresses(&allocator, trace).expect("replay");
    allocator
        .check_invariants()
        .expect("consistent after replay");
    report
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
        "{:<34} {:>7} {:>15} {:>15} {:>15} {:>15} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "trace",
        "events",
        "torch alloc",
        "live (512)",
        "torch classic",
        "torch ES",
        "t.cl/L",
        "t.ES/L",
        "ours.cl",
        "ours",
        "ours/L"
    );
    for entry in &corpus {
        let file = File::open(&entry.file)
            .unwrap_or_else(|e| panic!("{}: {e}", entry.file.display()));
        let trace = RecordedTrace::from_events(read_trace_tsv(BufReader::new(file)).expect("TSV"));
        let mut check = |ok: bool, what: String| {
            if !ok {
                failures.push(format!("{}: {what}", entry.name));
            }
        };
        // Recording began before anything was allocated: no baseline.
        check(
            trace.live_before.is_empty(),
            format!("{} blocks live before recording", trace.live_before.len()),
        );
        let classic = replay(AllocatorConfig::pytorch_defaults(), &trace);
        let default = replay(AllocatorConfig::default(), &trace);
        let torch_es = replay(AllocatorConfig::pytorch_expandable(), &trace);
        println!("EXACT {} classic {} vs {} | torch_es {} vs {} | alloc cl {} vs {} | alloc def {} vs {} | tes alloc {}", entry.name, classic.peak_reserved_bytes, entry.classic.reserved, torch_es.peak_reserved_bytes, entry.expandable.reserved, classic.peak_allocated_bytes, entry.classic.allocated, default.peak_allocated_bytes, entry.expandable.allocated, torch_es.peak_allocated_bytes);
        for (policy, report) in [("classic", &classic), ("default", &default)] {
            check(
                report.events == entry.events,
                format!("{policy}: {} events, not {}", report.events, entry.events),
            );
            check(
                (report.skipped_frees, report.ooms) == (0, 0),
                format!(
                    "{policy}: {} skipped frees, {} OOMs",
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
        let classic_reserved = ratio(classic.peak_reserved_bytes, entry.classic.reserved);
        check(
            (classic_reserved - 1.0).abs() <= 0.005,
            format!(
                "classic reserves {} B, {classic_reserved:.5}× PyTorch's {} B",
                classic.peak_reserved_bytes, entry.classic.reserved
            ),
        );
        for (policy, report, torch) in [
            ("classic", &classic, &entry.classic),
            ("default", &default, &entry.expandable),
        ] {
            let allocated = ratio(report.peak_allocated_bytes, torch.allocated);
            check(
                (allocated - 1.0).abs() <= 0.001,
                format!(
                    "{policy}: peak allocated {} B is {allocated:.5}× PyTorch's {} B",
                    report.peak_allocated_bytes, torch.allocated
                ),
            );
        }
        let over_live = default.reserved_over_requested();
        check(
            over_live <= 1.01,
            format!(
                "default reserves {} B, {over_live:.5}× the live peak",
                default.peak_reserved_bytes
            ),
        );
        check(
            default.peak_reserved_bytes <= entry.expandable.reserved,
            format!(
                "default reserves {} B, more than PyTorch's expandable segments ({} B)",
                default.peak_reserved_bytes, entry.expandable.reserved
            ),
        );
        println!(
            "{:<34} {:>7} {:>15} {:>15} {:>15} {:>15} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>7.4}",
            entry.name,
            entry.events,
            entry.classic.allocated,
            entry.peak_live_rounded,
            entry.classic.reserved,
            entry.expandable.reserved,
            ratio(entry.classic.reserved, entry.peak_live_rounded),
            ratio(entry.expandable.reserved, entry.peak_live_rounded),
            classic.reserved_over_requested(),
            default.peak_reserved_bytes as f64 / entry.expandable.reserved as f64,
            over_live,
        );
        println!(
            "    maps/unmaps: default {}/{}, classic segments {}",
            default.device_allocs, default.device_frees, classic.device_allocs
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
