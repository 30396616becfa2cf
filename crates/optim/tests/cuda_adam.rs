//! Fused Adam on the GPU against the CPU's fused kernel: bit for bit, with gradient unscaling
//! and the found-inf skip. Each test is marked `#[ignore = "needs a CUDA device"]`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{CudaFusedAdam, DeviceAdamParam};
use headroom_optim::kernels::{adam_fused, AdamBuffers, AdamConfig, GradScaling, ParamRounding};
use headroom_optim::{DeviceGradScaling, OptimError};
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::Xorshift;

/// `n` values uniform in `[-scale/2, scale/2)` from the xorshift stream that starts at state
/// `seed | 1`.
fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut stream = Xorshift::from_state(seed | 1);
    (0..n)
        .map(|_| stream.next_signed_f32() * 0.5 * scale)
        .collect()
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A GradScaler's scale (and flag) as one-element f32 tensors of `backend`.
fn scaling(
    backend: &Arc<CudaBackend>,
    grad_scale: f32,
    found_inf: Option<f32>,
) -> DeviceGradScaling {
    let backend: BackendRef = backend.clone();
    let one = |value: f32| Tensor::from_slice(&backend, &[value], &[1]).unwrap();
    DeviceGradScaling {
        grad_scale: Some(one(grad_scale)),
        found_inf: found_inf.map(one),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_fused_adam_equals_the_cpu_bit_for_bit() {
    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    // Sizes cover a tail that is not a multiple of 4 and a chunk boundary (65,536 elements).
    let sizes = [37usize, 5000, 70_001];
    for cfg in [
        AdamConfig {
            weight_decay: 0.01,
            ..AdamConfig::adamw()
        },
        AdamConfig {
            weight_decay: 0.01,
            lr: 3e-3,
            ..AdamConfig::adam()
        },
    ] {
        let mut host: Vec<[Vec<f32>; 4]> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let i = i as u64;
                [
                    random(i + 1, n, 2.0),
                    random(i + 100, n, 1.0),
                    vec![0.0; n],
                    vec![0.0; n],
                ]
            })
            .collect();
        let grad_scale = 1024.0f32;
        let mut device = Vec::new();
        let mut params = Vec::new();
        for buffers in &host {
            let scaled: Vec<f32> = buffers[1].iter().map(|g| g * grad_scale).collect();
            let uploads: Vec<_> = [&buffers[0], &scaled, &buffers[2], &buffers[3]]
                .iter()
                .map(|values| backend.upload(&bytes(values)).unwrap())
                .collect();
            params.push(DeviceAdamParam {
                param: uploads[0].address(),
                grad: uploads[1].address(),
                exp_avg: uploads[2].address(),
                exp_avg_sq: uploads[3].address(),
                max_exp_avg_sq: None,
                len: buffers[0].len(),
            });
            device.push(uploads);
        }
        let clean = scaling(&backend, grad_scale, Some(0.0));
        let overflowed = scaling(&backend, grad_scale, Some(1.0));
        // SAFETY: every address is a live allocation of `backend` holding `len` f32s, kept in
        // `device` until the end of the test.
        let mut adam = unsafe { CudaFusedAdam::new(backend.clone(), &params) }.unwrap();
        for step in 1..=3 {
            adam.step(&cfg, step, Some(&clean)).unwrap();
            // An overflowed step changes nothing.
            adam.step(&cfg, step, Some(&overflowed)).unwrap();
            for buffers in &mut host {
                let [p, g, m, v] = buffers;
                let bufs = AdamBuffers {
                    param: p,
                    grad: g,
                    exp_avg: m,
                    exp_avg_sq: v,
                    max_exp_avg_sq: None,
                };
                adam_fused(&cfg, step, bufs, GradScaling::default()).unwrap();
            }
        }
        for (buffers, uploads) in host.iter().zip(&device) {
            // Parameter, first and second moment (the device gradient holds scaled values).
            for index in [0, 2, 3] {
                let want = bytes(&buffers[index]);
                let mut got = vec![0u8; want.len()];
                // SAFETY: the allocation is live and holds that many bytes.
                unsafe { backend.download(uploads[index].address(), &mut got) }.unwrap();
                assert_eq!(got, want, "GPU and CPU differ in buffer {index} ({cfg:?})");
            }
        }
        drop(adam);
        for allocation in device.into_iter().flatten() {
            backend.allocator().free(allocation).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_8bit_adam_equals_the_cpu_bit_for_bit() {
    use headroom_optim::bnb_maps;
    use headroom_optim::cuda::{CudaAdam8bit, DeviceAdam8bitParam};
    use headroom_optim::kernels::{adam8bit_blockwise, n_blocks, Adam8bitBuffers, Adam8bitConfig};
    const NEAREST: ParamRounding = ParamRounding::NEAREST;

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let (qmap1, qmap2) = bnb_maps();
    let sizes = [4096usize, 5000, 70_001];
    for cfg in [Adam8bitConfig::adam(), Adam8bitConfig::adamw()] {
        // Per parameter: param, grad, absmax1, absmax2 (f32) and state1, state2 (u8).
        let mut floats: Vec<[Vec<f32>; 4]> = Vec::new();
        let mut codes: Vec<[Vec<u8>; 2]> = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let i = i as u64;
            floats.push([
                random(i + 7, n, 2.0),
                random(i + 70, n, 0.1),
                vec![0.0; n_blocks(n)],
                vec![0.0; n_blocks(n)],
            ]);
            codes.push([vec![0; n], vec![0; n]]);
        }
        let grad_scale = 512.0f32;
        let mut device = Vec::new();
        let mut params = Vec::new();
        for (f, c) in floats.iter().zip(&codes) {
            let scaled: Vec<f32> = f[1].iter().map(|g| g * grad_scale).collect();
            let up = |data: Vec<u8>| backend.upload(&data).unwrap();
            let uploads = [
                up(bytes(&f[0])),
                up(bytes(&scaled)),
                up(c[0].clone()),
                up(c[1].clone()),
                up(bytes(&f[2])),
                up(bytes(&f[3])),
            ];
            params.push(DeviceAdam8bitParam {
                param: uploads[0].address(),
                grad: uploads[1].address(),
                state1: uploads[2].address(),
                state2: uploads[3].address(),
                absmax1: uploads[4].address(),
                absmax2: uploads[5].address(),
                len: f[0].len(),
            });
            device.push(uploads);
        }
        let scaled = scaling(&backend, grad_scale, None);
        let overflowed = scaling(&backend, grad_scale, Some(1.0));
        // SAFETY: every address is a live allocation of `backend` of the documented size, kept
        // in `device` until the end of the test.
        let mut adam = unsafe { CudaAdam8bit::new(backend.clone(), &params) }.unwrap();
        for step in 1..=3 {
            adam.step(&cfg, step, Some(&scaled)).unwrap();
            adam.step(&cfg, step, Some(&overflowed)).unwrap();
            for (f, c) in floats.iter_mut().zip(codes.iter_mut()) {
                let [p, g, a1, a2] = f;
                let [c1, c2] = c;
                let bufs = Adam8bitBuffers {
                    param: p,
                    grad: g,
                    state1: c1,
                    state2: c2,
                    absmax1: a1,
                    absmax2: a2,
                };
                adam8bit_blockwise(
                    &cfg,
                    step,
                    qmap1,
                    qmap2,
                    bufs,
                    GradScaling::default(),
                    NEAREST,
                )
                .unwrap();
            }
        }
        for ((f, c), uploads) in floats.iter().zip(&codes).zip(&device) {
            let expected: [(usize, Vec<u8>); 5] = [
                (0, bytes(&f[0])),
                (2, c[0].clone()),
                (3, c[1].clone()),
                (4, bytes(&f[2])),
                (5, bytes(&f[3])),
            ];
            for (index, want) in expected {
                let mut got = vec![0u8; want.len()];
                // SAFETY: the allocation is live and holds that many bytes.
                unsafe { backend.download(uploads[index].address(), &mut got) }.unwrap();
                assert_eq!(got, want, "GPU and CPU differ in buffer {index} ({cfg:?})");
            }
        }
        drop(adam);
        for allocation in device.into_iter().flatten() {
            backend.allocator().free(allocation).unwrap();
        }
    }
}

/// The framework path (`step_buffers`): gradients in a new buffer every step, as torch's are
/// after `zero_grad(set_to_none=True)`, and a small tensor stepped by bitsandbytes' 32-bit
/// kernel beside an 8-bit one — each bit for bit against the CPU.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_step_buffers_follow_moving_gradients_bit_for_bit() {
    use headroom_optim::bnb_maps;
    use headroom_optim::cuda::{CudaAdam8bit, DeviceAdam8bitParam};
    use headroom_optim::kernels::{
        adam8bit_blockwise, adam_bnb_32bit, n_blocks, Adam8bitBuffers, Adam8bitConfig, F32States,
    };
    const NEAREST: ParamRounding = ParamRounding::NEAREST;

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let down = |address: u64, len: usize| {
        let mut got = vec![0u8; len];
        // SAFETY: the callers pass live allocations of at least `len` bytes.
        unsafe { backend.download(address, &mut got) }.unwrap();
        got
    };

    // Fused AdamW, 5000 elements, a fresh gradient buffer per step.
    let cfg = AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::adamw()
    };
    let n = 5000;
    let (mut p, mut m, mut v) = (random(3, n, 2.0), vec![0.0f32; n], vec![0.0f32; n]);
    let state: Vec<_> = [&p, &m, &v]
        .iter()
        .map(|values| backend.upload(&bytes(values)).unwrap())
        .collect();
    // SAFETY: no buffers yet; each step names its own.
    let mut adam = unsafe { CudaFusedAdam::new(backend.clone(), &[]) }.unwrap();
    for step in 1..=3u64 {
        let g = random(step * 11, n, 1.0);
        let grad = backend.upload(&bytes(&g)).unwrap();
        let param = DeviceAdamParam {
            param: state[0].address(),
            grad: grad.address(),
            exp_avg: state[1].address(),
            exp_avg_sq: state[2].address(),
            max_exp_avg_sq: None,
            len: n,
        };
        // SAFETY: live f32 buffers of `n` elements, kept until the download below waits.
        unsafe { adam.step_buffers(&cfg, step, &[param], (None, None)) }.unwrap();
        let bufs = AdamBuffers {
            param: &mut p,
            grad: &g,
            exp_avg: &mut m,
            exp_avg_sq: &mut v,
            max_exp_avg_sq: None,
        };
        adam_fused(&cfg, step, bufs, GradScaling::default()).unwrap();
        assert_eq!(down(state[0].address(), n * 4), bytes(&p), "step {step}");
        backend.allocator().free(grad).unwrap();
    }
    drop(adam);

    // 8-bit Adam over one 8-bit tensor (5000) and one 32-bit tensor (1000).
    let cfg = Adam8bitConfig::adam();
    let (qmap1, qmap2) = bnb_maps();
    let (big, small) = (5000usize, 1000usize);
    let (mut pb, mut c1, mut c2) = (random(5, big, 2.0), vec![0u8; big], vec![0u8; big]);
    let (mut a1, mut a2) = (vec![0.0f32; n_blocks(big)], vec![0.0f32; n_blocks(big)]);
    let (mut ps, mut s1, mut s2) = (
        random(6, small, 2.0),
        vec![0.0f32; small],
        vec![0.0f32; small],
    );
    let up = |data: Vec<u8>| backend.upload(&data).unwrap();
    let buffers = [
        up(bytes(&pb)),
        up(c1.clone()),
        up(c2.clone()),
        up(bytes(&a1)),
        up(bytes(&a2)),
        up(bytes(&ps)),
        up(bytes(&s1)),
        up(bytes(&s2)),
    ];
    // SAFETY: no buffers yet; each step names its own.
    let mut adam = unsafe { CudaAdam8bit::new(backend.clone(), &[]) }.unwrap();
    for step in 1..=3u64 {
        let (gb, gs) = (random(step * 13, big, 0.1), random(step * 17, small, 0.1));
        let (grad_b, grad_s) = (up(bytes(&gb)), up(bytes(&gs)));
        let params = [
            DeviceAdam8bitParam {
                param: buffers[0].address(),
                grad: grad_b.address(),
                state1: buffers[1].address(),
                state2: buffers[2].address(),
                absmax1: buffers[3].address(),
                absmax2: buffers[4].address(),
                len: big,
            },
            DeviceAdam8bitParam {
                param: buffers[5].address(),
                grad: grad_s.address(),
                state1: buffers[6].address(),
                state2: buffers[7].address(),
                absmax1: 0,
                absmax2: 0,
                len: small,
            },
        ];
        // SAFETY: live buffers of the documented sizes (f32 states for the small tensor), kept
        // until the downloads below wait for the launches.
        unsafe { adam.step_buffers(&cfg, step, &params, (None, None)) }.unwrap();
        let bufs = Adam8bitBuffers {
            param: &mut pb,
            grad: &gb,
            state1: &mut c1,
            state2: &mut c2,
            absmax1: &mut a1,
            absmax2: &mut a2,
        };
        adam8bit_blockwise(
            &cfg,
            step,
            qmap1,
            qmap2,
            bufs,
            GradScaling::default(),
            NEAREST,
        )
        .unwrap();
        let states = F32States {
            param: &mut ps,
            grad: &gs,
            state1: &mut s1,
            state2: &mut s2,
        };
        adam_bnb_32bit(&cfg, step, states, GradScaling::default(), NEAREST).unwrap();
        assert_eq!(
            down(buffers[0].address(), big * 4),
            bytes(&pb),
            "8-bit, step {step}"
        );
        assert_eq!(
            down(buffers[1].address(), big),
            c1,
            "8-bit codes, step {step}"
        );
        assert_eq!(
            down(buffers[5].address(), small * 4),
            bytes(&ps),
            "32-bit, step {step}"
        );
        assert_eq!(
            down(buffers[6].address(), small * 4),
            bytes(&s1),
            "32-bit m, step {step}"
        );
        backend.allocator().free(grad_b).unwrap();
        backend.allocator().free(grad_s).unwrap();
    }
    drop(adam);
    for allocation in state.into_iter().chain(buffers) {
        backend.allocator().free(allocation).unwrap();
    }
}

