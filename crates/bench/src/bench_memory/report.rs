//! `bench-memory`'s text outputs: the Markdown table, the JSON document, PyTorch's anchors read
//! from `torch_reference.py`'s `anchor.jsonl`, and the tutorial's finding checked on the figures.
//!
//! It reads [`CaseResult`]s only; it runs nothing and knows no device.

use std::collections::HashMap;
use std::fmt::Write as _;

use anyhow::Result;
use serde_json::{json, Value};

use super::cases::Case;
use super::measure::CaseResult;

/// PyTorch's figures for one case of `torch_reference.py` (one line of its `anchor.jsonl`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Anchor {
    pub(crate) first3_peak_alloc: u64,
    pub(crate) steady_peak_alloc: u64,
    pub(crate) steady_peak_reserved: u64,
    pub(crate) step_ms_median: f64,
}

/// PyTorch's anchors by (model, case, batch).
pub(crate) type Anchors = HashMap<(String, String, usize), Anchor>;

/// The model of an anchor line without a `model` key (`torch_reference.py` measured only
/// ViT-L/16).
const ANCHOR_DEFAULT_MODEL: &str = "vit_l_16";

/// PyTorch's anchors in an `anchor.jsonl` (or the lines of `torch_reference.py case NAME BATCH`
/// runs); lines that are not JSON objects (warnings) or lack peak figures (the `env` line,
/// errors, other phases) are skipped.
pub(crate) fn parse_anchors(text: &str) -> Result<Anchors> {
    let mut anchors = HashMap::new();
    for row in crate::json_object_lines(text) {
        let row = row?;
        let bytes = |key: &str| row[key].as_f64().map(|v| v as u64);
        let (Some(case), Some(batch), Some(peak), Some(reserved), Some(ms)) = (
            row["case"].as_str(),
            row["batch"].as_u64(),
            bytes("steady_peak_alloc"),
            bytes("steady_peak_reserved"),
            row["step_ms_median"].as_f64(),
        ) else {
            continue;
        };
        let model = row["model"].as_str().unwrap_or(ANCHOR_DEFAULT_MODEL);
        anchors.insert(
            (model.to_owned(), case.to_owned(), batch as usize),
            Anchor {
                first3_peak_alloc: bytes("first3_peak_alloc").unwrap_or(0),
                steady_peak_alloc: peak,
                steady_peak_reserved: reserved,
                step_ms_median: ms,
            },
        );
    }
    Ok(anchors)
}

/// PyTorch's figures for the model, case and batch of `result`.
pub(crate) fn anchor<'a>(anchors: &'a Anchors, result: &CaseResult) -> Option<&'a Anchor> {
    anchors.get(&(
        result.model.to_owned(),
        result.case.pytorch_name().to_owned(),
        result.batch,
    ))
}

/// Bytes as decimal GB (the anchors' unit) when at least 1 GB, else MB.
pub(crate) fn size(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

/// The Markdown table: one row per case, PyTorch's figures beside ours where known.
pub(crate) fn markdown(results: &[CaseResult], anchors: &Anchors) -> String {
    let with_pytorch = results.iter().any(|r| anchor(anchors, r).is_some());
    let mut out = String::from(
        "| model | batch | case | peak alloc | peak reserved | host peak | first-3 peak | \
         step ms | params | grads | opt state | activations | cast cache | logits | peak in |",
    );
    if with_pytorch {
        out.push_str(" PyTorch peak | peak ratio | PyTorch ms | time ratio |");
    }
    out.push_str("\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    if with_pytorch {
        out.push_str("---:|---:|---:|---:|");
    }
    out.push('\n');
    for r in results {
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} |",
            r.model,
            r.batch,
            r.case.name(),
            size(r.peak_allocated_bytes),
            size(r.peak_reserved_bytes),
            r.host_peak_reserved_bytes
                .map_or_else(|| "-".to_owned(), size),
            size(r.first3_peak_allocated_bytes),
            r.step_ms,
            size(r.param_bytes),
            size(r.grad_bytes),
            size(r.state_bytes),
            size(r.activation_bytes),
            size(r.cast_cache_bytes),
            r.logits_bytes.map_or_else(|| "-".to_owned(), size),
            r.at_peak.phase.map_or("-", |p| p.label()),
        );
        if with_pytorch {
            match anchor(anchors, r) {
                Some(a) => {
                    let _ = write!(
                        out,
                        " {} | {:.2} | {:.1} | {:.2} |",
                        size(a.steady_peak_alloc),
                        r.peak_allocated_bytes as f64 / a.steady_peak_alloc as f64,
                        a.step_ms_median,
                        r.step_ms / a.step_ms_median,
                    );
                }
                None => out.push_str(" - | - | - | - |"),
            }
        }
        out.push('\n');
    }
    out
}

