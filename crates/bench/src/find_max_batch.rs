//! `cargo xtask find-max-batch`: the largest batch each `bench-memory` case trains at under a
//! memory cap that the allocator enforces (`per_process_memory_fraction`, as PyTorch's
//! `torch.cuda.set_per_process_memory_fraction`).
//!
//! Per case, one model and optimizer are built; a step at batch 1 creates the optimizer's state,
//! and the allocated bytes after it are the case's baseline. Each probe is one training step at
//! one batch (input built, forward, backward, step, `zero_grad(set_to_none)`): it fits, or
//! fails with the allocator's typed out-of-memory error (`AllocError::OutOfMemory`, found in the
//! error's chain), which is caught; any other error stops the command. After every probe the
//! gradients are set to none, the cache is emptied (each probe starts from the same state, as
//! the recipe's `empty_cache` does) and the allocator must hold exactly the baseline's bytes:
//! otherwise the probe leaked, and the command fails naming it. The search ([`search`]) doubles
//! the batch through the small, cheap batches, then probes where the line through the measured
//! allocated peaks (linear in the batch) reaches the cap, gallops from there until the largest
//! batch that fits and the smallest that does not are bracketed, and bisects the rest. The
//! result is exact: the largest batch fits and the next one does not.
//!
//! Its options are [`command_line`]'s. It sits on `bench_memory`'s models, cases and training
//! loop and on the backends' caching allocators; it knows nothing about how `bench-memory`
//! reports.

mod command_line;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use headroom_autograd_core::TensorError;
use headroom_caching_allocator::{
    AllocError, AllocatorConfig, CachingAllocator, CudaStorage, HostStorage, Storage,
    ALLOC_CONF_ENV,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use serde_json::{json, Value};

use crate::bench_memory::cases::Case;
use crate::bench_memory::measure::Protocol;
use crate::bench_memory::models::{Input, Model};
use crate::bench_memory::training::{Probe, Training};
use crate::bench_memory::DeviceChoice;
use crate::output_paths;
pub(crate) use command_line::Args;
use command_line::{Options, CPU_DEFAULT_CAP_MIB, CUDA_DEFAULT_CAP_MIB};

/// `cargo xtask find-max-batch ARGS`: checks the output path, then searches.
pub(crate) fn run(args: Args, command: String) -> Result<()> {
    let options = Options::new(args, command)?;
    if let Some(path) = &options.json {
        output_paths::check_file("--json", path)?;
    }
    execute(&options).map(|_| ())
}

/// What the search found for one case.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub(crate) case: Case,
    pub(crate) model: &'static str,
    /// The largest batch that fits (0: not even batch 1).
    pub(crate) max_batch: usize,
    /// Peak allocated and reserved bytes of the step at `max_batch`, and its time (one step on an
    /// emptied cache); [`Peaks::NONE`] when not even batch 1 fits.
    pub(crate) at_max: Peaks,
    /// Probes that ran out of memory.
    pub(crate) ooms: usize,
    /// Every probe, in order.
    pub(crate) probes: Vec<Probed>,
    /// Each probe's wall time in seconds (input, step, clean-up), in the order of `probes`.
    pub(crate) probe_seconds: Vec<f64>,
    /// Wall time of building the model and optimizer.
    pub(crate) build_seconds: f64,
    /// Wall time of the whole search, model building included.
    pub(crate) seconds: f64,
}

/// One probe's outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Probed {
    pub(crate) batch: usize,
    /// `None`: out of memory.
    pub(crate) peaks: Option<Peaks>,
}

/// The peaks and time of a step that fit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Peaks {
    pub(crate) allocated: u64,
    pub(crate) reserved: u64,
    /// Peak reserved pinned host memory (`None`: a backend without any, the CPU's).
    pub(crate) host_reserved: Option<u64>,
    pub(crate) step_ms: f64,
}

impl Peaks {
    /// What a search records where no batch fits: no bytes, no time.
    pub(crate) const NONE: Peaks = Peaks {
        allocated: 0,
        reserved: 0,
        host_reserved: None,
        step_ms: f64::NAN,
    };
}

