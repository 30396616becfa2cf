//! The GradScaler against PyTorch: the golden sequence of scales and parameters reproduced
//! exactly on both of its paths; zero host reads in a whole step with a fused optimizer (counted
//! through the backend); f16 and bf16 gradients unscaled in f32 arithmetic; PyTorch's misuse
//! errors as typed errors; skipped steps that a scheduler does not count; the state dict; and
//! training with the scaler bitwise equal to training without it (a power-of-two scale is exact).

use std::sync::Arc;

use half::{bf16, f16};
use headroom_amp::{AmpError, AmpPolicy, GradScaler, GradScalerConfig, GradScalerState};
use headroom_autograd_core::{BackendRef, DType, Generator, Tensor};
use headroom_nn::{Activation, Dropout, Mlp, Module, VitConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{
    Adam, AdamConfig, Implementation, LrScheduler, Optimizer, ParamGroup, Schedule, Sgd, SgdConfig,
    SkipFlag,
};
use headroom_testkit::counting::HostReadCounter;
use headroom_testkit::{
    check_technique, Batch, ModelSpec, OptimSpec, Technique, Tolerance, TrainCase, TrainRun,
};

fn golden() -> serde_json::Value {
    let file: serde_json::Value =
        serde_json::from_str(include_str!("../../../testdata/grad_scaler_golden.json")).unwrap();
    file["grad_scaler"].clone()
}

/// A parameter of four ones that requires grad, and SGD over it at `lr`.
fn four_ones_and_sgd(
    backend: &BackendRef,
    lr: f64,
    implementation: Implementation,
) -> (Tensor, Sgd) {
    let p = Tensor::ones(backend, &[4], DType::F32).unwrap();
    p.requires_grad_(true).unwrap();
    let sgd = Sgd::new(
        vec![ParamGroup::new(vec![p.clone()], SgdConfig::new(lr))],
        implementation,
    )
    .unwrap();
    (p, sgd)
}

/// PyTorch's sequence (growth interval 3, overflows at steps 4, 8 and 9), on the fused path
/// (the kernel divides by the scale, the flag read in place) and on the unscale-then-read path:
/// every scale and every parameter bit equal.
#[test]
fn the_golden_sequence_is_reproduced_exactly() {
    let golden = golden();
    for implementation in [Implementation::Fused, Implementation::Single] {
        let cpu = CpuBackend::new_ref();
        let (p, mut sgd) = four_ones_and_sgd(&cpu, 0.1, implementation);
        let c = Tensor::from_slice(&cpu, &[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
        let config = GradScalerConfig {
            init_scale: golden["init_scale"].as_f64().unwrap(),
            growth_factor: golden["growth_factor"].as_f64().unwrap(),
            backoff_factor: golden["backoff_factor"].as_f64().unwrap(),
            growth_interval: golden["growth_interval"].as_u64().unwrap() as u32,
            enabled: true,
        };
        let mut scaler = GradScaler::new(config).unwrap();
        for step in golden["steps"].as_array().unwrap() {
            let before = p.to_vec::<f32>().unwrap();
            let mut loss = p.mul(&c).unwrap().sum_all().unwrap();
            if step["inf_in_loss"].as_bool().unwrap() {
                loss = loss.mul_scalar(f64::INFINITY).unwrap();
            }
            scaler.scale(&loss).unwrap().backward().unwrap();
            let skipped = scaler.step(&mut sgd).unwrap();
            scaler.update().unwrap();
            sgd.zero_grad(true).unwrap();
            let at = format!("{implementation:?} step {}", step["step"]);
            assert_eq!(
                f64::from(scaler.get_scale().unwrap()),
                step["scale_after_update"].as_f64().unwrap(),
                "{at}"
            );
            let expected: Vec<u32> = step["param"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| (v.as_f64().unwrap() as f32).to_bits())
                .collect();
            let got = p.to_vec::<f32>().unwrap();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected,
                "{at}"
            );
            let changed = step["param_changed"].as_bool().unwrap();
            assert_eq!(got != before, changed, "{at}");
            assert!(
                matches!(skipped, SkipFlag::Known(s) if s != changed),
                "{at}"
            );
        }
    }
}

/// A model whose every op runs on the counting backend.
fn mlp(backend: &BackendRef) -> Mlp {
    let generator = Arc::new(Generator::new(7));
    Mlp::new(
        backend,
        32,
        64,
        Activation::Gelu,
        Dropout::new(0.0, Arc::clone(&generator)),
        DType::F32,
        &generator,
    )
    .unwrap()
}

/// Steps of scale, backward, step, update and zero_grad with fused Adam read nothing back to the
/// host — overflowed steps included — while the non-fused path reads its flag once per step.
#[test]
fn a_fused_step_reads_nothing_back_to_the_host() {
    for (implementation, reads_per_step) in
        [(Implementation::Fused, 0), (Implementation::FOREACH, 1)]
    {
        let counter = HostReadCounter::wrap(CpuBackend::new_ref());
        let backend: BackendRef = counter.clone();
        let model = mlp(&backend);
        let mut adam = Adam::new(
            vec![ParamGroup::new(model.parameters(), AdamConfig::adamw())],
            implementation,
        )
        .unwrap();
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let x = Tensor::full(&backend, &[8, 32], 0.5, DType::F32).unwrap();
        let mut step = |scaler: &mut GradScaler, overflow: bool| {
            let mut loss = model.forward(&x).unwrap().sum_all().unwrap();
            if overflow {
                loss = loss.mul_scalar(f64::INFINITY).unwrap();
            }
            scaler.scale(&loss).unwrap().backward().unwrap();
            scaler.step(&mut adam).unwrap();
            scaler.update().unwrap();
            adam.zero_grad(true).unwrap();
        };
        step(&mut scaler, false);
        let before = counter.host_reads();
        for overflow in [false, true, false, false, true] {
            step(&mut scaler, overflow);
        }
        assert_eq!(
            counter.host_reads() - before,
            5 * reads_per_step,
            "{implementation:?}"
        );
        // Two overflows halved the scale twice.
        assert_eq!(scaler.get_scale().unwrap(), 16384.0, "{implementation:?}");
    }
}

/// `round(f32(g) · f32(1 / scale))` per element: what the unscale of an f16 or bf16 gradient must
/// give.
fn expected_unscaled(values: &[f32], scale: f64, dtype: DType) -> Vec<f32> {
    let inv = (1.0 / scale) as f32;
    values
        .iter()
        .map(|&g| match dtype {
            DType::BF16 => bf16::from_f32(g * inv).to_f32(),
            _ => f16::from_f32(g * inv).to_f32(),
        })
        .collect()
}

/// f16 and bf16 gradients (PyTorch: "Attempting to unscale FP16 gradients", "not implemented for
/// 'BFloat16'") are unscaled in f32 arithmetic and rounded once; a non-finite one sets the flag
/// and the step is skipped.
#[test]
fn half_gradients_are_unscaled_in_f32() {
    let cpu = CpuBackend::new_ref();
    for dtype in [DType::F16, DType::BF16] {
        let n = 512;
        let values: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 3000.0).collect();
        let p = Tensor::zeros(&cpu, &[n], dtype).unwrap();
        p.requires_grad_(true).unwrap();
        let grad_values: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
        let exact: Vec<f32> = Tensor::from_f64s(&cpu, &grad_values, &[n], dtype)
            .unwrap()
            .to_vec_f64()
            .unwrap()
            .iter()
            .map(|&v| v as f32)
            .collect();
        let mut sgd = Sgd::new(
            vec![ParamGroup::new(vec![p.clone()], SgdConfig::new(1.0))],
            Implementation::Single,
        )
        .unwrap();
        // A scale whose inverse is not a power of two: the rounding shows.
        let config = GradScalerConfig {
            init_scale: 3.0,
            ..GradScalerConfig::default()
        };
        let mut scaler = GradScaler::new(config).unwrap();
        let loss = p.to_dtype(DType::F32).unwrap().sum_all().unwrap();
        scaler.scale(&loss).unwrap(); // creates the scale
        p.set_grad(Some(
            Tensor::from_f64s(&cpu, &grad_values, &[n], dtype).unwrap(),
        ))
        .unwrap();
        scaler.unscale_(&sgd).unwrap();
        let got: Vec<f32> = p
            .grad()
            .unwrap()
            .to_vec_f64()
            .unwrap()
            .iter()
            .map(|&v| v as f32)
            .collect();
        assert_eq!(got, expected_unscaled(&exact, 3.0, dtype), "{dtype:?}");
        assert_eq!(scaler.found_inf().unwrap().to_vec::<f32>().unwrap(), [0.0]);
        // The step runs on the unscaled f16/bf16 gradient: p = -g / 3.
        assert!(!scaler.step(&mut sgd).unwrap().read().unwrap());
        scaler.update().unwrap();

        // An infinite f16/bf16 gradient: flagged, skipped, scale backed off.
        let before = p.to_vec_f64().unwrap();
        let mut with_inf = grad_values.clone();
        with_inf[7] = f64::INFINITY;
        p.set_grad(Some(
            Tensor::from_f64s(&cpu, &with_inf, &[n], dtype).unwrap(),
        ))
        .unwrap();
        assert!(scaler.step(&mut sgd).unwrap().read().unwrap(), "{dtype:?}");
        scaler.update().unwrap();
        assert_eq!(p.to_vec_f64().unwrap(), before);
        assert_eq!(scaler.get_scale().unwrap(), 1.5);
    }
}

/// PyTorch's misuse checks, as typed errors that say what to do.
#[test]
fn misuse_is_a_typed_error() {
    let cpu = CpuBackend::new_ref();
    let (p, mut sgd) = four_ones_and_sgd(&cpu, 0.1, Implementation::Fused);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    assert!(matches!(scaler.unscale_(&sgd), Err(AmpError::NotScaled)));
    assert!(matches!(scaler.update(), Err(AmpError::UpdateWithoutCheck)));
    let loss = p.sum_all().unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
    scaler.unscale_(&sgd).unwrap();
    let twice = scaler.unscale_(&sgd).unwrap_err();
    assert!(matches!(twice, AmpError::AlreadyUnscaled));
    assert!(twice.to_string().contains("once per step"), "{twice}");
    scaler.step(&mut sgd).unwrap();
    assert!(matches!(
        scaler.unscale_(&sgd),
        Err(AmpError::UnscaleAfterStep)
    ));
    assert!(matches!(scaler.step(&mut sgd), Err(AmpError::StepTwice)));
    scaler.update().unwrap();
    // Unscaled once before the step: the step does not divide again.
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.9f32; 4]);

    for bad in [
        GradScalerConfig {
            growth_factor: 1.0,
            ..GradScalerConfig::default()
        },
        GradScalerConfig {
            backoff_factor: 1.0,
            ..GradScalerConfig::default()
        },
        GradScalerConfig {
            growth_interval: 0,
            ..GradScalerConfig::default()
        },
    ] {
        refusal_reason(GradScaler::new(bad), &format!("{bad:?}"));
    }
}

