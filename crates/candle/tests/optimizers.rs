//! The candle optimizers against Headroom's own and against candle's: `AdamW`, `Sgd`,
//! `AdamWStochastic` and `AdamW8bit` stepping candle `Var`s give the bits Headroom's `Adam`,
//! `Sgd`, `AdamStochastic` and `Adam8bit` give on autograd-core CPU tensors fed the same gradients
//! (f32 and bf16 for SGD with momentum; bf16 weights with stochastic rounding for the stochastic
//! and 8-bit rules; a parameter without a gradient left alone);
//! `clip_grad_norm` gives `clip_grad_norm_`'s norm and clipped gradients (to 1e-6, four ulps);
//! `AdamW` trains a small network as `candle_nn::AdamW` does (PyTorch's formula against candle's
//! op-by-op one: the losses agree to 1e-5 relative) and its parameters stay within 8 f32
//! epsilons of max(|p|, lr) of candle's; a run resumed from a saved state gives the
//! bits of one that never stopped; what they cannot step or load is a typed error.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor as CTensor, Var};
use candle_nn::Optimizer as _;
use half::bf16;
use headroom_autograd_core::{BackendRef, Tensor};
use headroom_candle::{
    clip_grad_norm, Adam8bitConfig, AdamConfig, AdamStochasticConfig, AdamW, AdamW8bit,
    AdamWStochastic, Bf16Rounding, Sgd, SgdConfig,
};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{
    clip_grad_norm_, Adam, Adam8bit, Implementation, NormType, Optimizer, ParamGroup,
};
use headroom_testkit::worst::nan_max_f32;

/// Shapes: a matrix, a bias, one with 8-bit codes and a partial last block, one large enough for
/// the kernels' parallel runs.
const SHAPES: [&[usize]; 4] = [&[64, 32], &[32], &[5000], &[256, 320]];

/// `n` values in [-scale/2, scale/2) from testkit's xorshift stream of `seed`.
fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    headroom_testkit::inputs::centered_f32(n, scale, seed)
}

/// Values as `dtype` and back to f32 (exact for bf16).
fn of_dtype(values: Vec<f32>, dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => values
            .into_iter()
            .map(|v| bf16::from_f32(v).to_f32())
            .collect(),
        _ => values,
    }
}

/// The same parameters as candle `Var`s and as autograd-core CPU tensors of `dtype`.
fn twin_params(cpu: &BackendRef, dtype: DType) -> (Vec<Var>, Vec<Tensor>) {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let values = of_dtype(random(i as u64 + 1, n, 2.0), dtype);
            let var = Var::from_tensor(
                &CTensor::from_vec(values.clone(), *shape, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            let ours = match dtype {
                DType::BF16 => {
                    let halves: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
                    Tensor::from_slice(cpu, &halves, shape).unwrap()
                }
                _ => Tensor::from_slice(cpu, &values, shape).unwrap(),
            };
            (var, ours)
        })
        .unzip()
}

/// Step `step`'s gradients, the same on both sides; parameter 1 gets none on even steps.
fn set_grads(vars: &[Var], tensors: &[Tensor], step: u64) -> GradStore {
    let mut store = GradStore::default();
    for (i, (var, tensor)) in vars.iter().zip(tensors).enumerate() {
        if i == 1 && step.is_multiple_of(2) {
            tensor.set_grad(None).unwrap();
            continue;
        }
        let values = of_dtype(
            random(100 * step + i as u64, var.elem_count(), 0.02),
            var.dtype(),
        );
        let grad = CTensor::from_vec(values.clone(), var.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(var.dtype())
            .unwrap();
        store.insert(var.as_tensor(), grad);
        let ours = match var.dtype() {
            DType::BF16 => {
                let halves: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
                Tensor::from_slice(tensor.backend(), &halves, tensor.shape()).unwrap()
            }
            _ => Tensor::from_slice(tensor.backend(), &values, tensor.shape()).unwrap(),
        };
        tensor.set_grad(Some(ours)).unwrap();
    }
    store
}

/// The parameters' bits on both sides, side by side.
fn assert_same_bits(vars: &[Var], tensors: &[Tensor], what: &str) {
    for (i, (var, tensor)) in vars.iter().zip(tensors).enumerate() {
        let candle_bits: Vec<u32> = var
            .as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let ours: Vec<u32> = match tensor.dtype() {
            headroom_autograd_core::DType::BF16 => tensor
                .to_vec::<bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_f32().to_bits())
                .collect(),
            _ => tensor
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        };
        let off = candle_bits
            .iter()
            .zip(&ours)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(off, 0, "{what}: parameter {i}: {off} elements differ");
    }
}

