//! The technique matrix's cells and how one trains: every way to drive a step × every way to keep
//! saved activations × every precision × two optimizers, on a tiny ViT and a tiny GPT-2, each
//! trained 5 steps and compared with the plain loop of the same model, precision and optimizer on
//! the same backend. `technique_matrix.rs` runs the whole matrix on the CPU,
//! `technique_matrix_cuda.rs` its GPU subset (offload added) on a CUDA device.
//!
//! - Drivers: the plain loop (backward, then `step`); in backward (hooks' `InBackward`); ZeRO-2
//!   on two in-process ranks (distributed's `ShardedOptimizer` inside `InBackward`; the ranks'
//!   bytes travel through the host, so they share one device).
//! - Saves: every activation kept; every block checkpointed; every block's saves in 8 bits;
//!   every block's saves offloaded to pinned host memory (CUDA only: on the CPU it is
//!   checkpoint's typed refusal, `CheckpointError::OffloadNeedsCuda`).
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
//! saves; 8-bit Adam over shards, which quantises different blocks; GPT-2 on CUDA, whose
//! embedding gradients add with atomics in a different order from run to run).
//!
//! It sits on testkit's models and inputs, and on the technique crates as dev-dependencies.

use std::sync::Arc;
use std::time::Instant;

use headroom_amp::{AmpPolicy, GradScaler, GradScalerConfig};
use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_checkpoint::{
    BlockSelection, CheckpointBlocks, CompressActivations, CompressBlocks, CompressOptions,
    Compression, OffloadBlocks, OffloadOptions, OffloadPool,
};
use headroom_distributed::{Communicator, InProcessGroup, ShardConfig, ShardedOptimizer};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_nn::{BlockRunner, Gpt2Config, VitConfig};
use headroom_optim::{
    Adam, Adam8bit, Adam8bitConfig, AdamConfig, Implementation, Optimizer, ParamGroup,
};
use headroom_testkit::inputs::Xorshift;
use headroom_testkit::worst::nan_max;
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
pub(crate) enum Driver {
    Plain,
    InBackward,
    Zero2,
}

pub(crate) const DRIVERS: [Driver; 3] = [Driver::Plain, Driver::InBackward, Driver::Zero2];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Saves {
    Keep,
    Checkpoint,
    Compress8bit,
    /// Every save of every block offloaded to pinned host memory (CUDA only).
    Offload,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Precision {
    F32,
    Bf16Autocast,
    Fp16Scaled,
}

const PRECISIONS: [Precision; 3] = [
    Precision::F32,
    Precision::Bf16Autocast,
    Precision::Fp16Scaled,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rule {
    FusedAdamW,
    Adam8bit,
}

/// What a cell is compared within: its model, precision and rule. The group's plain loop with
/// every activation kept is the reference of every cell of the group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Group {
    pub(crate) model: ModelSpec,
    pub(crate) precision: Precision,
    pub(crate) rule: Rule,
}

/// One cell of the matrix.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cell {
    pub(crate) group: Group,
    pub(crate) driver: Driver,
    pub(crate) saves: Saves,
}

/// Every cell of `saves` × `drivers` × the precisions × the rules × the two models.
pub(crate) fn cells(saves: &[Saves], drivers: &[Driver]) -> Vec<Cell> {
    let mut cells = Vec::new();
    for model in models() {
        for precision in PRECISIONS {
            for rule in [Rule::FusedAdamW, Rule::Adam8bit] {
                for &driver in drivers {
                    for &saves in saves {
                        cells.push(Cell {
                            group: Group {
                                model,
                                precision,
                                rule,
                            },
                            driver,
                            saves,
                        });
                    }
                }
            }
        }
    }
    cells
}

