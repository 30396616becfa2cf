//! ZeRO-1 and ZeRO-2 on the CPU backend with the in-process communicator, 2 and 4 ranks: the
//! parameters after 20 steps against single-rank training on the same global batch, the bytes
//! each rank holds, the bytes each step moves, accumulation, clipping and loss scaling (8-bit
//! Adam's shards are `zero_8bit.rs`).
//!
//! The single-rank reference runs the global batch as the ranks' micro-batches in rank order,
//! each loss scaled by `1 / world_size`, accumulated into `.grad`, then one step: the same
//! global batch and the same mean loss. Its gradient is `((g₀/n + g₁/n) + g₂/n) + …`; the ranks'
//! is `(((g₀ + g₁) + g₂) + …) · (1/n)` (the in-process reduce-scatter sums in rank order). For
//! `n` a power of two, scaling by `1/n` is exact and commutes with every rounding, so the two are
//! the same bits; the shards' update is the element-wise rule on the same elements. Hence
//! bitwise.

mod zero2;

use std::sync::Arc;

use headroom_amp::{GradScaler, GradScalerConfig};
use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_distributed::{
    CollectiveCount, CommStats, Communicator, DistributedError, InProcessGroup, ShardClipping,
    ShardConfig, ShardLayout, ShardedOptimizer,
};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_nn::VitConfig;
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{
    clip_grad_norm_, Adafactor, AdafactorConfig, Adam, AdamConfig, Implementation, NormType,
    Optimizer, ParamGroup,
};
use headroom_testkit::inputs::Xorshift;
use headroom_testkit::worst::nan_max;
use headroom_testkit::{Batch, Model, ModelSpec};
use zero2::zero2_in_backward;

const STEPS: usize = 20;
/// Examples per rank per micro-batch.
const PER_RANK: usize = 3;
const SEED: u64 = 16;

/// Widths that no rank count divides: every rank count pads some parameter.
const MLP: ModelSpec = ModelSpec::Mlp {
    width: 13,
    hidden: 30,
};

fn adamw() -> AdamConfig {
    AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw()
    }
}

/// How a run steps.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    /// A plain backward, then `step()`.
    Zero1,
    /// Inside backward through InBackward, buckets of this many bytes.
    Zero2 { bucket_bytes: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Run {
    spec: ModelSpec,
    world_size: usize,
    stage: Stage,
    accumulation: usize,
    clip: Option<f64>,
    /// fp16-style loss scaling (amp's GradScaler, 2^16 at first) with the last rank's loss
    /// overflowing at [`OVERFLOW_STEP`], so that every rank must skip that step together.
    scaled: bool,
}

impl Run {
    /// The MLP on `world_size` ranks under `stage`: one micro-step, no clipping, no scaling.
    fn plain(world_size: usize, stage: Stage) -> Run {
        Run {
            spec: MLP,
            world_size,
            stage,
            accumulation: 1,
            clip: None,
            scaled: false,
        }
    }
}

/// The step whose last-rank loss is infinite in a scaled run.
const OVERFLOW_STEP: usize = 3;

/// What one rank ends with.
#[derive(Debug)]
struct RankResult {
    params: Vec<Vec<f32>>,
    /// Communication of the last step alone.
    last_step: CommStats,
    /// Communication during the micro-steps before the last of the last step.
    micro_steps: CommStats,
    layout: ShardLayout,
}

/// The global batch of micro-step `micro` of `step`: `world_size × PER_RANK` examples.
fn global_batch(
    spec: ModelSpec,
    backend: &BackendRef,
    world_size: usize,
    step: usize,
    micro: usize,
) -> Batch {
    let mut random = Xorshift::new(SEED * 1000 + (step * 16 + micro) as u64);
    spec.batch(backend, DType::F32, world_size * PER_RANK, &mut random)
        .unwrap()
}

fn values(params: &[Tensor]) -> Vec<Vec<f32>> {
    params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

/// Single-rank training on the same global batches (see the file's docs).
fn reference(run: Run) -> Vec<Vec<f32>> {
    let cpu = CpuBackend::new_ref();
    let model = run.spec.build(&cpu, DType::F32, SEED).unwrap();
    let params = model.module().parameters();
    let mut adam = Adam::new(
        vec![ParamGroup::new(params.clone(), adamw())],
        Implementation::Fused,
    )
    .unwrap();
    let scale = 1.0 / (run.world_size * run.accumulation) as f64;
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: run.scaled,
        ..GradScalerConfig::default()
    })
    .unwrap();
    for step in 0..STEPS {
        for micro in 0..run.accumulation {
            let batch = global_batch(run.spec, &cpu, run.world_size, step, micro);
            for rank in 0..run.world_size {
                let part = batch.narrow(rank * PER_RANK, PER_RANK).unwrap();
                let loss = model
                    .loss(&model.forward(&part.input).unwrap(), &part)
                    .unwrap();
                let loss = overflow_if_due(run, step, rank, loss);
                let loss = loss.mul_scalar(scale).unwrap();
                scaler.scale(&loss).unwrap().backward().unwrap();
            }
        }
        if let Some(max_norm) = run.clip {
            scaler.unscale_(&adam).unwrap();
            clip_grad_norm_(&params, max_norm, NormType::L2, false).unwrap();
        }
        scaler.step(&mut adam).unwrap();
        scaler.update().unwrap();
        adam.zero_grad(true).unwrap();
    }
    values(&params)
}

