//! `cargo xtask replay-trace`: a PyTorch allocator trace through Headroom's allocator.
//!
//! Reads a TSV trace (gzipped or not) or a PyTorch snapshot (pickle or JSON), replays its
//! `alloc` / `free_completed` sequence on [`SimulatedStorage`] with the settings given, and
//! prints the figures of [`headroom_caching_allocator::ReplayReport`] as text or one JSON
//! object. Segments are placed at the recorded addresses where they fit
//! ([`replay_trace_at_recorded_addresses`]), so the classic policy replays PyTorch's classic run
//! to the byte. `--corpus` replays every trace of `testdata/traces/corpus.json` through
//! PyTorch's two policies and the default one and prints them against PyTorch's figures.
//!
//! The replay starts from the baseline, the blocks live before the recording began (see
//! [`RecordedTrace`]): a snapshot's active blocks that its history never allocates, and, in any
//! input, the blocks the trace frees without having allocated them. Its peaks include them, as
//! PyTorch's do.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use headroom_caching_allocator::{
    read_json, read_pickle, read_trace_tsv, replay_trace_at_recorded_addresses, write_pickle,
    AllocatorConfig, CachingAllocator, HistoryOptions, RecordedTrace, ReplayReport,
    SimulatedStorage,
};

use crate::output_paths;

/// An H200's memory as `cudaMemGetInfo` reports it.
const H200_BYTES: u64 = 150_754_820_096;

/// A PyTorch allocator trace through Headroom's caching allocator on simulated memory.
#[derive(Debug, Clone, clap::Args)]
#[command(long_about = LONG_ABOUT)]
pub(crate) struct Args {
    /// The trace: .tsv, .tsv.gz, or a snapshot .pickle or .json.
    #[arg(value_name = "FILE", required_unless_present = "corpus")]
    file: Option<PathBuf>,
    /// Replays every trace of testdata/traces/corpus.json instead (see below).
    #[arg(long, conflicts_with_all = ["file", "conf", "capacity", "snapshot", "repeat"])]
    corpus: bool,
    /// Allocator settings in PYTORCH_CUDA_ALLOC_CONF's syntax (default: HEADROOM_ALLOC_CONF,
    /// else Headroom's defaults).
    #[arg(long, value_name = "STRING")]
    conf: Option<String>,
    /// The simulated device's bytes (the default is an H200's).
    #[arg(long, value_name = "BYTES", default_value_t = H200_BYTES)]
    capacity: u64,
    /// Prints one JSON object (with --corpus, one JSON line per trace).
    #[arg(long)]
    json: bool,
    /// Records history during one more replay and writes the final snapshot as a pickle (the
    /// baseline shows as the first allocations, labelled `live before recording`).
    #[arg(long, value_name = "OUT.pickle")]
    snapshot: Option<PathBuf>,
    /// Events per second are the best of N replays.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
}

const LONG_ABOUT: &str = "A PyTorch allocator trace through Headroom's caching allocator on \
     simulated memory.\n\n\
     Replays a PyTorch allocator trace (.tsv, .tsv.gz, or a snapshot .pickle or .json) through \
     Headroom's caching allocator on simulated memory and prints what it measured. Segments \
     land at the recorded addresses where they fit, as the device placed them. The replay \
     starts from the baseline: the blocks live before recording began (a snapshot's active \
     blocks its history never allocates, e.g. the parameters, and the blocks a trace frees \
     without having allocated them), allocated first with their requested sizes and streams; \
     peaks include it, and the report states its bytes.\n\n\
     --corpus replays every trace of testdata/traces/corpus.json (recorded by \
     scripts/traces/record.py) through PyTorch's classic and expandable policies and the \
     default one, and prints each peak reserved next to PyTorch's, with the ratios to the peak \
     of live requests rounded to 512 B; with --json, one JSON line per trace: PyTorch's figures \
     and each replay's report, waits and physical handles (classic, PyTorch's expandable, the \
     default, reclaiming(), the default with 8 and 32 MiB handles), what the allocator \
     README's corpus tables render from (`cargo xtask tables`).";

