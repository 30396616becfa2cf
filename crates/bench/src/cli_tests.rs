//! The command line as a whole: every command's `--help` is a success (exit status 0) whose text
//! is generated from the tables the errors use (the cases with their summaries, the models, the
//! devices' defaults), and the commands are the three xtask forwards. The commands' own tests
//! check their options with [`args`] and [`assert_rejected`].

use clap::error::ErrorKind;
use clap::CommandFactory;

use crate::bench_memory::cases::Case;
use crate::bench_memory::models::Model;
use crate::{parse_command_line, Cli};

/// `list` as the owned words a command's options are parsed from.
pub(crate) fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Each `(arguments, message)` of `rejected`: `parse` refuses the arguments with an error whose
/// chain (`{:#}`) contains the message.
pub(crate) fn assert_rejected<T: std::fmt::Debug>(
    parse: impl Fn(&[String]) -> anyhow::Result<T>,
    rejected: &[(&[&str], &str)],
) {
    for &(bad, message) in rejected {
        let err = format!("{:#}", parse(&args(bad)).unwrap_err());
        assert!(err.contains(message), "{bad:?}: {err}");
    }
}

/// Whether `text` lists `case` as a possible value with its summary (`- name:   summary`).
fn lists(text: &str, case: Case) -> bool {
    let head = format!("- {}:", case.name());
    text.lines().any(|line| {
        line.trim_start()
            .strip_prefix(&head)
            .is_some_and(|rest| rest.trim() == case.summary())
    })
}

/// `words`' help text, checked to be a request for help that exits 0.
fn help(words: &[&str]) -> String {
    let err = parse_command_line(words).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DisplayHelp, "{words:?}: {err}");
    assert_eq!(err.exit_code(), 0, "{words:?}");
    err.render().to_string()
}

#[test]
fn the_commands_are_bench_memory_find_max_batch_and_replay_trace() {
    let names: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|command| command.get_name().to_owned())
        .collect();
    assert_eq!(
        names,
        ["bench-memory", "find-max-batch", "replay-trace", "plan"]
    );
    let text = help(&["--help"]);
    for name in &names {
        assert!(text.contains(name.as_str()), "{text}");
    }
    Cli::command().debug_assert();
}

/// bench-memory's `--help` lists every case with its summary (the four the hand-written usage
/// left out among them), every model, and each device's defaults from their constants.
#[test]
fn bench_memory_help_lists_every_case_model_and_default() {
    let text = help(&["bench-memory", "--help"]);
    for case in Case::ALL {
        assert!(lists(&text, case), "missing {case:?} in:\n{text}");
    }
    for model in Model::NAMES {
        assert!(text.contains(model), "missing {model} in:\n{text}");
    }
    assert!(
        text.contains(
            "CPU:  vit_mini, batch 1: adam_foreach, adam_foreach_unbounded, adam_single, \
             adam_fused, adam8bit; batch 32: adam_fused, adam_inbwd, adam_ckpt, adam_auto"
        ),
        "{text}"
    );
    assert!(
        text.contains("CUDA: vit_l_16, batch 1: every case; batch 32: every case"),
        "{text}"
    );
    assert!(text.contains("--all-cases"), "{text}");
    // The language models' loss is fused unless --unfused-loss.
    assert!(text.contains("--unfused-loss"), "{text}");
    // The short form is a success too.
    help(&["bench-memory", "-h"]);
}

/// find-max-batch's `--help` lists every case but adam_auto, which it refuses.
#[test]
fn find_max_batch_help_lists_the_cases_it_accepts() {
    let text = help(&["find-max-batch", "--help"]);
    for case in Case::ALL {
        assert_eq!(
            lists(&text, case),
            case != Case::AdamAuto,
            "{case:?}:\n{text}"
        );
    }
}

#[test]
fn replay_trace_help_is_a_success() {
    let text = help(&["replay-trace", "--help"]);
    assert!(text.contains("--corpus"), "{text}");
    help(&["help", "replay-trace"]);
}