/// The reason of `result`'s [`AmpError::InvalidScalerConfig`]; panics, naming `what` was
/// refused, on any other result.
fn refusal_reason<T>(result: Result<T, AmpError>, what: &str) -> String {
    match result {
        Err(AmpError::InvalidScalerConfig { reason }) => reason,
        Err(err) => panic!("{what}: {err}, not an invalid scaler configuration"),
        Ok(_) => panic!("{what}: accepted"),
    }
}

/// Every scale that enters the device from the host is a positive normal f32: an f64 setting
/// that rounds to 0 (1e-50), a subnormal (1e-40), zero, a negative, NaN or infinity is a typed
/// error from the settings, `update_to` and a loaded state alike; so is a growth tracker too
/// large to be an exact f32 integer. Before the check, `init_scale: 1e-50` made the scale 0 and
/// one step turned every parameter into NaN.
#[test]
fn every_scale_that_enters_the_device_is_a_positive_normal_f32() {
    let bad_scales = [1e-50, 1e-40, 0.0, -1.0, f64::NAN, f64::INFINITY, 1e39];
    for init_scale in bad_scales {
        let config = GradScalerConfig {
            init_scale,
            ..GradScalerConfig::default()
        };
        let reason = refusal_reason(
            GradScaler::new(config),
            &format!("init_scale {init_scale:e}"),
        );
        assert!(
            reason.contains("positive normal f32"),
            "init_scale {init_scale:e}: {reason}"
        );
    }
    let smallest_normal = GradScalerConfig {
        init_scale: f64::from(f32::MIN_POSITIVE),
        ..GradScalerConfig::default()
    };
    smallest_normal.validate().unwrap();

    let cpu = CpuBackend::new_ref();
    let (p, mut sgd) = four_ones_and_sgd(&cpu, 0.1, Implementation::Fused);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let loss = p.sum_all().unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
    for new_scale in [1e-40f32, 0.0, -2.0, f32::NAN, f32::INFINITY] {
        refusal_reason(
            scaler.update_to(new_scale),
            &format!("update_to({new_scale:e})"),
        );
    }
    assert_eq!(
        scaler.get_scale().unwrap(),
        65536.0,
        "a refused scale changed nothing"
    );
    let good = scaler.state().unwrap();
    for state in [
        GradScalerState {
            scale: 1e-39,
            ..good
        },
        GradScalerState { scale: 0.0, ..good },
        GradScalerState {
            growth_tracker: u32::MAX,
            ..good
        },
    ] {
        refusal_reason(scaler.load_state(state), &format!("{state:?}"));
    }
    assert_eq!(
        scaler.state().unwrap(),
        good,
        "a refused state changed nothing"
    );
    scaler.step(&mut sgd).unwrap();
    scaler.update().unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.9f32; 4]);
}

