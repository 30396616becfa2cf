//! The optimizer in backward on the CUDA backend: 20 steps of ViT-tiny give the plain loop's
//! parameters bit for bit (fused AdamW at two bucket sizes, 8-bit Adam), and a scaled loss is
//! unscaled in the fused kernels from device tensors, skipping the whole step on an overflow.
//! Skips with a notice without a GPU (fails where `HEADROOM_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_nn::VitConfig;
use headroom_ops_cuda::CudaBackend;
use headroom_optim::kernels::AdamConfig;
use headroom_optim::{Adam, Implementation, Optimizer, ParamGroup};
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::{
    check_technique, Batch, ModelSpec, OptimSpec, Technique, Tolerance, TrainCase, TrainRun,
};

struct StepInBackward {
    config: InBackwardConfig,
    in_backward: Option<InBackward>,
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
        let loss = run.model.loss(&run.model.forward(&batch.input)?, batch)?;
        self.in_backward
            .as_ref()
            .ok_or("not prepared")?
            .backward(&loss)?;
        Ok(loss)
    }

    fn finish(&mut self, _run: &mut TrainRun) -> headroom_testkit::Result<()> {
        self.in_backward = None;
        Ok(())
    }
}

fn cuda() -> Option<BackendRef> {
    cuda_or_skip(CudaBackend::new(0)).map(|cuda| cuda as BackendRef)
}

#[test]
fn twenty_steps_in_backward_on_the_gpu_equal_the_plain_loop_bit_for_bit() {
    let Some(cuda) = cuda() else { return };
    for (optimizer, bucket_bytes) in [
        (OptimSpec::adamw(1e-3, 1e-2), 4096),
        (
            OptimSpec::adamw(1e-3, 1e-2),
            headroom_hooks::DEFAULT_BUCKET_BYTES,
        ),
        (OptimSpec::adam8bit(1e-3), 4096),
    ] {
        let case = TrainCase {
            name: "vit-tiny on CUDA",
            model: ModelSpec::Vit(VitConfig::tiny()),
            dtype: DType::F32,
            batch: 4,
            steps: 20,
            optimizer,
            tolerance: Tolerance::Bitwise {
                why: "each parameter's update is the same fused kernel on the same gradient, \
                      whatever bucket it is stepped in",
            },
            seed: 2,
        };
        let mut technique = StepInBackward {
            config: InBackwardConfig {
                bucket_bytes,
                ..InBackwardConfig::default()
            },
            in_backward: None,
        };
        let report = check_technique(&cuda, &case, &mut technique).unwrap_or_else(|err| {
            panic!("{:?}, buckets of {bucket_bytes} B: {err}", case.optimizer)
        });
        assert_eq!(report.baseline_losses, report.technique_losses);
    }
}

fn weights(cuda: &BackendRef) -> Vec<Tensor> {
    (0..3)
        .map(|i| {
            let values: Vec<f64> = (0..4096)
                .map(|j| ((i * 4096 + j) as f64 * 0.01).sin())
                .collect();
            let w = Tensor::from_f64s(cuda, &values, &[4096], DType::F32).unwrap();
            w.requires_grad_(true).unwrap();
            w
        })
        .collect()
}

fn adam(params: Vec<Tensor>) -> Adam {
    Adam::new(
        vec![ParamGroup::new(params, AdamConfig::adamw())],
        Implementation::Fused,
    )
    .unwrap()
}

fn loss_of(params: &[Tensor]) -> Tensor {
    let mut total = params[0].mul(&params[0]).unwrap().sum_all().unwrap();
    for p in &params[1..] {
        total = total.add(&p.exp().unwrap().sum_all().unwrap()).unwrap();
    }
    total
}

#[test]
fn a_scaled_loss_is_unscaled_on_the_device_and_an_overflow_skips_the_whole_step() {
    let Some(cuda) = cuda() else { return };
    let (ours, reference) = (weights(&cuda), weights(&cuda));
    let mut plain = adam(reference.clone());
    let in_backward = InBackward::new(
        Box::new(adam(ours.clone())),
        InBackwardConfig {
            bucket_bytes: 0,
            ..InBackwardConfig::default()
        },
    )
    .unwrap();
    let scale = Tensor::full(&cuda, &[1], 65536.0, DType::F32).unwrap();
    for _ in 0..3 {
        let scaled = loss_of(&ours).mul(&scale.reshape(&[]).unwrap()).unwrap();
        let found_inf = in_backward.backward_scaled(&scaled, &scale).unwrap();
        loss_of(&reference).backward().unwrap();
        plain.step().unwrap();
        plain.zero_grad(true).unwrap();
        assert_eq!(found_inf.to_vec::<f32>().unwrap(), [0.0]);
    }
    for (a, b) in ours.iter().zip(&reference) {
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    }
    let before: Vec<Vec<f32>> = ours.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    let nan = Tensor::full(&cuda, &[], f64::NAN, DType::F32).unwrap();
    let poisoned = loss_of(&ours)
        .add(&ours[2].sum_all().unwrap().mul(&nan).unwrap())
        .unwrap()
        .mul(&scale.reshape(&[]).unwrap())
        .unwrap();
    let found_inf = in_backward.backward_scaled(&poisoned, &scale).unwrap();
    assert_eq!(found_inf.to_vec::<f32>().unwrap(), [1.0]);
    let after: Vec<Vec<f32>> = ours.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    assert_eq!(
        after, before,
        "no parameter moved, not even those stepped before the NaN"
    );
}
