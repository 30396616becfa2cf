//! torchao 0.18's 4-bit Adam/AdamW against its reference data
//! (`testdata/torchao_adam4bit_golden.safetensors`): the two code tables and the quantiser bit
//! for bit, then five steps of `AdamW4bit` (`adamw`) and `Adam4bit` with L2 decay (`adam_l2`) on
//! the CPU against torchao's eager CPU run (`eager_*`) after every step — every state bit for
//! bit, `b`'s parameters bit for bit, `w`'s within 1e-8 (PyTorch's CPU square root is not
//! correctly rounded; see the test) — and against its compiled GPU run (`cuda_*`: codes equal,
//! parameters within 2e-7). Also: stepping one parameter at a time (an in-backward hook's
//! call) gives the same bits, a state dict continues the run, and bad hyperparameters, other
//! implementations and other dtypes are typed errors.

mod adam4bit_golden;

use adam4bit_golden::{configs, differing, max_abs_diff, run, state_key, Golden};
use adam4bit_golden::{PARAMS, STEPS};
use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{
    adam4bit_blockwise, code_4bit, dequantize_4bit, qmap4, quantize_4bit, Adam4bitBuffers,
    GradScaling, ParamRounding,
};
use headroom_optim::{Adam4bit, Adam4bitConfig, Implementation, OptimError, Optimizer, ParamGroup};
use headroom_testkit::worst::nan_max_f32;

#[test]
fn code_tables_equal_torchao_bit_for_bit() {
    let golden = Golden::load();
    for (signed, name) in [(true, "qmap.signed"), (false, "qmap.unsigned")] {
        let ours: Vec<u32> = qmap4(signed).iter().map(|v| v.to_bits()).collect();
        let theirs: Vec<u32> = golden.f32s(name).iter().map(|v| v.to_bits()).collect();
        assert_eq!(ours, theirs, "{name}");
    }
}

/// `quant.<table>.*`: random blocks, a zero block, midpoints between codes and one ulp either
/// side, huge and tiny magnitudes, a block under the scale's 1e-12 floor.
#[test]
fn the_quantiser_equals_torchao_bit_for_bit() {
    let golden = Golden::load();
    for (signed, table) in [(true, "signed"), (false, "unsigned")] {
        let qmap = qmap4(signed);
        let input = golden.f32s(&format!("quant.{table}.input"));
        let mut packed = vec![0u8; input.len() / 2];
        let mut scales = vec![0f32; input.len() / 128];
        quantize_4bit(&qmap, &input, &mut packed, &mut scales).unwrap();
        assert_eq!(
            packed,
            golden.bytes(&format!("quant.{table}.packed")),
            "{table}"
        );
        let scale_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let expected_scales = golden.f32s(&format!("quant.{table}.scale"));
        assert_eq!(scale_bits(&scales), scale_bits(&expected_scales), "{table}");
        let codes: Vec<u8> = input
            .iter()
            .enumerate()
            .map(|(j, x)| code_4bit(&qmap, x / scales[j / 128]))
            .collect();
        assert_eq!(
            codes,
            golden.bytes(&format!("quant.{table}.codes")),
            "{table}"
        );
        let mut dequant = vec![0f32; input.len()];
        dequantize_4bit(&qmap, &packed, &scales, &mut dequant).unwrap();
        let expected = golden.f32s(&format!("quant.{table}.dequant"));
        assert_eq!(scale_bits(&dequant), scale_bits(&expected), "{table}");
    }
}

