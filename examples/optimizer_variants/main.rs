//! The optimizer tutorial's first finding, measured with Headroom: the memory one ViT training
//! step peaks at with Adam computed foreach as PyTorch does (temporaries for every parameter at
//! once), foreach with bounded temporaries, one tensor at a time, fused, and with bitsandbytes'
//! 8-bit blockwise state — plus plain SGD for scale, fused Adam on the whole model in bf16
//! (bf16 parameters, gradients and moments, f32 arithmetic), and torchao's 4-bit AdamW on the
//! bf16 model with no master copy (stochastic rounding), and AdamW on the bf16 model with its
//! state in host memory, stepped by the host (`OffloadedAdam`), and the 4-bit AdamW with its
//! state in host memory between steps, streamed through the GPU (`StreamedOptimizer`; on the CPU
//! it is the 4-bit optimizer itself).
//!
//! Each variant gets a fresh model and optimizer and runs three steps (forward, loss =
//! `out.sum()`, backward, `step()`, `zero_grad(set_to_none)`). Printed per variant: the peak
//! allocated over the three steps, the optimizer state (what the first `step()` allocated and
//! kept) and the step's transient (the last `step()`'s peak minus what stays after it). On the
//! CPU the model is `VitConfig::mini()` at batch 1; on a GPU (built with `--features cuda`; auto,
//! or `--cuda`) torchvision's ViT-L/16 at batch 1, the tutorial's setting. See README.md.

#[path = "../device/mod.rs"]
mod device;

use std::sync::Arc;

use anyhow::Result;
use headroom::autograd_core::{DType, Generator, Tensor};
use headroom::nn::{Module, VisionTransformer, VitConfig};
use headroom::optim::kernels::Bf16Rounding;
use headroom::optim::{
    Adam, Adam4bit, Adam4bitConfig, Adam8bit, Adam8bitConfig, AdamConfig, Implementation,
    OffloadConfig, OffloadedAdam, Optimizer, ParamGroup, Sgd, SgdConfig, StreamedOptimizer,
    DEFAULT_STATE_STREAM_BYTES,
};

use device::Device;

/// The optimizer a variant builds.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Adam (lr 1e-4) with this implementation.
    Adam(Implementation),
    /// bitsandbytes' Adam8bit (lr 1e-4).
    Adam8bit,
    /// SGD (lr 1e-3, no momentum), fused.
    Sgd,
    /// Fused Adam (lr 1e-4) on the whole model in bf16: parameters, gradients and both moments
    /// in bf16, the update computed in f32 (PyTorch's `model.bfloat16()` with fused Adam).
    AdamBf16,
    /// torchao's 4-bit AdamW (lr 1e-4) on the bf16 model without a master copy, the parameters
    /// rounded stochastically (`AdamW4bit(bf16_stochastic_round=True)`).
    Adam4bitBf16,
    /// AdamW (lr 1e-4, f32 moments) on the bf16 model with its state in host memory, stepped by
    /// the host, the parameters rounded stochastically (`OffloadedAdam`).
    AdamwOffloadBf16,
    /// The 4-bit AdamW above with its state in pinned host memory between steps, streamed
    /// through the GPU (`StreamedOptimizer`).
    Adam4bitStreamedBf16,
}

impl Kind {
    /// The dtype of the model this variant trains.
    fn dtype(self) -> DType {
        match self {
            Kind::AdamBf16
            | Kind::Adam4bitBf16
            | Kind::AdamwOffloadBf16
            | Kind::Adam4bitStreamedBf16 => DType::BF16,
            _ => DType::F32,
        }
    }
}

