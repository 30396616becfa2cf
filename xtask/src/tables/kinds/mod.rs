//! The kinds of table: each a function that renders a Markdown table (lines without
//! indentation) from raw results files, named by `<!-- table: KIND FILE... -->`.
//!
//! A kind reads the files as their tool wrote them (the JSON lines of `crates/python/bench` and
//! of `cargo xtask replay-trace --corpus --json`, bench-memory's JSON, a test's stdout) and
//! computes every figure it shows from them; the only text of its own is labels (a trace's or a
//! model's name in words) and, for `nn-golden`, the bound its test holds each model to. It sits
//! on serde_json and knows nothing of markers or documents. A new kind is one function, in the
//! module of the tool whose results it reads ([`python`], [`nn`], [`bench_memory`],
//! [`find_max_batch`], [`find_max_model`], [`allocator`], [`cuda_benches`], [`criterion`]), and one entry of
//! [`KINDS`]; this module holds the reading and formatting they share.

mod allocator;
mod bench_memory;
mod criterion;
mod cuda_benches;
mod find_max_batch;
mod find_max_model;
mod nn;
mod python;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// A raw results file: its path (relative to the workspace root), its text and its provenance
/// (`meta`, see `results/README.md`).
pub(super) struct ResultFile {
    pub(super) path: String,
    pub(super) text: String,
    pub(super) meta: Value,
}

/// A kind of table and what it reads.
pub(super) struct Kind {
    pub(super) name: &'static str,
    pub(super) reads: &'static str,
    render: fn(&[ResultFile]) -> Result<Vec<String>>,
}