/// Runs the search for every case on the device the options pick and prints the table.
fn execute(options: &Options) -> Result<Vec<Found>> {
    let started = Instant::now();
    let pytorch = match &options.pytorch {
        Some(path) => crate::read_parsed(path, parse_pytorch)?,
        None => Vec::new(),
    };
    // Read before any device: a malformed value names the variable, on the CPU too.
    let allocator_config = crate::allocator_config_from_env()?;
    let cuda = match options.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => CudaStorage::new(0).is_ok(),
    };
    let cases = cases_to_search(options, cuda)?;
    let cap_mib = options.cap_mib.unwrap_or(if cuda {
        CUDA_DEFAULT_CAP_MIB
    } else {
        CPU_DEFAULT_CAP_MIB
    });
    let cap = crate::mib_to_bytes("--memory-cap-mb", cap_mib)?;
    let (found, device_name) = if cuda {
        let total = CudaStorage::new(0)
            .context("--device cuda (--device cpu runs on the CPU backend; auto picks)")?
            .memory_info()
            .total;
        ensure!(
            cap <= total,
            "--memory-cap-mb {cap_mib}: the device has only {} MiB",
            total >> 20
        );
        let config = capped_config(cap as f64 / total as f64)?;
        let backend = CudaBackend::with_config(0, config)
            .context("--device cuda (--device cpu runs on the CPU backend; auto picks)")?;
        let probe = Probe {
            backend: backend.clone(),
            device: "cuda:0".into(),
            profile_ops: None,
        };
        let name = backend.allocator().with_storage(|s| s.device_name());
        let found = search_cases(&probe, options, "vit_l_16", &cases, cap, &mut |found| {
            write_json(options, &name, cap, started, found, &pytorch, false)
        })?;
        (found, name)
    } else {
        let allocator = CachingAllocator::new(HostStorage::with_capacity(cap), allocator_config);
        let cpu = Arc::new(CpuBackend::new(allocator));
        let probe = Probe::cpu(&cpu);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let name = format!("CPU backend, {threads} threads");
        let found = search_cases(&probe, options, "vit_mini", &cases, cap, &mut |found| {
            write_json(options, &name, cap, started, found, &pytorch, false)
        })?;
        (found, name)
    };
    println!(
        "find-max-batch on {device_name}: cap {cap_mib} MiB ({cap} B), one step a probe, sizes in \
         decimal GB\n"
    );
    println!("{}", markdown(&found, &pytorch));
    write_json(options, &device_name, cap, started, &found, &pytorch, true)?;
    if let Some(path) = &options.json {
        eprintln!("find-max-batch: wrote {}", path.display());
    }
    let seconds = started.elapsed().as_secs_f64();
    eprintln!("find-max-batch: {} cases in {seconds:.1} s", found.len());
    Ok(found)
}

