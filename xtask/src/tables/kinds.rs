//! The kinds of table: each a function that renders a Markdown table (lines without
//! indentation) from raw results files, named by `<!-- table: KIND FILE... -->`.
//!
//! A kind reads the files as their tool wrote them (the JSON lines of `crates/python/bench` and
//! of `cargo xtask replay-trace --corpus --json`, bench-memory's JSON, a test's stdout) and
//! computes every figure it shows from them; the only text of its own is labels (a trace's or a
//! model's name in words) and, for `nn-golden`, the bound its test holds each model to. It sits
//! on serde_json and bench-memory's case names, and knows nothing of markers or documents. A new
//! kind is one function and one entry of [`KINDS`].

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
        render: python_training,
    },
    Kind {
        name: "python-handles",
        reads: "train.py JSON lines of GPT-2 runs with expandable_handle_size_mb 2, 8 and 32",
        render: python_handles,
    },
    Kind {
        name: "python-optim",
        reads: "crates/python/bench's optim_compare.py JSON lines (run.sh's optim.jsonl)",
        render: python_optim,
    },
    Kind {
        name: "nn-golden",
        reads:
            "the stdout of crates/nn/tests/golden.rs (`cargo test --test golden -- --nocapture`)",
        render: nn_golden,
    },
    Kind {
        name: "bench-memory-pytorch",
        reads: "`cargo xtask bench-memory --json` (gpu-measure.sh's vit.json), and PyTorch's \
                anchor.jsonl files (a later file's line for a case wins) unless its cases carry \
                PyTorch's figures (--pytorch)",
        render: bench_memory_pytorch,
    },
    Kind {
        name: "bench-memory-planner",
        reads: "`cargo xtask bench-memory --cases adam_auto --budget B --json` files, one per \
                budget (gpu-measure.sh's planner phase)",
        render: bench_memory_planner,
    },
    Kind {
        name: "bench-memory-allocators",
        reads: "`cargo xtask bench-memory --json` files of the same cases under different \
                allocator settings (gpu-measure.sh's reclaim_default, reclaim_on, reclaim_off)",
        render: bench_memory_allocators,
    },
    Kind {
        name: "allocator-corpus",
        reads: "`cargo xtask replay-trace --corpus --json`",
        render: allocator_corpus,
    },
    Kind {
        name: "allocator-steady-state",
        reads: "the stdout of crates/caching-allocator/tests/steady_state.rs \
                (`cargo test --test steady_state -- --nocapture --test-threads 1`)",
        render: allocator_steady_state,
    },
    Kind {
        name: "allocator-handles",
        reads: "`cargo xtask replay-trace --corpus --json`",
        render: allocator_handles,
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

/// `train.py`'s allocator names in words.
fn allocator_label(run: &Value) -> Result<String> {
    let alloc = text(run, "alloc")?;
    let label = match alloc {
        "native" => "PyTorch native".to_owned(),
        "expandable" => "PyTorch `expandable_segments:True`".to_owned(),
        "headroom" => "Headroom".to_owned(),
        other => other.to_owned(),
    };
    Ok(match run["conf"].as_str() {
        Some(conf) if !conf.is_empty() => format!("{label} (`{conf}`)"),
        _ => label,
    })
}

/// A model of `train.py`: its name in the first round and the short one of later rounds.
fn model_labels(model: &str) -> (String, String) {
    match model {
        "vit" => ("ViT-L/16 b32".into(), "ViT-L/16".into()),
        "gpt2" => ("GPT-2 small varlen".into(), "GPT-2".into()),
        other => (other.to_owned(), other.to_owned()),
    }
}

fn round_label(short: &str, round: usize) -> String {
    const ORDINALS: &[&str] = &["first", "second", "third", "fourth", "fifth", "sixth"];
    match ORDINALS.get(round - 1) {
        Some(ordinal) => format!("{short}, {ordinal} round"),
        None => format!("{short}, round {round}"),
    }
}

/// How many of `run`'s losses equal `native`'s bit for bit, as `n/total bitwise`.
fn losses_against(run: &Value, native: &Value) -> Result<String> {
    let ours = run["loss_bits"].as_array().context("no `loss_bits`")?;
    let theirs = native["loss_bits"].as_array().context("no `loss_bits`")?;
    let same = ours.iter().zip(theirs).filter(|(a, b)| a == b).count();
    Ok(format!("{same}/{} bitwise", theirs.len()))
}

/// `crates/python/README.md`'s training table: per model, each run's median and mean step
/// against the native run of the same model that came last before it (`summarize.py`'s
/// pairing), its peak reserved bytes, and its losses against that native run's. A model's
/// second native run starts its second round.
fn python_training(files: &[ResultFile]) -> Result<Vec<String>> {
    let runs = json_lines(one_file(files)?)?;
    let mut lines = vec![
        "| model | allocator | median step | mean step | peak reserved | losses vs native |"
            .to_owned(),
        "|---|---|---:|---:|---:|---|".to_owned(),
    ];
    let mut natives: Vec<(String, Value)> = Vec::new();
    let mut rounds: Vec<(String, usize)> = Vec::new();
    for run in &runs {
        let model = text(run, "model")?.to_owned();
        let reserved = format!("{} B", thousands(count(run, "peak_reserved")?));
        if run["alloc"] == "native" {
            let round = match rounds.iter_mut().find(|(name, _)| *name == model) {
                Some((_, round)) => {
                    *round += 1;
                    *round
                }
                None => {
                    rounds.push((model.clone(), 1));
                    1
                }
            };
            let (first, short) = model_labels(&model);
            let label = if round == 1 {
                first
            } else {
                round_label(&short, round)
            };
            lines.push(row(&[
                label,
                allocator_label(run)?,
                format!("{:.2} ms", number(run, "median_step_ms")?),
                format!("{:.2} ms", number(run, "mean_step_ms")?),
                reserved,
                "—".into(),
            ]));
            natives.retain(|(name, _)| *name != model);
            natives.push((model, run.clone()));
            continue;
        }
        let Some((_, native)) = natives.iter().find(|(name, _)| *name == model) else {
            bail!("a `{model}` run before any native run of it");
        };
        let ratio = |key: &str| -> Result<String> {
            Ok(format!("{:.4}×", number(run, key)? / number(native, key)?))
        };
        lines.push(row(&[
            String::new(),
            allocator_label(run)?,
            ratio("median_step_ms")?,
            ratio("mean_step_ms")?,
            reserved,
            losses_against(run, native)?,
        ]));
    }
    Ok(lines)
}

/// The physical handle size of a Headroom run in MiB: its `conf`'s
/// `expandable_handle_size_mb`, else the wheel's default, which the file's provenance states
/// (`plugin_default_handle_size_mb`).
fn handle_size_mb(run: &Value, meta: &Value) -> Result<u64> {
    let conf = run["conf"].as_str().unwrap_or_default();
    let from_conf = conf
        .split(',')
        .filter_map(|pair| pair.split_once(':'))
        .find(|(key, _)| key.trim() == "expandable_handle_size_mb");
    match from_conf {
        Some((_, value)) => value
            .trim()
            .parse()
            .with_context(|| format!("conf `{conf}`: a handle size that is no number")),
        None => meta["plugin_default_handle_size_mb"].as_u64().context(
            "a run with the wheel's default handle size, and no `plugin_default_handle_size_mb` \
             in the file's meta",
        ),
    }
}

/// The Headroom runs of one handle size, by round: mean and median step over the native run
/// before each, and peak reserved bytes.
#[derive(Default)]
struct HandleRuns {
    size_mb: u64,
    means: Vec<f64>,
    medians: Vec<f64>,
    reserved: Vec<u64>,
}

/// `crates/python/README.md`'s handle-size table: GPT-2's Headroom runs per handle size, mean
/// and median step against the native run before them, per round, and their peak reserved
/// bytes (one figure when every round reserved the same).
fn python_handles(files: &[ResultFile]) -> Result<Vec<String>> {
    let file = one_file(files)?;
    let runs = json_lines(file)?;
    let mut sizes: Vec<HandleRuns> = Vec::new();
    let mut native: Option<&Value> = None;
    for run in &runs {
        if run["alloc"] == "native" {
            native = Some(run);
            continue;
        }
        if run["alloc"] != "headroom" {
            continue;
        }
        let base = native.context("a Headroom run before any native run")?;
        let size = handle_size_mb(run, &file.meta)?;
        let index = match sizes.iter().position(|entry| entry.size_mb == size) {
            Some(index) => index,
            None => {
                sizes.push(HandleRuns {
                    size_mb: size,
                    ..HandleRuns::default()
                });
                sizes.len() - 1
            }
        };
        let entry = &mut sizes[index];
        entry
            .means
            .push(number(run, "mean_step_ms")? / number(base, "mean_step_ms")?);
        entry
            .medians
            .push(number(run, "median_step_ms")? / number(base, "median_step_ms")?);
        entry.reserved.push(count(run, "peak_reserved")?);
    }
    sizes.sort_by_key(|entry| entry.size_mb);
    let rounds = sizes
        .iter()
        .map(|entry| entry.means.len())
        .max()
        .unwrap_or(0);
    let round_names = (1..=rounds)
        .map(|round| format!("round {round}"))
        .collect::<Vec<_>>()
        .join(" / ");
    let mut lines = vec![
        format!(
            "| handles | GPT-2 mean step, {round_names} | median, {round_names} | peak reserved |"
        ),
        "|---|---:|---:|---:|".to_owned(),
    ];
    let ratios = |values: &[f64]| {
        values
            .iter()
            .map(|value| format!("{value:.4}×"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    for HandleRuns {
        size_mb,
        means,
        medians,
        reserved,
    } in &sizes
    {
        let reserved = if reserved.windows(2).all(|pair| pair[0] == pair[1]) {
            format!("{} B", thousands(reserved[0]))
        } else {
            reserved
                .iter()
                .map(|bytes| format!("{} B", thousands(*bytes)))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        lines.push(row(&[
            format!("{size_mb} MiB"),
            ratios(means),
            ratios(medians),
            reserved,
        ]));
    }
    Ok(lines)
}

/// A time in ms to four significant figures: `3.357 ms`, `22.76 ms`.
fn milliseconds(ms: f64) -> String {
    let decimals = if ms >= 100.0 {
        1
    } else if ms >= 10.0 {
        2
    } else {
        3
    };
    format!("{ms:.decimals$} ms")
}

/// How two runs' parameters compare, from `optim_compare.py`'s comparison object.
fn parameters_compared(comparison: &Value) -> Result<String> {
    let equal = text(comparison, "tensors_bitwise_equal")?;
    let ulps = count(comparison, "max_ulps")?;
    if count(comparison, "elements_differing")? == 0 {
        return Ok(format!("{equal} tensors bitwise ({ulps} ulps)"));
    }
    Ok(format!(
        "{equal} tensors bitwise; the others at most {:.1e} apart",
        number(comparison, "max_abs_diff")?
    ))
}

/// `crates/python/README.md`'s optimizer table: each of `optim_compare.py`'s timed
/// comparisons, theirs against Headroom's step, and the parameters after 20 steps.
fn python_optim(files: &[ResultFile]) -> Result<Vec<String>> {
    let cases = json_lines(one_file(files)?)?;
    let case = |name: &str| -> Result<&Value> {
        cases
            .iter()
            .find(|value| value["case"] == name)
            .with_context(|| format!("no `{name}` case"))
    };
    let mut lines = vec![
        "| comparison | theirs | headroom | ratio | parameters after 20 steps |".to_owned(),
        "|---|---:|---:|---:|---|".to_owned(),
    ];
    for (name, label) in [
        (
            "adamw_fused",
            "`AdamW(weight_decay=1e-2)` vs `torch.optim.AdamW(fused=True)`",
        ),
        (
            "adamw_amsgrad_fused",
            "`AdamW(amsgrad=True)` vs the same, fused",
        ),
        (
            "adam_l2_fused",
            "`Adam(weight_decay=1e-2)` (L2) vs `torch.optim.Adam(fused=True)`",
        ),
    ] {
        let value = case(name)?;
        lines.push(row(&[
            label.to_owned(),
            milliseconds(number(value, "torch_ms")?),
            milliseconds(number(value, "headroom_ms")?),
            format!("{:.3}×", number(value, "ratio")?),
            parameters_compared(value)?,
        ]));
    }
    let adam8bit = case("adam8bit")?;
    lines.push(row(&[
        "`Adam8bit` vs `bitsandbytes.optim.Adam8bit`".to_owned(),
        milliseconds(number(adam8bit, "bnb_ms")?),
        milliseconds(number(adam8bit, "headroom_ms")?),
        format!("{:.1}× faster", number(adam8bit, "speedup")?),
        parameters_compared(&adam8bit["vs_bnb"])?,
    ]));
    Ok(lines)
}

/// A relative error to two significant figures (`4.5e-16`), zero as `0`.
fn relative_error(value: f64) -> String {
    if value == 0.0 {
        "0".to_owned()
    } else {
        format!("{value:.1e}")
    }
}

/// `crates/nn/README.md`'s golden table: per model, the relative errors testkit's
/// `golden::check` prints (`vit on Cpu in F64: logits 4.50e-16, loss 0.00e0, worst parameter
/// gradient 1.29e-15 (relative)`), and the bound `tests/golden.rs` holds each model to.
fn nn_golden(files: &[ResultFile]) -> Result<Vec<String>> {
    let file = one_file(files)?;
    let mut lines = vec![
        "| model | logits | loss | worst parameter gradient | bound |".to_owned(),
        "|---|---|---|---|---|".to_owned(),
    ];
    // The models in the table's order, with their bound in tests/golden.rs.
    let models = [
        ("vit", "ViT tiny (torchvision)", "1e-10"),
        (
            "gpt2",
            "GPT-2 tiny (Hugging Face)",
            "1e-5 (the reference loss is f32)",
        ),
    ];
    for (prefix, label, bound) in models {
        let mut found = false;
        for line in file.text.lines() {
            let Some((head, figures)) = line.split_once(": logits ") else {
                continue;
            };
            let Some((model, device)) = head.split_once(" on ") else {
                continue;
            };
            if model != prefix {
                continue;
            }
            let figure = |text: &str| -> Result<f64> {
                text.trim()
                    .parse()
                    .with_context(|| format!("{}: `{text}` in `{line}`", file.path))
            };
            let (logits, rest) = figures
                .split_once(", loss ")
                .with_context(|| format!("{}: no loss in `{line}`", file.path))?;
            let (loss, rest) = rest
                .split_once(", worst parameter gradient ")
                .with_context(|| format!("{}: no gradient in `{line}`", file.path))?;
            let gradient = rest.trim_end_matches(" (relative)");
            let label = match device.split_once(" in ") {
                Some(("Cpu", _)) => label.to_owned(),
                Some((device, _)) => format!("{label}, {device}"),
                None => label.to_owned(),
            };
            lines.push(row(&[
                label,
                relative_error(figure(logits)?),
                relative_error(figure(loss)?),
                relative_error(figure(gradient)?),
                bound.to_owned(),
            ]));
            found = true;
        }
        if !found {
            bail!("{}: no `{prefix} on …` line", file.path);
        }
    }
    Ok(lines)
}

/// The `cases` of a `cargo xtask bench-memory --json` document.
fn bench_memory_cases(file: &ResultFile) -> Result<Vec<Value>> {
    let document: Value = serde_json::from_str(&file.text)
        .with_context(|| format!("{}: not a JSON document", file.path))?;
    document["cases"]
        .as_array()
        .cloned()
        .with_context(|| format!("{}: no `cases` (not bench-memory's --json)", file.path))
}

/// PyTorch's figures for one bench-memory case: from `anchors` (anchor.jsonl's lines) when
/// given, matched as bench-memory matches them (model, PyTorch's name of the case, batch), else
/// the case's own `pytorch` object.
fn pytorch_figures(case: &Value, anchors: Option<&[Value]>) -> Result<Option<(u64, f64)>> {
    let Some(anchors) = anchors else {
        let own = &case["pytorch"];
        if own.is_null() {
            return Ok(None);
        }
        return Ok(Some((
            number(own, "steady_peak_alloc")? as u64,
            number(own, "step_ms_median")?,
        )));
    };
    let name = crate::bench_memory::cases::Case::parse(text(case, "case")?)?.pytorch_name();
    let model = text(case, "model")?;
    let batch = count(case, "batch")?;
    let found = anchors.iter().find(|anchor| {
        anchor["case"] == name
            && anchor["batch"].as_u64() == Some(batch)
            // Anchors without a model are torch_reference.py's ViT-L/16 (bench-memory's rule).
            && anchor["model"].as_str().unwrap_or("vit_l_16") == model
            && anchor["steady_peak_alloc"].is_number()
    });
    found
        .map(|anchor| {
            Ok((
                number(anchor, "steady_peak_alloc")? as u64,
                number(anchor, "step_ms_median")?,
            ))
        })
        .transpose()
}

/// Every case of a bench-memory run beside PyTorch's case of the same name: peak allocated
/// bytes and median step, `—` where PyTorch has no such case.
fn bench_memory_pytorch(files: &[ResultFile]) -> Result<Vec<String>> {
    let (bench, anchors) = match files {
        [] => bail!("reads a bench-memory JSON and, optionally, anchor.jsonl files"),
        [bench] => (bench, None),
        [bench, anchor_files @ ..] => {
            // A later file's line for the same case wins: it measured again.
            let mut anchors = Vec::new();
            for file in anchor_files.iter().rev() {
                anchors.extend(json_lines(file)?);
            }
            (bench, Some(anchors))
        }
    };
    let mut lines = vec![
        "| batch | case | peak alloc (B) | PyTorch (B) | step ms | PyTorch ms |".to_owned(),
        "|---:|---|---:|---:|---:|---:|".to_owned(),
    ];
    for case in bench_memory_cases(bench)? {
        let torch = pytorch_figures(&case, anchors.as_deref())?;
        lines.push(row(&[
            count(&case, "batch")?.to_string(),
            text(&case, "case")?.to_owned(),
            thousands(count(&case, "peak_allocated_bytes")?),
            torch.map_or("—".into(), |(bytes, _)| thousands(bytes)),
            format!("{:.2}", number(&case, "step_ms")?),
            torch.map_or("—".into(), |(_, ms)| format!("{ms:.2}")),
        ]));
    }
    Ok(lines)
}

/// The planner (`adam_auto`) at each budget: its plan in words, measured and predicted peak and
/// step, and uniform every-k checkpointing at the same budget, measured in alternation.
fn bench_memory_planner(files: &[ResultFile]) -> Result<Vec<String>> {
    if files.is_empty() {
        bail!("reads one or more bench-memory JSON files of adam_auto");
    }
    let mut lines = vec![
        "| budget (B) | plan | peak (B) | predicted (B) | step ms | predicted ms | uniform: every k, \
         recomputed | uniform peak (B) | uniform ms | plan / uniform |"
            .to_owned(),
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|".to_owned(),
    ];
    let mut cases = Vec::new();
    for file in files {
        for case in bench_memory_cases(file)? {
            if case["plan"].is_object() {
                cases.push((file.path.as_str(), case));
            }
        }
    }
    cases.sort_by_key(|(_, case)| case["plan"]["budget_bytes"].as_u64());
    for (path, case) in &cases {
        let plan = &case["plan"];
        let uniform = &plan["uniform"];
        let strategies = plan["strategies"]
            .as_array()
            .with_context(|| format!("{path}: a plan without strategies"))?;
        let mut counts: Vec<(String, usize)> = Vec::new();
        for strategy in strategies {
            let name = strategy.as_str().unwrap_or("?").to_owned();
            match counts.iter_mut().find(|(seen, _)| *seen == name) {
                Some((_, n)) => *n += 1,
                None => counts.push((name, 1)),
            }
        }
        let words: Vec<String> = counts
            .iter()
            .map(|(name, n)| format!("{n} {name}"))
            .collect();
        let plan_ms = number(uniform, "plan_step_ms")?;
        let uniform_ms = number(uniform, "step_ms")?;
        lines.push(row(&[
            thousands(count(plan, "budget_bytes")?),
            words.join(", "),
            thousands(count(case, "peak_allocated_bytes")?),
            thousands(count(plan, "predicted_peak_bytes")?),
            format!("{plan_ms:.1}"),
            format!("{:.1}", number(plan, "predicted_step_ms")?),
            format!(
                "{}: {}",
                count(uniform, "every")?,
                count(uniform, "n_recomputed")?
            ),
            thousands(count(uniform, "peak_allocated_bytes")?),
            format!("{uniform_ms:.1}"),
            format!("{:.3}", plan_ms / uniform_ms),
        ]));
    }
    Ok(lines)
}

/// A column's name for a bench-memory run under some allocator settings, from its file's name
/// (gpu-measure.sh's reclaim phases).
fn allocator_settings_label(path: &str) -> String {
    let stem = path
        .rsplit('/')
        .next()
        .unwrap_or(path)
        .trim_end_matches(".json");
    match stem {
        "reclaim_default" => "default".to_owned(),
        "reclaim_on" => "`reclaiming()`".to_owned(),
        "reclaim_off" => "`reclaim_free_pages:False`".to_owned(),
        other => format!("`{other}`"),
    }
}

/// The same bench-memory cases under different allocator settings, one column per file: median
/// step (fastest step) and peak reserved bytes.
fn bench_memory_allocators(files: &[ResultFile]) -> Result<Vec<String>> {
    if files.len() < 2 {
        bail!(
            "reads two or more bench-memory JSON files, given {}",
            files.len()
        );
    }
    let runs = files
        .iter()
        .map(bench_memory_cases)
        .collect::<Result<Vec<_>>>()?;
    let labels: Vec<String> = files
        .iter()
        .map(|file| allocator_settings_label(&file.path))
        .collect();
    let mut lines = vec![
        format!("| batch | case | {} |", labels.join(" | ")),
        format!("|---:|---|{}", "---|".repeat(files.len())),
    ];
    for case in &runs[0] {
        let (name, batch) = (text(case, "case")?, count(case, "batch")?);
        let mut cells = vec![batch.to_string(), name.to_owned()];
        for (file, run) in files.iter().zip(&runs) {
            let same = run
                .iter()
                .find(|other| other["case"] == name && other["batch"].as_u64() == Some(batch))
                .with_context(|| format!("{}: no {name} at batch {batch}", file.path))?;
            cells.push(format!(
                "{:.2} ms ({:.2}), {} B",
                number(same, "step_ms")?,
                number(same, "step_ms_min")?,
                thousands(count(same, "peak_reserved_bytes")?)
            ));
        }
        lines.push(row(&cells));
    }
    Ok(lines)
}

/// The corpus traces' names in words (`testdata/traces/corpus.json`'s `name`).
fn trace_label(name: &str) -> &str {
    match name {
        "bert_varlen_adamw_30steps" => "BERT, variable lengths (shared)",
        "vit_l16_b8_adam_3steps" => "ViT-L/16, batch 8",
        "vit_l16_b32_adam_3steps" => "ViT-L/16, batch 32",
        "vit_b16_batch_change_adamw" => "ViT-B/16, batch 16 → 96 → 48",
        "bert_varlen_adamw_30steps_seed0" => "BERT, variable lengths (our recording)",
        "gpt2_medium_varlen_adamw_16steps" => "GPT-2 medium, variable lengths",
        "llama_bf16_ckpt_adamw_8steps" => "Llama 0.9B, bf16 autocast, checkpointing",
        "llama_generate_kvcache" => "Llama generation, growing KV cache",
        "resnet50_sgd_b128_5steps" => "ResNet-50, batch 128, SGD",
        other => other,
    }
}

/// One policy's replay of a corpus line.
fn replay<'a>(trace: &'a Value, policy: &str) -> Result<&'a Value> {
    let value = &trace["replays"][policy];
    if value.is_null() {
        bail!("no `{policy}` replay of {}", trace["name"]);
    }
    Ok(value)
}

/// `crates/caching-allocator/README.md`'s corpus table: per trace, PyTorch's figures, the
/// replays' peak reserved bytes with their ratio to the 512-rounded live peak (the default
/// replay's), the default's and `reclaiming()`'s against PyTorch's expandable segments, and
/// their waits for the device.
fn allocator_corpus(files: &[ResultFile]) -> Result<Vec<String>> {
    let traces = json_lines(one_file(files)?)?;
    let mut lines = vec![
        "| trace | events | PyTorch peak allocated | live (512-rounded) | PyTorch classic | \
         PyTorch expandable | ours classic | ours default | default / PyTorch expandable | ours \
         `reclaiming()` | `reclaiming()` / PyTorch expandable | waits: default, `reclaiming()` |"
            .to_owned(),
        "|---|---|---|---|---|---|---|---|---|---|---|---|".to_owned(),
    ];
    for trace in &traces {
        let classic = replay(trace, "classic")?;
        let default = replay(trace, "default")?;
        let reclaiming = replay(trace, "reclaiming")?;
        let live = count(default, "peak_requested_rounded_bytes")?;
        let torch_classic = &trace["pytorch"]["classic"];
        let torch_expandable = count(&trace["pytorch"]["expandable"], "peak_reserved_bytes")?;
        let over_live =
            |bytes: u64| format!("{} ({:.4})", thousands(bytes), bytes as f64 / live as f64);
        let over_expandable = |bytes: u64| format!("{:.4}", bytes as f64 / torch_expandable as f64);
        let default_reserved = count(default, "peak_reserved_bytes")?;
        let reclaiming_reserved = count(reclaiming, "peak_reserved_bytes")?;
        lines.push(row(&[
            trace_label(text(trace, "name")?).to_owned(),
            thousands(count(default, "events")?),
            thousands(count(torch_classic, "peak_allocated_bytes")?),
            thousands(live),
            over_live(count(torch_classic, "peak_reserved_bytes")?),
            over_live(torch_expandable),
            over_live(count(classic, "peak_reserved_bytes")?),
            over_live(default_reserved),
            over_expandable(default_reserved),
            over_live(reclaiming_reserved),
            over_expandable(reclaiming_reserved),
            format!(
                "{}, {}",
                count(default, "waits")?,
                count(reclaiming, "waits")?
            ),
        ]));
    }
    Ok(lines)
}

/// `crates/caching-allocator/README.md`'s handle table: per trace, the physical handles the
/// default's maps created with handles of up to 2 (one per page), 8 and 32 MiB, and the peak
/// reserved of the larger handles over the 2 MiB one's.
fn allocator_handles(files: &[ResultFile]) -> Result<Vec<String>> {
    let traces = json_lines(one_file(files)?)?;
    let mut lines = vec![
        "| trace | handles, 2 MiB | 8 MiB | 32 MiB | peak reserved over 2 MiB handles', 8 MiB | \
         32 MiB |"
            .to_owned(),
        "|---|---:|---:|---:|---:|---:|".to_owned(),
    ];
    for trace in &traces {
        let default = replay(trace, "default")?;
        let eight = replay(trace, "default_8mib_handles")?;
        let thirty_two = replay(trace, "default_32mib_handles")?;
        let reserved = count(default, "peak_reserved_bytes")? as f64;
        let over = |value: &Value| -> Result<String> {
            Ok(format!(
                "{:.4}",
                count(value, "peak_reserved_bytes")? as f64 / reserved
            ))
        };
        lines.push(row(&[
            trace_label(text(trace, "name")?).to_owned(),
            thousands(count(default, "handles")?),
            thousands(count(eight, "handles")?),
            thousands(count(thirty_two, "handles")?),
            over(eight)?,
            over(thirty_two)?,
        ]));
    }
    Ok(lines)
}

/// The loops of `tests/steady_state.rs` in words, by trace file.
fn loop_label(file: &str) -> &str {
    match file {
        "vit_l16_b32_adam_3steps.tsv.gz" => "ViT-L/16 batch 32, Adam",
        "vit_l16_b8_adam_3steps.tsv.gz" => "ViT-L/16 batch 8, Adam",
        "vit_b16_batch_change_adamw.tsv.gz" => "ViT-B/16 batch 48, AdamW",
        "resnet50_sgd_b128_5steps.tsv.gz" => "ResNet-50 batch 128, SGD",
        "llama_bf16_ckpt_adamw_8steps.tsv.gz" => "Llama 0.9B bf16, checkpointed",
        "bench_vit_l16_b1_adam_fused.tsv.gz" => "bench-memory ViT-L/16 batch 1, fused Adam",
        "bench_vit_l16_b1_adam_inbwd.tsv.gz" => "bench-memory, step in backward",
        "bench_vit_l16_b1_adam_ckpt.tsv.gz" => "bench-memory, checkpointed",
        other => other,
    }
}

/// One policy's loop: peak reserved over the live peak, and maps / unmaps / waits per step.
struct LoopSeries {
    over_live: f64,
    steps: Vec<[u64; 3]>,
}

impl LoopSeries {
    /// Parses `1.0079× live; maps/unmaps/waits per step: 58/30/9 2/2/1 ...`.
    fn parse(text: &str) -> Result<LoopSeries> {
        let (ratio, steps) = text
            .split_once("× live; maps/unmaps/waits per step:")
            .with_context(|| format!("not a loop line: `{text}`"))?;
        let over_live = ratio
            .trim()
            .parse()
            .with_context(|| format!("`{ratio}` is no ratio"))?;
        let steps = steps
            .split_whitespace()
            .map(|step| {
                let counts: Vec<u64> = step
                    .split('/')
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("`{step}` is not maps/unmaps/waits"))?;
                <[u64; 3]>::try_from(counts)
                    .map_err(|_| anyhow::anyhow!("`{step}` is not maps/unmaps/waits"))
            })
            .collect::<Result<_>>()?;
        Ok(LoopSeries { over_live, steps })
    }

    /// The 1-based step from which every step maps, unmaps and waits for nothing, if the loop
    /// ends that way.
    fn settled_from(&self) -> Option<usize> {
        let busy = self.steps.iter().rposition(|step| *step != [0, 0, 0]);
        match busy {
            None => Some(1),
            Some(idx) if idx + 1 < self.steps.len() => Some(idx + 2),
            Some(_) => None,
        }
    }

    /// Every step until the loop settles, then `then 0/0/0`.
    fn first_steps(&self) -> String {
        let shown = self
            .settled_from()
            .map_or(self.steps.len(), |from| from - 1);
        let mut parts: Vec<String> = self.steps[..shown]
            .iter()
            .map(|[maps, unmaps, waits]| format!("{maps}/{unmaps}/{waits}"))
            .collect();
        if shown < self.steps.len() {
            parts.push("then 0/0/0".into());
        }
        parts.join(", ")
    }

    /// `0/0/0 from step N` when the loop settles, else the range of each count over the steps
    /// from `first` (1-based) on: `3–4/4–9/2`.
    fn late_steps(&self, first: usize) -> String {
        if let Some(from) = self.settled_from() {
            return format!("0/0/0 from step {from}");
        }
        let late = &self.steps[(first - 1).min(self.steps.len())..];
        (0..3)
            .map(|which| {
                let low = late.iter().map(|step| step[which]).min().unwrap_or(0);
                let high = late.iter().map(|step| step[which]).max().unwrap_or(0);
                if low == high {
                    low.to_string()
                } else {
                    format!("{low}–{high}")
                }
            })
            .collect::<Vec<_>>()
            .join("/")
    }
}

/// `crates/caching-allocator/README.md`'s loop table, from what `tests/steady_state.rs` prints
/// for each loop (a line naming the trace, then one line per policy): the default's steps until
/// it settles, `reclaiming()`'s from step 7 (after the six warm-up steps the test allows the
/// default), and no reclaiming's, each with its peak reserved over the live peak.
fn allocator_steady_state(files: &[ResultFile]) -> Result<Vec<String>> {
    /// The first step of `reclaiming()`'s column: the test's warm-up steps, plus one.
    const LATE_FROM: usize = 7;
    let file = one_file(files)?;
    let mut loops: Vec<(String, Vec<(String, LoopSeries)>)> = Vec::new();
    for line in file.text.lines() {
        let trimmed = line.trim();
        if let Some(rest) = line.strip_prefix("  ") {
            let Some((policy, series)) = rest.split_once("  ") else {
                continue;
            };
            let Some((_, policies)) = loops.last_mut() else {
                bail!("{}: `{trimmed}` before any trace", file.path);
            };
            let series = LoopSeries::parse(series.trim())
                .with_context(|| format!("{}: `{trimmed}`", file.path))?;
            policies.push((policy.trim().to_owned(), series));
        } else if let Some(trace) = trimmed.split_whitespace().last() {
            // A trace's line (after the test harness's `test … ...` when it is the first).
            if trace.ends_with(".tsv.gz") && !trimmed.contains(": ") {
                loops.push((trace.to_owned(), Vec::new()));
            }
        }
    }
    if loops.is_empty() {
        bail!("{}: no loop", file.path);
    }
    let mut lines = vec![
        "| loop (steady step × 20) | default: first steps, then every step | peak reserved / live \
         | `reclaiming()`: each of steps 7–20 | peak / live | no reclaim \
         (`reclaim_free_pages:False`) |"
            .to_owned(),
        "|---|---|---|---|---|---|".to_owned(),
    ];
    for (trace, policies) in &loops {
        let policy = |name: &str| -> Result<&LoopSeries> {
            policies
                .iter()
                .find(|(policy, _)| policy == name)
                .map(|(_, series)| series)
                .with_context(|| format!("{}: no `{name}` loop for {trace}", file.path))
        };
        let default = policy("default")?;
        let reclaiming = policy("reclaiming()")?;
        let no_reclaim = policy("no reclaim")?;
        lines.push(row(&[
            loop_label(trace).to_owned(),
            default.first_steps(),
            format!("{:.4}", default.over_live),
            reclaiming.late_steps(LATE_FROM),
            format!("{:.4}", reclaiming.over_live),
            format!(
                "{}, {:.4}",
                no_reclaim.late_steps(LATE_FROM),
                no_reclaim.over_live
            ),
        ]));
    }
    Ok(lines)
}
