//! The golden table of `crates/nn/README.md`, from what `crates/nn/tests/golden.rs` prints: the
//! relative errors of each model against PyTorch's, and the bound the test holds it to.

use anyhow::{bail, Context, Result};

use super::{one_file, row, table_head, ResultFile};

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
pub(super) fn nn_golden(files: &[ResultFile]) -> Result<Vec<String>> {
    let file = one_file(files)?;
    let mut lines = table_head(
        "| model | logits | loss | worst parameter gradient | bound |",
        "|---|---|---|---|---|",
    );
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