/// The tutorial's first finding, made at batch 1 where parameters, gradients and state
/// dominate: foreach (unbounded) peaks above single and fused, and 8-bit below every other Adam.
/// `None` when a case it needs was not run at `batch`.
pub(crate) fn finding(results: &[CaseResult], batch: usize) -> Option<String> {
    let peak = |case: Case| {
        results
            .iter()
            .find(|r| r.case == case && r.batch == batch)
            .map(|r| r.peak_allocated_bytes)
    };
    let unbounded = peak(Case::AdamForeachUnbounded)?;
    let single = peak(Case::AdamSingle)?;
    let fused = peak(Case::AdamFused)?;
    let eight_bit = peak(Case::Adam8bit)?;
    let others: Vec<u64> = [Case::AdamForeach, Case::AdamForeachUnbounded]
        .into_iter()
        .filter_map(peak)
        .chain([single, fused])
        .collect();
    let above = unbounded > single && unbounded > fused;
    let below = others.iter().all(|&p| eight_bit < p);
    let verdict = if above && below {
        "reproduced"
    } else {
        "NOT reproduced"
    };
    Some(format!(
        "batch {batch}: foreach (unbounded) {} {} single {} and fused {}; 8-bit {} {} every \
         other Adam case: {verdict}",
        size(unbounded),
        if above { "above" } else { "not above" },
        size(single),
        size(fused),
        size(eight_bit),
        if below { "below" } else { "not below" },
    ))
}

/// One case as a JSON object.
pub(crate) fn case_json(r: &CaseResult, anchors: &Anchors) -> Value {
    let components: serde_json::Map<String, Value> = r
        .at_peak
        .components()
        .iter()
        .map(|(name, bytes)| ((*name).to_owned(), json!(bytes)))
        .collect();
    let phases: Vec<Value> = r
        .phases
        .iter()
        .map(|p| {
            json!({
                "phase": p.phase.label(),
                "allocated_before_bytes": p.before,
                "allocated_after_bytes": p.after,
                "peak_allocated_bytes": p.peak,
            })
        })
        .collect();
    let mut value = json!({
        "case": r.case.name(),
        "model": r.model,
        "batch": r.batch,
        "device": r.device,
        "n_params": r.n_params,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "host_peak_reserved_bytes": r.host_peak_reserved_bytes,
        "first3_peak_allocated_bytes": r.first3_peak_allocated_bytes,
        "step_ms": r.step_ms,
        "step_ms_min": r.step_ms_min,
        "times_ms": r.times_ms,
        "param_bytes": r.param_bytes,
        "grad_bytes": r.grad_bytes,
        "state_bytes": r.state_bytes,
        "host_state_bytes": r.host_state_bytes,
        "activation_bytes": r.activation_bytes,
        "cast_cache_bytes": r.cast_cache_bytes,
        "logits_bytes": r.logits_bytes,
        "traced_step": {
            "phases": phases,
            "peak_phase": r.at_peak.phase.map(|p| p.label()),
            "peak_allocated_bytes": r.at_peak.total(),
            "at_peak": components,
        },
    });
    if let Some(blocks) = r.checkpointed_blocks {
        value["checkpointed_blocks"] = blocks.into();
    }
    if let Some(layers) = r.layers {
        value["layers"] = layers.into();
    }
    if let Some(bytes) = r.stream_budget {
        value["stream_budget_bytes"] = bytes.into();
    }
    if let Some(plan) = &r.plan {
        value["plan"] = super::budget_plan::json(plan);
    }
    if let Some(saves) = &r.block_saves {
        value["block_saves"] = saves.json();
    }
    if let Some(a) = anchor(anchors, r) {
        value["pytorch"] = json!({
            "case": r.case.pytorch_name(),
            "first3_peak_alloc": a.first3_peak_alloc,
            "steady_peak_alloc": a.steady_peak_alloc,
            "steady_peak_reserved": a.steady_peak_reserved,
            "step_ms_median": a.step_ms_median,
        });
    }
    value
}

/// The JSON document: where and how it ran, then one object per case.
pub(crate) fn document(results: &[CaseResult], anchors: &Anchors, command: &str) -> Value {
    json!({
        "tool": "cargo xtask bench-memory",
        "command": command,
        "revision": revision(),
        "host": host(),
        "cases": results.iter().map(|r| case_json(r, anchors)).collect::<Vec<_>>(),
    })
}

/// The measured sources' commit: `COMMIT` where the caller knows it (scripts/gpu-measure.sh sets
/// it on a machine whose copy of the tree has no git metadata of its own), else `git rev-parse`
/// in the working directory (not the build machine's checkout, which a carried binary names).
fn revision() -> String {
    if let Some(commit) = std::env::var("COMMIT").ok().filter(|c| !c.is_empty()) {
        return commit;
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

fn host() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|name| name.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}