pub(super) const KINDS: &[Kind] = &[
    Kind {
        name: "python-training",
        reads: "crates/python/bench's train.py JSON lines (run.sh's train.jsonl)",
        render: python::python_training,
    },
    Kind {
        name: "python-handles",
        reads: "train.py JSON lines of GPT-2 runs with expandable_handle_size_mb 2, 8 and 32",
        render: python::python_handles,
    },
    Kind {
        name: "python-optim",
        reads: "crates/python/bench's optim_compare.py JSON lines (run.sh's optim.jsonl)",
        render: python::python_optim,
    },
    Kind {
        name: "python-clients",
        reads: "crates/python/bench's clients.py JSON lines (techniques.sh's clients.jsonl), \
                several files in order",
        render: python::python_clients,
    },
    Kind {
        name: "python-saved-offload",
        reads: "crates/python/bench's saved_activations.py JSON lines (plain and save_on_cpu \
                among the variants)",
        render: python::python_saved_offload,
    },
    Kind {
        name: "python-fused-ce",
        reads: "scripts/pytorch/fused_ce_reference.py's output (the JSON object after its log)",
        render: python::python_fused_ce,
    },
    Kind {
        name: "nn-golden",
        reads:
            "the stdout of crates/nn/tests/golden.rs (`cargo test --test golden -- --nocapture`)",
        render: nn::nn_golden,
    },
    Kind {
        name: "bench-memory-pytorch",
        reads: "`cargo xtask bench-memory --json` (gpu-measure.sh's vit.json), and PyTorch's \
                anchor.jsonl files (a later file's line for a case wins) unless its cases carry \
                PyTorch's figures (--pytorch)",
        render: bench_memory::bench_memory_pytorch,
    },
    Kind {
        name: "tokens-per-second",
        reads: "`cargo xtask bench-memory --json` files of a language model (their command's \
                --seq) and PyTorch's anchor.jsonl files of the same model, any batches",
        render: bench_memory::tokens_per_second,
    },
    Kind {
        name: "bench-memory-planner",
        reads: "`cargo xtask bench-memory --cases adam_auto --budget B --json` files, one per \
                budget (gpu-measure.sh's planner phase)",
        render: bench_memory::bench_memory_planner,
    },
    Kind {
        name: "bench-memory-versions",
        reads: "two `cargo xtask bench-memory --json` files of the same cases by two builds, \
                before then after (scripts/gpu-saves.sh's old_*.json and new_*.json)",
        render: bench_memory::bench_memory_versions,
    },
    Kind {
        name: "bench-memory-fp8",
        reads: "one `cargo xtask bench-memory --json` file with fp8 cases and their bf16 \
                counterparts (adam_fp8 beside adam_bf16, ...)",
        render: bench_memory::bench_memory_fp8,
    },
    Kind {
        name: "bench-memory-fp8-steps",
        reads: "as bench-memory-fp8, from a GPU run: with each side's median step and the \
                speed-up (bf16 step / fp8 step)",
        render: bench_memory::bench_memory_fp8_steps,
    },
    Kind {
        name: "bench-memory-allocators",
        reads: "`cargo xtask bench-memory --json` files of the same cases under different \
                allocator settings (gpu-measure.sh's reclaim_default, reclaim_on, reclaim_off)",
        render: bench_memory::bench_memory_allocators,
    },
    Kind {
        name: "find-max-batch",
        reads: "`cargo xtask find-max-batch --json` (gpu-measure.sh's fmb.json) and, optionally, \
                scripts/pytorch/find_max_batch.py's JSON lines (fmb_torch.jsonl)",
        render: find_max_batch::find_max_batch,
    },
    Kind {
        name: "find-max-model",
        reads: "`cargo xtask plan --find-max-model --run --json` (fmm_plan.json), then \
                scripts/pytorch/find_max_model.py's JSON lines of one run or several \
                (fmm_torch.jsonl)",
        render: find_max_model::find_max_model,
    },
    Kind {
        name: "vit-step",
        reads: "the JSON lines of crates/ops-cuda/benches/vit_step.rs (gpu-measure.sh's \
                vit_step.jsonl) and bench_reference.py's sgd and sgd_bf16_model lines \
                (anchor_vit_step.jsonl)",
        render: cuda_benches::vit_step,
    },
    Kind {
        name: "graph-step",
        reads: "the JSON lines of crates/ops-cuda/benches/graph_step.rs (graph_step.jsonl) and \
                scripts/pytorch/graph_step_reference.py's (anchor_graph_step.jsonl)",
        render: cuda_benches::graph_step,
    },
    Kind {
        name: "attention-f32",
        reads: "the JSON lines of crates/ops-cuda/benches/attention_f32.rs (attention_f32.jsonl) \
                and scripts/pytorch/attention_f32_reference.py's \
                (attention_f32_reference.jsonl)",
        render: cuda_benches::attention_f32,
    },
    Kind {
        name: "attention-hopper",
        reads: "the stdout of crates/ops-cuda/benches/kernels.rs run with --bench (its \
                hopper_attention family's summary lines) and scripts/pytorch/\
                attention_reference.py --shape issue35's JSON lines (cuDNN, flash and \
                memory-efficient SDPA)",
        render: cuda_benches::attention_hopper,
    },
    Kind {
        name: "adam-step-1e9",
        reads: "the JSON lines of crates/optim/benches/cuda_adam.rs (gpu-measure.sh's \
                cuda_adam.jsonl) and scripts/pytorch/adam_step_1e9.py's \
                (adam_step_1e9_torch.jsonl)",
        render: cuda_benches::adam_step_1e9,
    },
    Kind {
        name: "criterion",
        reads: "the stdout of criterion bench binaries run with --bench (gpu-measure.sh's \
                cpu-benches phase: cpu_vit.txt, cpu_gemm.txt)",
        render: criterion::criterion,
    },
    Kind {
        name: "allocator-pairs",
        reads: "the stdout of the `allocator` bench (host and simulated storage) and of \
                crates/caching-allocator/benches/cuda_alloc.rs, run with --bench (gpu-measure.sh's \
                allocator.txt, cuda_alloc.txt)",
        render: allocator::allocator_pairs,
    },
    Kind {
        name: "allocator-driver-calls",
        reads: "the stdout of crates/caching-allocator/benches/cuda_alloc.rs (gpu-measure.sh's \
                cuda_alloc.txt)",
        render: allocator::allocator_driver_calls,
    },
    Kind {
        name: "allocator-corpus",
        reads: "`cargo xtask replay-trace --corpus --json`",
        render: allocator::allocator_corpus,
    },
    Kind {
        name: "allocator-cuda-replay",
        reads: "the stdout of crates/caching-allocator/tests/cuda_allocator.rs on a GPU \
                (gpu-measure.sh's tests phase, `--show-output`)",
        render: allocator::allocator_cuda_replay,
    },
    Kind {
        name: "allocator-steady-state",
        reads: "the stdout of crates/caching-allocator/tests/steady_state.rs \
                (`cargo test --test steady_state -- --nocapture --test-threads 1`)",
        render: allocator::allocator_steady_state,
    },
    Kind {
        name: "allocator-handles",
        reads: "`cargo xtask replay-trace --corpus --json`",
        render: allocator::allocator_handles,
    },
];

