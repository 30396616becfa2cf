//! torchao's 4-bit Adam/AdamW on CUDA tensors against the same rule on the CPU and against
//! torchao (`testdata/torchao_adam4bit_golden.safetensors`): the golden five steps of `adamw` and
//! `adam_l2` on the GPU equal the CPU's bit for bit after every step (parameters, packed codes,
//! scales, f32 states), stepping all parameters at once or one at a time (an in-backward hook's
//! call); so every code and scale equals torchao's eager CPU run, the parameters are within 1e-8
//! of it (`golden_adam4bit.rs` says why not bitwise), and the codes equal torchao's compiled GPU
//! run with the parameters within 2e-7 of it. Then random parameters with 4-bit and f32 states
//! under a device GradScaler with a device-skipped step: the parameters are within 4 ulps of the
//! CPU's and the states equal (AdamW's always, Adam's where the parameter is) (after a skip the device recomputes the bias corrections with its
//! `pow`, within an ulp of the host's). Each test is marked `#[ignore = "needs a CUDA device"]`:
//! it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

mod adam4bit_golden;
mod cuda_tensors;

use adam4bit_golden::{configs, differing, max_abs_diff, run, state_key, Golden};
use adam4bit_golden::{PARAMS, STEPS};
use cuda_tensors::{random, raw_bytes, scaled_step, shared_cuda_and_cpu, tensor_of};
use headroom_autograd_core::{DType, Tensor};
use headroom_optim::cuda::fast_arithmetic_mismatches;
use headroom_optim::{Adam4bit, Adam4bitConfig, Implementation, Optimizer, ParamGroup};
use headroom_testkit::ulps::max_ulps;
use headroom_testkit::worst::nan_max_f32;

