//! Recipe 2 of the project's references (checkpointing a 1B-parameter ViT), the Headroom way:
//! the same training step without checkpointing, with every encoder block checkpointed, with
//! every second block, and with selective checkpointing (each block keeps what its matrix
//! products saved and recomputes the rest), printing for each the peak allocated memory, what the
//! forward keeps for backward, and the step time.
//!
//! Blocks are checkpointed without editing the model: a `CheckpointBlocks` becomes the encoder's
//! block runner. Unlike `torch.utils.checkpoint`'s reentrant form, the input needs no
//! `requires_grad`, and recomputed dropout draws the forward's masks (the model here has dropout
//! 0.1, so the last step's loss is printed too: with and without checkpointing it is the same
//! to the bit).
//!
//! On a GPU (built with `--features cuda`; auto, or `--cuda`): a ViT-g/14-sized model (40 blocks
//! of width 1408, 1.0 B parameters, f32) at batch 16 with SGD and `loss = out.sum()`, the recipe's
//! setting (its figures are fp16; mixed precision arrives with the amp crate), and one more row:
//! the first 3/5 of the blocks offloaded to pinned host memory (an `OffloadBlocks` as the block
//! runner). On the CPU: `VitConfig::mini()` at batch 16. `--only WORD` runs the baseline and the
//! settings whose label contains WORD. See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use headroom::autograd_core::{DType, Generator, Tensor};
use headroom::checkpoint::{
    BlockSelection, CheckpointBlocks, CheckpointOptions, OffloadBlocks, OffloadOptions, SaveMatmuls,
};
use headroom::nn::{BlockRunner, Module, VisionTransformer, VitConfig};
use headroom::optim::kernels::SgdConfig;
use headroom::optim::{Implementation, Optimizer, ParamGroup, Sgd};

use device::Device;

/// One way of running the blocks.
struct Setting {
    label: &'static str,
    runner: Option<Arc<dyn BlockRunner>>,
}

/// The settings: with `offload` (a CUDA device), also the saved tensors of the first 3/5 of the
/// blocks offloaded to pinned host memory, their copies overlapping the forward of the blocks
/// after them and the prefetch three blocks ahead of backward.
fn settings(n_blocks: usize, offload: bool) -> Vec<Setting> {
    let every = |selection| -> Option<Arc<dyn BlockRunner>> {
        Some(Arc::new(CheckpointBlocks {
            selection,
            options: CheckpointOptions::default(),
        }))
    };
    let offloaded = (n_blocks * 3).div_ceil(5);
    let mut settings = vec![
        Setting {
            label: "no checkpointing",
            runner: None,
        },
        Setting {
            label: "checkpoint every block",
            runner: every(BlockSelection::All),
        },
        Setting {
            label: "checkpoint every 2nd block",
            runner: every(BlockSelection::Every(2)),
        },
        Setting {
            label: "selective: save matmuls",
            runner: Some(Arc::new(CheckpointBlocks {
                selection: BlockSelection::All,
                options: CheckpointOptions {
                    policy: Arc::new(SaveMatmuls),
                    ..CheckpointOptions::default()
                },
            })),
        },
    ];
    if offload {
        settings.push(Setting {
            label: "offload first 3/5 of blocks",
            runner: Some(Arc::new(OffloadBlocks {
                selection: BlockSelection::Indices((0..offloaded).collect()),
                options: OffloadOptions {
                    release_after_blocks: n_blocks - offloaded,
                    prefetch_blocks: 3,
                    ..OffloadOptions::default()
                },
            })),
        });
    }
    settings
}

/// What one setting measured.
struct Figures {
    peak: u64,
    kept: u64,
    step_ms: f64,
    loss: f32,
}

fn measure(device: &Device, config: VitConfig, batch: usize, setting: &Setting) -> Result<Figures> {
    let mut model = VisionTransformer::new(
        &device.backend,
        config,
        DType::F32,
        &Arc::new(Generator::new(0)),
    )?;
    model.encoder.block_runner = setting.runner.clone();
    let mut sgd = Sgd::new(
        vec![ParamGroup::new(model.parameters(), SgdConfig::new(1e-4))],
        Implementation::Fused,
    )?;
    let size = config.image_size;
    let values: Vec<f64> = (0..batch * 3 * size * size)
        .map(|i| ((i * 7919) % 1000) as f64 / 1000.0)
        .collect();
    let images = Tensor::from_f64s(
        &device.backend,
        &values,
        &[batch, 3, size, size],
        DType::F32,
    )?;
    let (warmup, timed) = (2, 3);
    let mut figures = Figures {
        peak: 0,
        kept: 0,
        step_ms: f64::INFINITY,
        loss: 0.0,
    };
    for step in 0..warmup + timed {
        device.synchronize()?;
        device.reset_peak();
        let start = Instant::now();
        let before = device.allocated();
        let loss = model.forward(&images)?.sum_all()?;
        let kept = device.allocated() - before;
        loss.backward()?;
        sgd.step()?;
        sgd.zero_grad(true)?;
        device.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        figures.loss = loss.to_vec::<f32>()?[0];
        if step >= warmup {
            figures.step_ms = figures.step_ms.min(ms);
            figures.peak = figures.peak.max(device.peak());
            figures.kept = kept;
        }
    }
    Ok(figures)
}

fn gb(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

fn main() -> Result<()> {
    let device = Device::from_args()?;
    let (name, config, batch) = if device.is_cuda() {
        let vit_g = VitConfig {
            image_size: 224,
            patch_size: 14,
            num_layers: 40,
            num_heads: 16,
            hidden_dim: 1408,
            mlp_dim: 6144,
            ..VitConfig::vit_l_16()
        };
        ("ViT-g/14-sized", vit_g, 16)
    } else {
        ("ViT mini", VitConfig::mini(), 16)
    };
    let config = VitConfig {
        dropout: 0.1,
        ..config
    };
    let n_params = VisionTransformer::new(
        &device.backend,
        config,
        DType::F32,
        &Arc::new(Generator::new(0)),
    )?
    .num_parameters();
    println!(
        "{name} ({:.2} B parameters, f32, dropout 0.1) at batch {batch} on {}, SGD, loss = \
         out.sum(); fastest of 3 steps after 2 warm-ups\n",
        n_params as f64 / 1e9,
        device.name
    );
    println!(
        "{:<28} {:>10} {:>16} {:>10} {:>8}  last loss",
        "setting", "peak", "kept by forward", "step", "time"
    );
    // `--only WORD`: the baseline and the settings whose label contains WORD.
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1));
    let mut baseline: Option<Figures> = None;
    for (i, setting) in settings(config.num_layers, device.is_cuda())
        .into_iter()
        .enumerate()
    {
        if i > 0 && only.is_some_and(|word| !setting.label.contains(word.as_str())) {
            continue;
        }
        let f = measure(&device, config, batch, &setting)?;
        let ratio = baseline.as_ref().map_or(1.0, |b| f.step_ms / b.step_ms);
        println!(
            "{:<28} {:>10} {:>16} {:>8.1} ms {:>7.2}x  {}",
            setting.label,
            gb(f.peak),
            gb(f.kept),
            f.step_ms,
            ratio,
            f.loss
        );
        if baseline.is_none() {
            baseline = Some(f);
        }
    }
    if !device.is_cuda() {
        println!("\n(offload copies saved tensors to pinned host memory: it runs with --cuda)");
    }
    Ok(())
}