/// The raw layer's safe `step` takes a GradScaler's values as tensors and checks them: of this
/// backend, f32, one element each; anything else is a typed error before any launch.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_raw_step_checks_the_scaling_tensors() {
    use headroom_optim::cuda::CudaAdam8bit;
    use headroom_optim::Adam8bitConfig;

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let cuda: BackendRef = backend.clone();
    let cpu: BackendRef = headroom_ops_cpu::CpuBackend::new_ref();
    // SAFETY: no buffers: `step` launches over none.
    let mut adam = unsafe { CudaFusedAdam::new(backend.clone(), &[]) }.unwrap();
    // SAFETY: as above.
    let mut eight = unsafe { CudaAdam8bit::new(backend.clone(), &[]) }.unwrap();
    let cases = [
        (
            "on the CPU",
            Tensor::from_slice(&cpu, &[1.0f32], &[1]).unwrap(),
        ),
        ("f64", Tensor::from_slice(&cuda, &[1.0f64], &[1]).unwrap()),
        (
            "two elements",
            Tensor::from_slice(&cuda, &[1.0f32, 2.0], &[2]).unwrap(),
        ),
    ];
    for (what, tensor) in cases {
        for as_flag in [false, true] {
            let scaling = if as_flag {
                DeviceGradScaling {
                    grad_scale: None,
                    found_inf: Some(tensor.clone()),
                }
            } else {
                DeviceGradScaling {
                    grad_scale: Some(tensor.clone()),
                    found_inf: None,
                }
            };
            let fused = adam.step(&AdamConfig::adam(), 1, Some(&scaling));
            let blockwise = eight.step(&Adam8bitConfig::adam(), 1, Some(&scaling));
            for outcome in [fused, blockwise] {
                let err = outcome.expect_err(what);
                let typed = match what {
                    "on the CPU" => matches!(err, OptimError::MixedDevices { .. }),
                    "f64" => matches!(
                        err,
                        OptimError::DType {
                            expected: DType::F32,
                            got: DType::F64,
                            ..
                        }
                    ),
                    _ => matches!(err, OptimError::InvalidArgument { .. }),
                };
                assert!(typed, "{what} (flag: {as_flag}): {err:?}");
            }
        }
    }
}

