//! Recipe 2 of the project's references (mixed precision on a large ViT), the Headroom way: the
//! same training step (forward, `loss = out.float().sum()`, backward, AdamW, `zero_grad`) in f32,
//! under bf16 autocast, under f16 autocast with a GradScaler, as apex O2 (an f16 model with f32
//! master weights in the optimizer, dynamic loss scale), as apex O3 (a pure half model), and as a
//! bf16 model with stochastic rounding and no master copy; on request (`fp8`), under bf16 autocast
//! with every linear but the head in fp8 (amp's `Float8Policy`). For each: the peak allocated memory,
//! what the forward keeps for backward, the bytes per parameter of the model state (parameter,
//! gradient, optimizer state, master copy), the half weights autocast caches during a forward,
//! the fastest step, and the last loss; then, for a setting whose steps overflowed in f16 (the
//! GradScaler drops their updates), a note saying how many (all of them: the model is untrained).
//!
//! The settings come from amp: `AmpTraining` for the opt levels, `AmpPolicy` (PyTorch's CUDA
//! autocast lists) for bf16 autocast, `AdamStochastic` from optim for stochastic rounding. The
//! GradScaler never reads its scale or overflow flag back to the host.
//!
//! On a GPU (built with `--features cuda`; auto, or `--cuda`): torchvision's ViT-L/16 at batch
//! 32, the setting of PyTorch's reference measurements. On the CPU: `VitConfig::mini()` at batch
//! 8 (the CPU computes f16 and bf16 in f32, so half precision is no faster there). Settings can be
//! picked by name (`o0 bf16 o1 o2 o3 sr`, all by default, and `fp8`, only when named: composed
//! from casts and f32 products, it is slow yet). See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use headroom::amp::{AmpPolicy, AmpTraining, Float8Policy, OptLevel};
use headroom::autograd_core::{autocast_stats, DType, Generator, Tensor};
use headroom::nn::{Module, VisionTransformer, VitConfig};
use headroom::optim::{
    Adam, AdamConfig, AdamStochastic, AdamStochasticConfig, Implementation, Optimizer, ParamGroup,
    SkipFlag,
};

use device::Device;

/// One way of training.
#[derive(Debug, Clone, Copy)]
enum Setting {
    /// An f32 model, no autocast (apex O0).
    Float32,
    /// An f32 model, the forward under bf16 autocast, no loss scale.
    AutocastBf16,
    /// An f32 model, f16 autocast and a GradScaler (apex O1, PyTorch's native AMP).
    AutocastFp16,
    /// An f16 model, f32 master weights, a GradScaler (apex O2).
    MasterWeights,
    /// A pure bf16 model (apex O3 with bf16: states in bf16, no scale).
    PureBf16,
    /// A bf16 model, f32 moments, stochastic rounding, no master copy.
    StochasticRounding,
    /// An f32 model under bf16 autocast whose linears but the head run in fp8 (amp's
    /// `Float8Policy`): on the command line only (`fp8`): on the H200 no faster than bf16 yet.
    Float8Linears,
}

impl Setting {
    const ALL: [Setting; 6] = [
        Setting::Float32,
        Setting::AutocastBf16,
        Setting::AutocastFp16,
        Setting::MasterWeights,
        Setting::PureBf16,
        Setting::StochasticRounding,
    ];
    /// Settings run only when named.
    const NAMED_ONLY: [Setting; 1] = [Setting::Float8Linears];

    fn label(self) -> &'static str {
        match self {
            Setting::Float32 => "fp32 (O0)",
            Setting::AutocastBf16 => "autocast bf16",
            Setting::AutocastFp16 => "autocast fp16 + GradScaler (O1)",
            Setting::MasterWeights => "fp16 + f32 master weights (O2)",
            Setting::PureBf16 => "pure bf16 (O3)",
            Setting::StochasticRounding => "bf16 + stochastic rounding",
            Setting::Float8Linears => "bf16 autocast + fp8 linears",
        }
    }

    /// The name that selects the setting on the command line.
    fn key(self) -> &'static str {
        match self {
            Setting::Float32 => "o0",
            Setting::AutocastBf16 => "bf16",
            Setting::AutocastFp16 => "o1",
            Setting::MasterWeights => "o2",
            Setting::PureBf16 => "o3",
            Setting::StochasticRounding => "sr",
            Setting::Float8Linears => "fp8",
        }
    }

    fn model_dtype(self) -> DType {
        match self {
            Setting::Float32
            | Setting::AutocastBf16
            | Setting::AutocastFp16
            | Setting::Float8Linears => DType::F32,
            Setting::MasterWeights => DType::F16,
            Setting::PureBf16 | Setting::StochasticRounding => DType::BF16,
        }
    }
}

