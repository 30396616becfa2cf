//! Activation checkpointing on the CPU backend: training with checkpointed blocks gives the plain
//! loop's parameters bit for bit (dropout included), f64 gradients against finite differences,
//! exact saved bytes, early stop, nesting, and the typed errors for regions that cannot be
//! recomputed faithfully.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use headroom_autograd_core::{
    autocast, dropout, layer_norm, layer_norm_linear, AutocastPolicy, BackendRef, CastPolicy,
    DType, Device, Generator, Tensor,
};
use headroom_checkpoint::{
    block_forwards, checkpoint, checkpoint_sequential, checkpoint_with, BlockSelection,
    CheckpointBlocks, CheckpointError, CheckpointOptions, Decision, PolicyFn, RecomputeBefore,
    SaveMatmuls, SavePolicy,
};
use headroom_nn::{BlockStack, EncoderBlock, Gpt2Config, VitConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::{check_technique, ModelSpec, OptimSpec, Tolerance, TrainCase};

mod block_runner;
use block_runner::WithRunner;
use headroom_testkit::memory::allocated;

fn vit_with_dropout() -> ModelSpec {
    ModelSpec::Vit(VitConfig {
        dropout: 0.1,
        attention_dropout: 0.1,
        ..VitConfig::tiny()
    })
}

fn gpt2_with_dropout() -> ModelSpec {
    let mut config = Gpt2Config::tiny();
    config.embd_pdrop = 0.1;
    config.attn_pdrop = 0.1;
    config.resid_pdrop = 0.1;
    ModelSpec::Gpt2 { config, seq: 16 }
}

#[test]
fn checkpointed_training_equals_plain_training_bit_for_bit_with_dropout() {
    let cpu = CpuBackend::new_ref();
    let every_block = CheckpointBlocks::all();
    let selective = CheckpointBlocks {
        selection: BlockSelection::Every(2),
        options: CheckpointOptions {
            policy: Arc::new(SaveMatmuls),
            ..CheckpointOptions::default()
        },
    };
    let attention_half = CheckpointBlocks {
        selection: BlockSelection::All,
        options: CheckpointOptions {
            policy: Arc::new(RecomputeBefore::mlp()),
            ..CheckpointOptions::default()
        },
    };
    for (name, model) in [("vit", vit_with_dropout()), ("gpt2", gpt2_with_dropout())] {
        for blocks in [&every_block, &selective, &attention_half] {
            let case = TrainCase {
                name,
                model,
                dtype: DType::F32,
                batch: 2,
                steps: 3,
                optimizer: OptimSpec::adamw(1e-3, 1e-2),
                tolerance: Tolerance::Bitwise {
                    why: "the recompute replays the forward's ops and random draws on the same \
                          deterministic CPU kernels",
                },
                seed: 5,
            };
            let report = check_technique(&cpu, &case, &mut WithRunner(Arc::new(blocks.clone())))
                .unwrap_or_else(|err| panic!("{name} {:?}: {err}", blocks.selection));
            assert_eq!(report.max_ulps, 0);
            assert_eq!(report.baseline_losses, report.technique_losses);
        }
    }
}

fn f64_tensor(cpu: &BackendRef, values: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64s(cpu, values, shape, DType::F64).unwrap()
}

/// A region with a product, a norm, a softmax and pointwise ops, as a function of `x` and `w`.
fn region_ops(x: &Tensor, w: &Tensor) -> headroom_autograd_core::Result<Tensor> {
    let h = x.matmul(w)?.tanh()?;
    let n = layer_norm(&h, &[3], None, None, 1e-5)?;
    n.softmax(-1)?.mul(&h)?.exp()?.sum_all()
}

#[test]
fn checkpointed_gradients_match_finite_differences_in_f64() {
    let cpu = CpuBackend::new_ref();
    let xs: Vec<f64> = (0..8).map(|i| 0.3 * (i as f64).sin()).collect();
    let ws: Vec<f64> = (0..12).map(|i| 0.2 * (i as f64 * 0.7).cos()).collect();
    let x = f64_tensor(&cpu, &xs, &[2, 4]);
    let w = f64_tensor(&cpu, &ws, &[4, 3]);
    x.requires_grad_(true).unwrap();
    w.requires_grad_(true).unwrap();
    let loss = checkpoint(
        |inputs| Ok(vec![region_ops(&inputs[0], &inputs[1])?]),
        &[x.clone(), w.clone()],
    )
    .unwrap();
    loss[0].backward().unwrap();
    let value = |xs: &[f64], ws: &[f64]| {
        region_ops(
            &f64_tensor(&cpu, xs, &[2, 4]),
            &f64_tensor(&cpu, ws, &[4, 3]),
        )
        .unwrap()
        .item()
        .unwrap()
    };
    let eps = 1e-6;
    for (which, (values, grad)) in [(&xs, x.grad().unwrap()), (&ws, w.grad().unwrap())]
        .into_iter()
        .enumerate()
    {
        let grad = grad.to_vec_f64().unwrap();
        for i in 0..values.len() {
            let (mut plus, mut minus) = (values.clone(), values.clone());
            plus[i] += eps;
            minus[i] -= eps;
            let numeric = if which == 0 {
                (value(&plus, &ws) - value(&minus, &ws)) / (2.0 * eps)
            } else {
                (value(&xs, &plus) - value(&xs, &minus)) / (2.0 * eps)
            };
            assert!(
                (grad[i] - numeric).abs() <= 1e-7 * numeric.abs().max(1.0),
                "input {which} element {i}: {} vs {numeric}",
                grad[i]
            );
        }
    }
}

#[test]
fn only_the_inputs_stay_and_the_saved_bytes_are_exact() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::full(&cpu, &[1024], 0.01, DType::F32).unwrap();
    x.requires_grad_(true).unwrap();
    let chain = |x: &Tensor| -> headroom_autograd_core::Result<Tensor> {
        let mut y = x.clone();
        for _ in 0..8 {
            y = y.exp()?.mul_scalar(0.5)?;
        }
        Ok(y)
    };
    let before = allocated(&cpu);
    let plain = chain(&x).unwrap();
    // Each exp saves its output (4 KiB); every result of mul_scalar but the last is freed or
    // held only as the next exp's input, which exp does not save.
    assert_eq!(allocated(&cpu) - before, 8 * 4096 + 4096);
    plain.sum_all().unwrap().backward().unwrap();
    let expected = x.take_grad().unwrap().to_vec::<f32>().unwrap();
    drop(plain);
    let before = allocated(&cpu);
    let out = checkpoint(
        move |inputs| Ok(vec![chain(&inputs[0])?]),
        std::slice::from_ref(&x),
    )
    .unwrap();
    assert_eq!(allocated(&cpu) - before, 4096, "the output alone");
    out[0].sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), expected);
}