/// `steps` steps of both optimizers on the twin parameters, fed the same gradients, the bits
/// compared after each.
fn step_both(
    (vars, tensors): (&[Var], &[Tensor]),
    candle_side: &mut impl candle_nn::Optimizer,
    ours: &mut dyn Optimizer,
    steps: u64,
    what: &str,
) {
    for step in 1..=steps {
        let grads = set_grads(vars, tensors, step);
        candle_side.step(&grads).unwrap();
        ours.step().unwrap();
        assert_same_bits(vars, tensors, &format!("{what}, step {step}"));
    }
}

#[test]
fn adamw_steps_vars_as_headroom_adam_steps_tensors() {
    let cpu = CpuBackend::new_ref();
    let config = AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw()
    };
    let (vars, tensors) = twin_params(&cpu, DType::F32);
    let mut candle_side = AdamW::new(vars.clone(), config.clone()).unwrap();
    let mut ours = Adam::new(
        vec![ParamGroup::new(tensors.clone(), config)],
        Implementation::Fused,
    )
    .unwrap();
    step_both((&vars, &tensors), &mut candle_side, &mut ours, 6, "AdamW");
    assert_eq!(candle_side.var_step(0), Some(6));
    assert_eq!(candle_side.var_step(1), Some(3), "no gradient, no step");
    let n: usize = SHAPES.iter().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!(candle_side.state_bytes(), 8 * n as u64);
}

#[test]
fn adamw_stochastic_steps_bf16_vars_as_headroom_adam_stochastic_steps_tensors() {
    let cpu = CpuBackend::new_ref();
    let config = AdamStochasticConfig::new(
        AdamConfig {
            lr: 1e-2,
            ..AdamConfig::adamw()
        },
        21,
    );
    let (vars, tensors) = twin_params(&cpu, DType::BF16);
    let mut candle_side = AdamWStochastic::new(vars.clone(), config.clone()).unwrap();
    let mut ours = headroom_optim::AdamStochastic::new(
        vec![ParamGroup::new(tensors.clone(), config)],
        Implementation::Fused,
    )
    .unwrap();
    step_both(
        (&vars, &tensors),
        &mut candle_side,
        &mut ours,
        6,
        "AdamWStochastic",
    );
    let n: usize = SHAPES.iter().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!(candle_side.state_bytes(), 8 * n as u64, "f32 moments");
}

#[test]
fn sgd_steps_vars_as_headroom_sgd_steps_tensors() {
    let cpu = CpuBackend::new_ref();
    let config = SgdConfig {
        momentum: 0.9,
        weight_decay: 1e-2,
        nesterov: true,
        ..SgdConfig::new(1e-1)
    };
    for dtype in [DType::F32, DType::BF16] {
        let (vars, tensors) = twin_params(&cpu, dtype);
        let mut candle_side = Sgd::new(vars.clone(), config.clone()).unwrap();
        let mut ours = headroom_optim::Sgd::new(
            vec![ParamGroup::new(tensors.clone(), config.clone())],
            Implementation::Fused,
        )
        .unwrap();
        let what = format!("SGD {dtype:?}");
        step_both((&vars, &tensors), &mut candle_side, &mut ours, 5, &what);
    }
}

