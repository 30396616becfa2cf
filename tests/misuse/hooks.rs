//! Misuse of headroom-hooks' optimizer in backward: a scale or clipping it cannot use, a
//! parameter registered twice or without grad, a step by hand, accumulation over 0
//! micro-batches, a plain backward under exact clipping.

use headroom_autograd_core::{DType, Tensor};
use headroom_hooks::{ClipMode, Clipping, HooksError, InBackward, InBackwardConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::SgdConfig;
use headroom_optim::{Implementation, NormType, OptimError, Optimizer, ParamGroup, Sgd};

use crate::{expect_eq, expect_err, f32s, param, Case};

pub(crate) fn cases() -> Vec<Case> {
    /// An InBackward over fused SGD of one parameter, with `config`.
    fn in_backward(config: InBackwardConfig) -> Result<(InBackward, Tensor), HooksError> {
        let cpu = CpuBackend::new_ref();
        let p = param(&cpu, &[1.0; 4])?;
        let sgd = Sgd::new(
            vec![ParamGroup::new(vec![p.clone()], SgdConfig::new(0.1))],
            Implementation::Fused,
        )?;
        Ok((InBackward::new(Box::new(sgd), config)?, p))
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
    vec![
        Case {
            name: "backward_scaled_with_a_two_element_scale_is_invalid_argument",
            run: || {
                let (in_backward, p) = in_backward(InBackwardConfig::default())?;
                let scale = Tensor::full(p.backend(), &[2], 1024.0, DType::F32)?;
                let res = expect_err!(
                    in_backward.backward_scaled(&p.sum_all()?, &scale),
                    HooksError::InvalidArgument {
                        op: "InBackward::backward_scaled",
                        ..
                    }
                );
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
            },
        },
        Case {
            name: "backward_scaled_with_an_f64_scale_is_invalid_argument",
            run: || {
                let (in_backward, p) = in_backward(InBackwardConfig::default())?;
                let scale = Tensor::full(p.backend(), &[1], 1024.0, DType::F64)?;
                expect_err!(
                    in_backward.backward_scaled(&p.sum_all()?, &scale),
                    HooksError::InvalidArgument {
                        op: "InBackward::backward_scaled",
                        ..
                    }
                )
            },
        },
        Case {
            name: "backward_scaled_with_previous_step_clipping_is_invalid_argument",
            run: || {
                let (in_backward, p) = in_backward(InBackwardConfig {
                    clipping: Some(Clipping {
                        max_norm: 1.0,
                        norm: NormType::L2,
                        mode: ClipMode::PreviousStep,
                    }),
                    ..InBackwardConfig::default()
                })?;
                let scale = Tensor::full(p.backend(), &[1], 1024.0, DType::F32)?;
                expect_err!(
                    in_backward.backward_scaled(&p.sum_all()?, &scale),
                    HooksError::InvalidArgument { .. }
                )
            },
        },
        Case {
            name: "a_parameter_registered_twice_is_already_registered",
            run: || {
                let (_first, p) = in_backward(InBackwardConfig::default())?;
                let sgd = Sgd::new(
                    vec![ParamGroup::new(vec![p], SgdConfig::new(0.1))],
                    Implementation::Fused,
                )?;
                expect_err!(
                    InBackward::new(Box::new(sgd), InBackwardConfig::default()),
                    HooksError::AlreadyRegistered { index: 0 }
                )
            },
        },
        Case {
            name: "stepping_an_in_backward_by_hand_is_unsupported_and_changes_nothing",
            run: || {
                let (mut in_backward, p) = in_backward(InBackwardConfig::default())?;
                p.set_grad(Some(Tensor::ones(p.backend(), &[4], DType::F32)?))?;
                let res = expect_err!(
                    in_backward.step(),
                    OptimError::Unsupported { optimizer: "InBackward", .. },
                    naming "steps inside backward"
                );
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
            },
        },
        Case {
            name: "in_backward_of_a_parameter_without_grad_is_does_not_require_grad",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = f32s(&cpu, &[1.0; 4], &[4])?;
                let sgd = Sgd::new(
                    vec![ParamGroup::new(vec![p], SgdConfig::new(0.1))],
                    Implementation::Fused,
                )?;
                expect_err!(
                    InBackward::new(Box::new(sgd), InBackwardConfig::default()),
                    HooksError::DoesNotRequireGrad { index: 0 }
                )
            },
        },
        Case {
            name: "in_backward_accumulating_0_micro_batches_is_invalid_argument",
            run: || {
                expect_err!(
                    in_backward(InBackwardConfig {
                        accumulation: 0,
                        ..InBackwardConfig::default()
                    }),
                    HooksError::InvalidArgument { .. }
                )
            },
        },
        Case {
            name: "in_backward_clipping_to_nan_is_invalid_argument",
            run: || {
                let mut config = exact_clipping();
                if let Some(clipping) = &mut config.clipping {
                    clipping.max_norm = f64::NAN;
                }
                expect_err!(in_backward(config), HooksError::InvalidArgument { .. })
            },
        },
        Case {
            name: "plain_backward_under_exact_clipping_is_needs_two_passes",
            run: || {
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
        },
    ]
}