#[test]
fn inputs_need_not_require_grad() {
    let cpu = CpuBackend::new_ref();
    let x = f64_tensor(&cpu, &[0.1, 0.2, 0.3, 0.4], &[2, 2]);
    let w = f64_tensor(&cpu, &[1.0, -1.0, 0.5, 2.0], &[2, 2]);
    w.requires_grad_(true).unwrap();
    x.matmul(&w)
        .unwrap()
        .exp()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let expected = w.take_grad().unwrap().to_vec_f64().unwrap();
    let weight = w.clone();
    let y = checkpoint(
        move |inputs| Ok(vec![inputs[0].matmul(&weight)?.exp()?]),
        &[x],
    )
    .unwrap();
    y[0].sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64().unwrap(), expected);
}

#[test]
fn the_recompute_stops_after_the_last_save_backward_needs() {
    let cpu = CpuBackend::new_ref();
    let x = f64_tensor(&cpu, &[0.5, 1.5], &[2]);
    x.requires_grad_(true).unwrap();
    let reached_the_tail = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&reached_the_tail);
    let y = checkpoint(
        move |inputs| {
            let e = inputs[0].exp()?; // the region's one save
            counter.fetch_add(1, Ordering::SeqCst);
            Ok(vec![e.mul_scalar(3.0)?.add_scalar(1.0)?])
        },
        std::slice::from_ref(&x),
    )
    .unwrap();
    y[0].sum_all().unwrap().backward().unwrap();
    assert_eq!(reached_the_tail.load(Ordering::SeqCst), 1, "forward only");
    let grad = x.grad().unwrap().to_vec_f64().unwrap();
    assert_eq!(grad, [3.0 * 0.5f64.exp(), 3.0 * 1.5f64.exp()]);
}

