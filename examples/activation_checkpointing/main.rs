//! Recipe 2 of the project's references (checkpointing a 1B-parameter ViT), the Headroom way:
//! the same training step without checkpointing, with every encoder block checkpointed, with
//! every second block, and with selective checkpointing (each block keeps what its matrix
//! products saved and recomputes the rest), printing for each the peak allocated memory, what the
//! forward keeps for backward, and the step time. Then the same with each block's saved
//! activations compressed (8 bits, bf16, and 8-bit block inputs of checkpointed blocks), and
//! the planner at a budget: `BlockPlanner` measures one step per strategy (keep,
//! keep-intermediates, recompute, 8-bit compression), `StepProfile::plan` picks one per block for a budget halfway between the
//! lowest peak it can reach and the peak without checkpointing, the example prints the plan's
//! table, trains under it and prints the measured peak and step time beside the predicted ones.
//! `--accuracy` instead trains a small ViT for 200 steps on a learnable task, the loss with and
//! without compression.
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
//! settings whose label contains WORD (`--only planner`: the planner alone). See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom::autograd_core::{
    cross_entropy, no_grad, uniform, BackendRef, DType, Generator, Reduction, Tensor,
};
use headroom::checkpoint::{
    BlockPlanner, BlockSelection, Candidate, CheckpointBlocks, CheckpointOptions, CompressBlocks,
    CompressOptions, Compression, OffloadBlocks, OffloadOptions, SaveMatmuls, StepProbe,
};
use headroom::nn::{BlockRunner, BlockStack, Module, VisionTransformer, VitConfig};
use headroom::ops_cpu::CpuBackend;
use headroom::optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup, Sgd, SgdConfig};

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
    settings.extend(compressed_settings());
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

/// Every block's saved activations compressed: to 8 bits (absmax per 256 elements), to bf16,
/// and checkpointed blocks whose saved input is kept in 8 bits.
fn compressed_settings() -> Vec<Setting> {
    let compressed = |compression, checkpoint| -> Option<Arc<dyn BlockRunner>> {
        Some(Arc::new(CompressBlocks {
            selection: BlockSelection::All,
            options: CompressOptions::new(compression),
            checkpoint,
        }))
    };
    vec![
        Setting {
            label: "saves in 8 bits",
            runner: compressed(Compression::default(), None),
        },
        Setting {
            label: "saves in bf16",
            runner: compressed(Compression::Bf16, None),
        },
        Setting {
            label: "checkpoint, 8-bit inputs",
            runner: compressed(Compression::default(), Some(CheckpointOptions::default())),
        },
    ]
}

/// What one setting measured.
struct Figures {
    peak: u64,
    kept: u64,
    step_ms: f64,
    loss: f32,
}

