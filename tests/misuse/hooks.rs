//! Misuse of headroom-hooks' optimizer in backward: a loss scaler that opens a step with a scale
//! the kernels cannot read, clipping it cannot use, a parameter registered twice or without
//! grad, accumulation over 0 micro-batches, a plain backward under exact clipping; and a
//! disabled scaler, which makes a scaled backward a plain one.

use headroom_amp::{GradScaler, GradScalerConfig};
use headroom_autograd_core::{DType, Tensor};
use headroom_hooks::{ClipMode, Clipping, HooksError, InBackward, InBackwardConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{DeviceGradScaling, Implementation, LossScaler, NormType, OptimError};

use crate::{expect_eq, expect_err, f32s, param, sgd_over, Case, Outcome};
use headroom_testkit::misuse_cases;

pub(crate) fn cases() -> Vec<Case> {
    /// An InBackward over fused SGD of one parameter, with `config`.
    fn in_backward(config: InBackwardConfig) -> Result<(InBackward, Tensor), HooksError> {
        let cpu = CpuBackend::new_ref();
        let p = param(&cpu, &[1.0; 4])?;
        let sgd = sgd_over(vec![p.clone()], Implementation::Fused)?;
        Ok((InBackward::new(Box::new(sgd), config)?, p))
    }
    /// A loss scaler of another crate that opens its steps with `scale` (anything at all) and
    /// a one-element flag.
    #[derive(Debug)]
    struct OddScaler {
        scale: Tensor,
    }
    impl LossScaler for OddScaler {
        fn scale_loss(&mut self, loss: &Tensor) -> Result<Tensor, OptimError> {
            Ok(loss.clone())
        }
        fn begin_step(&mut self) -> Result<Option<DeviceGradScaling>, OptimError> {
            let found_inf = Tensor::zeros(self.scale.backend(), &[1], DType::F32)?;
            Ok(Some(DeviceGradScaling {
                grad_scale: Some(self.scale.clone()),
                found_inf: Some(found_inf),
            }))
        }
        fn end_step(&mut self, _: &DeviceGradScaling) -> Result<(), OptimError> {
            Ok(())
        }
    }
    /// A scaled backward whose scaler opens the step with a scale of `shape` and `dtype`:
    /// refused, the parameter left as it was.
    fn odd_scale_refused(shape: &[usize], dtype: DType) -> Outcome {
        let (in_backward, p) = in_backward(InBackwardConfig::default())?;
        let scale = Tensor::full(p.backend(), shape, 1024.0, dtype)?;
        let res = expect_err!(
            in_backward.backward_scaled(&p.sum_all()?, &mut OddScaler { scale }),
            HooksError::InvalidArgument {
                op: "InBackward::backward_scaled",
                ..
            }
        );
        res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
    }
    /// An InBackward of `config` refused as an invalid argument.
    fn config_refused(config: InBackwardConfig) -> Outcome {
        expect_err!(in_backward(config), HooksError::InvalidArgument { .. })
    }
    fn exact_clipping() -> InBackwardConfig {
        InBackwardConfig {
            clipping: Some(Clipping {
                max_norm: 1.0,
                norm: NormType::L2,
                mode: ClipMode::Exact,
            }),
            ..InBackwardConfig::default()
        }
    }
    misuse_cases![
        backward_scaled_with_a_two_element_scale_is_invalid_argument =>
            odd_scale_refused(&[2], DType::F32),
        backward_scaled_with_an_f64_scale_is_invalid_argument =>
            odd_scale_refused(&[1], DType::F64),
        backward_scaled_with_previous_step_clipping_is_invalid_argument => {
            let (in_backward, p) = in_backward(InBackwardConfig {
                clipping: Some(Clipping {
                    max_norm: 1.0,
                    norm: NormType::L2,
                    mode: ClipMode::PreviousStep,
                }),
                ..InBackwardConfig::default()
            })?;
            let mut scaler = GradScaler::new(GradScalerConfig::default())?;
            expect_err!(
                in_backward.backward_scaled(&p.sum_all()?, &mut scaler),
                HooksError::InvalidArgument { .. }
            )
        },
        a_parameter_registered_twice_is_already_registered => {
            let (_first, p) = in_backward(InBackwardConfig::default())?;
            let sgd = sgd_over(vec![p], Implementation::Fused)?;
            expect_err!(
                InBackward::new(Box::new(sgd), InBackwardConfig::default()),
                HooksError::AlreadyRegistered { index: 0 }
            )
        },
        // Stepping an InBackward by hand no longer compiles (it is not an Optimizer); a
        // scaler that is disabled makes a scaled backward a plain one.
        backward_scaled_with_a_disabled_scaler_steps_unscaled => {
            let (in_backward, p) = in_backward(InBackwardConfig::default())?;
            let mut scaler = GradScaler::new(GradScalerConfig {
                enabled: false,
                ..GradScalerConfig::default()
            })?;
            let skipped = in_backward.backward_scaled(&p.sum_all()?, &mut scaler)?;
            // One SGD step of lr 0.1 on a gradient of ones.
            expect_eq(skipped.read()?, false)
                .and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![0.9; 4]))
        },
        in_backward_of_a_parameter_without_grad_is_does_not_require_grad => {
            let cpu = CpuBackend::new_ref();
            let p = f32s(&cpu, &[1.0; 4], &[4])?;
            let sgd = sgd_over(vec![p], Implementation::Fused)?;
            expect_err!(
                InBackward::new(Box::new(sgd), InBackwardConfig::default()),
                HooksError::DoesNotRequireGrad { index: 0 }
            )
        },
        in_backward_accumulating_0_micro_batches_is_invalid_argument =>
            config_refused(InBackwardConfig { accumulation: 0, ..InBackwardConfig::default() }),
        in_backward_clipping_to_nan_is_invalid_argument => {
            let mut config = exact_clipping();
            if let Some(clipping) = &mut config.clipping {
                clipping.max_norm = f64::NAN;
            }
            config_refused(config)
        },
        plain_backward_under_exact_clipping_is_needs_two_passes => {
            let (_in_backward, p) = in_backward(exact_clipping())?;
            let err = match p.sum_all()?.backward() {
                Ok(()) => return Err("expected NeedsTwoPasses, got Ok".into()),
                Err(err) => err,
            };
            match err.hook_source::<HooksError>() {
                Some(HooksError::NeedsTwoPasses) => expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]),
                _ => Err(format!("expected NeedsTwoPasses, got {err:?}").into()),
            }
        },
    ]
}
