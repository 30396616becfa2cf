//! `bench-memory`'s command line: its options ([`Args`], declared with clap, whose `--help` lists
//! the cases, models and devices from their tables), what they resolve to ([`Options`]), and the
//! batches and cases a device runs when none are named ([`Defaults`], [`Options::runs`]).
//!
//! Lists take commas or repeated flags alike (`--batch 1,32` is `--batch 1 --batch 32`). What can
//! be checked before a case runs is checked here or in [`Options::check_before_running`]: the
//! output paths, the numbers' ranges, and (once the device is known) cases the device cannot
//! run. It knows nothing about measuring or reporting.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};

use super::cases::Case;
use super::measure::Protocol;
use super::models::Model;
use crate::output_paths;

/// Which device `--device` asks for (bench-memory's and find-max-batch's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DeviceChoice {
    /// CUDA when a device answers, else the CPU.
    Auto,
    /// The CPU backend.
    Cpu,
    /// The first CUDA device (an error when none answers).
    Cuda,
}

/// The model, and per batch the cases, a device runs when the command line names neither.
#[derive(Debug)]
pub(crate) struct Defaults {
    pub(crate) model: &'static str,
    /// Per batch, its cases; an empty list: every case the device runs.
    pub(crate) runs: &'static [(usize, &'static [Case])],
    /// Timed steps a case when `--steps` is not given.
    pub(crate) steps: usize,
    /// Whether the cases that need CUDA run.
    pub(crate) cuda: bool,
}

pub(crate) const CUDA_DEFAULTS: Defaults = Defaults {
    model: "vit_l_16",
    runs: &[(1, &[]), (32, &[])],
    steps: 6,
    cuda: true,
};

/// On the CPU, a selection that runs in under a minute on two idle cores: at batch 1, where
/// parameters, gradients and optimizer state dominate, the optimizer implementations of the
/// tutorial's finding ([`super::report::finding`]); at batch 32, where activations dominate, the
/// techniques that trade them for time (in backward, checkpointing, the planner); 3 timed steps
/// a case (a median of 3 is enough where no PyTorch figure is compared). `--all-cases` runs
/// every case at both.
pub(crate) const CPU_DEFAULTS: Defaults = Defaults {
    model: "vit_mini",
    runs: &[
        (
            1,
            &[
                Case::AdamForeach,
                Case::AdamForeachUnbounded,
                Case::AdamSingle,
                Case::AdamFused,
                Case::Adam8bit,
            ],
        ),
        (
            32,
            &[
                Case::AdamFused,
                Case::AdamInbwd,
                Case::AdamCkpt,
                Case::AdamAuto,
            ],
        ),
    ],
    steps: 3,
    cuda: false,
};

impl Defaults {
    /// The cases the device runs at all: every case, less those that need CUDA on the CPU.
    fn every_case(&self) -> Vec<Case> {
        Case::ALL
            .into_iter()
            .filter(|case| self.cuda || !case.needs_cuda())
            .collect()
    }

    /// A default batch's `cases`, or every case the device runs when the list is empty.
    fn cases_at(&self, cases: &[Case]) -> Vec<Case> {
        if cases.is_empty() {
            self.every_case()
        } else {
            cases.to_vec()
        }
    }

    /// The defaults in words, for `--help`.
    fn describe(&self) -> String {
        let runs: Vec<String> = self
            .runs
            .iter()
            .map(|(batch, cases)| {
                let names: Vec<&str> = cases.iter().map(|case| case.name()).collect();
                if names.is_empty() {
                    format!("batch {batch}: every case")
                } else {
                    format!("batch {batch}: {}", names.join(", "))
                }
            })
            .collect();
        format!(
            "{}, {}; {} timed steps a case",
            self.model,
            runs.join("; "),
            self.steps
        )
    }
}