/// `loss`, made infinite on the last rank at [`OVERFLOW_STEP`] of a scaled run.
fn overflow_if_due(run: Run, step: usize, rank: usize, loss: Tensor) -> Tensor {
    match run.scaled && step == OVERFLOW_STEP && rank + 1 == run.world_size {
        true => loss.mul_scalar(f64::INFINITY).unwrap(),
        false => loss,
    }
}

/// One rank's training.
fn train_rank(run: Run, comm: Arc<dyn Communicator>) -> RankResult {
    let cpu = CpuBackend::new_ref();
    let rank = comm.rank();
    let model = run.spec.build(&cpu, DType::F32, SEED).unwrap();
    let params = model.module().parameters();
    let config = ShardConfig {
        bucket_bytes: 1024,
        clipping: run.clip.map(|max_norm| ShardClipping {
            max_norm,
            norm: NormType::L2,
        }),
    };
    let sharded = ShardedOptimizer::new(
        vec![ParamGroup::new(params.clone(), adamw())],
        Implementation::Fused,
        Arc::clone(&comm),
        config,
    )
    .unwrap();
    let layout = sharded.handle().layout();
    enum Driver {
        Plain(ShardedOptimizer),
        InBackward(InBackward),
    }
    let mut driver = match run.stage {
        Stage::Zero1 => Driver::Plain(sharded),
        Stage::Zero2 { bucket_bytes } => Driver::InBackward(
            sharded
                .into_in_backward(InBackwardConfig {
                    bucket_bytes,
                    accumulation: run.accumulation,
                    clipping: None,
                })
                .unwrap(),
        ),
    };
    let (mut last_step, mut micro_steps) = (CommStats::default(), CommStats::default());
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: run.scaled,
        ..GradScalerConfig::default()
    })
    .unwrap();
    for step in 0..STEPS {
        let start = comm.stats();
        for micro in 0..run.accumulation {
            if micro + 1 == run.accumulation {
                micro_steps = comm.stats().since(&start);
            }
            let batch = global_batch(run.spec, &cpu, run.world_size, step, micro);
            let part = batch.narrow(rank * PER_RANK, PER_RANK).unwrap();
            let mut loss = model
                .loss(&model.forward(&part.input).unwrap(), &part)
                .unwrap();
            if run.accumulation > 1 {
                loss = loss.mul_scalar(1.0 / run.accumulation as f64).unwrap();
            }
            let loss = overflow_if_due(run, step, rank, loss);
            match &driver {
                Driver::Plain(_) => scaler.scale(&loss).unwrap().backward().unwrap(),
                Driver::InBackward(in_backward) if run.scaled => {
                    in_backward.backward_scaled(&loss, &mut scaler).unwrap();
                }
                Driver::InBackward(in_backward) => in_backward.backward(&loss).unwrap(),
            }
        }
        if let Driver::Plain(optimizer) = &mut driver {
            scaler.step(optimizer).unwrap();
            scaler.update().unwrap();
            optimizer.zero_grad(true).unwrap();
        }
        last_step = comm.stats().since(&start);
    }
    RankResult {
        params: values(&params),
        last_step,
        micro_steps,
        layout,
    }
}

