//! The framework path of the rules the `headroom` wheel steps on PyTorch's memory: raw device
//! buffers given per call (`CudaFusedAdam::step_buffers_stochastic`, `CudaSgd::step_buffers`,
//! `CudaAdam4bit::step_buffers`) against the host kernels, bit for bit, fresh gradient buffers
//! every step as torch's are. Each test is marked `#[ignore = "needs a CUDA device"]`.
#![cfg(feature = "cuda")]

use headroom_autograd_core::DType;
use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{CudaFusedAdam, DeviceAdamParam};
use headroom_optim::kernels::{AdamConfig, GradScaling, ParamElement, ParamRounding};
use headroom_optim::OptimError;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::Xorshift;

/// `n` values uniform in `[-scale/2, scale/2)` from the xorshift stream of state `seed | 1`.
fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut stream = Xorshift::from_state(seed | 1);
    std::iter::repeat_with(|| stream.next_signed_f32() * 0.5 * scale)
        .take(n)
        .collect()
}

/// `values` as little-endian bytes.
fn bytes(values: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

/// The framework path of the stochastic rule (`CudaFusedAdam::step_buffers_stochastic`): bf16
/// parameters with f32 moments, and with bf16 moments, fresh gradient buffers every step — the
/// host kernel's bits, parameters and moments (`adam_fused_stochastic` with
/// `AdamStochasticConfig::key(slot, step)`).
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_stochastic_step_buffers_equal_the_host_kernel() {
    use headroom_optim::kernels::bf16;

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    stochastic_case::<f32>(&backend, DType::F32, bytes);
    stochastic_case::<bf16>(&backend, DType::BF16, half_bytes);
}

/// The little-endian bytes of bf16 values.
fn half_bytes(values: &[headroom_optim::kernels::bf16]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect()
}

/// Three steps of three parameters with moments of `M` (`moments` on the device), device against
/// host after each.
fn stochastic_case<M: ParamElement>(
    backend: &std::sync::Arc<CudaBackend>,
    moments: DType,
    moment_bytes: fn(&[M]) -> Vec<u8>,
) {
    use headroom_optim::kernels::{adam_fused_stochastic, bf16, AdamStochasticBuffers};
    use headroom_optim::AdamStochasticConfig;

    let halves =
        |values: &[f32]| -> Vec<bf16> { values.iter().map(|&v| bf16::from_f32(v)).collect() };
    let cfg = AdamStochasticConfig::new(
        AdamConfig {
            lr: 1e-3,
            weight_decay: 0.01,
            ..AdamConfig::adamw()
        },
        42,
    );
    // Eight elements a thread where every buffer is aligned to 16 bytes (301 leaves five for the
    // element-wise tail); the third parameter starts four elements into its buffers (8 bytes for
    // bf16), where the kernel takes four at a time, and leaves three for the tail.
    let (lens, slots, shifts) = ([5000usize, 301, 1003], [0usize, 7, 3], [0usize, 0, 4]);
    let padded = |shift: usize, bytes: Vec<u8>, elem: usize| -> Vec<u8> {
        let mut out = vec![0u8; shift * elem];
        out.extend(bytes);
        out
    };
    let m_size = std::mem::size_of::<M>();
    let zero = M::from_f32(0.0);
    let mut host: Vec<(Vec<bf16>, Vec<M>, Vec<M>)> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (
                halves(&random(i as u64 + 5, n, 2.0)),
                vec![zero; n],
                vec![zero; n],
            )
        })
        .collect();
    let device: Vec<_> = host
        .iter()
        .zip(shifts)
        .map(|((p, m, v), s)| {
            [
                padded(s, half_bytes(p), 2),
                padded(s, moment_bytes(m), m_size),
                padded(s, moment_bytes(v), m_size),
            ]
            .map(|b| backend.upload(&b).unwrap())
        })
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
            .zip(shifts)
            .map(|(g, s)| backend.upload(&padded(s, half_bytes(g), 2)).unwrap())
            .collect();
        let params: Vec<DeviceAdamParam> = (0..lens.len())
            .map(|i| DeviceAdamParam {
                param: device[i][0].address() + 2 * shifts[i] as u64,
                grad: uploaded[i].address() + 2 * shifts[i] as u64,
                exp_avg: device[i][1].address() + (m_size * shifts[i]) as u64,
                exp_avg_sq: device[i][2].address() + (m_size * shifts[i]) as u64,
                max_exp_avg_sq: None,
                len: lens[i],
            })
            .collect();
        // SAFETY: live bf16 parameters and gradients and moments of `moments` and `len`
        // elements, kept until the downloads below wait.
        unsafe { adam.step_buffers_stochastic(&cfg, step, &params, &slots, moments, (None, None)) }
            .unwrap();
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
            let expected = [
                padded(shifts[i], half_bytes(p), 2),
                padded(shifts[i], moment_bytes(m), m_size),
                padded(shifts[i], moment_bytes(v), m_size),
            ];
            for (k, want) in expected.iter().enumerate() {
                let mut got = vec![0u8; want.len()];
                // SAFETY: a live allocation of `want.len()` bytes.
                unsafe { backend.download(device[i][k].address(), &mut got) }.unwrap();
                assert_eq!(
                    &got, want,
                    "{moments:?} moments: parameter {i}, buffer {k}, step {step}"
                );
            }
        }
        for grad in uploaded {
            backend.allocator().free(grad).unwrap();
        }
    }
    // Slots that do not match the parameters are refused before any launch, and so are
    // moments of another dtype.
    let wrong = [DeviceAdamParam {
        param: device[0][0].address(),
        grad: device[0][0].address(),
        exp_avg: device[0][1].address(),
        exp_avg_sq: device[0][2].address(),
        max_exp_avg_sq: None,
        len: lens[0],
    }];
    // SAFETY: refused before any launch (no slot for the parameter).
    let refused =
        unsafe { adam.step_buffers_stochastic(&cfg, 4, &wrong, &[], moments, (None, None)) };
    assert!(matches!(refused, Err(OptimError::InvalidArgument { .. })));
    // SAFETY: refused before any launch (f16 moments).
    let refused =
        unsafe { adam.step_buffers_stochastic(&cfg, 4, &wrong, &[0], DType::F16, (None, None)) };
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
    let n = 3001; // four elements a thread, then a tail of one
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

