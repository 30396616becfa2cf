//! PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass",
//! step by step, with Headroom: standard Adam against Adam stepped inside backward.
//!
//! 1. The standard loop, `backward(); step(); zero_grad()`, with Adam computed foreach as
//!    PyTorch does by default, then fused: the memory snapshot shows the peak at the step, where
//!    every gradient is alive (and, foreach, a temporary of every parameter's size).
//! 2. The same Adam stepped inside backward by hooks' `InBackward`: each bucket of parameters is
//!    stepped as soon as its gradients are final and the gradients are freed, so they never pile
//!    up. Unlike the tutorial's one optimizer per parameter, this is one fused optimizer stepped
//!    a bucket at a time — and an LR scheduler, gradient accumulation and clipping work with it.
//! 3. 8-bit Adam inside backward: the state shrinks too.
//!
//! Printed per variant: the peak allocated over three steps and the fastest step. Written to the
//! output folder (first argument, default `target/example-output/optimizer_in_backward` in the
//! workspace): `standard.pickle` and `in_backward.pickle` (the third step's allocator history,
//! for https://pytorch.org/memory_viz) and `timeline.html` (allocated bytes over that step, both
//! loops side by side). On a GPU (built
//! with `--features cuda`; auto, or `--cuda`): torchvision's ViT-L/16 at batch 1, the tutorial's
//! setting; on the CPU, `VitConfig::mini()`. See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use headroom::autograd_core::{DType, Generator, Tensor};
use headroom::caching_allocator::{write_pickle, Snapshot, TraceAction};
use headroom::hooks::{InBackward, InBackwardConfig, DEFAULT_BUCKET_BYTES};
use headroom::nn::{Module, VisionTransformer, VitConfig};
use headroom::optim::{
    Adam, Adam8bit, Adam8bitConfig, AdamConfig, Implementation, Optimizer, ParamGroup,
};

use device::Device;

/// How a variant steps.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    /// `step()` after backward, Adam with this implementation.
    Standard(Implementation),
    /// Fused Adam inside backward.
    InBackward,
    /// 8-bit Adam inside backward.
    EightBitInBackward,
}

const VARIANTS: [(&str, Variant); 4] = [
    (
        "Adam foreach, step after backward (PyTorch's default)",
        Variant::Standard(Implementation::ForeachUnbounded),
    ),
    (
        "Adam fused, step after backward",
        Variant::Standard(Implementation::Fused),
    ),
    ("Adam fused, stepped in backward", Variant::InBackward),
    (
        "8-bit Adam, stepped in backward",
        Variant::EightBitInBackward,
    ),
];

/// What one variant measured.
struct Figures {
    peak: u64,
    step_ms: f64,
    snapshot: Snapshot,
    /// Allocated bytes when the traced step began.
    base: u64,
}

fn adam(params: Vec<Tensor>, implementation: Implementation) -> Result<Box<dyn Optimizer>> {
    let config = AdamConfig {
        lr: 1e-4,
        ..AdamConfig::adam()
    };
    Ok(Box::new(Adam::new(
        vec![ParamGroup::new(params, config)],
        implementation,
    )?))
}

