//! f32 master weights (apex O2) and the opt levels: a bucket size changes no bit, the memory is
//! 16 bytes per parameter with Adam (exactly, from the allocator), an overflowed step under a
//! GradScaler changes neither the masters nor the model, the state dict continues a run, and
//! every level trains with apex's settings.

use std::sync::Arc;

use headroom_amp::{
    AmpError, AmpTraining, GradScaler, GradScalerConfig, LossScale, MasterWeights, OptLevel,
};
use headroom_autograd_core::{cross_entropy, BackendRef, DType, Generator, Reduction, Tensor};
use headroom_nn::{Activation, Dropout, Mlp, Module};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};

fn mlp(backend: &BackendRef, dtype: DType, seed: u64) -> Mlp {
    let generator = Arc::new(Generator::new(seed));
    Mlp::new(
        backend,
        32,
        64,
        Activation::Gelu,
        Dropout::new(0.0, Arc::clone(&generator)),
        dtype,
        &generator,
    )
    .unwrap()
}

fn adam(masters: Vec<Tensor>) -> Result<Adam, headroom_optim::OptimError> {
    Adam::new(
        vec![ParamGroup::new(masters, AdamConfig::adamw())],
        Implementation::Fused,
    )
}

fn bits(tensors: &[Tensor]) -> Vec<Vec<f64>> {
    tensors.iter().map(|t| t.to_vec_f64().unwrap()).collect()
}

/// Three O2 steps of a bf16 model with buckets of one parameter and with the default bucket end
/// in the same bits; the masters moved off the bf16 grid.
#[test]
fn bucket_size_changes_no_bit() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::full(&cpu, &[8, 32], 0.5, DType::BF16).unwrap();
    let mut results = Vec::new();
    for bucket_bytes in [1, headroom_amp::DEFAULT_MASTER_BUCKET_BYTES] {
        let model = mlp(&cpu, DType::BF16, 3);
        let mut opt = MasterWeights::new(model.parameters(), adam)
            .unwrap()
            .with_bucket_bytes(bucket_bytes);
        for _ in 0..3 {
            let loss = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
            loss.sum_all().unwrap().backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad(true).unwrap();
        }
        let masters = bits(opt.masters());
        let rounded: Vec<Vec<f64>> = opt
            .masters()
            .iter()
            .map(|m| m.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap())
            .collect();
        assert_eq!(
            bits(&model.parameters()),
            rounded,
            "the model is its masters rounded"
        );
        results.push((bits(&model.parameters()), masters));
    }
    assert_eq!(results[0], results[1]);
    let off_grid = results[0].1[0]
        .iter()
        .filter(|&&v| f64::from(half::bf16::from_f64(v).to_f32()) != v)
        .count();
    assert!(off_grid > 0, "f32 masters hold what bf16 cannot");
}

/// bf16 parameters, their bf16 gradients, f32 masters and Adam's f32 moments: 2 + 2 + 4 + 8 = 16
/// bytes per parameter, counted by the allocator; the f32 gradients of a step are freed.
#[test]
fn o2_holds_sixteen_bytes_per_parameter() {
    let cpu = Arc::new(CpuBackend::default());
    let backend: BackendRef = cpu.clone();
    let shapes: [&[usize]; 3] = [&[256, 64], &[1024], &[64, 512]];
    let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let params: Vec<Tensor> = shapes
        .iter()
        .map(|shape| {
            let p = Tensor::full(&backend, shape, 0.25, DType::BF16).unwrap();
            p.requires_grad_(true).unwrap();
            p.set_grad(Some(
                Tensor::full(&backend, shape, 0.5, DType::BF16).unwrap(),
            ))
            .unwrap();
            p
        })
        .collect();
    let allocated = || cpu.allocator().memory_allocated();
    assert_eq!(allocated(), 4 * n as u64);
    let mut opt = MasterWeights::new(params.clone(), adam).unwrap();
    assert_eq!(allocated(), 8 * n as u64);
    opt.step().unwrap();
    assert_eq!(allocated(), 16 * n as u64);
    opt.zero_grad(true).unwrap();
    assert_eq!(allocated(), 14 * n as u64);
}

/// Under a GradScaler (f16 model, as apex O2), an overflowed step leaves masters and model as
/// they were and halves the scale; the next step moves them.
#[test]
fn an_overflowed_step_changes_nothing() {
    let cpu = CpuBackend::new_ref();
    let model = mlp(&cpu, DType::F16, 4);
    let x = Tensor::full(&cpu, &[8, 32], 0.5, DType::F16).unwrap();
    let mut opt = MasterWeights::new(model.parameters(), adam).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let step = |scaler: &mut GradScaler, opt: &mut MasterWeights<Adam>, overflow: bool| {
        let mut loss = model
            .forward(&x)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .mean_all()
            .unwrap();
        if overflow {
            loss = loss.mul_scalar(f64::INFINITY).unwrap();
        }
        scaler.scale(&loss).unwrap().backward().unwrap();
        let skipped = scaler.step(opt).unwrap().read().unwrap();
        scaler.update().unwrap();
        opt.zero_grad(true).unwrap();
        skipped
    };
    let before = bits(&model.parameters());
    assert!(step(&mut scaler, &mut opt, true));
    assert_eq!(bits(&model.parameters()), before);
    assert_eq!(bits(opt.masters()), before, "masters untouched too");
    assert!(!step(&mut scaler, &mut opt, false));
    assert_ne!(bits(&model.parameters()), before);
    assert_eq!(scaler.get_scale().unwrap(), 32768.0);
}

