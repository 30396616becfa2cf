//! The optimizers on CUDA tensors against the same optimizers on CPU tensors: every rule and
//! implementation bit for bit on random data (Adafactor within a few ulps: its two norms are
//! f64 sums in another order), host- and device-valued gradient scaling with device-counted
//! skips, SGD and Adam on bf16 and f16 parameters bit for bit with the CPU, bf16 Adam with
//! stochastic rounding bit for bit with the CPU (device-skipped steps included), and typed errors
//! for tensors a step cannot take. The memory each implementation holds is
//! `cuda_optim_memory.rs`'s, a GradScaler's overflow check `cuda_overflow_check.rs`'s. Each test
//! is marked `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

mod cuda_tensors;

use std::num::NonZeroUsize;

use headroom_autograd_core::{BackendRef, DType, Device, Tensor};
use headroom_optim::kernels::GradScaling;
use headroom_optim::{
    AdafactorConfig, Adam, Adam4bitConfig, Adam8bitConfig, AdamConfig, AdamStochastic,
    AdamStochasticConfig, DeviceGradScaling, GroupOptimizer, Implementation, OptimError, Optimizer,
    ParamGroup, Scaling, SgdConfig, StepParams, UpdateRule,
};
use headroom_testkit::ulps::max_ulps;

use cuda_tensors::{
    device_scaled_step, random, raw_bytes, scaled_step, shared_cuda_and_cpu, tensor_of,
};

/// Shapes with a tail off every vector width, a tensor over a fused block (65,536 elements),
/// a matrix, and one under 8-bit Adam's `min_8bit_size`.
const SHAPES: [&[usize]; 4] = [&[37], &[70_001], &[300, 257], &[5000]];

fn implementations() -> [Implementation; 5] {
    [
        Implementation::Single,
        Implementation::FOREACH,
        Implementation::Foreach {
            chunk: NonZeroUsize::new(1000).unwrap(),
        },
        Implementation::ForeachUnbounded,
        Implementation::Fused,
    ]
}

/// The params and states of one run, as bytes.
fn snapshot<R: UpdateRule>(optimizer: &GroupOptimizer<R>, params: &[Tensor]) -> Vec<Vec<u8>> {
    let mut res: Vec<Vec<u8>> = params.iter().map(raw_bytes).collect();
    for idx in 0..params.len() {
        for (_, tensor) in optimizer.param_state(0, idx) {
            res.push(raw_bytes(&tensor));
        }
    }
    res
}

/// The largest ulp distance between two snapshots (f32 buffers; u8 codes must be equal).
fn snapshot_ulps(a: &[Vec<u8>], b: &[Vec<u8>]) -> u32 {
    assert_eq!(a.len(), b.len());
    let floats = |bytes: &[u8]| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let mut worst = 0;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        if x.len() % 4 != 0 {
            assert_eq!(x, y, "codes differ");
            continue;
        }
        worst = worst.max(max_ulps(&floats(x), &floats(y)));
    }
    worst
}

/// Three steps of `config` with `implementation` over random parameters and gradients of
/// `SHAPES` and `dtype` on `backend`; gradients carry `grad_scale` (unscaled by the kernels) when
/// given.
fn run<R: UpdateRule>(
    backend: &BackendRef,
    config: &R,
    (implementation, dtype): (Implementation, DType),
    grad_scale: Option<f32>,
) -> Vec<Vec<u8>> {
    let params: Vec<Tensor> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            tensor_of(backend, &random(i as u64 + 1, n, 2.0), shape, dtype)
        })
        .collect();
    let mut optimizer = GroupOptimizer::new(
        vec![ParamGroup::new(params.clone(), config.clone())],
        implementation,
    )
    .unwrap();
    for step in 0..3u64 {
        for (i, (param, shape)) in params.iter().zip(SHAPES).enumerate() {
            let n = shape.iter().product();
            let mut grad = random(100 * step + i as u64 + 7, n, 0.2);
            if let Some(scale) = grad_scale {
                grad.iter_mut().for_each(|g| *g *= scale);
            }
            param
                .set_grad(Some(tensor_of(backend, &grad, shape, dtype)))
                .unwrap();
        }
        let scaling = GradScaling {
            grad_scale,
            found_inf: None,
        };
        optimizer
            .step_with(StepParams::All, Scaling::Host(scaling))
            .unwrap();
    }
    snapshot(&optimizer, &params)
}

