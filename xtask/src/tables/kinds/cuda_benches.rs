//! The tables of the crates' CUDA benches that print JSON lines, beside PyTorch's side of the
//! same setting: ViT-L/16 SGD steps (`crates/ops-cuda/benches/vit_step.rs`, against
//! `scripts/pytorch/bench_reference.py`'s `sgd` and `sgd_bf16_model`), one Adam step on 1e9
//! parameters (`crates/optim/benches/cuda_adam.rs`, against `scripts/pytorch/adam_step_1e9.py`)
//! batch-1 steps eager against replayed from a CUDA graph
//! (`crates/ops-cuda/benches/graph_step.rs`, against `scripts/pytorch/graph_step_reference.py`)
//! f32 attention at the models' shapes (`crates/ops-cuda/benches/attention_f32.rs`, against
//! `scripts/pytorch/attention_f32_reference.py`) and 16-bit attention at issue 35's shapes (the
//! kernels bench's `hopper_attention` family, against `scripts/pytorch/attention_reference.py
//! --shape issue35`'s SDPA backends).
//!
//! It knows the benches' settings and implementations by the names they print, and gives each
//! its label in words; an implementation it has no label for is an error, so a renamed one
//! cannot drop out of the table unseen.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::{count, json_lines, number, row, table_head, text, ResultFile};

/// Bytes in decimal gigabytes: `11.37 GB`.
fn gigabytes(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}

/// ViT-L/16 steps with SGD: per setting vit_step prints (fp32 at batch 1 and 32, the bf16 model
/// at batch 32), its median step and peak allocated bytes beside PyTorch's (`sgd` for fp32,
/// `sgd_bf16_model` for the bf16 model; the same batch, ViT-L/16); `—` where PyTorch has none.
pub(super) fn vit_step(files: &[ResultFile]) -> Result<Vec<String>> {
    let (ours, pytorch) = match files {
        [ours, pytorch] => (json_lines(ours)?, json_lines(pytorch)?),
        _ => bail!(
            "reads vit_step's JSON lines and bench_reference.py's, given {} files",
            files.len()
        ),
    };
    let mut lines = table_head(
        "| setting | Headroom step | peak alloc | PyTorch step | PyTorch peak |",
        "|---|---:|---:|---:|---:|",
    );
    for setting in ours.iter().filter(|line| line["case"] == "vit_l16_sgd") {
        let batch = count(setting, "batch")?;
        let (label, torch_case) = match text(setting, "dtype")? {
            "F32" => ("fp32", "sgd"),
            "BF16" => ("bf16 model", "sgd_bf16_model"),
            other => bail!("{}: no label for dtype `{other}`", files[0].path),
        };
        let torch = pytorch.iter().find(|line| {
            line["case"] == torch_case
                && line["batch"].as_u64() == Some(batch)
                && line["model"].as_str().unwrap_or("vit_l_16") == "vit_l_16"
                && line["step_ms_median"].is_number()
        });
        let (torch_ms, torch_peak) = match torch {
            Some(torch) => (
                format!("{:.1} ms", number(torch, "step_ms_median")?),
                gigabytes(number(torch, "steady_peak_alloc")?),
            ),
            None => ("—".to_owned(), "—".to_owned()),
        };
        lines.push(row(&[
            format!("{label}, batch {batch}"),
            format!("{:.1} ms", number(setting, "step_ms")?),
            gigabytes(number(setting, "peak_allocated_bytes")?),
            torch_ms,
            torch_peak,
        ]));
    }
    if lines.len() == 2 {
        bail!("{}: no `vit_l16_sgd` line", files[0].path);
    }
    Ok(lines)
}