/// Every rank of `run` on its own thread.
fn train(run: Run) -> Vec<RankResult> {
    let ranks = InProcessGroup::ranks(run.world_size).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|comm| scope.spawn(move || train_rank(run, Arc::new(comm))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The largest `|a − b| / max |b|` over each parameter.
fn max_relative(ours: &[Vec<f32>], reference: &[Vec<f32>]) -> f64 {
    ours.iter()
        .zip(reference)
        .map(|(a, b)| {
            let scale = b.iter().fold(0f64, |m, &v| nan_max(m, f64::from(v).abs()));
            let diff = a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
                nan_max(m, (f64::from(x) - f64::from(y)).abs())
            });
            diff / scale
        })
        .fold(0.0, nan_max)
}

fn assert_bitwise(run: Run) {
    let expected = reference(run);
    for (rank, result) in train(run).iter().enumerate() {
        for (index, (ours, theirs)) in result.params.iter().zip(&expected).enumerate() {
            let first = ours
                .iter()
                .zip(theirs)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                first.is_none(),
                "{run:?}: rank {rank}, parameter {index}, element {first:?}: {:?} vs {:?}",
                first.map(|i| ours[i]),
                first.map(|i| theirs[i])
            );
        }
    }
}

#[test]
fn zero1_trains_to_single_rank_bitwise_on_2_and_4_ranks() {
    for world_size in [2, 4] {
        assert_bitwise(Run::plain(world_size, Stage::Zero1));
    }
}

#[test]
fn zero2_trains_to_single_rank_bitwise_on_2_and_4_ranks() {
    for (world_size, bucket_bytes) in [(2, 0), (2, 2048), (4, 1 << 20)] {
        assert_bitwise(Run::plain(world_size, Stage::Zero2 { bucket_bytes }));
    }
}

#[test]
fn zero2_trains_vit_tiny_to_single_rank_bitwise() {
    assert_bitwise(Run {
        spec: ModelSpec::Vit(VitConfig::tiny()),
        ..Run::plain(
            2,
            Stage::Zero2 {
                bucket_bytes: 16 << 10,
            },
        )
    });
}

/// fp16-style loss scaling stacks with ZeRO-1 (amp's GradScaler stepping the sharded optimizer)
/// and ZeRO-2 (the same scaler handed to InBackward's `backward_scaled`): the parameters equal
/// single-rank training under the same scaler bit for bit, on 2 and 4 ranks — including a step
/// where only the last rank's gradients overflow, which every rank skips (the ranks' flags are
/// agreed before any shard is updated). With clipping, the global norm of the scaled shards over
/// the scale is the unscaled norm (a power-of-two scale): the ranks agree to the bit and stay
/// within the clipping test's bound of single-rank training.
#[test]
fn loss_scaling_trains_to_single_rank_bitwise_under_zero1_and_zero2() {
    for world_size in [2, 4] {
        let zero1 = Run {
            scaled: true,
            ..Run::plain(world_size, Stage::Zero1)
        };
        assert_bitwise(zero1);
        assert_bitwise(Run {
            stage: Stage::Zero2 { bucket_bytes: 2048 },
            ..zero1
        });
    }
    let clipped = Run {
        clip: Some(0.05),
        scaled: true,
        ..Run::plain(2, Stage::Zero1)
    };
    let expected = reference(clipped);
    let results = train(clipped);
    for result in &results {
        assert_eq!(result.params, results[0].params, "ranks agree to the bit");
        let err = max_relative(&result.params, &expected);
        assert!(err < 1e-6, "relative error {err:e}");
    }
    // The overflowed step was skipped: unscaled training differs from scaled training.
    let plain = Run {
        clip: None,
        scaled: false,
        ..clipped
    };
    assert_ne!(
        reference(plain),
        reference(Run {
            scaled: true,
            ..plain
        })
    );
}

