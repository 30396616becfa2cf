//! The table of `plan --find-max-model --run --json` (the largest Llama-shaped model our plan
//! fits, measured) beside PyTorch's (`scripts/pytorch/find_max_model.py`'s JSON lines, one file
//! or several runs' between their bounds): each side's largest model that trained, PyTorch's
//! smallest larger probe that ran out of memory, and the ratio of parameters.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::{count, json_lines, number, row, table_head, text, thousands, ResultFile};

/// `model, N layers`.
fn shape(value: &Value) -> Result<String> {
    Ok(format!(
        "{}, {} layers",
        text(value, "model")?,
        count(value, "layers")?
    ))
}

/// Our largest measured shape (its plan, measured peak beside the predicted one, host state,
/// step, tokens a second), PyTorch's largest probe that fitted and its smallest larger probe
/// that did not, and our parameters over PyTorch's.
pub(super) fn find_max_model(files: &[ResultFile]) -> Result<Vec<String>> {
    let [ours, pytorch @ ..] = files else {
        bail!("reads plan --find-max-model --run --json, then find_max_model.py's JSON lines");
    };
    if pytorch.is_empty() {
        bail!("reads find_max_model.py's JSON lines after our JSON");
    }
    let document: Value = serde_json::from_str(&ours.text)
        .with_context(|| format!("{}: not a JSON document", ours.path))?;
    let largest = &document["largest_measured"];
    if !largest.is_object() {
        bail!(
            "{}: no `largest_measured` (was it run with --run?)",
            ours.path
        );
    }
    let measured = &largest["measured"];
    let predicted = document["shapes"]
        .as_array()
        .and_then(|shapes| {
            shapes
                .iter()
                .find(|s| s["model"] == largest["model"] && s["layers"] == largest["layers"])
        })
        .map(|s| &s["predicted"])
        .with_context(|| format!("{}: the measured shape's prediction is missing", ours.path))?;
    let tokens = (count(&document, "seq")? * count(&document, "batch")?) as f64;
    let plan = &largest["plan"];
    let recomputed = count(plan, "checkpointed_blocks")?;
    let plan_text = match recomputed {
        0 => format!("`{}`", text(plan, "case")?),
        n => format!(
            "`{}`, {n} of {} blocks recomputed",
            text(plan, "case")?,
            count(plan, "blocks")?
        ),
    };
    let (peak, want) = (
        count(measured, "peak_allocated_bytes")?,
        count(predicted, "gpu_peak_bytes")?,
    );
    let step = number(measured, "step_ms")?;
    let mut lines = table_head(
        "| side | shape | parameters | plan or recipe | GPU peak (B) | predicted | host state (B) | step ms | tokens/s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    );
    lines.push(row(&[
        "Headroom".to_owned(),
        shape(largest)?,
        thousands(count(largest, "parameters")?),
        plan_text,
        thousands(peak),
        format!("{:+.2}%", (want as f64 / peak as f64 - 1.0) * 100.0),
        thousands(count(measured, "host_state_bytes")?),
        format!("{step:.1}"),
        format!("{:.0}", tokens * 1000.0 / step),
    ]));
    let mut probes = Vec::new();
    for file in pytorch {
        probes.extend(
            json_lines(file)?
                .into_iter()
                .filter(|l| l["fits"].is_boolean()),
        );
    }
    let fitted = probes
        .iter()
        .filter(|p| p["fits"] == true)
        .max_by_key(|p| p["parameters"].as_u64())
        .context("no PyTorch probe fitted")?;
    let theirs = count(fitted, "parameters")?;
    lines.push(row(&[
        "PyTorch + torchao".to_owned(),
        shape(fitted)?,
        thousands(theirs),
        format!("`{}`", text(fitted, "recipe")?),
        thousands(count(fitted, "peak_allocated_bytes")?),
        String::new(),
        "—".to_owned(),
        format!("{:.1}", number(fitted, "step_ms")?),
        format!("{:.0}", number(fitted, "tokens_per_s")?),
    ]));
    let next_failed = probes
        .iter()
        .filter(|p| p["fits"] == false && p["parameters"].as_u64() > Some(theirs))
        .min_by_key(|p| p["parameters"].as_u64());
    if let Some(failed) = next_failed {
        lines.push(row(&[
            "PyTorch + torchao, next probe".to_owned(),
            shape(failed)?,
            thousands(count(failed, "parameters")?),
            format!("`{}`", text(failed, "recipe")?),
            "out of memory".to_owned(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
        ]));
    }
    let ratio = count(largest, "parameters")? as f64 / theirs as f64;
    lines.push(row(&[
        "Headroom / PyTorch".to_owned(),
        String::new(),
        format!("{ratio:.2}×"),
    ]));
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::super::rendered;

    const OURS: &str = r#"{"seq": 2048, "batch": 1, "memory_cap_mb": 142336,
        "largest_measured": {"model": "qwen2.5-32b", "layers": 136, "parameters": 67871454208,
          "plan": {"blocks": 136, "case": "adamw4bit_stream_inbwd_bf16_ckpt",
                   "checkpointed_blocks": 128},
          "measured": {"host_state_bytes": 72115352384, "peak_allocated_bytes": 145590737920,
                       "step_ms": 2554.806}},
        "shapes": [{"model": "qwen2.5-32b", "layers": 64, "predicted": {"gpu_peak_bytes": 1}},
          {"model": "qwen2.5-32b", "layers": 136,
           "predicted": {"gpu_peak_bytes": 146101266432}}]}"#;

    /// Probes of two runs merge: the largest that fitted, the smallest larger one that did not
    /// (a larger failure and the summary lines are ignored), the ratio of parameters.
    #[test]
    fn the_largest_of_each_side_and_the_ratio() {
        let first = "{\"model\": \"qwen2.5-32b\", \"layers\": 76, \"parameters\": 38615139328, \"recipe\": \"r\", \"fits\": true, \"peak_allocated_bytes\": 140477240832, \"step_ms\": 1969.65, \"tokens_per_s\": 1039.8}\n\
            {\"model\": \"qwen2.5-32b\", \"layers\": 84, \"parameters\": 42515981312, \"recipe\": \"r\", \"fits\": false, \"error\": \"CUDA out of memory\"}\n\
            {\"model\": \"qwen2.5-32b\", \"layers\": 100, \"parameters\": 50317665280, \"recipe\": \"r\", \"fits\": false}\n";
        let second = "{\"model\": \"qwen2.5-32b\", \"layers\": 80, \"parameters\": 40565560320, \"recipe\": \"r\", \"fits\": true, \"peak_allocated_bytes\": 146539378176, \"step_ms\": 2080.61, \"tokens_per_s\": 984.33}\n\
            {\"recipe\": \"r\", \"probes\": 1, \"largest\": {\"parameters\": 40565560320}}\n";
        let table = rendered(
            "find-max-model",
            &[
                ("results/x/fmm_plan.json", OURS),
                ("results/x/fmm_torch.jsonl", first),
                ("results/y/fmm_torch.jsonl", second),
            ],
        )
        .unwrap();
        assert_eq!(
            table[2],
            "| Headroom | qwen2.5-32b, 136 layers | 67,871,454,208 | \
             `adamw4bit_stream_inbwd_bf16_ckpt`, 128 of 136 blocks recomputed | \
             145,590,737,920 | +0.35% | 72,115,352,384 | 2554.8 | 802 |"
        );
        assert_eq!(
            table[3],
            "| PyTorch + torchao | qwen2.5-32b, 80 layers | 40,565,560,320 | `r` | \
             146,539,378,176 | | — | 2080.6 | 984 |"
        );
        assert_eq!(
            table[4],
            "| PyTorch + torchao, next probe | qwen2.5-32b, 84 layers | 42,515,981,312 | `r` | \
             out of memory | | | | |"
        );
        assert_eq!(table[5], "| Headroom / PyTorch | | 1.67× |");
    }
}
