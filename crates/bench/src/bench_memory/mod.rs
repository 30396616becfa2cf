//! `cargo xtask bench-memory`: trains a ViT with each optimizer implementation and reports, per
//! case, peak allocated and reserved bytes, step time and where the memory goes.
//!
//! On a GPU (`CudaBackend::new(0)` succeeds): torchvision's ViT-L/16 at batch 1 and 32, the
//! settings of PyTorch's anchors (`torch_reference.py`). Without one: the CPU backend on
//! `vit_mini` (see [`models::Model::named`]), a few minutes on two cores. Each case starts from a
//! fresh model and optimizer after `empty_cache`, and follows the reference protocol
//! ([`measure`]). Output: a progress bar on stderr, a Markdown table on stdout (with PyTorch's
//! figures and the ratios when `--pytorch anchor.jsonl` is given), `--json FILE` (one object per
//! case under `cases`) and `--html FILE` (charts, [`html`]). A case that fails (out of memory,
//! an optimizer the device lacks) is reported and the others still run; the command then exits
//! with an error.
//!
//! The breakdown, per case: `param_bytes`, `grad_bytes` and `state_bytes` are exact element
//! counts × element sizes; `activation_bytes` is measured at the forward/backward boundary
//! (allocated after the loss minus allocated before the forward: what the forward keeps for
//! backward); and the traced step's peak is split by what held it at that moment
//! ([`timeline`]), the components adding up to that peak exactly.
//!
//! Modules: [`cases`] (what each case trains with), [`models`] (the models and their input),
//! [`training`] (one training run), [`measure`] (the protocol that measures a case),
//! [`budget_plan`] (`adam_auto`'s plan), [`timeline`] (history → timeline and breakdown),
//! [`report`] (table, JSON, anchors), [`html`] (charts). This one parses the options, picks the
//! device and drives the cases.

mod budget_plan;
pub(crate) mod cases;
mod html;
pub(crate) mod measure;
pub(crate) mod models;
mod report;
mod timeline;
pub(crate) mod training;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_caching_allocator::TraceEvent;
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use indicatif::{ProgressBar, ProgressStyle};

use cases::Case;
use measure::{CaseResult, Protocol};
use models::Model;
use report::Anchors;
use training::Probe;

/// Which device `--device` asks for (bench-memory's and find-max-batch's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceChoice {
    /// CUDA when a device answers, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

impl DeviceChoice {
    /// `--device`'s value: `auto`, `cpu` or `cuda`.
    pub(crate) fn parse(text: &str) -> Result<DeviceChoice> {
        Ok(match text {
            "auto" => DeviceChoice::Auto,
            "cpu" => DeviceChoice::Cpu,
            "cuda" => DeviceChoice::Cuda,
            other => bail!("--device {other}: expected auto, cpu or cuda"),
        })
    }
}

/// The parsed command line.
#[derive(Debug, Clone)]
struct Options {
    device: DeviceChoice,
    /// Empty: the device's defaults.
    batches: Vec<usize>,
    /// Empty: every case the device runs.
    cases: Vec<Case>,
    /// `None`: the device's default.
    model: Option<Model>,
    /// A language model's tokens a row (`--seq`); `None`: its full context.
    seq: Option<usize>,
    protocol: Protocol,
    /// `adam_auto`'s budgets (`--budget`, repeatable); empty: its default.
    budgets: Vec<u64>,
    json: Option<PathBuf>,
    html: Option<PathBuf>,
    pytorch: Option<PathBuf>,
    /// `--trace DIR`: each case's allocator events are written there.
    trace: Option<PathBuf>,
    progress: bool,
    /// The command line, for the JSON document.
    command: String,
}

/// The model, batch sizes and cases a device runs when none are given.
struct Defaults {
    model: &'static str,
    batches: &'static [usize],
    /// Whether the cases that need CUDA run.
    cuda: bool,
}

const CUDA_DEFAULTS: Defaults = Defaults {
    model: "vit_l_16",
    batches: &[1, 32],
    cuda: true,
};

const CPU_DEFAULTS: Defaults = Defaults {
    model: "vit_mini",
    batches: &[1, 32],
    cuda: false,
};

