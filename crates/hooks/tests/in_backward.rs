//! The optimizer in backward on the CPU backend: the same parameters as the plain loop to the
//! bit (every rule, every bucket size), gradient accumulation, LR trajectories, loss scaling
//! without partial updates, gradients that never pile up, and the typed errors.

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_hooks::{HooksError, InBackward, InBackwardConfig};
use headroom_nn::{Gpt2Config, VitConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::Bf16Rounding;
use headroom_optim::{
    DeviceGradScaling, Implementation, LossScaler, LrScheduler, OptimError, Optimizer, ParamGroup,
    Schedule, Sgd, SgdConfig, SkipFlag,
};
mod techniques;

use headroom_testkit::memory::{allocated, peak};
use headroom_testkit::{check_technique, train, ModelSpec, OptimSpec, TrainCase};
use techniques::{
    case, clipping, mlp, parameter_ulps, Accumulate, ClipAccumulate, ClipThenStep, FixedScale,
    StepInBackward,
};

#[test]
fn training_in_backward_equals_the_plain_loop_bit_for_bit() {
    let cpu = CpuBackend::new_ref();
    let gpt2 = ModelSpec::Gpt2 {
        config: Gpt2Config::tiny(),
        seq: 16,
    };
    let cases = [
        case(
            "vit, AdamW",
            ModelSpec::Vit(VitConfig::tiny()),
            OptimSpec::adamw(1e-3, 1e-2),
            20,
        ),
        case("gpt2, 8-bit Adam", gpt2, OptimSpec::adam8bit(1e-3), 20),
        case("gpt2, 4-bit AdamW", gpt2, OptimSpec::adamw4bit(1e-3), 20),
        case(
            "mlp, SGD momentum",
            mlp(),
            OptimSpec::sgd_momentum(1e-2, 0.9),
            20,
        ),
        case("mlp, Adafactor", mlp(), OptimSpec::adafactor(1e-2), 20),
        case(
            "mlp, Adam single",
            mlp(),
            OptimSpec::adam(1e-3).with_implementation(Implementation::Single),
            20,
        ),
    ];
    for case in &cases {
        for bucket_bytes in [0, 4096, headroom_hooks::DEFAULT_BUCKET_BYTES] {
            let config = InBackwardConfig {
                bucket_bytes,
                ..InBackwardConfig::default()
            };
            let report = check_technique(&cpu, case, &mut StepInBackward::new(config))
                .unwrap_or_else(|err| {
                    panic!("{} with buckets of {bucket_bytes} B: {err}", case.name)
                });
            assert_eq!(report.baseline_losses, report.technique_losses);
        }
    }
}

/// bf16 parameters without a master copy, rounded stochastically: the stream follows each
/// parameter's index and step, so stepping in backward keeps the plain loop's bits.
#[test]
fn bf16_parameters_rounded_stochastically_step_in_backward_as_in_the_plain_loop() {
    let cpu = CpuBackend::new_ref();
    let gpt2 = ModelSpec::Gpt2 {
        config: Gpt2Config::tiny(),
        seq: 16,
    };
    let stochastic = Bf16Rounding::Stochastic { seed: 7 };
    for (name, optimizer) in [
        ("gpt2 bf16, 8-bit Adam", OptimSpec::adam8bit(1e-3)),
        ("gpt2 bf16, 4-bit AdamW", OptimSpec::adamw4bit(1e-3)),
    ] {
        let case = TrainCase {
            dtype: DType::BF16,
            ..case(name, gpt2, optimizer.with_bf16_rounding(stochastic), 10)
        };
        for bucket_bytes in [0, 4096] {
            let config = InBackwardConfig {
                bucket_bytes,
                ..InBackwardConfig::default()
            };
            let report = check_technique(&cpu, &case, &mut StepInBackward::new(config))
                .unwrap_or_else(|err| panic!("{name} with buckets of {bucket_bytes} B: {err}"));
            assert_eq!(report.baseline_losses, report.technique_losses);
        }
    }
}

/// `OffloadedAdam` in backward on the CPU backend (the host steps in the call): the plain loop's
/// bits with the on-device optimizer, f32 and bf16.
#[test]
fn offloaded_adam_in_backward_equals_the_plain_loop() {
    let gpt2 = ModelSpec::Gpt2 {
        config: Gpt2Config::tiny(),
        seq: 16,
    };
    techniques::offloaded_in_backward_equals_the_plain_loop(&CpuBackend::new_ref(), gpt2, 10);
}

#[test]
fn accumulation_over_four_micro_batches_equals_plain_accumulation() {
    let cpu = CpuBackend::new_ref();
    for (optimizer, bound) in [
        (OptimSpec::sgd_momentum(1e-2, 0.9), 0),
        (OptimSpec::adamw(1e-3, 1e-2), 2),
    ] {
        let case = TrainCase {
            batch: 8,
            ..case("mlp", mlp(), optimizer, 6)
        };
        let plain = train(&cpu, &case, &mut Accumulate(4)).unwrap();
        let config = InBackwardConfig {
            accumulation: 4,
            bucket_bytes: 2048,
            ..InBackwardConfig::default()
        };
        let in_backward = train(&cpu, &case, &mut StepInBackward::new(config)).unwrap();
        assert!(
            parameter_ulps(&plain.parameters, &in_backward.parameters) <= bound,
            "{:?}: more than {bound} ulps",
            case.optimizer
        );
        assert_eq!(plain.losses, in_backward.losses);
    }
}

fn params(cpu: &BackendRef) -> Vec<Tensor> {
    (0..3)
        .map(|i| {
            let values: Vec<f64> = (0..32).map(|j| ((i * 32 + j) as f64 * 0.1).sin()).collect();
            let t = Tensor::from_f64s(cpu, &values, &[32], DType::F32).unwrap();
            t.requires_grad_(true).unwrap();
            t
        })
        .collect()
}

fn sgd(params: Vec<Tensor>, lr: f64) -> Sgd {
    Sgd::new(
        vec![ParamGroup::new(params, SgdConfig::new(lr))],
        Implementation::Fused,
    )
    .unwrap()
}

fn loss_of(params: &[Tensor]) -> Tensor {
    let mut total = params[0].mul(&params[0]).unwrap().sum_all().unwrap();
    for p in &params[1..] {
        total = total.add(&p.mul(p).unwrap().sum_all().unwrap()).unwrap();
    }
    total
}

#[test]
fn one_scheduler_drives_the_model_as_on_the_plain_optimizer() {
    let cpu = CpuBackend::new_ref();
    let schedules = [
        Schedule::Step {
            step_size: 7,
            gamma: 0.5,
        },
        Schedule::Cosine {
            t_max: 100,
            eta_min: 1e-5,
        },
        Schedule::LinearWarmup {
            start_factor: 0.1,
            warmup_steps: 20,
        },
    ];
    for schedule in schedules {
        let mut plain = sgd(params(&cpu), 0.1);
        let mut scheduler = LrScheduler::new(schedule.clone(), &mut plain).unwrap();
        let mut expected = Vec::new();
        for _ in 0..100 {
            loss_of(
                &plain
                    .params()
                    .into_iter()
                    .map(|(_, p)| p)
                    .collect::<Vec<_>>(),
            )
            .backward()
            .unwrap();
            plain.step().unwrap();
            plain.zero_grad(true).unwrap();
            scheduler.step(&mut plain);
            expected.push(plain.lr(0));
        }
        let ps = params(&cpu);
        let in_backward =
            InBackward::new(Box::new(sgd(ps.clone(), 0.1)), InBackwardConfig::default()).unwrap();
        in_backward.set_lr_scheduler(schedule.clone()).unwrap();
        let mut got = Vec::new();
        for _ in 0..100 {
            in_backward.backward(&loss_of(&ps)).unwrap();
            got.push(in_backward.lr(0));
        }
        assert_eq!(got, expected, "{schedule:?}");
        // And the parameters followed the same rates.
        let plain_params: Vec<Vec<f32>> = plain
            .params()
            .iter()
            .map(|(_, p)| p.to_vec::<f32>().unwrap())
            .collect();
        let ours: Vec<Vec<f32>> = ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
        assert_eq!(ours, plain_params);
    }
}

#[test]
fn a_scaled_loss_with_an_overflow_updates_nothing() {
    let cpu = CpuBackend::new_ref();
    let ps = params(&cpu);
    let reference = params(&cpu);
    let mut plain = sgd(reference.clone(), 0.05);
    let in_backward =
        InBackward::new(Box::new(sgd(ps.clone(), 0.05)), InBackwardConfig::default()).unwrap();
    let mut scaler = FixedScale::new(&ps[0], 1024.0);
    // A finite step: the gradients of 1024·loss, unscaled in the kernel, are the plain ones.
    let skipped = in_backward
        .backward_scaled(&loss_of(&ps), &mut scaler)
        .unwrap();
    assert!(matches!(skipped, SkipFlag::Known(false)));
    loss_of(&reference).backward().unwrap();
    plain.step().unwrap();
    plain.zero_grad(true).unwrap();
    for (p, r) in ps.iter().zip(&reference) {
        assert_eq!(p.to_vec::<f32>().unwrap(), r.to_vec::<f32>().unwrap());
    }
    // An overflow in one gradient: no parameter moves, not even those stepped before it.
    let before: Vec<Vec<f32>> = ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    let inf = Tensor::full(&cpu, &[], f64::INFINITY, DType::F32).unwrap();
    let poisoned = loss_of(&ps)
        .add(&ps[1].sum_all().unwrap().mul(&inf).unwrap())
        .unwrap();
    let skipped = in_backward.backward_scaled(&poisoned, &mut scaler).unwrap();
    assert!(matches!(skipped, SkipFlag::Known(true)));
    let flags: Vec<Vec<f32>> = scaler.closed.iter().map(|f| f.to_vec().unwrap()).collect();
    assert_eq!(flags, [[0.0], [1.0]], "each step closed with its own flag");
    let after: Vec<Vec<f32>> = ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    assert_eq!(after, before);
    assert!(
        ps.iter().all(|p| p.grad().is_none()),
        "gradients are freed anyway"
    );
}

/// A loss scaler that opens its steps with whatever scale it was given, and leaves the loss as
/// it is (so only the scale's check can refuse it).
#[derive(Debug)]
struct OddScale(Tensor);

impl LossScaler for OddScale {
    fn scale_loss(&mut self, loss: &Tensor) -> Result<Tensor, OptimError> {
        Ok(loss.clone())
    }

    fn begin_step(&mut self) -> Result<Option<DeviceGradScaling>, OptimError> {
        Ok(Some(DeviceGradScaling {
            grad_scale: Some(self.0.clone()),
            found_inf: Some(Tensor::zeros(self.0.backend(), &[1], DType::F32)?),
        }))
    }

    fn end_step(&mut self, _: &DeviceGradScaling) -> Result<(), OptimError> {
        Ok(())
    }
}

/// The loss scale a scaler opens a step with is one f32 element, as on CUDA: a 2-element or f64
/// scale is a typed error before anything runs (the CPU path used to read element 0 of whatever
/// it was given), and the parameters and gradients are left as they were.
#[test]
fn a_loss_scale_that_is_not_one_f32_is_refused() {
    let cpu = CpuBackend::new_ref();
    let ps = params(&cpu);
    let before: Vec<Vec<f32>> = ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    let in_backward =
        InBackward::new(Box::new(sgd(ps.clone(), 0.05)), InBackwardConfig::default()).unwrap();
    for scale in [
        Tensor::from_slice(&cpu, &[1024.0f64, 7.0], &[2]).unwrap(),
        Tensor::from_slice(&cpu, &[1024.0f64], &[1]).unwrap(),
        Tensor::from_slice(&cpu, &[1024.0f32, 1024.0], &[2]).unwrap(),
    ] {
        let err = in_backward
            .backward_scaled(&loss_of(&ps), &mut OddScale(scale.clone()))
            .unwrap_err();
        assert!(
            matches!(err, HooksError::InvalidArgument { .. }),
            "{:?} {:?}: {err}",
            scale.dtype(),
            scale.shape()
        );
    }
    let after: Vec<Vec<f32>> = ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    assert_eq!(after, before);
    assert_eq!(
        in_backward.stats(),
        Default::default(),
        "nothing was stepped"
    );
}

#[test]
fn gradients_never_pile_up() {
    let cpu = Arc::new(CpuBackend::default());
    let backend: BackendRef = cpu.clone();
    // Four 256×256 weights (256 KiB each) and a batch of 4 rows.
    let weights: Vec<Tensor> = (0..4)
        .map(|i| {
            let values: Vec<f64> = (0..256 * 256)
                .map(|j| ((i + j) as f64 * 1e-3).sin() * 0.05)
                .collect();
            let w = Tensor::from_f64s(&backend, &values, &[256, 256], DType::F32).unwrap();
            w.requires_grad_(true).unwrap();
            w
        })
        .collect();
    let x = Tensor::full(&backend, &[4, 256], 0.5, DType::F32).unwrap();
    let forward = |weights: &[Tensor]| {
        let mut h = x.clone();
        for w in weights {
            h = h.linear(w, None).unwrap().tanh().unwrap();
        }
        h.sum_all().unwrap()
    };
    let grad_bytes = 256 * 256 * 4;
    // The plain loop: every gradient is alive at the end of backward.
    let mut plain = sgd(weights.clone(), 1e-3);
    let loss = forward(&weights);
    let base = allocated(&backend);
    cpu.allocator().reset_peak_stats();
    loss.backward().unwrap();
    let plain_peak = peak(&cpu) - base;
    // (The activations freed during backward, a few KiB, come off the base.)
    assert!(
        plain_peak > 3 * grad_bytes + grad_bytes / 2,
        "plain peak {plain_peak}"
    );
    plain.step().unwrap();
    plain.zero_grad(true).unwrap();
    drop(loss);
    // In backward, buckets of one parameter: at most one weight gradient at a time.
    let in_backward = InBackward::new(
        Box::new(plain),
        InBackwardConfig {
            bucket_bytes: 0,
            ..InBackwardConfig::default()
        },
    )
    .unwrap();
    let loss = forward(&weights);
    let base = allocated(&backend);
    cpu.allocator().reset_peak_stats();
    in_backward.backward(&loss).unwrap();
    let ours = peak(&cpu) - base;
    assert!(
        ours < 2 * grad_bytes,
        "in-backward peak {ours} B above the forward's, plain {plain_peak} B"
    );
    assert!(weights.iter().all(|w| w.grad().is_none()));
    assert_eq!(in_backward.stats().buckets, 4);
    drop(in_backward);
    // A bucket is stepped before the next gradient would take it past its size: with room for
    // one and a half gradients, never two at once (the pass before teaches the firing order);
    // with room for exactly two, buckets of two.
    for (bucket_bytes, buckets_per_pass) in [(grad_bytes * 3 / 2, 4), (2 * grad_bytes, 2)] {
        let in_backward = InBackward::new(
            Box::new(sgd(weights.clone(), 1e-3)),
            InBackwardConfig {
                bucket_bytes: bucket_bytes as u64,
                ..InBackwardConfig::default()
            },
        )
        .unwrap();
        for pass in 1..=2u64 {
            let loss = forward(&weights);
            let base = allocated(&backend);
            cpu.allocator().reset_peak_stats();
            in_backward.backward(&loss).unwrap();
            let ours = peak(&cpu) - base;
            let held = if buckets_per_pass == 4 { 1 } else { 2 };
            assert!(
                ours < (held + 1) * grad_bytes,
                "bucket {bucket_bytes} B, pass {pass}: peak {ours} B above the forward's"
            );
            assert_eq!(in_backward.stats().buckets, buckets_per_pass * pass);
        }
    }
}

#[test]
fn misuse_is_a_typed_error_and_unused_parameters_are_counted() {
    let cpu = CpuBackend::new_ref();
    let ps = params(&cpu);
    let first =
        InBackward::new(Box::new(sgd(ps.clone(), 0.1)), InBackwardConfig::default()).unwrap();
    // The same parameters in a second InBackward.
    let err =
        InBackward::new(Box::new(sgd(ps.clone(), 0.1)), InBackwardConfig::default()).unwrap_err();
    assert!(
        matches!(err, HooksError::AlreadyRegistered { index: 0 }),
        "{err}"
    );
    // Stepping by hand does not compile: an InBackward is not an Optimizer.
    // An unused parameter is not updated, and counted.
    let unused_before = ps[2].to_vec::<f32>().unwrap();
    first.backward(&loss_of(&ps[..2])).unwrap();
    assert_eq!(ps[2].to_vec::<f32>().unwrap(), unused_before);
    assert_eq!(first.stats().params_without_grad, 1);
    drop(first);
    // Dropped: the parameters can be claimed again, and are no longer stepped in backward.
    let again = InBackward::new(Box::new(sgd(ps.clone(), 0.1)), InBackwardConfig::default());
    assert!(again.is_ok());
    drop(again);
    let before = ps[0].to_vec::<f32>().unwrap();
    loss_of(&ps).backward().unwrap();
    assert_eq!(ps[0].to_vec::<f32>().unwrap(), before);
    assert!(ps[0].grad().is_some());

    // A parameter that does not require grad.
    let frozen = Tensor::zeros(&cpu, &[4], DType::F32).unwrap();
    let err = InBackward::new(
        Box::new(sgd(vec![frozen], 0.1)),
        InBackwardConfig::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, HooksError::DoesNotRequireGrad { index: 0 }),
        "{err}"
    );
    // Exact clipping needs InBackward::backward.
    let fresh = params(&cpu);
    let clipping = InBackward::new(
        Box::new(sgd(fresh.clone(), 0.1)),
        InBackwardConfig {
            clipping: Some(headroom_hooks::Clipping {
                max_norm: 1.0,
                norm: headroom_optim::NormType::L2,
                mode: headroom_hooks::ClipMode::Exact,
            }),
            ..InBackwardConfig::default()
        },
    )
    .unwrap();
    let err = loss_of(&fresh).backward().unwrap_err();
    assert!(err.to_string().contains("InBackward::backward"), "{err}");
    drop(clipping);
    let err = InBackward::new(
        Box::new(sgd(params(&cpu), 0.1)),
        InBackwardConfig {
            accumulation: 0,
            ..InBackwardConfig::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, HooksError::InvalidArgument { .. }), "{err}");
}

