//! `OffloadedAdam`: Adam's state in host memory, stepped by the host. Its steps equal the
//! on-device optimizers' to the bit — fused `Adam` on f32 parameters, `AdamStochastic` on bf16
//! ones (the same random stream) — whether a step comes whole or in buckets, with `amsgrad`, for
//! a parameter large enough to be stepped in parallel chunks; a parameter changed through a tensor
//! op between steps is read back, not overwritten; a state dict continues a run; misuse is a typed
//! error. On the CPU backend the host steps in the call; (`--include-ignored`, on a CUDA device)
//! the same runs on CUDA — stepped by the host (gradients out on a side stream, a host thread,
//! parameters back) or by the device (the moments streamed in and out of pinned memory) — equal
//! the on-device CUDA optimizers bit for bit, a state dict continues either, and a pinned budget
//! too small for a bucket is the typed error that names it.

use headroom_autograd_core::{BackendRef, DType, Device, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{bf16, GradScaling};
use headroom_optim::{
    Adam, AdamConfig, AdamStochastic, AdamStochasticConfig, Implementation, OffloadConfig,
    OffloadStepper, OffloadedAdam, OptimError, Optimizer, ParamGroup, ParamId, Scaling, StepParams,
    DEFAULT_STREAM_BYTES,
};

/// A large parameter (stepped in parallel chunks of 32 Ki elements, whose random indices
/// continue across chunks), two small ones and a matrix.
const SHAPES: [&[usize]; 4] = [&[300, 500], &[4096], &[37], &[8, 8]];

/// `n` values in `[-scale/2, scale/2)` from testkit's xorshift stream of `seed`.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    headroom_testkit::inputs::centered_f32(n, scale, seed)
}

fn tensor(backend: &BackendRef, values: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    let t = Tensor::from_slice(backend, values, shape).unwrap();
    if dtype == DType::F32 {
        t
    } else {
        t.to_dtype(dtype).unwrap()
    }
}

fn params_of(backend: &BackendRef, dtype: DType) -> Vec<Tensor> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            tensor(backend, &values(100 + i as u64, n, 2.0), shape, dtype)
        })
        .collect()
}

fn set_grads(backend: &BackendRef, params: &[Tensor], step: u64) {
    for (i, param) in params.iter().enumerate() {
        let grad = values(1000 * step + i as u64, param.numel(), 0.2);
        let grad = tensor(backend, &grad, param.shape(), param.dtype());
        param.set_grad(Some(grad)).unwrap();
    }
}

/// Every element's bits, parameter by parameter.
fn bits(params: &[Tensor]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| match p.dtype() {
            DType::BF16 => p
                .to_vec::<bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits() as u32)
                .collect(),
            _ => p
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        })
        .collect()
}

/// `steps` steps of `optimizer`: odd steps in two buckets (the last two parameters first, as
/// backward finishes them, then the first two) and `finish_steps`, even steps whole.
fn train(optimizer: &mut dyn Optimizer, backend: &BackendRef, params: &[Tensor], steps: u64) {
    let ids: Vec<ParamId> = optimizer.params().into_iter().map(|(id, _)| id).collect();
    for step in 1..=steps {
        set_grads(backend, params, step);
        if step % 2 == 1 {
            optimizer
                .step_with(StepParams::Only(&ids[2..]), Scaling::None)
                .unwrap();
            optimizer
                .step_with(StepParams::Only(&ids[..2]), Scaling::None)
                .unwrap();
            optimizer.finish_steps().unwrap();
        } else {
            optimizer.step().unwrap();
        }
        optimizer.zero_grad(true).unwrap();
    }
}

fn adam(amsgrad: bool) -> AdamConfig {
    AdamConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        amsgrad,
        ..AdamConfig::adamw()
    }
}

/// The on-device optimizer whose bits the offloaded one has: fused Adam on f32, AdamStochastic
/// (seed 7) on bf16.
fn on_device(params: &[Tensor], adam: AdamConfig) -> Box<dyn Optimizer> {
    let params = params.to_vec();
    match params[0].dtype() {
        DType::BF16 => Box::new(
            AdamStochastic::new(
                vec![ParamGroup::new(params, AdamStochasticConfig::new(adam, 7))],
                Implementation::Fused,
            )
            .unwrap(),
        ),
        _ => {
            Box::new(Adam::new(vec![ParamGroup::new(params, adam)], Implementation::Fused).unwrap())
        }
    }
}

