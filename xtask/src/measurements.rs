//! `cargo xtask bench-memory | find-max-batch | replay-trace | plan`: the measurements (and the
//! planner), which live in `crates/bench` (package `headroom-bench`). xtask does not link them:
//! it runs `cargo run --release -p headroom-bench -- <command> <args>` with the arguments it was
//! given, in the directory it was started in (relative paths mean what they meant), and exits as
//! that run exits. So `cargo xtask tidy` and `cargo xtask tables` build no model, optimizer or CUDA
//! code, while what a measurement times is optimised code.
//!
//! It knows the commands' names and one line about each (`cargo xtask --help`); their options
//! are headroom-bench's, and `cargo xtask <command> --help` is passed on to it like any other
//! argument, so the help printed is the binary's own.

use std::process::Command;

use anyhow::{Context, Result};

use crate::project_root;

/// A measurement's arguments, passed on untouched (`--help` among them).
#[derive(Debug, clap::Args)]
pub(crate) struct Forwarded {
    /// headroom-bench's options for the command.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "OPTIONS"
    )]
    pub(crate) args: Vec<String>,
}

/// What `cargo xtask help <command>` says of the measurement `command`'s options.
pub(crate) fn forwarded_help(command: &str) -> String {
    format!(
        "Its options are headroom-bench's (crates/bench): `cargo xtask {command} --help` builds \
         that binary in release and prints them."
    )
}

/// Runs `command` with `args` through headroom-bench's binary, in release; exits with its status
/// when it fails (it has printed its error).
pub(crate) fn run(command: &str, args: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let status = Command::new(&cargo)
        .args(cargo_args(command, args))
        .status()
        .with_context(|| format!("running {cargo}"))?;
    if !status.success() {
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}

/// The arguments of the `cargo` call that runs `command` with `args`.
fn cargo_args(command: &str, args: &[String]) -> Vec<String> {
    let manifest = project_root().join("Cargo.toml");
    let mut cargo_args: Vec<String> = [
        "run",
        "--release",
        "--package",
        "headroom-bench",
        "--bin",
        "headroom-bench",
        "--manifest-path",
    ]
    .map(str::to_owned)
    .into();
    cargo_args.push(manifest.display().to_string());
    cargo_args.push("--".to_owned());
    cargo_args.push(command.to_owned());
    cargo_args.extend(args.iter().cloned());
    cargo_args
}

#[cfg(test)]
mod tests {
    /// Each command goes to headroom-bench's binary in release, through the workspace's
    /// manifest, its arguments after `--` unchanged (a flag of the command is not cargo's).
    #[test]
    fn a_command_runs_headroom_benchs_binary_in_release_with_its_arguments() {
        let args = [
            "--json".to_owned(),
            "out.json".to_owned(),
            "--release".to_owned(),
        ];
        let cargo_args = super::cargo_args("bench-memory", &args);
        let split = cargo_args.iter().position(|arg| arg == "--").unwrap();
        let (cargo_side, command_side) = cargo_args.split_at(split);
        assert_eq!(
            command_side,
            ["--", "bench-memory", "--json", "out.json", "--release"]
        );
        let manifest = super::project_root()
            .join("Cargo.toml")
            .display()
            .to_string();
        let pairs: Vec<[&str; 2]> = cargo_side
            .windows(2)
            .map(|pair| [pair[0].as_str(), pair[1].as_str()])
            .collect();
        assert_eq!(cargo_side[..2], ["run", "--release"]);
        assert!(pairs.contains(&["--package", "headroom-bench"]));
        assert!(pairs.contains(&["--bin", "headroom-bench"]));
        assert!(pairs.contains(&["--manifest-path", manifest.as_str()]));
    }

    /// xtask forwards exactly the commands headroom-bench's binary knows, each with its help
    /// flag left to headroom-bench.
    #[test]
    fn the_forwarded_commands_are_headroom_benchs() {
        use clap::CommandFactory;

        let names = |command: clap::Command| -> Vec<String> {
            command
                .get_subcommands()
                .filter(|sub| sub.get_name() != "help")
                .map(|sub| sub.get_name().to_owned())
                .collect()
        };
        let theirs = names(headroom_bench::Cli::command());
        let ours: Vec<String> = crate::Cli::command()
            .get_subcommands()
            .filter(|sub| sub.is_disable_help_flag_set())
            .map(|sub| sub.get_name().to_owned())
            .collect();
        assert_eq!(ours, theirs);
    }
}