/// Five steps of each configuration on the CPU against torchao's eager CPU run, after every
/// step: `w`'s packed codes and scales and `b`'s f32 states bit for bit, `b`'s parameters bit for
/// bit, `w`'s parameters within 1e-8 (at most 0.5% of them differ). Bitwise is not reachable for
/// `w`'s parameters: PyTorch's CPU `sqrt` of a float tensor (its vectorised x86 path, on the GPU
/// machine's CPU) is not correctly rounded — at step 1 of `adamw`, 8 of 8,192 roots are the
/// neighbour of the correctly rounded one (each exact root within 0.02 ulp of a midpoint), and
/// with the neighbour our update gives torchao's bits for all 8; we keep the correctly rounded
/// root, which the CUDA kernel computes too. Measured: at most 33 of 8,192 parameters differ
/// after a step, by at most 7.5e-9 (2^-27; the parameters are about 0.05); the states never
/// differ. Against torchao's compiled GPU run (inductor fuses and reorders the float32 operations;
/// its own eager and compiled runs differ by up to 1.8e-7) every code is equal and the parameters
/// are within 2e-7 (measured 6.7e-8 for `adamw`, 1.83e-7 for `adam_l2`).
#[test]
fn five_steps_match_torchao_eager_and_compiled() {
    let golden = Golden::load();
    let cpu = CpuBackend::new_ref();
    for (tag, cfg) in configs(&golden) {
        let records = run(&golden, &cfg, &cpu, false);
        let (mut worst_eager, mut most_differing) = (0f32, 0);
        let (mut worst_cuda, mut cuda_codes) = (0f32, 0);
        for (t, record) in (1..=STEPS).zip(&records) {
            assert_eq!(record.states[0].len(), 4, "w keeps 4-bit states");
            for (idx, p) in PARAMS.iter().enumerate() {
                let ours = &record.params[idx];
                let eager = golden.f32s(&format!("eager_{tag}.{p}.param.{t}"));
                let off = ours
                    .iter()
                    .zip(&eager)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                let worst = max_abs_diff(ours, &eager);
                if *p == "b" {
                    assert_eq!(
                        off, 0,
                        "{tag}.b step {t}: {off} parameters differ ({worst:e})"
                    );
                }
                assert!(worst <= 1e-8, "{tag}.{p} step {t}: {worst:e}");
                assert!(off * 200 <= ours.len(), "{tag}.{p} step {t}: {off} differ");
                worst_eager = nan_max_f32(worst_eager, worst);
                most_differing = most_differing.max(off);
                let compiled = golden.f32s(&format!("cuda_{tag}.{p}.param.{t}"));
                worst_cuda = nan_max_f32(worst_cuda, max_abs_diff(ours, &compiled));
                for (key, state) in &record.states[idx] {
                    let eager = golden.bytes(&state_key(&format!("eager_{tag}"), p, key, t));
                    assert!(
                        state == eager,
                        "{tag}.{p}.{key} step {t}: {} of {} bytes differ",
                        differing(state, eager, 1),
                        state.len()
                    );
                    if key.starts_with("state") && *p == "w" {
                        let compiled = golden.bytes(&state_key(&format!("cuda_{tag}"), p, key, t));
                        cuda_codes += differing(state, compiled, 1);
                    }
                }
            }
        }
        println!(
            "{tag}, {STEPS} steps: states and b equal torchao's eager CPU run bit for bit; w's \
             parameters: at most {most_differing} of 8192 differ, by at most {worst_eager:e}; \
             compiled CUDA: parameters within {worst_cuda:e}, {cuda_codes} code bytes differ"
        );
        assert!(worst_cuda <= 2e-7, "{tag}: {worst_cuda:e}");
        assert_eq!(cuda_codes, 0, "{tag}");
    }
}

/// Stepping one parameter at a time (what an optimizer-in-backward hook does) gives the bits
/// of a whole step.
#[test]
fn stepping_one_parameter_at_a_time_gives_the_same_bits() {
    let golden = Golden::load();
    let cpu = CpuBackend::new_ref();
    for (tag, cfg) in configs(&golden) {
        let whole = run(&golden, &cfg, &cpu, false);
        let one_by_one = run(&golden, &cfg, &cpu, true);
        for (a, b) in whole.iter().zip(&one_by_one) {
            let bits =
                |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
            assert_eq!(bits(&a.params), bits(&b.params), "{tag}");
            assert_eq!(a.states, b.states, "{tag}");
        }
    }
}