/// Batch-1 training steps eager and replayed from a CUDA graph, one row per model graph_step
/// printed: both loops' median steps, their ratio, the host's time to enqueue a step, whether
/// the parameters matched bit for bit after the run, the peak allocated bytes of both loops, and
/// PyTorch's eager and graphed steps and peaks of the same case (`—` where its line is missing or
/// reports an error).
pub(super) fn graph_step(files: &[ResultFile]) -> Result<Vec<String>> {
    let (ours, pytorch) = match files {
        [ours, pytorch] => (json_lines(ours)?, json_lines(pytorch)?),
        _ => bail!(
            "reads graph_step's JSON lines and graph_step_reference.py's, given {} files",
            files.len()
        ),
    };
    let mut lines = table_head(
        "| case | Headroom eager | Headroom graph | ratio | host ms (eager → graph) | bitwise | \
         peak (eager → graph) | PyTorch eager | PyTorch graph | ratio | PyTorch peak (eager → \
         graph) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    );
    for line in &ours {
        let case = text(line, "case")?;
        let bitwise = match line["params_bitwise_equal"].as_bool() {
            Some(true) => "equal",
            Some(false) => "differ",
            None => bail!("{}: `{case}` has no params_bitwise_equal", files[0].path),
        };
        let torch = pytorch
            .iter()
            .find(|t| t["case"] == case && t["graph_step_ms"].is_number());
        let peaks = |line: &Value| -> Result<String> {
            Ok(format!(
                "{} → {}",
                gigabytes(number(line, "eager_peak_allocated_bytes")?),
                gigabytes(number(line, "graph_peak_allocated_bytes")?)
            ))
        };
        let torch_cells = match torch {
            Some(t) => [
                format!("{:.1} ms", number(t, "eager_step_ms")?),
                format!("{:.1} ms", number(t, "graph_step_ms")?),
                format!("{:.3}", number(t, "ratio")?),
                peaks(t)?,
            ],
            None => [
                "—".to_owned(),
                "—".to_owned(),
                "—".to_owned(),
                "—".to_owned(),
            ],
        };
        let [torch_eager, torch_graph, torch_ratio, torch_peaks] = torch_cells;
        lines.push(row(&[
            format!("`{case}`"),
            format!("{:.1} ms", number(line, "eager_step_ms")?),
            format!("{:.1} ms", number(line, "graph_step_ms")?),
            format!("{:.3}", number(line, "ratio")?),
            format!(
                "{:.1} → {:.2}",
                number(line, "eager_host_ms")?,
                number(line, "graph_host_ms")?
            ),
            bitwise.to_owned(),
            peaks(line)?,
            torch_eager,
            torch_graph,
            torch_ratio,
            torch_peaks,
        ]));
    }
    if lines.len() == 2 {
        bail!("{}: no graph_step line", files[0].path);
    }
    Ok(lines)
}

/// f32 attention, one row per shape in the order attention_f32 prints them: its forward,
/// backward and forward + backward medians beside PyTorch's memory-efficient SDPA at the same
/// shape, and the ratio of the forward + backward times; `—` where PyTorch has no line.
pub(super) fn attention_f32(files: &[ResultFile]) -> Result<Vec<String>> {
    let (ours, pytorch) = match files {
        [ours, pytorch] => (json_lines(ours)?, json_lines(pytorch)?),
        _ => bail!(
            "reads attention_f32's JSON lines and attention_f32_reference.py's, given {} files",
            files.len()
        ),
    };
    let mut lines = table_head(
        "| shape | Headroom forward | backward | fwd + bwd | PyTorch forward | backward | \
         fwd + bwd | ratio (fwd + bwd) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    );
    let mut shapes: Vec<&str> = Vec::new();
    for line in &ours {
        let shape = text(line, "shape")?;
        if !shapes.contains(&shape) {
            shapes.push(shape);
        }
    }
    for shape in shapes {
        let ms = |side: &[Value], case: &str| -> Result<Option<f64>> {
            side.iter()
                .find(|l| l["shape"] == shape && l["case"] == case && l["ms"].is_number())
                .map(|l| number(l, "ms"))
                .transpose()
        };
        let mut cells = vec![format!("`{shape}`")];
        let mut both = [None, None];
        for (index, side) in [&ours, &pytorch].into_iter().enumerate() {
            for case in ["forward", "backward", "fwd_bwd"] {
                let value = ms(side, case)?;
                if index == 0 && value.is_none() {
                    bail!("{}: `{shape}` has no `{case}` line", files[0].path);
                }
                if case == "fwd_bwd" {
                    both[index] = value;
                }
                cells.push(value.map_or("—".to_owned(), |v| format!("{v:.3} ms")));
            }
        }
        cells.push(match both {
            [Some(a), Some(b)] => format!("{:.3}", a / b),
            _ => "—".to_owned(),
        });
        lines.push(row(&cells));
    }
    if lines.len() == 2 {
        bail!("{}: no attention_f32 line", files[0].path);
    }
    Ok(lines)
}

/// The kernels bench's engines of the `hopper_attention` family, by the suffix its cases carry,
/// with their labels.
const HOPPER_ENGINES: &[(&str, &str)] = &[
    ("mma", "Headroom `mma.sync`"),
    ("wgmma", "Headroom wgmma"),
    ("default", "Headroom default (`ws` forward and backward)"),
    ("ws", "Headroom warp-specialised (`ws`)"),
    ("ws_overlap", "Headroom `ws-overlap`"),
    ("ws_pingpong", "Headroom `ws-pingpong`"),
];

/// SDPA's backends in attention_reference.py's lines (`backend`), with their labels.
const SDPA_BACKENDS: &[(&str, &str)] = &[
    ("cudnn", "PyTorch SDPA, cuDNN"),
    ("flash", "PyTorch SDPA, flash"),
    ("efficient", "PyTorch SDPA, memory-efficient"),
];

/// 16-bit attention at issue 35's shapes: per shape (causal or full, head dim), a row per
/// engine of ours and per SDPA backend with forward and forward + backward times and TFLOP/s,
/// and forward + backward's time against cuDNN's. The kernels bench prints a summary line per
/// case, `hopper_attention <case> <MB/pass> <device µs> <GB/s> <%> <%> <host µs> <TFLOP/s>`,
/// its case `bf16_<causal|full>_<forward|fwd_bwd>_<engine>_<shape>`; PyTorch's case is
/// `bf16_<mask>_<forward|fwd_bwd>_<shape>[_<backend>]` with `ms` and `tflops`.
pub(super) fn attention_hopper(files: &[ResultFile]) -> Result<Vec<String>> {
    let (bench, pytorch) = match files {
        [bench, pytorch] => (bench, json_lines(pytorch)?),
        _ => bail!(
            "reads the kernels bench's stdout and attention_reference.py's JSON lines, given {} \
             files",
            files.len()
        ),
    };
    // (case, device µs, TFLOP/s) of every hopper_attention summary line.
    let mut ours: Vec<(&str, f64, f64)> = Vec::new();
    for line in bench.text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() != 9 || fields[0] != "hopper_attention" {
            continue;
        }
        let parse = |field: &str| -> Result<f64> {
            field
                .parse()
                .with_context(|| format!("{}: `{field}` is not a number in `{line}`", bench.path))
        };
        ours.push((fields[1], parse(fields[3])?, parse(fields[8])?));
    }
    if ours.is_empty() {
        bail!("{}: no hopper_attention summary line", bench.path);
    }
    let mut lines = table_head(
        "| shape | kernel | forward | TFLOP/s | fwd + bwd | TFLOP/s | fwd + bwd against cuDNN |",
        "|---|---|---:|---:|---:|---:|---:|",
    );
    for mask in ["causal", "full"] {
        for dim in [128, 64] {
            let shape = format!("b4_h16_s4096_d{dim}");
            let reference = |pass: &str, backend: &str| {
                let suffix = if backend == "cudnn" {
                    String::new()
                } else {
                    format!("_{backend}")
                };
                let case = format!("bf16_{mask}_{pass}_{shape}{suffix}");
                pytorch
                    .iter()
                    .find(|l| l["case"] == case.as_str() && l["ms"].is_number())
                    .map(|l| Ok::<_, anyhow::Error>((number(l, "ms")?, number(l, "tflops")?)))
                    .transpose()
            };
            let cudnn_ms = reference("fwd_bwd", "cudnn")?.map(|(ms, _)| ms);
            let label = format!("{mask}, head dim {dim}");
            let mut row_of =
                |kernel: &str, forward: Option<(f64, f64)>, both: Option<(f64, f64)>| {
                    let cell = |pair: Option<(f64, f64)>| match pair {
                        Some((ms, tflops)) => [format!("{ms:.3} ms"), format!("{tflops:.0}")],
                        None => ["—".to_owned(), "—".to_owned()],
                    };
                    let [forward_ms, forward_tflops] = cell(forward);
                    let [both_ms, both_tflops] = cell(both);
                    let ratio = match (both, cudnn_ms) {
                        (Some((ms, _)), Some(cudnn)) => format!("{:.2}×", ms / cudnn),
                        _ => "—".to_owned(),
                    };
                    lines.push(row(&[
                        label.clone(),
                        kernel.to_owned(),
                        forward_ms,
                        forward_tflops,
                        both_ms,
                        both_tflops,
                        ratio,
                    ]));
                };
            for (engine, kernel) in HOPPER_ENGINES {
                let find = |pass: &str| {
                    let case = format!("bf16_{mask}_{pass}_{engine}_{shape}");
                    ours.iter()
                        .find(|(name, _, _)| *name == case)
                        .map(|&(_, micros, tflops)| (micros / 1e3, tflops))
                };
                let (forward, both) = (find("forward"), find("fwd_bwd"));
                if forward.is_none() && both.is_none() {
                    continue;
                }
                row_of(kernel, forward, both);
            }
            for (backend, kernel) in SDPA_BACKENDS {
                let (forward, both) = (
                    reference("forward", backend)?,
                    reference("fwd_bwd", backend)?,
                );
                if forward.is_some() || both.is_some() {
                    row_of(kernel, forward, both);
                }
            }
        }
    }
    Ok(lines)
}

/// Adam at 1e9 parameters, one row per implementation: (label, cuda_adam's `impl`, PyTorch's
/// `impl` in adam_step_1e9.py where it has that implementation).
const ADAM_IMPLEMENTATIONS: &[(&str, &str, Option<&str>)] = &[
    ("fused", "headroom_fused_cuda", Some("torch_fused")),
    (
        "foreach (bounded, 16 MiB chunk)",
        "headroom_foreach_cuda",
        Some("torch_foreach"),
    ),
    (
        "foreach (bounded, 8 MiB chunk)",
        "headroom_foreach_chunk2Mi_cuda",
        None,
    ),
    (
        "foreach (bounded, 4 MiB chunk)",
        "headroom_foreach_chunk1Mi_cuda",
        None,
    ),
    ("foreach unbounded", "headroom_foreach_unbounded_cuda", None),
    ("single", "headroom_single_cuda", Some("torch_single")),
    (
        "8-bit blockwise (bitsandbytes' update)",
        "headroom_adam8bit_cuda",
        Some("bitsandbytes_adam8bit"),
    ),
    (
        "8-bit blockwise (torchao's `Adam8bit`)",
        "headroom_torchao_adam8bit_cuda",
        Some("torchao_adam8bit"),
    ),
    (
        "4-bit blockwise (torchao's update; tensors of 6,249,984)",
        "headroom_adam4bit_cuda",
        Some("torchao_adam4bit"),
    ),
    (
        "fused, raw buffers (`CudaFusedAdam`)",
        "headroom_raw_fused_cuda",
        None,
    ),
    (
        "8-bit, raw buffers (`CudaAdam8bit`)",
        "headroom_raw_adam8bit_cuda",
        None,
    ),
];

/// The bytes a step allocated beyond its start, in decimal units: `+0 B`, `+16.8 MB`,
/// `+4.03 GB`.
fn extra_bytes(bytes: u64) -> String {
    let value = bytes as f64;
    if bytes < 1_000 {
        format!("+{bytes} B")
    } else if bytes < 1_000_000 {
        format!("+{:.1} kB", value / 1e3)
    } else if bytes < 1_000_000_000 {
        format!("+{:.1} MB", value / 1e6)
    } else {
        format!("+{:.2} GB", value / 1e9)
    }
}

/// One implementation's cell: median step and extra bytes, `not measured (WHY)` for a line
/// that reports an error (PyTorch's bitsandbytes where it is not installed).
fn adam_cell(line: &Value) -> Result<String> {
    if let Some(error) = line["error"].as_str() {
        let why = error.split(['(', ':']).next().unwrap_or(error).trim();
        return Ok(format!("not measured ({why})"));
    }
    Ok(format!(
        "{:.2} ms, {}",
        number(line, "ms")?,
        extra_bytes(count(line, "step_extra_bytes")?)
    ))
}

/// The `adam_step_1e9` lines of a file by `impl`, every one of them known to
/// [`ADAM_IMPLEMENTATIONS`] on the side `known` picks.
fn adam_lines<'a>(
    file: &ResultFile,
    lines: &'a [Value],
    known: impl Fn(&str) -> bool,
) -> Result<Vec<(&'a str, &'a Value)>> {
    let mut found = Vec::new();
    for line in lines.iter().filter(|line| line["case"] == "adam_step_1e9") {
        let name = text(line, "impl")?;
        if !known(name) {
            bail!(
                "{}: no row for the implementation `{name}` (xtask's ADAM_IMPLEMENTATIONS)",
                file.path
            );
        }
        found.push((name, line));
    }
    Ok(found)
}

