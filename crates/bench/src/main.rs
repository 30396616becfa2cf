//! `headroom-bench <command> [options]`: the measurements of [`headroom_bench`], one subcommand
//! each ([`headroom_bench::Cli`]). `cargo xtask bench-memory | find-max-batch | replay-trace`
//! builds this binary in release and runs it with the same arguments; on a GPU machine without
//! cargo it runs alone (`scripts/gpu-measure.sh`).
//!
//! `--help` prints to stdout and exits 0; a mistake on the command line is clap's message and
//! exit status 2; an error while running is one line, `error: ` and the error's chain, and exit
//! status 1, with no backtrace (whatever `RUST_BACKTRACE` says).

use std::process::ExitCode;

use clap::Parser;
use headroom_bench::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    let command_line = format!("cargo xtask {}", arguments.join(" "));
    match cli.run(command_line) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