/// Saved after two steps and loaded into a fresh decorator over a fresh model, a run continues
/// bit for bit (masters and Adam's moments restored; the model re-rounded from the masters).
#[test]
fn the_state_dict_continues_the_run() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::full(&cpu, &[8, 32], 0.5, DType::BF16).unwrap();
    let step = |model: &Mlp, opt: &mut MasterWeights<Adam>| {
        let loss = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
        loss.sum_all().unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad(true).unwrap();
    };
    let model = mlp(&cpu, DType::BF16, 5);
    let mut opt = MasterWeights::new(model.parameters(), adam).unwrap();
    for _ in 0..2 {
        step(&model, &mut opt);
    }
    let saved = opt.state_dict().unwrap();
    step(&model, &mut opt);

    let fresh = mlp(&cpu, DType::BF16, 99);
    let mut restored = MasterWeights::new(fresh.parameters(), adam).unwrap();
    restored.load_state_dict(&saved).unwrap();
    step(&fresh, &mut restored);
    assert_eq!(bits(&fresh.parameters()), bits(&model.parameters()));
    assert_eq!(bits(restored.masters()), bits(opt.masters()));
}

/// apex's table, typed errors for a model in the wrong dtype, and every level training a
/// classifier (its loss falls over 30 steps).
#[test]
fn every_opt_level_trains_with_apexs_settings() {
    let half = DType::BF16;
    let props = |level: OptLevel| level.properties(half).unwrap();
    assert_eq!(props(OptLevel::O0).model_dtype, DType::F32);
    assert!(props(OptLevel::O1).autocast && props(OptLevel::O1).loss_scale == LossScale::Dynamic);
    assert!(props(OptLevel::O2).master_weights && props(OptLevel::O2).model_dtype == half);
    assert_eq!(props(OptLevel::O3).loss_scale, LossScale::Static(1.0));
    assert!(!props(OptLevel::O3).master_weights && !props(OptLevel::O2).autocast);
    assert!(OptLevel::O2.properties(DType::F32).is_err());

    let cpu = CpuBackend::new_ref();
    let wrong = mlp(&cpu, DType::F32, 1);
    let build = |params: Vec<Tensor>| {
        let config = AdamConfig {
            lr: 1e-2,
            ..AdamConfig::adamw()
        };
        let adam = Adam::new(vec![ParamGroup::new(params, config)], Implementation::Fused)?;
        Ok(Box::new(adam) as Box<dyn Optimizer>)
    };
    let err = AmpTraining::new(OptLevel::O2, half, wrong.parameters(), build).unwrap_err();
    assert!(matches!(
        err,
        AmpError::ParameterDType {
            index: 0,
            got: DType::F32,
            ..
        }
    ));
    assert!(err.to_string().contains("DType::BF16"), "{err}");

    let labels = Tensor::from_slice(&cpu, &[1i64, 5, 9, 30, 2, 7, 11, 0], &[8]).unwrap();
    for level in OptLevel::ALL {
        let dtype = props(level).model_dtype;
        let model = mlp(&cpu, dtype, 2);
        let features: Vec<f64> = (0..8 * 32).map(|i| (i as f64 * 0.7).sin()).collect();
        let x = Tensor::from_f64s(&cpu, &features, &[8, 32], dtype).unwrap();
        let mut amp = AmpTraining::new(level, half, model.parameters(), build).unwrap();
        assert_eq!(
            amp.scaler().is_enabled(),
            props(level).loss_scale == LossScale::Dynamic
        );
        let mut losses = Vec::new();
        for _ in 0..30 {
            let loss = {
                let _autocast = amp.autocast();
                let logits = model.forward(&x).unwrap();
                if level == OptLevel::O1 {
                    assert_eq!(logits.dtype(), half, "O1 runs the linears in half");
                }
                cross_entropy(&logits, &labels, -100, Reduction::Mean).unwrap()
            };
            losses.push(loss.item().unwrap());
            amp.backward(&loss).unwrap();
            assert!(!amp.step().unwrap().read().unwrap());
            amp.zero_grad().unwrap();
        }
        assert!(
            losses[29] < 0.5 * losses[0],
            "{level:?}: loss {} -> {}",
            losses[0],
            losses[29]
        );
    }
}
