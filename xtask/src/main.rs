//! Workspace tasks, run as `cargo xtask <command>` (the alias lives in `.cargo/config.toml`).
//!
//! The command line is [`Cli`], declared with clap: every task's `--help` is generated from it
//! and exits 0. Each task is one module with a `run` entry point. The measurements
//! (`bench-memory`, `find-max-batch`, `replay-trace`, `plan`) live in `crates/bench`:
//! [`measurements`] hands them, with their arguments untouched (`--help` included), to its binary, built in
//! release, so that xtask itself stays small and builds in debug (`tidy` and `tables` compile no
//! CUDA code). An error is printed as one line, `error: ` and its chain, with exit status 1 and
//! no backtrace. xtask sits on top of the library crates and may use anyhow; no library crate
//! depends on it.

mod build_kernels;
mod measurements;
mod tables;
mod tidy;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// `cargo xtask <command> [options]`.
#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Headroom's workspace tasks"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

/// One task.
#[derive(Debug, Subcommand)]
enum Task {
    /// Peak allocated and reserved bytes, where the memory goes and step time, per optimizer and
    /// technique, on a ViT, GPT-2 or Llama, beside PyTorch's figures.
    #[command(
        disable_help_flag = true,
        after_help = measurements::forwarded_help("bench-memory")
    )]
    BenchMemory(measurements::Forwarded),
    /// The largest batch each bench-memory case trains at under a memory cap.
    #[command(
        disable_help_flag = true,
        after_help = measurements::forwarded_help("find-max-batch")
    )]
    FindMaxBatch(measurements::Forwarded),
    /// A PyTorch allocator trace through Headroom's caching allocator on simulated memory.
    #[command(
        disable_help_flag = true,
        after_help = measurements::forwarded_help("replay-trace")
    )]
    ReplayTrace(measurements::Forwarded),
    /// The fastest bf16 AdamW recipe whose predicted peak fits a Llama-shaped model under a cap.
    #[command(
        disable_help_flag = true,
        after_help = measurements::forwarded_help("plan")
    )]
    Plan(measurements::Forwarded),
    /// Renders each measured table of the READMEs from its committed raw result.
    #[command(long_about = tables::LONG_ABOUT, after_long_help = tables::kinds_help())]
    Tables {
        /// Changes nothing; fails naming each stale block.
        #[arg(long)]
        check: bool,
    },
    /// Checks the house rules: `//!` headers, no utils/helpers modules, the code map, crate
    /// dependencies down the layers (testkit in dev-dependencies only), README tables.
    Tidy,
    /// Compiles crates/*/kernels/*.cu to the committed PTX.
    #[command(long_about = build_kernels::LONG_ABOUT)]
    BuildKernels {
        /// Only tells whether the committed PTX matches the sources (no nvcc needed).
        #[arg(long)]
        check: bool,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse().task) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(task: Task) -> Result<()> {
    match task {
        Task::BenchMemory(forwarded) => measurements::run("bench-memory", &forwarded.args),
        Task::FindMaxBatch(forwarded) => measurements::run("find-max-batch", &forwarded.args),
        Task::ReplayTrace(forwarded) => measurements::run("replay-trace", &forwarded.args),
        Task::Plan(forwarded) => measurements::run("plan", &forwarded.args),
        Task::Tables { check } => tables::run(check),
        Task::Tidy => tidy::run(),
        Task::BuildKernels { check } => build_kernels::run(check),
    }
}

/// The workspace root (xtask lives one folder below it).
fn project_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits inside the workspace")
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::{CommandFactory, Parser};

    use super::{Cli, Task};

    fn parse(words: &[&str]) -> Result<Task, clap::Error> {
        Cli::try_parse_from(std::iter::once("xtask").chain(words.iter().copied()))
            .map(|cli| cli.task)
    }

    /// xtask's own tasks print their help and exit 0 (`tidy --help` does not run tidy).
    #[test]
    fn every_tasks_help_exits_0() {
        Cli::command().debug_assert();
        for words in [
            &["--help"][..],
            &["-h"],
            &["help"],
            &["tidy", "--help"],
            &["tables", "--help"],
            &["build-kernels", "--help"],
            &["build-kernels", "-h"],
            &["help", "tidy"],
        ] {
            let err = parse(words).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::DisplayHelp, "{words:?}: {err}");
            assert_eq!(err.exit_code(), 0, "{words:?}");
        }
        let tables = parse(&["tables", "--help"])
            .unwrap_err()
            .render()
            .to_string();
        assert!(
            tables.contains("Kinds (xtask/src/tables/kinds/)"),
            "{tables}"
        );
    }

    /// The measurements' arguments, `--help` among them, go to headroom-bench untouched.
    #[test]
    fn the_measurements_arguments_pass_through_untouched() {
        let words = ["--help", "--batch", "1,32", "--cases", "sgd", "-h"];
        for name in ["bench-memory", "find-max-batch", "replay-trace", "plan"] {
            let task = parse(&[&[name][..], &words].concat()).unwrap();
            let (Task::BenchMemory(forwarded)
            | Task::FindMaxBatch(forwarded)
            | Task::ReplayTrace(forwarded)
            | Task::Plan(forwarded)) = task
            else {
                panic!("{name} parsed as {task:?}");
            };
            assert_eq!(forwarded.args, words);
        }
        let Task::BenchMemory(none) = parse(&["bench-memory"]).unwrap() else {
            panic!("bench-memory without arguments");
        };
        assert!(none.args.is_empty());
    }

    /// Flags and tasks xtask does not know are clap's errors (exit status 2), not a run.
    #[test]
    fn unknown_tasks_and_flags_are_refused() {
        for words in [
            &["frobnicate"][..],
            &["tidy", "--fix"],
            &["tables", "x"],
            &["build-kernels", "--chek"],
        ] {
            let err = parse(words).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{words:?}: {err}");
        }
        assert!(matches!(
            parse(&["tables", "--check"]),
            Ok(Task::Tables { check: true })
        ));
        assert!(matches!(
            parse(&["build-kernels"]),
            Ok(Task::BuildKernels { check: false })
        ));
    }
}