#[test]
#[ignore = "needs a CUDA device"]
fn golden_steps_on_cuda_equal_the_cpu_and_torchao() {
    let Some((cuda, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    let golden = Golden::load();
    for (tag, cfg) in configs(&golden) {
        let on_cpu = run(&golden, &cfg, &cpu, false);
        for one_by_one in [false, true] {
            let on_cuda = run(&golden, &cfg, &cuda, one_by_one);
            let mut worst_eager = 0f32;
            let mut worst_compiled = 0f32;
            for (t, (ours, cpu)) in (1..=STEPS).zip(on_cuda.iter().zip(&on_cpu)) {
                for (idx, p) in PARAMS.iter().enumerate() {
                    let (a, b) = (&ours.params[idx], &cpu.params[idx]);
                    let off = a
                        .iter()
                        .zip(b)
                        .filter(|(x, y)| x.to_bits() != y.to_bits())
                        .count();
                    assert_eq!(
                        off,
                        0,
                        "{tag}.{p} step {t} (one by one: {one_by_one}): {off} parameters differ \
                         from the CPU's, by up to {:e}",
                        max_abs_diff(a, b)
                    );
                    let eager = golden.f32s(&format!("eager_{tag}.{p}.param.{t}"));
                    worst_eager = nan_max_f32(worst_eager, max_abs_diff(a, &eager));
                    let compiled = golden.f32s(&format!("cuda_{tag}.{p}.param.{t}"));
                    worst_compiled = nan_max_f32(worst_compiled, max_abs_diff(a, &compiled));
                    for (key, state) in &ours.states[idx] {
                        let on_host = &cpu.states[idx][key];
                        assert!(
                            state == on_host,
                            "{tag}.{p}.{key} step {t}: {} of {} bytes differ from the CPU's",
                            differing(state, on_host, 1),
                            state.len()
                        );
                        let eager = golden.bytes(&state_key(&format!("eager_{tag}"), p, key, t));
                        assert!(state == eager, "{tag}.{p}.{key} step {t}: not torchao's");
                        if key.starts_with("state") && *p == "w" {
                            let compiled =
                                golden.bytes(&state_key(&format!("cuda_{tag}"), p, key, t));
                            assert_eq!(differing(state, compiled, 1), 0, "{tag}.{p}.{key} {t}");
                        }
                    }
                }
            }
            println!(
                "{tag} (one by one: {one_by_one}): CUDA equals the CPU bit for bit over {STEPS} \
                 steps; parameters within {worst_eager:e} of torchao eager, {worst_compiled:e} \
                 of torchao compiled"
            );
            assert!(worst_eager <= 1e-8, "{tag}: {worst_eager:e}");
            assert!(worst_compiled <= 2e-7, "{tag}: {worst_compiled:e}");
        }
    }
}

/// Shapes with 4-bit states (whole blocks of 128 from 4096 elements: one of many blocks, a
/// matrix) and with f32 states (too small; not whole blocks).
const SHAPES: [&[usize]; 5] = [&[4096], &[547, 128], &[300, 128], &[37], &[5000]];

/// A GradScaler: steps 1, 3, 4 and 5 unscale by 1024, step 2 has found-inf set; the CPU skips it
/// on the host, CUDA on the device (counting it there).
#[test]
#[ignore = "needs a CUDA device"]
fn a_device_grad_scaler_skips_on_the_device_and_matches_the_cpu() {
    let Some((cuda, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    for (tag, cfg) in [
        ("adamw", Adam4bitConfig::adamw()),
        (
            "adam_l2",
            Adam4bitConfig {
                weight_decay: 0.1,
                ..Adam4bitConfig::adam()
            },
        ),
    ] {
        let mut snapshots = Vec::new();
        for backend in [&cpu, &cuda] {
            let params: Vec<Tensor> = SHAPES
                .iter()
                .enumerate()
                .map(|(i, shape)| {
                    let n = shape.iter().product();
                    tensor_of(backend, &random(i as u64 + 3, n, 0.2), shape, DType::F32)
                })
                .collect();
            let mut optimizer = Adam4bit::new(
                vec![ParamGroup::new(params.clone(), cfg.clone())],
                Implementation::Fused,
            )
            .unwrap();
            for (step, overflow) in [false, true, false, false, false].into_iter().enumerate() {
                for (i, (param, shape)) in params.iter().zip(SHAPES).enumerate() {
                    let n = shape.iter().product();
                    let grad: Vec<f32> = random(10 * step as u64 + i as u64, n, 0.02)
                        .iter()
                        .map(|g| g * 1024.0)
                        .collect();
                    let grad = tensor_of(backend, &grad, shape, DType::F32);
                    param.set_grad(Some(grad)).unwrap();
                }
                scaled_step(&mut optimizer, backend, &cpu, overflow);
            }
            for idx in 0..params.len() {
                assert_eq!(optimizer.param_step(0, idx).unwrap(), 4, "{tag}");
            }
            let states: Vec<Vec<(String, Vec<u8>)>> = (0..params.len())
                .map(|idx| {
                    optimizer
                        .param_state(0, idx)
                        .into_iter()
                        .map(|(name, t)| (name.to_string(), raw_bytes(&t)))
                        .collect()
                })
                .collect();
            let values: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec().unwrap()).collect();
            snapshots.push((values, states));
        }
        let (host, device) = (&snapshots[0], &snapshots[1]);
        let mut worst = 0;
        for (idx, shape) in SHAPES.iter().enumerate() {
            let distance = max_ulps(&host.0[idx], &device.0[idx]);
            worst = worst.max(distance);
            let mut host_states = host.1[idx].clone();
            let mut device_states = device.1[idx].clone();
            host_states.sort();
            device_states.sort();
            let quantized = host_states.len() == 4;
            let n: usize = shape.iter().product();
            assert_eq!(
                quantized,
                n >= 4096 && n.is_multiple_of(128),
                "{tag} {shape:?}"
            );
            if tag == "adamw" || distance == 0 {
                // AdamW's states do not depend on the parameter (nor on the bias corrections);
                // Adam's L2 term feeds the parameter into them.
                assert!(
                    host_states == device_states,
                    "{tag} {shape:?}: states differ"
                );
            }
        }
        println!("{tag} with a device GradScaler: parameters within {worst} ulps of the CPU");
        assert!(worst <= 4, "{tag}: {worst} ulps");
    }
}

/// The kernel's written-out division and square root equal `div.rn` and `sqrt.rn` wherever its
/// range checks admit them: every sign and significand of every exponent as a dividend, by 64
/// divisors that span the admitted range (its two ends among them), and as a radicand.
#[test]
#[ignore = "needs a CUDA device"]
fn fast_arithmetic_equals_the_correctly_rounded_one() {
    let Some((cuda, _cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    // The admitted divisors are [2^-58, 2^58): the two ends, 1, torchao's least scale, a bias
    // correction, then one divisor of random significand every other exponent from 2^-58 up.
    let mut divisors = vec![
        f32::from_bits(69 << 23),
        f32::from_bits((185 << 23) - 1),
        1.0,
        1e-12,
        1.0 - 0.999f32.powi(3),
    ];
    let significands = random(41, 64, 2.0);
    divisors.extend((0..59).map(|k| {
        let significand = (significands[k].to_bits() & 0x7f_ffff) | 0x3f80_0000;
        f32::from_bits(significand) * 2f32.powi(2 * k as i32 - 58)
    }));
    assert_eq!(divisors.len(), 64);
    let divisors = tensor_of(&cuda, &divisors, &[64], DType::F32);
    for exponent in 0..=u8::MAX {
        let [quotients, roots] = fast_arithmetic_mismatches(&divisors, exponent).unwrap();
        assert_eq!(
            (quotients, roots),
            (0, 0),
            "biased exponent {exponent}: quotients and square roots that differ from div.rn's \
             and sqrt.rn's"
        );
    }
}

/// Operands outside the fast arithmetic's range — zero, signed zero, subnormal, tiny and huge
/// gradients, and parameters — take the kernel's exact path per lane: parameters, codes and
/// scales equal the CPU's bit for bit after every step, Adam and AdamW, f32 parameters. A
/// gradient whose square overflows makes its block's second moment infinite, and the next
/// step's `lerp(inf, g², w)` NaN, so the block's parameters turn NaN on both devices: a NaN
/// parameter need only be NaN on both (x86 and the GPU make NaNs of different bits; the scales
/// are Rust's NaN on both).
#[test]
#[ignore = "needs a CUDA device"]
fn edge_operands_take_the_exact_path_and_equal_the_cpu() {
    let Some((cuda, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    const N: usize = 8192;
    // Every 128-element block mixes ordinary values with one kind of edge operand (some blocks
    // have none, so the fast path runs beside the exact one within a launch).
    let edges = [
        0.0, -0.0, 1e-40, -3e-39, 1e-30, -2e-25, 1e-19, 3e18, -1e25, 1e30,
    ];
    let values = |seed: u64, scale: f32| -> Vec<f32> {
        let mut values = random(seed, N, scale);
        for (i, value) in values.iter_mut().enumerate() {
            let block = i / 128;
            if block % 12 < edges.len() && i % 7 == block % 7 {
                *value = edges[block % 12];
            }
        }
        values
    };
    for (tag, cfg) in [
        ("adamw", Adam4bitConfig::adamw()),
        (
            "adam_l2",
            Adam4bitConfig {
                weight_decay: 0.01,
                ..Adam4bitConfig::adam()
            },
        ),
    ] {
        let mut runs = Vec::new();
        for backend in [&cpu, &cuda] {
            let param = tensor_of(backend, &values(5, 0.2), &[N], DType::F32);
            let mut optimizer = Adam4bit::new(
                vec![ParamGroup::new(vec![param.clone()], cfg.clone())],
                Implementation::Fused,
            )
            .unwrap();
            let mut after_each = Vec::new();
            for step in 0..4u64 {
                let grad = tensor_of(backend, &values(60 + step, 0.02), &[N], DType::F32);
                param.set_grad(Some(grad)).unwrap();
                optimizer.step().unwrap();
                let states: Vec<(String, Vec<u8>)> = optimizer
                    .param_state(0, 0)
                    .into_iter()
                    .map(|(name, t)| (name.to_string(), raw_bytes(&t)))
                    .collect();
                after_each.push((raw_bytes(&param), states));
            }
            runs.push(after_each);
        }
        for (step, (host, device)) in runs[0].iter().zip(&runs[1]).enumerate() {
            let value = |bytes: &[u8]| f32::from_le_bytes(bytes.try_into().unwrap());
            let differing = host
                .0
                .chunks(4)
                .zip(device.0.chunks(4))
                .filter(|(a, b)| {
                    let (a, b) = (value(a), value(b));
                    a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan())
                })
                .count();
            assert_eq!(differing, 0, "{tag} step {}: parameters differ", step + 1);
            assert!(host.1 == device.1, "{tag} step {}: states differ", step + 1);
        }
    }
}
