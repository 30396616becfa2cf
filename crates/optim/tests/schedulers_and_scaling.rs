//! Learning-rate schedules against PyTorch's values, and the fused kernels' gradient scaling:
//! dividing the gradients by the scale inside the kernel gives the unscaled step bit for bit,
//! and a set found-inf flag leaves everything untouched and does not count the step.

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{GradScaling, StepOutcome};
use headroom_optim::{
    Adam, AdamConfig, Implementation, LrScheduler, Optimizer, ParamGroup, Scaling, Schedule, Sgd,
    SgdConfig, StepParams,
};

/// The rates PyTorch's schedulers give for base lr 1 (`scheduler.get_last_lr()` after each
/// `step()`, starting with the value at construction).
#[test]
fn schedules_give_pytorchs_learning_rates() {
    let cases: [(Schedule, &[f64]); 4] = [
        (
            Schedule::LinearWarmup {
                start_factor: 0.25,
                warmup_steps: 3,
            },
            &[0.25, 0.5, 0.75, 1.0, 1.0],
        ),
        (
            Schedule::Step {
                step_size: 2,
                gamma: 0.1,
            },
            &[1.0, 1.0, 0.1, 0.1, 0.01],
        ),
        (
            Schedule::Cosine {
                t_max: 4,
                eta_min: 0.0,
            },
            &[
                1.0,
                0.853_553_390_593_273_7,
                0.5,
                0.146_446_609_406_726_24,
                0.0,
            ],
        ),
        // OneCycleLR(max_lr=1, total_steps=10): 0.04 → 1 at step 2 → 4e-6 at step 9.
        (
            Schedule::one_cycle(1.0, 10),
            &[
                0.04,
                0.52,
                1.0,
                0.950_484_632_013_473_7,
                0.811_745_653_949_763_1,
            ],
        ),
    ];
    let cpu = CpuBackend::new_ref();
    for (schedule, expected) in cases {
        let p = Tensor::zeros(&cpu, &[2], DType::F32).unwrap();
        let q = Tensor::zeros(&cpu, &[2], DType::F32).unwrap();
        let mut sgd = Sgd::new(
            vec![
                ParamGroup::new(vec![p], SgdConfig::new(1.0)),
                ParamGroup::new(vec![q], SgdConfig::new(2.0)),
            ],
            Implementation::Single,
        )
        .unwrap();
        let mut scheduler = LrScheduler::new(schedule.clone(), &mut sgd).unwrap();
        for (t, &lr) in expected.iter().enumerate() {
            if t > 0 {
                scheduler.step(&mut sgd);
            }
            assert!(
                (sgd.lr(0) - lr).abs() < 1e-12,
                "{schedule:?} step {t}: {}",
                sgd.lr(0)
            );
            if !matches!(schedule, Schedule::OneCycle { .. }) {
                assert!(
                    (sgd.lr(1) - 2.0 * lr).abs() < 1e-12,
                    "second group follows its base"
                );
            }
        }
    }
    assert!((Schedule::one_cycle(1.0, 10).lr_at(1.0, 9) - 4e-6).abs() < 1e-15);
}

#[test]
fn fused_step_unscales_in_kernel_and_skips_on_overflow() {
    let cpu = CpuBackend::new_ref();
    let values = [0.5f32, -1.25, 2.0, 0.0, 3.5];
    let grads = [0.1f32, -0.2, 0.3, 0.4, -0.5];
    let run = |scale: Option<f32>| -> (Vec<f32>, Adam) {
        let p = Tensor::from_slice(&cpu, &values, &[5]).unwrap();
        let scaled: Vec<f32> = grads.iter().map(|g| g * scale.unwrap_or(1.0)).collect();
        p.set_grad(Some(Tensor::from_slice(&cpu, &scaled, &[5]).unwrap()))
            .unwrap();
        let mut adam = Adam::new(
            vec![ParamGroup::new(vec![p.clone()], AdamConfig::adamw())],
            Implementation::Fused,
        )
        .unwrap();
        let scaling = GradScaling {
            grad_scale: scale,
            found_inf: Some(0.0),
        };
        assert_eq!(
            adam.step_with(StepParams::All, Scaling::Host(scaling))
                .unwrap(),
            StepOutcome::Stepped
        );
        (p.to_vec::<f32>().unwrap(), adam)
    };
    let (plain, _) = run(None);
    let (unscaled, mut adam) = run(Some(65536.0));
    assert_eq!(plain, unscaled, "a power-of-two scale divides out exactly");
    // Overflow: nothing moves and the step is not counted.
    let p = adam.groups()[0].params[0].clone();
    let skip = GradScaling {
        grad_scale: Some(65536.0),
        found_inf: Some(1.0),
    };
    assert_eq!(
        adam.step_with(StepParams::All, Scaling::Host(skip))
            .unwrap(),
        StepOutcome::Skipped
    );
    assert_eq!(p.to_vec::<f32>().unwrap(), unscaled);
    assert_eq!(adam.param_step(0, 0).unwrap(), 1);
    // A scale is refused by implementations that cannot apply it in the kernel.
    let mut single = Adam::new(
        vec![ParamGroup::new(
            vec![Tensor::zeros(&cpu, &[2], DType::F32).unwrap()],
            AdamConfig::adam(),
        )],
        Implementation::Single,
    )
    .unwrap();
    assert!(single
        .step_with(StepParams::All, Scaling::Host(skip))
        .is_err());
}
