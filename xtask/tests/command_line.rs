//! xtask's binary as a user meets it: `--help` of xtask and of each of its own tasks prints to
//! stdout and exits 0 without running the task (`tidy --help` used to run tidy,
//! `build-kernels --help` to exit 1 with a backtrace); a task it does not know is clap's error,
//! exit status 2.

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("xtask runs")
}

#[test]
fn help_exits_0_and_runs_nothing() {
    for args in [
        &["--help"][..],
        &["-h"],
        &["tidy", "--help"],
        &["tidy", "-h"],
        &["build-kernels", "-h"],
        &["tables", "--help"],
        &["build-kernels", "--help"],
        &["help", "bench-memory"],
    ] {
        let output = run(args);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {output:?}");
        assert!(
            stdout.starts_with(char::is_alphabetic),
            "{args:?}: {stdout}"
        );
        assert!(stdout.contains("Usage: cargo xtask"), "{args:?}: {stdout}");
        assert!(!stdout.contains("tidy: ok"), "{args:?} ran tidy: {stdout}");
        assert_eq!(String::from_utf8_lossy(&output.stderr), "", "{args:?}");
    }
}

#[test]
fn an_unknown_task_is_refused_with_status_2() {
    let output = run(&["frobnicate"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: unrecognized subcommand 'frobnicate'"),
        "{stderr}"
    );
}