/// Writes `--json`'s document for the cases `found` so far (`complete`: every case asked for);
/// rewritten after each case, so a run that is stopped early leaves the cases it finished.
fn write_json(
    options: &Options,
    device_name: &str,
    cap: u64,
    started: Instant,
    found: &[Found],
    pytorch: &[TorchFound],
    complete: bool,
) -> Result<()> {
    let Some(path) = &options.json else {
        return Ok(());
    };
    let document = json!({
        "tool": "cargo xtask find-max-batch",
        "command": options.command,
        "device_name": device_name,
        "memory_cap_bytes": cap,
        "seconds": started.elapsed().as_secs_f64(),
        "complete": complete,
        "cases": found.iter().map(|f| case_json(f, pytorch)).collect::<Vec<_>>(),
    });
    let text = serde_json::to_string_pretty(&document)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// `HEADROOM_ALLOC_CONF`'s settings with `per_process_memory_fraction` set to `fraction`.
fn capped_config(fraction: f64) -> Result<AllocatorConfig> {
    let base = std::env::var(ALLOC_CONF_ENV).unwrap_or_default();
    if base.contains("per_process_memory_fraction") {
        bail!("{ALLOC_CONF_ENV} sets per_process_memory_fraction: give the cap as --memory-cap-mb");
    }
    let conf = if base.trim().is_empty() {
        format!("per_process_memory_fraction:{fraction}")
    } else {
        format!("{base},per_process_memory_fraction:{fraction}")
    };
    AllocatorConfig::parse(&conf).with_context(|| format!("allocator settings `{conf}`"))
}

/// The cases the options ask for, on CUDA or on the CPU: an error, before any search, for a
/// case the CPU cannot run.
fn cases_to_search(options: &Options, cuda: bool) -> Result<Vec<Case>> {
    if options.cases.is_empty() {
        return Ok(Case::ALL
            .into_iter()
            .filter(|case| *case != Case::AdamAuto && (cuda || !case.needs_cuda()))
            .collect());
    }
    Case::refuse_cuda_only(&options.cases, cuda)?;
    Ok(options.cases.clone())
}

/// `cases` in order; `after_each` sees the results so far after each case.
fn search_cases(
    probe: &Probe<'_>,
    options: &Options,
    default_model: &str,
    cases: &[Case],
    cap: u64,
    after_each: &mut dyn FnMut(&[Found]) -> Result<()>,
) -> Result<Vec<Found>> {
    let model = match options.model {
        Some(model) => model,
        None => Model::named(default_model)?,
    };
    let model = match options.seq {
        Some(seq) => model.with_seq(seq)?,
        None => model,
    };
    let mut found = Vec::with_capacity(cases.len());
    // What the allocator holds between cases: the backend's own buffers (cuBLAS's workspace,
    // made by the first case's first product) and nothing of any case.
    let mut resting = None;
    for &case in cases {
        let result = find_max_batch(probe, model, case, cap, options.max_batch)?;
        let held = probe.allocator().memory_allocated();
        let expected = *resting.get_or_insert(held);
        ensure!(
            held == expected,
            "{} {} left {held} B allocated, the case before it {expected} B",
            model.name,
            case.name()
        );
        eprintln!(
            "find-max-batch: {} {}: max batch {} ({} OOMs, {:.1} s)",
            model.name,
            case.name(),
            result.max_batch,
            result.ooms,
            result.seconds
        );
        found.push(result);
        after_each(&found)?;
    }
    Ok(found)
}

/// The largest batch `case` trains `model` at on `probe`'s device, whose allocator is capped at
/// `cap` bytes; no probe above `max_batch`.
pub(crate) fn find_max_batch(
    probe: &Probe<'_>,
    model: Model,
    case: Case,
    cap: u64,
    max_batch: usize,
) -> Result<Found> {
    let started = Instant::now();
    let allocator = probe.allocator();
    allocator.empty_cache()?;
    let mut probe_seconds = Vec::new();
    let (build_seconds, (max, probes)) = {
        let training = Training::new(probe, model, case)
            .with_context(|| format!("{} {}: building the model", model.name, case.name()))?;
        let build_seconds = started.elapsed().as_secs_f64();
        let mut baseline = None;
        let mut step =
            |batch: usize| -> Result<Option<Peaks>> {
                let probe_started = Instant::now();
                let outcome = probe_batch(probe, &training, model, case, batch);
                // Whatever the step left (gradients of an interrupted backward) goes; the cache too.
                training.clear_grads()?;
                probe.backend.synchronize()?;
                allocator.empty_cache()?;
                let peaks = match outcome {
                    Ok(peaks) => Some(peaks),
                    Err(err) if is_out_of_memory(&err) => None,
                    Err(err) => {
                        return Err(err.context(format!(
                            "{} {} at batch {batch}",
                            model.name,
                            case.name()
                        )))
                    }
                };
                let now = allocator.memory_allocated();
                let expected = *baseline.get_or_insert(now);
                ensure!(
                now == expected,
                "{} {} at batch {batch} ({}) leaked: the allocator holds {now} B after the probe, \
                 {expected} B before",
                model.name,
                case.name(),
                if peaks.is_some() { "fit" } else { "out of memory" },
            );
                probe_seconds.push(probe_started.elapsed().as_secs_f64());
                Ok(peaks)
            };
        (build_seconds, search(cap, max_batch, &mut step)?)
    };
    let at_max = probes.iter().find(|p| p.batch == max).and_then(|p| p.peaks);
    Ok(Found {
        case,
        model: model.name,
        max_batch: max,
        at_max: at_max.unwrap_or(Peaks::NONE),
        ooms: probes.iter().filter(|p| p.peaks.is_none()).count(),
        probes,
        probe_seconds,
        build_seconds,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// One training step of `case` at `batch`: its peaks and time, or the error it stopped with.
fn probe_batch(
    probe: &Probe<'_>,
    training: &Training,
    model: Model,
    case: Case,
    batch: usize,
) -> Result<Peaks> {
    let protocol = Protocol::ONE_STEP;
    let input = Input::new(&probe.backend, model, batch)?;
    probe.backend.synchronize()?;
    probe.allocator().reset_peak_stats();
    let host = probe.backend.host_allocator_view();
    if let Some(host) = host {
        host.reset_peak_stats();
    }
    let start = Instant::now();
    training.run(&input, case, protocol)?.step()?;
    probe.backend.synchronize()?;
    Ok(Peaks {
        allocated: probe.allocator().max_memory_allocated(),
        reserved: probe.allocator().max_memory_reserved(),
        host_reserved: host.map(|host| host.max_memory_reserved()),
        step_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

/// Whether `err` is the allocator's out-of-memory error, wherever it sits in the chain (an op's
/// `TensorError::Alloc`, an nn or optimizer error around it, a hook's error inside backward).
pub(crate) fn is_out_of_memory(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<AllocError>(),
            Some(AllocError::OutOfMemory(_))
        ) || matches!(
            cause.downcast_ref::<TensorError>(),
            Some(TensorError::Alloc(AllocError::OutOfMemory(_)))
        )
    })
}

/// Batches are doubled up to this one before the line through the measured peaks is trusted:
/// small probes are cheap, and the line through two of them predicts the large one.
const DOUBLING_UP_TO: usize = 16;

/// The most a predicted probe multiplies the largest batch that fit; past it the line is drawn
/// again through the new probe.
const MAX_JUMP: usize = 8;

/// A line that reaches the cap within this multiple of the largest batch that fit is probed
/// where it says. Further out it is aimed below ([`AIM_BELOW`]): on ViT-L/16 (H200, 24 GiB cap)
/// the line through batches 16 and 128 of the checkpointed cases reaches 6.6 to 6.9 times out
/// and overshoots by 11 to 25% (the memory a sample costs grows with the batch there), while the
/// plain cases' line through 8 and 16 reaches 4.4 times out and is exact.
const DIRECT_REACH: usize = 5;

/// An aimed probe's place between the largest fit and a far line's answer (or the smallest batch
/// known not to fit): below by more than such a line misses, so that the probe fits and the line
/// through it can be trusted.
const AIM_BELOW: f64 = 0.7;

/// [`AIM_BELOW`] of the way from `lo` (the largest fit) to `line`.
fn aim_below(lo: usize, line: usize) -> usize {
    lo + (line.saturating_sub(lo) as f64 * AIM_BELOW) as usize
}

/// After a probe at a near line's answer that did not fit, galloping down starts with this
/// share of the line's reach past the largest fit.
const GALLOP_DOWN_SHARE: usize = 64;

/// Aimed probes before galloping and bisection.
const AIM_ROUNDS: usize = 4;

/// The largest batch in `1..=max_batch` for which `fits` returns peaks, given that the
/// allocator is capped at `cap` bytes; and every probe, in order.
///
/// The probes at large batches are the costly ones (a step's time grows with the batch), so the
/// search spends as few as it can there:
/// 1. doubling from 1 up to [`DOUBLING_UP_TO`] (or the first batch that does not fit);
/// 2. jumps of at most [`MAX_JUMP`] times the largest fit towards where the line through the
///    measured peaks ([`predicted`]) reaches `cap`;
/// 3. aiming: a line that reaches the cap within [`DIRECT_REACH`] times the largest fit is
///    probed at its answer; a line that reaches further is probed [`AIM_BELOW`] of the way to
///    it, and after a probe there (fit or not) the line is drawn again (at most [`AIM_ROUNDS`]
///    probes);
/// 4. after a probe at the line's answer, galloping away from it (up by 1, 2, 4... when it fit;
///    down when it did not, from a first step of 1/[`GALLOP_DOWN_SHARE`] of the line's reach)
///    until the answer is bracketed, then bisection.
///
/// With a line that is right to a batch or two, the costly probes are the line's and one or
/// two next to it. Exact when `fits` is monotone: the result fits and the next batch does not.
pub(crate) fn search(
    cap: u64,
    max_batch: usize,
    fits: &mut dyn FnMut(usize) -> Result<Option<Peaks>>,
) -> Result<(usize, Vec<Probed>)> {
    let mut probes: Vec<Probed> = Vec::new();
    let mut probe = |batch: usize, probes: &mut Vec<Probed>| -> Result<bool> {
        let peaks = fits(batch)?;
        probes.push(Probed { batch, peaks });
        Ok(peaks.is_some())
    };
    // 1. Doubling through the small batches: `lo` fits, `hi` (if any) does not.
    let mut lo = 0;
    let mut hi = None;
    let mut batch = 1;
    while batch <= max_batch {
        if !probe(batch, &mut probes)? {
            hi = Some(batch);
            break;
        }
        lo = batch;
        if batch == max_batch || (batch >= DOUBLING_UP_TO && predicted(&probes, cap).is_some()) {
            break;
        }
        batch = (batch * 2).min(max_batch);
    }
    // The largest batch that may still fit.
    let top = hi.map_or(max_batch, |hi| hi - 1);
    if lo == top {
        return Ok((lo, probes));
    }
    // 2. Jumps along the line (twice the largest fit when there is no line), at most `MAX_JUMP`
    // times the largest fit: a line through small batches may be far off.
    loop {
        if aim_below(lo, predicted(&probes, cap).unwrap_or(2 * lo)) <= MAX_JUMP * lo {
            break;
        }
        let at = (MAX_JUMP * lo).clamp(lo + 1, top);
        if !probe(at, &mut probes)? {
            hi = Some(at);
            break;
        }
        lo = at;
        if lo == top {
            return Ok((lo, probes));
        }
    }
    // 3. Aiming. A probe at a near line's answer ends the aiming: the answer is next to it. A far
    // line is aimed below, because it overshoots as often as it undershoots and a probe that
    // does not fit tells nothing about the slope; the next line goes through that probe.
    // `at_line`: the last probe was at a near line's answer, and whether it fit.
    let mut at_line = None;
    // How far the last line reached past the largest fit.
    let mut reach = 0;
    for _ in 0..AIM_ROUNDS {
        let upper = hi.map_or(top, |hi| hi - 1);
        if lo >= upper {
            break;
        }
        let line = predicted(&probes, cap).unwrap_or(2 * lo);
        let near = line <= DIRECT_REACH * lo;
        let at = if near {
            line
        } else {
            aim_below(lo, line.min(upper))
        }
        .clamp(lo + 1, upper);
        reach = at - lo;
        let fit = probe(at, &mut probes)?;
        if fit {
            lo = at;
        } else {
            hi = Some(at);
        }
        if near {
            at_line = Some(fit);
            break;
        }
    }
    let top = hi.map_or(top, |hi| hi - 1);
    if lo >= top {
        return Ok((lo, probes));
    }
    // 4. Galloping away from the line's answer (or up from the largest fit when nothing above is
    // known not to fit), then bisection.
    if at_line == Some(false) {
        // A line misses by a share of how far it reached: the first step down is that share.
        let mut step = (reach / GALLOP_DOWN_SHARE).max(1);
        while let Some(next) = hi
            .and_then(|hi| hi.checked_sub(step))
            .filter(|&next| next > lo)
        {
            if probe(next, &mut probes)? {
                lo = next;
                break;
            }
            hi = Some(next);
            step *= 2;
        }
    } else if at_line == Some(true) || hi.is_none() {
        let mut step = 1;
        while lo < top {
            let next = (lo + step).min(top);
            if !probe(next, &mut probes)? {
                hi = Some(next);
                break;
            }
            lo = next;
            step *= 2;
        }
    }
    let Some(mut hi) = hi.filter(|&hi| lo + 1 < hi) else {
        return Ok((lo, probes));
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if probe(mid, &mut probes)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok((lo, probes))
}

/// The smallest share of the largest fitting batch by which the line's other point lies below it:
/// peaks of neighbouring batches differ by little more than the allocator's rounding, which
/// makes their slope noise.
const LINE_SPAN: f64 = 0.9;

/// The batch at which the line through two fitting probes' allocated peaks reaches `cap`
/// (rounded down): the largest fit and the largest one at most [`LINE_SPAN`] of its batch (the
/// largest below it when none is that far). `None` with fewer than two fits, or peaks that do
/// not grow with the batch.
///
/// Allocated peaks, not reserved ones: they are linear in the batch, while what the allocator
/// reserves over them varies from probe to probe with where its free pages lie (on ViT-L/16
/// under a 24 GiB cap, 20 MB to 470 MB), and the allocator moves free pages before it fails.
fn predicted(probes: &[Probed], cap: u64) -> Option<usize> {
    let mut fitting: Vec<(usize, u64)> = probes
        .iter()
        .filter_map(|p| p.peaks.map(|peaks| (p.batch, peaks.allocated)))
        .collect();
    fitting.sort_unstable();
    fitting.dedup_by_key(|(batch, _)| *batch);
    let (&(b2, a2), below) = fitting.split_last()?;
    let &(b1, a1) = below
        .iter()
        .rev()
        .find(|(b, _)| (*b as f64) <= LINE_SPAN * b2 as f64)
        .or(below.last())?;
    if a2 <= a1 {
        return None;
    }
    let per_sample = (a2 - a1) as f64 / (b2 - b1) as f64;
    let room = cap.saturating_sub(a2) as f64;
    Some(b2 + (room / per_sample).floor() as usize)
}

/// PyTorch's result for one case (a line of `scripts/pytorch/find_max_batch.py`'s output).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TorchFound {
    pub(crate) model: String,
    pub(crate) case: String,
    pub(crate) max_batch: usize,
    pub(crate) peak_allocated_bytes: u64,
    pub(crate) ooms: usize,
    pub(crate) seconds: f64,
}

/// The JSON lines with a `case` and a `max_batch` (others, and lines that are not JSON objects,
/// are skipped); `model` defaults to `vit_l_16`.
pub(crate) fn parse_pytorch(text: &str) -> Result<Vec<TorchFound>> {
    let mut found = Vec::new();
    for row in crate::json_object_lines(text) {
        let row = row?;
        let (Some(case), Some(max_batch)) = (row["case"].as_str(), row["max_batch"].as_u64())
        else {
            continue;
        };
        found.push(TorchFound {
            model: row["model"].as_str().unwrap_or("vit_l_16").to_owned(),
            case: case.to_owned(),
            max_batch: max_batch as usize,
            peak_allocated_bytes: row["peak_allocated_bytes"].as_u64().unwrap_or(0),
            ooms: row["ooms"].as_u64().unwrap_or(0) as usize,
            seconds: row["seconds"].as_f64().unwrap_or(f64::NAN),
        });
    }
    Ok(found)
}

fn torch_for<'a>(pytorch: &'a [TorchFound], found: &Found) -> Option<&'a TorchFound> {
    pytorch
        .iter()
        .find(|t| t.model == found.model && t.case == found.case.pytorch_name())
}

fn gb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e9)
}

