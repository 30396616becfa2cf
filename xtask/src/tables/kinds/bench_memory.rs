//! The tables of `bench-memory`'s JSON (`cargo xtask bench-memory --json`): each case beside
//! PyTorch's anchors, tokens per second of a language model's recipes at each batch on both
//! sides, the planner at each budget, the same cases under different allocator settings, and the
//! fp8 cases beside their bf16 ones.
//!
//! It knows bench-memory's case names only as far as matching PyTorch's anchors needs
//! ([`pytorch_case`]; a test holds that against headroom-bench's own cases) and as far as an fp8
//! case's bf16 counterpart is its name with `fp8` made `bf16`.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::{count, json_lines, number, row, table_head, text, thousands, ResultFile};

/// The `cases` of a `cargo xtask bench-memory --json` document.
fn bench_memory_cases(file: &ResultFile) -> Result<Vec<Value>> {
    let document: Value = serde_json::from_str(&file.text)
        .with_context(|| format!("{}: not a JSON document", file.path))?;
    document["cases"]
        .as_array()
        .cloned()
        .with_context(|| format!("{}: no `cases` (not bench-memory's --json)", file.path))
}

/// The case of `torch_reference.py` that the bench-memory case `case` is compared with: the
/// same name, but for `adam_foreach_unbounded`, which compares with PyTorch's foreach (unbounded
/// too) as `adam_foreach` does. headroom-bench's `bench_memory_case_names` says the same; the
/// test below holds the two equal.
pub(super) fn pytorch_case(case: &str) -> &str {
    match case {
        "adam_foreach_unbounded" => "adam_foreach",
        other => other,
    }
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
    let name = pytorch_case(text(case, "case")?);
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

/// Every case of one or more bench-memory runs (`.json`, in order) beside PyTorch's case of the
/// same name in the anchor files (`.jsonl`): peak allocated bytes and median step, `—` where
/// PyTorch has no such case.
pub(super) fn bench_memory_pytorch(files: &[ResultFile]) -> Result<Vec<String>> {
    let (benches, anchor_files): (Vec<&ResultFile>, Vec<&ResultFile>) = files
        .iter()
        .partition(|file| !file.path.ends_with(".jsonl"));
    if benches.is_empty() {
        bail!("reads bench-memory JSON files and, optionally, anchor.jsonl files");
    }
    let anchors = match anchor_files.as_slice() {
        [] => None,
        anchor_files => {
            // A later file's line for the same case wins: it measured again.
            let mut anchors = Vec::new();
            for file in anchor_files.iter().rev() {
                anchors.extend(json_lines(file)?);
            }
            Some(anchors)
        }
    };
    let mut lines = table_head(
        "| batch | case | peak alloc (B) | PyTorch (B) | step ms | PyTorch ms |",
        "|---:|---|---:|---:|---:|---:|",
    );
    let mut cases = Vec::new();
    for bench in benches {
        cases.extend(bench_memory_cases(bench)?);
    }
    for case in cases {
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

/// Tokens a row of a bench-memory document: the `--seq` its command line gave (language models;
/// the JSON predates a field of its own).
fn sequence_length(file: &ResultFile) -> Result<u64> {
    let document: Value = serde_json::from_str(&file.text)
        .with_context(|| format!("{}: not a JSON document", file.path))?;
    let command = text(&document, "command")?;
    let mut words = command.split_whitespace();
    while let Some(word) = words.next() {
        if word == "--seq" {
            if let Some(n) = words.next().and_then(|n| n.parse().ok()) {
                return Ok(n);
            }
        }
    }
    bail!("{}: its command has no --seq N ({command})", file.path)
}

/// Tokens per second of a language model's training recipes at each batch, ours from
/// bench-memory documents (`.json`) and PyTorch's from anchor files (`.jsonl`, a batch that ran
/// out of memory shown as such): batch × tokens a row ÷ the median step. The fastest row of
/// each side is marked, and a last row gives our fastest over PyTorch's.
pub(super) fn tokens_per_second(files: &[ResultFile]) -> Result<Vec<String>> {
    // Side, case, batch, and (peak bytes, step ms, tokens/s) unless it ran out of memory.
    type Measured = Option<(u64, f64, f64)>;
    let mut rows: Vec<(&str, String, u64, Measured)> = Vec::new();
    for file in files {
        if file.path.ends_with(".jsonl") {
            for line in json_lines(file)? {
                if line["case"] == "env" {
                    continue;
                }
                let (case, batch) = (text(&line, "case")?.to_owned(), count(&line, "batch")?);
                if line["error"].is_string() {
                    rows.push(("PyTorch", case, batch, None));
                    continue;
                }
                let ms = number(&line, "step_ms_median")?;
                let tokens = (batch * count(&line, "seq")?) as f64 * 1e3 / ms;
                let peak = number(&line, "steady_peak_alloc")? as u64;
                rows.push(("PyTorch", case, batch, Some((peak, ms, tokens))));
            }
        } else {
            let seq = sequence_length(file)?;
            for case in bench_memory_cases(file)? {
                let batch = count(&case, "batch")?;
                let ms = number(&case, "step_ms")?;
                let tokens = (batch * seq) as f64 * 1e3 / ms;
                let peak = count(&case, "peak_allocated_bytes")?;
                let name = text(&case, "case")?.to_owned();
                rows.push(("Headroom", name, batch, Some((peak, ms, tokens))));
            }
        }
    }
    let fastest = |side: &str| {
        rows.iter()
            .filter(|row| row.0 == side)
            .filter_map(|row| row.3.map(|(_, _, tokens)| tokens))
            .fold(None, |best: Option<f64>, t| {
                Some(best.map_or(t, |b| b.max(t)))
            })
    };
    let (ours, theirs) = match (fastest("Headroom"), fastest("PyTorch")) {
        (Some(ours), Some(theirs)) => (ours, theirs),
        _ => bail!("reads bench-memory JSON files and anchor .jsonl files: both sides needed"),
    };
    let mut lines = table_head(
        "| side | case | batch | peak alloc (B) | step ms | tokens/s |",
        "|---|---|---:|---:|---:|---:|",
    );
    for (side, case, batch, figures) in &rows {
        let cells = match figures {
            None => vec!["out of memory".to_owned(), "—".to_owned(), "—".to_owned()],
            Some((peak, ms, tokens)) => {
                let best = *tokens == if *side == "Headroom" { ours } else { theirs };
                let tokens = format!("{tokens:.0}");
                vec![
                    thousands(*peak),
                    format!("{ms:.1}"),
                    if best {
                        format!("**{tokens}** (fastest)")
                    } else {
                        tokens
                    },
                ]
            }
        };
        let mut row_cells = vec![(*side).to_owned(), case.clone(), batch.to_string()];
        row_cells.extend(cells);
        lines.push(row(&row_cells));
    }
    lines.push(row(&[
        "Headroom / PyTorch".to_owned(),
        "each side's fastest".to_owned(),
        String::new(),
        String::new(),
        String::new(),
        format!("{:.2}×", ours / theirs),
    ]));
    Ok(lines)
}

/// The planner (`adam_auto`) at each budget: its plan in words, measured and predicted peak and
/// step, and uniform every-k checkpointing at the same budget, measured in alternation.
pub(super) fn bench_memory_planner(files: &[ResultFile]) -> Result<Vec<String>> {
    if files.is_empty() {
        bail!("reads one or more bench-memory JSON files of adam_auto");
    }
    let mut lines = table_head(
        "| budget (B) | plan | peak (B) | predicted (B) | step ms | predicted ms | uniform: every k, \
         recomputed | uniform peak (B) | uniform ms | plan / uniform |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    );
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
pub(super) fn bench_memory_allocators(files: &[ResultFile]) -> Result<Vec<String>> {
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

/// The fp8 cases of a bench-memory document beside their bf16 counterparts in it (the same
/// name with `fp8` made `bf16`, the same model and batch; an fp8 case the run has no
/// counterpart of, `adam_inbwd_fp8`, is left to the tables that compare it with PyTorch, and a
/// document with no pair at all is an error): peak allocated bytes, fp8 / bf16, activations and
/// what the traced block keeps (memory only, for a CPU run whose steps are no figures).
pub(super) fn bench_memory_fp8(files: &[ResultFile]) -> Result<Vec<String>> {
    fp8_beside_bf16(files, false)
}

/// [`bench_memory_fp8`] with each side's median step and the speed-up, bf16 step / fp8 step
/// (a GPU run).
pub(super) fn bench_memory_fp8_steps(files: &[ResultFile]) -> Result<Vec<String>> {
    fp8_beside_bf16(files, true)
}

fn fp8_beside_bf16(files: &[ResultFile], steps: bool) -> Result<Vec<String>> {
    let file = match files {
        [file] => file,
        _ => bail!("reads one bench-memory JSON file, given {}", files.len()),
    };
    let cases = bench_memory_cases(file)?;
    let mut lines = if steps {
        table_head(
            "| model | batch | case | step (ms) | bf16 step (ms) | speed-up | peak (B) | bf16 peak (B) | fp8 / bf16 | activations (B) | bf16 activations (B) |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        )
    } else {
        table_head(
            "| model | batch | case | peak (B) | bf16 peak (B) | fp8 / bf16 | activations (B) | bf16 activations (B) | block keeps (B) | bf16 block keeps (B) |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        )
    };
    let block_keeps = |case: &Value| -> String {
        case["block_saves"]["kept_bytes"]
            .as_u64()
            .map_or("—".into(), thousands)
    };
    for case in cases.iter().filter(|case| {
        case["case"]
            .as_str()
            .is_some_and(|name| name.contains("fp8"))
    }) {
        let name = text(case, "case")?;
        let (model, batch) = (text(case, "model")?, count(case, "batch")?);
        let counterpart = name.replace("fp8", "bf16");
        let Some(bf16) = cases.iter().find(|other| {
            other["case"] == counterpart.as_str()
                && other["model"] == model
                && other["batch"].as_u64() == Some(batch)
        }) else {
            continue;
        };
        let (peak, bf16_peak) = (
            count(case, "peak_allocated_bytes")?,
            count(bf16, "peak_allocated_bytes")?,
        );
        let mut cells = vec![model.to_owned(), batch.to_string(), name.to_owned()];
        if steps {
            let (step, bf16_step) = (number(case, "step_ms")?, number(bf16, "step_ms")?);
            cells.extend([
                format!("{step:.1}"),
                format!("{bf16_step:.1}"),
                format!("{:.3}", bf16_step / step),
            ]);
        }
        cells.extend([
            thousands(peak),
            thousands(bf16_peak),
            format!("{:.3}", peak as f64 / bf16_peak as f64),
            thousands(count(case, "activation_bytes")?),
            thousands(count(bf16, "activation_bytes")?),
        ]);
        if !steps {
            cells.extend([block_keeps(case), block_keeps(bf16)]);
        }
        lines.push(row(&cells));
    }
    if lines.len() == 2 {
        bail!("{}: no fp8 case beside its bf16 counterpart", file.path);
    }
    Ok(lines)
}

/// The same bench-memory cases run by two builds (the first file the before, the second the
/// after): per model, batch and case, each build's peak allocated bytes and median step, and
/// after / before.
pub(super) fn bench_memory_versions(files: &[ResultFile]) -> Result<Vec<String>> {
    let [before, after] = files else {
        bail!(
            "reads two bench-memory JSON files (before, after), given {}",
            files.len()
        );
    };
    let (before_cases, after_cases) = (bench_memory_cases(before)?, bench_memory_cases(after)?);
    let mut lines = table_head(
        "| model | batch | case | peak before (B) | peak after (B) | after / before | step before \
         (ms) | step after (ms) | after / before |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    );
    for case in &before_cases {
        let (model, name, batch) = (
            text(case, "model")?,
            text(case, "case")?,
            count(case, "batch")?,
        );
        let same = after_cases
            .iter()
            .find(|other| {
                other["model"] == model
                    && other["case"] == name
                    && other["batch"].as_u64() == Some(batch)
            })
            .with_context(|| format!("{}: no {model} {name} at batch {batch}", after.path))?;
        let (peak_before, peak_after) = (
            count(case, "peak_allocated_bytes")?,
            count(same, "peak_allocated_bytes")?,
        );
        let (step_before, step_after) = (number(case, "step_ms")?, number(same, "step_ms")?);
        lines.push(row(&[
            model.to_owned(),
            batch.to_string(),
            name.to_owned(),
            thousands(peak_before),
            thousands(peak_after),
            format!("{:.3}", peak_after as f64 / peak_before as f64),
            format!("{step_before:.2}"),
            format!("{step_after:.2}"),
            format!("{:.3}", step_after / step_before),
        ]));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    /// Every case headroom-bench runs matches PyTorch's case of the name it writes beside it.
    #[test]
    fn pytorch_cases_are_the_ones_headroom_bench_names() {
        let cases = headroom_bench::bench_memory_case_names();
        assert_eq!(cases.len(), 39);
        for (case, pytorch) in cases {
            assert_eq!(super::pytorch_case(case), pytorch, "{case}");
        }
        assert_eq!(
            super::pytorch_case("adam_foreach_unbounded"),
            "adam_foreach"
        );
    }

    /// Each fp8 case beside the bf16 case of its name, model and batch, memory only; an fp8
    /// case without its counterpart is left out, and a file without a pair is an error.
    #[test]
    fn fp8_cases_sit_beside_their_bf16_counterparts() {
        let run = r#"{"cases": [
            {"case": "adam_bf16", "model": "m", "batch": 4, "peak_allocated_bytes": 2000, "activation_bytes": 800, "block_saves": {"kept_bytes": 400}},
            {"case": "adam_fp8", "model": "m", "batch": 4, "peak_allocated_bytes": 1500, "activation_bytes": 500, "block_saves": {"kept_bytes": 250}},
            {"case": "adam_inbwd_ckpt_fp8", "model": "m", "batch": 8, "peak_allocated_bytes": 1, "activation_bytes": 1}]}"#;
        let only_first = run
            .replace("\"batch\": 8", "\"batch\": 4")
            .replace("adam_inbwd_ckpt_fp8", "adam_fp16");
        let table =
            super::super::rendered("bench-memory-fp8", &[("results/x/run.json", &only_first)])
                .unwrap();
        assert_eq!(
            table[2..],
            ["| m | 4 | adam_fp8 | 1,500 | 2,000 | 0.750 | 500 | 800 | 250 | 400 |"]
        );
        let unpaired = super::super::rendered("bench-memory-fp8", &[("results/x/run.json", run)]);
        assert_eq!(unpaired.unwrap(), table);
        let alone = run.replace("adam_bf16", "adam_fp16");
        let alone = super::super::rendered("bench-memory-fp8", &[("results/x/run.json", &alone)]);
        assert!(format!("{:#}", alone.unwrap_err()).contains("no fp8 case beside"));
        let none = run.replace("fp8", "fp16");
        assert!(
            super::super::rendered("bench-memory-fp8", &[("results/x/run.json", &none)]).is_err()
        );
        let timed = only_first
            .replace(
                "\"batch\": 4, \"peak_allocated_bytes\": 2000",
                "\"batch\": 4, \"step_ms\": 150.0, \"peak_allocated_bytes\": 2000",
            )
            .replace(
                "\"batch\": 4, \"peak_allocated_bytes\": 1500",
                "\"batch\": 4, \"step_ms\": 120.0, \"peak_allocated_bytes\": 1500",
            );
        let table =
            super::super::rendered("bench-memory-fp8-steps", &[("results/x/run.json", &timed)])
                .unwrap();
        assert_eq!(
            table[2..],
            ["| m | 4 | adam_fp8 | 120.0 | 150.0 | 1.250 | 1,500 | 2,000 | 0.750 | 500 | 800 |"]
        );
    }

    /// Tokens per second from the command's --seq and each side's rows; an out-of-memory batch
    /// shows as such; the fastest of each side is marked and their ratio closes the table.
    #[test]
    fn tokens_per_second_marks_each_sides_fastest_and_their_ratio() {
        let ours = r#"{"command": "headroom-bench bench-memory --model llama-3.1-8b --seq 2048 --batch 4", "cases": [
            {"case": "adamw4bit_inbwd_bf16", "batch": 4, "step_ms": 800.0, "peak_allocated_bytes": 1000}]}"#;
        let theirs = "{\"case\": \"env\"}\n\
            {\"case\": \"adamw8bit_bf16\", \"batch\": 2, \"seq\": 2048, \"step_ms_median\": 512.0, \"steady_peak_alloc\": 2000}\n\
            {\"case\": \"adamw8bit_bf16\", \"batch\": 7, \"error\": \"OutOfMemoryError\"}\n";
        let table = super::super::rendered(
            "tokens-per-second",
            &[
                ("results/x/ours.json", ours),
                ("results/x/anchor.jsonl", theirs),
            ],
        )
        .unwrap();
        assert_eq!(
            table[2..],
            [
                "| Headroom | adamw4bit_inbwd_bf16 | 4 | 1,000 | 800.0 | **10240** (fastest) |",
                "| PyTorch | adamw8bit_bf16 | 2 | 2,000 | 512.0 | **8000** (fastest) |",
                "| PyTorch | adamw8bit_bf16 | 7 | out of memory | — | — |",
                "| Headroom / PyTorch | each side's fastest | | | | 1.28× |",
            ]
        );
        let no_seq = ours.replace("--seq 2048 ", "");
        let err = super::super::rendered(
            "tokens-per-second",
            &[
                ("results/x/ours.json", &no_seq),
                ("results/x/anchor.jsonl", theirs),
            ],
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("no --seq N"), "{err:#}");
    }
}
