//! `cargo xtask bench-memory`: trains a ViT with each optimizer implementation and reports, per
//! case, peak allocated and reserved bytes, step time and where the memory goes.
//!
//! On a GPU (`CudaBackend::new(0)` succeeds): torchvision's ViT-L/16 at batch 1 and 32, every
//! case, the settings of PyTorch's anchors (`torch_reference.py`). Without one: the CPU backend
//! on `vit_mini` (see [`models::Model::named`]), a selection of the cases at batch 1 and 32 that
//! runs in under a minute on two idle cores (`--all-cases`: every case; [`command_line`]). Each
//! case starts from a fresh model and optimizer after `empty_cache`, and follows the reference
//! protocol ([`measure`]). Output: a progress bar on stderr, a Markdown table on stdout (with
//! PyTorch's figures and the ratios when `--pytorch anchor.jsonl` is given), `--json FILE` (one
//! object per case under `cases`) and `--html FILE` (charts, [`html`]). A case that fails (out of memory,
//! an optimizer the device lacks) is reported and the others still run; the command then exits
//! with an error.
//!
//! The breakdown, per case: `param_bytes`, `grad_bytes` and `state_bytes` are exact element
//! counts × element sizes; `activation_bytes` is measured at the forward/backward boundary
//! (allocated after the loss minus allocated before the forward: what the forward keeps for
//! backward); and the traced step's peak is split by what held it at that moment
//! ([`timeline`]), the components adding up to that peak exactly. One more forward names every
//! tensor the last block saves ([`block_saves`]: op, role, shape, dtype, bytes, storage), adding
//! up to what the block keeps; for a Llama beside nn's formula of a block's bytes per token. A
//! language model's loss runs once more alone for `logits_bytes` ([`loss_logits`]): what its
//! logits take at their peak, `2 · rows · vocab · dtype bytes + 12 · rows + 8` with
//! `--unfused-loss` (the logits, their gradient, the I64 targets and an f32 statistic a row),
//! one chunk of at most 64 MiB with the default fused loss.
//!
//! Modules: [`cases`] (what each case trains with), [`models`] (the models and their input),
//! [`block_saves`] (one block's saved tensors), [`loss_logits`] (the loss's logits),
//! [`training`] (one training run), [`measure`] (the protocol that measures a case),
//! [`budget_plan`] (`adam_auto`'s plan), [`timeline`] (history → timeline and breakdown),
//! [`report`] (table, JSON, anchors), [`html`] (charts), [`command_line`] (the options and the
//! devices' defaults). This one picks the device and drives the cases.

mod block_saves;
mod budget_plan;
pub(crate) mod cases;
mod command_line;
mod html;
mod loss_logits;
pub(crate) mod measure;
pub(crate) mod models;
mod report;
mod timeline;
pub(crate) mod training;

#[cfg(test)]
mod language_model_tests;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_caching_allocator::{CachingAllocator, HostStorage, TraceEvent};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::{CudaBackend, SmallCopies};
use indicatif::{ProgressBar, ProgressStyle};

use cases::Case;
pub(crate) use command_line::{Args, DeviceChoice, Options};
use command_line::{Defaults, CPU_DEFAULTS, CUDA_DEFAULTS};
use measure::{CaseResult, Protocol};
use models::Model;
use report::Anchors;
use training::Probe;

/// `cargo xtask bench-memory ARGS`: checks the output paths, then measures.
pub(crate) fn run(args: Args, command: String) -> Result<()> {
    let options = Options::new(args, command)?;
    options.check_outputs()?;
    execute(&options).map(|_| ())
}

