//! The optimizers on CUDA tensors against the same optimizers on CPU tensors: every rule and
//! implementation bit for bit on random data (Adafactor within a few ulps: its two norms are
//! f64 sums in another order), host- and device-valued gradient scaling with device-counted
//! skips, the memory each implementation promises, SGD and Adam on bf16 and f16 parameters bit for
//! bit with the CPU (and the bf16 fused step's memory: states only), bf16 Adam with stochastic
//! rounding bit for bit with the CPU (device-skipped steps included), a GradScaler's overflow check
//! and unscale (one launch per dtype) equal to the host's portable form, and typed errors for
//! tensors a step cannot take. Prints a skip notice (and passes) without a CUDA device.
#![cfg(feature = "cuda")]

use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};

use headroom_autograd_core::{BackendRef, DType, Device, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_optim::kernels::{bf16, f16, n_blocks, GradScaling};
use headroom_optim::{
    non_finite_check_and_unscale_, AdafactorConfig, Adam, Adam8bit, Adam8bitConfig, AdamConfig,
    AdamStochastic, AdamStochasticConfig, DeviceGradScaling, GroupOptimizer, Implementation,
    OptimError, Optimizer, ParamGroup, Scaling, Sgd, SgdConfig, StepParams, UpdateRule,
};
use headroom_testkit::gpu::cuda_or_skip;

/// The device shared by this binary's tests.
fn cuda() -> Option<Arc<CudaBackend>> {
    static CUDA: OnceLock<Option<Arc<CudaBackend>>> = OnceLock::new();
    CUDA.get_or_init(|| cuda_or_skip(CudaBackend::new(0)))
        .clone()
}

fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

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

/// A tensor's elements as little-endian bytes.
fn raw_bytes(tensor: &Tensor) -> Vec<u8> {
    match tensor.dtype() {
        DType::U8 => tensor.to_vec::<u8>().unwrap(),
        DType::BF16 => tensor
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => tensor
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        _ => bytes(&tensor.to_vec::<f32>().unwrap()),
    }
}

/// `values` as a tensor of `dtype` (rounded on the host, to nearest-even).
fn tensor_of(backend: &BackendRef, values: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    match dtype {
        DType::BF16 => {
            let values: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            Tensor::from_slice(backend, &values, shape).unwrap()
        }
        DType::F16 => {
            let values: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            Tensor::from_slice(backend, &values, shape).unwrap()
        }
        _ => Tensor::from_slice(backend, values, shape).unwrap(),
    }
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The largest ulp distance between two snapshots (f32 buffers; u8 codes must be equal).
fn max_ulps(a: &[Vec<u8>], b: &[Vec<u8>]) -> u32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        if x.len() % 4 != 0 {
            assert_eq!(x, y, "codes differ");
            continue;
        }
        for (u, v) in x.chunks_exact(4).zip(y.chunks_exact(4)) {
            let u = i32::from_le_bytes([u[0], u[1], u[2], u[3]]);
            let v = i32::from_le_bytes([v[0], v[1], v[2], v[3]]);
            worst = worst.max(u.abs_diff(v));
        }
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
    let Some(cuda) = cuda() else { return };
    let cuda: BackendRef = cuda;
    let cpu = CpuBackend::new_ref();
    for &implementation in implementations {
        let scales: &[Option<f32>] = match implementation {
            Implementation::Fused => &[None, Some(1024.0)],
            _ => &[None],
        };
        for &scale in scales {
            let want = run(&cpu, &config, (implementation, dtype), scale);
            let got = run(&cuda, &config, (implementation, dtype), scale);
            let distance = max_ulps(&want, &got);
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
fn stochastic_adam_on_cuda_equals_the_cpu() {
    let config = AdamStochasticConfig::new(AdamConfig::adamw(), 42);
    compare_dtype(
        "adam_stochastic",
        config.clone(),
        &[Implementation::Fused],
        DType::BF16,
        0,
    );
    let Some(cuda) = cuda() else { return };
    let cuda_ref: BackendRef = cuda;
    let cpu = CpuBackend::new_ref();
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
            let flag = if overflow { 1.0f32 } else { 0.0 };
            let scaling = DeviceGradScaling {
                grad_scale: Some(Tensor::from_slice(backend, &[1024.0f32], &[1]).unwrap()),
                found_inf: Some(Tensor::from_slice(backend, &[flag], &[1]).unwrap()),
            };
            optimizer
                .step_with(StepParams::All, Scaling::Device(&scaling))
                .unwrap();
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
fn adam8bit_on_cuda_equals_the_cpu() {
    for (name, config) in [
        ("adam8bit", Adam8bitConfig::adam()),
        ("adamw8bit", Adam8bitConfig::adamw()),
    ] {
        compare(name, config, &[Implementation::Fused], 0);
    }
}

/// A GradScaler on the device: steps 1, 3 and 4 unscale by 1024, step 2 has found-inf set. The
/// CPU skips step 2 on the host; the CUDA kernels skip it on the device and count it, so the
/// step numbers and the later bias corrections agree (the corrections after a skip come from the
/// device's `pow`, within an ulp of the host's).
fn device_scaling<R: UpdateRule>(name: &str, config: R, implementation: Implementation) {
    let Some(cuda) = cuda() else { return };
    let cuda_ref: BackendRef = cuda.clone();
    let cpu = CpuBackend::new_ref();
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
            let flag = if overflow { 1.0 } else { 0.0 };
            if Arc::ptr_eq(backend, &cpu) {
                let scaling = GradScaling {
                    grad_scale: Some(1024.0),
                    found_inf: Some(flag),
                };
                optimizer
                    .step_with(StepParams::All, Scaling::Host(scaling))
                    .unwrap();
            } else {
                let scaling = DeviceGradScaling {
                    grad_scale: Some(Tensor::from_slice(backend, &[1024.0f32], &[1]).unwrap()),
                    found_inf: Some(Tensor::from_slice(backend, &[flag], &[1]).unwrap()),
                };
                optimizer
                    .step_with(StepParams::All, Scaling::Device(&scaling))
                    .unwrap();
            }
        }
        for idx in 0..params.len() {
            assert_eq!(optimizer.param_step(0, idx).unwrap(), 3, "{name}");
        }
        snapshots.push(snapshot(&optimizer, &params));
    }
    let distance = max_ulps(&snapshots[0], &snapshots[1]);
    println!("{name} {implementation:?} with a device GradScaler: {distance} ulps from the CPU");
    assert!(distance <= 4, "{name}: {distance} ulps");
}

#[test]
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

fn allocated(cuda: &CudaBackend) -> u64 {
    cuda.allocator().memory_allocated()
}

/// Bytes allocated and the peak above them during one step (after a first one that created the
/// state and the launch table).
fn step_memory(cuda: &CudaBackend, optimizer: &mut dyn Optimizer) -> (u64, u64) {
    optimizer.step().unwrap();
    cuda.synchronize().unwrap();
    let before = allocated(cuda);
    cuda.allocator().reset_peak_stats();
    optimizer.step().unwrap();
    cuda.synchronize().unwrap();
    let peak = cuda.allocator().max_memory_allocated();
    assert_eq!(allocated(cuda), before, "a step keeps nothing");
    (before, peak - before)
}

fn cuda_params(cuda: &BackendRef, shapes: &[&[usize]]) -> Vec<Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let t = Tensor::from_slice(cuda, &random(i as u64, n, 1.0), shape).unwrap();
            t.set_grad(Some(
                Tensor::from_slice(cuda, &random(i as u64 + 50, n, 1.0), shape).unwrap(),
            ))
            .unwrap();
            t
        })
        .collect()
}