fn measure(device: &Device, config: VitConfig, variant: Variant) -> Result<Figures> {
    let model = VisionTransformer::new(
        &device.backend,
        config,
        DType::F32,
        &Arc::new(Generator::new(0)),
    )?;
    let params = model.parameters();
    // Buckets of 25 MiB (the default) or 1/16 of the parameters, whichever is smaller: the CPU's
    // small model then keeps as few gradients alive as ViT-L/16 does with 25 MiB.
    let param_bytes: u64 = params.iter().map(|p| 4 * p.numel() as u64).sum();
    let buckets = InBackwardConfig {
        bucket_bytes: (param_bytes / 16).min(DEFAULT_BUCKET_BYTES),
        ..InBackwardConfig::default()
    };
    let (standard, in_backward) = match variant {
        Variant::Standard(implementation) => (Some(adam(params, implementation)?), None),
        Variant::InBackward => {
            let optimizer = adam(params, Implementation::Fused)?;
            (None, Some(InBackward::new(optimizer, buckets)?))
        }
        Variant::EightBitInBackward => {
            let config = Adam8bitConfig {
                lr: 1e-4,
                ..Adam8bitConfig::adam()
            };
            let optimizer =
                Adam8bit::new(vec![ParamGroup::new(params, config)], Implementation::Fused)?;
            (None, Some(InBackward::new(Box::new(optimizer), buckets)?))
        }
    };
    let mut standard = standard;
    let size = config.image_size;
    let images = Tensor::full(&device.backend, &[1, 3, size, size], 0.5, DType::F32)?;
    let mut step_ms = f64::INFINITY;
    let mut base = 0;
    device.reset_peak();
    for step in 0..3 {
        let traced = step == 2;
        device.synchronize()?;
        if traced {
            base = device.allocated();
            device.record_history(true);
        }
        let start = Instant::now();
        let loss = model.forward(&images)?.sum_all()?;
        match (&mut standard, &in_backward) {
            (Some(optimizer), _) => {
                loss.backward()?;
                optimizer.step()?;
                optimizer.zero_grad(true)?;
            }
            (None, Some(in_backward)) => in_backward.backward(&loss)?,
            (None, None) => unreachable!("every variant has an optimizer"),
        }
        drop(loss);
        device.synchronize()?;
        if step > 0 {
            step_ms = step_ms.min(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let snapshot = device.snapshot();
    device.record_history(false);
    Ok(Figures {
        peak: device.peak(),
        step_ms,
        snapshot,
        base,
    })
}

/// Allocated bytes after each event of a snapshot's history, from `base`.
fn allocated_curve(snapshot: &Snapshot, base: u64) -> Vec<u64> {
    let mut sizes = HashMap::new();
    let mut allocated = base as i64;
    let mut curve = vec![base];
    for entry in snapshot.device_traces.iter().flatten() {
        match entry.action {
            TraceAction::Alloc => {
                sizes.insert(entry.addr, entry.size as i64);
                allocated += entry.size as i64;
            }
            TraceAction::FreeRequested | TraceAction::Free => {
                allocated -= sizes.remove(&entry.addr).unwrap_or(0);
            }
            _ => continue,
        }
        curve.push(allocated.max(0) as u64);
    }
    curve
}

/// An SVG polyline chart of `curve` scaled to `top` bytes.
fn chart(title: &str, curve: &[u64], top: u64) -> String {
    let (width, height) = (560.0, 240.0);
    let n = curve.len().max(2) as f64 - 1.0;
    let points: String = curve
        .iter()
        .enumerate()
        .map(|(i, &bytes)| {
            let x = i as f64 / n * width;
            let y = height - bytes as f64 / top.max(1) as f64 * height;
            format!("{x:.1},{y:.1} ")
        })
        .collect();
    let peak = curve.iter().copied().max().unwrap_or(0);
    format!(
        "<figure><figcaption>{title}: peak {}</figcaption>\
         <svg viewBox=\"0 0 {width} {height}\" width=\"{width}\" height=\"{height}\">\
         <rect width=\"{width}\" height=\"{height}\" fill=\"#f6f8fa\"/>\
         <polyline points=\"{points}\" fill=\"none\" stroke=\"#1f6feb\" stroke-width=\"1.5\"/>\
         <text x=\"4\" y=\"14\" font-size=\"12\">{}</text>\
         <text x=\"4\" y=\"{}\" font-size=\"12\">0</text>\
         <text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"end\">allocator events →</text>\
         </svg></figure>",
        gb(peak),
        gb(top),
        height - 4.0,
        width - 4.0,
        height - 4.0,
    )
}

fn gb(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

/// Where the files go when no folder is named: under the workspace's `target/`, beside what
/// cargo builds (ignored by git, removed by `cargo clean`).
fn default_out_dir() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/example-output/optimizer_in_backward"
    )
    .to_owned()
}

fn main() -> Result<()> {
    let device = Device::from_args()?;
    let out = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .unwrap_or_else(default_out_dir);
    std::fs::create_dir_all(&out).with_context(|| format!("OUT_DIR {out}: cannot create it"))?;
    let (name, config) = if device.is_cuda() {
        ("ViT-L/16", VitConfig::vit_l_16())
    } else {
        ("ViT mini", VitConfig::mini())
    };
    println!(
        "{name} at batch 1 on {}, Adam (lr 1e-4), loss = out.sum(); three steps each\n",
        device.name
    );
    println!("{:<56} {:>10} {:>10}", "variant", "peak", "step");
    let mut results = Vec::new();
    for (label, variant) in VARIANTS {
        let figures = measure(&device, config, variant)?;
        println!(
            "{label:<56} {:>10} {:>7.1} ms",
            gb(figures.peak),
            figures.step_ms
        );
        results.push((label, variant, figures));
    }
    let standard = &results[0].2;
    let in_backward = &results[2].2;
    for (file, figures) in [("standard", standard), ("in_backward", in_backward)] {
        let path = format!("{out}/{file}.pickle");
        write_pickle(
            &figures.snapshot,
            std::io::BufWriter::new(std::fs::File::create(&path)?),
        )?;
    }
    let curves = [
        allocated_curve(&standard.snapshot, standard.base),
        allocated_curve(&in_backward.snapshot, in_backward.base),
    ];
    let top = curves.iter().flatten().copied().max().unwrap_or(1);
    let mut html = String::new();
    write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>optimizer in backward</title>\
         <style>body{{font-family:sans-serif;margin:24px}} .row{{display:flex;gap:24px}}</style>\
         </head><body><h1>{name}, batch 1 on {}: one training step</h1>\
         <p>Allocated bytes after each allocator event of the third step (forward, backward, \
         step), same scale.</p><div class=\"row\">{}{}</div></body></html>",
        device.name,
        chart(results[0].0, &curves[0], top),
        chart(results[2].0, &curves[1], top)
    )?;
    std::fs::write(format!("{out}/timeline.html"), html)?;
    println!(
        "\nstepping in backward peaks {} below the standard foreach loop and {} below fused; \
         wrote {out}/standard.pickle and {out}/in_backward.pickle (open them at \
         https://pytorch.org/memory_viz) and {out}/timeline.html",
        gb(standard.peak.saturating_sub(in_backward.peak)),
        gb(results[1].2.peak.saturating_sub(in_backward.peak)),
    );
    Ok(())
}