pub(crate) const USAGE: &str =
    "  bench-memory [--device auto|cpu|cuda] [--model NAME] [--seq N] [--batch N]... [--cases a,b,c]
               [--warmup N] [--steps N] [--bucket-mib N] [--budget BYTES]... [--json FILE]
               [--html FILE] [--op-profile]
               [--pytorch anchor.jsonl] [--trace DIR]
      Trains a model (ViT: loss = model(x).sum(); GPT-2: Hugging Face's causal-LM loss on --seq
      random tokens a row, default 1024, dropout off) with each optimizer and technique: per case, a fresh
      model and optimizer, N warm-up steps (default 3; their peak is the first-3 peak), then N
      timed steps (default 6: steady peak allocated and reserved, median step time), then one
      traced step (memory by phase and by component at the peak). Prints a Markdown table.
      Device auto: CUDA when a GPU answers (ViT-L/16, batch 1 and 32), else the CPU backend
      (vit_mini, batch 1 and 32). Models: vit_l_16, vit_b_16, vit_mini, vit_tiny, gpt2,
      gpt2-medium, gpt2-large. Cases
      (default all the device runs): adam_foreach (bounded temporaries), adam_foreach_unbounded
      (PyTorch's), adam_single, adam_fused, adam8bit, sgd; adam_inbwd and adam8bit_inbwd (the
      step inside backward), adam_ckpt (every block but the last checkpointed: recomputing
      the last would free nothing), adam_inbwd_ckpt (in backward, every block checkpointed),
      adam_auto (per block keep, recompute, 8-bit compression or, on a GPU, offload, planned
      for --budget BYTES, repeatable; default: halfway between the lowest peak the planner
      reaches and the peak without checkpointing; it also measures uniform every-k
      checkpointing at the same budget, alternating with the plan), adam_offload (the first 7/12 of the blocks offloaded to pinned host memory; CUDA only),
      adam_fused_clip (clip_grad_norm_ to 1.0, then the step), adam_inbwd_clip (in backward,
      exact clipping: a measuring pass first), adam_inbwd_clip_prev (previous step's norm),
      fwd_bwd and fwd_bwd_bf16 (forward and backward only; the second with the whole model in
      bf16).
      --bucket-mib sets the in-backward cases' bucket (default: 1/16 of the parameters, at most
      25). --json writes one object per case, --html charts (timelines by time or in event
      order, a toggle in the page); --pytorch reads the anchor.jsonl of
      scripts/pytorch/bench_reference.py and adds PyTorch's figures. --op-profile (CUDA) runs
      one more step per case with timing events around every backend primitive and prints its
      device time by primitive. --trace writes
      each case's allocations and completed frees, from the model's creation to the end of the
      timed steps, to DIR/MODEL_bBATCH_CASE.tsv (the columns of a replayable trace, and
      `step`: 0 while building, then each step's number).
";

/// `cargo xtask bench-memory ARGS`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    if args.iter().any(|arg| arg == "--help" || arg == "-h") {
        print!("usage:\n{USAGE}");
        return Ok(());
    }
    let options = parse(args)?;
    execute(&options).map(|_| ())
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options {
        device: DeviceChoice::Auto,
        batches: Vec::new(),
        cases: Vec::new(),
        model: None,
        seq: None,
        protocol: Protocol {
            warmup: 3,
            steps: 6,
            bucket_bytes: None,
            budget: None,
            op_profile: false,
            record_events: false,
        },
        budgets: Vec::new(),
        json: None,
        html: None,
        pytorch: None,
        trace: None,
        progress: true,
        command: std::iter::once("cargo xtask bench-memory".to_owned())
            .chain(args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" "),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .with_context(|| format!("{arg} needs a value"))
                .cloned()
        };
        let number = |text: String| -> Result<usize> {
            text.parse()
                .with_context(|| format!("{arg} {text}: not a whole number"))
        };
        match arg.as_str() {
            "--device" => options.device = DeviceChoice::parse(&value()?)?,
            "--model" => options.model = Some(Model::named(&value()?)?),
            "--seq" => options.seq = Some(number(value()?)?),
            "--batch" => {
                let batch = number(value()?)?;
                if batch == 0 {
                    bail!("--batch must be at least 1");
                }
                options.batches.push(batch);
            }
            "--cases" => options.cases = Case::parse_list(&value()?)?,
            "--warmup" => options.protocol.warmup = number(value()?)?,
            "--op-profile" => options.protocol.op_profile = true,
            "--steps" => {
                options.protocol.steps = number(value()?)?;
                if options.protocol.steps == 0 {
                    bail!("--steps must be at least 1");
                }
            }
            "--bucket-mib" => {
                let mib = number(value()?)?;
                if mib == 0 {
                    bail!("--bucket-mib must be at least 1");
                }
                options.protocol.bucket_bytes =
                    Some(crate::mib_to_bytes("--bucket-mib", mib as u64)?);
            }
            "--budget" => {
                let text = value()?;
                let bytes: u64 = text
                    .parse()
                    .with_context(|| format!("--budget {text}: not a whole number of bytes"))?;
                options.budgets.push(bytes);
            }
            "--json" => options.json = Some(value()?.into()),
            "--html" => options.html = Some(value()?.into()),
            "--pytorch" => options.pytorch = Some(value()?.into()),
            "--trace" => {
                options.trace = Some(value()?.into());
                options.protocol.record_events = true;
            }
            other => bail!("unknown option {other}\n\nusage:\n{USAGE}"),
        }
    }
    Ok(options)
}

