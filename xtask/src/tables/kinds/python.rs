//! The tables of `crates/python/README.md`, from the JSON lines of `crates/python/bench`'s
//! scripts (`train.py`, `optim_compare.py`): step times against PyTorch's native allocator, peak
//! reserved bytes, losses and parameters compared bit for bit.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::{count, json_lines, number, one_file, row, table_head, text, thousands, ResultFile};

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
pub(super) fn python_training(files: &[ResultFile]) -> Result<Vec<String>> {
    let runs = json_lines(one_file(files)?)?;
    let mut lines = table_head(
        "| model | allocator | median step | mean step | peak reserved | losses vs native |",
        "|---|---|---:|---:|---:|---|",
    );
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
pub(super) fn python_handles(files: &[ResultFile]) -> Result<Vec<String>> {
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
pub(super) fn python_optim(files: &[ResultFile]) -> Result<Vec<String>> {
    let cases = json_lines(one_file(files)?)?;
    let case = |name: &str| -> Result<&Value> {
        cases
            .iter()
            .find(|value| value["case"] == name)
            .with_context(|| format!("no `{name}` case"))
    };
    let mut lines = table_head(
        "| comparison | theirs | headroom | ratio | parameters after 20 steps |",
        "|---|---:|---:|---:|---|",
    );
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