/// The options of one trace's replay.
struct Options {
    file: PathBuf,
    conf: Option<String>,
    capacity: u64,
    json: bool,
    snapshot: Option<PathBuf>,
    repeat: u32,
}

impl Options {
    /// The options of `args`, which name a trace (not `--corpus`).
    fn new(args: Args) -> Result<Options> {
        Ok(Options {
            file: args.file.context("replay-trace needs a trace file")?,
            conf: args.conf,
            capacity: args.capacity,
            json: args.json,
            snapshot: args.snapshot,
            repeat: args.repeat,
        })
    }
}

/// `cargo xtask replay-trace ARGS`.
pub(crate) fn run(args: Args) -> Result<()> {
    if args.corpus {
        let testdata = crate::project_root().join("testdata");
        return if args.json {
            print_corpus_json(&testdata)
        } else {
            print_corpus(&testdata)
        };
    }
    let options = Options::new(args)?;
    if let Some(path) = &options.snapshot {
        output_paths::check_file("--snapshot", path)?;
    }
    let (report, allocator) = replay(&options)?;
    if options.json {
        println!("{}", json_report(&options, &allocator, &report));
    } else {
        println!("trace                  {}", options.file.display());
        println!(
            "settings               {}",
            allocator.config().to_conf_string()
        );
        println!("events                 {}", report.events);
        println!(
            "live before recording  {} B allocated ({} blocks, {} B requested; {} of them freed \
             by the trace)",
            report.baseline_bytes,
            report.baseline_blocks,
            report.baseline_requested_bytes,
            report.baseline_freed_blocks
        );
        println!(
            "allocs / frees         {} / {} ({} frees of addresses already freed left out, {} \
             OOMs)",
            report.allocs, report.frees, report.skipped_frees, report.ooms
        );
        println!(
            "peak allocated         {} B (the baseline included)",
            report.peak_allocated_bytes
        );
        println!("peak reserved          {} B", report.peak_reserved_bytes);
        println!(
            "peak live (512-rounded) {} B",
            report.peak_requested_rounded_bytes
        );
        println!(
            "reserved / live        {:.4}",
            report.reserved_over_requested()
        );
        println!(
            "device allocs / frees  {} / {}",
            report.device_allocs, report.device_frees
        );
        println!(
            "events per second      {:.0} (best of {} replays)",
            report.events_per_second(),
            options.repeat
        );
    }
    if let Some(path) = &options.snapshot {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        write_pickle(&allocator.snapshot(), std::io::BufWriter::new(file))?;
        if !options.json {
            println!("snapshot written to    {}", path.display());
        }
    }
    Ok(())
}

