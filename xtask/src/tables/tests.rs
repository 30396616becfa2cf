//! Tests of `cargo xtask tables`: the marker parser, stale and missing sources, the pending line,
//! provenance, and the command's arguments. Documents and results are written to a temporary
//! workspace root; the real one is checked by tidy's `the_workspace_is_tidy`.

use std::path::{Path, PathBuf};

use super::blocks::{self, Block, Source};
use super::{process, Counts};

/// A temporary workspace root with a `scripts/gpu-measure.sh` of two phases, removed on drop.
struct Root(PathBuf);

impl Root {
    fn new(name: &str) -> Root {
        let path =
            std::env::temp_dir().join(format!("headroom-tables-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        let root = Root(path);
        root.write(
            "scripts/gpu-measure.sh",
            "for phase in \"$@\"; do\n  case $phase in\n    vit)\n      step vit ;;\n    \
             reclaim)\n      step r ;;\n    *) exit 2 ;;\n  esac\ndone\n",
        );
        root
    }

    fn write(&self, relative: &str, text: &str) {
        let path = self.0.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One line of `replay-trace --corpus --json` with the three replays the handle table reads.
const CORPUS_LINE: &str = r#"{"name":"vit_l16_b8_adam_3steps","replays":{"default":{"handles":3203,"peak_reserved_bytes":1000000},"default_8mib_handles":{"handles":932,"peak_reserved_bytes":1002900},"default_32mib_handles":{"handles":482,"peak_reserved_bytes":1005200}}}"#;

const META: &str = r#"{"date":"2026-12-01","commit":"abcdef0","machine":{"cpu":"2 cores"},"versions":{"rustc":"1.95.0"},"command":"cargo xtask replay-trace --corpus --json"}"#;

/// What `allocator-handles` renders from [`CORPUS_LINE`].
const HANDLES_TABLE: &str = "\
| trace | handles, 2 MiB | 8 MiB | 32 MiB | peak reserved over 2 MiB handles', 8 MiB | 32 MiB |
|---|---:|---:|---:|---:|---:|
| ViT-L/16, batch 8 | 3,203 | 932 | 482 | 1.0029 | 1.0052 |";

/// Processes `doc` under `root` and checks that it is current: no problems, nothing stale, the
/// text unchanged.
fn assert_current(root: &Root, doc: &str) {
    let outcome = process(root.path(), "README.md", doc);
    assert_eq!(outcome.problems, Vec::<String>::new());
    assert_eq!(outcome.stale, Vec::<String>::new());
    assert_eq!(outcome.text, doc);
}

/// Processes `doc` under `root` and checks that its blocks at `stale` are stale and rewritten to
/// `expected`, counting `counts`, without problems; and that `expected` is then current.
fn assert_rewritten(root: &Root, doc: &str, stale: &[&str], expected: &str, counts: Counts) {
    let outcome = process(root.path(), "README.md", doc);
    assert_eq!(outcome.problems, Vec::<String>::new());
    assert_eq!(outcome.stale, stale);
    assert_eq!(outcome.text, expected);
    assert_eq!(outcome.counts, counts);
    assert_current(root, expected);
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

#[test]
fn markers_parse_into_blocks_with_their_sources_and_indentation() {
    let doc = "\
intro
<!-- table: allocator-corpus results/2026-12-01-abcdef0/corpus.jsonl -->
| a |
|---|
<!-- /table -->
- item

  <!-- table: pending vit reclaim -->
  | b |
  |--:|
  <!-- /table -->
```
<!-- table: prose -->
```
<!-- table: prose -->
| c |
<!-- /table -->";
    let parsed = blocks::parse(&lines(doc));
    assert_eq!(parsed.problems, Vec::<(usize, String)>::new());
    assert_eq!(
        parsed.blocks,
        vec![
            Block {
                body: 2..4,
                indent: String::new(),
                source: Source::Rendered {
                    kind: "allocator-corpus".into(),
                    files: vec!["results/2026-12-01-abcdef0/corpus.jsonl".into()],
                },
            },
            Block {
                body: 8..10,
                indent: "  ".into(),
                source: Source::Pending {
                    phases: vec!["vit".into(), "reclaim".into()],
                },
            },
            Block {
                body: 15..16,
                indent: String::new(),
                source: Source::Prose,
            },
        ]
    );
}

#[test]
fn bad_markers_are_named_by_line() {
    let doc = "\
<!-- /table -->
<!-- table: pending -->
<!-- table: prose -->
<!-- /table -->
<!-- table: allocator-corpus -->
<!-- /table -->
<!-- table: prose extra -->
<!-- /table -->
<!-- table allocator-corpus x -->
<!-- /table -->
<!-- table: prose -->";
    let parsed = blocks::parse(&lines(doc));
    let expected: Vec<(usize, String)> = vec![
        (1, "`<!-- /table -->` closes no block".into()),
        (
            2,
            "`pending` needs the scripts/gpu-measure.sh phases that measure the table (or `none`)"
                .into(),
        ),
        (3, "a block opens inside the one opened on line 2".into()),
        (5, "`allocator-corpus` names no results file".into()),
        (7, "`prose` takes nothing after it".into()),
        (
            9,
            "`<!-- table allocator-corpus x -->` is not `<!-- table: SOURCE -->`".into(),
        ),
        (11, "a block without `<!-- /table -->`".into()),
    ];
    assert_eq!(parsed.problems, expected);
    assert_eq!(parsed.blocks, vec![]);
}

#[test]
fn tables_start_at_a_row_followed_by_a_delimiter_row_outside_code() {
    let doc = "\
| a | b |
|---|:--:|
| 1 | 2 |
text | not a table
  | indented |
  | --- |
```
| fenced |
|---|
```
| no delimiter |
| 3 |";
    assert_eq!(blocks::table_starts(&lines(doc)), vec![0, 4]);
}

#[test]
fn a_stale_block_is_named_and_rewritten_from_its_results() {
    let root = Root::new("stale");
    root.write("results/2026-12-01-abcdef0/corpus.jsonl", CORPUS_LINE);
    root.write("results/2026-12-01-abcdef0/meta.json", META);
    let marker = "<!-- table: allocator-handles results/2026-12-01-abcdef0/corpus.jsonl -->";
    let doc = format!(
        "# Doc\n\n{marker}\n| trace | handles |\n|---|---|\n| ViT | 3,000 |\n<!-- /table -->\n\nafter\n"
    );
    let rendered = format!("# Doc\n\n{marker}\n{HANDLES_TABLE}\n<!-- /table -->\n\nafter\n");
    let stale = ["README.md:3 (allocator-handles results/2026-12-01-abcdef0/corpus.jsonl)"];
    let counts = Counts {
        rendered: 1,
        ..Counts::default()
    };
    assert_rewritten(&root, &doc, &stale, &rendered, counts);
}

#[test]
fn a_block_whose_results_are_missing_or_unsourced_is_a_problem() {
    let root = Root::new("missing");
    root.write("results/2026-12-01-abcdef0/corpus.jsonl", CORPUS_LINE);
    root.write(
        "results/2026-12-01-abcdef0/meta.json",
        r#"{"date":"2026-12-01","commit":"abcdef0","machine":"box"}"#,
    );
    root.write("results/latest/corpus.jsonl", CORPUS_LINE);
    let doc = "\
<!-- table: allocator-handles results/2026-12-01-abcdef0/absent.jsonl -->
| a |
|---|
<!-- /table -->
<!-- table: allocator-handles results/2026-12-01-abcdef0/corpus.jsonl -->
| a |
|---|
<!-- /table -->
<!-- table: allocator-handles results/latest/corpus.jsonl -->
<!-- /table -->
<!-- table: no-such-kind results/2026-12-01-abcdef0/corpus.jsonl -->
<!-- /table -->
| outside |
|---|
";
    let outcome = process(root.path(), "README.md", doc);
    let expected = vec![
        "README.md:13: a table outside `<!-- table: … -->` … `<!-- /table -->`: render it from a \
         raw result, or mark it `pending PHASE` or `prose` (results/README.md)",
        "README.md:1 (allocator-handles results/2026-12-01-abcdef0/absent.jsonl): \
         results/2026-12-01-abcdef0/absent.jsonl: no such results file (commit its raw result): \
         No such file or directory (os error 2)",
        "README.md:5 (allocator-handles results/2026-12-01-abcdef0/corpus.jsonl): \
         results/2026-12-01-abcdef0/corpus.jsonl: its provenance: its meta lacks `versions`, \
         `command` (results/README.md)",
        "README.md:9 (allocator-handles results/latest/corpus.jsonl): results/latest/corpus.jsonl: \
         `results/latest/` is not named `<YYYY-MM-DD>-<commit>` (results/README.md)",
    ];
    assert_eq!(outcome.problems[..4], expected);
    assert!(
        outcome.problems[4].starts_with(
            "README.md:11 (no-such-kind results/2026-12-01-abcdef0/corpus.jsonl): \
             no table kind `no-such-kind` (kinds: python-training, "
        ),
        "{}",
        outcome.problems[4]
    );
    assert_eq!(outcome.problems.len(), 5);
    // A block that cannot be rendered keeps its text, and is not called stale.
    assert_eq!(outcome.stale, Vec::<String>::new());
    assert_eq!(outcome.text, doc);
}

#[test]
fn a_pending_block_keeps_its_table_and_gets_the_line_under_it() {
    let root = Root::new("pending");
    let doc = "\
- figures:

  <!-- table: pending vit reclaim -->
  | a |
  |---|
  | 1 |
  <!-- /table -->

<!-- table: pending none -->
| b |
|---|

_Unsourced: an older wording._
<!-- /table -->
";
    // The line goes under each table, replacing an older one.
    let expected = doc
        .replace(
            "  | 1 |\n",
            "  | 1 |\n\n  _Unsourced: measured before raw results were kept; `bash \
             scripts/gpu-measure.sh vit reclaim` measures it again into `results/`._\n",
        )
        .replace(
            "_Unsourced: an older wording._",
            "_Unsourced: measured before raw results were kept, and no script measures it into \
             `results/` yet._",
        );
    let stale = [
        "README.md:3 (pending vit reclaim)",
        "README.md:9 (pending none)",
    ];
    let counts = Counts {
        pending: 2,
        ..Counts::default()
    };
    assert_rewritten(&root, doc, &stale, &expected, counts);
}

#[test]
fn a_pending_phase_must_be_one_of_gpu_measure() {
    let root = Root::new("phase");
    let doc = "<!-- table: pending vitt -->\n| a |\n|---|\n<!-- /table -->\n";
    let outcome = process(root.path(), "README.md", doc);
    assert_eq!(
        outcome.problems,
        vec![
            "README.md:1 (pending vitt): `vitt` is no phase of scripts/gpu-measure.sh (vit \
             reclaim; or `none`)"
                .to_owned()
        ]
    );
}

#[test]
fn a_prose_block_stays_as_written() {
    let root = Root::new("prose");
    assert_current(
        &root,
        "<!-- table: prose -->\n| crate | what |\n|---|---|\n| a | b |\n<!-- /table -->\n",
    );
}

#[test]
fn provenance_comes_from_the_file_or_its_folder() {
    let root = Root::new("meta");
    let folder = "crates/python/bench/results";
    root.write(
        &format!("{folder}/meta.json"),
        r#"{"date":"2026-12-01","commit":"9bbc409","machine":"H200","versions":{"torch":"2.11"},
            "command":"run.sh","files":{"old.jsonl":{"commit":"b678ed0","plugin_default_handle_size_mb":2}}}"#,
    );
    root.write(&format!("{folder}/old.jsonl"), "{}\n");
    root.write(&format!("{folder}/new.jsonl"), "{}\n");
    let old = super::load_result(root.path(), &format!("{folder}/old.jsonl")).unwrap();
    assert_eq!(old.meta["commit"], "b678ed0");
    assert_eq!(old.meta["plugin_default_handle_size_mb"], 2);
    assert_eq!(old.meta["machine"], "H200");
    assert!(old.meta.get("files").is_none());
    let new = super::load_result(root.path(), &format!("{folder}/new.jsonl")).unwrap();
    assert_eq!(new.meta["commit"], "9bbc409");
    // A JSON-lines file's own first line overrides the folder's.
    root.write(
        "results/2026-12-01-abcdef0/own.jsonl",
        &format!("{{\"meta\":{META}}}\n{CORPUS_LINE}\n"),
    );
    let own = super::load_result(root.path(), "results/2026-12-01-abcdef0/own.jsonl").unwrap();
    assert_eq!(
        own.meta["command"],
        "cargo xtask replay-trace --corpus --json"
    );
    // The meta line is no row of the table.
    let table = super::kinds::render("allocator-handles", &[own]).unwrap();
    assert_eq!(table.join("\n"), HANDLES_TABLE);
}

#[test]
fn figures_get_thousands_separators() {
    assert_eq!(super::kinds::thousands(0), "0");
    assert_eq!(super::kinds::thousands(999), "999");
    assert_eq!(super::kinds::thousands(1000), "1,000");
    assert_eq!(super::kinds::thousands(15_592_325_120), "15,592,325,120");
}

/// `cargo xtask tables --help` lists every kind with what it reads, from the kinds' table.
#[test]
fn the_help_lists_every_kind() {
    let help = super::kinds_help();
    for kind in super::kinds::KINDS {
        let line = format!("  {:<24} {}", kind.name, kind.reads);
        assert!(help.lines().any(|l| l == line), "{line}\n{help}");
    }
}

/// bench-memory's cases beside PyTorch's: from anchor.jsonl, matched by model, PyTorch's name of
/// the case and batch (bench-memory's own rule), `—` where PyTorch has no such case.
#[test]
fn bench_memory_cases_render_beside_the_anchors() {
    let bench = r#"{"tool": "cargo xtask bench-memory", "cases": [
        {"case": "adam_foreach_unbounded", "model": "vit_l_16", "batch": 1,
         "peak_allocated_bytes": 6120000000, "step_ms": 25.4, "step_ms_min": 25.0},
        {"case": "adam8bit_inbwd", "model": "vit_l_16", "batch": 32,
         "peak_allocated_bytes": 11868827136, "step_ms": 290.534, "step_ms_min": 290.0}]}"#;
    let anchors = "warning: a line that is not JSON\n\
        {\"case\": \"adam_foreach\", \"batch\": 1, \"steady_peak_alloc\": 6160000000.0, \
         \"steady_peak_reserved\": 6200000000, \"step_ms_median\": 40.1}\n\
        {\"case\": \"adam_foreach\", \"batch\": 32, \"steady_peak_alloc\": 1, \
         \"steady_peak_reserved\": 1, \"step_ms_median\": 1.0}\n";
    let table = super::kinds::rendered(
        "bench-memory-pytorch",
        &[
            ("results/x/vit.json", bench),
            ("results/x/anchor_vit.jsonl", anchors),
        ],
    )
    .unwrap();
    assert_eq!(
        table,
        [
            "| batch | case | peak alloc (B) | PyTorch (B) | step ms | PyTorch ms |",
            "|---:|---|---:|---:|---:|---:|",
            "| 1 | adam_foreach_unbounded | 6,120,000,000 | 6,160,000,000 | 25.40 | 40.10 |",
            "| 32 | adam8bit_inbwd | 11,868,827,136 | — | 290.53 | — |",
        ]
    );
}

/// The same cases by two builds: each peak and step beside the other, with after / before; a
/// case the second build lacks is an error naming it.
#[test]
fn bench_memory_versions_put_two_builds_side_by_side() {
    let run = |peak: u64, ms: f64| {
        format!(
            r#"{{"cases": [{{"case": "adam_fused", "model": "vit_l_16", "batch": 32,
                "step_ms": {ms}, "peak_allocated_bytes": {peak}}}]}}"#
        )
    };
    let table = super::kinds::rendered(
        "bench-memory-versions",
        &[
            ("results/x/old_vit.json", &run(13_683_924_992, 286.62)),
            ("results/x/new_vit.json", &run(10_064_028_160, 289.04)),
        ],
    )
    .unwrap();
    assert_eq!(
        table[2],
        "| vit_l_16 | 32 | adam_fused | 13,683,924,992 | 10,064,028,160 | 0.735 | 286.62 | 289.04 \
         | 1.008 |"
    );
    let other = r#"{"cases": [{"case": "adam_ckpt", "model": "vit_l_16", "batch": 32,
        "step_ms": 1.0, "peak_allocated_bytes": 1}]}"#;
    let err = super::kinds::rendered(
        "bench-memory-versions",
        &[
            ("results/x/old.json", &run(1, 1.0)),
            ("results/x/new.json", other),
        ],
    )
    .unwrap_err();
    let err = format!("{err:#}");
    assert!(err.contains("no vit_l_16 adam_fused at batch 32"), "{err}");
}

