//! Recipe 2 of the project's references (checkpointing a 1B-parameter ViT), the Headroom way:
//! the same training step without checkpointing, with every encoder block checkpointed, with
//! every second block, with selective checkpointing (each block keeps what its matrix products
//! saved and recomputes the rest), and with the planner's choice per block for a memory budget,
//! printing for each the peak allocated memory, what the forward keeps for backward, and the step
//! time; then the plan's table.
//!
//! Blocks are checkpointed without editing the model: a `CheckpointBlocks` becomes the encoder's
//! block runner. Unlike `torch.utils.checkpoint`'s reentrant form, the input needs no
//! `requires_grad`, and recomputed dropout draws the forward's masks (the model here has dropout
//! 0.1, so the last step's loss is printed too: with and without checkpointing it is the same
//! to the bit).
//!
//! The planner (`BlockPlanner`) measures one training step with every block kept and one with
//! every block recomputed, then picks per block the fastest step whose predicted peak fits the
//! budget: here halfway between the lowest peak it can reach and the peak without
//! checkpointing.
//!
//! On a GPU (built with `--features cuda`; auto, or `--cuda`): a ViT-g/14-sized model (40 blocks
//! of width 1408, 1.0 B parameters, f32) at batch 16 with SGD and `loss = out.sum()`, the recipe's
//! setting (its figures are fp16; mixed precision arrives with the amp crate). On the CPU:
//! `VitConfig::mini()` at batch 16. See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use headroom::autograd_core::{DType, Generator, Tensor};
use headroom::checkpoint::{
    BlockPlan, BlockPlanner, BlockSelection, Candidate, CheckpointBlocks, CheckpointOptions,
    SaveMatmuls, StepProbe,
};
use headroom::nn::{BlockRunner, Module, VisionTransformer, VitConfig};
use headroom::ops_cpu::CpuBackend;
use headroom::optim::kernels::SgdConfig;
use headroom::optim::{Implementation, Optimizer, ParamGroup, Sgd};

use device::Device;

/// One way of running the blocks.
struct Setting {
    label: &'static str,
    runner: Option<Arc<dyn BlockRunner>>,
}

fn settings() -> Vec<Setting> {
    let every = |selection| -> Arc<dyn BlockRunner> {
        Arc::new(CheckpointBlocks {
            selection,
            options: CheckpointOptions::default(),
        })
    };
    vec![
        Setting {
            label: "no checkpointing",
            runner: None,
        },
        Setting {
            label: "checkpoint every block",
            runner: Some(every(BlockSelection::All)),
        },
        Setting {
            label: "checkpoint every 2nd block",
            runner: Some(every(BlockSelection::Every(2))),
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
    ]
}

/// What one setting measured.
struct Figures {
    peak: u64,
    kept: u64,
    step_ms: f64,
    loss: f32,
}

/// A model, its SGD optimizer and its input: one training step at a time.
struct Training {
    model: VisionTransformer,
    sgd: Sgd,
    images: Tensor,
}

impl Training {
    fn new(device: &Device, config: VitConfig, batch: usize) -> Result<Training> {
        let model = VisionTransformer::new(
            &device.backend,
            config,
            DType::F32,
            &Arc::new(Generator::new(0)),
        )?;
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
        Ok(Training { model, sgd, images })
    }

    /// Forward, backward, step, `zero_grad(set_to_none)`; the loss, and what the forward kept.
    fn step(&mut self, device: &Device) -> Result<(Tensor, u64)> {
        let before = device.allocated();
        let loss = self.model.forward(&self.images)?.sum_all()?;
        let kept = device.allocated() - before;
        loss.backward()?;
        self.sgd.step()?;
        self.sgd.zero_grad(true)?;
        Ok((loss, kept))
    }
}

fn measure(device: &Device, config: VitConfig, batch: usize, setting: &Setting) -> Result<Figures> {
    let mut training = Training::new(device, config, batch)?;
    training.model.encoder.block_runner = setting.runner.clone();
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
        let (loss, kept) = training.step(device)?;
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

/// The planner's probe of the example's device: its allocator, and CUDA events or the host clock.
fn step_probe(device: &Device) -> Result<StepProbe> {
    let any = device.backend.clone().into_any();
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = any.clone().downcast::<headroom::ops_cuda::CudaBackend>() {
        return Ok(StepProbe::cuda(&cuda));
    }
    match any.downcast::<CpuBackend>() {
        Ok(cpu) => Ok(StepProbe::host(cpu, CpuBackend::allocator)),
        Err(_) => bail!("the planner's probe knows the CPU and CUDA backends"),
    }
}

/// Measures a step with every block kept and one with every block recomputed, and plans for
/// halfway between the lowest peak a plan reaches and the peak without checkpointing.
fn plan_for_budget(device: &Device, config: VitConfig, batch: usize) -> Result<BlockPlan> {
    let mut training = Training::new(device, config, batch)?;
    let planner = BlockPlanner::new(step_probe(device)?, Candidate::defaults());
    training.model.encoder.block_runner = Some(planner.runner());
    let profile = planner.profile(|| {
        training.step(device)?;
        Ok(())
    })?;
    let lowest = profile.min_budget()?;
    let keep = profile.candidate_index("keep").unwrap_or(0);
    let keep_all = profile.predict(&vec![keep; profile.n_blocks()])?.peak_bytes;
    Ok(profile.plan(lowest + (keep_all - lowest) / 2)?)
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
    let plan = plan_for_budget(&device, config, batch)?;
    let mut settings = settings();
    settings.push(Setting {
        label: "planned for a budget",
        runner: Some(Arc::new(plan.clone())),
    });
    let mut baseline: Option<Figures> = None;
    for setting in settings {
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
    println!(
        "\nthe plan, from one measured step with every block kept and one with every block \
         recomputed:\n{plan}"
    );
    Ok(())
}
