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
