//! The memory-analysis walkthrough: what a training step allocates, phase by phase — model,
//! optimizer, inputs, forward, loss, backward, optimizer step, `zero_grad` — read from the
//! caching allocator after each, including AdamW's first-step state and the step's transient.
//!
//! Part 1 is the walkthrough's own example, `Linear(1024, 1024, bias=False)` with AdamW on an
//! input of ones, two iterations, beside PyTorch's figures for it on an H200
//! (`testdata/golden_memory_seed.json`). PyTorch's rows include cuBLAS workspaces that its
//! allocator hands out (32 MiB from the first forward, a second 32 MiB from backward, which runs
//! with its own cuBLAS handle); without them the figures agree byte for byte on the CPU.
//! Part 2 does the same on a ViT (`VitConfig::mini()` on the CPU, torchvision's ViT-L/16 on a
//! GPU) at batch 1 and names each component. CPU by default; `--cuda` (built with
//! `--features cuda`) or auto on a GPU. See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::sync::Arc;

use anyhow::{Context, Result};
use headroom::autograd_core::{DType, Generator, Tensor};
use headroom::nn::{Linear, Module, VisionTransformer, VitConfig};
use headroom::optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};

use device::Device;

const MIB: f64 = (1u64 << 20) as f64;

/// PyTorch's cuBLAS workspace on Hopper (32 MiB).
const CUBLAS_WORKSPACE: u64 = 32 << 20;

/// One line of the walkthrough: allocated bytes after a phase and the peak during it.
struct Row {
    label: String,
    allocated: u64,
    peak: u64,
}

/// Runs `phase`, recording the allocated bytes after it and its peak; returns its value.
fn record<T>(
    device: &Device,
    rows: &mut Vec<Row>,
    label: &str,
    phase: impl FnOnce() -> Result<T>,
) -> Result<T> {
    device.reset_peak();
    let value = phase()?;
    rows.push(Row {
        label: label.to_owned(),
        allocated: device.allocated(),
        peak: device.peak(),
    });
    Ok(value)
}

fn adamw(params: Vec<Tensor>) -> Result<Adam> {
    // PyTorch's default on CUDA is foreach; here the bound (4 Mi elements) exceeds the
    // parameter, so the temporaries are PyTorch's too.
    Ok(Adam::new(
        vec![ParamGroup::new(params, AdamConfig::adamw())],
        Implementation::FOREACH,
    )?)
}

/// The inputs (`make_input`), then two iterations of forward, loss, backward, step and
/// zero_grad. The output and loss live on, as Python variables do, until the next iteration
/// replaces them (inside the phase that computes the new one, as Python's assignment does).
fn train(
    device: &Device,
    rows: &mut Vec<Row>,
    make_input: impl FnOnce() -> Result<Tensor>,
    forward: &dyn Fn(&Tensor) -> Result<Tensor>,
    optimizer: &mut Adam,
) -> Result<()> {
    let input = record(device, rows, "inputs", make_input)?;
    let (mut output, mut loss) = (None, None);
    for iter in 0..2 {
        record(device, rows, &format!("iter{iter} forward"), || {
            output = Some(forward(&input)?);
            Ok(())
        })?;
        record(device, rows, &format!("iter{iter} loss"), || {
            loss = Some(output.as_ref().context("output")?.sum_all()?);
            Ok(())
        })?;
        record(device, rows, &format!("iter{iter} backward"), || {
            Ok(loss.as_ref().context("loss")?.backward()?)
        })?;
        record(device, rows, &format!("iter{iter} optimizer.step"), || {
            Ok(optimizer.step()?)
        })?;
        record(device, rows, &format!("iter{iter} zero_grad"), || {
            Ok(optimizer.zero_grad(true)?)
        })?;
    }
    Ok(())
}

/// PyTorch's rows for the walkthrough's Linear + AdamW example.
fn pytorch_rows() -> Result<Vec<(String, u64)>> {
    let text = include_str!("../../testdata/golden_memory_seed.json");
    let json: serde_json::Value = serde_json::from_str(text)?;
    json["seed_linear_adamw"]["rows"]
        .as_array()
        .context("seed_linear_adamw rows")?
        .iter()
        .map(|row| {
            Ok((
                row["step"].as_str().context("step")?.to_owned(),
                row["allocated"].as_u64().context("allocated")?,
            ))
        })
        .collect()
}