#[test]
fn accumulation_micro_steps_communicate_nothing() {
    for world_size in [2, 4] {
        let zero1 = Run {
            accumulation: 3,
            ..Run::plain(world_size, Stage::Zero1)
        };
        let zero2 = Run {
            stage: Stage::Zero2 { bucket_bytes: 2048 },
            ..zero1
        };
        let (ones, twos) = (train(zero1), train(zero2));
        for result in ones.iter().chain(&twos) {
            assert_eq!(
                result.micro_steps,
                CommStats::default(),
                "{world_size} ranks"
            );
            let padded = result.layout.padded_bytes();
            assert_eq!(result.last_step.reduce_scatter.bytes, padded);
            assert_eq!(result.last_step.all_gather.bytes, padded);
        }
        // The same sums in the same order: each rank accumulates its micro-batches, then the
        // ranks are reduced.
        for (one, two) in ones.iter().zip(&twos) {
            assert_eq!(
                one.params, two.params,
                "ZeRO-1 and ZeRO-2, {world_size} ranks"
            );
        }
        // The single rank sums the micro-batch gradients one after another instead of per rank
        // first: a rounding apart per element per step, which Adam's normalisation carries
        // through 20 steps (measured: 1.7e-7 and 1.6e-7 of each parameter's largest element on 2 and 4 ranks).
        let err = max_relative(&ones[0].params, &reference(zero1));
        assert!(err < 1e-6, "{world_size} ranks: relative error {err:e}");
    }
}

#[test]
fn clipping_is_the_global_norm_across_ranks() {
    for world_size in [2, 4] {
        let zero1 = Run {
            clip: Some(0.05),
            ..Run::plain(world_size, Stage::Zero1)
        };
        let zero2 = Run {
            stage: Stage::Zero2 { bucket_bytes: 2048 },
            ..zero1
        };
        let expected = reference(zero1);
        let unclipped = reference(Run {
            clip: None,
            ..zero1
        });
        // The bound is low enough to clip: clipping changes the trained parameters.
        assert!(max_relative(&unclipped, &expected) > 1e-3);
        for run in [zero1, zero2] {
            let results = train(run);
            for result in &results {
                assert_eq!(result.params, results[0].params, "ranks agree to the bit");
                // The norm's squares are summed per shard and then over ranks instead of per
                // parameter: the coefficient differs in its last bits, which 20 Adam steps
                // carry (measured: 5.1e-8 on 2 ranks, 1.5e-7 on 4).
                let err = max_relative(&result.params, &expected);
                assert!(err < 1e-6, "{run:?}: relative error {err:e}");
                // One f64 all-reduce of the norm's square per step, beside the shards' moves.
                assert_eq!(
                    result.last_step.all_reduce,
                    CollectiveCount { calls: 1, bytes: 8 }
                );
            }
        }
    }
}