/// `step_buffers` does not keep its buffers: a later safe `step` launches over the buffers
/// given at creation (here none), never over a framework's buffers of an earlier step, which
/// may have been freed since. Overlapping or null buffers are refused before any launch.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_step_buffers_keep_nothing_and_refuse_overlaps() {
    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let n = 1000;
    let cfg = AdamConfig::adamw();
    let state: Vec<_> = [
        random(7, n, 1.0),
        random(8, n, 1.0),
        vec![0.0; n],
        vec![0.0; n],
    ]
    .iter()
    .map(|values| backend.upload(&bytes(values)).unwrap())
    .collect();
    let param = DeviceAdamParam {
        param: state[0].address(),
        grad: state[1].address(),
        exp_avg: state[2].address(),
        exp_avg_sq: state[3].address(),
        max_exp_avg_sq: None,
        len: n,
    };
    // SAFETY: no buffers at creation.
    let mut adam = unsafe { CudaFusedAdam::new(backend.clone(), &[]) }.unwrap();
    // SAFETY: live f32 buffers of `n` elements, kept until the end of the test.
    unsafe { adam.step_buffers(&cfg, 1, &[param], (None, None)) }.unwrap();
    let mut after_one = vec![0u8; n * 4];
    // SAFETY: a live allocation of `n` f32s.
    unsafe { backend.download(state[0].address(), &mut after_one) }.unwrap();
    for step in 2..=4 {
        adam.step(&cfg, step, None).unwrap();
    }
    let mut after_safe_steps = vec![0u8; n * 4];
    // SAFETY: as above.
    unsafe { backend.download(state[0].address(), &mut after_safe_steps) }.unwrap();
    assert_eq!(
        after_safe_steps, after_one,
        "a safe step touched the buffers of an earlier step_buffers"
    );

    let shared_state = DeviceAdamParam {
        exp_avg: state[2].address() + 16,
        ..param
    };
    let twice = [
        param,
        DeviceAdamParam {
            param: state[3].address(),
            ..shared_state
        },
    ];
    let null = DeviceAdamParam {
        exp_avg: 0,
        ..param
    };
    for params in [&twice[..], &[null][..]] {
        // SAFETY: refused before any launch (checked below).
        let err = unsafe { adam.step_buffers(&cfg, 2, params, (None, None)) }.unwrap_err();
        assert!(matches!(err, OptimError::InvalidArgument { .. }), "{err:?}");
        // SAFETY: as above: `new` checks the same.
        let err = unsafe { CudaFusedAdam::new(backend.clone(), params) }.unwrap_err();
        assert!(matches!(err, OptimError::InvalidArgument { .. }), "{err:?}");
    }
    drop(adam);
    for allocation in state {
        backend.allocator().free(allocation).unwrap();
    }
}