fn offloaded(params: &[Tensor], adam: AdamConfig) -> OffloadedAdam {
    offloaded_by(params, adam, OffloadStepper::Host)
}

fn offloaded_by(params: &[Tensor], adam: AdamConfig, stepper: OffloadStepper) -> OffloadedAdam {
    offloaded_streaming(params, adam, stepper, DEFAULT_STREAM_BYTES)
}

/// With `stream_bytes` 0 the device stepper holds one bucket's moments coming in and one going
/// back beside the one it steps (the compute stream waits for each older copy back); with the
/// default, all of these.
fn offloaded_streaming(
    params: &[Tensor],
    adam: AdamConfig,
    stepper: OffloadStepper,
    stream_bytes: u64,
) -> OffloadedAdam {
    let config = OffloadConfig {
        seed: 7,
        stepper,
        stream_bytes,
        ..OffloadConfig::new(adam)
    };
    OffloadedAdam::new(params.to_vec(), config).unwrap()
}

/// 20 steps of both on `backend`, every dtype and `amsgrad` setting: the same bits.
fn offloaded_equals_on_device(backend: &BackendRef, stepper: OffloadStepper, stream_bytes: u64) {
    for dtype in [DType::F32, DType::BF16] {
        for amsgrad in [false, true] {
            let reference = params_of(backend, dtype);
            train(
                on_device(&reference, adam(amsgrad)).as_mut(),
                backend,
                &reference,
                20,
            );
            let params = params_of(backend, dtype);
            let mut optimizer = offloaded_streaming(&params, adam(amsgrad), stepper, stream_bytes);
            train(&mut optimizer, backend, &params, 20);
            assert_eq!(optimizer.param_step(0).unwrap(), 20);
            let (want, got) = (bits(&reference), bits(&params));
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                let off = w.iter().zip(g).filter(|(a, b)| a != b).count();
                assert_eq!(
                    off, 0,
                    "{dtype:?} amsgrad {amsgrad}, parameter {i}: {off} differ"
                );
            }
            // Moments f32 (and the host's copy of the parameter, which a device stepper does not
            // keep) per element, amsgrad's third buffer besides.
            let n: usize = SHAPES.iter().map(|s| s.iter().product::<usize>()).sum();
            let moments = if amsgrad { 3 } else { 2 };
            let streamed = stepper == OffloadStepper::Device && backend.device() != Device::Cpu;
            let copy = if streamed { 0 } else { dtype.size_in_bytes() };
            assert_eq!(
                optimizer.host_state_bytes(),
                (n * (4 * moments + copy)) as u64
            );
        }
    }
}

#[test]
fn offloaded_steps_equal_the_on_device_optimizers_bit_for_bit() {
    for stepper in [OffloadStepper::Host, OffloadStepper::Device] {
        offloaded_equals_on_device(&CpuBackend::new_ref(), stepper, DEFAULT_STREAM_BYTES);
    }
}

/// A parameter written through a tensor op between steps (a checkpoint loaded into it) moves
/// its version counter: the offloaded optimizer reads it back, as the on-device one sees it.
#[test]
fn a_parameter_changed_between_steps_is_read_back() {
    let cpu = CpuBackend::new_ref();
    let mut runs = Vec::new();
    for offload in [false, true] {
        let params = params_of(&cpu, DType::BF16);
        let mut optimizer: Box<dyn Optimizer> = match offload {
            false => on_device(&params, adam(false)),
            true => Box::new(offloaded(&params, adam(false))),
        };
        train(optimizer.as_mut(), &cpu, &params, 3);
        let loaded = tensor(&cpu, &values(5, 4096, 1.0), &[4096], DType::BF16);
        params[1].copy_(&loaded).unwrap();
        train(optimizer.as_mut(), &cpu, &params, 3);
        runs.push(bits(&params));
    }
    assert_eq!(runs[0], runs[1]);
}

/// Ten steps, a state dict, a fresh optimizer that loads it, ten more: the bits of twenty.
#[test]
fn a_state_dict_continues_a_run() {
    state_dict_continues_a_run(&CpuBackend::new_ref(), OffloadStepper::Host);
}