/// Reads `path` as a snapshot (`.pickle`, `.pkl`, `.json`) or a TSV trace (anything else,
/// gzipped or not), with its baseline.
fn read_trace(path: &Path) -> Result<RecordedTrace> {
    let reader =
        BufReader::new(File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let extension = path.extension().and_then(|ext| ext.to_str());
    Ok(match extension {
        Some("pickle" | "pkl") => RecordedTrace::from_snapshot(&read_pickle(reader)?),
        Some("json") => RecordedTrace::from_snapshot(&read_json(reader)?),
        _ => RecordedTrace::from_events(read_trace_tsv(reader)?),
    })
}

/// Replays the options' trace `repeat` times and returns the report (its time the best) and
/// the last allocator: with `--snapshot`, one that recorded the replay's history.
fn replay(options: &Options) -> Result<(ReplayReport, CachingAllocator<SimulatedStorage>)> {
    let trace = read_trace(&options.file)?;
    let config = match &options.conf {
        Some(conf) => AllocatorConfig::parse(conf).with_context(|| format!("--conf {conf:?}"))?,
        None => crate::allocator_config_from_env()?,
    };
    // Throughput is the best of `repeat` replays, each on a fresh allocator (the first one also
    // pays for page faults and cold caches); the figures other than time are identical.
    let mut report = None;
    let mut allocator = None;
    for _ in 0..options.repeat {
        let fresh = CachingAllocator::new(SimulatedStorage::new(options.capacity), config.clone());
        let run = replay_trace_at_recorded_addresses(&fresh, &trace)?;
        let best = report.get_or_insert_with(|| run.clone());
        best.seconds = best.seconds.min(run.seconds);
        allocator = Some(fresh);
    }
    let (Some(report), Some(mut allocator)) = (report, allocator) else {
        bail!("--repeat must be at least 1");
    };
    if options.snapshot.is_some() {
        // One more replay with history recorded, for the snapshot.
        allocator = CachingAllocator::new(SimulatedStorage::new(options.capacity), config);
        allocator.record_history(Some(HistoryOptions::default()));
        replay_trace_at_recorded_addresses(&allocator, &trace)?;
    }
    Ok((report, allocator))
}

/// The path of `testdata/traces/corpus.json` and its `traces` list (each entry a trace's file
/// and PyTorch's figures).
fn corpus_traces(testdata: &Path) -> Result<(PathBuf, Vec<serde_json::Value>)> {
    let path = testdata.join("traces/corpus.json");
    let mut manifest: serde_json::Value = serde_json::from_reader(BufReader::new(
        File::open(&path).with_context(|| format!("opening {}", path.display()))?,
    ))
    .with_context(|| format!("reading {}", path.display()))?;
    match manifest["traces"].take() {
        serde_json::Value::Array(traces) => Ok((path, traces)),
        _ => bail!("{}: no `traces` list", path.display()),
    }
}

/// `--corpus`: every trace of `testdata/traces/corpus.json` through PyTorch's classic and
/// expandable policies and the default one, one row each, against PyTorch's figures.
fn print_corpus(testdata: &Path) -> Result<()> {
    let (path, traces) = corpus_traces(testdata)?;
    println!(
        "{:<33} {:>7} {:>15} {:>15} {:>15} {:>15} {:>15} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "trace",
        "events",
        "peak allocated",
        "live (512)",
        "torch classic",
        "torch ES",
        "ours default",
        "cl./L",
        "ES/L",
        "ours/L",
        "ours/ES",
        "recl./L"
    );
    for entry in &traces {
        let field = |key: &str| {
            entry[key]
                .as_str()
                .with_context(|| format!("{}: a trace without `{key}`", path.display()))
        };
        let figure = |mode: &str, key: &str| {
            entry["pytorch"][mode][key]
                .as_u64()
                .with_context(|| format!("{}: no pytorch.{mode}.{key} for a trace", path.display()))
        };
        let file = testdata.join(field("file")?);
        let trace = read_trace(&file)?;
        let replay = |config: AllocatorConfig| -> Result<ReplayReport> {
            let allocator = CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config);
            Ok(replay_trace_at_recorded_addresses(&allocator, &trace)?)
        };
        let classic = replay(AllocatorConfig::pytorch_defaults())?;
        let default = replay(AllocatorConfig::default())?;
        let reclaiming = replay(AllocatorConfig::reclaiming())?;
        let live = default.peak_requested_rounded_bytes as f64;
        let torch_es = figure("expandable", "peak_reserved_bytes")?;
        println!(
            "{:<33} {:>7} {:>15} {:>15} {:>15} {:>15} {:>15} {:>8.4} {:>8.4} {:>8.4} {:>8.4} {:>8.4}",
            field("name")?,
            default.events,
            figure("classic", "peak_allocated_bytes")?,
            default.peak_requested_rounded_bytes,
            figure("classic", "peak_reserved_bytes")?,
            torch_es,
            default.peak_reserved_bytes,
            classic.peak_reserved_bytes as f64 / live,
            torch_es as f64 / live,
            default.peak_reserved_bytes as f64 / live,
            default.peak_reserved_bytes as f64 / torch_es as f64,
            reclaiming.peak_reserved_bytes as f64 / live,
        );
    }
    println!(
        "L: the peak of live requests rounded to 512 B (live); cl./L: the classic policy's peak \
         reserved over it (PyTorch's to the byte), ES/L: PyTorch's expandable segments', ours/L: \
         the default policy's; ours/ES: the default's peak reserved over PyTorch's expandable; \
         recl./L: AllocatorConfig::reclaiming()'s over the live peak"
    );
    Ok(())
}