/// The kind named `name`, or an error listing the kinds.
pub(super) fn find(name: &str) -> Result<&'static Kind> {
    KINDS
        .iter()
        .find(|kind| kind.name == name)
        .with_context(|| {
            format!(
                "no table kind `{name}` (kinds: {})",
                KINDS
                    .iter()
                    .map(|kind| kind.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// Renders the table of the kind named `name` from `files`.
pub(super) fn render(name: &str, files: &[ResultFile]) -> Result<Vec<String>> {
    let kind = find(name)?;
    (kind.render)(files).with_context(|| format!("`{name}` ({})", kind.reads))
}

/// For a kind's test: the table of the kind named `name` rendered from `files`, each its
/// `(path, text)`, without provenance (the kinds do not read it).
#[cfg(test)]
pub(super) fn rendered(name: &str, files: &[(&str, &str)]) -> Result<Vec<String>> {
    let files: Vec<ResultFile> = files
        .iter()
        .map(|(path, text)| ResultFile {
            path: (*path).to_owned(),
            text: (*text).to_owned(),
            meta: Value::Null,
        })
        .collect();
    render(name, &files)
}

/// The one file a kind reads.
fn one_file(files: &[ResultFile]) -> Result<&ResultFile> {
    match files {
        [file] => Ok(file),
        _ => bail!("reads one file, given {}", files.len()),
    }
}

/// The JSON objects of a JSON-lines file: every line that starts with `{`, but a `{"meta": …}`
/// line (other lines are the tool's log, which the raw output keeps).
fn json_lines(file: &ResultFile) -> Result<Vec<Value>> {
    let mut values = Vec::new();
    for (idx, line) in file.text.lines().enumerate() {
        if !line.starts_with('{') {
            continue;
        }
        let value: Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", file.path, idx + 1))?;
        if value.get("meta").is_none() {
            values.push(value);
        }
    }
    Ok(values)
}

fn number(value: &Value, key: &str) -> Result<f64> {
    value[key]
        .as_f64()
        .with_context(|| format!("no number `{key}` in {}", brief(value)))
}

fn count(value: &Value, key: &str) -> Result<u64> {
    value[key]
        .as_u64()
        .with_context(|| format!("no count `{key}` in {}", brief(value)))
}

fn text<'a>(value: &'a Value, key: &str) -> Result<&'a str> {
    value[key]
        .as_str()
        .with_context(|| format!("no string `{key}` in {}", brief(value)))
}

/// The start of a JSON value, for an error message.
fn brief(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(80) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// `15592325120` → `15,592,325,120`.
pub(super) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (idx, digit) in digits.chars().enumerate() {
        if idx > 0 && (digits.len() - idx).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// A table's first two lines: its header row and its delimiter row.
fn table_head(header: &str, delimiter: &str) -> Vec<String> {
    vec![header.to_owned(), delimiter.to_owned()]
}

/// A row of cells: `| a | b |`, an empty cell as `| |`.
fn row(cells: &[String]) -> String {
    let mut line = "|".to_owned();
    for cell in cells {
        if !cell.is_empty() {
            line.push(' ');
            line.push_str(cell);
        }
        line.push_str(" |");
    }
    line
}