/// The Markdown table: one row per case, PyTorch's columns when any case has its figures.
pub(crate) fn markdown(found: &[Found], pytorch: &[TorchFound]) -> String {
    let with_pytorch = found.iter().any(|f| torch_for(pytorch, f).is_some());
    let mut out = String::from(
        "| model | case | max batch | peak alloc GB | peak reserved GB | step ms | OOMs | probes | s |",
    );
    if with_pytorch {
        out.push_str(
            " PyTorch max batch | PyTorch peak GB | PyTorch OOMs | PyTorch s | ours / PyTorch |",
        );
    }
    out.push('\n');
    out.push_str(&"|---".repeat(if with_pytorch { 14 } else { 9 }));
    out.push_str("|\n");
    for f in found {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.1} |",
            f.model,
            f.case.name(),
            f.max_batch,
            gb(f.at_max.allocated),
            gb(f.at_max.reserved),
            f.at_max.step_ms,
            f.ooms,
            f.probes.len(),
            f.seconds
        ));
        if with_pytorch {
            match torch_for(pytorch, f) {
                Some(t) => out.push_str(&format!(
                    " {} | {} | {} | {:.1} | {:.2} |",
                    t.max_batch,
                    gb(t.peak_allocated_bytes),
                    t.ooms,
                    t.seconds,
                    f.max_batch as f64 / t.max_batch as f64
                )),
                None => out.push_str(" - | - | - | - | - |"),
            }
        }
        out.push('\n');
    }
    out
}