#[test]
fn nested_checkpoints_give_the_plain_gradients() {
    let cpu = CpuBackend::new_ref();
    let x = f64_tensor(&cpu, &[0.1, -0.4, 0.9], &[3]);
    x.requires_grad_(true).unwrap();
    x.exp()
        .unwrap()
        .tanh()
        .unwrap()
        .exp()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let expected = x.take_grad().unwrap().to_vec_f64().unwrap();
    let y = checkpoint(
        |inputs| {
            let inner = checkpoint(|xs| Ok(vec![xs[0].exp()?.tanh()?]), &[inputs[0].clone()])
                .map_err(|err| headroom_autograd_core::TensorError::hook("inner", err))?;
            Ok(vec![inner[0].exp()?])
        },
        std::slice::from_ref(&x),
    )
    .unwrap();
    y[0].sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), expected);
}

#[test]
fn recomputed_dropout_draws_the_forwards_masks_and_leaves_the_generator_alone() {
    let cpu = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(11));
    let x = Tensor::full(&cpu, &[4096], 1.0, DType::F32).unwrap();
    x.requires_grad_(true).unwrap();
    let g = Arc::clone(&generator);
    let y = checkpoint(
        move |inputs| Ok(vec![dropout(&inputs[0].exp()?, 0.5, true, &g)?]),
        std::slice::from_ref(&x),
    )
    .unwrap();
    let after_forward = generator.state();
    y[0].sum_all().unwrap().backward().unwrap();
    assert_eq!(generator.state(), after_forward);
    // The gradient is e·2 where the forward kept the element, 0 where it dropped it.
    let kept: Vec<bool> = y[0]
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&v| v != 0.0)
        .collect();
    let grad = x.grad().unwrap().to_vec::<f32>().unwrap();
    let e = 1f32.exp() * 2.0;
    assert!(kept.iter().filter(|&&k| k).count() > 1800);
    for (i, (&k, &g)) in kept.iter().zip(&grad).enumerate() {
        assert_eq!(g, if k { e } else { 0.0 }, "element {i}");
    }
}

#[test]
fn checkpoint_sequential_equals_the_plain_chain() {
    let cpu = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(3));
    let config = VitConfig {
        num_layers: 4,
        ..VitConfig::tiny()
    };
    let vit = headroom_nn::VisionTransformer::new(&cpu, config, DType::F64, &generator).unwrap();
    let tokens = Tensor::from_f64s(
        &cpu,
        &(0..2 * 5 * 64)
            .map(|i| (i as f64 * 0.37).sin())
            .collect::<Vec<_>>(),
        &[2, 5, 64],
        DType::F64,
    )
    .unwrap();
    let blocks = block_forwards(&vit.encoder.layers, EncoderBlock::forward);
    let run = |out: Tensor| {
        out.sum_all().unwrap().backward().unwrap();
        let grads: Vec<Vec<f64>> = vit
            .encoder
            .layers
            .iter()
            .map(|b| b.ln_1.weight.take_grad().unwrap().to_vec_f64().unwrap())
            .collect();
        grads
    };
    let mut plain = tokens.clone();
    for block in &blocks {
        plain = block(&plain).unwrap();
    }
    let expected = run(plain);
    let options = CheckpointOptions::default();
    let out = checkpoint_sequential(&blocks, 2, &tokens, &options).unwrap();
    assert_eq!(run(out), expected);
    let err = checkpoint_sequential(&blocks, 5, &tokens, &options).unwrap_err();
    assert!(
        matches!(err, CheckpointError::InvalidArgument { .. }),
        "{err}"
    );
}