/// Saved after three steps and loaded into a fresh optimizer, the run continues as if
/// uninterrupted.
#[test]
fn a_state_dict_continues_the_run() {
    let golden = Golden::load();
    let cpu = CpuBackend::new_ref();
    let [(tag, cfg), _] = configs(&golden);
    let fresh = |values: &[Vec<f32>]| -> Vec<Tensor> {
        PARAMS
            .iter()
            .zip(values)
            .map(|(p, v)| {
                let t = Tensor::from_slice(&cpu, v, golden.shape(&format!("param.{p}.0"))).unwrap();
                t.requires_grad_(true).unwrap();
                t
            })
            .collect()
    };
    let start: Vec<Vec<f32>> = PARAMS
        .iter()
        .map(|p| golden.f32s(&format!("param.{p}.0")))
        .collect();
    let params = fresh(&start);
    let new = |params: &[Tensor]| {
        Adam4bit::new(
            vec![ParamGroup::new(params.to_vec(), cfg.clone())],
            Implementation::Fused,
        )
        .unwrap()
    };
    let set_grads = |params: &[Tensor], t: usize| {
        for (p, param) in PARAMS.iter().zip(params) {
            let name = format!("grad.{p}.{t}");
            let g = Tensor::from_slice(&cpu, &golden.f32s(&name), golden.shape(&name)).unwrap();
            param.set_grad(Some(g)).unwrap();
        }
    };
    let mut first = new(&params);
    for t in 1..=3 {
        set_grads(&params, t);
        first.step().unwrap();
    }
    let saved = first.state_dict().unwrap();
    let values: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    let resumed_params = fresh(&values);
    let mut resumed = new(&resumed_params);
    resumed.load_state_dict(&saved).unwrap();
    for t in 4..=5 {
        set_grads(&params, t);
        first.step().unwrap();
        set_grads(&resumed_params, t);
        resumed.step().unwrap();
    }
    for (idx, (a, b)) in params.iter().zip(&resumed_params).enumerate() {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert!(a == b, "{tag}: parameter {idx} differs after resuming");
        let eager = golden.f32s(&format!("eager_{tag}.{}.param.5", PARAMS[idx]));
        assert!(
            max_abs_diff(&a, &eager) <= 1e-8,
            "{tag}: parameter {idx} is not torchao's"
        );
    }
    assert_eq!(
        first.param_step(0, 0).unwrap(),
        resumed.param_step(0, 0).unwrap()
    );
}

