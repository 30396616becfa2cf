//! `find-max-batch`'s command line: its options ([`Args`], declared with clap; `--cases` lists
//! bench-memory's cases but adam_auto, from the cases' table) and what they resolve to
//! ([`Options`]), with the devices' default caps. It knows nothing about the search.

use std::path::PathBuf;

use anyhow::Result;
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use crate::bench_memory::cases::Case;
use crate::bench_memory::models::Model;
use crate::bench_memory::DeviceChoice;

/// The largest batch each bench-memory case trains at under a memory cap the allocator
/// enforces.
#[derive(Debug, Clone, clap::Args)]
#[command(long_about = LONG_ABOUT)]
pub(crate) struct Args {
    /// Where to run: CUDA when a GPU answers, else the CPU backend (auto), or one of them.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// The model (default: vit_l_16 on CUDA, vit_mini on the CPU).
    #[arg(long, value_parser = PossibleValuesParser::new(Model::NAMES).try_map(|name| Model::named(&name)))]
    model: Option<Model>,
    /// A language model's tokens a row (default: 1024 for GPT-2, 2048 for the Llama shapes, 64
    /// for llama-tiny and qwen2-tiny).
    #[arg(long, value_name = "N", value_parser = crate::at_least_one)]
    seq: Option<usize>,
    /// Cases, by commas or repeated: bench-memory's, adam_auto excepted (it plans for a byte
    /// budget, not a batch) (default: every case the device runs).
    #[arg(long, value_name = "CASE", value_delimiter = ',', value_parser = batch_cases())]
    cases: Vec<Case>,
    /// The cap the allocator enforces, in MiB (default: 24576 on CUDA, 128 on the CPU).
    #[arg(long, value_name = "N", value_parser = crate::at_least_one)]
    memory_cap_mb: Option<usize>,
    /// No probe goes above this batch.
    #[arg(long, value_name = "N", default_value_t = 1 << 16, value_parser = crate::at_least_one)]
    max_batch: usize,
    /// Writes one object per case, rewritten after each case (checked writable before anything
    /// runs).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Reads the JSON lines of scripts/pytorch/find_max_batch.py and adds PyTorch's figures.
    #[arg(long, value_name = "FILE")]
    pytorch: Option<PathBuf>,
}

const LONG_ABOUT: &str = "The largest batch each bench-memory case trains at under a memory cap \
     the allocator enforces.\n\n\
     One step a probe (forward, backward, optimizer step) under a cap of --memory-cap-mb MiB \
     (per_process_memory_fraction). Doubling through batch 16, a probe where the line through \
     the measured allocated peaks reaches the cap, then galloping and bisection; every \
     out-of-memory error is caught and the allocator must come back to the case's baseline \
     bytes. --json writes one object per case (case, max_batch, peak_allocated_bytes at that \
     batch, ooms, seconds, every probe), rewritten after each case (`complete` is true once \
     every case ran).";

/// `--cases`' values: bench-memory's cases but adam_auto, each with its summary.
fn batch_cases() -> impl TypedValueParser<Value = Case> {
    let cases = Case::ALL
        .into_iter()
        .filter(|case| *case != Case::AdamAuto)
        .map(|case| PossibleValue::new(case.name()).help(case.summary()));
    PossibleValuesParser::new(cases).try_map(|name| Case::parse(&name))
}

/// Default caps in MiB.
pub(super) const CUDA_DEFAULT_CAP_MIB: u64 = 24 << 10;
pub(super) const CPU_DEFAULT_CAP_MIB: u64 = 128;

/// The parsed command line.
#[derive(Debug, Clone)]
pub(super) struct Options {
    pub(super) device: DeviceChoice,
    pub(super) model: Option<Model>,
    pub(super) seq: Option<usize>,
    /// Empty: every case the device runs.
    pub(super) cases: Vec<Case>,
    pub(super) cap_mib: Option<u64>,
    /// No probe goes above this batch.
    pub(super) max_batch: usize,
    pub(super) json: Option<PathBuf>,
    pub(super) pytorch: Option<PathBuf>,
    pub(super) command: String,
}

impl Options {
    /// The options `args` give (the cap checked to fit in bytes); `command` is the command line
    /// the JSON records.
    pub(super) fn new(args: Args, command: String) -> Result<Options> {
        let cap_mib = args.memory_cap_mb.map(|mib| mib as u64);
        if let Some(mib) = cap_mib {
            crate::mib_to_bytes("--memory-cap-mb", mib)?;
        }
        let model = match (args.model, args.seq) {
            (Some(model), Some(seq)) => Some(model.with_seq(seq)?),
            (model, _) => model,
        };
        Ok(Options {
            device: args.device,
            model,
            seq: args.seq,
            cases: args.cases,
            cap_mib,
            max_batch: args.max_batch,
            json: args.json,
            pytorch: args.pytorch,
            command,
        })
    }
}