/// Runs `config` on both devices with every implementation it has and checks the ulp distance.
fn compare<R: UpdateRule>(name: &str, config: R, implementations: &[Implementation], ulps: u32) {
    compare_dtype(name, config, implementations, DType::F32, ulps);
}

/// [`compare`] on parameters of `dtype` (bf16 and f16 compare bytes: `ulps` must be 0).
fn compare_dtype<R: UpdateRule>(
    name: &str,
    config: R,
    implementations: &[Implementation],
    dtype: DType,
    ulps: u32,
) {
    let Some((cuda, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    for &implementation in implementations {
        let scales: &[Option<f32>] = match implementation {
            Implementation::Fused => &[None, Some(1024.0)],
            _ => &[None],
        };
        for &scale in scales {
            let want = run(&cpu, &config, (implementation, dtype), scale);
            let got = run(&cuda, &config, (implementation, dtype), scale);
            let distance = snapshot_ulps(&want, &got);
            if dtype != DType::F32 {
                assert!(
                    ulps == 0 && want == got,
                    "{name} {dtype:?} {implementation:?}"
                );
            }
            println!(
                "{name} {dtype:?} {implementation:?} scale {scale:?}: {distance} ulps from the CPU"
            );
            assert!(
                distance <= ulps,
                "{name} {implementation:?} scale {scale:?}: {distance} ulps"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn sgd_on_cuda_equals_the_cpu() {
    let configs = [
        ("sgd", SgdConfig::new(0.1)),
        (
            "sgd_momentum_dampening_wd",
            SgdConfig {
                momentum: 0.9,
                dampening: 0.1,
                weight_decay: 1e-2,
                ..SgdConfig::new(0.05)
            },
        ),
        (
            "sgd_nesterov_maximize",
            SgdConfig {
                momentum: 0.8,
                nesterov: true,
                weight_decay: 1e-3,
                maximize: true,
                ..SgdConfig::new(0.05)
            },
        ),
    ];
    for (name, config) in configs {
        compare(name, config, &implementations(), 0);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn adam_on_cuda_equals_the_cpu() {
    let configs = [
        ("adam", AdamConfig::adam()),
        (
            "adam_l2_maximize",
            AdamConfig {
                weight_decay: 1e-2,
                maximize: true,
                ..AdamConfig::adam()
            },
        ),
        (
            "adam_amsgrad",
            AdamConfig {
                amsgrad: true,
                lr: 3e-3,
                ..AdamConfig::adam()
            },
        ),
        ("adamw", AdamConfig::adamw()),
        (
            "adamw_amsgrad_maximize",
            AdamConfig {
                amsgrad: true,
                maximize: true,
                ..AdamConfig::adamw()
            },
        ),
    ];
    for (name, config) in configs {
        compare(name, config, &implementations(), 0);
    }
}

/// SGD and Adam on bf16 and f16 parameters: states of the parameter's dtype, the same roundings
/// on both devices, so the same bits.
#[test]
#[ignore = "needs a CUDA device"]
fn half_sgd_and_adam_on_cuda_equal_the_cpu() {
    for dtype in [DType::BF16, DType::F16] {
        let sgd = [
            ("sgd", SgdConfig::new(0.1)),
            (
                "sgd_momentum_dampening_wd",
                SgdConfig {
                    momentum: 0.9,
                    dampening: 0.1,
                    weight_decay: 1e-2,
                    ..SgdConfig::new(0.05)
                },
            ),
            (
                "sgd_nesterov_maximize",
                SgdConfig {
                    momentum: 0.8,
                    nesterov: true,
                    weight_decay: 1e-3,
                    maximize: true,
                    ..SgdConfig::new(0.05)
                },
            ),
        ];
        for (name, config) in sgd {
            compare_dtype(name, config, &implementations(), dtype, 0);
        }
        let adam = [
            (
                "adam_l2_maximize",
                AdamConfig {
                    weight_decay: 1e-2,
                    maximize: true,
                    ..AdamConfig::adam()
                },
            ),
            ("adamw", AdamConfig::adamw()),
            (
                "adamw_amsgrad_maximize",
                AdamConfig {
                    amsgrad: true,
                    maximize: true,
                    ..AdamConfig::adamw()
                },
            ),
        ];
        for (name, config) in adam {
            compare_dtype(name, config, &implementations(), dtype, 0);
        }
    }
}

/// bf16 Adam with stochastic rounding: the same random bits and the same roundings on both
/// devices, with and without a gradient scale, and with steps a device GradScaler skips (the
/// random stream follows the true step).
#[test]
#[ignore = "needs a CUDA device"]
fn stochastic_adam_on_cuda_equals_the_cpu() {
    let config = AdamStochasticConfig::new(AdamConfig::adamw(), 42);
    compare_dtype(
        "adam_stochastic",
        config.clone(),
        &[Implementation::Fused],
        DType::BF16,
        0,
    );
    let Some((cuda_ref, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    let mut snapshots = Vec::new();
    for backend in [&cpu, &cuda_ref] {
        let params: Vec<Tensor> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let n = shape.iter().product();
                tensor_of(backend, &random(i as u64 + 3, n, 2.0), shape, DType::BF16)
            })
            .collect();
        let mut optimizer = AdamStochastic::new(
            vec![ParamGroup::new(params.clone(), config.clone())],
            Implementation::Fused,
        )
        .unwrap();
        for (step, overflow) in [false, true, false, false].into_iter().enumerate() {
            for (i, (param, shape)) in params.iter().zip(SHAPES).enumerate() {
                let n = shape.iter().product();
                let grad: Vec<f32> = random(10 * step as u64 + i as u64, n, 0.2)
                    .iter()
                    .map(|g| g * 1024.0)
                    .collect();
                param
                    .set_grad(Some(tensor_of(backend, &grad, shape, DType::BF16)))
                    .unwrap();
            }
            device_scaled_step(&mut optimizer, backend, overflow);
        }
        for idx in 0..params.len() {
            assert_eq!(optimizer.param_step(0, idx).unwrap(), 3);
        }
        snapshots.push(snapshot(&optimizer, &params));
    }
    assert!(
        snapshots[0] == snapshots[1],
        "stochastic Adam with a device GradScaler differs between the CPU and CUDA"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn adafactor_on_cuda_is_within_ulps_of_the_cpu() {
    let configs = [
        ("adafactor", AdafactorConfig::new()),
        (
            "adafactor_wd_maximize",
            AdafactorConfig {
                weight_decay: 1e-2,
                maximize: true,
                ..AdafactorConfig::new()
            },
        ),
    ];
    for (name, config) in configs {
        compare(name, config, &implementations(), 4);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn adam8bit_on_cuda_equals_the_cpu() {
    for (name, config) in [
        ("adam8bit", Adam8bitConfig::adam()),
        ("adamw8bit", Adam8bitConfig::adamw()),
    ] {
        compare(name, config, &[Implementation::Fused], 0);
    }
}

/// 4-bit Adam on the shapes above, none of which it quantises (its f32-state kernel; the 4-bit
/// kernel is `cuda_adam4bit.rs`'s).
#[test]
#[ignore = "needs a CUDA device"]
fn adam4bit_f32_states_on_cuda_equal_the_cpu() {
    for (name, config) in [
        ("adam4bit", Adam4bitConfig::adam()),
        ("adamw4bit", Adam4bitConfig::adamw()),
    ] {
        compare(name, config, &[Implementation::Fused], 0);
    }
}

/// A GradScaler on the device: steps 1, 3 and 4 unscale by 1024, step 2 has found-inf set. The
/// CPU skips step 2 on the host; the CUDA kernels skip it on the device and count it, so the
/// step numbers and the later bias corrections agree (the corrections after a skip come from the
/// device's `pow`, within an ulp of the host's).
fn device_scaling<R: UpdateRule>(name: &str, config: R, implementation: Implementation) {
    let Some((cuda_ref, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    let mut snapshots = Vec::new();
    for backend in [&cpu, &cuda_ref] {
        let params: Vec<Tensor> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let n = shape.iter().product();
                Tensor::from_slice(backend, &random(i as u64 + 3, n, 2.0), shape).unwrap()
            })
            .collect();
        let mut optimizer = GroupOptimizer::new(
            vec![ParamGroup::new(params.clone(), config.clone())],
            implementation,
        )
        .unwrap();
        for (step, overflow) in [false, true, false, false].into_iter().enumerate() {
            for (i, (param, shape)) in params.iter().zip(SHAPES).enumerate() {
                let n = shape.iter().product();
                let grad: Vec<f32> = random(10 * step as u64 + i as u64, n, 0.2)
                    .iter()
                    .map(|g| g * 1024.0)
                    .collect();
                param
                    .set_grad(Some(Tensor::from_slice(backend, &grad, shape).unwrap()))
                    .unwrap();
            }
            scaled_step(&mut optimizer, backend, &cpu, overflow);
        }
        for idx in 0..params.len() {
            assert_eq!(optimizer.param_step(0, idx).unwrap(), 3, "{name}");
        }
        snapshots.push(snapshot(&optimizer, &params));
    }
    let distance = snapshot_ulps(&snapshots[0], &snapshots[1]);
    println!("{name} {implementation:?} with a device GradScaler: {distance} ulps from the CPU");
    assert!(distance <= 4, "{name}: {distance} ulps");
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_grad_scaling_skips_and_counts_on_the_device() {
    device_scaling("adamw", AdamConfig::adamw(), Implementation::Fused);
    device_scaling(
        "sgd_momentum",
        SgdConfig {
            momentum: 0.9,
            ..SgdConfig::new(0.1)
        },
        Implementation::Fused,
    );
    device_scaling("adam8bit", Adam8bitConfig::adam(), Implementation::Fused);
}

/// Tensors a CUDA optimizer cannot take give typed errors.
#[test]
#[ignore = "needs a CUDA device"]
fn mixed_devices_dtypes_and_views_are_refused() {
    let Some((cuda, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    let on_cuda = Tensor::zeros(&cuda, &[4, 3], DType::F32).unwrap();
    let on_cpu = Tensor::zeros(&cpu, &[4, 3], DType::F32).unwrap();
    let group = |params: Vec<Tensor>| {
        Adam::new(
            vec![ParamGroup::new(params, AdamConfig::adam())],
            Implementation::Fused,
        )
    };
    let err = group(vec![on_cuda.clone(), on_cpu.clone()]).unwrap_err();
    assert!(
        matches!(
            err,
            OptimError::MixedDevices {
                expected: Device::Cuda(0),
                got: Device::Cpu,
                ..
            }
        ),
        "{err}"
    );
    let f64s = Tensor::zeros(&cuda, &[4], DType::F64).unwrap();
    let err = group(vec![f64s]).unwrap_err();
    assert!(
        matches!(
            err,
            OptimError::DType {
                got: DType::F64,
                ..
            }
        ),
        "{err}"
    );
    let view = on_cuda.t().unwrap();
    let err = group(vec![view]).unwrap_err();
    assert!(matches!(err, OptimError::NonContiguous { .. }), "{err}");
    // A gradient on another device is refused at the step.
    // (autograd-core may refuse it first.)
    let mut adam = group(vec![on_cuda.clone()]).unwrap();
    if on_cuda.set_grad(Some(on_cpu.clone())).is_ok() {
        let err = adam.step().unwrap_err();
        assert!(matches!(err, OptimError::MixedDevices { .. }), "{err}");
    }
    // A device scale on another device than the parameters' is refused.
    let mut on_host = group(vec![on_cpu]).unwrap();
    let scaling = DeviceGradScaling {
        grad_scale: Some(Tensor::from_slice(&cuda, &[2.0f32], &[1]).unwrap()),
        found_inf: None,
    };
    assert!(matches!(
        on_host
            .step_with(StepParams::All, Scaling::Device(&scaling))
            .unwrap_err(),
        OptimError::MixedDevices { .. }
    ));
}