/// The variants, in print order.
const VARIANTS: [(&str, Kind); 10] = [
    (
        "Adam, foreach (PyTorch's)",
        Kind::Adam(Implementation::ForeachUnbounded),
    ),
    (
        "Adam, foreach bounded (16 MiB)",
        Kind::Adam(Implementation::FOREACH),
    ),
    ("Adam, single tensor", Kind::Adam(Implementation::Single)),
    ("Adam, fused", Kind::Adam(Implementation::Fused)),
    ("Adam, 8-bit blockwise", Kind::Adam8bit),
    ("SGD, fused (no state)", Kind::Sgd),
    ("Adam, fused, bf16 model", Kind::AdamBf16),
    ("AdamW, 4-bit, bf16 model", Kind::Adam4bitBf16),
    ("AdamW, host state, bf16 model", Kind::AdamwOffloadBf16),
    ("AdamW, 4-bit streamed, bf16", Kind::Adam4bitStreamedBf16),
];

/// A variant's optimizer: any, or one with host state, whose host bytes the example reads.
enum Built {
    OnDevice(Box<dyn Optimizer>),
    Offloaded(Box<OffloadedAdam>),
    Streamed(Box<StreamedOptimizer<Adam4bitConfig>>),
}

impl Built {
    fn optimizer(&mut self) -> &mut dyn Optimizer {
        match self {
            Built::OnDevice(optimizer) => optimizer.as_mut(),
            Built::Offloaded(optimizer) => optimizer.as_mut(),
            Built::Streamed(optimizer) => optimizer.as_mut(),
        }
    }

    fn host_state_bytes(&self) -> u64 {
        match self {
            Built::OnDevice(_) => 0,
            Built::Offloaded(optimizer) => optimizer.host_state_bytes(),
            Built::Streamed(optimizer) => optimizer.host_state_bytes(),
        }
    }
}

fn optimizer(kind: Kind, params: Vec<Tensor>) -> Result<Built> {
    Ok(Built::OnDevice(match kind {
        Kind::AdamBf16 => {
            let config = AdamConfig {
                lr: 1e-4,
                ..AdamConfig::adam()
            };
            Box::new(Adam::new(
                vec![ParamGroup::new(params, config)],
                Implementation::Fused,
            )?)
        }
        Kind::Adam(implementation) => {
            let config = AdamConfig {
                lr: 1e-4,
                ..AdamConfig::adam()
            };
            Box::new(Adam::new(
                vec![ParamGroup::new(params, config)],
                implementation,
            )?)
        }
        Kind::Adam8bit => {
            let config = Adam8bitConfig {
                lr: 1e-4,
                ..Adam8bitConfig::adam()
            };
            let groups = vec![ParamGroup::new(params, config)];
            Box::new(Adam8bit::new(groups, Implementation::Fused)?)
        }
        Kind::Sgd => {
            let groups = vec![ParamGroup::new(params, SgdConfig::new(1e-3))];
            Box::new(Sgd::new(groups, Implementation::Fused)?)
        }
        Kind::Adam4bitBf16 => {
            let groups = vec![ParamGroup::new(params, adamw4bit())];
            Box::new(Adam4bit::new(groups, Implementation::Fused)?)
        }
        Kind::Adam4bitStreamedBf16 => {
            let groups = vec![ParamGroup::new(params, adamw4bit())];
            let streamed =
                StreamedOptimizer::new(groups, Implementation::Fused, DEFAULT_STATE_STREAM_BYTES)?;
            return Ok(Built::Streamed(Box::new(streamed)));
        }
        Kind::AdamwOffloadBf16 => {
            let adamw = AdamConfig {
                lr: 1e-4,
                ..AdamConfig::adamw()
            };
            let offloaded = OffloadedAdam::new(params, OffloadConfig::new(adamw))?;
            return Ok(Built::Offloaded(Box::new(offloaded)));
        }
    }))
}

/// torchao's 4-bit AdamW (lr 1e-4) rounding bf16 parameters stochastically.
fn adamw4bit() -> Adam4bitConfig {
    Adam4bitConfig {
        lr: 1e-4,
        bf16_rounding: Bf16Rounding::Stochastic { seed: 0 },
        ..Adam4bitConfig::adamw()
    }
}

/// What one variant measured.
struct Figures {
    peak: u64,
    state: u64,
    transient: u64,
    /// Optimizer state in host memory (the offloaded variant's).
    host_state: u64,
}