/// Gradients of norm about 0.8 clipped to 0.1: the total norm within 1e-6 relative of
/// `clip_grad_norm_`'s (the sums run in another order) and every clipped gradient within four
/// ulps (the coefficient carries the total's last bits into every element); a bound above the norm
/// changes nothing.
#[test]
fn clip_grad_norm_is_clip_grad_norm_on_candle_gradients() {
    let cpu = CpuBackend::new_ref();
    let (vars, tensors) = twin_params(&cpu, DType::F32);
    let mut grads = set_grads(&vars, &tensors, 1);
    let theirs = clip_grad_norm_(&tensors, 0.1, NormType::L2, false).unwrap();
    let theirs = theirs.to_vec::<f32>().unwrap()[0];
    let ours = clip_grad_norm(&vars, &mut grads, 0.1).unwrap();
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-6,
        "{ours} against {theirs}"
    );
    for (i, (var, tensor)) in vars.iter().zip(&tensors).enumerate() {
        let Some(grad) = grads.get(var.as_tensor()) else {
            continue;
        };
        let ours: Vec<f32> = grad.flatten_all().unwrap().to_vec1().unwrap();
        let theirs = tensor.grad().unwrap().to_vec::<f32>().unwrap();
        let worst = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (i64::from(a.to_bits() as i32) - i64::from(b.to_bits() as i32)).abs())
            .max()
            .unwrap();
        assert!(worst <= 4, "parameter {i}: {worst} ulps");
    }
    let first_grad = |grads: &GradStore| -> Vec<f32> {
        let grad = grads.get(vars[0].as_tensor()).unwrap();
        grad.flatten_all().unwrap().to_vec1().unwrap()
    };
    let before = first_grad(&grads);
    let total = clip_grad_norm(&vars, &mut grads, 10.0).unwrap();
    assert!((total - 0.1).abs() < 1e-6, "{total}");
    assert_eq!(before, first_grad(&grads));
}

#[test]
fn adamw8bit_steps_vars_as_headroom_adam8bit_steps_tensors() {
    let cpu = CpuBackend::new_ref();
    for (dtype, rounding) in [
        (DType::F32, Bf16Rounding::Nearest),
        (DType::BF16, Bf16Rounding::Nearest),
        (DType::BF16, Bf16Rounding::Stochastic { seed: 11 }),
    ] {
        let config = Adam8bitConfig {
            lr: 1e-2,
            bf16_rounding: rounding,
            ..Adam8bitConfig::adamw()
        };
        let (vars, tensors) = twin_params(&cpu, dtype);
        let mut candle_side = AdamW8bit::new(vars.clone(), config.clone()).unwrap();
        let mut ours = Adam8bit::new(
            vec![ParamGroup::new(tensors.clone(), config)],
            Implementation::Fused,
        )
        .unwrap();
        for step in 1..=6 {
            let grads = set_grads(&vars, &tensors, step);
            candle_side.step(&grads).unwrap();
            ours.step().unwrap();
            assert_same_bits(
                &vars,
                &tensors,
                &format!("{dtype:?} {rounding:?} step {step}"),
            );
        }
        // Codes a byte and an f32 scale per 256 from 4096 elements, f32 moments under it (the
        // 64 x 32 matrix and the bias).
        let large: u64 = [5000u64, 256 * 320]
            .iter()
            .map(|&n| 2 * n + 8 * n.div_ceil(256))
            .sum();
        assert_eq!(
            candle_side.state_bytes(),
            large + 8 * (64 * 32 + 32),
            "{dtype:?}"
        );
    }
}

