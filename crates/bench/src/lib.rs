//! Headroom's measurements, one [`Command`] each: `bench-memory` (peak memory, where it goes and
//! step time, per optimizer and technique, beside PyTorch's figures), `find-max-batch` (the
//! largest batch each case trains at under a memory cap) and `replay-trace` (a PyTorch allocator
//! trace through Headroom's allocator on simulated memory).
//!
//! Each command is one module with its usage text and a `run(args)` entry point, called by this
//! crate's binary (`headroom-bench <command> [options]`), which `cargo xtask <command>` builds in
//! release and runs, so what is timed is optimised code. It sits on top of the library crates
//! (models, optimizers, techniques, both backends with CUDA compiled in) and may use anyhow; no
//! library crate depends on it. It knows nothing about the workspace's other tasks (xtask's
//! `tidy`, `tables`, `build-kernels`), which read the JSON it writes from files only.

mod bench_memory;
mod find_max_batch;
mod replay_trace;

use anyhow::{bail, Result};

/// One measurement, by its command name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `bench-memory`: trains a model with each optimizer and technique and reports, per case,
    /// peak allocated and reserved bytes, step time and where the memory goes.
    BenchMemory,
    /// `find-max-batch`: the largest batch each bench-memory case trains at under a memory cap
    /// the allocator enforces.
    FindMaxBatch,
    /// `replay-trace`: a PyTorch allocator trace through Headroom's caching allocator on
    /// simulated memory.
    ReplayTrace,
}

impl Command {
    /// Every command, in the order the usage lists them.
    pub const ALL: [Command; 3] = [
        Command::BenchMemory,
        Command::FindMaxBatch,
        Command::ReplayTrace,
    ];

    /// The command's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Command::BenchMemory => "bench-memory",
            Command::FindMaxBatch => "find-max-batch",
            Command::ReplayTrace => "replay-trace",
        }
    }

    /// The command named `name`, if there is one.
    pub fn named(name: &str) -> Option<Command> {
        Command::ALL
            .into_iter()
            .find(|command| command.name() == name)
    }

    /// The command's options and what it does, as its `--help` prints them (indented, for a
    /// list of commands).
    pub fn usage(self) -> &'static str {
        match self {
            Command::BenchMemory => bench_memory::USAGE,
            Command::FindMaxBatch => find_max_batch::USAGE,
            Command::ReplayTrace => replay_trace::USAGE,
        }
    }

    /// Runs the command with `args` (what follows its name on the command line).
    pub fn run(self, args: &[String]) -> Result<()> {
        match self {
            Command::BenchMemory => bench_memory::run(args),
            Command::FindMaxBatch => find_max_batch::run(args),
            Command::ReplayTrace => replay_trace::run(args),
        }
    }
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