/// A step skipped on overflow is not counted by a scheduler that takes the step's flag: after 5
/// steps of which 2 overflowed, a step schedule of size 2 has decayed once, not twice.
#[test]
fn schedulers_do_not_count_skipped_steps() {
    let cpu = CpuBackend::new_ref();
    let (p, mut sgd) = four_ones_and_sgd(&cpu, 1.0, Implementation::Fused);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let schedule = Schedule::Step {
        step_size: 2,
        gamma: 0.5,
    };
    let mut scheduler = LrScheduler::new(schedule, &mut sgd).unwrap();
    let mut advanced = Vec::new();
    for overflow in [false, true, false, true, false] {
        let mut loss = p.mul_scalar(1e-3).unwrap().sum_all().unwrap();
        if overflow {
            loss = loss.mul_scalar(f64::INFINITY).unwrap();
        }
        scaler.scale(&loss).unwrap().backward().unwrap();
        let skipped = scaler.step(&mut sgd).unwrap();
        scaler.update().unwrap();
        sgd.zero_grad(true).unwrap();
        advanced.push(scheduler.step_unless_skipped(&mut sgd, &skipped).unwrap());
    }
    assert_eq!(advanced, [true, false, true, false, true]);
    assert_eq!(scheduler.last_step(), 3);
    assert_eq!(sgd.lr(0), 0.5);
    // A flag still on the device is read when the scheduler needs it.
    let on_device = SkipFlag::OnDevice(Tensor::ones(&cpu, &[1], DType::F32).unwrap());
    assert!(!scheduler.step_unless_skipped(&mut sgd, &on_device).unwrap());
}