/// 20 steps of AdamW (lr 1e-3, decay 1e-2) on f32 Vars fed the same gradients every step, ours
/// and `candle_nn::AdamW`: each parameter within 8 f32 epsilons of max(|p|, lr) of candle's —
/// within 2 ulps where |p| is well above the learning rate. The two round the same update at
/// different places (PyTorch: `lr/bc₁ · m / (√v/√bc₂ + ε)`; candle: `lr · (m·(1/bc₁)) /
/// (√(v·(1/bc₂)) + ε)`), so they differ by about an ulp of the update (of the order of lr) a
/// step, which adds up over the steps and is many ulps of a parameter near zero. Measured here:
/// 6.35 epsilons at most; 96% of the elements equal, 3.4% one ulp apart.
#[test]
fn adamw_parameters_stay_within_2_ulps_of_candle_nn_adamw() {
    let shapes: [&[usize]; 3] = [&[64, 32], &[5000], &[33]];
    let vars = || -> Vec<Var> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let n = shape.iter().product();
                let t = CTensor::from_vec(random(i as u64 + 1, n, 2.0), *shape, &Device::Cpu);
                Var::from_tensor(&t.unwrap()).unwrap()
            })
            .collect()
    };
    let grads = |vars: &[Var], step: u64| {
        let mut store = GradStore::default();
        for (i, var) in vars.iter().enumerate() {
            let g = random(100 * step + i as u64, var.elem_count(), 0.2);
            let g = CTensor::from_vec(g, var.shape(), &Device::Cpu).unwrap();
            store.insert(var.as_tensor(), g);
        }
        store
    };
    let (ours_w, theirs_w) = (vars(), vars());
    let config = AdamConfig {
        lr: 1e-3,
        ..AdamConfig::adamw()
    };
    let mut ours = AdamW::new(ours_w.clone(), config).unwrap();
    let params = candle_nn::ParamsAdamW {
        lr: 1e-3,
        ..Default::default()
    };
    let mut theirs = candle_nn::AdamW::new(theirs_w.clone(), params).unwrap();
    for step in 0..20 {
        ours.step(&grads(&ours_w, step)).unwrap();
        theirs.step(&grads(&theirs_w, step)).unwrap();
    }
    let (mut counts, mut worst) = ([0usize; 3], 0f32);
    for (a, b) in ours_w.iter().zip(&theirs_w) {
        let a = a
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = b
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (x, y) in a.iter().zip(&b) {
            let ulps =
                (i64::from(x.to_bits() as i32) - i64::from(y.to_bits() as i32)).unsigned_abs();
            counts[(ulps as usize).min(2)] += 1;
            worst = nan_max_f32(worst, (x - y).abs() / (f32::EPSILON * x.abs().max(1e-3)));
        }
    }
    println!(
        "against candle_nn::AdamW: {} equal, {} one ulp apart, {} more; worst {worst:.2} \
         epsilons of max(|p|, lr)",
        counts[0], counts[1], counts[2]
    );
    assert!(worst <= 8.0, "{worst} epsilons of max(|p|, lr)");
}

/// A two-layer network on a fixed batch, 30 steps of AdamW (lr 1e-2, decay 1e-2) with ours and
/// with candle's: the losses agree to 1e-5 relative at every step, and both fall.
#[test]
fn adamw_trains_a_network_as_candle_nn_adamw_does() {
    let x = CTensor::from_vec(random(7, 16 * 8, 2.0), (16, 8), &Device::Cpu).unwrap();
    let y = CTensor::from_vec(random(8, 16 * 4, 2.0), (16, 4), &Device::Cpu).unwrap();
    let weights = || {
        [
            (random(1, 32 * 8, 0.5), (32, 8)),
            (random(2, 4 * 32, 0.5), (4, 32)),
        ]
        .map(|(v, shape)| {
            Var::from_tensor(&CTensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
        })
    };
    let loss_of = |w: &[Var; 2]| {
        let h = x
            .matmul(&w[0].as_tensor().t().unwrap())
            .unwrap()
            .relu()
            .unwrap();
        let out = h.matmul(&w[1].as_tensor().t().unwrap()).unwrap();
        (out - &y).unwrap().sqr().unwrap().mean_all().unwrap()
    };
    let (ours_w, theirs_w) = (weights(), weights());
    let config = AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw()
    };
    let mut ours = AdamW::new(ours_w.to_vec(), config).unwrap();
    let params = candle_nn::ParamsAdamW {
        lr: 1e-2,
        weight_decay: 1e-2,
        ..Default::default()
    };
    let mut theirs = candle_nn::AdamW::new(theirs_w.to_vec(), params).unwrap();
    let mut first = None;
    for step in 0..30 {
        let (a, b) = (loss_of(&ours_w), loss_of(&theirs_w));
        let (la, lb) = (a.to_scalar::<f32>().unwrap(), b.to_scalar::<f32>().unwrap());
        assert!(
            ((la - lb) / lb).abs() < 1e-5,
            "step {step}: {la} against candle's {lb}"
        );
        first.get_or_insert(la);
        ours.backward_step(&a).unwrap();
        theirs.backward_step(&b).unwrap();
    }
    let last = loss_of(&ours_w).to_scalar::<f32>().unwrap();
    assert!(last < 0.5 * first.unwrap(), "{last} from {first:?}");
}

