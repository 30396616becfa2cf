//! Headroom's measurements, one subcommand each: `bench-memory` (peak memory, where it goes and
//! step time, per optimizer and technique, beside PyTorch's figures), `find-max-batch` (the
//! largest batch each case trains at under a memory cap), `replay-trace` (a PyTorch allocator
//! trace through Headroom's allocator on simulated memory), and `plan` (the bf16 AdamW recipe
//! and the blocks to recompute predicted fastest for a Llama-shaped model under a memory cap,
//! measured with `--run`).
//!
//! The command line is [`Cli`], declared with clap: each command's options are one `Args`
//! struct in its module, and its `--help` is generated from the same tables its errors name
//! (the cases, the models, the devices). This crate's binary (`headroom-bench <command>
//! [options]`) parses it and runs it; `cargo xtask <command>` builds that binary in release and
//! runs it, so what is timed is optimised code. A command checks what it can before it measures
//! anything: the output paths it will write (`output_paths.rs`), `HEADROOM_ALLOC_CONF`
//! (`allocator_config_from_env`), cases the device cannot run.
//!
//! It sits on top of the library crates (models, optimizers, techniques, both backends with CUDA
//! compiled in) and may use anyhow; no library crate depends on it. It knows nothing about the
//! workspace's other tasks (xtask's `tidy`, `tables`, `build-kernels`), which read the JSON it
//! writes from files only.

mod bench_memory;
mod find_max_batch;
mod output_paths;
mod plan;
mod replay_trace;

#[cfg(test)]
mod cli_tests;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use headroom_caching_allocator::{AllocatorConfig, ALLOC_CONF_ENV};

/// `headroom-bench <command> [options]`: the command line of this crate's binary.
#[derive(Debug, Parser)]
#[command(
    name = "headroom-bench",
    about = "Headroom's measurements (also run as `cargo xtask <command> [options]`)",
    // `cargo xtask bench-memory ...` is how most people run it: the usage line says both.
    override_usage = "headroom-bench <COMMAND> [OPTIONS]\n       cargo xtask <COMMAND> [OPTIONS]"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// One measurement and its options.
#[derive(Debug, Subcommand)]
enum Command {
    BenchMemory(bench_memory::Args),
    FindMaxBatch(find_max_batch::Args),
    ReplayTrace(replay_trace::Args),
    Plan(plan::Args),
}

impl Cli {
    /// Runs the command that was parsed. `command_line` is what the JSON documents record as the
    /// command (e.g. `cargo xtask bench-memory --batch 1`).
    pub fn run(self, command_line: String) -> Result<()> {
        match self.command {
            Command::BenchMemory(args) => bench_memory::run(args, command_line),
            Command::FindMaxBatch(args) => find_max_batch::run(args, command_line),
            Command::ReplayTrace(args) => replay_trace::run(args),
            Command::Plan(args) => plan::run(args),
        }
    }
}

/// `headroom-bench` followed by `words`, parsed as the binary parses its command line (`plan
/// --run` runs bench-memory this way).
fn parse_command_line(words: &[&str]) -> Result<Command, clap::Error> {
    Cli::try_parse_from(std::iter::once("headroom-bench").chain(words.iter().copied()))
        .map(|cli| cli.command)
}

/// Every bench-memory case, in report order, as (its name, the name of `torch_reference.py`'s
/// case it is compared with): the names its `--json` files hold and PyTorch's anchors match on.
pub fn bench_memory_case_names() -> Vec<(&'static str, &'static str)> {
    bench_memory::cases::Case::ALL
        .into_iter()
        .map(|case| (case.name(), case.pytorch_name()))
        .collect()
}

/// The workspace root (this crate lives two folders below it).
fn project_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/bench sits inside the workspace")
        .to_path_buf()
}

/// The allocator settings of `HEADROOM_ALLOC_CONF` (Headroom's defaults when it is unset), read
/// before any measurement: a malformed value is an error that names the variable and its value,
/// never a reason to fall back to another device.
fn allocator_config_from_env() -> Result<AllocatorConfig> {
    AllocatorConfig::from_env().map_err(|err| {
        let variable = match std::env::var_os(ALLOC_CONF_ENV) {
            Some(value) => format!("{ALLOC_CONF_ENV}={value:?}"),
            None => ALLOC_CONF_ENV.to_owned(),
        };
        anyhow::anyhow!(
            "{variable}: {:#}; fix or unset {ALLOC_CONF_ENV} (PYTORCH_CUDA_ALLOC_CONF's syntax, \
             e.g. expandable_segments:True,max_split_size_mb:512)",
            anyhow::Error::new(err)
        )
    })
}

/// `mib` MiB in bytes, for the option `flag`: an error naming the flag where the bytes would not
/// fit in a `u64` (a wrapped product would silently become a tiny cap or a zero bucket).
fn mib_to_bytes(flag: &str, mib: u64) -> Result<u64> {
    match mib.checked_mul(1 << 20) {
        Some(bytes) => Ok(bytes),
        None => bail!(
            "{flag} {mib}: too large to count in bytes (at most {} MiB)",
            u64::MAX >> 20
        ),
    }
}

/// `path`'s text through `parse`, its errors naming the file (the JSON lines PyTorch's scripts
/// write: `torch_reference.py`'s anchors, `find_max_batch.py`'s results).
fn read_parsed<T>(path: &std::path::Path, parse: impl FnOnce(&str) -> Result<T>) -> Result<T> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The JSON objects among `text`'s lines, in order: a line that does not start with `{` (a
/// script's warnings) is skipped, one that does but is not JSON is an error naming its number.
fn json_object_lines(text: &str) -> impl Iterator<Item = Result<serde_json::Value>> + '_ {
    text.lines()
        .enumerate()
        .filter(|(_, line)| line.trim_start().starts_with('{'))
        .map(|(n, line)| {
            serde_json::from_str(line).with_context(|| format!("line {} is not JSON", n + 1))
        })
}

/// A whole number of at least 1, for clap's value parsers (`--batch`, `--steps`, ...).
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(err) => Err(format!("not a whole number ({err})")),
    }
}