#[test]
fn exact_clipping_in_backward_is_within_two_ulps_of_clip_grad_norm_then_step() {
    use headroom_hooks::ClipMode;
    use headroom_optim::NormType;
    let cpu = CpuBackend::new_ref();
    for (optimizer, norm, max_norm) in [
        (OptimSpec::adamw(1e-3, 1e-2), NormType::L2, 0.05),
        (OptimSpec::sgd_momentum(1e-2, 0.9), NormType::L2, 0.05),
        (OptimSpec::sgd(1e-2), NormType::Inf, 0.01),
    ] {
        for accumulation in [1, 2] {
            let case = TrainCase {
                batch: 8,
                ..case(
                    "vit",
                    ModelSpec::Vit(VitConfig::tiny()),
                    optimizer.clone(),
                    20,
                )
            };
            let reference = if accumulation == 1 {
                train(&cpu, &case, &mut ClipThenStep { max_norm, norm }).unwrap()
            } else {
                train(
                    &cpu,
                    &case,
                    &mut ClipAccumulate {
                        max_norm,
                        norm,
                        k: accumulation,
                    },
                )
                .unwrap()
            };
            let config = InBackwardConfig {
                accumulation,
                ..clipping(max_norm, norm, ClipMode::Exact)
            };
            let ours = train(&cpu, &case, &mut StepInBackward::new(config)).unwrap();
            let ulps = parameter_ulps(&reference.parameters, &ours.parameters);
            assert!(
                ulps <= 2,
                "{optimizer:?} {norm:?} k={accumulation}: {ulps} ulps"
            );
        }
    }
}

