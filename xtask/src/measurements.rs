//! `cargo xtask bench-memory | find-max-batch | replay-trace`: the measurements, which live in
//! `crates/bench` (package `headroom-bench`). xtask does not link them: it runs
//! `cargo run --release -p headroom-bench -- <command> <args>` with the arguments it was given,
//! in the directory it was started in (relative paths mean what they meant), and exits as that
//! run exits. So `cargo xtask tidy` and `cargo xtask tables` build no model, optimizer or CUDA
//! code, while what a measurement times is optimised code.
//!
//! It knows the commands' names and one line about each; their options are headroom-bench's
//! (`cargo xtask <command> --help`).

use std::process::Command;

use anyhow::{Context, Result};

use crate::project_root;

/// The commands headroom-bench's binary runs.
pub(crate) const COMMANDS: [&str; 3] = ["bench-memory", "find-max-batch", "replay-trace"];

/// Their lines in `cargo xtask --help`.
pub(crate) const USAGE: &str = "  bench-memory [options]
      Peak allocated and reserved bytes, where the memory goes and step time, per optimizer and
      technique, on a ViT or GPT-2, beside PyTorch's figures (--pytorch).
  find-max-batch [options]
      The largest batch each bench-memory case trains at under a memory cap.
  replay-trace FILE [options] | replay-trace --corpus [--json]
      A PyTorch allocator trace through Headroom's caching allocator on simulated memory.
    These three are crates/bench's binary (headroom-bench), built in release with CUDA compiled
    in (a GPU is used when one answers); `cargo xtask <command> --help` lists a command's
    options.
";

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

    /// xtask forwards exactly the commands headroom-bench's binary knows.
    #[test]
    fn the_forwarded_commands_are_headroom_benchs() {
        let theirs: Vec<&str> = headroom_bench::Command::ALL
            .iter()
            .map(|command| command.name())
            .collect();
        assert_eq!(super::COMMANDS.to_vec(), theirs);
    }
}