/// Peak allocated and reserved bytes, where the memory goes and step time, per optimizer and
/// technique, on a ViT, GPT-2 or Llama, beside PyTorch's figures (--pytorch).
#[derive(Debug, Clone, clap::Args)]
#[command(long_about = long_about(), after_long_help = defaults_help())]
pub(crate) struct Args {
    /// Where to run: CUDA when a GPU answers, else the CPU backend (auto), or one of them.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// The model (default: the device's, below).
    #[arg(long, value_parser = model_parser())]
    model: Option<Model>,
    /// A language model's tokens a row (default: 1024 for GPT-2, 2048 for the Llama shapes, 64
    /// for llama-tiny and qwen2-tiny).
    #[arg(long, value_name = "N", value_parser = crate::at_least_one)]
    seq: Option<usize>,
    /// A language model's loss through its logits (the `[batch, seq, vocab]` logits, then the
    /// loss on them, as Hugging Face computes it) instead of the default, the head fused with the
    /// loss (autograd-core's linear_cross_entropy, 64 MiB chunks, no logits held).
    #[arg(long)]
    unfused_loss: bool,
    /// A Llama-family model with N decoder layers instead of its own (a shape between the
    /// standard ones, as `plan --find-max-model` walks them).
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// The checkpointed cases recompute the model's first N blocks and keep every activation
    /// of the others (default: each case's own, every block or every block but the last); needs
    /// --model and --cases naming checkpointed cases only. `plan` runs its partial
    /// checkpointing this way.
    #[arg(long, value_name = "N")]
    checkpoint_blocks: Option<usize>,
    /// The streamed cases (adamw_offload_stream_inbwd_bf16, adamw4bit_stream_*) let the GPU
    /// hold N MiB of optimizer state coming in, and as many going back (default: a quarter of
    /// the state, the 4-bit cases at most 256 MiB); needs --model.
    #[arg(long, value_name = "N")]
    stream_budget_mib: Option<u64>,
    /// Batch sizes, by commas or repeated (default: the device's, below).
    #[arg(long = "batch", value_name = "N", value_delimiter = ',', value_parser = crate::at_least_one)]
    batches: Vec<usize>,
    /// Cases, by commas or repeated, run at every batch (default: the device's selection,
    /// below).
    #[arg(long, value_name = "CASE", value_delimiter = ',', value_enum)]
    cases: Vec<Case>,
    /// Every case the device runs, at every batch (on the CPU the default is a selection).
    #[arg(long, conflicts_with = "cases")]
    all_cases: bool,
    /// Warm-up steps from the fresh optimizer (their peak is the first-3 peak).
    #[arg(long, value_name = "N", default_value_t = 3)]
    warmup: usize,
    /// Timed steps: steady peak allocated and reserved, median step time (default: the
    /// device's, below).
    #[arg(long, value_name = "N", value_parser = crate::at_least_one)]
    steps: Option<usize>,
    /// The in-backward cases' bucket in MiB (default: 1/16 of the parameters, at most 25).
    #[arg(long, value_name = "N", value_parser = crate::at_least_one)]
    bucket_mib: Option<usize>,
    /// adam_auto's memory budgets in bytes, by commas or repeated, one run each (default:
    /// halfway between the lowest peak the planner reaches and the peak without
    /// checkpointing).
    #[arg(long = "budget", value_name = "BYTES", value_delimiter = ',')]
    budgets: Vec<u64>,
    /// Writes one JSON object per case (checked writable before anything runs).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Writes an HTML page of charts: peaks by component, timelines by time or in event order.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
    /// Reads scripts/pytorch/bench_reference.py's anchor.jsonl and adds PyTorch's figures.
    #[arg(long, value_name = "FILE")]
    pytorch: Option<PathBuf>,
    /// Writes each case's allocations and completed frees, from the model's creation to the end
    /// of the timed steps, to DIR/MODEL_bBATCH_CASE.tsv (a replayable trace's columns and
    /// `step`: 0 while building, then each step's number).
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// CUDA: one more step per case with timing events around every backend primitive; prints
    /// its device time by primitive.
    #[arg(long)]
    op_profile: bool,
    /// CUDA: defer the index checks of gather, scatter-add and cross-entropy (ops-cuda's
    /// `set_deferred_index_checks`: an out-of-range index is reported at the next
    /// synchronisation, as PyTorch's asynchronous errors are) instead of reading an error word
    /// back after each launch, a host wait that also waits behind the streamed cases' copies.
    #[arg(long)]
    defer_index_checks: bool,
    /// CUDA: copy a few bytes between host and device (error words, launch tables, `item`)
    /// through a copy engine (ops-cuda's `SmallCopies::CopyEngine`), where they wait behind the
    /// streamed cases' large copies, instead of through a kernel (the default), for a
    /// side-by-side measurement.
    #[arg(long)]
    copy_engine_copies: bool,
}