/// Runs every case the options name on the device they pick, prints the table and writes the
/// files; returns what was measured.
fn execute(options: &Options) -> Result<Vec<CaseResult>> {
    let anchors = match &options.pytorch {
        Some(path) => report::read_anchors(path)?,
        None => Anchors::new(),
    };
    let started = Instant::now();
    let cuda = match options.device {
        DeviceChoice::Cpu => None,
        DeviceChoice::Cuda => Some(CudaBackend::new(0).context("--device cuda")?),
        DeviceChoice::Auto => match CudaBackend::new(0) {
            Ok(cuda) => Some(cuda),
            // A malformed HEADROOM_ALLOC_CONF is the user's to fix, not a reason to fall back.
            Err(err @ headroom_ops_cuda::CudaError::Config { .. }) => {
                return Err(err).context("--device auto");
            }
            Err(err) => {
                eprintln!("bench-memory: no CUDA device ({err}); running on the CPU backend");
                None
            }
        },
    };
    let (outcomes, device_name) = match cuda {
        Some(cuda) => {
            let profile_ops = |step: &mut dyn FnMut() -> Result<()>| {
                cuda.start_op_profile()?;
                let stepped = step();
                let timings = cuda.finish_op_profile()?;
                stepped?;
                Ok(timings.into_iter().map(|t| (t.label, t.ms)).collect())
            };
            let probe = Probe {
                backend: cuda.clone(),
                device: "cuda:0".into(),
                profile_ops: Some(&profile_ops),
            };
            let name = cuda.allocator().with_storage(|s| s.device_name());
            (run_cases(&probe, options, &CUDA_DEFAULTS)?, name)
        }
        None => {
            let cpu = Arc::new(CpuBackend::default());
            let probe = Probe::cpu(&cpu);
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let name = format!("CPU backend, {threads} threads");
            (run_cases(&probe, options, &CPU_DEFAULTS)?, name)
        }
    };

    let Outcomes { results, failures } = outcomes;
    println!(
        "bench-memory on {} ({device_name}): warm-up {}, timed {}, sizes in decimal GB/MB\n",
        results.first().map_or("-", |r| r.device.as_str()),
        options.protocol.warmup,
        options.protocol.steps
    );
    println!("{}", report::markdown(&results, &anchors));
    for text in results.iter().filter_map(budget_plan::describe) {
        println!("{text}\n");
    }
    println!(
        "activations: allocated after the loss minus before the forward. cast cache: the half \
         copies of the weights autocast holds at the end of the forward. peak in: the phase of \
         the traced step's peak (its components are in --json and --html)."
    );
    if let Some(line) = report::finding(&results, 1) {
        println!("the tutorial's finding, {line}");
    }
    for failure in &failures {
        println!(
            "failed: {} {} at batch {}: {}",
            failure.model,
            failure.case.name(),
            failure.batch,
            failure.error
        );
    }
    if let Some(path) = &options.json {
        let mut document = report::document(&results, &anchors, &options.command);
        document["device_name"] = device_name.clone().into();
        document["failures"] = failures
            .iter()
            .map(|f| {
                serde_json::json!({
                    "case": f.case.name(),
                    "model": f.model,
                    "batch": f.batch,
                    "error": f.error,
                })
            })
            .collect();
        let text = serde_json::to_string_pretty(&document)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench-memory: wrote {}", path.display());
    }
    if let Some(dir) = &options.trace {
        for result in &results {
            let path = dir.join(format!(
                "{}_b{}_{}.tsv",
                result.model,
                result.batch,
                result.case.name()
            ));
            std::fs::write(&path, events_tsv(&result.events))
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("bench-memory: wrote {}", path.display());
        }
    }
    if let Some(path) = &options.html {
        let title = format!("Headroom bench-memory · {device_name}");
        std::fs::write(path, html::page(&results, &anchors, &title))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench-memory: wrote {}", path.display());
    }
    eprintln!(
        "bench-memory: {} cases in {:.1} s",
        results.len() + failures.len(),
        started.elapsed().as_secs_f64()
    );
    if !failures.is_empty() {
        bail!("{} of the cases failed", failures.len());
    }
    Ok(results)
}