#[test]
fn a_step_moves_what_plain_data_parallel_moves() {
    for world_size in [2, 4] {
        let results = train(Run::plain(world_size, Stage::Zero2 { bucket_bytes: 2048 }));
        let layout = &results[0].layout;
        // The MLP: 13×30 + 30 + 30×13 + 13 = 823 f32 parameters.
        let param_bytes: u64 = layout.params.iter().map(|p| p.numel as u64 * 4).sum();
        assert_eq!(param_bytes, 823 * 4);
        let padded = layout.padded_bytes();
        let expected_padded = match world_size {
            // 390 → 2 × 195, 30 → 2 × 15, 390, 13 → 2 × 7.
            2 => (195 + 15 + 195 + 7) * 2 * 4,
            // 390 → 4 × 98, 30 → 4 × 8, 390, 13 → 4 × 4.
            _ => (98 + 8 + 98 + 4) * 4 * 4,
        };
        assert_eq!(padded, expected_padded);
        for result in &results {
            let step = result.last_step;
            assert_eq!(step.reduce_scatter.bytes, padded, "the gradients, once");
            assert_eq!(step.all_gather.bytes, padded, "the parameters, once");
            assert_eq!(step.all_reduce, CollectiveCount::default());
            assert_eq!(step.reduce_scatter.calls, step.all_gather.calls);
            // Plain data parallelism all-reduces the gradients: on a ring, the same bytes.
            let plain = CommStats {
                all_reduce: CollectiveCount {
                    calls: 1,
                    bytes: padded,
                },
                ..CommStats::default()
            };
            assert_eq!(
                step.ring_bytes_sent(world_size),
                plain.ring_bytes_sent(world_size)
            );
        }
    }
}

/// Allocated bytes of a tensor of `bytes`: the allocator's 512-byte rounding.
fn block(bytes: u64) -> i64 {
    bytes.div_ceil(512) as i64 * 512
}

/// What one rank's allocator saw in the second of two ZeRO-2 steps.
#[derive(Debug, Clone, Copy)]
struct StepMemory {
    /// Allocated after the step minus before the optimizer existed: the optimizer's state.
    state: i64,
    /// Allocated when backward starts minus after the previous step: the activations.
    activations: i64,
    /// The peak during backward, everything included.
    peak: i64,
    /// Allocated when backward starts (parameters, state, activations, the input).
    start: i64,
}