#[test]
fn a_region_that_cannot_be_recomputed_faithfully_is_a_typed_error() {
    let cpu = CpuBackend::new_ref();
    let x = f64_tensor(&cpu, &[0.5, 1.5], &[2]);
    x.requires_grad_(true).unwrap();

    // Writes its input in place.
    let y = x.mul_scalar(2.0).unwrap();
    let err = checkpoint(
        |inputs| {
            inputs[0].add_(&inputs[0].detach())?;
            Ok(vec![inputs[0].exp()?])
        },
        &[y.detach()],
    )
    .unwrap_err();
    assert!(
        matches!(err, CheckpointError::RegionWritesInput { input: 0 }),
        "{err}"
    );

    // Its input modified after the forward.
    let input = x.exp().unwrap();
    let out = checkpoint(
        |inputs| Ok(vec![inputs[0].tanh()?]),
        std::slice::from_ref(&input),
    )
    .unwrap();
    input.mul_(&f64_tensor(&cpu, &[2.0], &[1])).unwrap();
    let err = out[0].sum_all().unwrap().backward().unwrap_err();
    let err = CheckpointError::Tensor(err);
    assert!(err.to_string().contains("modified"), "{err}");

    // Another op on recompute.
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let out = checkpoint(
        move |inputs| {
            let first = counter.fetch_add(1, Ordering::SeqCst) == 0;
            Ok(vec![if first {
                inputs[0].exp()?
            } else {
                inputs[0].tanh()?
            }])
        },
        std::slice::from_ref(&x),
    )
    .unwrap();
    let err = out[0].sum_all().unwrap().backward().unwrap_err();
    assert!(
        err.to_string().contains("save 0 of the recomputed region"),
        "{err}"
    );

    // Other random draws on recompute.
    let generator = Arc::new(Generator::new(1));
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let out = checkpoint(
        move |inputs| {
            let first = counter.fetch_add(1, Ordering::SeqCst) == 0;
            if !first {
                generator.advance(7);
            }
            Ok(vec![dropout(&inputs[0], 0.5, true, &generator)?])
        },
        std::slice::from_ref(&x),
    )
    .unwrap();
    let err = out[0].sum_all().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("random numbers"), "{err}");
}

#[derive(Debug)]
struct MatmulInBf16;

impl AutocastPolicy for MatmulInBf16 {
    fn lower_precision(&self) -> DType {
        DType::BF16
    }

    fn cast_policy(&self, op: &'static str, _device: Device) -> CastPolicy {
        if op == "matmul" {
            CastPolicy::LowerPrecision
        } else {
            CastPolicy::Keep
        }
    }
}

#[test]
fn the_recompute_runs_under_the_forwards_autocast_policy() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::from_f64s(&cpu, &[0.25, -0.5, 1.0, 2.0], &[2, 2], DType::F32).unwrap();
    let w = Tensor::from_f64s(&cpu, &[0.5, 1.5, -1.0, 0.75], &[2, 2], DType::F32).unwrap();
    w.requires_grad_(true).unwrap();
    let plain = {
        let _scope = autocast(Arc::new(MatmulInBf16));
        x.matmul(&w).unwrap().tanh().unwrap()
    };
    plain
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let expected = w.take_grad().unwrap().to_vec::<f32>().unwrap();
    let weight = w.clone();
    let out = {
        let _scope = autocast(Arc::new(MatmulInBf16));
        checkpoint(
            move |inputs| Ok(vec![inputs[0].matmul(&weight)?.tanh()?]),
            std::slice::from_ref(&x),
        )
        .unwrap()
    };
    assert_eq!(out[0].dtype(), DType::BF16);
    out[0]
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), expected);
}

#[test]
fn a_policy_keeps_what_it_says_and_recomputes_the_rest() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::full(&cpu, &[1024], 0.01, DType::F32).unwrap();
    x.requires_grad_(true).unwrap();
    let keep_tanh = CheckpointOptions {
        policy: Arc::new(PolicyFn(|site: &headroom_autograd_core::SaveSite| {
            if site.op == "tanh" {
                Decision::Save
            } else {
                Decision::Recompute
            }
        })),
        ..CheckpointOptions::default()
    };
    let before = allocated(&cpu);
    let out = checkpoint_with(
        |inputs| Ok(vec![inputs[0].exp()?.tanh()?.exp()?.mul_scalar(2.0)?]),
        std::slice::from_ref(&x),
        &keep_tanh,
    )
    .unwrap();
    // The output and tanh's saved output stay; the two exps' outputs are dropped.
    assert_eq!(allocated(&cpu) - before, 2 * 4096);
    out[0].sum_all().unwrap().backward().unwrap();
    let grad = x.grad().unwrap().to_vec::<f32>().unwrap();
    let t = 0.01f32.exp().tanh();
    let expected = 2.0 * t.exp() * (1.0 - t * t) * 0.01f32.exp();
    assert!(
        (grad[0] - expected).abs() <= 1e-6 * expected,
        "{} vs {expected}",
        grad[0]
    );
}

