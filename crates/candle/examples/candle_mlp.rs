//! A candle training loop that swaps its optimizer: the same two-layer network on the same batch,
//! 100 steps with `candle_nn::AdamW`, then with Headroom's `AdamW` and `AdamW8bit` (all three
//! `candle_nn::Optimizer`s), printing each one's mean step time, the bytes of state it keeps and
//! its loss at steps 1, 10 and 100. On the CPU; `--help` says so.

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use headroom_candle::{Adam8bitConfig, AdamConfig, AdamW, AdamW8bit};

const STEPS: usize = 100;

fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!(
            "candle_mlp: 100 AdamW steps of a 256-512-64 network on candle's CPU device with \
             candle_nn::AdamW, headroom_candle::AdamW and headroom_candle::AdamW8bit; prints \
             step time, optimizer state bytes and losses. No options."
        );
        return Ok(());
    }
    let device = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (64, 256), &device)?;
    let y = Tensor::randn(0f32, 1.0, (64, 64), &device)?;
    let init = [
        Tensor::randn(0f32, 0.05, (512, 256), &device)?,
        Tensor::randn(0f32, 0.05, (64, 512), &device)?,
    ];
    let weights =
        || -> Result<[Var; 2]> { Ok([Var::from_tensor(&init[0])?, Var::from_tensor(&init[1])?]) };
    let loss_of = |w: &[Var; 2]| -> Result<Tensor> {
        let h = x.matmul(&w[0].as_tensor().t()?)?.relu()?;
        Ok((h.matmul(&w[1].as_tensor().t()?)? - &y)?
            .sqr()?
            .mean_all()?)
    };
    println!(
        "{:<28} {:>10} {:>12} {:>10} {:>10} {:>10}",
        "optimizer", "ms/step", "state bytes", "loss 1", "loss 10", "loss 100"
    );
    for name in [
        "candle_nn::AdamW",
        "headroom_candle::AdamW",
        "headroom_candle::AdamW8bit",
    ] {
        let w = weights()?;
        let mut optimizer = Choice::new(name, w.to_vec(), 1e-3)?;
        let mut losses = Vec::new();
        let start = Instant::now();
        for _ in 0..STEPS {
            let loss = loss_of(&w)?;
            losses.push(loss.to_scalar::<f32>()?);
            optimizer.backward_step(&loss)?;
        }
        let ms = start.elapsed().as_secs_f64() * 1e3 / STEPS as f64;
        let state = optimizer.state_bytes(&w);
        println!(
            "{name:<28} {ms:>10.2} {state:>12} {:>10.3e} {:>10.3e} {:>10.3e}",
            losses[0],
            losses[9],
            losses[STEPS - 1]
        );
    }
    println!(
        "\ncandle's AdamW keeps two moments of the weights' dtype as Vars and allocates a tensor \
         per operation each step; Headroom's steps each Var in place in one fused pass (AdamW8bit: \
         one byte a moment and a scale per 256 for tensors from 4096 elements)."
    );
    Ok(())
}

/// One of the three optimizers under comparison.
enum Choice {
    Candle(candle_nn::AdamW),
    Headroom(AdamW),
    Headroom8bit(AdamW8bit),
}

impl Choice {
    /// The optimizer named `name` over `vars`, AdamW at `lr` with its other defaults.
    fn new(name: &str, vars: Vec<Var>, lr: f64) -> Result<Choice> {
        Ok(match name {
            "candle_nn::AdamW" => {
                let params = candle_nn::ParamsAdamW {
                    lr,
                    ..Default::default()
                };
                Choice::Candle(candle_nn::AdamW::new(vars, params)?)
            }
            "headroom_candle::AdamW" => {
                let config = AdamConfig {
                    lr,
                    ..AdamConfig::adamw()
                };
                Choice::Headroom(AdamW::new(vars, config)?)
            }
            _ => {
                let config = Adam8bitConfig {
                    lr,
                    ..Adam8bitConfig::adamw()
                };
                Choice::Headroom8bit(AdamW8bit::new(vars, config)?)
            }
        })
    }

    fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        match self {
            Choice::Candle(opt) => opt.backward_step(loss)?,
            Choice::Headroom(opt) => opt.backward_step(loss)?,
            Choice::Headroom8bit(opt) => opt.backward_step(loss)?,
        }
        Ok(())
    }

    /// The bytes of state kept for `w`: candle's two moments `Var`s of the weights' f32, or
    /// what Headroom's optimizer reports.
    fn state_bytes(&self, w: &[Var; 2]) -> u64 {
        match self {
            Choice::Candle(_) => w.iter().map(|v| 8 * v.elem_count() as u64).sum(),
            Choice::Headroom(opt) => opt.state_bytes(),
            Choice::Headroom8bit(opt) => opt.state_bytes(),
        }
    }
}
