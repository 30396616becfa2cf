//! The technique harness proves itself on the CPU: the plain loop equals itself to the bit on
//! every model, a technique that changes the update (a larger learning rate, one extra step) is
//! caught with a message naming a parameter, and a technique that takes another path to the same
//! arithmetic (gradient accumulation over one micro-batch, an optimizer stepped by the technique
//! itself) passes as bitwise equal.

use std::time::Instant;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_nn::{Gpt2Config, Module, VitConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::{
    check_technique, Baseline, Batch, HarnessError, ModelSpec, OptimSpec, Result, Technique,
    Tolerance, TrainCase, TrainRun,
};

const SAME_KERNELS: Tolerance = Tolerance::Bitwise {
    why: "the same float operations in the same order on the CPU's deterministic kernels",
};

fn vit_tiny() -> TrainCase {
    TrainCase {
        name: "vit-tiny",
        model: ModelSpec::Vit(VitConfig::tiny()),
        dtype: DType::F32,
        batch: 2,
        steps: 3,
        optimizer: OptimSpec::sgd_momentum(1e-2, 0.9),
        tolerance: SAME_KERNELS,
        seed: 1,
    }
}

fn gpt2_tiny() -> TrainCase {
    TrainCase {
        name: "gpt2-tiny",
        model: ModelSpec::Gpt2 {
            config: Gpt2Config::tiny(),
            seq: 16,
        },
        dtype: DType::F32,
        batch: 2,
        steps: 3,
        optimizer: OptimSpec::adamw(1e-3, 1e-2),
        tolerance: SAME_KERNELS,
        seed: 2,
    }
}

fn mlp() -> TrainCase {
    TrainCase {
        name: "mlp",
        model: ModelSpec::Mlp {
            width: 16,
            hidden: 32,
        },
        dtype: DType::F32,
        batch: 8,
        steps: 4,
        optimizer: OptimSpec::sgd(1e-1),
        tolerance: SAME_KERNELS,
        seed: 3,
    }
}

fn cpu() -> BackendRef {
    CpuBackend::new_ref()
}

/// The error of a run that must fail, as the harness's own error.
fn harness_error(res: Result<impl std::fmt::Debug>) -> HarnessError {
    let err = res.expect_err("the harness must fail this technique");
    match err.downcast::<HarnessError>() {
        Ok(err) => *err,
        Err(other) => panic!("not a harness error: {other}"),
    }
}

/// The plain step with the learning rate scaled by `factor`.
struct ScaledLr(f64);

impl Technique for ScaledLr {
    fn name(&self) -> &str {
        "lr x 1.01"
    }

    fn prepare(&mut self, run: &mut TrainRun) -> Result<()> {
        let spec = run.optim_spec.clone();
        let lr = spec.lr() * self.0;
        run.optimizer = Some(spec.with_lr(lr).build(run.model.parameters())?);
        Ok(())
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> Result<Tensor> {
        Baseline.step(run, batch)
    }
}

/// The plain step, with the optimizer stepped twice on the last batch.
struct ExtraStepAtTheEnd {
    steps: usize,
}

impl Technique for ExtraStepAtTheEnd {
    fn name(&self) -> &str {
        "one extra step"
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> Result<Tensor> {
        if run.step + 1 < self.steps {
            return Baseline.step(run, batch);
        }
        let loss = run.model.loss(&run.model.forward(&batch.input)?, batch)?;
        loss.backward()?;
        let optimizer = run.optimizer_mut()?;
        optimizer.step()?;
        optimizer.step()?;
        optimizer.zero_grad(true)?;
        Ok(loss)
    }
}

/// Gradient accumulation: `k` micro-batches, each loss scaled by 1/k, one optimizer step.
struct GradAccumulation {
    k: usize,
}

impl Technique for GradAccumulation {
    fn name(&self) -> &str {
        "gradient accumulation"
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> Result<Tensor> {
        let micro = batch.len() / self.k;
        let mut total = 0.0;
        for idx in 0..self.k {
            let part = batch.narrow(idx * micro, micro)?;
            let loss = run.model.loss(&run.model.forward(&part.input)?, &part)?;
            let scaled = loss.mul_scalar(1.0 / self.k as f64)?;
            scaled.backward()?;
            total += scaled.item()?;
        }
        let optimizer = run.optimizer_mut()?;
        optimizer.step()?;
        optimizer.zero_grad(true)?;
        Ok(Tensor::scalar(&run.backend, total, DType::F32)?)
    }
}

/// Takes the case's optimizer in `prepare` and steps it itself, as optimizer-in-backward will.
#[derive(Default)]
struct OwnOptimizer {
    taken: Option<Box<dyn headroom_optim::Optimizer>>,
    then_use_the_plain_step: bool,
}

impl Technique for OwnOptimizer {
    fn name(&self) -> &str {
        "own optimizer"
    }

    fn prepare(&mut self, run: &mut TrainRun) -> Result<()> {
        self.taken = run.optimizer.take();
        Ok(())
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> Result<Tensor> {
        if self.then_use_the_plain_step {
            return Baseline.step(run, batch);
        }
        let loss = run.model.loss(&run.model.forward(&batch.input)?, batch)?;
        loss.backward()?;
        let optimizer = self.taken.as_mut().expect("taken in prepare");
        optimizer.step()?;
        optimizer.zero_grad(true)?;
        Ok(loss)
    }
}

#[test]
fn the_plain_loop_equals_itself_bit_for_bit_on_every_model() {
    let cpu = cpu();
    for case in [vit_tiny(), gpt2_tiny(), mlp()] {
        let start = Instant::now();
        let report = check_technique(&cpu, &case, &mut Baseline).unwrap();
        println!(
            "{}: losses {:?} in {:.2?}",
            case.name,
            report.baseline_losses,
            start.elapsed()
        );
        assert_eq!((report.max_ulps, report.max_relative), (0, 0.0));
        assert_eq!(report.baseline_losses, report.technique_losses);
        assert_eq!(report.baseline_losses.len(), case.steps);
        assert!(report.baseline_losses.iter().all(|loss| loss.is_finite()));
    }
}

#[test]
fn a_larger_learning_rate_is_caught_naming_the_parameter() {
    let err = harness_error(check_technique(&cpu(), &mlp(), &mut ScaledLr(1.01)));
    let message = err.to_string();
    let HarnessError::Mismatch {
        parameter,
        ulps,
        n_differ,
        n_parameters,
        ..
    } = err
    else {
        panic!("not a mismatch: {message}");
    };
    assert_eq!(
        parameter, "0.weight",
        "the first parameter in the model's order"
    );
    assert!(ulps > 0 && ulps < u64::MAX, "{message}");
    assert_eq!((n_differ, n_parameters), (4, 4), "{message}");
    assert!(
        message.starts_with(
            "case `mlp`: `lr x 1.01` is not within bitwise equality (the same float operations \
             in the same order on the CPU's deterministic kernels) of the baseline: parameter \
             `0.weight` element "
        ),
        "{message}"
    );
    assert!(message.contains("ulps apart"), "{message}");
    println!("{message}");
}

#[test]
fn one_extra_optimizer_step_is_caught() {
    let case = gpt2_tiny();
    let mut technique = ExtraStepAtTheEnd { steps: case.steps };
    let err = harness_error(check_technique(&cpu(), &case, &mut technique));
    let HarnessError::Mismatch { parameter, .. } = &err else {
        panic!("not a mismatch: {err}");
    };
    assert_eq!(parameter, "transformer.wte.weight", "{err}");
    // A tolerance does not hide a whole step either.
    let loose = TrainCase {
        tolerance: Tolerance::Ulps {
            max: 64,
            why: "a loose bound, to show a step is far outside it",
        },
        ..case
    };
    let err = harness_error(check_technique(&cpu(), &loose, &mut technique));
    assert!(matches!(err, HarnessError::Mismatch { ulps, .. } if ulps > 64));
}

#[test]
fn gradient_accumulation_over_one_micro_batch_equals_the_plain_loop() {
    for case in [vit_tiny(), mlp()] {
        let report = check_technique(&cpu(), &case, &mut GradAccumulation { k: 1 }).unwrap();
        assert_eq!(report.max_ulps, 0, "{}", case.name);
        assert_eq!(report.baseline_losses, report.technique_losses);
    }
}

#[test]
fn gradient_accumulation_over_two_micro_batches_is_within_a_relative_bound() {
    let case = TrainCase {
        tolerance: Tolerance::Relative {
            max: 1e-5,
            why: "two half-batch means, halved and summed, round differently from one mean; \
                  four SGD steps carry that rounding (~1e-7) into the weights",
        },
        ..mlp()
    };
    let report = check_technique(&cpu(), &case, &mut GradAccumulation { k: 2 }).unwrap();
    println!(
        "k = 2: {} ulps, relative {:e}",
        report.max_ulps, report.max_relative
    );
    assert!(report.max_relative <= 1e-5);
}

#[test]
fn a_technique_may_take_the_optimizer() {
    let report = check_technique(&cpu(), &mlp(), &mut OwnOptimizer::default()).unwrap();
    assert_eq!(report.max_ulps, 0);
    let mut careless = OwnOptimizer {
        then_use_the_plain_step: true,
        ..OwnOptimizer::default()
    };
    let err = harness_error(check_technique(&cpu(), &mlp(), &mut careless));
    assert_eq!(err, HarnessError::OptimizerTaken);
}