fn measure(device: &Device, config: VitConfig, kind: Kind) -> Result<Figures> {
    let model = VisionTransformer::new(
        &device.backend,
        config,
        kind.dtype(),
        &Arc::new(Generator::new(0)),
    )?;
    let mut built = optimizer(kind, model.parameters())?;
    let size = config.image_size;
    let images = Tensor::full(&device.backend, &[1, 3, size, size], 0.5, kind.dtype())?;
    let mut figures = Figures {
        peak: 0,
        state: 0,
        transient: 0,
        host_state: 0,
    };
    device.reset_peak();
    for step in 0..3 {
        model.forward(&images)?.sum_all()?.backward()?;
        figures.peak = figures.peak.max(device.peak());
        let before = device.allocated();
        device.reset_peak();
        built.optimizer().step()?;
        let after = device.allocated();
        if step == 0 {
            figures.state = after - before;
        }
        figures.transient = device.peak() - after;
        built.optimizer().zero_grad(true)?;
    }
    figures.peak = figures.peak.max(device.peak());
    figures.host_state = built.host_state_bytes();
    Ok(figures)
}

fn mb(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

fn main() -> Result<()> {
    let device = Device::from_args()?;
    let (name, config) = if device.is_cuda() {
        ("ViT-L/16", VitConfig::vit_l_16())
    } else {
        ("ViT mini", VitConfig::mini())
    };
    let n_params = VisionTransformer::new(
        &device.backend,
        config,
        DType::F32,
        &Arc::new(Generator::new(0)),
    )?
    .num_parameters() as u64;
    let mut results = Vec::new();
    for (label, kind) in VARIANTS {
        results.push((label, measure(&device, config, kind)?));
    }

    println!(
        "{name} ({n_params} parameters: {} of f32 weights, as many of gradients), batch 1, on {}; \
         three steps from a fresh optimizer each\n",
        mb(4 * n_params),
        device.name
    );
    println!(
        "{:<32} {:>10} {:>16} {:>15}",
        "variant", "peak", "optimizer state", "step transient"
    );
    for (label, f) in &results {
        println!(
            "{label:<32} {:>10} {:>16} {:>15}",
            mb(f.peak),
            mb(f.state),
            mb(f.transient)
        );
    }

    // In the order of `VARIANTS`.
    let figures = |idx: usize| &results[idx].1;
    let (foreach, single, fused, eight_bit) = (figures(0), figures(2), figures(3), figures(4));
    let (bf16, four_bit, offloaded, streamed) = (figures(6), figures(7), figures(8), figures(9));
    println!(
        "\nforeach as PyTorch computes it peaks {} above single-tensor Adam and {} above fused: \
         its temporaries span every parameter at once ({} here); fused needs none. 8-bit state \
         takes {} instead of {}, so 8-bit Adam peaks lowest of the f32 Adam variants: {}. \
         The bf16 model halves weights, gradients and moments alike: fused Adam peaks at {}; \
         with 4-bit states and no master copy, AdamW peaks at {} ({} of state); with its state \
         in host memory, at {} ({} of device state, {} of host state: the moments and a copy \
         of the weights); the 4-bit state streamed from host memory, at {} ({} of device state \
         between steps, {} of host state).",
        mb(foreach.peak.saturating_sub(single.peak)),
        mb(foreach.peak.saturating_sub(fused.peak)),
        mb(foreach.transient),
        mb(eight_bit.state),
        mb(fused.state),
        if foreach.peak > single.peak
            && foreach.peak > fused.peak
            && results[..4].iter().all(|(_, f)| eight_bit.peak < f.peak)
        {
            "the tutorial's finding, reproduced"
        } else {
            "NOT the tutorial's finding"
        },
        mb(bf16.peak),
        mb(four_bit.peak),
        mb(four_bit.state),
        mb(offloaded.peak),
        mb(offloaded.state),
        mb(offloaded.host_state),
        mb(streamed.peak),
        mb(streamed.state),
        mb(streamed.host_state)
    );
    Ok(())
}