/// Two norm-fed products with a pointwise op between, `y = lnl(tanh(lnl(x)))`, and the
/// gradients of its weights and input, as f32 bits; with `options`, checkpointed (`None`: plain).
/// Returns the bytes the forward kept too.
fn two_norm_products(options: Option<&CheckpointOptions>) -> (Vec<Vec<u32>>, i64) {
    let cpu = CpuBackend::new_ref();
    let leaf = |n: usize, scale: f32, shape: &[usize]| {
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * scale)
            .collect();
        let t = Tensor::from_slice(&cpu, &values, shape).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let (x, w1, w2) = (
        leaf(8 * 64, 2.0, &[8, 64]),
        leaf(64 * 64, 0.2, &[64, 64]),
        leaf(16 * 64, 0.2, &[16, 64]),
    );
    let (w1_held, w2_held) = (w1.clone(), w2.clone());
    let region = move |inputs: &[Tensor]| -> headroom_autograd_core::Result<Vec<Tensor>> {
        let (w1, w2) = (&w1_held, &w2_held);
        let h = layer_norm_linear(&inputs[0], &[64], None, None, 1e-5, w1, None)?.tanh()?;
        Ok(vec![layer_norm_linear(
            &h,
            &[64],
            None,
            None,
            1e-5,
            w2,
            None,
        )?
        .exp()?])
    };
    let before = allocated(&cpu);
    let out = match options {
        Some(options) => checkpoint_with(region, std::slice::from_ref(&x), options).unwrap(),
        None => region(std::slice::from_ref(&x)).unwrap(),
    };
    let kept = allocated(&cpu) - before;
    out[0].sum_all().unwrap().backward().unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        t.grad()
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    (vec![bits(&x), bits(&w1), bits(&w2)], kept)
}

#[test]
fn recompute_before_keeps_the_late_part_and_recomputes_the_early_part() {
    let (plain, plain_kept) = two_norm_products(None);
    let (all, all_kept) = two_norm_products(Some(&CheckpointOptions::default()));
    let before_second = CheckpointOptions {
        policy: Arc::new(RecomputeBefore {
            op: "layer_norm_linear",
            instance: 1,
        }),
        ..CheckpointOptions::default()
    };
    let (late_kept, late_kept_bytes) = two_norm_products(Some(&before_second));
    assert_eq!(all, plain);
    assert_eq!(late_kept, plain);
    // Recompute all: the output (8 × 16 f32, one 512-byte block). Kept from the second call on:
    // its input (8 × 64 f32), its mean and rstd (a block each), and the output.
    assert_eq!(all_kept, 512);
    assert_eq!(late_kept_bytes, 2048 + 512 + 512 + 512);
    assert!(
        late_kept_bytes < plain_kept,
        "{late_kept_bytes} against {plain_kept}"
    );
    // Outside a region it recomputes; a region with one call recomputes everything.
    let site_of = |op: &'static str| headroom_autograd_core::SaveSite {
        op,
        role: headroom_autograd_core::SaveRole::Input(0),
        shape: Default::default(),
        dtype: DType::F32,
        device: Device::Cpu,
        bytes: 0,
        seq: 0,
        is_parameter: false,
        rebuildable: false,
    };
    let policy = RecomputeBefore::mlp();
    assert_eq!(
        policy.decide(&site_of("layer_norm_linear")),
        Decision::Recompute
    );
    let input = headroom_autograd_core::SaveRole::Input(0);
    assert_eq!(
        policy.decide_in_region(
            &site_of("layer_norm_linear"),
            &mut [("layer_norm_linear", input)].into_iter()
        ),
        Decision::Save
    );
    assert_eq!(
        policy.decide_in_region(
            &site_of("gelu_linear"),
            &mut [("linear", input)].into_iter()
        ),
        Decision::Recompute
    );
}

/// Counts the calls of every block it runs, then hands the block to `inner`.
#[derive(Debug)]
struct CountingRunner {
    inner: CheckpointBlocks,
    calls: Arc<AtomicUsize>,
}

impl headroom_nn::BlockRunner for CountingRunner {
    fn run(
        &self,
        index: usize,
        block: headroom_nn::BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        let calls = Arc::clone(&self.calls);
        let counted: headroom_nn::BlockForward = Arc::new(move |x| {
            calls.fetch_add(1, Ordering::Relaxed);
            block(x)
        });
        self.inner.run(index, counted, input)
    }
}

