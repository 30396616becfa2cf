//! Workspace tasks, run as `cargo xtask <command>` (the alias lives in `.cargo/config.toml`).
//!
//! Each task is one module with a `run(args)` entry point. The measurements (`bench-memory`,
//! `find-max-batch`, `replay-trace`) live in `crates/bench`: [`measurements`] hands them to its
//! binary, built in release, so that xtask itself stays small and builds in debug (`tidy` and
//! `tables` compile no CUDA code). xtask sits on top of the library crates and may use anyhow; no
//! library crate depends on it.

mod build_kernels;
mod measurements;
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
    if measurements::COMMANDS.contains(&command.as_str()) {
        return measurements::run(&command, &rest);
    }
    match command.as_str() {
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
        "{USAGE_HEAD}{}{}{USAGE}",
        measurements::USAGE,
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
