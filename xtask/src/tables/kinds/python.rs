//! The tables of `crates/python/README.md`, from the JSON lines of `crates/python/bench`'s
//! scripts (`train.py`, `optim_compare.py`, `clients.py`): step times against PyTorch's native
//! allocator or PyTorch alone, peak reserved bytes, losses and parameters compared.

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

/// The object of `values` whose `key` is `name`.
fn named<'a>(values: &'a [Value], key: &str, name: &str) -> Result<&'a Value> {
    values
        .iter()
        .find(|value| value[key] == name)
        .with_context(|| format!("no `{name}` {key}"))
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
    let case = |name: &str| named(&cases, "case", name);
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

/// A client and model of `clients.py` in words: `Trainer, GPT-2 small (f32)`.
fn client_label(run: &Value) -> Result<String> {
    let client = match text(run, "client")? {
        "hf" => "Trainer",
        "lightning" => "Lightning",
        other => other,
    };
    let model = match text(run, "model")? {
        "gpt2" => "GPT-2 small",
        "llama-tiny" => "tiny Llama",
        "llama-1b" => "Llama-3.2-1B shape",
        other => other,
    };
    let precision = if run["bf16"].as_bool() == Some(true) {
        "bf16 autocast"
    } else {
        "f32"
    };
    Ok(format!("{client}, {model} ({precision})"))
}

