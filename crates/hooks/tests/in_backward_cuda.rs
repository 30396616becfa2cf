//! The optimizer in backward on the CUDA backend: 20 steps of ViT-tiny give the plain loop's
//! parameters bit for bit (fused AdamW at two bucket sizes, 8-bit Adam, 4-bit AdamW; the
//! block-wise rules on bf16 parameters rounded stochastically too), exact clipping gives
//! `clip_grad_norm_` then a step, accumulation over four micro-batches gives plain accumulation,
//! a scaled loss is unscaled in the fused kernels from device tensors, skipping the whole step
//! on an overflow, and fused AdamW in backward replays from a CUDA graph bit for bit. Each test
//! is marked `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.

mod techniques;

use headroom_autograd_core::{BackendRef, DType, Tensor, TensorError};
use headroom_hooks::{ClipMode, InBackward, InBackwardConfig};
use headroom_nn::VitConfig;
use headroom_ops_cuda::{CudaBackend, GraphedStep, StepRun};
use headroom_optim::kernels::Bf16Rounding;
use headroom_optim::{Adam, AdamConfig, Implementation, NormType, Optimizer, ParamGroup, SkipFlag};
use headroom_testkit::gpu::{backend_or_skip, exclusive_device};
use headroom_testkit::{check_technique, train, ModelSpec, OptimSpec, Tolerance, TrainCase};
use techniques::{clipping, parameter_ulps, Accumulate, ClipThenStep, FixedScale, StepInBackward};

#[test]
#[ignore = "needs a CUDA device"]
fn twenty_steps_in_backward_on_the_gpu_equal_the_plain_loop_bit_for_bit() {
    let _device = exclusive_device();
    let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    // bf16 parameters without a master copy, rounded stochastically (8- and 4-bit rules).
    let stochastic = Bf16Rounding::Stochastic { seed: 7 };
    for (optimizer, bucket_bytes, dtype) in [
        (OptimSpec::adamw(1e-3, 1e-2), 4096, DType::F32),
        (
            OptimSpec::adamw(1e-3, 1e-2),
            headroom_hooks::DEFAULT_BUCKET_BYTES,
            DType::F32,
        ),
        (OptimSpec::adam8bit(1e-3), 4096, DType::F32),
        (OptimSpec::adamw4bit(1e-3), 4096, DType::F32),
        (
            OptimSpec::adam8bit(1e-3).with_bf16_rounding(stochastic),
            4096,
            DType::BF16,
        ),
        (
            OptimSpec::adamw4bit(1e-3).with_bf16_rounding(stochastic),
            4096,
            DType::BF16,
        ),
    ] {
        let case = TrainCase {
            name: "vit-tiny on CUDA",
            model: ModelSpec::Vit(VitConfig::tiny()),
            dtype,
            batch: 4,
            steps: 20,
            optimizer,
            tolerance: Tolerance::Bitwise {
                why: "each parameter's update is the same fused kernel on the same gradient, \
                      whatever bucket it is stepped in",
            },
            seed: 2,
        };
        let mut technique = StepInBackward::new(InBackwardConfig {
            bucket_bytes,
            ..InBackwardConfig::default()
        });
        let report = check_technique(&cuda, &case, &mut technique).unwrap_or_else(|err| {
            panic!(
                "{:?} {dtype:?}, buckets of {bucket_bytes} B: {err}",
                case.optimizer
            )
        });
        assert_eq!(report.baseline_losses, report.technique_losses);
    }
}

/// `OffloadedAdam` in backward on CUDA, stepped by the host (gradients out on a side stream, the
/// host thread steps each bucket as its copy lands, parameters back on a second stream, joined at
/// the end of backward) and by the device (the moments streamed in and out): 20 steps of ViT-tiny give the plain loop's bits with the on-device CUDA optimizer,
/// f32 (fused AdamW) and bf16 (`AdamStochastic`).
#[test]
#[ignore = "needs a CUDA device"]
fn offloaded_adam_in_backward_on_the_gpu_equals_the_plain_loop() {
    let _device = exclusive_device();
    let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    techniques::offloaded_in_backward_equals_the_plain_loop(
        &cuda,
        ModelSpec::Vit(VitConfig::tiny()),
        20,
    );
    println!(
        "OffloadedAdam in backward on CUDA, stepped by the host and by the device: f32 and bf16, \
         two bucket sizes, bitwise"
    );
}

fn weights(cuda: &BackendRef) -> Vec<Tensor> {
    (0..3)
        .map(|i| {
            let values: Vec<f64> = (0..4096)
                .map(|j| ((i * 4096 + j) as f64 * 0.01).sin())
                .collect();
            let w = Tensor::from_f64s(cuda, &values, &[4096], DType::F32).unwrap();
            w.requires_grad_(true).unwrap();
            w
        })
        .collect()
}

fn adam(params: Vec<Tensor>) -> Adam {
    Adam::new(
        vec![ParamGroup::new(params, AdamConfig::adamw())],
        Implementation::Fused,
    )
    .unwrap()
}

fn loss_of(params: &[Tensor]) -> Tensor {
    let mut total = params[0].mul(&params[0]).unwrap().sum_all().unwrap();
    for p in &params[1..] {
        total = total.add(&p.exp().unwrap().sum_all().unwrap()).unwrap();
    }
    total
}