/// The framework path of the stochastic rule (`step_buffers_stochastic`): two bf16 parameters
/// with f32 moments, fresh gradient buffers every step, each keyed by its slot — the host
/// kernel's bits (`adam_fused_stochastic` with `AdamStochasticConfig::key(slot, step)`).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_stochastic_step_buffers_equal_the_host_kernel() {
    use headroom_optim::kernels::{adam_fused_stochastic, bf16, AdamStochasticBuffers};
    use headroom_optim::AdamStochasticConfig;

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let halves =
        |values: &[f32]| -> Vec<bf16> { values.iter().map(|&v| bf16::from_f32(v)).collect() };
    let half_bytes = |values: &[bf16]| -> Vec<u8> {
        values
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect()
    };
    let cfg = AdamStochasticConfig::new(
        AdamConfig {
            lr: 1e-3,
            weight_decay: 0.01,
            ..AdamConfig::adamw()
        },
        42,
    );
    let (lens, slots) = ([5000usize, 300], [0usize, 7]);
    let mut host: Vec<(Vec<bf16>, Vec<f32>, Vec<f32>)> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (
                halves(&random(i as u64 + 5, n, 2.0)),
                vec![0.0; n],
                vec![0.0; n],
            )
        })
        .collect();
    let device: Vec<_> = host
        .iter()
        .map(|(p, m, v)| [half_bytes(p), bytes(m), bytes(v)].map(|b| backend.upload(&b).unwrap()))
        .collect();
    // SAFETY: no buffers yet; each step names its own.
    let mut adam = unsafe { CudaFusedAdam::new(backend.clone(), &[]) }.unwrap();
    for step in 1..=3u64 {
        let grads: Vec<Vec<bf16>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| halves(&random(step * 13 + i as u64, n, 1.0)))
            .collect();
        let uploaded: Vec<_> = grads
            .iter()
            .map(|g| backend.upload(&half_bytes(g)).unwrap())
            .collect();
        let params: Vec<DeviceAdamParam> = (0..lens.len())
            .map(|i| DeviceAdamParam {
                param: device[i][0].address(),
                grad: uploaded[i].address(),
                exp_avg: device[i][1].address(),
                exp_avg_sq: device[i][2].address(),
                max_exp_avg_sq: None,
                len: lens[i],
            })
            .collect();
        // SAFETY: live bf16 parameters and gradients and f32 moments of `len` elements, kept
        // until the downloads below wait.
        unsafe { adam.step_buffers_stochastic(&cfg, step, &params, &slots, (None, None)) }.unwrap();
        for (i, (p, m, v)) in host.iter_mut().enumerate() {
            let bufs = AdamStochasticBuffers {
                param: p,
                grad: &grads[i],
                exp_avg: m,
                exp_avg_sq: v,
                max_exp_avg_sq: None,
            };
            adam_fused_stochastic(
                &cfg.adam,
                step,
                cfg.key(slots[i], step),
                bufs,
                GradScaling::NONE,
            )
            .unwrap();
            let mut got = vec![0u8; lens[i] * 2];
            // SAFETY: a live allocation of `len` bf16 elements.
            unsafe { backend.download(device[i][0].address(), &mut got) }.unwrap();
            assert_eq!(got, half_bytes(p), "parameter {i}, step {step}");
        }
        for grad in uploaded {
            backend.allocator().free(grad).unwrap();
        }
    }
    // Slots that do not match the parameters are refused before any launch.
    let wrong = [DeviceAdamParam {
        param: device[0][0].address(),
        grad: device[0][0].address(),
        exp_avg: device[0][1].address(),
        exp_avg_sq: device[0][2].address(),
        max_exp_avg_sq: None,
        len: lens[0],
    }];
    // SAFETY: refused before any launch (no slot for the parameter).
    let refused = unsafe { adam.step_buffers_stochastic(&cfg, 4, &wrong, &[], (None, None)) };
    assert!(matches!(refused, Err(OptimError::InvalidArgument { .. })));
}