#[test]
fn previous_step_clipping_trains_like_exact_clipping() {
    use headroom_hooks::ClipMode;
    use headroom_optim::NormType;
    let cpu = CpuBackend::new_ref();
    let case = TrainCase {
        batch: 8,
        ..case(
            "vit",
            ModelSpec::Vit(VitConfig::tiny()),
            OptimSpec::adamw(3e-3, 1e-2),
            40,
        )
    };
    let exact = train(
        &cpu,
        &case,
        &mut StepInBackward::new(clipping(0.5, NormType::L2, ClipMode::Exact)),
    )
    .unwrap();
    let previous = train(
        &cpu,
        &case,
        &mut StepInBackward::new(clipping(0.5, NormType::L2, ClipMode::PreviousStep)),
    )
    .unwrap();
    let tail = |losses: &[f64]| losses[30..].iter().sum::<f64>() / 10.0;
    let (a, b) = (tail(&exact.losses), tail(&previous.losses));
    println!(
        "ViT-tiny, AdamW 3e-3, max_norm 0.5, 40 steps: mean loss of steps 30-39 exact {a:.5}, \
         previous-step {b:.5} ({:+.2}%); first losses {:.4} / {:.4}",
        100.0 * (b - a) / a,
        exact.losses[0],
        previous.losses[0]
    );
    assert!((b - a).abs() <= 0.02 * a.abs(), "{a} vs {b}");
}