/// The state dict carries PyTorch's keys and the wrapped optimizer's state: a scaler restored
/// from it continues exactly where the first left off.
#[test]
fn the_state_dict_round_trips() {
    let run = |steps: usize, restore: Option<&[u8]>| {
        let cpu = CpuBackend::new_ref();
        let model = mlp(&cpu);
        let mut adam = Adam::new(
            vec![ParamGroup::new(model.parameters(), AdamConfig::adamw())],
            Implementation::Fused,
        )
        .unwrap();
        let config = GradScalerConfig {
            growth_interval: 2,
            ..GradScalerConfig::default()
        };
        let mut scaler = GradScaler::new(config).unwrap();
        let x = Tensor::full(&cpu, &[8, 32], 0.5, DType::F32).unwrap();
        if let Some(bytes) = restore {
            // The state of 3 steps, loaded into a fresh model's optimizer after copying the
            // parameters over is not needed: the test compares optimizer and scaler state.
            scaler.load_state_dict(&mut adam, bytes).unwrap();
        }
        for i in 0..steps {
            let mut loss = model.forward(&x).unwrap().sum_all().unwrap();
            if i == 1 {
                loss = loss.mul_scalar(f64::INFINITY).unwrap();
            }
            scaler.scale(&loss).unwrap().backward().unwrap();
            scaler.step(&mut adam).unwrap();
            scaler.update().unwrap();
            adam.zero_grad(true).unwrap();
        }
        (scaler.state().unwrap(), scaler.state_dict(&adam).unwrap())
    };
    let (state, bytes) = run(4, None);
    assert_eq!(
        state,
        GradScalerState {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2,
            growth_tracker: 0,
        }
    );
    let (restored, restored_bytes) = run(0, Some(&bytes));
    assert_eq!(restored, state);
    // The same entries (metadata order is the serializer's).
    let entries = |bytes: &[u8]| {
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
        let metadata: std::collections::BTreeMap<String, String> =
            header.metadata().clone().unwrap().into_iter().collect();
        let tensors = safetensors::SafeTensors::deserialize(bytes).unwrap();
        let mut data: Vec<(String, Vec<u8>)> = tensors
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, view.data().to_vec()))
            .collect();
        data.sort();
        (metadata, data)
    };
    let (saved, restored) = (entries(&bytes), entries(&restored_bytes));
    assert_eq!(saved.0, restored.0);
    assert!(
        saved.1 == restored.1,
        "state tensors differ after the round trip"
    );
    assert_eq!(saved.0["grad_scaler._growth_tracker"], "0");
    assert_eq!(
        saved.0["state.0.0.step"], "3",
        "the overflowed step is not counted"
    );
}