/// The framework path of Adafactor (`CudaAdafactor::step_buffers`): a factored [3, 40, 70] and a
/// vector [300] parameter, fresh gradients every step, each with its own step count — the host
/// kernel's values (`adafactor_fused`) within four ulps (the two norms are f64 sums in another
/// order), and a parameter whose moments do not fit its shape refused before any launch.
#[test]
#[ignore = "needs a CUDA device"]
fn gpu_adafactor_step_buffers_are_within_ulps_of_the_host_kernel() {
    use headroom_optim::cuda::{CudaAdafactor, DeviceAdafactorParam};
    use headroom_optim::kernels::{adafactor_fused, AdafactorBuffers, AdafactorConfig};

    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let cfg = AdafactorConfig {
        weight_decay: 1e-2,
        ..AdafactorConfig::new()
    };
    let shapes: [Vec<usize>; 2] = [vec![3, 40, 70], vec![300]];
    let mut host: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n: usize = shape.iter().product();
            let (rows, cols) = match shape.len() {
                1 => (n, 0),
                _ => (3 * 40, 3 * 70),
            };
            (
                random(i as u64 + 41, n, 2.0),
                vec![0.0; rows],
                vec![0.0; cols],
            )
        })
        .collect();
    let device: Vec<_> = host
        .iter()
        .map(|(p, r, c)| {
            let upload = |v: &[f32]| (!v.is_empty()).then(|| backend.upload(&bytes(v)).unwrap());
            (upload(p).unwrap(), upload(r).unwrap(), upload(c))
        })
        .collect();
    let mut adafactor = CudaAdafactor::new(backend.clone());
    for step in 1..=3u64 {
        let grads: Vec<Vec<f32>> = host
            .iter()
            .enumerate()
            .map(|(i, (p, _, _))| random(step * 7 + i as u64, p.len(), 1.0))
            .collect();
        let uploaded: Vec<_> = grads
            .iter()
            .map(|g| backend.upload(&bytes(g)).unwrap())
            .collect();
        let params: Vec<DeviceAdafactorParam> = shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let (p, first, second) = &device[i];
                let factored = shape.len() > 1;
                DeviceAdafactorParam {
                    param: p.address(),
                    grad: uploaded[i].address(),
                    shape: shape.clone(),
                    row_var: factored.then(|| first.address()),
                    col_var: second.as_ref().map(|c| c.address()),
                    variance: (!factored).then(|| first.address()),
                    step,
                }
            })
            .collect();
        // SAFETY: live contiguous f32 buffers of the sizes above, kept until the downloads wait.
        unsafe { adafactor.step_buffers(&cfg, &params, None) }.unwrap();
        for (i, (p, r, c)) in host.iter_mut().enumerate() {
            let (row_var, col_var, variance) = match shapes[i].len() > 1 {
                true => (Some(&mut r[..]), Some(&mut c[..]), None),
                false => (None, None, Some(&mut r[..])),
            };
            let bufs = AdafactorBuffers {
                param: p,
                grad: &grads[i],
                shape: &shapes[i],
                row_var,
                col_var,
                variance,
            };
            adafactor_fused(&cfg, step, bufs, GradScaling::NONE).unwrap();
            let mut got = vec![0u8; p.len() * 4];
            // SAFETY: a live allocation of `p.len()` f32.
            unsafe { backend.download(device[i].0.address(), &mut got) }.unwrap();
            let got: &[f32] = bytemuck::cast_slice(&got);
            let distance = headroom_testkit::ulps::max_ulps(got, p);
            assert!(distance <= 4, "parameter {i}, step {step}: {distance} ulps");
        }
        for grad in uploaded {
            backend.allocator().free(grad).unwrap();
        }
    }
    let mut wrong = DeviceAdafactorParam {
        param: device[0].0.address(),
        grad: device[0].0.address(),
        shape: shapes[0].clone(),
        row_var: None,
        col_var: None,
        variance: Some(device[0].1.address()),
        step: 4,
    };
    // SAFETY: refused before any launch (a factored shape with a variance).
    let refused = unsafe { adafactor.step_buffers(&cfg, std::slice::from_ref(&wrong), None) };
    assert!(matches!(refused, Err(OptimError::InvalidArgument { .. })));
    wrong.step = 0;
    // SAFETY: refused before any launch (step 0).
    let refused = unsafe { adafactor.step_buffers(&cfg, &[wrong], None) };
    assert!(matches!(refused, Err(OptimError::InvalidArgument { .. })));
}