/// `--corpus --json`: one line per trace of `testdata/traces/corpus.json`, with the manifest's
/// figures (PyTorch's) and, per policy, the replay's report, its waits for the device
/// (`num_sync_all_streams`) and the physical handles its maps created.
fn print_corpus_json(testdata: &Path) -> Result<()> {
    let (path, traces) = corpus_traces(testdata)?;
    let with_handles = |mib: u64| -> Result<AllocatorConfig> {
        Ok(AllocatorConfig::builder()
            .expandable_handle_size_mb(mib)
            .build()?)
    };
    let policies = [
        ("classic", AllocatorConfig::pytorch_defaults()),
        ("pytorch_expandable", AllocatorConfig::pytorch_expandable()),
        ("default", AllocatorConfig::default()),
        ("reclaiming", AllocatorConfig::reclaiming()),
        ("default_8mib_handles", with_handles(8)?),
        ("default_32mib_handles", with_handles(32)?),
    ];
    for entry in &traces {
        let file = entry["file"]
            .as_str()
            .with_context(|| format!("{}: a trace without `file`", path.display()))?;
        let trace = read_trace(&testdata.join(file))?;
        let mut replays = serde_json::Map::new();
        for (policy, config) in &policies {
            let allocator =
                CachingAllocator::new(SimulatedStorage::new(H200_BYTES), config.clone());
            let report = replay_trace_at_recorded_addresses(&allocator, &trace)?;
            let options = Options {
                file: Path::new("testdata").join(file),
                conf: None,
                capacity: H200_BYTES,
                json: true,
                snapshot: None,
                repeat: 1,
            };
            let mut value = json_report(&options, &allocator, &report);
            value["waits"] = allocator.memory_stats().num_sync_all_streams.into();
            value["handles"] = allocator
                .with_storage(|storage| storage.handles_mapped())
                .into();
            replays.insert((*policy).to_owned(), value);
        }
        let line = serde_json::json!({
            "name": entry["name"],
            "file": file,
            "events": entry["events"],
            "peak_live_rounded_bytes": entry["peak_live_rounded_bytes"],
            "pytorch": entry["pytorch"],
            "replays": replays,
        });
        println!("{line}");
    }
    Ok(())
}

/// The `--json` object.
fn json_report(
    options: &Options,
    allocator: &CachingAllocator<SimulatedStorage>,
    report: &ReplayReport,
) -> serde_json::Value {
    serde_json::json!({
        "file": options.file.display().to_string(),
        "conf": allocator.config().to_conf_string(),
        "expandable_segments": allocator.uses_expandable_segments(),
        "events": report.events,
        "baseline_blocks": report.baseline_blocks,
        "baseline_freed_blocks": report.baseline_freed_blocks,
        "baseline_bytes": report.baseline_bytes,
        "baseline_requested_bytes": report.baseline_requested_bytes,
        "allocs": report.allocs,
        "frees": report.frees,
        "skipped_frees": report.skipped_frees,
        "ooms": report.ooms,
        "peak_allocated_bytes": report.peak_allocated_bytes,
        "peak_reserved_bytes": report.peak_reserved_bytes,
        "peak_requested_rounded_bytes": report.peak_requested_rounded_bytes,
        "reserved_over_requested": report.reserved_over_requested(),
        "device_allocs": report.device_allocs,
        "device_frees": report.device_frees,
        "seconds": report.seconds,
        "events_per_second": report.events_per_second(),
        "repeat": options.repeat,
    })
}

#[cfg(test)]
mod tests {
    use headroom_caching_allocator::write_json;

    use super::*;

