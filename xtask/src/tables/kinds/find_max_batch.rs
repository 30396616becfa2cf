//! The table of `find-max-batch`'s JSON (`cargo xtask find-max-batch --json`, gpu-measure.sh's
//! `fmb.json`): the largest batch of each case under the cap, and the search's seconds, beside
//! PyTorch's (`scripts/pytorch/find_max_batch.py`'s JSON lines, `fmb_torch.jsonl`).
//!
//! PyTorch's case of a find-max-batch case is bench-memory's ([`super::bench_memory`]'s
//! `pytorch_case`): find-max-batch searches bench-memory's cases.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::bench_memory::pytorch_case;
use super::{count, json_lines, number, row, table_head, text, ResultFile};

/// PyTorch's result for `case` (a find-max-batch case): from `lines` (find_max_batch.py's) when
/// given, matched by model (`vit_l_16` where a line names none, as find-max-batch reads them)
/// and PyTorch's name of the case, else the case's own `pytorch` object. A line that reports an
/// error stands for the case too.
fn pytorch_result<'a>(case: &'a Value, lines: Option<&'a [Value]>) -> Result<Option<&'a Value>> {
    let Some(lines) = lines else {
        let own = &case["pytorch"];
        return Ok((!own.is_null()).then_some(own));
    };
    let name = pytorch_case(text(case, "case")?);
    let model = text(case, "model")?;
    Ok(lines.iter().find(|line| {
        line["case"] == name
            && line["model"].as_str().unwrap_or("vit_l_16") == model
            && (line["max_batch"].is_u64() || line["error"].is_string())
    }))
}

/// The largest batch per case and the seconds its search took (model building included), ours
/// beside PyTorch's; `—` where PyTorch has no such case, `error` where its search failed.
pub(super) fn find_max_batch(files: &[ResultFile]) -> Result<Vec<String>> {
    let (ours, pytorch) = match files {
        [ours] => (ours, None),
        [ours, pytorch] => (ours, Some(json_lines(pytorch)?)),
        _ => bail!(
            "reads find-max-batch's JSON and, optionally, find_max_batch.py's JSON lines, given \
             {} files",
            files.len()
        ),
    };
    let document: Value = serde_json::from_str(&ours.text)
        .with_context(|| format!("{}: not a JSON document", ours.path))?;
    if document["complete"] != true {
        bail!(
            "{}: `complete` is not true: the search stopped before every case ran",
            ours.path
        );
    }
    let cases = document["cases"]
        .as_array()
        .with_context(|| format!("{}: no `cases` (not find-max-batch's --json)", ours.path))?;
    let mut lines = table_head(
        "| case | Headroom | s | PyTorch | s |",
        "|---|---:|---:|---:|---:|",
    );
    for case in cases {
        let mut cells = vec![
            format!("`{}`", text(case, "case")?),
            count(case, "max_batch")?.to_string(),
            format!("{:.1}", number(case, "seconds")?),
        ];
        match pytorch_result(case, pytorch.as_deref())? {
            None => cells.extend(["—".to_owned(), String::new()]),
            Some(torch) if torch["error"].is_string() => {
                cells.extend(["error".to_owned(), String::new()])
            }
            Some(torch) => cells.extend([
                count(torch, "max_batch")?.to_string(),
                format!("{:.1}", number(torch, "seconds")?),
            ]),
        }
        lines.push(row(&cells));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::super::rendered;

    const OURS: &str = r#"{"tool": "cargo xtask find-max-batch", "complete": true, "cases": [
        {"case": "adam_foreach_unbounded", "model": "vit_l_16", "max_batch": 70,
         "seconds": 23.94, "pytorch": {"case": "adam_foreach", "max_batch": 1, "seconds": 1.0}},
        {"case": "adam8bit", "model": "vit_l_16", "max_batch": 76, "seconds": 3.61},
        {"case": "adam_ckpt8bit", "model": "vit_l_16", "max_batch": 251, "seconds": 6.6}]}"#;

    /// PyTorch's figures come from find_max_batch.py's lines when they are given (its first
    /// line, the run's settings, and lines of other models match no case), matched through
    /// bench-memory's name of the case; an error line reads `error`, a case PyTorch lacks `—`.
    #[test]
    fn cases_render_beside_find_max_batch_py() {
        let torch = "{\"tool\": \"find_max_batch.py\", \"memory_cap_bytes\": 25769803776}\n\
            {\"case\": \"adam_foreach\", \"model\": \"gpt2\", \"max_batch\": 9, \"seconds\": 9.0}\n\
            {\"case\": \"adam_foreach\", \"max_batch\": 64, \"seconds\": 12.74}\n\
            {\"case\": \"adam8bit\", \"model\": \"vit_l_16\", \"error\": \"ModuleNotFoundError\"}\n";
        let table = rendered(
            "find-max-batch",
            &[
                ("results/x/fmb.json", OURS),
                ("results/x/fmb_torch.jsonl", torch),
            ],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| case | Headroom | s | PyTorch | s |",
                "|---|---:|---:|---:|---:|",
                "| `adam_foreach_unbounded` | 70 | 23.9 | 64 | 12.7 |",
                "| `adam8bit` | 76 | 3.6 | error | |",
                "| `adam_ckpt8bit` | 251 | 6.6 | — | |",
            ]
        );
    }

    /// Without find_max_batch.py's file, each case's own `pytorch` object (--pytorch) is read;
    /// a search that did not finish is no table.
    #[test]
    fn cases_carry_pytorch_or_the_search_did_not_finish() {
        let table = rendered("find-max-batch", &[("results/x/fmb.json", OURS)]).unwrap();
        assert_eq!(
            table[2],
            "| `adam_foreach_unbounded` | 70 | 23.9 | 1 | 1.0 |"
        );
        assert_eq!(table[3], "| `adam8bit` | 76 | 3.6 | — | |");
        let partial = OURS.replace("\"complete\": true", "\"complete\": false");
        let err = rendered("find-max-batch", &[("results/x/fmb.json", &partial)]).unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            "`find-max-batch` (`cargo xtask find-max-batch --json` (gpu-measure.sh's fmb.json) \
             and, optionally, scripts/pytorch/find_max_batch.py's JSON lines (fmb_torch.jsonl)): \
             results/x/fmb.json: `complete` is not true: the search stopped before every case ran"
        );
    }
}
