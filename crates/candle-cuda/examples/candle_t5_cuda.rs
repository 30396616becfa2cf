//! candle-transformers' T5 (`t5::T5ForConditionalGeneration`, encoder and decoder) trained on a
//! CUDA device for 100 steps with `candle_nn::AdamW`, then with Headroom's `AdamW` and
//! `AdamW8bit` from the same weights — the optimizer's constructor is the one line that
//! changes. Printed per optimizer: the mean device time of `Optimizer::step` (synchronised
//! before and after), the most bytes the step allocated on the device beyond what it kept
//! (candle allocates from the device's default memory pool, whose high-water mark is reset
//! before each step; Headroom's launch tables come from its own backend, counted too), the
//! state bytes, and the loss every 20 steps. Two sizes: T5 of width 128 (3 + 3 layers, 1.4 M
//! parameters) and of width 512 (6 + 6 layers, d_ff 2048); a byte vocabulary, batch 8, 48 tokens
//! in, 16 decoder tokens. `--json PATH` appends one JSON line per run; `--steps N`.

use std::collections::HashMap;
use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::{result, sys};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use candle_transformers::models::t5::{Config, T5ForConditionalGeneration};
use headroom_candle_cuda::{Adam8bitConfig, AdamConfig, AdamW, AdamW8bit};

const BATCH: usize = 8;
const SOURCE: usize = 48;
const PREFIX: usize = 16;
const LR: f64 = 1e-3;

fn config(width: usize, layers: usize) -> Config {
    Config {
        vocab_size: 256,
        d_model: width,
        d_kv: 64,
        d_ff: 4 * width,
        num_layers: layers,
        num_decoder_layers: Some(layers),
        num_heads: width / 64,
        use_cache: false,
        ..Config::default()
    }
}

/// Batch `step`: walks `t -> (5t + 17) mod 256`, so the next token is learnable.
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

enum Choice {
    Candle(candle_nn::AdamW),
    Headroom(AdamW),
    Headroom8bit(AdamW8bit),
}