/// What each implementation promises during a step on CUDA: fused and 8-bit nothing, single one
/// parameter's temporary, bounded foreach at most its chunk, unbounded foreach all parameters
/// (PyTorch's foreach). State sizes are exact.
#[test]
fn each_implementation_holds_the_memory_it_promises() {
    // A backend of its own: other tests' tensors stay out of its allocator's counts.
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let backend: BackendRef = cuda.clone();
    // 4 Mi + 1 Mi + 1000 elements.
    let shapes: [&[usize]; 3] = [&[2048, 2048], &[1024, 1024], &[1000]];
    let largest = 2048 * 2048 * 4;
    let total = (2048 * 2048 + 1024 * 1024 + 1024) * 4; // the 4000-byte tensor takes 4096
    let cases: [(Implementation, u64); 6] = [
        (Implementation::Fused, 0),
        (Implementation::Single, largest),
        (Implementation::FOREACH, 16 << 20),
        (
            Implementation::Foreach {
                chunk: NonZeroUsize::new(1 << 16).unwrap(),
            },
            1 << 18,
        ),
        (Implementation::ForeachUnbounded, total),
        (
            Implementation::Foreach {
                chunk: NonZeroUsize::new(1 << 30).unwrap(),
            },
            total,
        ),
    ];
    for (implementation, extra) in cases {
        let params = cuda_params(&backend, &shapes);
        let mut adam = Adam::new(
            vec![ParamGroup::new(params.clone(), AdamConfig::adamw())],
            implementation,
        )
        .unwrap();
        let (_, peak) = step_memory(&cuda, &mut adam);
        println!("Adam {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "{implementation:?}");
        for (idx, param) in params.iter().enumerate() {
            for (name, state) in adam.param_state(0, idx) {
                assert_eq!(state.shape(), param.shape(), "{name}");
                assert_eq!(state.dtype(), DType::F32, "{name}");
                assert_eq!(state.device(), param.device(), "{name}");
            }
        }
        let mut sgd = Sgd::new(
            vec![ParamGroup::new(
                params,
                SgdConfig {
                    momentum: 0.9,
                    ..SgdConfig::new(0.1)
                },
            )],
            implementation,
        )
        .unwrap();
        let (_, peak) = step_memory(&cuda, &mut sgd);
        println!("SGD {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "{implementation:?}");
    }
    // 8-bit: u8 codes and one f32 scale per 256 elements; f32 states under 4096 elements.
    let params = cuda_params(&backend, &[&[300, 257], &[1000]]);
    let mut adam8 = Adam8bit::new(
        vec![ParamGroup::new(params.clone(), Adam8bitConfig::adam())],
        Implementation::Fused,
    )
    .unwrap();
    let (_, peak) = step_memory(&cuda, &mut adam8);
    assert_eq!(peak, 0);
    let state: Vec<_> = adam8.param_state(0, 0);
    let n = 300 * 257;
    let expect = [
        ("state1", DType::U8, n),
        ("state2", DType::U8, n),
        ("absmax1", DType::F32, n_blocks(n)),
        ("absmax2", DType::F32, n_blocks(n)),
    ];
    for ((name, tensor), (want_name, dtype, numel)) in state.iter().zip(expect) {
        assert_eq!(
            (*name, tensor.dtype(), tensor.numel()),
            (want_name, dtype, numel)
        );
        let bytes = (numel * dtype.size_in_bytes()) as u64;
        assert_eq!(tensor.buffer().allocated_bytes(), bytes.div_ceil(512) * 512);
    }
    let small: Vec<_> = adam8.param_state(0, 1);
    assert_eq!(small.len(), 2);
    for (_, tensor) in small {
        assert_eq!((tensor.dtype(), tensor.numel()), (DType::F32, 1000));
    }
}

/// The bf16 fused step on CUDA: states of 2 bytes per element (exact bytes), nothing else during
/// a step; bounded foreach holds its chunk of bf16 temporaries.
#[test]
fn bf16_fused_steps_hold_only_their_states() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let backend: BackendRef = cuda.clone();
    let shapes: [&[usize]; 2] = [&[2048, 2048], &[1000]];
    let n_elems: u64 = 2048 * 2048 + 1000;
    // 2-byte states, each buffer rounded up to 512 bytes.
    let state_bytes = 2048 * 2048 * 2 + 2048;
    let params: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let t = tensor_of(&backend, &random(i as u64, n, 1.0), shape, DType::BF16);
            t.set_grad(Some(tensor_of(
                &backend,
                &random(i as u64 + 50, n, 1.0),
                shape,
                DType::BF16,
            )))
            .unwrap();
            t
        })
        .collect();
    let sgd_config = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.1)
    };
    let cases: [(Implementation, u64); 2] = [
        (Implementation::Fused, 0),
        (Implementation::FOREACH, n_elems.min(1 << 22) * 2),
    ];
    for (implementation, extra) in cases {
        let before = allocated(&cuda);
        let mut adam = Adam::new(
            vec![ParamGroup::new(params.clone(), AdamConfig::adamw())],
            implementation,
        )
        .unwrap();
        let (with_state, peak) = step_memory(&cuda, &mut adam);
        println!("bf16 Adam {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "Adam {implementation:?}");
        let states: u64 = (0..params.len())
            .flat_map(|idx| adam.param_state(0, idx))
            .map(|(name, state)| {
                assert_eq!(state.dtype(), DType::BF16, "{name}");
                state.buffer().allocated_bytes()
            })
            .sum();
        assert_eq!(states, 2 * state_bytes);
        assert!(with_state - before >= states);
        drop(adam);
        let mut sgd = Sgd::new(
            vec![ParamGroup::new(params.clone(), sgd_config.clone())],
            implementation,
        )
        .unwrap();
        let (_, peak) = step_memory(&cuda, &mut sgd);
        println!("bf16 SGD {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "SGD {implementation:?}");
        let buffer = &sgd.param_state(0, 0)[0].1;
        assert_eq!(buffer.dtype(), DType::BF16);
        assert_eq!(buffer.buffer().allocated_bytes(), 2048 * 2048 * 2);
    }
}

/// Tensors a CUDA optimizer cannot take give typed errors.
#[test]
fn mixed_devices_dtypes_and_views_are_refused() {
    let Some(cuda) = cuda() else { return };
    let cuda: BackendRef = cuda;
    let cpu = CpuBackend::new_ref();
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

/// `(found_inf, unscaled gradients as bytes)` of one `non_finite_check_and_unscale_` call on
/// `backend` over `grads` (values, dtype; each gradient a view from element 1 of a buffer one
/// longer when `offset`, so its address is off every vector width), the flag starting at
/// `found_before`.
fn checked(
    backend: &BackendRef,
    grads: &[(Vec<f32>, DType)],
    offset: bool,
    found_before: f32,
    inv_scale: Option<f32>,
) -> (f32, Vec<Vec<u8>>) {
    let tensors: Vec<Tensor> = grads
        .iter()
        .map(|(values, dtype)| {
            if !offset {
                return tensor_of(backend, values, &[values.len()], *dtype);
            }
            let padded: Vec<f32> = std::iter::once(0.0).chain(values.iter().copied()).collect();
            tensor_of(backend, &padded, &[padded.len()], *dtype)
                .narrow(0, 1, values.len())
                .unwrap()
        })
        .collect();
    let found_inf = Tensor::from_slice(backend, &[found_before], &[1]).unwrap();
    let inv_scale = inv_scale.map(|s| Tensor::from_slice(backend, &[s], &[1]).unwrap());
    non_finite_check_and_unscale_(&tensors, &found_inf, inv_scale.as_ref()).unwrap();
    let found = found_inf.to_vec::<f32>().unwrap()[0];
    (found, tensors.iter().map(raw_bytes).collect())
}

/// The overflow check on CUDA (one launch per dtype over every gradient) against the host's
/// portable form: the same flag for clean gradients, a NaN or infinity first, in the middle or
/// last (in a block past the first of a large gradient, in tails off every vector width, in
/// views off the vector alignment, in one dtype of a mixed call), an accumulated flag kept, and
/// the unscaled gradients equal to the bit.
#[test]
fn the_overflow_check_and_unscale_on_cuda_equals_the_host() {
    let Some(cuda) = cuda() else { return };
    let cuda: BackendRef = cuda;
    let cpu = CpuBackend::new_ref();
    let lens = [37, 200_003, 300 * 257, 1, 0, 5000];
    let grads_of = |dtype: DType| -> Vec<(Vec<f32>, DType)> {
        lens.iter()
            .enumerate()
            .map(|(idx, &n)| (random(idx as u64 + 7, n, 6e4), dtype))
            .collect()
    };
    let mixed: Vec<(Vec<f32>, DType)> = [DType::F32, DType::BF16, DType::F16]
        .iter()
        .flat_map(|&dtype| grads_of(dtype))
        .collect();
    let inv_scale = (1.0f64 / 65536.0) as f32;
    for (name, grads) in [
        ("f32", grads_of(DType::F32)),
        ("bf16", grads_of(DType::BF16)),
        ("f16", grads_of(DType::F16)),
        ("mixed", mixed),
    ] {
        for offset in [false, true] {
            for scale in [None, Some(inv_scale)] {
                let at = format!("{name} offset {offset} scale {scale:?}");
                let on_cuda = checked(&cuda, &grads, offset, 0.0, scale);
                let on_cpu = checked(&cpu, &grads, offset, 0.0, scale);
                assert_eq!(on_cuda.0, 0.0, "{at}: clean gradients");
                assert_eq!(on_cuda, on_cpu, "{at}");
                assert_eq!(checked(&cuda, &grads, offset, 1.0, scale).0, 1.0, "{at}");
                let last = grads.len() - 1;
                let big = grads.iter().position(|(v, _)| v.len() == 200_003).unwrap();
                for (tensor, elem, value) in [
                    (0, 0, f32::NAN),
                    (big, 150_001, f32::INFINITY),
                    (last, grads[last].0.len() - 1, f32::NEG_INFINITY),
                ] {
                    let mut poisoned = grads.clone();
                    poisoned[tensor].0[elem] = value;
                    let (found, _) = checked(&cuda, &poisoned, offset, 0.0, scale);
                    assert_eq!(found, 1.0, "{at}: {value} at {elem} of gradient {tensor}");
                }
            }
        }
    }
}
