//! The training loops the optimizer-in-backward tests compare (testkit techniques), shared by the
//! CPU and CUDA test files: stepping in backward, plain accumulation, and the plain loop with
//! `clip_grad_norm_` (with and without accumulation).

#![allow(dead_code, reason = "each test file uses some of them")]

use headroom_autograd_core::{DType, Tensor};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_testkit::ulps::max_ulps;
use headroom_testkit::{Batch, ModelSpec, OptimSpec, Technique, Tolerance, TrainCase, TrainRun};

/// Takes the case's optimizer into an `InBackward` and trains with its backward.
pub(crate) struct StepInBackward {
    config: InBackwardConfig,
    in_backward: Option<InBackward>,
    /// Micro-batches per step (the batch is cut into this many).
    micro_batches: usize,
}

impl StepInBackward {
    pub(crate) fn new(config: InBackwardConfig) -> StepInBackward {
        let micro_batches = config.accumulation;
        StepInBackward {
            config,
            in_backward: None,
            micro_batches,
        }
    }
}

impl Technique for StepInBackward {
    fn name(&self) -> &str {
        "optimizer in backward"
    }

    fn prepare(&mut self, run: &mut TrainRun) -> headroom_testkit::Result<()> {
        let optimizer = run.optimizer.take().ok_or("no optimizer")?;
        self.in_backward = Some(InBackward::new(optimizer, self.config.clone())?);
        Ok(())
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> headroom_testkit::Result<Tensor> {
        let in_backward = self.in_backward.as_ref().ok_or("not prepared")?;
        let size = batch.len() / self.micro_batches;
        let mut last = None;
        for micro in 0..self.micro_batches {
            let part = batch.narrow(micro * size, size)?;
            let loss = run.model.loss(&run.model.forward(&part.input)?, &part)?;
            in_backward.backward(&loss)?;
            last = Some(loss);
        }
        Ok(last.expect("at least one micro-batch"))
    }

    fn finish(&mut self, _run: &mut TrainRun) -> headroom_testkit::Result<()> {
        self.in_backward = None;
        Ok(())
    }
}

/// The plain loop with gradient accumulation: `k` backwards, one step.
pub(crate) struct Accumulate(pub usize);

impl Technique for Accumulate {
    fn name(&self) -> &str {
        "plain accumulation"
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> headroom_testkit::Result<Tensor> {
        let size = batch.len() / self.0;
        let mut last = None;
        for micro in 0..self.0 {
            let part = batch.narrow(micro * size, size)?;
            let loss = run.model.loss(&run.model.forward(&part.input)?, &part)?;
            loss.backward()?;
            last = Some(loss);
        }
        let optimizer = run.optimizer.as_mut().ok_or("no optimizer")?;
        optimizer.step()?;
        optimizer.zero_grad(true)?;
        Ok(last.expect("at least one micro-batch"))
    }
}

pub(crate) fn case(
    name: &'static str,
    model: ModelSpec,
    optimizer: OptimSpec,
    steps: usize,
) -> TrainCase {
    TrainCase {
        name,
        model,
        dtype: DType::F32,
        batch: 4,
        steps,
        optimizer,
        tolerance: Tolerance::Bitwise {
            why: "each parameter's update is the same fused kernel on the same gradient, \
                  whatever bucket it is stepped in",
        },
        seed: 9,
    }
}

pub(crate) fn mlp() -> ModelSpec {
    ModelSpec::Mlp {
        width: 16,
        hidden: 48,
    }
}

/// The largest distance in ulps between two parameter sets of one model.
pub(crate) fn parameter_ulps(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> u32 {
    let mut worst = 0;
    for ((name, x), (other, y)) in a.iter().zip(b) {
        assert_eq!(name, other);
        let (x, y) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
        worst = worst.max(max_ulps(&x, &y));
    }
    worst
}

/// The plain loop with `clip_grad_norm_` before the step.
pub(crate) struct ClipThenStep {
    pub(crate) max_norm: f64,
    pub(crate) norm: headroom_optim::NormType,
}

impl Technique for ClipThenStep {
    fn name(&self) -> &str {
        "clip_grad_norm_ then step"
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> headroom_testkit::Result<Tensor> {
        let loss = run.model.loss(&run.model.forward(&batch.input)?, batch)?;
        loss.backward()?;
        let params = run.model.module().parameters();
        headroom_optim::clip_grad_norm_(&params, self.max_norm, self.norm, false)?;
        let optimizer = run.optimizer.as_mut().ok_or("no optimizer")?;
        optimizer.step()?;
        optimizer.zero_grad(true)?;
        Ok(loss)
    }
}

pub(crate) fn clipping(
    max_norm: f64,
    norm: headroom_optim::NormType,
    mode: headroom_hooks::ClipMode,
) -> InBackwardConfig {
    InBackwardConfig {
        bucket_bytes: 2048,
        clipping: Some(headroom_hooks::Clipping {
            max_norm,
            norm,
            mode,
        }),
        ..InBackwardConfig::default()
    }
}

/// Plain accumulation over `k` micro-batches, clipped before the step.
pub(crate) struct ClipAccumulate {
    pub(crate) max_norm: f64,
    pub(crate) norm: headroom_optim::NormType,
    pub(crate) k: usize,
}

impl Technique for ClipAccumulate {
    fn name(&self) -> &str {
        "accumulate, clip_grad_norm_, step"
    }

    fn step(&mut self, run: &mut TrainRun, batch: &Batch) -> headroom_testkit::Result<Tensor> {
        let size = batch.len() / self.k;
        let mut last = None;
        for micro in 0..self.k {
            let part = batch.narrow(micro * size, size)?;
            let loss = run.model.loss(&run.model.forward(&part.input)?, &part)?;
            loss.backward()?;
            last = Some(loss);
        }
        let params = run.model.module().parameters();
        headroom_optim::clip_grad_norm_(&params, self.max_norm, self.norm, false)?;
        let optimizer = run.optimizer.as_mut().ok_or("no optimizer")?;
        optimizer.step()?;
        optimizer.zero_grad(true)?;
        Ok(last.expect("at least one micro-batch"))
    }
}

/// A loss scaler of a fixed scale (no growth, no backoff), as the tests of `backward_scaled`
/// need one without amp: the scale on `like`'s backend, a fresh overflow flag per step, and the
/// flags of the steps it closed.
#[derive(Debug)]
pub(crate) struct FixedScale {
    pub(crate) scale: Tensor,
    pub(crate) closed: Vec<Tensor>,
}

impl FixedScale {
    pub(crate) fn new(like: &Tensor, scale: f64) -> FixedScale {
        FixedScale {
            scale: Tensor::full(like.backend(), &[], scale, DType::F32).unwrap(),
            closed: Vec::new(),
        }
    }
}

impl headroom_optim::LossScaler for FixedScale {
    fn scale_loss(&mut self, loss: &Tensor) -> Result<Tensor, headroom_optim::OptimError> {
        Ok(loss.to_dtype(DType::F32)?.mul(&self.scale)?)
    }

    fn begin_step(
        &mut self,
    ) -> Result<Option<headroom_optim::DeviceGradScaling>, headroom_optim::OptimError> {
        Ok(Some(headroom_optim::DeviceGradScaling {
            grad_scale: Some(self.scale.clone()),
            found_inf: Some(Tensor::zeros(self.scale.backend(), &[1], DType::F32)?),
        }))
    }

    fn end_step(
        &mut self,
        scaling: &headroom_optim::DeviceGradScaling,
    ) -> Result<(), headroom_optim::OptimError> {
        self.closed.extend(scaling.found_inf.clone());
        Ok(())
    }
}

/// Adam's state in host memory (`OffloadedAdam`), stepped inside backward bucket by bucket
/// (buckets of 4 KiB and the default 25 MiB): the losses and parameter bits of the plain loop
/// with the on-device optimizer — fused AdamW on f32 parameters, `AdamStochastic` (the same seed)
/// on bf16 ones.
pub(crate) fn offloaded_in_backward_equals_the_plain_loop(
    backend: &headroom_autograd_core::BackendRef,
    model: ModelSpec,
    steps: usize,
) {
    use headroom_optim::{AdamConfig, AdamStochasticConfig, Implementation, OffloadStepper};
    let adam = AdamConfig {
        lr: 1e-3,
        weight_decay: 1e-2,
        ..AdamConfig::adamw()
    };
    for dtype in [DType::F32, DType::BF16] {
        let on_device = match dtype {
            DType::BF16 => OptimSpec::AdamStochastic {
                config: AdamStochasticConfig::new(adam.clone(), 7),
            },
            _ => OptimSpec::Adam {
                config: adam.clone(),
                implementation: Implementation::Fused,
            },
        };
        let plain_case = TrainCase {
            dtype,
            ..case("offloaded Adam", model, on_device, steps)
        };
        let plain =
            headroom_testkit::train(backend, &plain_case, &mut headroom_testkit::Baseline).unwrap();
        let steppers: &[OffloadStepper] = match backend.device() {
            headroom_autograd_core::Device::Cpu => &[OffloadStepper::Host],
            _ => &[OffloadStepper::Host, OffloadStepper::Device],
        };
        let runs = steppers
            .iter()
            .flat_map(|s| [4096, headroom_hooks::DEFAULT_BUCKET_BYTES].map(|b| (*s, b)));
        for (stepper, bucket_bytes) in runs {
            let mut optimizer = OptimSpec::offloaded(adam.clone(), 7);
            if let OptimSpec::Offloaded { config } = &mut optimizer {
                config.stepper = stepper;
            }
            let offloaded_case = TrainCase {
                optimizer,
                ..plain_case.clone()
            };
            let mut technique = StepInBackward::new(InBackwardConfig {
                bucket_bytes,
                ..InBackwardConfig::default()
            });
            let got = headroom_testkit::train(backend, &offloaded_case, &mut technique)
                .unwrap_or_else(|err| {
                    panic!("{stepper:?}, {dtype:?}, buckets of {bucket_bytes} B: {err}")
                });
            assert_eq!(
                plain.losses, got.losses,
                "{stepper:?}, {dtype:?}, buckets of {bucket_bytes} B"
            );
            for ((name, want), (_, have)) in plain.parameters.iter().zip(&got.parameters) {
                let as_f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
                let (want, have) = (as_f32(want), as_f32(have));
                let off = want
                    .iter()
                    .zip(&have)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    off, 0,
                    "{stepper:?}, {dtype:?}, buckets of {bucket_bytes} B, {name}: {off} differ"
                );
            }
        }
    }
}