/// The same cases under two allocator settings, a column each, named by the file.
#[test]
fn bench_memory_runs_render_side_by_side_by_allocator_settings() {
    let run = |ms: f64, reserved: u64| {
        format!(
            r#"{{"cases": [{{"case": "adam_fused", "model": "vit_l_16", "batch": 1,
                "step_ms": {ms}, "step_ms_min": 21.5, "peak_reserved_bytes": {reserved}}}]}}"#
        )
    };
    let table = super::kinds::rendered(
        "bench-memory-allocators",
        &[
            ("results/x/reclaim_default.json", &run(21.57, 5_100_273_664)),
            ("results/x/reclaim_off.json", &run(21.45, 5_033_164_800)),
        ],
    )
    .unwrap();
    assert_eq!(
        table,
        [
            "| batch | case | default | `reclaim_free_pages:False` |",
            "|---:|---|---|---|",
            "| 1 | adam_fused | 21.57 ms (21.50), 5,100,273,664 B | 21.45 ms (21.50), \
             5,033,164,800 B |",
        ]
    );
}

/// Tidy reads README.md, BENCHMARKS.md and the READMEs of crates/* and examples/*, and no other
/// document.
#[test]
fn tidy_checks_the_readmes_and_benchmarks_only() {
    let root = Root::new("documents");
    let table = "| a |\n|---|\n";
    for document in [
        "README.md",
        "BENCHMARKS.md",
        "ARCHITECTURE.md",
        "crates/nn/README.md",
        "crates/nn/NOTES.md",
        "examples/mixed_precision/README.md",
        "results/README.md",
    ] {
        root.write(document, table);
    }
    let problems = super::tidy_problems(root.path());
    let files: Vec<&str> = problems
        .iter()
        .map(|problem| problem.split(':').next().unwrap())
        .collect();
    assert_eq!(
        files,
        [
            "README.md",
            "BENCHMARKS.md",
            "crates/nn/README.md",
            "examples/mixed_precision/README.md"
        ]
    );
}