/// The framework path of SGD (`CudaSgd::step_buffers`): f32 and bf16 parameters with momentum,
/// fresh gradient buffers every step — the host kernel's bits (`sgd_fused`).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_sgd_step_buffers_equal_the_host_kernel() {
    use headroom_optim::cuda::{CudaSgd, DeviceSgdParam};
    use headroom_optim::kernels::{bf16, sgd_fused, SgdBuffers, SgdConfig};

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let cfg = SgdConfig {
        momentum: 0.9,
        weight_decay: 0.01,
        ..SgdConfig::new(0.1)
    };
    let n = 3000;
    let mut sgd = CudaSgd::new(backend.clone());
    // f32.
    let (mut p, mut b) = (random(21, n, 2.0), vec![0.0f32; n]);
    let state = [bytes(&p), bytes(&b)].map(|v| backend.upload(&v).unwrap());
    // bf16.
    let half = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let half_bytes =
        |v: &[bf16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect() };
    let (mut hp, mut hb) = (half(&random(22, n, 2.0)), vec![bf16::ZERO; n]);
    let hstate = [half_bytes(&hp), half_bytes(&hb)].map(|v| backend.upload(&v).unwrap());
    for step in 1..=3u64 {
        let g = random(step * 17, n, 1.0);
        let hg = half(&g);
        let grads = [
            backend.upload(&bytes(&g)).unwrap(),
            backend.upload(&half_bytes(&hg)).unwrap(),
        ];
        let one = |param: u64, buffer: u64, grad: u64| DeviceSgdParam {
            param,
            grad,
            momentum_buffer: Some(buffer),
            len: n,
        };
        // SAFETY: live buffers of `n` elements of the dtype, kept until the downloads wait.
        unsafe {
            sgd.step_buffers(
                &cfg,
                DType::F32,
                step,
                &[one(
                    state[0].address(),
                    state[1].address(),
                    grads[0].address(),
                )],
                (None, None),
            )
            .unwrap();
            sgd.step_buffers(
                &cfg,
                DType::BF16,
                step,
                &[one(
                    hstate[0].address(),
                    hstate[1].address(),
                    grads[1].address(),
                )],
                (None, None),
            )
            .unwrap();
        }
        let first_step = step == 1;
        sgd_fused(
            &cfg,
            SgdBuffers {
                param: &mut p,
                grad: &g,
                momentum_buffer: Some(&mut b),
                first_step,
            },
            GradScaling::NONE,
        )
        .unwrap();
        sgd_fused(
            &cfg,
            SgdBuffers {
                param: &mut hp,
                grad: &hg,
                momentum_buffer: Some(&mut hb),
                first_step,
            },
            GradScaling::NONE,
        )
        .unwrap();
        let mut got = vec![0u8; n * 4];
        // SAFETY: a live allocation of `n` f32.
        unsafe { backend.download(state[0].address(), &mut got) }.unwrap();
        assert_eq!(got, bytes(&p), "f32, step {step}");
        let mut got = vec![0u8; n * 2];
        // SAFETY: a live allocation of `n` bf16.
        unsafe { backend.download(hstate[0].address(), &mut got) }.unwrap();
        assert_eq!(got, half_bytes(&hp), "bf16, step {step}");
        for grad in grads {
            backend.allocator().free(grad).unwrap();
        }
    }
}