/// The parsed command line.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) device: DeviceChoice,
    /// Empty: the device's defaults.
    pub(crate) batches: Vec<usize>,
    /// Empty: the device's defaults (or, with `all_cases`, every case it runs).
    pub(crate) cases: Vec<Case>,
    pub(crate) all_cases: bool,
    /// `None`: the device's default.
    pub(crate) model: Option<Model>,
    /// A language model's tokens a row (`--seq`); `None`: its full context.
    pub(crate) seq: Option<usize>,
    /// A language model's loss through its logits (`--unfused-loss`); else fused with the head.
    pub(crate) unfused_loss: bool,
    /// The protocol; its `steps` is `--steps`, else CUDA's default until [`Options::on_device`]
    /// gives the device's.
    pub(crate) protocol: Protocol,
    pub(crate) steps_given: bool,
    /// `adam_auto`'s budgets (`--budget`, repeatable); empty: its default.
    pub(crate) budgets: Vec<u64>,
    pub(crate) json: Option<PathBuf>,
    pub(crate) html: Option<PathBuf>,
    pub(crate) pytorch: Option<PathBuf>,
    /// `--trace DIR`: each case's allocator events are written there.
    pub(crate) trace: Option<PathBuf>,
    pub(crate) progress: bool,
    /// `--defer-index-checks`.
    pub(crate) defer_index_checks: bool,
    /// `--copy-engine-copies`.
    pub(crate) copy_engine_copies: bool,
    /// The command line, for the JSON document.
    pub(crate) command: String,
}

impl Options {
    /// The options `args` give; `command` is the command line the JSON records.
    pub(crate) fn new(args: Args, command: String) -> Result<Options> {
        let bucket_bytes = match args.bucket_mib {
            Some(mib) => Some(crate::mib_to_bytes("--bucket-mib", mib as u64)?),
            None => None,
        };
        let model = match (args.model, args.seq) {
            (Some(model), Some(seq)) => Some(model.with_seq(seq)?),
            (model, _) => model,
        };
        let model = match (model, args.unfused_loss) {
            (Some(model), true) => Some(model.with_unfused_loss()?),
            (model, _) => model,
        };
        let model = match (model, args.layers) {
            (model, None) => model,
            (None, Some(_)) => bail!("--layers needs --model (a Llama-family model)"),
            (Some(model), Some(layers)) => Some(model.with_layers(layers)?),
        };
        let model = match (model, args.checkpoint_blocks) {
            (model, None) => model,
            (None, Some(_)) => {
                bail!("--checkpoint-blocks needs --model: the number of blocks is the model's")
            }
            (Some(model), Some(blocks)) => {
                if args.cases.is_empty() {
                    bail!(
                        "--checkpoint-blocks needs --cases naming the checkpointed cases it \
                         applies to"
                    );
                }
                if let Some(case) = args.cases.iter().find(|case| !case.checkpointed()) {
                    bail!(
                        "--checkpoint-blocks applies to checkpointed cases; {} checkpoints no \
                         block",
                        case.name()
                    );
                }
                Some(model.with_checkpointed_blocks(blocks)?)
            }
        };
        let model = match (model, args.stream_budget_mib) {
            (model, None) => model,
            (None, Some(_)) => bail!("--stream-budget-mib needs --model"),
            (Some(model), Some(mib)) => {
                Some(model.with_stream_budget(crate::mib_to_bytes("--stream-budget-mib", mib)?))
            }
        };
        Ok(Options {
            device: args.device,
            batches: args.batches,
            cases: args.cases,
            all_cases: args.all_cases,
            model,
            seq: args.seq,
            unfused_loss: args.unfused_loss,
            protocol: Protocol {
                warmup: args.warmup,
                steps: args.steps.unwrap_or(CUDA_DEFAULTS.steps),
                bucket_bytes,
                budget: None,
                op_profile: args.op_profile,
                record_events: args.trace.is_some(),
            },
            steps_given: args.steps.is_some(),
            budgets: args.budgets,
            json: args.json,
            html: args.html,
            pytorch: args.pytorch,
            trace: args.trace,
            progress: true,
            defer_index_checks: args.defer_index_checks,
            copy_engine_copies: args.copy_engine_copies,
            command,
        })
    }

