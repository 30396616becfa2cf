//! The techniques stacked, as the ViT-G recipe stacks them: a ViT trained by the plain loop
//! (fused AdamW, f32), then with 8-bit Adam stepped inside backward, every block checkpointed and
//! the forward under bf16 autocast, then the same under fp16 autocast with loss scaling. Each
//! technique is one line on top of the plain loop, and they compose through their types:
//! - in backward: hooks' `InBackward` owns the optimizer (any optim `Optimizer`);
//! - checkpointing: a `BlockRunner` set on the model's blocks;
//! - autocast: amp's policy entered around the forward;
//! - loss scaling: amp's `GradScaler`, a `LossScaler` that `InBackward::backward_scaled` takes.
//!
//! Printed per setting: the peak allocated over the timed steps, the median step, and the loss.
//! On a GPU (built with `--features cuda`; auto, or `--cuda`): a ViT-g/14-shaped model (about
//! 1 B parameters) at batch 8 — the recipe's model; on the CPU, `VitConfig::mini()` at batch 4.
//! Flags: `--steps N` (timed steps after 2 warm-up steps, default 4). See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom::amp::{AmpPolicy, GradScaler, GradScalerConfig};
use headroom::autograd_core::{cross_entropy, DType, Generator, Reduction, Tensor};
use headroom::checkpoint::CheckpointBlocks;
use headroom::hooks::{InBackward, InBackwardConfig};
use headroom::nn::{BlockStack, Module, VisionTransformer, VitConfig};
use headroom::optim::kernels::{Adam8bitConfig, AdamConfig};
use headroom::optim::{Adam, Adam8bit, Implementation, Optimizer, ParamGroup};

use device::Device;

/// How a setting trains.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Setting {
    /// Fused AdamW after backward, f32: the baseline.
    Plain,
    /// 8-bit Adam in backward, every block checkpointed, bf16 autocast.
    Stacked,
    /// The same under fp16 autocast with a GradScaler.
    StackedFp16,
}

const SETTINGS: [(&str, Setting); 3] = [
    ("plain: fused AdamW after backward, f32", Setting::Plain),
    (
        "8-bit Adam in backward + checkpointing + bf16 autocast",
        Setting::Stacked,
    ),
    (
        "8-bit Adam in backward + checkpointing + fp16 + loss scaling",
        Setting::StackedFp16,
    ),
];

/// What one setting measured.
struct Measured {
    peak: u64,
    step_ms: f64,
    loss: f32,
}

fn main() -> Result<()> {
    let device = Device::from_args()?;
    let steps = parse_steps()?;
    let (config, batch) = if device.is_cuda() {
        (VitConfig::vit_g_14(), 8)
    } else {
        (VitConfig::mini(), 4)
    };
    println!(
        "{} on {}, batch {batch}, {steps} timed steps after 2 warm-up steps",
        describe(&config),
        device.name
    );
    println!(
        "{:<62} {:>11} {:>10} {:>9}",
        "setting", "peak", "step", "loss"
    );
    let mut plain_peak = None;
    for (name, setting) in SETTINGS {
        let measured = train(&device, &config, batch, steps, setting)?;
        let ratio = match plain_peak {
            None => {
                plain_peak = Some(measured.peak);
                String::new()
            }
            Some(plain) => format!(
                " ({:.2}x the plain peak)",
                measured.peak as f64 / plain as f64
            ),
        };
        println!(
            "{name:<62} {:>8.1} MB {:>7.1} ms {:>9.4}{ratio}",
            measured.peak as f64 / 1e6,
            measured.step_ms,
            measured.loss
        );
    }
    Ok(())
}

fn parse_steps() -> Result<usize> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().position(|a| a == "--steps") {
        None => Ok(4),
        Some(i) => {
            let text = args.get(i + 1).context("--steps needs a value")?;
            match text.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => bail!("--steps {text}: expected a whole number of at least 1"),
            }
        }
    }
}

fn describe(config: &VitConfig) -> String {
    format!(
        "ViT ({} blocks of width {}, {}px images, patch {})",
        config.num_layers, config.hidden_dim, config.image_size, config.patch_size
    )
}

/// Trains `setting` from a fresh model: 2 warm-up steps, then `steps` timed ones.
fn train(
    device: &Device,
    config: &VitConfig,
    batch: usize,
    steps: usize,
    setting: Setting,
) -> Result<Measured> {
    let backend = &device.backend;
    let generator = Arc::new(Generator::new(0));
    let mut vit = VisionTransformer::new(backend, *config, DType::F32, &generator)?;
    let params = vit.parameters();
    let pixels = batch * 3 * config.image_size * config.image_size;
    let values: Vec<f32> = (0..pixels)
        .map(|i| (i as f32 * 0.618_034).fract() * 2.0 - 1.0)
        .collect();
    let images = Tensor::from_slice(
        backend,
        &values,
        &[batch, 3, config.image_size, config.image_size],
    )?;
    let labels: Vec<i64> = (0..batch as i64)
        .map(|i| i % config.num_classes as i64)
        .collect();
    let labels = Tensor::from_slice(backend, &labels, &[batch])?;

    // The plain loop's optimizer, or the stacked techniques: each is one line.
    let mut plain = None;
    let mut in_backward = None;
    let mut policy = None;
    let mut scaler = None;
    match setting {
        Setting::Plain => {
            let adamw = AdamConfig {
                lr: 1e-4,
                ..AdamConfig::adamw()
            };
            let groups = vec![ParamGroup::new(params.clone(), adamw)];
            plain = Some(Adam::new(groups, Implementation::Fused)?);
        }
        Setting::Stacked | Setting::StackedFp16 => {
            let adam8bit = Adam8bitConfig {
                lr: 1e-4,
                ..Adam8bitConfig::adamw()
            };
            let groups = vec![ParamGroup::new(params.clone(), adam8bit)];
            let optimizer = Box::new(Adam8bit::new(groups, Implementation::Fused)?);
            in_backward = Some(InBackward::new(optimizer, InBackwardConfig::default())?);
            vit.set_block_runner(Some(Arc::new(CheckpointBlocks::all())));
            let half = match setting {
                Setting::StackedFp16 => DType::F16,
                _ => DType::BF16,
            };
            policy = Some(AmpPolicy::torch_cuda(half)?);
            if setting == Setting::StackedFp16 {
                scaler = Some(GradScaler::new(GradScalerConfig::default())?);
            }
        }
    }

    let mut times = Vec::new();
    let mut loss_value = 0.0;
    for step in 0..2 + steps {
        if step == 2 {
            device.synchronize()?;
            device.reset_peak();
        }
        let started = Instant::now();
        let loss = {
            let _autocast = policy.as_ref().map(AmpPolicy::enter);
            let logits = vit.forward(&images)?;
            cross_entropy(&logits, &labels, -100, Reduction::Mean)?.to_dtype(DType::F32)?
        };
        match (&mut plain, &in_backward, &mut scaler) {
            (Some(adam), _, _) => {
                loss.backward()?;
                adam.step()?;
                adam.zero_grad(true)?;
            }
            (None, Some(in_backward), Some(scaler)) => {
                in_backward.backward_scaled(&loss, scaler)?;
            }
            (None, Some(in_backward), None) => in_backward.backward(&loss)?,
            (None, None, _) => unreachable!("every setting has an optimizer"),
        }
        device.synchronize()?;
        if step >= 2 {
            times.push(started.elapsed().as_secs_f64() * 1e3);
            loss_value = loss.to_vec::<f32>()?[0];
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(Measured {
        peak: device.peak(),
        step_ms: times[times.len() / 2],
        loss: loss_value,
    })
}