/// 10 steps, a state dict, a new optimizer that loads it and 10 more steps (in buckets or
/// whole): the bits of 20 steps straight.
fn state_dict_continues_a_run(backend: &BackendRef, stepper: OffloadStepper) {
    let cpu = backend;
    let straight = params_of(cpu, DType::BF16);
    train(
        &mut offloaded_by(&straight, adam(true), stepper),
        cpu,
        &straight,
        20,
    );

    let params = params_of(cpu, DType::BF16);
    let mut first = offloaded_by(&params, adam(true), stepper);
    train(&mut first, cpu, &params, 10);
    let saved = first.state_dict().unwrap();
    drop(first);
    let mut second = offloaded_by(&params, adam(true), stepper);
    second.load_state_dict(&saved).unwrap();
    assert_eq!(second.param_step(3).unwrap(), 10);
    // Steps 11..=20 draw their gradients as the straight run's did.
    let ids: Vec<ParamId> = second.params().into_iter().map(|(id, _)| id).collect();
    for step in 11..=20 {
        set_grads(cpu, &params, step);
        if step % 2 == 1 {
            second
                .step_with(StepParams::Only(&ids[2..]), Scaling::None)
                .unwrap();
            second
                .step_with(StepParams::Only(&ids[..2]), Scaling::None)
                .unwrap();
            second.finish_steps().unwrap();
        } else {
            second.step().unwrap();
        }
    }
    assert_eq!(bits(&straight), bits(&params));

    // Another optimizer's state dict is refused, naming what it holds.
    let adam_state = on_device(&params, adam(true)).state_dict().unwrap();
    let err = second.load_state_dict(&adam_state).unwrap_err();
    assert!(matches!(err, OptimError::StateDict(_)), "{err}");
    assert!(err.to_string().contains("AdamStochastic"), "{err}");
}

#[test]
fn misuse_is_a_typed_error() {
    let cpu = CpuBackend::new_ref();
    let f16 = tensor(&cpu, &[1.0, 2.0], &[2], DType::F16);
    let err = OffloadedAdam::new(vec![f16], OffloadConfig::new(adam(false))).unwrap_err();
    assert!(
        matches!(err, OptimError::DType { got, .. } if got == DType::F16),
        "{err}"
    );

    let params = params_of(&cpu, DType::F32);
    let none_in_flight = OffloadConfig {
        buckets_in_flight: 0,
        ..OffloadConfig::new(adam(false))
    };
    let err = OffloadedAdam::new(params.clone(), none_in_flight).unwrap_err();
    assert!(err.to_string().contains("buckets_in_flight is 0"), "{err}");

    let no_master_on_device = OffloadConfig {
        master_weights: true,
        stepper: OffloadStepper::Device,
        ..OffloadConfig::new(adam(false))
    };
    let err = OffloadedAdam::new(params.clone(), no_master_on_device).unwrap_err();
    assert!(err.to_string().contains("OffloadStepper::Host"), "{err}");

    let strided = params[3].t().unwrap();
    let err = OffloadedAdam::new(vec![strided], OffloadConfig::new(adam(false))).unwrap_err();
    assert!(matches!(err, OptimError::NonContiguous { .. }), "{err}");

    let mut optimizer = offloaded(&params, adam(false));
    set_grads(&cpu, &params, 1);
    let ids: Vec<ParamId> = optimizer.params().into_iter().map(|(id, _)| id).collect();
    let twice = [ids[0], ids[0]];
    let err = optimizer
        .step_with(StepParams::Only(&twice), Scaling::None)
        .unwrap_err();
    assert!(err.to_string().contains("listed twice"), "{err}");
    let err = optimizer
        .step_with(
            StepParams::All,
            Scaling::Host(GradScaling {
                grad_scale: Some(2.0),
                found_inf: None,
            }),
        )
        .unwrap_err();
    assert!(matches!(err, OptimError::Unsupported { .. }), "{err}");
    // Nothing was stepped by the refused calls.
    assert_eq!(optimizer.param_step(0).unwrap(), 0);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn offloaded_steps_on_cuda_equal_the_on_device_cuda_optimizers() {
    use headroom_ops_cuda::CudaBackend;
    let Some(cuda) = headroom_testkit::gpu::shared_or_skip(|| CudaBackend::new(0)) else {
        return;
    };
    let cuda: BackendRef = cuda;
    for stepper in [OffloadStepper::Host, OffloadStepper::Device] {
        offloaded_equals_on_device(&cuda, stepper, DEFAULT_STREAM_BYTES);
        state_dict_continues_a_run(&cuda, stepper);
    }
    offloaded_equals_on_device(&cuda, OffloadStepper::Device, 0);
    println!(
        "OffloadedAdam on CUDA, stepped by the host and by the device: f32 and bf16, amsgrad or \
         not, bitwise over 20 steps (the device stepper with its default budget and with none); a \
         state dict continues a run"
    );
}

/// A pinned budget smaller than one bucket's staging: the step is the pinned pool's typed error,
/// naming the budget, and no parameter moved.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn a_pinned_budget_smaller_than_a_bucket_is_a_typed_error() {
    use headroom_ops_cuda::{CudaBackend, CudaBackendOptions};
    let options = CudaBackendOptions {
        pinned_budget: Some(1 << 20),
        ..CudaBackendOptions::default()
    };
    let Some(backend) = headroom_testkit::gpu::cuda_or_skip(CudaBackend::with_options(0, options))
    else {
        return;
    };
    let backend: BackendRef = backend;
    let params = params_of(&backend, DType::F32);
    let before = bits(&params);
    for stepper in [OffloadStepper::Host, OffloadStepper::Device] {
        let mut optimizer = offloaded_by(&params, adam(false), stepper);
        set_grads(&backend, &params, 1);
        let err = optimizer.step().unwrap_err().to_string();
        assert!(err.contains("budget"), "{stepper:?}: {err}");
        assert_eq!(bits(&params)[0], before[0], "{stepper:?}");
        println!("pinned budget of 1 MiB, {stepper:?} stepper: {err}");
    }
}