#[test]
fn zero2_holds_a_shard_of_the_state_and_gradients() {
    // Four 256×256 weights, each its own bucket (bucket_bytes 0), against small activations.
    const N_WEIGHTS: usize = 4;
    const SIDE: usize = 256;
    for world_size in [2, 4] {
        let ranks = InProcessGroup::ranks(world_size).unwrap();
        let measured: Vec<StepMemory> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|comm| {
                    scope.spawn(move || {
                        let cpu = Arc::new(CpuBackend::default());
                        let backend: BackendRef = cpu.clone();
                        let weights: Vec<Tensor> = (0..N_WEIGHTS)
                            .map(|i| {
                                let values: Vec<f64> = (0..SIDE * SIDE)
                                    .map(|j| ((i + j) as f64 * 1e-3).sin() * 0.05)
                                    .collect();
                                let w =
                                    Tensor::from_f64s(&backend, &values, &[SIDE, SIDE], DType::F32)
                                        .unwrap();
                                w.requires_grad_(true).unwrap();
                                w
                            })
                            .collect();
                        let x = Tensor::full(&backend, &[4, SIDE], 0.5, DType::F32).unwrap();
                        let rank = comm.rank() as f64;
                        let forward = || {
                            let mut h = x.mul_scalar(1.0 + rank).unwrap();
                            for w in &weights {
                                h = h.linear(w, None).unwrap().tanh().unwrap();
                            }
                            h.sum_all().unwrap()
                        };
                        let allocated = || backend.memory_stats().allocated_bytes.all.current;
                        let before = allocated();
                        let in_backward =
                            zero2_in_backward(weights.clone(), adamw(), Arc::new(comm), 0);
                        in_backward.backward(&forward()).unwrap();
                        let after_first = allocated();
                        let loss = forward();
                        let start = allocated();
                        cpu.allocator().reset_peak_stats();
                        in_backward.backward(&loss).unwrap();
                        let peak = backend.memory_stats().allocated_bytes.all.peak;
                        drop(loss);
                        assert!(weights.iter().all(|w| w.grad().is_none()));
                        StepMemory {
                            state: allocated() - before,
                            activations: start - after_first,
                            peak,
                            start,
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let param_bytes = block((SIDE * SIDE * 4) as u64);
        let params = N_WEIGHTS as i64 * param_bytes;
        let gradients = params;
        let shard_bytes = block((SIDE * SIDE * 4 / world_size) as u64);
        for (rank, memory) in measured.iter().enumerate() {
            // Adam's two moments per shard, exactly: 1/world_size of the replicated state, and
            // no shard copies (every shard is a view of its weight).
            assert_eq!(memory.state, N_WEIGHTS as i64 * 2 * shard_bytes);
            assert_eq!(
                memory.start,
                params + memory.state + memory.activations + block(4 * SIDE as u64 * 4)
            );
            // The target: parameters + (gradients + state) / N + activations + one bucket (the
            // input batch, 4 KiB, counted with the activations).
            let replicated_state = 2 * params;
            let bound = params
                + (gradients + replicated_state) / world_size as i64
                + memory.activations
                + block(4 * SIDE as u64 * 4)
                + param_bytes;
            assert!(
                memory.peak <= bound,
                "{world_size} ranks, rank {rank}: peak {} B over the bound {bound} B",
                memory.peak
            );
        }
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let mut ranks = InProcessGroup::ranks(1).unwrap();
    let comm: Arc<dyn Communicator> = Arc::new(ranks.remove(0));
    let cpu = CpuBackend::new_ref();
    let w = Tensor::ones(&cpu, &[4, 4], DType::F32).unwrap();
    w.requires_grad_(true).unwrap();
    let err = ShardedOptimizer::new(
        vec![ParamGroup::new(vec![w.clone()], AdafactorConfig::default())],
        Implementation::Single,
        Arc::clone(&comm),
        ShardConfig {
            bucket_bytes: 0,
            clipping: None,
        },
    )
    .unwrap_err();
    assert!(
        matches!(err, DistributedError::InvalidArgument { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("element-wise"), "{err}");
    let _ = Adafactor::new(
        vec![ParamGroup::new(vec![w.clone()], AdafactorConfig::default())],
        Implementation::Single,
    )
    .unwrap();
    let sharded = ShardedOptimizer::new(
        vec![ParamGroup::new(vec![w.clone()], adamw())],
        Implementation::Fused,
        comm,
        ShardConfig {
            bucket_bytes: 0,
            clipping: None,
        },
    )
    .unwrap();
    let err = sharded
        .into_in_backward(InBackwardConfig {
            clipping: Some(headroom_hooks::Clipping {
                max_norm: 1.0,
                norm: NormType::L2,
                mode: headroom_hooks::ClipMode::Exact,
            }),
            ..InBackwardConfig::default()
        })
        .unwrap_err();
    assert!(err.to_string().contains("ShardConfig::clipping"), "{err}");
}

#[test]
fn one_rank_is_the_plain_optimizer() {
    let run = Run::plain(1, Stage::Zero2 { bucket_bytes: 2048 });
    assert_bitwise(run);
    let _: &Model = &run
        .spec
        .build(&CpuBackend::new_ref(), DType::F32, 0)
        .unwrap();
}

#[test]
fn accumulation_and_clipping_together() {
    let zero1 = Run {
        accumulation: 2,
        clip: Some(0.05),
        ..Run::plain(2, Stage::Zero1)
    };
    let zero2 = Run {
        stage: Stage::Zero2 { bucket_bytes: 2048 },
        ..zero1
    };
    let (ones, twos) = (train(zero1), train(zero2));
    for (one, two) in ones.iter().zip(&twos) {
        assert_eq!(
            one.params, two.params,
            "ZeRO-1 and ZeRO-2 run the same sums"
        );
        assert_eq!(one.micro_steps, CommStats::default());
        assert_eq!(two.micro_steps, CommStats::default());
    }
    // The two differences above together (measured: 3.0e-7).
    let err = max_relative(&ones[0].params, &reference(zero1));
    assert!(err < 1e-6, "relative error {err:e}");
}