/// With two anchor files the later file's line for a case wins (it measured again).
#[test]
fn a_later_anchor_file_wins() {
    let bench = r#"{"cases": [{"case": "adam_fused", "model": "vit_l_16", "batch": 1,
        "peak_allocated_bytes": 10, "step_ms": 2.0, "step_ms_min": 2.0}]}"#;
    let line = |ms: f64| {
        format!(
            "{{\"case\": \"adam_fused\", \"batch\": 1, \"steady_peak_alloc\": 11, \
             \"step_ms_median\": {ms}}}\n"
        )
    };
    let table = super::kinds::rendered(
        "bench-memory-pytorch",
        &[
            ("results/x/vit.json", bench),
            ("results/x/a.jsonl", &line(36.9)),
            ("results/x/b.jsonl", &line(53.7)),
        ],
    )
    .unwrap();
    assert_eq!(table[2], "| 1 | adam_fused | 10 | 11 | 2.00 | 53.70 |");
}

/// The planner's runs, one row per budget in budget order: the plan in words, measured and
/// predicted figures, uniform checkpointing at the same budget and the ratio of the steps.
#[test]
fn planner_runs_render_by_budget() {
    let run = |budget: u64, strategies: &str, plan_ms: f64| {
        format!(
            r#"{{"cases": [{{"case": "adam_auto", "batch": 32, "peak_allocated_bytes": {peak},
            "plan": {{"budget_bytes": {budget}, "predicted_peak_bytes": {peak},
            "predicted_step_ms": 290.04, "strategies": [{strategies}],
            "uniform": {{"every": 2, "n_recomputed": 12, "peak_allocated_bytes": 9000,
            "plan_step_ms": {plan_ms}, "step_ms": 300.0}}}}}}]}}"#,
            peak = budget - 100
        )
    };
    let table = super::kinds::rendered(
        "bench-memory-planner",
        &[
            (
                "results/x/planner_2.json",
                &run(20000, r#""keep", "compress-int8", "keep""#, 291.0),
            ),
            (
                "results/x/planner_1.json",
                &run(10000, r#""recompute""#, 297.0),
            ),
        ],
    )
    .unwrap();
    assert_eq!(
        &table[2..],
        [
            "| 10,000 | 1 recompute | 9,900 | 9,900 | 297.0 | 290.0 | 2: 12 | 9,000 | 300.0 | 0.990 |",
            "| 20,000 | 2 keep, 1 compress-int8 | 19,900 | 19,900 | 291.0 | 290.0 | 2: 12 | 9,000 | \
             300.0 | 0.970 |",
        ]
    );
}

/// The CUDA storage's replay lines, one row per trace, a column per policy in a fixed order.
#[test]
fn cuda_replay_lines_render_by_trace_and_policy() {
    let log = "running 5 tests\n\
        t classic: peak reserved 9 B, peak allocated 8 B, 3 maps or segments, 0 unmaps or frees, 0.5 s on the device (0.1 s simulated)\n\
        t pytorch_expandable: peak reserved 9 B, peak allocated 7 B, 2 maps or segments, 0 unmaps or frees, 0.6 s on the device (0.1 s simulated)\n\
        t default: peak reserved 9 B, peak allocated 1234 B, 4 maps or segments, 1 unmaps or frees, 0.7 s on the device (0.1 s simulated)\n\
        t reclaiming: peak reserved 9 B, peak allocated 7 B, 5 maps or segments, 2 unmaps or frees, 0.8 s on the device (0.1 s simulated)\n\
        test ok\n";
    let table = super::kinds::rendered(
        "allocator-cuda-replay",
        &[("results/x/tests/test_cuda_allocator.log", log)],
    )
    .unwrap();
    assert_eq!(
        table,
        [
            "| trace (peak allocated) | classic | PyTorch's expandable | default | `reclaiming()` |",
            "|---|---|---|---|---|",
            "| t (1,234 B) | 0.5 s, 3 maps, 0 unmaps | 0.6 s, 2 maps, 0 unmaps | 0.7 s, 4 maps, 1 \
             unmaps | 0.8 s, 5 maps, 2 unmaps |",
        ]
    );
}