#[test]
fn leaving_the_last_block_alone_saves_its_recompute_for_the_same_peak() {
    let config = VitConfig::mini();
    let blocks = config.num_layers;
    let mut results = Vec::new();
    for runner in [
        CheckpointBlocks::all(),
        CheckpointBlocks::all_but_last(blocks),
    ] {
        let cpu = Arc::new(CpuBackend::default());
        let backend: BackendRef = cpu.clone();
        let mut vit = headroom_nn::VisionTransformer::new(
            &backend,
            config,
            DType::F32,
            &Arc::new(Generator::new(0)),
        )
        .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        vit.set_block_runner(Some(Arc::new(CountingRunner {
            inner: runner,
            calls: Arc::clone(&calls),
        })));
        let images = Tensor::full(&backend, &[4, 3, 64, 64], 0.25, DType::F32).unwrap();
        cpu.allocator().reset_peak_stats();
        vit.forward(&images)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let peak = backend.memory_stats().allocated_bytes.all.peak;
        let grads: Vec<Vec<f32>> = headroom_nn::Module::parameters(&vit)
            .iter()
            .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
            .collect();
        results.push((calls.load(Ordering::Relaxed), peak, grads));
    }
    let (all_calls, all_peak, all_grads) = &results[0];
    let (but_last_calls, but_last_peak, but_last_grads) = &results[1];
    assert_eq!(
        *all_calls,
        2 * blocks,
        "a forward and a recompute per block"
    );
    assert_eq!(
        *but_last_calls,
        2 * blocks - 1,
        "the last block is not recomputed"
    );
    assert!(
        but_last_peak <= all_peak,
        "peak {but_last_peak} B leaving the last block alone, {all_peak} B checkpointing it"
    );
    assert_eq!(but_last_grads, all_grads);
}

/// Records the shape of each block's input, then hands the block to `inner`.
#[derive(Debug)]
struct ShapeRecorder {
    inner: CheckpointBlocks,
    shapes: Arc<parking_lot::Mutex<Vec<Vec<usize>>>>,
}

impl headroom_nn::BlockRunner for ShapeRecorder {
    fn run(
        &self,
        index: usize,
        block: headroom_nn::BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        self.shapes.lock().push(input.shape().to_vec());
        self.inner.run(index, block, input)
    }
}

/// A ViT's block 0, for a runner, is the embedding and the first encoder block, from the images:
/// with every block checkpointed the forward leaves one `[batch, seq, hidden]` activation per
/// block but the first (whose input, the images, the caller holds anyway), and nothing else that
/// grows with the blocks.
#[test]
fn a_checkpointed_vit_keeps_the_images_for_block_zero_not_its_tokens() {
    let (batch, seq, hidden) = (4, 17, 256);
    let mut retained = Vec::new();
    for num_layers in [1, 6] {
        let cpu = Arc::new(CpuBackend::default());
        let backend: BackendRef = cpu.clone();
        let config = VitConfig {
            num_layers,
            ..VitConfig::mini()
        };
        let mut vit = headroom_nn::VisionTransformer::new(
            &backend,
            config,
            DType::F32,
            &Arc::new(Generator::new(0)),
        )
        .unwrap();
        let shapes = Arc::new(parking_lot::Mutex::new(Vec::new()));
        vit.set_block_runner(Some(Arc::new(ShapeRecorder {
            inner: CheckpointBlocks::all(),
            shapes: Arc::clone(&shapes),
        })));
        let images = Tensor::full(&backend, &[batch, 3, 64, 64], 0.25, DType::F32).unwrap();
        let before = allocated(&backend);
        let loss = vit.forward(&images).unwrap().sum_all().unwrap();
        retained.push(allocated(&backend) - before);
        let mut expected = vec![vec![batch, 3, 64, 64]];
        expected.extend(std::iter::repeat_n(
            vec![batch, seq, hidden],
            num_layers - 1,
        ));
        assert_eq!(*shapes.lock(), expected, "{num_layers} blocks");
        loss.backward().unwrap();
    }
    let activation = (batch * seq * hidden * 4) as i64;
    assert_eq!(retained[1] - retained[0], 5 * activation);
    // One block: what the head keeps (the class rows, the norm's statistics, the logits), no
    // activation of the sequence.
    assert!(
        retained[0] < activation,
        "{} B kept by a one-block model",
        retained[0]
    );
}