/// Runs every case the options name on the device they pick, prints the table and writes the
/// files; returns what was measured.
pub(crate) fn execute(options: &Options) -> Result<Vec<CaseResult>> {
    let anchors = match &options.pytorch {
        Some(path) => crate::read_parsed(path, report::parse_anchors)?,
        None => Anchors::new(),
    };
    let started = Instant::now();
    // Read before any device: a malformed value names the variable, on the CPU too.
    let allocator_config = crate::allocator_config_from_env()?;
    let cuda = match options.device {
        DeviceChoice::Cpu => None,
        DeviceChoice::Cuda => Some(
            CudaBackend::new(0)
                .context("--device cuda (--device cpu runs on the CPU backend; auto picks)")?,
        ),
        DeviceChoice::Auto => match CudaBackend::new(0) {
            Ok(cuda) => Some(cuda),
            Err(err) => {
                eprintln!("bench-memory: no CUDA device ({err}); running on the CPU backend");
                None
            }
        },
    };
    let (outcomes, device_name, protocol) = match cuda {
        Some(cuda) => {
            cuda.set_deferred_index_checks(options.defer_index_checks)?;
            if options.copy_engine_copies {
                cuda.set_small_copies(SmallCopies::CopyEngine);
            }
            let options = &options.on_device(&CUDA_DEFAULTS);
            let runs = options.runs(&CUDA_DEFAULTS)?;
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
            let outcomes = run_cases(&probe, options, &CUDA_DEFAULTS, &runs)?;
            (outcomes, name, options.protocol)
        }
        None => {
            let options = &options.on_device(&CPU_DEFAULTS);
            let runs = options.runs(&CPU_DEFAULTS)?;
            let allocator = CachingAllocator::new(HostStorage::new(), allocator_config);
            let cpu = Arc::new(CpuBackend::new(allocator));
            let probe = Probe::cpu(&cpu);
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let name = format!("CPU backend, {threads} threads");
            let outcomes = run_cases(&probe, options, &CPU_DEFAULTS, &runs)?;
            (outcomes, name, options.protocol)
        }
    };

    let Outcomes { results, failures } = outcomes;
    println!(
        "bench-memory on {} ({device_name}): warm-up {}, timed {}, sizes in decimal GB/MB\n",
        results.first().map_or("-", |r| r.device.as_str()),
        protocol.warmup,
        protocol.steps
    );
    println!("{}", report::markdown(&results, &anchors));
    for text in results.iter().filter_map(budget_plan::describe) {
        println!("{text}\n");
    }
    // One block's saves, named, for the first case that recorded them (--json has every case's).
    if let Some((result, saves)) = results
        .iter()
        .find_map(|r| Some((r, r.block_saves.as_ref()?)))
    {
        println!("{}", saves.markdown(result.model, result.case));
    }
    println!(
        "activations: allocated after the loss minus before the forward. cast cache: the half \
         copies of the weights autocast holds at the end of the forward. logits: a language \
         model's loss run alone, the most bytes its temporaries held at once (the logits and \
         their gradient with --unfused-loss, one chunk of the fused loss otherwise). \
         peak in: the phase of the traced step's peak (its components are in --json and --html)."
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

/// Every (batch, case) of `runs` on `probe`'s device, with the options' protocol (`adam_auto`
/// once per `--budget`), under a progress bar.
fn run_cases(
    probe: &Probe<'_>,
    options: &Options,
    defaults: &Defaults,
    runs: &[(usize, Vec<Case>)],
) -> Result<Outcomes> {
    let model = match options.model {
        Some(model) => model,
        None => Model::named(defaults.model)?,
    };
    let model = match options.seq {
        Some(seq) => model.with_seq(seq)?,
        None => model,
    };
    let model = match options.unfused_loss {
        true => model.with_unfused_loss()?,
        false => model,
    };
    let protocols = |case: Case| -> Vec<Protocol> {
        let budgets: Vec<Option<u64>> = match case {
            Case::AdamAuto if !options.budgets.is_empty() => {
                options.budgets.iter().copied().map(Some).collect()
            }
            _ => vec![None],
        };
        budgets
            .into_iter()
            .map(|budget| Protocol {
                budget,
                ..options.protocol
            })
            .collect()
    };
    let runs: Vec<(usize, Case, Protocol)> = runs
        .iter()
        .flat_map(|(batch, cases)| {
            cases.iter().flat_map(move |&case| {
                protocols(case)
                    .into_iter()
                    .map(move |protocol| (*batch, case, protocol))
            })
        })
        .collect();
    let n_cases = runs.len();
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
    for &(batch, case, protocol) in &runs {
        bar.set_message(format!("{} batch {batch} {}", model.name, case.name()));
        let done = bar.position() + options.protocol.total_steps() as u64;
        let tick = &mut || bar.inc(1);
        match measure::measure(probe, model, batch, case, protocol, tick) {
            // A planned case's plan is printed once, with the table at the end (stdout).
            Ok(result) => run.results.push(result),
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