/// The technique of the harness: scale, backward, step, update (optionally under autocast).
struct Scaled {
    policy: Option<AmpPolicy>,
    scaler: Option<(GradScaler, Box<dyn Optimizer>)>,
}

impl Technique for Scaled {
    fn name(&self) -> &str {
        match self.policy {
            Some(_) => "autocast_bf16_grad_scaler",
            None => "grad_scaler",
        }
    }

    fn prepare(&mut self, run: &mut TrainRun) -> headroom_testkit::Result<()> {
        let optimizer = run.optimizer.take().expect("the case's optimizer");
        self.scaler = Some((GradScaler::new(GradScalerConfig::default())?, optimizer));
        Ok(())
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> headroom_testkit::Result<Tensor> {
        let loss = {
            let _autocast = self.policy.as_ref().map(AmpPolicy::enter);
            let output = run.model.forward(&batch.input)?;
            run.model.loss(&output, batch)?
        };
        let (scaler, optimizer) = self.scaler.as_mut().expect("prepared");
        scaler.scale(&loss)?.backward()?;
        scaler.step(optimizer.as_mut())?;
        scaler.update()?;
        optimizer.zero_grad(true)?;
        Ok(loss)
    }
}

/// A ViT trained with the scaler ends bit for bit where plain training does: gradients scaled by
/// 2^16 and divided by it again in the kernel are the same numbers. Under bf16 autocast it ends
/// close (bf16 products).
#[test]
fn training_with_the_scaler_equals_training_without() {
    let cpu = CpuBackend::new_ref();
    let case = TrainCase {
        name: "vit_tiny_adamw",
        model: ModelSpec::Vit(VitConfig::tiny()),
        dtype: DType::F32,
        batch: 2,
        steps: 3,
        optimizer: OptimSpec::adamw(1e-3, 1e-2),
        tolerance: Tolerance::Bitwise {
            why: "a power-of-two scale multiplies and divides every gradient exactly",
        },
        seed: 5,
    };
    let mut scaled = Scaled {
        policy: None,
        scaler: None,
    };
    let report = check_technique(&cpu, &case, &mut scaled).unwrap();
    assert_eq!(report.max_ulps, 0);

    let case = TrainCase {
        optimizer: OptimSpec::sgd(0.1),
        tolerance: Tolerance::Relative {
            max: 0.05,
            why: "bf16 matrix products (8-bit mantissa): gradients a few percent off f32's, and \
                  SGD's update is proportional to them",
        },
        ..case
    };
    let mut autocast = Scaled {
        policy: Some(AmpPolicy::torch_cuda(DType::BF16).unwrap()),
        scaler: None,
    };
    let report = check_technique(&cpu, &case, &mut autocast).unwrap();
    assert!(report.max_relative > 0.0, "bf16 must change something");
    println!(
        "autocast bf16 + GradScaler vs f32: max relative {}",
        report.max_relative
    );
}