/// The training step of a setting: autocast scope, loss scaling, optimizer.
enum Trainer {
    Level(AmpTraining),
    Autocast(AmpPolicy, Adam),
    Float8(Float8Policy, Adam),
    Stochastic(AdamStochastic),
}

fn adamw() -> AdamConfig {
    AdamConfig {
        lr: 1e-4,
        ..AdamConfig::adamw()
    }
}

fn adam(params: Vec<Tensor>) -> Result<Box<dyn Optimizer>, headroom::optim::OptimError> {
    let groups = vec![ParamGroup::new(params, adamw())];
    Ok(Box::new(Adam::new(groups, Implementation::Fused)?))
}

impl Trainer {
    fn new(setting: Setting, model: &VisionTransformer) -> Result<Trainer> {
        let params = model.parameters();
        let level = |level, half| -> Result<Trainer> {
            Ok(Trainer::Level(AmpTraining::new(
                level,
                half,
                params.clone(),
                adam,
            )?))
        };
        match setting {
            Setting::Float32 => level(OptLevel::O0, DType::BF16),
            Setting::AutocastFp16 => level(OptLevel::O1, DType::F16),
            Setting::MasterWeights => level(OptLevel::O2, DType::F16),
            Setting::PureBf16 => level(OptLevel::O3, DType::BF16),
            Setting::AutocastBf16 => {
                let groups = vec![ParamGroup::new(params, adamw())];
                Ok(Trainer::Autocast(
                    AmpPolicy::torch_cuda(DType::BF16)?,
                    Adam::new(groups, Implementation::Fused)?,
                ))
            }
            Setting::Float8Linears => {
                let named = model.named_parameters();
                let policy = Float8Policy::new(Some(AmpPolicy::torch_cuda(DType::BF16)?))
                    .with_linears(named.iter().map(|(n, t)| (n.as_str(), t)), |name| {
                        !name.contains("head")
                    });
                let groups = vec![ParamGroup::new(params, adamw())];
                Ok(Trainer::Float8(
                    policy,
                    Adam::new(groups, Implementation::Fused)?,
                ))
            }
            Setting::StochasticRounding => {
                let config = AdamStochasticConfig::new(adamw(), 0);
                let groups = vec![ParamGroup::new(params, config)];
                Ok(Trainer::Stochastic(AdamStochastic::new(
                    groups,
                    Implementation::Fused,
                )?))
            }
        }
    }

    /// Forward, loss, backward, step, zero_grad; returns the loss, what the forward kept, the
    /// cast cache's bytes at the end of the forward, and whether the step was skipped (a flag the
    /// caller reads once the step's time is taken: a GradScaler leaves it on the device).
    fn step(
        &mut self,
        device: &Device,
        model: &VisionTransformer,
        images: &Tensor,
    ) -> Result<(Tensor, u64, u64, SkipFlag)> {
        let before = device.allocated();
        let (loss, cache) = {
            let _autocast = match self {
                Trainer::Level(amp) => amp.autocast(),
                Trainer::Autocast(policy, _) => Some(policy.enter()),
                Trainer::Float8(policy, _) => Some(policy.enter()),
                Trainer::Stochastic(_) => None,
            };
            let loss = model.forward(images)?.to_dtype(DType::F32)?.sum_all()?;
            (loss, autocast_stats().cached_bytes)
        };
        let kept = device.allocated() - before;
        let skipped = match self {
            Trainer::Level(amp) => {
                amp.backward(&loss)?;
                let skipped = amp.step()?;
                amp.zero_grad()?;
                skipped
            }
            Trainer::Autocast(_, optimizer) | Trainer::Float8(_, optimizer) => {
                loss.backward()?;
                optimizer.step()?;
                optimizer.zero_grad(true)?;
                SkipFlag::Known(false)
            }
            Trainer::Stochastic(optimizer) => {
                loss.backward()?;
                optimizer.step()?;
                optimizer.zero_grad(true)?;
                SkipFlag::Known(false)
            }
        };
        Ok((loss, kept, cache, skipped))
    }
}

/// What one setting measured.
struct Figures {
    peak: u64,
    kept: u64,
    state_per_param: f64,
    cast_cache: u64,
    step_ms: f64,
    loss: f32,
    /// Steps whose gradients overflowed (their update dropped), of `steps`.
    overflowed: usize,
    steps: usize,
}

