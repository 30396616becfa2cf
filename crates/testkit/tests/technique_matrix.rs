//! The technique matrix: every way to drive a step × every way to keep saved activations × every
//! precision × two optimizers, on a tiny ViT and a tiny GPT-2, each trained 5 steps on the CPU
//! and compared with the plain loop of the same model, precision and optimizer.
//!
//! - Drivers: the plain loop (backward, then `step`); in backward (hooks' `InBackward`); ZeRO-2
//!   on two in-process ranks (distributed's `ShardedOptimizer` inside `InBackward`).
//! - Saves: every activation kept; every block checkpointed; every block's saves in 8 bits.
//! - Precision: f32; bf16 autocast; fp16 autocast with loss scaling (amp's `GradScaler`, the same
//!   provider for every driver: `scaler.step(&mut optimizer)` in the plain loop,
//!   `InBackward::backward_scaled(&loss, &mut scaler)` in backward and under ZeRO-2).
//! - Optimizers: fused AdamW and 8-bit Adam.
//!
//! Every step's global batch is two halves, each half's mean loss × 1/2 (the plain loop and
//! in-backward accumulate the two as micro-batches, ZeRO-2 gives one to each rank, whose
//! reduce-scatter sums in rank order and multiplies by 1/2): the same sums, exact scalings, so
//! the gradients are the same bits. Under fp16 the rank's loss is its half's mean (× 1, not
//! × 1/2), so its scaler starts at half the plain loop's scale: the same seed then reaches each
//! half's backward, whose f16 products (their overflows and subnormals) are the same numbers.
//! Hence bitwise wherever the arithmetic is the same, and a stated bound where it is not (8-bit
//! saves; 8-bit Adam over shards, which quantises different blocks). No cell is refused: every
//! combination trains.
//!
//! It sits on testkit's models and inputs, and on the technique crates as dev-dependencies.

use std::sync::Arc;
use std::time::Instant;