fn linear_adamw(device: &Device) -> Result<()> {
    let backend = &device.backend;
    let generator = Arc::new(Generator::new(0));
    let mut rows = Vec::new();
    let model = record(device, &mut rows, "model", || {
        Ok(Linear::new(
            backend,
            1024,
            1024,
            false,
            DType::F32,
            &generator,
        )?)
    })?;
    let mut optimizer = record(device, &mut rows, "optimizer created", || {
        adamw(model.parameters())
    })?;
    let ones = || Ok(Tensor::ones(backend, &[1024], DType::F32)?);
    let forward = |x: &Tensor| Ok(model.forward(x)?);
    train(device, &mut rows, ones, &forward, &mut optimizer)?;

    println!(
        "Part 1: Linear(1024, 1024, bias=False) + AdamW, input ones(1024), on {}\n",
        device.name
    );
    println!(
        "{:<22} {:>12} {:>14} {:>16} {:>16}",
        "after", "allocated", "peak in phase", "PyTorch (H200)", "PyTorch − cuBLAS"
    );
    let pytorch = pytorch_rows()?;
    let mut workspace = 0;
    for (row, (label, theirs)) in rows.iter().zip(&pytorch) {
        workspace = match label.as_str() {
            "iter0 forward" => CUBLAS_WORKSPACE,
            "iter0 backward" => 2 * CUBLAS_WORKSPACE,
            _ => workspace,
        };
        let without = theirs - workspace;
        println!(
            "{:<22} {:>12} {:>14} {:>16} {:>16} {}",
            row.label,
            row.allocated,
            row.peak,
            theirs,
            without,
            if row.allocated == without { "=" } else { "≠" }
        );
    }
    let at = |label: &str| rows.iter().find(|r| r.label == label).map(|r| r.allocated);
    let (Some(backward), Some(step), Some(zero)) = (
        at("iter0 backward"),
        at("iter0 optimizer.step"),
        at("iter0 zero_grad"),
    ) else {
        anyhow::bail!("missing rows");
    };
    let step_row = rows
        .iter()
        .find(|r| r.label == "iter0 optimizer.step")
        .context("step row")?;
    println!(
        "\nAdamW's first step keeps exp_avg and exp_avg_sq: +{:.1} MiB (two copies of the 4 MiB \
         weight); the step's transient, freed before it returns: {:.1} MiB (foreach's temporary, \
         one weight-sized buffer; fused Adam has none); zero_grad(set_to_none) frees the \
         gradient: −{:.1} MiB.\n",
        (step - backward) as f64 / MIB,
        (step_row.peak - step_row.allocated) as f64 / MIB,
        (step - zero) as f64 / MIB,
    );
    Ok(())
}

fn vit_adamw(device: &Device) -> Result<()> {
    let (name, config) = if device.is_cuda() {
        ("ViT-L/16", VitConfig::vit_l_16())
    } else {
        ("ViT mini", VitConfig::mini())
    };
    let backend = &device.backend;
    let mut rows = Vec::new();
    let model = record(device, &mut rows, "model", || {
        let generator = Arc::new(Generator::new(0));
        Ok(VisionTransformer::new(
            backend,
            config,
            DType::F32,
            &generator,
        )?)
    })?;
    let mut optimizer = adamw(model.parameters())?;
    let size = config.image_size;
    let images = || Ok(Tensor::full(backend, &[1, 3, size, size], 0.5, DType::F32)?);
    let forward = |x: &Tensor| Ok(model.forward(x)?);
    train(device, &mut rows, images, &forward, &mut optimizer)?;

    println!(
        "Part 2: {name}, batch 1, AdamW (foreach, bounded), on {}\n",
        device.name
    );
    println!(
        "{:<22} {:>12} {:>12} {:>14}",
        "after", "allocated", "change", "peak in phase"
    );
    let mut previous = 0;
    for row in &rows {
        println!(
            "{:<22} {:>9.1} MB {:>+9.1} MB {:>11.1} MB",
            row.label,
            row.allocated as f64 / 1e6,
            (row.allocated as f64 - previous as f64) / 1e6,
            row.peak as f64 / 1e6
        );
        previous = row.allocated;
    }
    let by_label = |label: &str| rows.iter().find(|r| r.label == label).context("row");
    let params = by_label("model")?;
    let loss = by_label("iter1 loss")?;
    let (first_step, first_backward) = (
        by_label("iter0 optimizer.step")?,
        by_label("iter0 backward")?,
    );
    let step = by_label("iter1 optimizer.step")?;
    let zero = by_label("iter1 zero_grad")?;
    println!(
        "\nparameters {:.1} MB; activations kept by the forward {:.1} MB; gradients {:.1} MB; \
         AdamW's state, created by the first step, {:.1} MB; the step's transient {:.1} MB.",
        params.allocated as f64 / 1e6,
        (loss.allocated - zero.allocated) as f64 / 1e6,
        (step.allocated - zero.allocated) as f64 / 1e6,
        (first_step.allocated - first_backward.allocated) as f64 / 1e6,
        (step.peak - step.allocated) as f64 / 1e6,
    );
    Ok(())
}

fn main() -> Result<()> {
    let device = Device::from_args()?;
    linear_adamw(&device)?;
    vit_adamw(&device)
}