impl Cell {
    /// How close the cell must end to the plain loop of its model, precision and rule on the
    /// same backend, and why.
    fn bound(&self, on_cuda: bool) -> Bound {
        let sharded_8bit = self.driver == Driver::Zero2 && self.group.rule == Rule::Adam8bit;
        let gpt2 = matches!(self.group.model, ModelSpec::Gpt2 { .. });
        match (self.saves, self.group.rule) {
            // First: on CUDA it covers the 8-bit saves and shards of GPT-2 too.
            (_, Rule::Adam8bit) if gpt2 && on_cuda => Bound::Absolute {
                max: 60.0 * STEPS as f64 * LR,
                why: "GPT-2's embedding gradients differ in the last bits from run to run on CUDA \
                      (atomics), and 8-bit Adam's smallest second-moment codes can turn such a \
                      difference into a step of many lr, as for 8-bit saves and shards (measured \
                      on the H200: 0.141 to 0.145 after 5 bf16 steps at lr 1e-3, the same in every \
                      driver and saves; twice that is the bound)",
            },
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
            (_, Rule::FusedAdamW) if gpt2 && on_cuda => Bound::Absolute {
                max: 2.0 * STEPS as f64 * LR,
                why: "GPT-2's embedding gradients are scatter-adds with atomics on CUDA, so their \
                      sums differ in the last bits from run to run (the plain loop included); \
                      where a gradient is near zero Adam turns that into a step of lr either way: \
                      at most 2 lr a step apart (measured on the H200: 3.1e-7)",
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
pub(crate) fn attach(model: &mut Model, saves: Saves) {
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
        // Every save, however small (the default spares saves under 1 MiB).
        Saves::Offload => Some(Arc::new(OffloadBlocks {
            selection: BlockSelection::All,
            options: OffloadOptions {
                min_bytes: 0,
                prefetch_blocks: 1,
                release_after_blocks: 0,
                pool: OffloadPool::new(),
            },
        })),
    };
    model
        .blocks_mut()
        .expect("the matrix trains models with blocks")
        .set_block_runner(runner);
}

/// The rule over `params`.
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

/// The rule's ZeRO-2 shards over `comm`, inside an `InBackward`.
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

/// One rank's training of `cell` on `backend` (the single process when `comm` is `None`): its
/// parameters at the end.
fn train_rank(
    cell: Cell,
    backend: &BackendRef,
    comm: Option<Arc<dyn Communicator>>,
) -> Vec<Vec<f32>> {
    let mut model = cell.group.model.build(backend, DType::F32, SEED).unwrap();
    attach(&mut model, cell.saves);
    let params = model.module().parameters();
    // A rank's loss is its half's mean, twice the plain loop's weighted half: half the scale
    // gives its backward the same seed (see the file's docs).
    let init_scale = match comm {
        Some(_) => GradScalerConfig::default().init_scale / 2.0,
        None => GradScalerConfig::default().init_scale,
    };
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: cell.group.precision == Precision::Fp16Scaled,
        init_scale,
        ..GradScalerConfig::default()
    })
    .unwrap();
    let policy = match cell.group.precision {
        Precision::F32 => None,
        Precision::Bf16Autocast => Some(AmpPolicy::torch_cuda(DType::BF16).unwrap()),
        Precision::Fp16Scaled => Some(AmpPolicy::torch_cuda(DType::F16).unwrap()),
    };
    let halves = match &comm {
        Some(comm) => vec![comm.rank()],
        None => vec![0, 1],
    };
    let mut stepper = match (cell.driver, comm) {
        (Driver::Plain, _) => Stepper::Plain(optimizer(cell.group.rule, params.clone())),
        (Driver::InBackward, _) => Stepper::InBackward(
            InBackward::new(
                optimizer(cell.group.rule, params.clone()),
                InBackwardConfig {
                    bucket_bytes: BUCKET_BYTES,
                    accumulation: 2,
                    clipping: None,
                },
            )
            .unwrap(),
        ),
        (Driver::Zero2, Some(comm)) => {
            Stepper::InBackward(sharded(cell.group.rule, params.clone(), comm))
        }
        (Driver::Zero2, None) => unreachable!("ZeRO-2 runs on ranks"),
    };
    // The plain loop and in-backward accumulate the two halves, each loss × 1/2; a ZeRO-2 rank
    // backwards its half's loss, which the reduce-scatter averages over the two ranks.
    let weight = if halves.len() == 2 { 0.5 } else { 1.0 };
    for step in 0..STEPS {
        let batch = global_batch(cell.group.model, backend, step);
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

/// The parameters `cell` ends with on `backend` (rank 0's under ZeRO-2, after checking that the
/// ranks agree to the bit).
pub(crate) fn train(cell: Cell, backend: &BackendRef) -> Vec<Vec<f32>> {
    if cell.driver != Driver::Zero2 {
        return train_rank(cell, backend, None);
    }
    let ranks = InProcessGroup::ranks(2).unwrap();
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|comm| scope.spawn(move || train_rank(cell, backend, Some(Arc::new(comm)))))
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
                largest = nan_max(largest, (f64::from(x) - f64::from(y)).abs());
            }
        }
    }
    (differing, largest)
}

/// Judges every cell ([`judge`]), prints how long training them took since `started`, and fails
/// listing every cell outside its bound.
pub(crate) fn assert_within_bounds(
    cells: &[Cell],
    trained: &[Vec<Vec<f32>>],
    on_cuda: bool,
    started: Instant,
) {
    let failures = judge(cells, trained, on_cuda);
    println!(
        "{} cells trained {STEPS} steps each{} in {:.1} s",
        cells.len(),
        if on_cuda { " on CUDA" } else { "" },
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each cell's result against the plain loop with every activation kept of its model,
/// precision and rule (which `cells` must hold), printed one line a cell: the lines of the
/// cells outside their bound.
fn judge(cells: &[Cell], trained: &[Vec<Vec<f32>>], on_cuda: bool) -> Vec<String> {
    let mut failures = Vec::new();
    for (cell, params) in cells.iter().zip(trained) {
        let reference = cells
            .iter()
            .position(|other| {
                other.group == cell.group
                    && other.driver == Driver::Plain
                    && other.saves == Saves::Keep
            })
            .expect("every group has its plain loop");
        let (differing, largest) = compare(params, &trained[reference]);
        let line = format!(
            "{} {:?} {:?} {:?} {:?}: {differing} elements differ, by at most {largest:.2e}",
            model_name(cell.group.model),
            cell.driver,
            cell.saves,
            cell.group.precision,
            cell.group.rule
        );
        println!("{line}");
        let failure = match cell.bound(on_cuda) {
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
    failures
}

pub(crate) fn model_name(model: ModelSpec) -> &'static str {
    match model {
        ModelSpec::Vit(_) => "vit",
        _ => "gpt2",
    }
}
