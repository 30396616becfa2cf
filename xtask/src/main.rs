//! Workspace tasks, run as `cargo xtask <command>` (the alias lives in `.cargo/config.toml`).
//!
//! Each command is one module with a `run(args)` entry point. xtask sits on top of the library
//! crates and may use anyhow; no library crate depends on it.

mod bench_memory;
mod build_kernels;
mod find_max_batch;
mod replay_trace;
mod tables;
mod tidy;

use anyhow::{bail, Result};

const USAGE_HEAD: &str = "usage: cargo xtask <command> [options]\n\ncommands:\n";

const USAGE: &str = "  build-kernels [--check]
      Compiles crates/ops-cuda/kernels/*.cu to the committed PTX (installing nvcc 13.0 with pip
      when none is found); --check only tells whether the committed PTX matches the sources.
  tidy
      Checks the house rules: `//!` headers, no utils/helpers modules, the code map, crate
      dependencies down the layers (testkit in dev-dependencies only).
";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(command) = args.next() else {
        print!("{}", usage());
        return Ok(());
    };
    let rest: Vec<String> = args.collect();
    match command.as_str() {
        "bench-memory" => bench_memory::run(&rest),
        "replay-trace" => replay_trace::run(&rest),
        "find-max-batch" => find_max_batch::run(&rest),
        "build-kernels" => build_kernels::run(&rest),
        "tables" => tables::run(&rest),
        "tidy" => tidy::run(),
        "help" | "--help" | "-h" => {
            print!("{}", usage());
            Ok(())
        }
        other => bail!("unknown command `{other}`\n\n{}", usage()),
    }
}

fn usage() -> String {
    format!(
        "{USAGE_HEAD}{}{}{}{}{USAGE}",
        bench_memory::USAGE,
        find_max_batch::USAGE,
        replay_trace::USAGE,
        tables::USAGE
    )
}

/// The workspace root (xtask lives one folder below it).
fn project_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits inside the workspace")
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