/// A case's recorded events as a trace file's TSV, with their step in a last column.
fn events_tsv(events: &[(usize, TraceEvent)]) -> String {
    let mut text = String::from("action\taddr\tsize\tstream\tstep\n");
    for (step, event) in events {
        text += &format!(
            "{}\t{}\t{}\t{}\t{step}\n",
            event.action.name(),
            event.addr,
            event.size,
            event.stream
        );
    }
    text
}

/// Every (batch, case) of the options on `probe`'s device, under a progress bar.
fn run_cases(probe: &Probe<'_>, options: &Options, defaults: &Defaults) -> Result<Outcomes> {
    let model = match options.model {
        Some(model) => model,
        None => Model::named(defaults.model)?,
    };
    let model = match options.seq {
        Some(seq) => model.with_seq(seq)?,
        None => model,
    };
    let batches = if options.batches.is_empty() {
        defaults.batches.to_vec()
    } else {
        options.batches.clone()
    };
    let cases: Vec<Case> = if options.cases.is_empty() {
        Case::ALL
            .into_iter()
            .filter(|case| defaults.cuda || !case.needs_cuda())
            .collect()
    } else {
        options.cases.clone()
    };
    let runs: Vec<(Case, Protocol)> = cases
        .iter()
        .flat_map(|&case| {
            let budgets: Vec<Option<u64>> = match case {
                Case::AdamAuto if !options.budgets.is_empty() => {
                    options.budgets.iter().copied().map(Some).collect()
                }
                _ => vec![None],
            };
            budgets.into_iter().map(move |budget| {
                (
                    case,
                    Protocol {
                        budget,
                        ..options.protocol
                    },
                )
            })
        })
        .collect();
    let n_cases = batches.len() * runs.len();
    let bar = if options.progress {
        ProgressBar::new((n_cases * options.protocol.total_steps()) as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:36} [{bar:30}] {pos}/{len} steps, {elapsed} (eta {eta})",
        )?
        .progress_chars("=> "),
    );
    let mut run = Outcomes {
        results: Vec::with_capacity(n_cases),
        failures: Vec::new(),
    };
    for &batch in &batches {
        for &(case, protocol) in &runs {
            bar.set_message(format!("{} batch {batch} {}", model.name, case.name()));
            let done = bar.position() + options.protocol.total_steps() as u64;
            let tick = &mut || bar.inc(1);
            match measure::measure(probe, model, batch, case, protocol, tick) {
                Ok(result) => {
                    // A planned case's plan as soon as it is measured (on stderr; stdout has
                    // them all at the end), so a run cut short still shows the ones done.
                    if let Some(text) = budget_plan::describe(&result) {
                        bar.suspend(|| eprintln!("{text}\n"));
                    }
                    run.results.push(result);
                }
                Err(err) => {
                    // Everything the case allocated was dropped with it: the next starts clean.
                    bar.suspend(|| {
                        eprintln!("bench-memory: {} at batch {batch}: {err:#}", case.name())
                    });
                    run.failures.push(Failure {
                        case,
                        model: model.name,
                        batch,
                        error: format!("{err:#}"),
                    });
                    bar.set_position(done);
                }
            }
        }
    }
    bar.finish_and_clear();
    Ok(run)
}

/// What the cases measured, and the cases that failed (an out-of-memory error, an optimizer
/// the device lacks): the others still run and are reported.
struct Outcomes {
    results: Vec<CaseResult>,
    failures: Vec<Failure>,
}

/// A case that returned an error.
struct Failure {
    case: Case,
    model: &'static str,
    batch: usize,
    error: String,
}