/// The framework path of 4-bit Adam (`CudaAdam4bit::step_buffers`): a quantised [8192] and an
/// f32-state [37] bf16 parameter, stochastic rounding keyed by their slots, fresh gradients every
/// step — the host kernels' bits (`adam4bit_blockwise`, `adam4bit_f32_states`).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_4bit_step_buffers_equal_the_host_kernels() {
    use headroom_optim::cuda::{CudaAdam4bit, DeviceAdam8bitParam};
    use headroom_optim::kernels::{
        adam4bit_blockwise, adam4bit_f32_states, bf16, Adam4bitConfig, Bf16Rounding,
        BlockwiseBuffers, F32States,
    };

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let cfg = Adam4bitConfig {
        bf16_rounding: Bf16Rounding::Stochastic { seed: 5 },
        ..Adam4bitConfig::adamw()
    };
    let half = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let half_bytes =
        |v: &[bf16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect() };
    let (n, m, slots) = (8192usize, 37usize, [3usize, 4]);
    let mut wp = half(&random(31, n, 2.0));
    let (mut w1, mut w2, mut a1, mut a2) = (
        vec![0u8; n / 2],
        vec![0u8; n / 2],
        vec![0f32; 64],
        vec![0f32; 64],
    );
    let mut bp = half(&random(32, m, 2.0));
    let (mut b1, mut b2) = (vec![0f32; m], vec![0f32; m]);
    let up = |bytes: Vec<u8>| backend.upload(&bytes).unwrap();
    let w = [
        up(half_bytes(&wp)),
        up(w1.clone()),
        up(w2.clone()),
        up(bytes(&a1)),
        up(bytes(&a2)),
    ];
    let b = [up(half_bytes(&bp)), up(bytes(&b1)), up(bytes(&b2))];
    let mut adam = CudaAdam4bit::new(backend.clone());
    for step in 1..=3u64 {
        let (wg, bg) = (
            half(&random(step * 7, n, 1.0)),
            half(&random(step * 7 + 1, m, 1.0)),
        );
        let grads = [up(half_bytes(&wg)), up(half_bytes(&bg))];
        let params = [
            DeviceAdam8bitParam {
                param: w[0].address(),
                grad: grads[0].address(),
                state1: w[1].address(),
                state2: w[2].address(),
                absmax1: w[3].address(),
                absmax2: w[4].address(),
                len: n,
            },
            DeviceAdam8bitParam {
                param: b[0].address(),
                grad: grads[1].address(),
                state1: b[1].address(),
                state2: b[2].address(),
                absmax1: 0,
                absmax2: 0,
                len: m,
            },
        ];
        // SAFETY: live buffers of the sizes the call documents, kept until the downloads wait.
        unsafe { adam.step_buffers(&cfg, DType::BF16, step, &params, &slots, (None, None)) }
            .unwrap();
        let rounding = |slot| ParamRounding::of(cfg.bf16_rounding, slot, step);
        let bufs = BlockwiseBuffers {
            param: &mut wp,
            grad: &wg,
            state1: &mut w1,
            state2: &mut w2,
            absmax1: &mut a1,
            absmax2: &mut a2,
        };
        adam4bit_blockwise(&cfg, step, bufs, GradScaling::NONE, rounding(slots[0])).unwrap();
        let bufs = F32States {
            param: &mut bp,
            grad: &bg,
            state1: &mut b1,
            state2: &mut b2,
        };
        adam4bit_f32_states(&cfg, step, bufs, GradScaling::NONE, rounding(slots[1])).unwrap();
        for (address, want, what) in [
            (w[0].address(), half_bytes(&wp), "w"),
            (w[1].address(), w1.clone(), "w codes"),
            (b[0].address(), half_bytes(&bp), "b"),
        ] {
            let mut got = vec![0u8; want.len()];
            // SAFETY: a live allocation of `want.len()` bytes.
            unsafe { backend.download(address, &mut got) }.unwrap();
            assert_eq!(got, want, "{what}, step {step}");
        }
        for grad in grads {
            backend.allocator().free(grad).unwrap();
        }
    }
}
