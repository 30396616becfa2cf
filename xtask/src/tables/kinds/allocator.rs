//! The tables of `crates/caching-allocator/README.md`: the trace corpus and the physical handles
//! (`cargo xtask replay-trace --corpus --json`), and the steady-state loops (what
//! `crates/caching-allocator/tests/steady_state.rs` prints), the cached allocate + free pair
//! (criterion's estimates of `benches/allocator.rs` and `benches/cuda_alloc.rs`) and the driver
//! calls of a map (what `benches/cuda_alloc.rs` prints before its criterion groups).

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::criterion::{estimates, Estimate};
use super::{count, json_lines, one_file, row, table_head, text, thousands, ResultFile};

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
pub(super) fn allocator_corpus(files: &[ResultFile]) -> Result<Vec<String>> {
    let traces = json_lines(one_file(files)?)?;
    let mut lines = table_head(
        "| trace | events | PyTorch peak allocated | live (512-rounded) | PyTorch classic | \
         PyTorch expandable | ours classic | ours default | default / PyTorch expandable | ours \
         `reclaiming()` | `reclaiming()` / PyTorch expandable | waits: default, `reclaiming()` |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    );
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
pub(super) fn allocator_handles(files: &[ResultFile]) -> Result<Vec<String>> {
    let traces = json_lines(one_file(files)?)?;
    let mut lines = table_head(
        "| trace | handles, 2 MiB | 8 MiB | 32 MiB | peak reserved over 2 MiB handles', 8 MiB | \
         32 MiB |",
        "|---|---:|---:|---:|---:|---:|",
    );
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
pub(super) fn allocator_steady_state(files: &[ResultFile]) -> Result<Vec<String>> {
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
    let mut lines = table_head(
        "| loop (steady step × 20) | default: first steps, then every step | peak reserved / live \
         | `reclaiming()`: each of steps 7–20 | peak / live | no reclaim \
         (`reclaim_free_pages:False`) |",
        "|---|---|---|---|---|---|",
    );
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

/// The CUDA storage replaying two corpus traces on the device (the stdout of
/// `crates/caching-allocator/tests/cuda_allocator.rs`, gpu-measure's tests phase): per trace and
/// policy, the device time of every map or segment and every unmap or free, and their counts;
/// each trace with the default policy's peak allocated bytes.
pub(super) fn allocator_cuda_replay(files: &[ResultFile]) -> Result<Vec<String>> {
    let file = one_file(files)?;
    const POLICIES: [(&str, &str); 4] = [
        ("classic", "classic"),
        ("pytorch_expandable", "PyTorch's expandable"),
        ("default", "default"),
        ("reclaiming", "`reclaiming()`"),
    ];
    // (trace, policy) → "0.082 s, 506 maps, 0 unmaps"
    let mut cells: Vec<(String, String, String, u64)> = Vec::new();
    for line in file.text.lines() {
        let Some((head, rest)) = line.split_once(": peak reserved ") else {
            continue;
        };
        let Some((trace, policy)) = head.split_once(' ') else {
            continue;
        };
        // `<reserved> B, peak allocated <n> B, <m> maps or segments, <u> unmaps or frees,
        // <s> s on the device (...)`
        let parts: Vec<&str> = rest.split(", ").collect();
        let number = |index: usize, prefix: &str, suffix: &str| -> Result<String> {
            parts
                .get(index)
                .and_then(|part| part.strip_prefix(prefix))
                .and_then(|part| part.split(suffix).next())
                .map(|value| value.trim().to_owned())
                .with_context(|| format!("{}: not a replay line: `{line}`", file.path))
        };
        let allocated: u64 = number(1, "peak allocated ", " B")?.parse()?;
        let maps = number(2, "", " maps or segments")?;
        let unmaps = number(3, "", " unmaps or frees")?;
        let seconds = number(4, "", " s on the device")?;
        cells.push((
            trace.to_owned(),
            policy.to_owned(),
            format!("{seconds} s, {maps} maps, {unmaps} unmaps"),
            allocated,
        ));
    }
    if cells.is_empty() {
        bail!(
            "{}: no replay lines (`<trace> <policy>: peak reserved ...`)",
            file.path
        );
    }
    let mut traces: Vec<&str> = Vec::new();
    for (trace, ..) in &cells {
        if !traces.contains(&trace.as_str()) {
            traces.push(trace);
        }
    }
    let header: Vec<&str> = POLICIES.iter().map(|(_, label)| *label).collect();
    let mut lines = vec![
        format!("| trace (peak allocated) | {} |", header.join(" | ")),
        format!("|---|{}", "---|".repeat(POLICIES.len())),
    ];
    for trace in traces {
        let mut row_cells = Vec::new();
        let mut allocated = 0;
        for (policy, _) in POLICIES {
            let cell = cells
                .iter()
                .find(|(t, p, ..)| t == trace && p == policy)
                .with_context(|| format!("{}: no {policy} line for {trace}", file.path))?;
            if policy == "default" {
                allocated = cell.3;
            }
            row_cells.push(cell.2.clone());
        }
        let mut all = vec![format!(
            "{} ({} B)",
            trace_label(trace),
            thousands(allocated)
        )];
        all.extend(row_cells);
        lines.push(row(&all));
    }
    Ok(lines)
}

/// The pair table's rows: a label (`{device}` stands for cuda_alloc's device) and the criterion
/// id its sizes extend (`ID/BYTES`).
const PAIR_ROWS: &[(&str, &str)] = &[
    (
        "host, classic (device machine CPU)",
        "alloc_free_pair/host_classic",
    ),
    (
        "simulated, classic (device machine CPU)",
        "alloc_free_pair/simulated_classic",
    ),
    (
        "simulated, expandable (device machine CPU)",
        "alloc_free_pair/simulated_expandable",
    ),
    (
        "CUDA on {device}, classic",
        "cached_pair/CachingAllocator_classic",
    ),
    (
        "CUDA on {device}, expandable",
        "cached_pair/CachingAllocator_expandable",
    ),
    (
        "`cuMemAlloc` + `cuMemFree` on {device}",
        "driver_pair/cuMemAlloc_cuMemFree",
    ),
    (
        "`cuMemAllocAsync` + `cuMemFreeAsync` on {device}",
        "driver_pair/cuMemAllocAsync_cuMemFreeAsync",
    ),
];

/// The pair table's columns: (heading, bytes).
const PAIR_SIZES: [(&str, u64); 3] = [("4 KiB", 4096), ("1 MiB", 1 << 20), ("64 MiB", 64 << 20)];

/// The device `benches/cuda_alloc.rs` ran on: its first line, `device: NAME`.
fn cuda_device(files: &[ResultFile]) -> Option<&str> {
    files
        .iter()
        .flat_map(|file| file.text.lines())
        .find_map(|line| line.strip_prefix("device: "))
        .map(str::trim)
}

/// A cached allocate + free pair in ns (criterion's estimate), per storage and size, from the
/// stdout of `benches/allocator.rs` (host and simulated storage) and of `benches/cuda_alloc.rs`
/// (the caching allocator on CUDA, and the driver's own pairs); `—` where a size is not
/// measured.
pub(super) fn allocator_pairs(files: &[ResultFile]) -> Result<Vec<String>> {
    if files.is_empty() {
        bail!("reads the stdout of benches/allocator.rs and of benches/cuda_alloc.rs");
    }
    let all: Vec<Estimate> = files
        .iter()
        .map(estimates)
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let device = cuda_device(files);
    let mut lines = vec![
        format!(
            "| storage | {} |",
            PAIR_SIZES.map(|(heading, _)| heading).join(" | ")
        ),
        format!("|---|{}", "---:|".repeat(PAIR_SIZES.len())),
    ];
    for (label, id) in PAIR_ROWS {
        let cells: Vec<Option<f64>> = PAIR_SIZES
            .iter()
            .map(|(_, bytes)| {
                let wanted = format!("{id}/{bytes}");
                all.iter()
                    .find(|estimate| estimate.id == wanted)
                    .map(|estimate| estimate.mid_ns)
            })
            .collect();
        if cells.iter().all(Option::is_none) {
            continue;
        }
        let label = if label.contains("{device}") {
            let device = device.with_context(|| {
                format!("`{id}` is measured but no file names its device (`device: NAME`)")
            })?;
            label.replace("{device}", device)
        } else {
            label.to_string()
        };
        let mut row_cells = vec![label];
        row_cells.extend(cells.iter().map(|ns| match ns {
            Some(ns) => thousands(ns.round() as u64),
            None => "—".to_owned(),
        }));
        lines.push(row(&row_cells));
    }
    if lines.len() == 2 {
        bail!("no estimate of a pair (ids alloc_free_pair/…, cached_pair/…, driver_pair/…)");
    }
    Ok(lines)
}

/// The driver calls of a 2 GiB map in 2 MiB handles, as benches/cuda_alloc.rs names them in its
/// `us per handle:` lines: (the name there, the row's label).
const DRIVER_CALLS: &[(&str, &str)] = &[
    ("create", "`cuMemCreate`"),
    ("map", "`cuMemMap`"),
    ("release", "`cuMemRelease` (the mapping keeps the memory)"),
    (
        "set access (once)",
        "`cuMemSetAccess`, one call over the whole range",
    ),
    ("unmap", "`cuMemUnmap`"),
];

/// What each driver call of a 2 GiB map costs per 2 MiB handle, from benches/cuda_alloc.rs's
/// lines `2 MiB handles x1024 (round N), us per handle: create A, map B, …`: the range over its
/// rounds (one figure where they agree to 0.1 µs).
pub(super) fn allocator_driver_calls(files: &[ResultFile]) -> Result<Vec<String>> {
    let file = one_file(files)?;
    let rounds: Vec<Vec<(&str, f64)>> = file
        .text
        .lines()
        .filter(|line| line.starts_with("2 MiB handles x"))
        .filter_map(|line| line.split_once("us per handle: "))
        .map(|(_, calls)| {
            calls
                .split(", ")
                .map(|call| {
                    let (name, value) = call
                        .rsplit_once(' ')
                        .with_context(|| format!("{}: `{call}` is not NAME VALUE", file.path))?;
                    let value = value
                        .parse()
                        .with_context(|| format!("{}: `{value}` in `{call}`", file.path))?;
                    Ok((name, value))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()?;
    if rounds.is_empty() {
        bail!("{}: no `2 MiB handles x… us per handle:` line", file.path);
    }
    let mut lines = table_head(
        "| driver call, per 2 MiB handle of a 2 GiB map | µs |",
        "|---|---:|",
    );
    for (name, label) in DRIVER_CALLS {
        let values = rounds
            .iter()
            .map(|round| {
                round
                    .iter()
                    .find(|(found, _)| found == name)
                    .map(|(_, value)| *value)
                    .with_context(|| format!("{}: a round without `{name}`", file.path))
            })
            .collect::<Result<Vec<f64>>>()?;
        let low = format!(
            "{:.1}",
            values.iter().copied().fold(f64::INFINITY, f64::min)
        );
        let high = format!(
            "{:.1}",
            values.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        );
        let figure = if low == high {
            low
        } else {
            format!("{low}–{high}")
        };
        lines.push(row(&[label.to_string(), figure]));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::super::rendered;

    const CUDA_ALLOC: &str = "\
device: NVIDIA H200
granularity: 2097152 bytes
2 MiB handles x1024 (round 0), us per handle: create 13.5, map 1.7, release 0.1, set access \
(once) 36.51, unmap 40.7
2 MiB handles x1024 (round 1), us per handle: create 13.2, map 1.1, release 0.1, set access \
(once) 34.93, unmap 40.5
2 GiB as 1024 handles by 1 thread(s): map 54.3 ms, unmap 40.1 ms
driver_pair/cuMemAlloc_cuMemFree/1048576
                        time:   [73.512 µs 73.995 µs 74.480 µs]
                        thrpt:  [13.426 Kelem/s 13.514 Kelem/s 13.603 Kelem/s]
cached_pair/CachingAllocator_expandable/67108864
                        time:   [281.20 ns 282.49 ns 283.90 ns]
";

    /// Host and simulated rows from allocator.rs's estimates, CUDA rows from cuda_alloc.rs's
    /// with its device in the label; ns rounded, `—` for a size not measured, rows without any
    /// estimate left out.
    #[test]
    fn pairs_render_by_storage_and_size() {
        let host = "alloc_free_pair/host_classic/4096\n                        time:   [377.01 ns \
                    379.45 ns 381.20 ns]\nalloc_free_pair/host_classic/67108864\n      \
                    time:   [181.5 ns 182.49 ns 183.0 ns]\n";
        let table = rendered(
            "allocator-pairs",
            &[
                ("results/x/allocator.txt", host),
                ("results/x/cuda_alloc.txt", CUDA_ALLOC),
            ],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| storage | 4 KiB | 1 MiB | 64 MiB |",
                "|---|---:|---:|---:|",
                "| host, classic (device machine CPU) | 379 | — | 182 |",
                "| CUDA on NVIDIA H200, expandable | — | — | 282 |",
                "| `cuMemAlloc` + `cuMemFree` on NVIDIA H200 | — | 73,995 | — |",
            ]
        );
    }

    /// Each call's range over the rounds, one figure where they agree.
    #[test]
    fn driver_calls_render_as_ranges_over_the_rounds() {
        let table = rendered(
            "allocator-driver-calls",
            &[("results/x/cuda_alloc.txt", CUDA_ALLOC)],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| driver call, per 2 MiB handle of a 2 GiB map | µs |",
                "|---|---:|",
                "| `cuMemCreate` | 13.2–13.5 |",
                "| `cuMemMap` | 1.1–1.7 |",
                "| `cuMemRelease` (the mapping keeps the memory) | 0.1 |",
                "| `cuMemSetAccess`, one call over the whole range | 34.9–36.5 |",
                "| `cuMemUnmap` | 40.5–40.7 |",
            ]
        );
    }
}