/// A Headroom run of `clients.py` in words: every feature, or the ones it left out, and the
/// fused loss's chunk and gradients where they are not the defaults.
fn clients_run_label(run: &Value) -> String {
    let without: Vec<&str> = run["without"]
        .as_array()
        .map(|names| names.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut label = if without.is_empty() {
        "Headroom, every feature".to_owned()
    } else {
        format!("Headroom without {}", without.join(", "))
    };
    if !without.contains(&"loss") {
        if let Some(chunk) = run["loss_chunk_mb"].as_f64() {
            label += &format!(", loss at {chunk} MiB");
        }
        match run["loss_gradients"].as_str() {
            Some("forward") => label += ", gradients in the forward",
            Some("backward") => label += ", gradients by recompute",
            _ => {}
        }
    }
    label
}

/// The largest relative difference between two runs' loss curves: in percent from 0.01%, else
/// as a number (`1.2e-5`).
fn largest_loss_difference(run: &Value, native: &Value) -> Result<String> {
    let ours = run["losses"].as_array().context("no `losses`")?;
    let theirs = native["losses"].as_array().context("no `losses`")?;
    let mut largest = 0.0f64;
    for (a, b) in ours.iter().zip(theirs) {
        let (a, b) = (
            a.as_f64().context("a loss that is no number")?,
            b.as_f64().context("a loss that is no number")?,
        );
        largest = largest.max((a - b).abs() / b.abs());
    }
    Ok(if largest >= 1e-4 {
        format!("{:.2}%", 100.0 * largest)
    } else {
        format!("{largest:.1e}")
    })
}

/// `crates/python/README.md`'s clients table: per client and model, each native run of
/// `clients.py` and the Headroom runs after it (paired with the native run of the same client
/// and model that came last before them, through the files in order): median step, peak
/// reserved bytes, both against native, and the loss curves' largest relative difference.
pub(super) fn python_clients(files: &[ResultFile]) -> Result<Vec<String>> {
    let mut lines = table_head(
        "| client, model | run | sources | median step | vs native | peak reserved | vs native | \
         losses vs native |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    );
    let mut natives: Vec<(String, Value)> = Vec::new();
    let mut last_group = String::new();
    for file in files {
        let sources = file.meta["commit"].as_str().unwrap_or("—").to_owned();
        for run in json_lines(file)? {
            let group = client_label(&run)?;
            let shown = if group == last_group {
                String::new()
            } else {
                group.clone()
            };
            last_group = group.clone();
            let step = number(&run, "step_ms_median")?;
            let reserved = count(&run, "peak_reserved_bytes")?;
            let gigabytes = format!("{:.2} GB", reserved as f64 / 1e9);
            if run["side"] == "native" {
                lines.push(row(&[
                    shown,
                    "PyTorch".to_owned(),
                    sources.clone(),
                    format!("{step:.2} ms"),
                    "—".to_owned(),
                    gigabytes,
                    "—".to_owned(),
                    "—".to_owned(),
                ]));
                natives.retain(|(name, _)| *name != group);
                natives.push((group, run));
                continue;
            }
            let Some((_, native)) = natives.iter().find(|(name, _)| *name == group) else {
                bail!("a Headroom run of `{group}` before any native run of it");
            };
            lines.push(row(&[
                shown,
                clients_run_label(&run),
                sources.clone(),
                format!("{step:.2} ms"),
                format!("{:.3}×", step / number(native, "step_ms_median")?),
                gigabytes,
                format!(
                    "{:.3}×",
                    reserved as f64 / count(native, "peak_reserved_bytes")? as f64
                ),
                largest_loss_difference(&run, native)?,
            ]));
        }
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::super::rendered;

    const RUNS: &str = r#"a log line
{"client": "hf", "side": "native", "model": "gpt2", "bf16": false, "without": [], "losses": [10.0, 9.0], "step_ms_median": 90.0, "peak_reserved_bytes": 9000000000}
{"client": "hf", "side": "headroom", "model": "gpt2", "bf16": false, "loss_chunk_mb": 256.0, "loss_gradients": "auto", "without": [], "losses": [10.0, 9.018], "step_ms_median": 88.2, "peak_reserved_bytes": 6300000000}
{"client": "hf", "side": "headroom", "model": "gpt2", "bf16": false, "loss_chunk_mb": 64.0, "loss_gradients": "auto", "without": ["loss"], "losses": [10.0, 9.0], "step_ms_median": 89.1, "peak_reserved_bytes": 8400000000}
{"client": "hf", "side": "native", "model": "llama-tiny", "bf16": true, "without": [], "losses": [10.4], "step_ms_median": 20.0, "peak_reserved_bytes": 2800000000}
{"client": "hf", "side": "headroom", "model": "llama-tiny", "bf16": true, "loss_chunk_mb": 64.0, "loss_gradients": "backward", "without": [], "losses": [10.4], "step_ms_median": 13.0, "peak_reserved_bytes": 700000000}
"#;

    #[test]
    fn clients_pair_each_headroom_run_with_the_native_run_before_it() {
        let table = rendered("python-clients", &[("results/x/clients.jsonl", RUNS)]).unwrap();
        assert_eq!(
            table,
            [
                "| client, model | run | sources | median step | vs native | peak reserved | vs native | losses vs native |",
                "|---|---|---|---:|---:|---:|---:|---:|",
                "| Trainer, GPT-2 small (f32) | PyTorch | — | 90.00 ms | — | 9.00 GB | — | — |",
                "| | Headroom, every feature, loss at 256 MiB | — | 88.20 ms | 0.980× | 6.30 GB | 0.700× | 0.20% |",
                "| | Headroom without loss | — | 89.10 ms | 0.990× | 8.40 GB | 0.933× | 0.0e0 |",
                "| Trainer, tiny Llama (bf16 autocast) | PyTorch | — | 20.00 ms | — | 2.80 GB | — | — |",
                "| | Headroom, every feature, loss at 64 MiB, gradients by recompute | — | 13.00 ms | 0.650× | 0.70 GB | 0.250× | 0.0e0 |",
            ]
        );
    }

    #[test]
    fn a_headroom_run_before_its_native_run_is_an_error() {
        let headroom_first = RUNS.lines().skip(2).collect::<Vec<_>>().join("\n");
        let err = rendered(
            "python-clients",
            &[("results/x/clients.jsonl", &headroom_first)],
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("before any native run"),
            "{err:#}"
        );
    }
}

/// A variant of `saved_activations.py` in words (its docstring names them).
fn saved_variant_label(variant: &str) -> String {
    match variant {
        "plain" => return "no hooks".to_owned(),
        "save_on_cpu" => return "`save_on_cpu(pin_memory=True)`".to_owned(),
        "none" => return "`saved_activations(None)`".to_owned(),
        "int8" | "bf16" => return format!("`saved_activations(\"{variant}\")`"),
        _ => {}
    }
    let (variant, kept_mb) = match variant.rsplit_once("_last") {
        Some((rest, mb)) if !mb.is_empty() && mb.bytes().all(|b| b.is_ascii_digit()) => {
            (rest, Some(mb))
        }
        _ => (variant, None),
    };
    let (rest, every_save) = match variant.strip_suffix("_all") {
        Some(rest) => (rest, true),
        None => (variant, false),
    };
    let (rest, transient) = match rest.strip_suffix("_transient") {
        Some(rest) => (rest, true),
        None => (rest, false),
    };
    let (rest, int8) = match rest.strip_prefix("int8_") {
        Some(rest) => (rest, true),
        None => (rest, false),
    };
    let mut label = if int8 { "int8, offloaded" } else { "offloaded" }.to_owned();
    if let Some(mb) = rest.strip_prefix("offload_prefetch") {
        label += &if mb == "0" {
            ", nothing fetched ahead".to_owned()
        } else {
            format!(", {mb} MiB ahead")
        };
    } else if let Some(mb) = rest.strip_prefix("offload_fit") {
        label += &format!(", {mb} MiB ahead with the save decoded");
    } else if rest == "offload_peak" {
        // 128 MiB under the previous backward's levels until 238c876, then 1,024 MiB by the
        // profiled first backward's schedule: the README says which, beside each table.
        label += ", ahead under `hold_peak=True`";
    } else if transient {
        label += ", ahead under the previous backward's peak less each step's rise";
    } else {
        label += ", 128 MiB ahead";
    }
    if every_save {
        label += ", every save";
    }
    if let Some(mb) = kept_mb {
        label += &format!(", the last {mb} MiB kept");
    }
    label
}

/// `crates/python/README.md`'s offload table: each variant of `saved_activations.py` (one
/// file), its median step and peak allocated bytes, against `save_on_cpu`'s and the plain
/// step's (a dash where the run left the plain step out).
pub(super) fn python_saved_offload(files: &[ResultFile]) -> Result<Vec<String>> {
    let variants = json_lines(one_file(files)?)?;
    let anchor = named(&variants, "variant", "save_on_cpu")?;
    let plain_ms = match named(&variants, "variant", "plain") {
        Ok(plain) => Some(number(plain, "step_ms")?),
        Err(_) => None,
    };
    let (anchor_ms, anchor_peak) = (
        number(anchor, "step_ms")?,
        count(anchor, "peak_allocated_bytes")?,
    );
    let mut lines = table_head(
        "| saved activations | median step | vs no hooks | vs `save_on_cpu` | peak allocated | \
         above `save_on_cpu`'s |",
        "|---|---:|---:|---:|---:|---:|",
    );
    for value in &variants {
        let ms = number(value, "step_ms")?;
        let peak = count(value, "peak_allocated_bytes")?;
        let above = peak as i64 - anchor_peak as i64;
        lines.push(row(&[
            saved_variant_label(text(value, "variant")?),
            format!("{ms:.1} ms"),
            plain_ms.map_or("—".to_owned(), |plain| format!("{:.3}×", ms / plain)),
            format!("{:.3}×", ms / anchor_ms),
            format!("{} B", thousands(peak)),
            if value == anchor {
                "—".to_owned()
            } else {
                format!(
                    "{:+.2} MB ({:+.2}%)",
                    above as f64 / 1e6,
                    100.0 * above as f64 / anchor_peak as f64
                )
            },
        ]));
    }
    Ok(lines)
}

#[cfg(test)]
mod saved_offload_tests {
    use super::super::rendered;

    #[test]
    fn a_run_without_the_plain_step_shows_a_dash() {
        let table = rendered(
            "python-saved-offload",
            &[(
                "results/x/offload.log",
                "{\"variant\": \"save_on_cpu\", \"step_ms\": 800.0, \"peak_allocated_bytes\": 6500000000}\n\
                 {\"variant\": \"offload_peak\", \"step_ms\": 480.0, \"peak_allocated_bytes\": 6500000000}\n",
            )],
        )
        .unwrap();
        assert_eq!(
            table[3],
            "| offloaded, ahead under `hold_peak=True` | 480.0 ms | — | 0.600× | 6,500,000,000 B | +0.00 MB (+0.00%) |"
        );
    }

    const VARIANTS: &str = r#"a warning
{"variant": "plain", "step_ms": 300.0, "peak_allocated_bytes": 15000000000}
{"variant": "save_on_cpu", "step_ms": 800.0, "peak_allocated_bytes": 6500000000}
{"variant": "offload_prefetch0", "step_ms": 600.0, "peak_allocated_bytes": 6500660000}
{"variant": "int8_offload_fit32_all", "step_ms": 330.0, "peak_allocated_bytes": 6499000000}
{"variant": "offload_transient", "step_ms": 450.0, "peak_allocated_bytes": 6500000000}
{"variant": "offload_peak_all_last1024", "step_ms": 440.0, "peak_allocated_bytes": 6490000000}
"#;

    #[test]
    fn every_variant_against_save_on_cpu_and_the_plain_step() {
        let table = rendered(
            "python-saved-offload",
            &[("results/x/offload.log", VARIANTS)],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| saved activations | median step | vs no hooks | vs `save_on_cpu` | peak allocated | above `save_on_cpu`'s |",
                "|---|---:|---:|---:|---:|---:|",
                "| no hooks | 300.0 ms | 1.000× | 0.375× | 15,000,000,000 B | +8500.00 MB (+130.77%) |",
                "| `save_on_cpu(pin_memory=True)` | 800.0 ms | 2.667× | 1.000× | 6,500,000,000 B | — |",
                "| offloaded, nothing fetched ahead | 600.0 ms | 2.000× | 0.750× | 6,500,660,000 B | +0.66 MB (+0.01%) |",
                "| int8, offloaded, 32 MiB ahead with the save decoded, every save | 330.0 ms | 1.100× | 0.412× | 6,499,000,000 B | -1.00 MB (-0.02%) |",
                "| offloaded, ahead under the previous backward's peak less each step's rise | 450.0 ms | 1.500× | 0.562× | 6,500,000,000 B | +0.00 MB (+0.00%) |",
                "| offloaded, ahead under `hold_peak=True`, every save, the last 1024 MiB kept | 440.0 ms | 1.467× | 0.550× | 6,490,000,000 B | -10.00 MB (-0.15%) |",
            ]
        );
    }
}

/// The JSON object a script prints after its log (`fused_ce_reference.py`: indented, from a
/// line that is `{` to the end).
fn object_after_log(file: &ResultFile) -> Result<Value> {
    let start = if file.text.starts_with('{') {
        0
    } else {
        file.text
            .find("\n{")
            .map(|at| at + 1)
            .with_context(|| format!("{}: no JSON object", file.path))?
    };
    serde_json::from_str(&file.text[start..])
        .with_context(|| format!("{}: the object after the log is not JSON", file.path))
}

/// An implementation of `fused_ce_reference.py` in words.
fn fused_ce_label(name: &str) -> String {
    match name {
        "torch_eager_unfused" => "eager PyTorch, logits materialised".to_owned(),
        "liger_flce" => "Liger-Kernel's fused linear cross-entropy".to_owned(),
        "cce" => "Cut Cross-Entropy (its gradient filter)".to_owned(),
        "cce_no_filter" => "Cut Cross-Entropy, every gradient".to_owned(),
        "headroom_python" => "`headroom.torch.linear_cross_entropy`".to_owned(),
        "headroom_python_backward" => "the same, gradients by recompute".to_owned(),
        "headroom_python_forward" => "the same, gradients in the forward".to_owned(),
        other => match other.strip_prefix("headroom_python_forward_") {
            Some(mb) => format!("the same, gradients in the forward, `chunk_mb={mb}`"),
            None => other.to_owned(),
        },
    }
}

/// `crates/python/README.md`'s fused-loss tables: each implementation `fused_ce_reference.py`
/// ran (one file), its median forward + backward against eager PyTorch's and the bytes it held
/// beyond its inputs and their gradients; one that failed says why.
pub(super) fn python_fused_ce(files: &[ResultFile]) -> Result<Vec<String>> {
    let object = object_after_log(one_file(files)?)?;
    let map = object.as_object().context("not a JSON object")?;
    let eager = number(
        map.get("torch_eager_unfused")
            .context("no `torch_eager_unfused`")?,
        "median_ms",
    )?;
    let mut lines = table_head(
        "| implementation | forward + backward | vs eager | beyond inputs and gradients |",
        "|---|---:|---:|---:|",
    );
    // The script's order (serde_json's map is sorted), then any other implementation.
    const ORDER: &[&str] = &[
        "torch_eager_unfused",
        "liger_flce",
        "headroom_python",
        "headroom_python_backward",
        "headroom_python_forward",
        "headroom_python_forward_128",
        "headroom_python_forward_256",
        "headroom_python_forward_512",
        "cce",
        "cce_no_filter",
    ];
    let known = ORDER.iter().filter_map(|name| map.get_key_value(*name));
    let others = map
        .iter()
        .filter(|(name, _)| !ORDER.contains(&name.as_str()));
    for (name, result) in known.chain(others) {
        if !result.is_object() || name == "shape" {
            continue;
        }
        if let Some(error) = result["error"].as_str() {
            let reason = error.split(':').next().unwrap_or(error);
            lines.push(row(&[
                fused_ce_label(name),
                format!("fails ({reason})"),
                "—".to_owned(),
                "—".to_owned(),
            ]));
            continue;
        }
        let ms = number(result, "median_ms")?;
        let beyond = result["peak_beyond_inputs_and_grads_bytes"]
            .as_i64()
            .context("no `peak_beyond_inputs_and_grads_bytes`")?;
        lines.push(row(&[
            fused_ce_label(name),
            format!("{ms:.2} ms"),
            format!("{:.3}×", ms / eager),
            format!("{:.1} MB", beyond as f64 / 1e6),
        ]));
    }
    Ok(lines)
}

#[cfg(test)]
mod fused_ce_tests {
    use super::super::rendered;

    const RUN: &str = r#"a warning
{
 "shape": {"tokens": 4, "hidden": 2, "vocab": 9, "dtype": "f32"},
 "iters": 10,
 "torch": "2.11.0",
 "torch_eager_unfused": {"median_ms": 20.0, "peak_beyond_inputs_and_grads_bytes": 2332858368},
 "headroom_python_forward_512": {"median_ms": 20.8, "peak_beyond_inputs_and_grads_bytes": 411070464},
 "cce": {"error": "AssertionError: Backwards requires embeddings to be bf16 or fp16"}
}
"#;

    #[test]
    fn every_implementation_against_eager_and_a_failure_with_its_reason() {
        let table = rendered("python-fused-ce", &[("results/x/ce.log", RUN)]).unwrap();
        assert_eq!(
            table,
            [
                "| implementation | forward + backward | vs eager | beyond inputs and gradients |",
                "|---|---:|---:|---:|",
                "| eager PyTorch, logits materialised | 20.00 ms | 1.000× | 2332.9 MB |",
                "| the same, gradients in the forward, `chunk_mb=512` | 20.80 ms | 1.040× | 411.1 MB |",
                "| Cut Cross-Entropy (its gradient filter) | fails (AssertionError) | — | — |",
            ]
        );
    }
}