#[test]
fn what_the_optimizers_cannot_step_is_a_typed_error() {
    let f16_var = Var::zeros(8, DType::F16, &Device::Cpu).unwrap();
    let err = AdamW8bit::new(vec![f16_var], Adam8bitConfig::adamw()).unwrap_err();
    assert!(err.to_string().contains("takes [F32, BF16]"), "{err}");
    let bad = AdamConfig {
        lr: -1.0,
        ..AdamConfig::adamw()
    };
    let err = AdamW::new(vec![], bad).unwrap_err();
    assert!(err.to_string().contains("learning rate"), "{err}");
    // Integer Vars are skipped, as candle's optimizers skip them.
    let ids = Var::zeros(8, DType::U32, &Device::Cpu).unwrap();
    let adamw = AdamW::new(vec![ids], AdamConfig::adamw()).unwrap();
    assert_eq!(adamw.var_step(0), None);
}

/// Three steps, the state saved as safetensors, a fresh optimizer over `Var`s holding the same
/// values loading it, three more steps: the bits of six steps in one run, for each optimizer
/// (the stochastic and 8-bit rules on bf16 `Var`s with stochastic rounding, whose stream follows
/// the restored step counts).
#[test]
fn saved_state_continues_a_run_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("headroom-candle-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cpu = CpuBackend::new_ref();
    let adamw = AdamConfig {
        lr: 1e-2,
        amsgrad: true,
        ..AdamConfig::adamw()
    };
    let sgd = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(1e-1)
    };
    let eight = Adam8bitConfig {
        lr: 1e-2,
        bf16_rounding: Bf16Rounding::Stochastic { seed: 5 },
        ..Adam8bitConfig::adamw()
    };
    let stochastic = AdamStochasticConfig::new(adamw.clone(), 5);
    for (name, dtype) in [
        ("adamw", DType::F32),
        ("sgd", DType::BF16),
        ("adamw_stochastic", DType::BF16),
        ("adamw8bit", DType::BF16),
    ] {
        let run = |vars: &[Var],
                   tensors: &[Tensor],
                   steps: std::ops::RangeInclusive<u64>,
                   state: Option<&std::path::Path>,
                   save: Option<&std::path::Path>| {
            macro_rules! drive {
                ($opt:expr) => {{
                    let mut opt = $opt;
                    if let Some(path) = state {
                        opt.load_state(path).unwrap();
                    }
                    for step in steps {
                        opt.step(&set_grads(vars, tensors, step)).unwrap();
                    }
                    if let Some(path) = save {
                        opt.save_state(path).unwrap();
                    }
                }};
            }
            match name {
                "adamw" => drive!(AdamW::new(vars.to_vec(), adamw.clone()).unwrap()),
                "sgd" => drive!(Sgd::new(vars.to_vec(), sgd.clone()).unwrap()),
                "adamw_stochastic" => {
                    drive!(AdamWStochastic::new(vars.to_vec(), stochastic.clone()).unwrap())
                }
                _ => drive!(AdamW8bit::new(vars.to_vec(), eight.clone()).unwrap()),
            }
        };
        let (straight, tensors) = twin_params(&cpu, dtype);
        run(&straight, &tensors, 1..=6, None, None);
        let path = dir.join(format!("{name}.safetensors"));
        let (first, tensors) = twin_params(&cpu, dtype);
        run(&first, &tensors, 1..=3, None, Some(&path));
        let resumed: Vec<Var> = first
            .iter()
            .map(|v| Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap())
            .collect();
        run(&resumed, &tensors, 4..=6, Some(&path), None);
        for (i, (a, b)) in resumed.iter().zip(&straight).enumerate() {
            let bits = |v: &Var| -> Vec<u32> {
                let t = v
                    .as_tensor()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap();
                t.to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            assert_eq!(bits(a), bits(b), "{name}: parameter {i}");
        }
    }
    // A state saved for f32 Vars does not load onto bf16 ones.
    let (vars, tensors) = twin_params(&cpu, DType::F32);
    let mut opt = AdamW::new(vars.clone(), AdamConfig::adamw()).unwrap();
    opt.step(&set_grads(&vars, &tensors, 1)).unwrap();
    let saved = opt.state_dict().unwrap();
    let (halves, _) = twin_params(&cpu, DType::BF16);
    let mut other = AdamW::new(halves, AdamConfig::adamw()).unwrap();
    let err = other.load_state_dict(&saved).unwrap_err();
    assert!(err.to_string().contains("the Var needs BF16"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