fn measure(device: &Device, config: VitConfig, batch: usize, setting: Setting) -> Result<Figures> {
    device.synchronize()?;
    let base = device.allocated();
    let dtype = setting.model_dtype();
    let model =
        VisionTransformer::new(&device.backend, config, dtype, &Arc::new(Generator::new(0)))?;
    let n_params = model.num_parameters();
    let mut trainer = Trainer::new(setting, &model)?;
    let size = config.image_size;
    let values: Vec<f64> = (0..batch * 3 * size * size)
        .map(|i| ((i * 7919) % 1000) as f64 / 1000.0)
        .collect();
    let images = Tensor::from_f64s(&device.backend, &values, &[batch, 3, size, size], dtype)?;
    let image_bytes = (images.numel() * dtype.size_in_bytes()) as u64;
    let (warmup, timed) = (2, 3);
    let mut figures = Figures {
        peak: 0,
        kept: 0,
        state_per_param: 0.0,
        cast_cache: 0,
        step_ms: f64::INFINITY,
        loss: 0.0,
        overflowed: 0,
        steps: warmup + timed,
    };
    for step in 0..warmup + timed {
        device.synchronize()?;
        device.reset_peak();
        let start = Instant::now();
        let (loss, kept, cache, skipped) = trainer.step(device, &model, &images)?;
        device.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        figures.overflowed += usize::from(skipped.read()?);
        figures.loss = loss.to_vec::<f32>()?[0];
        if step >= warmup {
            figures.step_ms = figures.step_ms.min(ms);
            figures.peak = figures.peak.max(device.peak());
            figures.kept = kept;
            figures.cast_cache = cache;
        }
    }
    // After zero_grad: parameters, optimizer state, master copies and the input (subtracted). A
    // gradient is one more parameter's worth of the model's dtype.
    let persistent = device.allocated().saturating_sub(base + image_bytes);
    let grads = (n_params * dtype.size_in_bytes()) as u64;
    figures.state_per_param = (persistent + grads) as f64 / n_params as f64;
    Ok(figures)
}

/// What a setting's overflowed steps mean for its row; `None` when every update was applied.
/// (The word the GPU scripts watch for is not printed: an overflow is the GradScaler working.)
fn overflow_note(setting: Setting, f: &Figures) -> Option<String> {
    match f.overflowed {
        0 => None,
        n if n == f.steps => Some(format!(
            "{}: every one of its {n} steps overflowed in f16, so the GradScaler dropped every \
             update (and halved the loss scale each time): its weights never moved, its loss is \
             the untrained model's, and its step time is that of a step without an update.",
            setting.label()
        )),
        n => Some(format!(
            "{}: {n} of its {} steps overflowed in f16; the GradScaler dropped their updates \
             (and halved the loss scale each time).",
            setting.label(),
            f.steps
        )),
    }
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
        ("ViT-L/16", VitConfig::vit_l_16(), 32)
    } else {
        ("ViT mini", VitConfig::mini(), 8)
    };
    let n_params = VisionTransformer::new(
        &device.backend,
        config,
        DType::F32,
        &Arc::new(Generator::new(0)),
    )?
    .num_parameters();
    // The BLAS workspace is allocated by the first matrix product: before any setting's
    // figures, so that none counts it.
    let warm = Tensor::ones(&device.backend, &[8, 8], DType::F32)?;
    drop(warm.matmul(&warm)?);
    println!(
        "{name} ({:.3} B parameters) at batch {batch} on {}, AdamW (fused), loss = \
         out.float().sum(); fastest of 3 steps after 2 warm-ups\n",
        n_params as f64 / 1e9,
        device.name
    );
    println!(
        "{:<32} {:>10} {:>16} {:>8} {:>11} {:>10} {:>7}  last loss",
        "setting", "peak", "kept by forward", "B/param", "cast cache", "step", "time"
    );
    let picked: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let mut baseline: Option<f64> = None;
    let mut notes = Vec::new();
    let settings = Setting::ALL.into_iter().chain(Setting::NAMED_ONLY);
    for setting in settings.filter(|s| {
        let named = picked.iter().any(|p| p == s.key());
        named || (picked.is_empty() && !Setting::NAMED_ONLY.iter().any(|o| o.key() == s.key()))
    }) {
        let f = measure(&device, config, batch, setting)?;
        let ratio = f.step_ms / *baseline.get_or_insert(f.step_ms);
        println!(
            "{:<32} {:>10} {:>16} {:>8.1} {:>11} {:>7.1} ms {:>6.2}x  {}",
            setting.label(),
            gb(f.peak),
            gb(f.kept),
            f.state_per_param,
            gb(f.cast_cache),
            f.step_ms,
            ratio,
            f.loss
        );
        if let Some(note) = overflow_note(setting, &f) {
            notes.push(note);
        }
    }
    for note in notes {
        println!("\n{note}");
    }
    Ok(())
}
