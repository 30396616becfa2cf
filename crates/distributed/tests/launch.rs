//! `headroom-launch` on this host: the ranks it starts find each other through the file
//! rendezvous, a failing rank stops the job, and `--help` answers.

use std::process::Command;

fn launch(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_headroom-launch"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn two_ranks_read_the_id_rank_0_published() {
    let out = launch(&["--nproc", "2", "--check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(
        lines[0].starts_with("rank 0 of 2 (local 0): id "),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with("rank 1 of 2 (local 1): id "),
        "{stdout}"
    );
    let id = |line: &str| line.rsplit(' ').next().unwrap().to_string();
    assert_eq!(id(lines[0]), id(lines[1]));
    assert_eq!(id(lines[0]).len(), 32);
}

#[test]
fn each_rank_gets_its_environment_and_a_failure_is_the_job_s() {
    let out = launch(&[
        "--nproc",
        "3",
        "--",
        "sh",
        "-c",
        // Rank 2 fails, which stops the job: it waits first, so that the other ranks have
        // printed before the launcher ends them (without it, a loaded machine lost rank 1's line).
        "echo $HEADROOM_RANK $HEADROOM_WORLD_SIZE $HEADROOM_LOCAL_RANK; \
         if [ $HEADROOM_RANK = 2 ]; then sleep 3; exit 7; fi",
    ]);
    assert_eq!(out.status.code(), Some(7));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["0 3 0", "1 3 1", "2 3 2"]);
}

#[test]
fn it_answers_help_and_refuses_bad_arguments() {
    let out = launch(&["--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("USAGE:"));
    let out = launch(&["--nproc", "two", "--check"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a number"));
    let out = launch(&["--nnodes", "2", "--nproc", "1", "--check"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rendezvous"));
}