impl Choice {
    /// The optimizer named `name`: the only line a candle user changes.
    fn new(name: &str, vars: Vec<Var>) -> Result<Choice> {
        Ok(match name {
            "candle_nn::AdamW" => Choice::Candle(candle_nn::AdamW::new(
                vars,
                candle_nn::ParamsAdamW {
                    lr: LR,
                    ..Default::default()
                },
            )?),
            "headroom_candle_cuda::AdamW" => Choice::Headroom(AdamW::new(
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

    /// State bytes: candle's two moment `Var`s of f32 per weight, or what ours report.
    fn state_bytes(&self, n_params: usize) -> u64 {
        match self {
            Choice::Candle(_) => 8 * n_params as u64,
            Choice::Headroom(opt) => opt.state_bytes(),
            Choice::Headroom8bit(opt) => opt.state_bytes(),
        }
    }
}

/// Device 0's default memory pool: bytes in use, and the most in use since the last call
/// (which resets the mark).
fn pool_bytes() -> Result<(u64, u64)> {
    // SAFETY: attribute reads and a reset on device 0's default pool while a candle CUDA
    // context is current; the out-pointers are u64s.
    unsafe {
        let device = result::device::get(0)?;
        let pool = result::device::get_default_mem_pool(device)?;
        let (mut used, mut high, mut zero) = (0u64, 0u64, 0u64);
        let current = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
        let mark = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        sys::cuMemPoolGetAttribute(pool, current, (&mut used as *mut u64).cast()).result()?;
        sys::cuMemPoolGetAttribute(pool, mark, (&mut high as *mut u64).cast()).result()?;
        sys::cuMemPoolSetAttribute(pool, mark, (&mut zero as *mut u64).cast()).result()?;
        Ok((used, high))
    }
}

struct Run {
    step_ms: f64,
    extra: u64,
    state: u64,
    losses: Vec<f32>,
    with_grads: usize,
}

fn train(
    name: &str,
    init: &HashMap<String, Tensor>,
    config: &Config,
    steps: usize,
    device: &Device,
) -> Result<Run> {
    let varmap = VarMap::new();
    let mut model = T5ForConditionalGeneration::load(
        VarBuilder::from_varmap(&varmap, DType::F32, device),
        config,
    )?;
    for (var_name, var) in varmap.data().lock().expect("varmap lock").iter() {
        var.set(
            &init
                .get(var_name)
                .context("a weight of the first model")?
                .to_device(device)?,
        )?;
    }
    let vars = varmap.all_vars();
    let n_params: usize = vars.iter().map(|v| v.elem_count()).sum();
    let mut optimizer = Choice::new(name, vars)?;
    let (mut seconds, mut extra, mut losses, mut with_grads) = (0.0, 0u64, Vec::new(), 0);
    for step in 0..steps {
        let (source, prefix, target) = batch(step, device)?;
        let logits = model.forward(&source, &prefix)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &target)?;
        losses.push(loss.to_scalar::<f32>()?);
        let grads = loss.backward()?;
        if step == 0 {
            with_grads = varmap
                .all_vars()
                .iter()
                .filter(|v| grads.get(v).is_some())
                .count();
        }
        device.synchronize()?;
        let (before, _) = pool_bytes()?;
        let start = Instant::now();
        optimizer.step(&grads)?;
        device.synchronize()?;
        let elapsed = start.elapsed().as_secs_f64();
        let (after, high) = pool_bytes()?;
        if step > 0 {
            // The first step allocates the state; later ones show the temporaries.
            seconds += elapsed;
            extra = extra.max(high.saturating_sub(before.max(after)));
        }
    }
    Ok(Run {
        step_ms: seconds * 1e3 / (steps - 1).max(1) as f64,
        extra,
        state: optimizer.state_bytes(n_params),
        losses,
        with_grads,
    })
}

fn main() -> Result<()> {
    let (mut steps, mut json) = (100usize, None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--help" | "-h" => {
                println!(
                    "candle_t5_cuda: candle-transformers' T5 (widths 128 and 512) trained on CUDA \
                     device 0 with candle_nn::AdamW, headroom_candle_cuda::AdamW and AdamW8bit \
                     from the same weights; prints each optimizer's step time, the device bytes \
                     its step allocates beyond its state, its state bytes and the loss every 20 \
                     steps.\n\nOptions: --steps N (default 100), --json PATH (append a JSON line \
                     per run)"
                );
                return Ok(());
            }
            "--steps" => {
                let value = args.next().context("--steps needs a number")?;
                steps = value
                    .parse()
                    .with_context(|| format!("--steps {value}: not a number"))?;
                if steps < 2 {
                    bail!("--steps {steps}: give at least two steps");
                }
            }
            "--json" => json = Some(args.next().context("--json needs a path")?),
            other => bail!("unknown argument {other}; see --help"),
        }
    }
    let device = Device::new_cuda(0).context("this example needs CUDA device 0")?;
    for (width, layers) in [(128, 3), (512, 6)] {
        let config = config(width, layers);
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
        println!("\nT5 width {width}, {layers} + {layers} layers: {n_params} parameters in {} weights, batch {BATCH}, {steps} steps on CUDA", init.len());
        println!(
            "{:<30} {:>9} {:>14} {:>12}  losses (every 20 steps)",
            "optimizer", "step ms", "step extra B", "state B"
        );
        let mut runs = Vec::new();
        for name in [
            "candle_nn::AdamW",
            "headroom_candle_cuda::AdamW",
            "headroom_candle_cuda::AdamW8bit",
        ] {
            let run = train(name, &init, &config, steps, &device)?;
            let shown: Vec<String> = (0..steps)
                .step_by(20)
                .chain([steps - 1])
                .map(|s| format!("{:.4}", run.losses[s]))
                .collect();
            println!(
                "{name:<30} {:>9.3} {:>14} {:>12}  {}",
                run.step_ms,
                run.extra,
                run.state,
                shown.join(" ")
            );
            if let Some(path) = &json {
                let mut file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?;
                writeln!(
                    file,
                    "{{\"model\": \"t5\", \"width\": {width}, \"layers\": {layers}, \"params\": {n_params}, \"weights_with_grads\": {}, \"steps\": {steps}, \"optimizer\": \"{name}\", \"step_ms\": {:.4}, \"step_extra_bytes\": {}, \"state_bytes\": {}, \"final_loss\": {}}}",
                    run.with_grads, run.step_ms, run.extra, run.state, run.losses[steps - 1]
                )?;
            }
            runs.push(run);
        }
        let (candle, fused, eight) = (&runs[0], &runs[1], &runs[2]);
        println!(
            "{} of {} weights get a gradient. Headroom's AdamW: {:.1}x faster than candle's step ({} against {} extra bytes); 8-bit AdamW: {:.1}x faster, {:.3}x candle's state bytes.",
            candle.with_grads,
            init.len(),
            candle.step_ms / fused.step_ms,
            fused.extra,
            candle.extra,
            candle.step_ms / eight.step_ms,
            eight.state as f64 / candle.state as f64
        );
    }
    Ok(())
}