use headroom_amp::{AmpPolicy, GradScaler, GradScalerConfig};
use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_checkpoint::{
    CheckpointBlocks, CompressActivations, CompressBlocks, CompressOptions, Compression,
};
use headroom_distributed::{Communicator, InProcessGroup, ShardConfig, ShardedOptimizer};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_nn::{BlockRunner, Gpt2Config, VitConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{Adam8bitConfig, AdamConfig};
use headroom_optim::{Adam, Adam8bit, Implementation, Optimizer, ParamGroup};
use headroom_testkit::inputs::Xorshift;
use headroom_testkit::{Batch, Model, ModelSpec};

const STEPS: usize = 5;
/// Examples in each half of a step's batch.
const HALF: usize = 2;
const SEED: u64 = 28;
/// The bytes of gradients an in-backward bucket collects (a few buckets per pass).
const BUCKET_BYTES: u64 = 16 << 10;
/// Both optimizers' learning rate.
const LR: f64 = 1e-3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    Plain,
    InBackward,
    Zero2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Saves {
    Keep,
    Checkpoint,
    Compress8bit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Precision {
    F32,
    Bf16Autocast,
    Fp16Scaled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    FusedAdamW,
    Adam8bit,
}

/// One cell of the matrix.
#[derive(Debug, Clone, Copy)]
struct Cell {
    model: ModelSpec,
    driver: Driver,
    saves: Saves,
    precision: Precision,
    rule: Rule,
}

impl Cell {
    /// How close the cell must end to the plain loop of its model, precision and rule, and why.
    fn bound(&self) -> Bound {
        let sharded_8bit = self.driver == Driver::Zero2 && self.rule == Rule::Adam8bit;
        match (self.saves, self.rule) {
            (Saves::Compress8bit, Rule::FusedAdamW) => Bound::Absolute {
                max: 2.0 * STEPS as f64 * LR,
                why: "8-bit saves perturb each gradient (one absmax per 256 elements); Adam moves \
                      an element by about lr a step in its gradient's direction, which a \
                      perturbation can reverse: at most 2 lr a step apart (measured: 7.7e-3 after \
                      5 steps)",
            },
            (Saves::Compress8bit, Rule::Adam8bit) => Bound::Absolute {
                max: 30.0 * STEPS as f64 * LR,
                why: "8-bit saves perturb each gradient, and 8-bit Adam quantises its second \
                      moment: a small element's state falls to the map's smallest codes, so a \
                      perturbed step can divide by a far smaller sqrt(v) (measured: 0.104 after 5 \
                      steps at lr 1e-3)",
            },
            _ if sharded_8bit => Bound::Absolute {
                max: 10.0 * STEPS as f64 * LR,
                why: "8-bit Adam over shards quantises other blocks than over whole weights (a \
                      shard of 4096 elements takes bitsandbytes' 32-bit path), so its states and \
                      updates differ (measured: 2.3e-2 after 5 steps at lr 1e-3)",
            },
            _ => Bound::Bitwise,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Bound {
    Bitwise,
    /// Every element within `max` of the plain loop's.
    Absolute {
        max: f64,
        why: &'static str,
    },
}

fn models() -> [ModelSpec; 2] {
    [
        ModelSpec::Vit(VitConfig::tiny()),
        ModelSpec::Gpt2 {
            config: Gpt2Config::tiny(),
            seq: 16,
        },
    ]
}

/// The global batch of `step`: `2 × HALF` examples, the same on every rank.
fn global_batch(spec: ModelSpec, backend: &BackendRef, step: usize) -> Batch {
    let mut random = Xorshift::new(SEED * 1000 + step as u64);
    spec.batch(backend, DType::F32, 2 * HALF, &mut random)
        .unwrap()
}

/// Attaches the saves' block runner to the model's blocks.
fn attach(model: &mut Model, saves: Saves) {
    let runner: Option<Arc<dyn BlockRunner>> = match saves {
        Saves::Keep => None,
        Saves::Checkpoint => Some(Arc::new(CheckpointBlocks::all())),
        // Every activation of a tiny model's block: the default spares saves under 16 Ki
        // elements, which would leave nothing to compress here.
        Saves::Compress8bit => Some(Arc::new(CompressBlocks {
            options: CompressOptions {
                policy: Arc::new(CompressActivations {
                    compression: Compression::Int8Blockwise { block: 256 },
                    min_elements: 256,
                }),
            },
            ..CompressBlocks::all()
        })),
    };
    model
        .blocks_mut()
        .expect("the matrix trains models with blocks")
        .set_block_runner(runner);
}

/// The rule over `params`, or its ZeRO-2 shards over `comm`, inside an `InBackward`.
fn optimizer(rule: Rule, params: Vec<Tensor>) -> Box<dyn Optimizer> {
    match rule {
        Rule::FusedAdamW => Box::new(
            Adam::new(
                vec![ParamGroup::new(params, adamw())],
                Implementation::Fused,
            )
            .unwrap(),
        ),
        Rule::Adam8bit => Box::new(
            Adam8bit::new(
                vec![ParamGroup::new(params, adam8bit())],
                Implementation::Fused,
            )
            .unwrap(),
        ),
    }
}

fn adamw() -> AdamConfig {
    AdamConfig {
        lr: LR,
        weight_decay: 1e-2,
        ..AdamConfig::adamw()
    }
}

fn adam8bit() -> Adam8bitConfig {
    Adam8bitConfig {
        lr: LR,
        ..Adam8bitConfig::adam()
    }
}

fn sharded(rule: Rule, params: Vec<Tensor>, comm: Arc<dyn Communicator>) -> InBackward {
    let config = ShardConfig {
        bucket_bytes: BUCKET_BYTES,
        clipping: None,
    };
    let in_backward = InBackwardConfig {
        bucket_bytes: BUCKET_BYTES,
        ..InBackwardConfig::default()
    };
    let sharded = match rule {
        Rule::FusedAdamW => ShardedOptimizer::new(
            vec![ParamGroup::new(params, adamw())],
            Implementation::Fused,
            comm,
            config,
        ),
        Rule::Adam8bit => ShardedOptimizer::new(
            vec![ParamGroup::new(params, adam8bit())],
            Implementation::Fused,
            comm,
            config,
        ),
    };
    sharded.unwrap().into_in_backward(in_backward).unwrap()
}

/// How one rank (or the single process) steps.
enum Stepper {
    Plain(Box<dyn Optimizer>),
    InBackward(InBackward),
}

/// One rank's training of `cell` (the single process when `comm` is `None`): its parameters at
/// the end.
fn train_rank(cell: Cell, comm: Option<Arc<dyn Communicator>>) -> Vec<Vec<f32>> {
    let cpu = CpuBackend::new_ref();
    let mut model = cell.model.build(&cpu, DType::F32, SEED).unwrap();
    attach(&mut model, cell.saves);
    let params = model.module().parameters();
    // A rank's loss is its half's mean, twice the plain loop's weighted half: half the scale
    // gives its backward the same seed (see the file's docs).
    let init_scale = match comm {
        Some(_) => GradScalerConfig::default().init_scale / 2.0,
        None => GradScalerConfig::default().init_scale,
    };
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: cell.precision == Precision::Fp16Scaled,
        init_scale,
        ..GradScalerConfig::default()
    })
    .unwrap();
    let policy = match cell.precision {
        Precision::F32 => None,
        Precision::Bf16Autocast => Some(AmpPolicy::torch_cuda(DType::BF16).unwrap()),
        Precision::Fp16Scaled => Some(AmpPolicy::torch_cuda(DType::F16).unwrap()),
    };
    let halves = match &comm {
        Some(comm) => vec![comm.rank()],
        None => vec![0, 1],
    };
    let mut stepper = match (cell.driver, comm) {
        (Driver::Plain, _) => Stepper::Plain(optimizer(cell.rule, params.clone())),
        (Driver::InBackward, _) => Stepper::InBackward(
            InBackward::new(
                optimizer(cell.rule, params.clone()),
                InBackwardConfig {
                    bucket_bytes: BUCKET_BYTES,
                    accumulation: 2,
                    clipping: None,
                },
            )
            .unwrap(),
        ),
        (Driver::Zero2, Some(comm)) => {
            Stepper::InBackward(sharded(cell.rule, params.clone(), comm))
        }
        (Driver::Zero2, None) => unreachable!("ZeRO-2 runs on ranks"),
    };
    // The plain loop and in-backward accumulate the two halves, each loss × 1/2; a ZeRO-2 rank
    // backwards its half's loss, which the reduce-scatter averages over the two ranks.
    let weight = if halves.len() == 2 { 0.5 } else { 1.0 };
    for step in 0..STEPS {
        let batch = global_batch(cell.model, &cpu, step);
        for &half in &halves {
            let part = batch.narrow(half * HALF, HALF).unwrap();
            let loss = {
                let _autocast = policy.as_ref().map(AmpPolicy::enter);
                let output = model.forward(&part.input).unwrap();
                model.loss(&output, &part).unwrap()
            };
            let loss = loss
                .to_dtype(DType::F32)
                .unwrap()
                .mul_scalar(weight)
                .unwrap();
            match &stepper {
                Stepper::Plain(_) => scaler.scale(&loss).unwrap().backward().unwrap(),
                Stepper::InBackward(in_backward) => {
                    in_backward.backward_scaled(&loss, &mut scaler).unwrap();
                }
            }
        }
        if let Stepper::Plain(optimizer) = &mut stepper {
            scaler.step(optimizer.as_mut()).unwrap();
            scaler.update().unwrap();
            optimizer.zero_grad(true).unwrap();
        }
    }
    params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

/// The parameters `cell` ends with (rank 0's under ZeRO-2, after checking that the ranks agree
/// to the bit).
fn train(cell: Cell) -> Vec<Vec<f32>> {
    if cell.driver != Driver::Zero2 {
        return train_rank(cell, None);
    }
    let ranks = InProcessGroup::ranks(2).unwrap();
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|comm| scope.spawn(move || train_rank(cell, Some(Arc::new(comm)))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results[0], results[1], "{cell:?}: the ranks disagree");
    results.into_iter().next().unwrap()
}

/// The number of elements whose bits differ, and the largest `|a − b|`.
fn compare(ours: &[Vec<f32>], reference: &[Vec<f32>]) -> (usize, f64) {
    let mut differing = 0;
    let mut largest = 0f64;
    for (a, b) in ours.iter().zip(reference) {
        for (&x, &y) in a.iter().zip(b) {
            if x.to_bits() != y.to_bits() {
                differing += 1;
                largest = largest.max((f64::from(x) - f64::from(y)).abs());
            }
        }
    }
    (differing, largest)
}

/// `jobs` run on as many threads as the machine has cores, results in order.
fn run_all<T: Send>(jobs: Vec<Box<dyn FnOnce() -> T + Send>>) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let jobs: Vec<_> = jobs.into_iter().map(Some).collect();
    let slots = std::sync::Mutex::new((jobs, 0usize));
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let (index, job) = {
                    let mut slots = slots.lock().unwrap();
                    let index = slots.1;
                    if index == slots.0.len() {
                        return;
                    }
                    slots.1 += 1;
                    (index, slots.0[index].take().expect("taken once"))
                };
                let result = job();
                results.lock().unwrap().push((index, result));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(index, _)| *index);
    results.into_iter().map(|(_, result)| result).collect()
}

#[test]
fn every_technique_stacks_with_every_other_and_trains_like_the_plain_loop() {
    let started = Instant::now();
    let mut cells = Vec::new();
    for model in models() {
        for precision in [
            Precision::F32,
            Precision::Bf16Autocast,
            Precision::Fp16Scaled,
        ] {
            for rule in [Rule::FusedAdamW, Rule::Adam8bit] {
                for driver in [Driver::Plain, Driver::InBackward, Driver::Zero2] {
                    for saves in [Saves::Keep, Saves::Checkpoint, Saves::Compress8bit] {
                        cells.push(Cell {
                            model,
                            driver,
                            saves,
                            precision,
                            rule,
                        });
                    }
                }
            }
        }
    }
    assert_eq!(cells.len(), 2 * 3 * 2 * 9);
    let jobs: Vec<Box<dyn FnOnce() -> Vec<Vec<f32>> + Send>> = cells
        .iter()
        .map(|&cell| Box::new(move || train(cell)) as Box<dyn FnOnce() -> _ + Send>)
        .collect();
    let trained = run_all(jobs);
    let mut failures = Vec::new();
    for (cell, params) in cells.iter().zip(&trained) {
        // The plain loop with every activation kept, of the same model, precision and rule.
        let reference = cells
            .iter()
            .position(|other| {
                other.driver == Driver::Plain
                    && other.saves == Saves::Keep
                    && other.model == cell.model
                    && other.precision == cell.precision
                    && other.rule == cell.rule
            })
            .expect("every group has its plain loop");
        let (differing, largest) = compare(params, &trained[reference]);
        let name = match cell.model {
            ModelSpec::Vit(_) => "vit",
            _ => "gpt2",
        };
        let line = format!(
            "{name} {:?} {:?} {:?} {:?}: {differing} elements differ, by at most {largest:.2e}",
            cell.driver, cell.saves, cell.precision, cell.rule
        );
        println!("{line}");
        let failure = match cell.bound() {
            Bound::Bitwise if differing > 0 => Some("bitwise: the same arithmetic".to_owned()),
            Bound::Absolute { max, why } if largest.is_nan() || largest > max => {
                Some(format!("within {max:e}: {why}"))
            }
            _ => None,
        };
        if let Some(bound) = failure {
            failures.push(format!("{line} (bound {bound})"));
        }
    }
    println!(
        "{} cells trained {STEPS} steps each in {:.1} s",
        cells.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