/// Adam at 1e9 parameters: per implementation, the median of 5 steps and the bytes a step
/// allocates beyond its start, ours beside PyTorch's; `—` where a side has no such
/// implementation or did not print it.
pub(super) fn adam_step_1e9(files: &[ResultFile]) -> Result<Vec<String>> {
    let [ours_file, pytorch_file] = files else {
        bail!(
            "reads cuda_adam's JSON lines and adam_step_1e9.py's, given {} files",
            files.len()
        );
    };
    let (ours_values, pytorch_values) = (json_lines(ours_file)?, json_lines(pytorch_file)?);
    let ours = adam_lines(ours_file, &ours_values, |name| {
        ADAM_IMPLEMENTATIONS
            .iter()
            .any(|(_, ours, _)| *ours == name)
    })?;
    let pytorch = adam_lines(pytorch_file, &pytorch_values, |name| {
        ADAM_IMPLEMENTATIONS
            .iter()
            .any(|(_, _, torch)| *torch == Some(name))
    })?;
    if ours.is_empty() {
        bail!("{}: no `adam_step_1e9` line", ours_file.path);
    }
    let cell = |lines: &[(&str, &Value)], name: Option<&str>| -> Result<String> {
        match lines.iter().find(|(found, _)| Some(*found) == name) {
            Some((_, line)) => adam_cell(line),
            None => Ok("—".to_owned()),
        }
    };
    let mut lines = table_head("| implementation | Headroom | PyTorch |", "|---|---|---|");
    for (label, ours_name, torch_name) in ADAM_IMPLEMENTATIONS {
        let (ours_cell, torch_cell) = (cell(&ours, Some(ours_name))?, cell(&pytorch, *torch_name)?);
        if ours_cell == "—" && torch_cell == "—" {
            continue;
        }
        lines.push(row(&[label.to_string(), ours_cell, torch_cell]));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::super::rendered;

    /// vit_step's settings in its order beside bench_reference.py's `sgd` (fp32) and
    /// `sgd_bf16_model` lines of the same batch; its `env` line and other cases match nothing.
    #[test]
    fn vit_steps_render_beside_pytorch_sgd() {
        let ours = "{\"case\": \"vit_l16_sgd\", \"dtype\": \"F32\", \"impl\": \"headroom_cuda\", \
             \"batch\": 1, \"step_ms\": 20.24, \"host_ms\": 9.1, \"peak_allocated_bytes\": \
             2470000000, \"linear_fallbacks\": 0}\n\
             {\"case\": \"vit_l16_sgd\", \"dtype\": \"BF16\", \"batch\": 32, \"step_ms\": 30.9, \
             \"peak_allocated_bytes\": 5714000000}\n";
        let torch = "{\"case\": \"env\", \"torch\": \"2.11.0\", \"model\": \"vit_l_16\"}\n\
             {\"case\": \"sgd\", \"model\": \"vit_l_16\", \"batch\": 32, \"step_ms_median\": 298.1, \
             \"steady_peak_alloc\": 12060000000}\n\
             {\"case\": \"sgd\", \"model\": \"vit_l_16\", \"batch\": 1, \"step_ms_median\": 37.14, \
             \"steady_peak_alloc\": 2514000000}\n\
             {\"case\": \"adam_fused\", \"model\": \"vit_l_16\", \"batch\": 32, \
             \"step_ms_median\": 1.0, \"steady_peak_alloc\": 1}\n";
        let table = rendered(
            "vit-step",
            &[
                ("results/x/vit_step.jsonl", ours),
                ("results/x/anchor_vit_step.jsonl", torch),
            ],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| setting | Headroom step | peak alloc | PyTorch step | PyTorch peak |",
                "|---|---:|---:|---:|---:|",
                "| fp32, batch 1 | 20.2 ms | 2.47 GB | 37.1 ms | 2.51 GB |",
                "| bf16 model, batch 32 | 30.9 ms | 5.71 GB | — | — |",
            ]
        );
    }

    /// One row per model, PyTorch's line of the same case beside it; a PyTorch line that
    /// reports an error leaves its cells empty.
    #[test]
    fn graph_steps_render_beside_pytorch_graphs() {
        let ours = "{\"case\": \"vit_l16_b1_adamw\", \"eager_step_ms\": 22.04, \
             \"eager_host_ms\": 10.41, \"graph_step_ms\": 20.21, \"graph_host_ms\": 0.11, \
             \"ratio\": 0.9171, \"params_bitwise_equal\": true, \"eager_peak_allocated_bytes\": \
             4906351104, \"graph_peak_allocated_bytes\": 4906351616}\n\
             {\"case\": \"gpt2_small_b1x1024_adamw\", \"eager_step_ms\": 36.2, \
             \"eager_host_ms\": 6.75, \"graph_step_ms\": 35.06, \"graph_host_ms\": 0.34, \
             \"ratio\": 0.9677, \"params_bitwise_equal\": false, \"eager_peak_allocated_bytes\": \
             2323190784, \"graph_peak_allocated_bytes\": 2323190784}\n";
        let torch = "{\"case\": \"vit_l16_b1_adamw\", \"eager_step_ms\": 34.227, \
             \"graph_step_ms\": 27.367, \"ratio\": 0.7996, \"eager_peak_allocated_bytes\": \
             4946067456, \"graph_peak_allocated_bytes\": 6301689344}\n\
             {\"case\": \"gpt2_small_b1x1024_adamw\", \"error\": \"TypeError()\"}\n";
        let table = rendered(
            "graph-step",
            &[
                ("results/x/graph_step.jsonl", ours),
                ("results/x/anchor_graph_step.jsonl", torch),
            ],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| case | Headroom eager | Headroom graph | ratio | host ms (eager → graph) | \
                 bitwise | peak (eager → graph) | PyTorch eager | PyTorch graph | ratio | PyTorch \
                 peak (eager → graph) |",
                "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
                "| `vit_l16_b1_adamw` | 22.0 ms | 20.2 ms | 0.917 | 10.4 → 0.11 | equal | 4.91 GB → \
                 4.91 GB | 34.2 ms | 27.4 ms | 0.800 | 4.95 GB → 6.30 GB |",
                "| `gpt2_small_b1x1024_adamw` | 36.2 ms | 35.1 ms | 0.968 | 6.8 → 0.34 | differ | \
                 2.32 GB → 2.32 GB | — | — | — | — |",
            ]
        );
    }

    /// One row per shape in our order, PyTorch's figures beside ours, `—` for a shape PyTorch
    /// has no line for.
    #[test]
    fn attention_f32_renders_beside_pytorch() {
        let line = |shape: &str, case: &str, ms: f64| {
            format!("{{\"shape\": \"{shape}\", \"case\": \"{case}\", \"ms\": {ms}}}\n")
        };
        let ours = line("gpt2_b8x1024", "forward", 0.411)
            + &line("gpt2_b8x1024", "backward", 1.194)
            + &line("gpt2_b8x1024", "fwd_bwd", 1.59)
            + &line("vit_l16_b1", "forward", 0.03)
            + &line("vit_l16_b1", "backward", 0.074)
            + &line("vit_l16_b1", "fwd_bwd", 0.1);
        let torch = line("gpt2_b8x1024", "forward", 0.518)
            + &line("gpt2_b8x1024", "backward", 1.603)
            + &line("gpt2_b8x1024", "fwd_bwd", 1.858);
        let table = rendered(
            "attention-f32",
            &[
                ("results/x/attention_f32.jsonl", &ours),
                ("results/x/attention_f32_reference.jsonl", &torch),
            ],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| shape | Headroom forward | backward | fwd + bwd | PyTorch forward | backward | \
                 fwd + bwd | ratio (fwd + bwd) |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
                "| `gpt2_b8x1024` | 0.411 ms | 1.194 ms | 1.590 ms | 0.518 ms | 1.603 ms | 1.858 \
                 ms | 0.856 |",
                "| `vit_l16_b1` | 0.030 ms | 0.074 ms | 0.100 ms | — | — | — | — |",
            ]
        );
    }

    /// Implementations in the table's order, each side's median and extra bytes, PyTorch's
    /// bitsandbytes line that reports an error as not measured, and rows neither side printed
    /// left out.
    #[test]
    fn adam_steps_render_by_implementation() {
        let line = |name: &str, ms: f64, extra: u64| {
            format!(
                "{{\"case\": \"adam_step_1e9\", \"impl\": \"{name}\", \"ms\": {ms}, \"GBps\": 1.0, \
                 \"step_extra_bytes\": {extra}, \"times_ms\": [{ms}]}}\n"
            )
        };
        let ours = line("headroom_foreach_cuda", 19.48, 16_777_216)
            + &line("headroom_fused_cuda", 7.031, 0)
            + &line("headroom_foreach_unbounded_cuda", 19.484, 4_000_000_000);
        let torch = line("torch_fused", 9.18, 512)
            + &line("torch_foreach", 21.16, 4_026_531_840)
            + &line("torch_single", 18.55, 75_497_472)
            + "{\"case\": \"adam_step_1e9\", \"impl\": \"bitsandbytes_adam8bit\", \"error\": \
               \"ModuleNotFoundError(\\\"No module named 'bitsandbytes'\\\")\"}\n";
        let table = rendered(
            "adam-step-1e9",
            &[
                ("results/x/cuda_adam.jsonl", &ours),
                ("results/x/adam_step_1e9_torch.jsonl", &torch),
            ],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| implementation | Headroom | PyTorch |",
                "|---|---|---|",
                "| fused | 7.03 ms, +0 B | 9.18 ms, +512 B |",
                "| foreach (bounded, 16 MiB chunk) | 19.48 ms, +16.8 MB | 21.16 ms, +4.03 GB |",
                "| foreach unbounded | 19.48 ms, +4.00 GB | — |",
                "| single | — | 18.55 ms, +75.5 MB |",
                "| 8-bit blockwise (bitsandbytes' update) | — | not measured \
                 (ModuleNotFoundError) |",
            ]
        );
    }

    /// An implementation without a row is an error naming it, not a row left out.
    #[test]
    fn an_unknown_adam_implementation_is_an_error() {
        let ours = "{\"case\": \"adam_step_1e9\", \"impl\": \"headroom_new_cuda\", \"ms\": 1.0, \
                    \"step_extra_bytes\": 0}\n";
        let err = rendered(
            "adam-step-1e9",
            &[
                ("results/x/cuda_adam.jsonl", ours),
                ("results/x/adam_step_1e9_torch.jsonl", ""),
            ],
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").ends_with(
                "results/x/cuda_adam.jsonl: no row for the implementation `headroom_new_cuda` \
                 (xtask's ADAM_IMPLEMENTATIONS)"
            ),
            "{err:#}"
        );
    }

    /// Our engines' summary lines (the others, the log around them and the shapes not measured
    /// skipped) beside SDPA's backends, each forward + backward against cuDNN's.
    #[test]
    fn hopper_attention_renders_beside_sdpa_backends() {
        let bench = "\
Benchmarking hopper_attention/bf16_causal_forward_ws_b4_h16_s4096_d128: Analyzing
measured hopper_attention/bf16_causal_forward_ws_b4_h16_s4096_d128: 625.3 µs device, 429 GB/s
family         case                                       MB/pass  device µs      GB/s   %ceil   %4.26    host µs  TFLOP/s
llama_attention bf16_causal_forward_b4_h32_kv8_s2048_d64      83.9      316.0       265    NaN%    6.2%      322.4    217.5
hopper_attention bf16_causal_forward_ws_b4_h16_s4096_d128     268.4      625.3       429    NaN%   10.1%      632.2    439.6
hopper_attention bf16_causal_fwd_bwd_ws_b4_h16_s4096_d128     536.9     4286.2       125    NaN%    2.9%     4296.2    224.5
";
        let reference = |case: &str, backend: &str, ms: f64, tflops: f64| {
            format!(
                "{{\"case\": \"{case}\", \"backend\": \"{backend}\", \"ms\": {ms}, \
                 \"tflops\": {tflops}}}\n"
            )
        };
        let torch = reference(
            "bf16_causal_forward_b4_h16_s4096_d128",
            "cudnn",
            0.494,
            556.8,
        ) + &reference(
            "bf16_causal_fwd_bwd_b4_h16_s4096_d128",
            "cudnn",
            2.197,
            437.9,
        ) + &reference(
            "bf16_causal_fwd_bwd_b4_h16_s4096_d128_flash",
            "flash",
            3.834,
            251.0,
        )
            + "{\"case\": \"bf16_causal_forward_b4_h16_s4096_d128_flash\", \"error\": \"x\"}\n";
        let table = rendered(
            "attention-hopper",
            &[
                ("results/x/kernels_attention.txt", bench),
                ("results/x/attention_reference_issue35.jsonl", &torch),
            ],
        )
        .unwrap();
        assert_eq!(
            table,
            [
                "| shape | kernel | forward | TFLOP/s | fwd + bwd | TFLOP/s | fwd + bwd against \
                 cuDNN |",
                "|---|---|---:|---:|---:|---:|---:|",
                "| causal, head dim 128 | Headroom warp-specialised (`ws`) | 0.625 ms | 440 | \
                 4.286 ms | 224 | 1.95× |",
                "| causal, head dim 128 | PyTorch SDPA, cuDNN | 0.494 ms | 557 | 2.197 ms | 438 | \
                 1.00× |",
                "| causal, head dim 128 | PyTorch SDPA, flash | — | — | 3.834 ms | 251 | 1.75× |",
            ]
        );
        let none = rendered(
            "attention-hopper",
            &[
                ("results/x/k.txt", "no summary\n"),
                ("results/x/r.jsonl", ""),
            ],
        );
        let error = format!("{:#}", none.unwrap_err());
        assert!(
            error.contains("no hopper_attention summary line"),
            "{error}"
        );
    }
}