#[test]
fn bad_hyperparameters_implementations_and_dtypes_are_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let param = Tensor::zeros(&cpu, &[4096], DType::F32).unwrap();
    let new = |cfg: Adam4bitConfig, implementation, param: &Tensor| {
        Adam4bit::new(
            vec![ParamGroup::new(vec![param.clone()], cfg)],
            implementation,
        )
    };
    let base = Adam4bitConfig::adamw();
    for bad in [
        Adam4bitConfig {
            lr: -1e-3,
            ..base.clone()
        },
        Adam4bitConfig {
            lr: f64::NAN,
            ..base.clone()
        },
        Adam4bitConfig {
            betas: (1.0, 0.999),
            ..base.clone()
        },
        Adam4bitConfig {
            betas: (0.9, -0.1),
            ..base.clone()
        },
        Adam4bitConfig {
            eps: -1e-8,
            ..base.clone()
        },
        Adam4bitConfig {
            weight_decay: f64::INFINITY,
            ..base.clone()
        },
    ] {
        let err = new(bad.clone(), Implementation::Fused, &param).unwrap_err();
        assert!(
            matches!(err, OptimError::InvalidArgument { .. }),
            "{bad:?}: {err}"
        );
    }
    let amsgrad = Adam4bitConfig {
        amsgrad: true,
        ..base.clone()
    };
    let err = new(amsgrad, Implementation::Fused, &param).unwrap_err();
    assert!(matches!(err, OptimError::Unsupported { .. }), "{err}");
    for implementation in [
        Implementation::Single,
        Implementation::FOREACH,
        Implementation::ForeachUnbounded,
    ] {
        let err = new(base.clone(), implementation, &param).unwrap_err();
        assert!(matches!(err, OptimError::Unsupported { .. }), "{err}");
    }
    // bf16 parameters are taken (tests/blockwise_bf16.rs); f16 ones are a typed error.
    let half = Tensor::zeros(&cpu, &[4096], DType::F16).unwrap();
    let refused = new(base.clone(), Implementation::Fused, &half).map(drop);
    assert!(
        matches!(
            refused,
            Err(OptimError::DType {
                got: DType::F16,
                ..
            })
        ),
        "{refused:?}"
    );
    // The raw kernel: step 0, buffers of the wrong lengths, a length not whole blocks.
    let (mut p, g) = (vec![0f32; 256], vec![0f32; 256]);
    let (mut c1, mut c2) = (vec![0u8; 128], vec![0u8; 128]);
    let (mut s1, mut s2) = (vec![0f32; 2], vec![0f32; 1]);
    let mut call = |step, p: &mut [f32], s2: &mut [f32]| {
        let bufs = Adam4bitBuffers {
            grad: &g[..p.len()],
            param: p,
            state1: &mut c1[..],
            state2: &mut c2[..],
            absmax1: &mut s1[..],
            absmax2: s2,
        };
        adam4bit_blockwise(&base, step, bufs, GradScaling::NONE, ParamRounding::NEAREST)
    };
    assert!(matches!(
        call(1, &mut p, &mut s2),
        Err(OptimError::LengthMismatch { .. })
    ));
    let mut s2 = vec![0f32; 2];
    assert!(matches!(
        call(0, &mut p, &mut s2),
        Err(OptimError::InvalidArgument { .. })
    ));
    assert!(matches!(
        call(1, &mut p[..200], &mut s2),
        Err(OptimError::InvalidArgument { .. })
    ));
    assert!(call(1, &mut p, &mut s2).is_ok());
}

/// A step whose gradients overflowed (`found_inf`) writes nothing; a loss scale is divided out
/// before the update.
#[test]
fn grad_scaling_skips_and_unscales_in_the_kernel() {
    let cfg = Adam4bitConfig::adamw();
    let n = 4096;
    let grad: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e-2).collect();
    let scaled: Vec<f32> = grad.iter().map(|g| g * 1024.0).collect();
    let step = |grad: &[f32], scaling: GradScaling| {
        let mut p = vec![0.05f32; n];
        let (mut c1, mut c2) = (vec![0u8; n / 2], vec![0u8; n / 2]);
        let (mut s1, mut s2) = (vec![0f32; n / 128], vec![0f32; n / 128]);
        let bufs = Adam4bitBuffers {
            param: &mut p,
            grad,
            state1: &mut c1,
            state2: &mut c2,
            absmax1: &mut s1,
            absmax2: &mut s2,
        };
        let outcome = adam4bit_blockwise(&cfg, 1, bufs, scaling, ParamRounding::NEAREST).unwrap();
        (outcome, p, c1, s1)
    };
    let plain = step(&grad, GradScaling::NONE);
    let unscaled = step(
        &scaled,
        GradScaling {
            grad_scale: Some(1024.0),
            found_inf: Some(0.0),
        },
    );
    assert_eq!(plain.1, unscaled.1);
    assert_eq!(plain.2, unscaled.2);
    let skipped = step(
        &grad,
        GradScaling {
            grad_scale: None,
            found_inf: Some(1.0),
        },
    );
    assert_eq!(skipped.0, headroom_optim::kernels::StepOutcome::Skipped);
    assert!(skipped.1.iter().all(|&v| v == 0.05) && skipped.3.iter().all(|&s| s == 0.0));
}