    /// Checks, before any case runs, that the output paths can be written.
    pub(crate) fn check_outputs(&self) -> Result<()> {
        for (flag, path) in [("--json", &self.json), ("--html", &self.html)] {
            if let Some(path) = path {
                output_paths::check_file(flag, path)?;
            }
        }
        if let Some(dir) = &self.trace {
            output_paths::check_folder("--trace", dir)?;
        }
        Ok(())
    }

    /// The options on a device with `defaults`: the protocol's timed steps are its default
    /// unless `--steps` was given.
    pub(crate) fn on_device(&self, defaults: &Defaults) -> Options {
        let mut options = self.clone();
        if !self.steps_given {
            options.protocol.steps = defaults.steps;
        }
        options
    }

    /// The (batch, cases) the options run on a device with `defaults`; an error, before any
    /// case runs, for a case named on `--cases` or an option (`--op-profile`) that the device
    /// cannot run.
    pub(crate) fn runs(&self, defaults: &Defaults) -> Result<Vec<(usize, Vec<Case>)>> {
        Case::refuse_cuda_only(&self.cases, defaults.cuda)?;
        if self.protocol.op_profile && !defaults.cuda {
            bail!(
                "--op-profile: it times every backend primitive with CUDA events, and this run is \
                 on the CPU backend (--device cpu, or no CUDA device answered); leave it out, or \
                 run on a GPU"
            );
        }
        let asked = |defaults_cases: &[Case]| -> Vec<Case> {
            if !self.cases.is_empty() {
                self.cases.clone()
            } else if self.all_cases {
                defaults.every_case()
            } else {
                defaults.cases_at(defaults_cases)
            }
        };
        if !self.batches.is_empty() {
            // The batches given, each with the union of the default batches' cases.
            let union: Vec<Case> = {
                let every: Vec<Case> = defaults
                    .runs
                    .iter()
                    .flat_map(|(_, cases)| asked(cases))
                    .collect();
                Case::ALL
                    .into_iter()
                    .filter(|case| every.contains(case))
                    .collect()
            };
            return Ok(self
                .batches
                .iter()
                .map(|&batch| (batch, union.clone()))
                .collect());
        }
        Ok(defaults
            .runs
            .iter()
            .map(|(batch, cases)| (*batch, asked(cases)))
            .collect())
    }
}

/// `--model`'s parser: the names of [`Model::NAMES`] (which `--help` lists).
fn model_parser() -> impl TypedValueParser<Value = Model> {
    PossibleValuesParser::new(Model::NAMES).try_map(|name| Model::named(&name))
}

/// `bench-memory --help`'s description.
fn long_about() -> String {
    "Peak allocated and reserved bytes, where the memory goes and step time, per optimizer and \
     technique, on a ViT, GPT-2 or Llama, beside PyTorch's figures (--pytorch).\n\n\
     Trains a model (ViT: loss = model(x).sum(); GPT-2 and the Llama shapes (llama-3.2-1b, \
     llama-3.2-3b, llama-3.1-8b, qwen2.5-14b, qwen2.5-32b, llama-3.1-70b; llama-tiny and \
     qwen2-tiny for the CPU): Hugging Face's \
     causal-LM loss on --seq random tokens a row, dropout off, the head fused with the loss \
     unless --unfused-loss) with each case's optimizer and technique: per case, a fresh model \
     and optimizer, --warmup steps (their peak is the first-3 peak), --steps timed steps \
     (steady peak allocated and reserved, median step time), then one traced step (memory \
     by phase and by component at the peak), and one more forward that names every tensor the \
     last block saves (for a Llama beside nn's formula of a block's bytes a token), and for a \
     language model one more forward and backward of the loss alone (its logits' bytes at their \
     peak). Prints a Markdown table; --json, --html and --trace write files."
        .to_owned()
}

/// What `--help` says after the options: the devices' defaults.
fn defaults_help() -> String {
    format!(
        "Defaults:\n  CUDA: {}\n  CPU:  {} (under a minute on two idle cores; --all-cases runs \
         every case at both batches, several minutes)\n  The cases that need CUDA ({}) and \
         --op-profile are refused on the CPU before anything runs.",
        CUDA_DEFAULTS.describe(),
        CPU_DEFAULTS.describe(),
        Case::ALL
            .iter()
            .filter(|case| case.needs_cuda())
            .map(|case| case.name())
            .collect::<Vec<_>>()
            .join(", ")
    )
}