    /// `replay-trace` with `words` after it, parsed as the binary parses it.
    fn parse(words: &[&str]) -> Result<Options> {
        let words: Vec<&str> = std::iter::once("replay-trace")
            .chain(words.iter().copied())
            .collect();
        match crate::parse_command_line(&words)? {
            crate::Command::ReplayTrace(args) => Options::new(args),
            other => bail!("parsed as {other:?}"),
        }
    }

    /// A trace file or `--corpus`, not both; `--repeat` at least 1.
    #[test]
    fn the_command_line_names_a_trace_or_the_corpus() {
        let options = parse(&["trace.tsv", "--repeat", "2", "--capacity", "4096"]).unwrap();
        assert_eq!(options.file, PathBuf::from("trace.tsv"));
        assert_eq!((options.repeat, options.capacity), (2, 4096));
        for (bad, message) in [
            (
                &[][..],
                "the following required arguments were not provided",
            ),
            (&["a.tsv", "--corpus"], "cannot be used with"),
            (&["--corpus", "--repeat", "2"], "cannot be used with"),
            (
                &["a.tsv", "--repeat", "0"],
                "invalid value '0' for '--repeat <N>'",
            ),
            (&["a.tsv", "b.tsv"], "unexpected argument 'b.tsv'"),
        ] {
            let err = format!("{:#}", parse(bad).err().unwrap());
            assert!(err.contains(message), "{bad:?}: {err}");
        }
        let corpus = crate::parse_command_line(&["replay-trace", "--corpus", "--json"]).unwrap();
        assert!(
            matches!(
                corpus,
                crate::Command::ReplayTrace(Args {
                    corpus: true,
                    json: true,
                    ..
                })
            ),
            "{corpus:?}"
        );
    }

    /// A snapshot reads the same from PyTorch's pickle and from our JSON, baseline included.
    #[test]
    fn a_json_snapshot_reads_as_its_pickle_with_the_same_baseline() {
        let dir = std::env::temp_dir().join(format!("headroom-replay-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pickle = crate::project_root().join("testdata/vit_l16_b8_adam_3steps.pickle");
        let snapshot = read_pickle(BufReader::new(File::open(&pickle).unwrap())).unwrap();
        let json = dir.join("vit.json");
        write_json(
            &snapshot,
            std::io::BufWriter::new(File::create(&json).unwrap()),
        )
        .unwrap();
        let from_pickle = read_trace(&pickle).unwrap();
        assert_eq!(from_pickle.live_before.len(), 297);
        assert_eq!(read_trace(&json).unwrap(), from_pickle);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A TSV trace that frees a block it never allocated: the JSON report states it as the
    /// baseline, and the peak includes it.
    #[test]
    fn the_json_report_states_the_baseline_of_a_tsv_trace() {
        let dir = std::env::temp_dir().join(format!("headroom-replay-tsv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tsv = dir.join("trace.tsv");
        std::fs::write(
            &tsv,
            "action\taddr\tsize\n\
             alloc\t4096\t3000\n\
             free_completed\t65536\t30000000\n\
             free_completed\t4096\t3000\n",
        )
        .unwrap();
        let options = parse(&[
            tsv.to_str().unwrap(),
            "--conf",
            "expandable_segments:False",
            "--repeat",
            "1",
            "--json",
        ])
        .unwrap();
        let (report, allocator) = replay(&options).unwrap();
        let json = json_report(&options, &allocator, &report);
        // 30,000,000 bytes rounded up to 512; its segment, rounded up to 2 MiB (31,457,280 B),
        // has more than 1 MiB left over, so the block is split and holds just that.
        assert_eq!(json["baseline_blocks"], 1);
        assert_eq!(json["baseline_freed_blocks"], 1);
        assert_eq!(json["baseline_requested_bytes"], 30_000_000);
        assert_eq!(json["baseline_bytes"], 30_000_128);
        assert_eq!(json["peak_allocated_bytes"], 30_000_128 + 3072);
        assert_eq!(
            (json["allocs"].clone(), json["frees"].clone()),
            (1.into(), 2.into())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