/// Fused AdamW in backward inside a CUDA graph: the forward, the backward and every bucket's
/// step are captured once and replayed; each replay steps at its own step number, so 20 steps
/// equal the plain eager loop bit for bit.
#[test]
#[ignore = "needs a CUDA device"]
fn in_backward_steps_replayed_from_a_cuda_graph_equal_the_plain_loop_bit_for_bit() {
    // The capture needs the device to itself: every test of this file holds it.
    let _device = exclusive_device();
    let Some(device) = headroom_testkit::gpu::cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let cuda: BackendRef = device.clone();
    let (ours, reference) = (weights(&cuda), weights(&cuda));
    let mut plain = adam(reference.clone());
    let in_backward = InBackward::new(
        Box::new(adam(ours.clone())),
        InBackwardConfig {
            bucket_bytes: 4096,
            ..InBackwardConfig::default()
        },
    )
    .unwrap();
    let mut graph = GraphedStep::new(&device, 3);
    let mut runs = Vec::new();
    for _ in 0..20 {
        let mut body = || {
            in_backward
                .backward(&loss_of(&ours))
                .map_err(|e| TensorError::Device {
                    op: "in_backward",
                    reason: e.to_string(),
                })
        };
        runs.push(graph.run(&[], &mut body).unwrap());
        loss_of(&reference).backward().unwrap();
        plain.step().unwrap();
        plain.zero_grad(true).unwrap();
    }
    let mut expected = vec![StepRun::Eager; 3];
    expected.push(StepRun::Captured);
    expected.resize(20, StepRun::Replayed);
    assert_eq!(runs, expected, "{:?}", graph.eager_reason());
    for (a, b) in ours.iter().zip(&reference) {
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_scaled_loss_is_unscaled_on_the_device_and_an_overflow_skips_the_whole_step() {
    let _device = exclusive_device();
    let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let (ours, reference) = (weights(&cuda), weights(&cuda));
    let mut plain = adam(reference.clone());
    let in_backward = InBackward::new(
        Box::new(adam(ours.clone())),
        InBackwardConfig {
            bucket_bytes: 0,
            ..InBackwardConfig::default()
        },
    )
    .unwrap();
    let mut scaler = FixedScale::new(&ours[0], 65536.0);
    for _ in 0..3 {
        let skipped = in_backward
            .backward_scaled(&loss_of(&ours), &mut scaler)
            .unwrap();
        loss_of(&reference).backward().unwrap();
        plain.step().unwrap();
        plain.zero_grad(true).unwrap();
        assert!(matches!(skipped, SkipFlag::OnDevice(_)), "nothing waits");
        assert!(!skipped.read().unwrap());
    }
    for (a, b) in ours.iter().zip(&reference) {
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    }
    let before: Vec<Vec<f32>> = ours.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    let nan = Tensor::full(&cuda, &[], f64::NAN, DType::F32).unwrap();
    let poisoned = loss_of(&ours)
        .add(&ours[2].sum_all().unwrap().mul(&nan).unwrap())
        .unwrap();
    let skipped = in_backward.backward_scaled(&poisoned, &mut scaler).unwrap();
    assert!(skipped.read().unwrap());
    assert_eq!(scaler.closed.len(), 4);
    let after: Vec<Vec<f32>> = ours.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    assert_eq!(
        after, before,
        "no parameter moved, not even those stepped before the NaN"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn exact_clipping_and_accumulation_on_the_gpu_match_the_plain_loops() {
    let _device = exclusive_device();
    let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let vit = |optimizer: OptimSpec| TrainCase {
        name: "vit-tiny on CUDA",
        model: ModelSpec::Vit(VitConfig::tiny()),
        dtype: DType::F32,
        batch: 8,
        steps: 20,
        optimizer,
        tolerance: Tolerance::Ulps {
            max: 2,
            why: "compared with train() below",
        },
        seed: 4,
    };
    for (optimizer, norm) in [
        (OptimSpec::adamw(1e-3, 1e-2), NormType::L2),
        (OptimSpec::sgd_momentum(1e-2, 0.9), NormType::Inf),
    ] {
        let case = vit(optimizer);
        let reference = train(
            &cuda,
            &case,
            &mut ClipThenStep {
                max_norm: 0.05,
                norm,
            },
        )
        .unwrap();
        let config = clipping(0.05, norm, ClipMode::Exact);
        let ours = train(&cuda, &case, &mut StepInBackward::new(config)).unwrap();
        let ulps = parameter_ulps(&reference.parameters, &ours.parameters);
        assert!(
            ulps <= 2,
            "exact clipping, {:?}: {ulps} ulps",
            case.optimizer
        );
    }
    for optimizer in [
        OptimSpec::sgd_momentum(1e-2, 0.9),
        OptimSpec::adamw(1e-3, 1e-2),
    ] {
        let case = vit(optimizer);
        let reference = train(&cuda, &case, &mut Accumulate(4)).unwrap();
        let config = InBackwardConfig {
            accumulation: 4,
            bucket_bytes: 4096,
            ..InBackwardConfig::default()
        };
        let ours = train(&cuda, &case, &mut StepInBackward::new(config)).unwrap();
        let ulps = parameter_ulps(&reference.parameters, &ours.parameters);
        assert!(ulps <= 2, "accumulation, {:?}: {ulps} ulps", case.optimizer);
    }
}
