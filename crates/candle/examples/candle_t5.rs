//! A model none of us wrote: candle-transformers' T5 (`t5::T5ForConditionalGeneration`, encoder
//! and decoder), trained for 100 steps on the same batch stream with `candle_nn::AdamW`, then
//! with Headroom's `AdamW` and `AdamW8bit` — the one line that differs is the optimizer's
//! constructor. Printed per optimizer: the mean time of `Optimizer::step` alone (backward
//! excluded), the most bytes the step allocated on top of what it kept (every allocation of the
//! process is counted by this example's global allocator), the bytes of state it keeps, and the
//! loss every 20 steps. The model is a small T5 (width 128, 3 encoder and 3 decoder layers, a
//! byte vocabulary), batch 8: 48 tokens in, 16 decoder tokens, the next token as the target; on
//! candle's CPU device, every run from the same weights. T5 rather than candle-transformers'
//! Llama: candle 0.11's fused `RmsNorm` (which its Llama and Mistral use) has no backward, so
//! there only the head receives a gradient; T5's layer norm is written in differentiable ops.
//! `--help` says so; `--steps N` changes the step count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use candle_transformers::models::t5::{Config, T5ForConditionalGeneration};
use headroom_candle::{Adam8bitConfig, AdamConfig, AdamW, AdamW8bit};

/// Counts the bytes every allocation of the process holds, and their peak since the last reset.
struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to the system allocator with the caller's layout; the counters
// are plain atomics and never affect what is returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's (valid, non-zero) layout.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const BATCH: usize = 8;
/// Tokens the encoder reads.
const SOURCE: usize = 48;
/// Tokens the decoder reads; the token after them is the target.
const PREFIX: usize = 16;
const LR: f64 = 1e-3;

/// The small T5: a byte vocabulary, width 128, 3 + 3 layers of 4 heads, no key/value cache.
fn config() -> Config {
    Config {
        vocab_size: 256,
        d_model: 128,
        d_kv: 32,
        d_ff: 512,
        num_layers: 3,
        num_decoder_layers: Some(3),
        num_heads: 4,
        use_cache: false,
        ..Config::default()
    }
}

/// Batch `step`: `BATCH` rows, each a walk `t -> (5t + 17) mod 256` from a start drawn by step
/// and row, so the next token is learnable: encoder input, decoder input, target.
fn batch(step: usize, device: &Device) -> Result<(Tensor, Tensor, Tensor)> {
    let len = SOURCE + PREFIX + 1;
    let mut rows = Vec::with_capacity(BATCH * len);
    for row in 0..BATCH {
        let mut token = ((step * 31 + row * 7) % 256) as u32;
        for _ in 0..len {
            rows.push(token);
            token = (5 * token + 17) % 256;
        }
    }
    let tokens = Tensor::from_vec(rows, (BATCH, len), device)?;
    Ok((
        tokens.narrow(1, 0, SOURCE)?.contiguous()?,
        tokens.narrow(1, SOURCE, PREFIX)?.contiguous()?,
        tokens
            .narrow(1, SOURCE + PREFIX, 1)?
            .squeeze(1)?
            .contiguous()?,
    ))
}

/// One of the optimizers under comparison.
enum Choice {
    Candle(candle_nn::AdamW),
    Headroom(AdamW),
    Headroom8bit(AdamW8bit),
}

impl Choice {
    /// The optimizer named `name` over `vars`: the only line a candle user changes.
    fn new(name: &str, vars: Vec<Var>) -> Result<Choice> {
        Ok(match name {
            "candle_nn::AdamW" => Choice::Candle(candle_nn::AdamW::new(
                vars,
                candle_nn::ParamsAdamW {
                    lr: LR,
                    ..Default::default()
                },
            )?),
            "headroom_candle::AdamW" => Choice::Headroom(AdamW::new(
                vars,
                AdamConfig {
                    lr: LR,
                    ..AdamConfig::adamw()
                },
            )?),
            _ => Choice::Headroom8bit(AdamW8bit::new(
                vars,
                Adam8bitConfig {
                    lr: LR,
                    ..Adam8bitConfig::adamw()
                },
            )?),
        })
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        match self {
            Choice::Candle(opt) => opt.step(grads)?,
            Choice::Headroom(opt) => opt.step(grads)?,
            Choice::Headroom8bit(opt) => opt.step(grads)?,
        }
        Ok(())
    }

    /// The bytes of state kept: candle's two f32 moment `Var`s per weight, or what Headroom's
    /// optimizer reports.
    fn state_bytes(&self, n_params: usize) -> u64 {
        match self {
            Choice::Candle(_) => 8 * n_params as u64,
            Choice::Headroom(opt) => opt.state_bytes(),
            Choice::Headroom8bit(opt) => opt.state_bytes(),
        }
    }
}

/// What one optimizer's run measured.
struct Run {
    /// Weights candle's backward gave a gradient (the rest are never stepped).
    with_grads: usize,
    step_ms: f64,
    step_extra_bytes: usize,
    state_bytes: u64,
    losses: Vec<f32>,
}