fn case_json(f: &Found, pytorch: &[TorchFound]) -> Value {
    let mut value = json!({
        "case": f.case.name(),
        "model": f.model,
        "max_batch": f.max_batch,
        "peak_allocated_bytes": f.at_max.allocated,
        "peak_reserved_bytes": f.at_max.reserved,
        "host_peak_reserved_bytes": f.at_max.host_reserved,
        "step_ms": f.at_max.step_ms,
        "ooms": f.ooms,
        "seconds": f.seconds,
        "build_seconds": f.build_seconds,
        "probes": f.probes.iter().zip(f.probe_seconds.iter().map(Some).chain(std::iter::repeat(None))).map(|(p, seconds)| json!({
            "batch": p.batch,
            "fits": p.peaks.is_some(),
            "seconds": seconds,
            "peak_allocated_bytes": p.peaks.map(|x| x.allocated),
            "peak_reserved_bytes": p.peaks.map(|x| x.reserved),
        })).collect::<Vec<_>>(),
    });
    if let Some(t) = torch_for(pytorch, f) {
        value["pytorch"] = json!({
            "case": t.case,
            "max_batch": t.max_batch,
            "peak_allocated_bytes": t.peak_allocated_bytes,
            "ooms": t.ooms,
            "seconds": t.seconds,
        });
    }
    value
}

#[cfg(test)]
mod tests;