/// With `master_weights`, bf16 parameters keep an f32 master copy on the host: 20 steps give the
/// bits of fused f32 Adam on f32 masters fed the bf16 gradients widened, each parameter the
/// master rounded to nearest (what amp's `MasterWeights` over `Adam` computes on the device),
/// whole or in buckets; the host keeps 12 bytes a parameter; a state dict carries the masters, so
/// a resumed run gives the bits of one that never stopped.
#[test]
fn master_weights_step_f32_masters_and_store_their_rounding() {
    let cpu = CpuBackend::new_ref();
    let config = OffloadConfig {
        master_weights: true,
        ..OffloadConfig::new(adam(false))
    };
    let params = params_of(&cpu, DType::BF16);
    let masters: Vec<Tensor> = params
        .iter()
        .map(|p| p.to_dtype(DType::F32).unwrap())
        .collect();
    let mut reference = Adam::new(
        vec![ParamGroup::new(masters.clone(), adam(false))],
        Implementation::Fused,
    )
    .unwrap();
    let mut offloaded = OffloadedAdam::new(params.clone(), config.clone()).unwrap();
    let ids: Vec<ParamId> = offloaded.params().into_iter().map(|(id, _)| id).collect();
    for step in 1..=20 {
        set_grads(&cpu, &params, step);
        for (master, param) in masters.iter().zip(&params) {
            let widened = param.grad().unwrap().to_dtype(DType::F32).unwrap();
            master.set_grad(Some(widened)).unwrap();
        }
        reference.step().unwrap();
        if step % 2 == 1 {
            offloaded
                .step_with(StepParams::Only(&ids[2..]), Scaling::None)
                .unwrap();
            offloaded
                .step_with(StepParams::Only(&ids[..2]), Scaling::None)
                .unwrap();
            offloaded.finish_steps().unwrap();
        } else {
            offloaded.step().unwrap();
        }
    }
    let rounded: Vec<Tensor> = masters
        .iter()
        .map(|m| m.to_dtype(DType::BF16).unwrap())
        .collect();
    assert_eq!(bits(&params), bits(&rounded));
    let n: usize = SHAPES.iter().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!(offloaded.host_state_bytes(), (12 * n) as u64);

    // Ten steps, a state dict, a fresh optimizer, ten more: the bits of twenty.
    let straight = params_of(&cpu, DType::BF16);
    let mut whole = OffloadedAdam::new(straight.clone(), config.clone()).unwrap();
    let resumed = params_of(&cpu, DType::BF16);
    let mut first = OffloadedAdam::new(resumed.clone(), config.clone()).unwrap();
    for step in 1..=10 {
        set_grads(&cpu, &straight, step);
        whole.step().unwrap();
        set_grads(&cpu, &resumed, step);
        first.step().unwrap();
    }
    let saved = first.state_dict().unwrap();
    drop(first);
    let mut second = OffloadedAdam::new(resumed.clone(), config).unwrap();
    second.load_state_dict(&saved).unwrap();
    for step in 11..=20 {
        set_grads(&cpu, &straight, step);
        whole.step().unwrap();
        set_grads(&cpu, &resumed, step);
        second.step().unwrap();
    }
    assert_eq!(bits(&straight), bits(&resumed));
}