#[test]
fn a_failed_backward_leaves_nothing_pending_for_the_next() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let cpu = CpuBackend::new_ref();
    let (ours, reference) = (params(&cpu), params(&cpu));
    let in_backward = InBackward::new(
        Box::new(sgd(ours.clone(), 0.1)),
        InBackwardConfig::default(),
    )
    .unwrap();
    let fail_once = Arc::new(AtomicBool::new(true));
    let loss_failing_once = |ps: &[Tensor]| {
        let last = ps[2].mul(&ps[2]).unwrap();
        let fail = Arc::clone(&fail_once);
        last.register_hook(move |_| {
            if fail.swap(false, Ordering::SeqCst) {
                return Err(headroom_autograd_core::TensorError::InvalidArgument {
                    op: "test hook",
                    reason: "fails once".into(),
                });
            }
            Ok(None)
        })
        .unwrap();
        loss_of(&ps[..2]).add(&last.sum_all().unwrap()).unwrap()
    };
    // The first backward fails after the first two gradients joined the pending bucket.
    assert!(in_backward.backward(&loss_failing_once(&ours)).is_err());
    for p in &ours {
        p.zero_grad(true).unwrap();
    }
    // The next one steps every parameter once, as one plain SGD step does.
    in_backward.backward(&loss_failing_once(&ours)).unwrap();
    let mut plain = sgd(reference.clone(), 0.1);
    loss_of(&reference).backward().unwrap();
    plain.step().unwrap();
    for (a, b) in ours.iter().zip(&reference) {
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    }
    assert_eq!(in_backward.stats().steps, 1);
}