/// `steps` steps of a fresh model holding `init`'s weights, stepped by `name`.
fn train(name: &str, init: &HashMap<String, Tensor>, config: &Config, steps: usize) -> Result<Run> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let mut model = T5ForConditionalGeneration::load(
        VarBuilder::from_varmap(&varmap, DType::F32, &device),
        config,
    )?;
    for (var_name, var) in varmap.data().lock().expect("varmap lock").iter() {
        let weights = init.get(var_name).context("a weight of the first model")?;
        var.set(weights)?;
    }
    let vars = varmap.all_vars();
    let n_params: usize = vars.iter().map(|v| v.elem_count()).sum();
    let mut optimizer = Choice::new(name, vars)?;
    let (mut step_s, mut extra, mut losses) = (0.0, 0usize, Vec::with_capacity(steps));
    let mut with_grads = 0;
    for step in 0..steps {
        let (source, prefix, target) = batch(step, &device)?;
        let logits = model.forward(&source, &prefix)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &target)?;
        losses.push(loss.to_scalar::<f32>()?);
        let grads = loss.backward()?;
        if step == 0 {
            let vars = varmap.all_vars();
            with_grads = vars.iter().filter(|v| grads.get(v).is_some()).count();
        }
        let before = CURRENT.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let start = Instant::now();
        optimizer.step(&grads)?;
        step_s += start.elapsed().as_secs_f64();
        let after = CURRENT.load(Ordering::Relaxed);
        extra = extra.max(PEAK.load(Ordering::Relaxed) - before.max(after));
    }
    Ok(Run {
        with_grads,
        step_ms: step_s * 1e3 / steps as f64,
        step_extra_bytes: extra,
        state_bytes: optimizer.state_bytes(n_params),
        losses,
    })
}

fn main() -> Result<()> {
    let mut steps = 100;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--help" | "-h" => {
                println!(
                    "candle_t5: candle-transformers' T5 (width 128, 3 + 3 layers, byte \
                     vocabulary, batch 8, CPU) trained with candle_nn::AdamW, \
                     headroom_candle::AdamW and headroom_candle::AdamW8bit from the same \
                     weights; prints each optimizer's step time, the bytes its step allocates \
                     on top of its state, its state bytes and the loss every 20 steps.\n\n\
                     Options: --steps N (default 100)"
                );
                return Ok(());
            }
            "--steps" => {
                let value = args.next().context("--steps needs a number")?;
                steps = value
                    .parse()
                    .with_context(|| format!("--steps {value}: not a number"))?;
                if steps == 0 {
                    bail!("--steps 0: give at least one step");
                }
            }
            other => bail!("unknown argument {other}; see --help"),
        }
    }
    let config = config();
    let init_map = VarMap::new();
    T5ForConditionalGeneration::load(
        VarBuilder::from_varmap(&init_map, DType::F32, &Device::Cpu),
        &config,
    )?;
    let init: HashMap<String, Tensor> = init_map
        .data()
        .lock()
        .expect("varmap lock")
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().copy().expect("a copy")))
        .collect();
    let n_params: usize = init.values().map(Tensor::elem_count).sum();
    println!(
        "T5, width 128, 3 + 3 layers ({n_params} parameters, {} weights), batch {BATCH} \
         ({SOURCE} tokens in, {PREFIX} decoder tokens, the next one predicted), CPU, {steps} \
         AdamW steps (lr {LR}) from the same weights\n",
        init.len()
    );
    let every: Vec<usize> = (0..steps).step_by(20).chain([steps - 1]).collect();
    let header: Vec<String> = every.iter().map(|s| format!("loss {}", s + 1)).collect();
    println!(
        "{:<28} {:>9} {:>14} {:>12}  {}",
        "optimizer",
        "step ms",
        "step extra B",
        "state B",
        header.join("  ")
    );
    let mut runs = Vec::new();
    for name in [
        "candle_nn::AdamW",
        "headroom_candle::AdamW",
        "headroom_candle::AdamW8bit",
    ] {
        let run = train(name, &init, &config, steps)?;
        let losses: Vec<String> = every
            .iter()
            .map(|&s| format!("{:>8.4}", run.losses[s]))
            .collect();
        println!(
            "{name:<28} {:>9.3} {:>14} {:>12}  {}",
            run.step_ms,
            run.step_extra_bytes,
            run.state_bytes,
            losses.join("  ")
        );
        runs.push(run);
    }
    let (candle, fused, eight_bit) = (&runs[0], &runs[1], &runs[2]);
    println!(
        "\ncandle's backward gives {} of the {} weights a gradient (its fused softmax has no \
         backward: queries, keys and the position bias get none); each optimizer steps those.\n\
         Headroom's AdamW steps in {:.2}x candle's time and allocates {} bytes on top of its \
         state where candle's step allocates {}; 8-bit AdamW keeps {:.3}x candle's state bytes.",
        candle.with_grads,
        init.len(),
        fused.step_ms / candle.step_ms,
        fused.step_extra_bytes,
        candle.step_extra_bytes,
        eight_bit.state_bytes as f64 / candle.state_bytes as f64
    );
    Ok(())
}
