//! headroom-bench's binary as a user meets it: every command's `--help` prints to stdout and
//! exits 0; a mistake found before measuring (a malformed `HEADROOM_ALLOC_CONF`, an output path
//! that cannot be written, a CUDA-only case on the CPU) is one line, `error: ...`, naming the
//! variable or flag at fault, with exit status 1, no backtrace even under `RUST_BACKTRACE=1`,
//! and nothing measured (no device line, no table); a malformed option is clap's error, exit 2;
//! a planned case's report is printed once.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the binary with `args` and `HEADROOM_ALLOC_CONF` set to `alloc_conf` (unset: `None`),
/// with backtraces asked for.
fn run(args: &[&str], alloc_conf: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_headroom-bench"));
    command.args(args).env("RUST_BACKTRACE", "1");
    match alloc_conf {
        Some(value) => command.env("HEADROOM_ALLOC_CONF", value),
        None => command.env_remove("HEADROOM_ALLOC_CONF"),
    };
    command.output().expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Checks that `output` failed before measuring with exactly one line on stderr, which starts
/// with `expected`; returns that line.
fn one_line_error(output: &Output, expected: &str) -> String {
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert_eq!(output.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stdout, "", "nothing is measured or printed");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line, no backtrace: {stderr}");
    assert!(lines[0].starts_with(expected), "{stderr}");
    lines[0].to_owned()
}

/// A scratch folder for this test.
fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("headroom-bench-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_commands_help_exits_0_on_stdout() {
    let mut calls = vec![
        vec!["--help"],
        vec!["-h"],
        vec!["help"],
        vec!["help", "bench-memory"],
    ];
    for command in ["bench-memory", "find-max-batch", "replay-trace"] {
        for flag in ["--help", "-h"] {
            calls.push(vec![command, flag]);
        }
    }
    for args in &calls {
        let output = run(args, None);
        let stdout = text(&output.stdout);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {output:?}");
        assert!(stdout.contains("Usage:"), "{args:?}: {stdout}");
        assert_eq!(text(&output.stderr), "", "{args:?}");
    }
    let listed = text(&run(&["bench-memory", "--help"], None).stdout);
    for (case, _) in headroom_bench::bench_memory_case_names() {
        assert!(listed.contains(&format!("- {case}:")), "{case}: {listed}");
    }
}

#[test]
fn a_malformed_alloc_conf_is_named_before_any_device() {
    let line = one_line_error(
        &run(&["bench-memory"], Some("bogus_key:1")),
        "error: HEADROOM_ALLOC_CONF=\"bogus_key:1\": ",
    );
    assert_eq!(
        line,
        "error: HEADROOM_ALLOC_CONF=\"bogus_key:1\": invalid allocator setting `bogus_key`: \
         unknown option; fix or unset HEADROOM_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF's syntax, \
         e.g. expandable_segments:True,max_split_size_mb:512)"
    );
    let line = one_line_error(
        &run(&["bench-memory"], Some("max_split_size_mb:abc")),
        "error: HEADROOM_ALLOC_CONF=\"max_split_size_mb:abc\": ",
    );
    assert!(
        line.contains("`max_split_size_mb`: expected a whole number, got `abc`"),
        "{line}"
    );
    one_line_error(
        &run(&["find-max-batch", "--device", "cpu"], Some("bogus_key:1")),
        "error: HEADROOM_ALLOC_CONF=\"bogus_key:1\": ",
    );
}

#[test]
fn an_unwritable_output_fails_before_any_work() {
    let dir = scratch("unwritable");
    let blocker = dir.join("a-file");
    std::fs::write(&blocker, "").unwrap();
    let json = blocker.join("out.json");
    let json = json.to_str().unwrap();
    one_line_error(
        &run(&["bench-memory", "--json", json], None),
        &format!("error: --json {json}: cannot write there (give a path in a writable folder): "),
    );
    one_line_error(
        &run(&["bench-memory", "--device", "cpu", "--html", json], None),
        &format!("error: --html {json}: cannot write there (give a path in a writable folder): "),
    );
    one_line_error(
        &run(&["find-max-batch", "--device", "cpu", "--json", json], None),
        &format!("error: --json {json}: cannot write there (give a path in a writable folder): "),
    );
    let trace = dir.join("trace.tsv");
    std::fs::write(&trace, "action\taddr\tsize\nalloc\t0\t512\n").unwrap();
    one_line_error(
        &run(
            &["replay-trace", trace.to_str().unwrap(), "--snapshot", json],
            None,
        ),
        &format!(
            "error: --snapshot {json}: cannot write there (give a path in a writable folder): "
        ),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_cuda_only_case_is_refused_on_the_cpu_before_any_work() {
    for command in ["bench-memory", "find-max-batch"] {
        one_line_error(
            &run(
                &[command, "--device", "cpu", "--cases", "sgd,adam_offload"],
                None,
            ),
            "error: --cases adam_offload: needs a CUDA device",
        );
    }
}

#[test]
fn a_malformed_option_is_clap_s_error_naming_it() {
    for (args, flag) in [
        (&["bench-memory", "--batch", "1,0"][..], "'--batch <N>'"),
        (&["bench-memory", "--cases", "adam"], "'--cases <CASE>'"),
        (
            &["find-max-batch", "--cases", "adam_auto"],
            "'--cases <CASE>'",
        ),
        (
            &["replay-trace", "--repeat", "0", "a.tsv"],
            "'--repeat <N>'",
        ),
    ] {
        let output = run(args, None);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: invalid value"), "{stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert_eq!(text(&output.stdout), "");
    }
}

/// A planned case's report (its plan, its table) is printed once, on stdout, with the table of
/// cases; stderr carries only the progress and the closing line.
#[test]
fn the_plan_is_reported_once() {
    let command = "bench-memory --device cpu --model vit_tiny --batch 4 --cases adam_auto \
                   --warmup 1 --steps 1";
    let words: Vec<&str> = command.split_whitespace().collect();
    let output = run(&words, None);
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let heading = "adam_auto vit_tiny batch 4: budget ";
    assert_eq!(stdout.matches(heading).count(), 1, "{stdout}");
    assert_eq!(stdout.matches("block  strategy").count(), 1, "{stdout}");
    assert!(!stderr.contains(heading), "{stderr}");
    assert!(!stderr.contains("block  strategy"), "{stderr}");
}