/// A fresh model (seed 0, `setting`'s runner), its SGD and the input: what every setting trains.
fn setup(
    device: &Device,
    config: VitConfig,
    batch: usize,
    runner: Option<Arc<dyn BlockRunner>>,
) -> Result<(VisionTransformer, Sgd, Tensor)> {
    let mut model = VisionTransformer::new(
        &device.backend,
        config,
        DType::F32,
        &Arc::new(Generator::new(0)),
    )?;
    model.set_block_runner(runner);
    let sgd = Sgd::new(
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
    Ok((model, sgd, images))
}

fn measure(device: &Device, config: VitConfig, batch: usize, setting: &Setting) -> Result<Figures> {
    let (model, mut sgd, images) = setup(device, config, batch, setting.runner.clone())?;
    timed_steps(device, &model, &mut sgd, &images)
}

/// 2 warm-up steps, then 3 timed ones: the highest peak, what the forward keeps, the fastest
/// step and the last loss.
fn timed_steps(
    device: &Device,
    model: &VisionTransformer,
    sgd: &mut Sgd,
    images: &Tensor,
) -> Result<Figures> {
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
        let loss = model.forward(images)?.sum_all()?;
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

/// The planner's probe of the example's device: the allocator's bytes, and CUDA events or the
/// host's clock.
fn step_probe(device: &Device) -> Result<StepProbe> {
    let any = device.backend.clone().into_any();
    #[cfg(feature = "cuda")]
    let any = match any.downcast::<headroom::ops_cuda::CudaBackend>() {
        Ok(cuda) => return Ok(StepProbe::cuda(&cuda)),
        Err(any) => any,
    };
    match any.downcast::<CpuBackend>() {
        Ok(cpu) => Ok(StepProbe::host(cpu)),
        Err(_) => bail!("the planner's probe knows the CPU and CUDA backends"),
    }
}

/// The planner at a budget: it measures one step per strategy (keep, keep-intermediates,
/// recompute, 8-bit compression) on a fresh model, plans for the budget halfway between the
/// lowest peak it can reach and the peak without checkpointing, prints the plan's table, then
/// trains under the plan and prints the measured peak and time beside the predicted ones.
fn planner_section(device: &Device, config: VitConfig, batch: usize) -> Result<()> {
    let (mut model, mut sgd, images) = setup(device, config, batch, None)?;
    let candidates = vec![
        Candidate::keep(),
        Candidate::keep_intermediates(),
        Candidate::recompute(),
        Candidate::compress(Compression::default()),
    ];
    // CUDA events time a block's work on the device; the host's clock on a CPU shared with other
    // work is noisier, so there each block's time is the median of three steps.
    let rounds = if device.is_cuda() { 1 } else { 3 };
    let planner = BlockPlanner::new(step_probe(device)?, candidates).measured_steps(rounds);
    model.set_block_runner(Some(planner.runner()));
    let profile = {
        let (model, sgd) = (&model, &mut sgd);
        // The step `timed_steps` runs (the loss a variable, the logits freed before backward):
        // the prediction is the peak of the step it measured.
        planner.profile(|| {
            let loss = model.forward(&images)?.sum_all()?;
            loss.backward()?;
            sgd.step()?;
            sgd.zero_grad(true)?;
            Ok(())
        })?
    };
    let n = profile.n_blocks();
    let predicted = |name: &str| -> Result<u64> {
        let index = profile
            .candidate_index(name)
            .context("a candidate of the list")?;
        Ok(profile.predict(&vec![index; n])?.peak_bytes)
    };
    let (keep_all, recompute_all) = (predicted("keep")?, predicted("recompute")?);
    let lowest = profile.min_budget()?;
    let budget = lowest + (keep_all - lowest) / 2;
    let plan = profile.plan(budget)?;
    let names: Vec<&str> = profile.candidates.iter().map(|c| c.name.as_str()).collect();
    println!(
        "\nThe planner: {rounds} measured step(s) per strategy ({}), then the fastest plan \
         within {} (halfway between the lowest peak a plan reaches, {}, and no checkpointing's {}; \
         every block recomputed: {}; all predicted)\n\n{plan}\n",
        names.join(", "),
        gb(budget),
        gb(lowest),
        gb(keep_all),
        gb(recompute_all),
    );
    let predicted_peak = plan.predicted_peak();
    let predicted_ms = plan.predicted_step_ms();
    model.set_block_runner(Some(Arc::new(plan)));
    let f = timed_steps(device, &model, &mut sgd, &images)?;
    println!(
        "trained under the plan: peak {} B measured, {} B predicted ({:.4}; budget {} B); step \
         {:.1} ms measured (fastest of 3), {:.1} ms predicted ({:.3})",
        f.peak,
        predicted_peak,
        f.peak as f64 / predicted_peak as f64,
        budget,
        f.step_ms,
        predicted_ms,
        f.step_ms / predicted_ms,
    );
    Ok(())
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
    if std::env::args().any(|a| a == "--accuracy") {
        return accuracy(&device.backend);
    }
    let (name, config, batch) = if device.is_cuda() {
        ("ViT-g/14-sized", VitConfig::vit_g_14(), 16)
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
    // `--only WORD`: the baseline and the settings whose label contains WORD.
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1));
    // `--only planner`: the planner alone (its profile measures the step without checkpointing).
    let planner_only = only.is_some_and(|word| word == "planner");
    if !planner_only {
        println!(
            "{:<28} {:>10} {:>16} {:>10} {:>8}  last loss",
            "setting", "peak", "kept by forward", "step", "time"
        );
    }
    let mut baseline: Option<Figures> = None;
    for (i, setting) in settings(config.num_layers, device.is_cuda())
        .into_iter()
        .enumerate()
    {
        let skipped = only.is_some_and(|word| !setting.label.contains(word.as_str()));
        if planner_only || (i > 0 && skipped) {
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
    if !device.is_cuda() && !planner_only {
        println!("\n(offload copies saved tensors to pinned host memory: it runs with --cuda)");
    }
    if only.is_none_or(|word| "planner".contains(word.as_str())) {
        planner_section(&device, config, batch)?;
    }
    Ok(())
}

/// The learnable task: 10 classes, each a fixed random image; an example is its class's image
/// plus uniform noise of the same amplitude. Returns `n` images `[n, 3, side, side]` and their
/// labels, drawn from stream `seed`.
fn noisy_templates(
    backend: &BackendRef,
    n: usize,
    side: usize,
    seed: u64,
) -> Result<(Tensor, Tensor)> {
    let pixels = 3 * side * side;
    let mut images = Vec::with_capacity(n * pixels);
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let label = (uniform(seed, i as u64) * 10.0) as usize;
        labels.push(label as i64);
        images.extend((0..pixels).map(|p| {
            let template = uniform(1000 + label as u64, p as u64) * 2.0 - 1.0;
            let noise = uniform(seed + 1, (i * pixels + p) as u64) * 2.0 - 1.0;
            (template + NOISE * noise) as f32
        }));
    }
    Ok((
        Tensor::from_slice(backend, &images, &[n, 3, side, side])?,
        Tensor::from_slice(backend, &labels, &[n])?,
    ))
}

/// Noise amplitude of the learnable task, relative to the templates'.
const NOISE: f64 = 4.0;

/// 200 steps of Adam (lr 1e-4) on the learnable task, batch 32, with each way of running the
/// blocks: the mean training loss over the last 20 steps, and the loss on 512 held-out examples.
fn accuracy(backend: &BackendRef) -> Result<()> {
    let config = VitConfig {
        image_size: 32,
        patch_size: 8,
        num_layers: 4,
        num_heads: 4,
        hidden_dim: 256,
        mlp_dim: 512,
        num_classes: 10,
        ..VitConfig::tiny()
    };
    let (steps, batch) = (200, 32);
    let (train_images, train_labels) = noisy_templates(backend, steps * batch, 32, 1)?;
    let (test_images, test_labels) = noisy_templates(backend, 512, 32, 2)?;
    println!(
        "\nAccuracy: a ViT of 4 blocks of width 256 learns 10 noisy templates (noise {NOISE}× \
         their amplitude), Adam lr 1e-4, batch {batch}, {steps} steps\n"
    );
    println!(
        "{:<28} {:>20} {:>10} {:>14} {:>10}",
        "setting", "train loss (last 20)", "vs plain", "held-out loss", "vs plain"
    );
    let mut plain: Option<(f64, f64)> = None;
    let runs = std::iter::once(Setting {
        label: "no compression",
        runner: None,
    })
    .chain(compressed_settings());
    for setting in runs {
        let mut model =
            VisionTransformer::new(backend, config, DType::F32, &Arc::new(Generator::new(0)))?;
        model.set_block_runner(setting.runner.clone());
        let adam = AdamConfig {
            lr: 1e-4,
            ..AdamConfig::adam()
        };
        let mut optimizer = Adam::new(
            vec![ParamGroup::new(model.parameters(), adam)],
            Implementation::Fused,
        )?;
        let mut last = Vec::new();
        for step in 0..steps {
            let images = train_images.narrow(0, step * batch, batch)?;
            let labels = train_labels.narrow(0, step * batch, batch)?;
            let loss = cross_entropy(&model.forward(&images)?, &labels, -100, Reduction::Mean)?;
            loss.backward()?;
            optimizer.step()?;
            optimizer.zero_grad(true)?;
            if step >= steps - 20 {
                last.push(loss.item()?);
            }
        }
        let train = last.iter().sum::<f64>() / last.len() as f64;
        let test = {
            let _no_grad = no_grad();
            cross_entropy(
                &model.forward(&test_images)?,
                &test_labels,
                -100,
                Reduction::Mean,
            )?
            .item()?
        };
        let (base_train, base_test) = *plain.get_or_insert((train, test));
        println!(
            "{:<28} {:>20.5} {:>+9.3}% {:>14.5} {:>+9.3}%",
            setting.label,
            train,
            100.0 * (train / base_train - 1.0),
            test,
            100.0 * (test / base_test - 1.0)
        );
    }
    Ok(())
}
