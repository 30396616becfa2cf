//! Misuse of headroom-optim: hyperparameters out of range, parameters of a dtype or layout an
//! optimizer does not take or listed twice, handles of another optimizer, state dicts that do not
//! fit, gradient clipping and schedules out of range, and the raw kernels given short buffers,
//! step 0 or a gradient scale of 0.

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{
    adam8bit_blockwise, adam_fused, dynamic_map, n_blocks, AdafactorConfig, Adam8bitBuffers,
    Adam8bitConfig, AdamBuffers, AdamConfig, GradScaling, SgdConfig,
};
use headroom_optim::{
    clip_grad_norm_, clip_grad_value_, Adafactor, Adam, Adam8bit, AdamStochastic,
    AdamStochasticConfig, Implementation, LrScheduler, NormType, OptimError, Optimizer, ParamGroup,
    Scaling, Schedule, Sgd, StepParams,
};

use crate::{
    expect_eq, expect_err, f32s, one_param_group, param, param_with_grad, sgd_over, Case, Outcome,
};

pub(crate) fn cases() -> Vec<Case> {
    /// `config` refused by the optimizer's constructor, the error naming `op` (its config type).
    fn refused<R: headroom_optim::UpdateRule>(
        config: R,
        implementation: Implementation,
        op: &str,
    ) -> Outcome {
        expect_err!(
            one_param_group(config, implementation),
            OptimError::InvalidArgument { op: o, .. } if *o == op
        )
    }
    /// A scheduler over a fresh SGD optimizer of one parameter.
    fn scheduler(schedule: Schedule) -> Result<LrScheduler, OptimError> {
        let mut sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
        LrScheduler::new(schedule, &mut sgd)
    }
    vec![
        Case {
            name: "sgd_with_negative_lr_is_invalid_argument",
            run: || refused(SgdConfig::new(-0.1), Implementation::Fused, "SgdConfig"),
        },
        Case {
            name: "sgd_with_nan_momentum_is_invalid_argument",
            run: || {
                refused(
                    SgdConfig {
                        momentum: f64::NAN,
                        ..SgdConfig::new(0.1)
                    },
                    Implementation::Single,
                    "SgdConfig",
                )
            },
        },
        Case {
            name: "sgd_nesterov_without_momentum_is_invalid_argument",
            run: || {
                refused(
                    SgdConfig {
                        nesterov: true,
                        ..SgdConfig::new(0.1)
                    },
                    Implementation::FOREACH,
                    "SgdConfig",
                )
            },
        },
        Case {
            name: "adam_with_negative_lr_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        lr: -1e-3,
                        ..AdamConfig::adam()
                    },
                    Implementation::Fused,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adam_with_beta2_of_1_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        betas: (0.9, 1.0),
                        ..AdamConfig::adamw()
                    },
                    Implementation::Fused,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adam_with_nan_eps_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        eps: f64::NAN,
                        ..AdamConfig::adam()
                    },
                    Implementation::ForeachUnbounded,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adam_with_negative_weight_decay_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        weight_decay: -0.1,
                        ..AdamConfig::adamw()
                    },
                    Implementation::Single,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_positive_beta2_decay_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        beta2_decay: 0.8,
                        ..AdafactorConfig::new()
                    },
                    Implementation::Fused,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_d_below_1_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        d: 0.5,
                        ..AdafactorConfig::new()
                    },
                    Implementation::Single,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_negative_weight_decay_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        weight_decay: -0.1,
                        ..AdafactorConfig::new()
                    },
                    Implementation::Fused,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_negative_eps_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        eps: (Some(-1e-30), -1e-3),
                        ..AdafactorConfig::new()
                    },
                    Implementation::Fused,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adam8bit_with_beta1_above_1_is_invalid_argument",
            run: || {
                refused(
                    Adam8bitConfig {
                        betas: (1.5, 0.999),
                        ..Adam8bitConfig::adam()
                    },
                    Implementation::Fused,
                    "Adam8bitConfig",
                )
            },
        },
        Case {
            name: "adam8bit_with_negative_eps_is_invalid_argument",
            run: || {
                refused(
                    Adam8bitConfig {
                        eps: -1e-8,
                        ..Adam8bitConfig::adamw()
                    },
                    Implementation::Fused,
                    "Adam8bitConfig",
                )
            },
        },
        Case {
            name: "adam8bit_single_is_unsupported",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    Adam8bit::new(
                        vec![ParamGroup::new(vec![p], Adam8bitConfig::adam())],
                        Implementation::Single
                    ),
                    OptimError::Unsupported { .. }
                )
            },
        },
        Case {
            name: "adam_on_an_integer_parameter_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::from_slice(&cpu, &[1i64, 2], &[2])?;
                expect_err!(
                    Adam::new(
                        vec![ParamGroup::new(vec![p], AdamConfig::adam())],
                        Implementation::Fused
                    ),
                    OptimError::DType {
                        got: DType::I64,
                        ..
                    }
                )
            },
        },
        Case {
            name: "adafactor_on_a_bf16_parameter_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::ones(&cpu, &[2, 2], DType::BF16)?;
                expect_err!(
                    Adafactor::new(
                        vec![ParamGroup::new(vec![p], AdafactorConfig::new())],
                        Implementation::Fused
                    ),
                    OptimError::DType {
                        got: DType::BF16,
                        ..
                    }
                )
            },
        },
        Case {
            name: "adam_stochastic_on_an_f32_parameter_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                let config = AdamStochasticConfig::new(AdamConfig::adam(), 0);
                expect_err!(
                    AdamStochastic::new(
                        vec![ParamGroup::new(vec![p], config)],
                        Implementation::Fused
                    ),
                    OptimError::DType {
                        got: DType::F32,
                        ..
                    }
                )
            },
        },
        Case {
            name: "sgd_on_a_non_contiguous_parameter_is_non_contiguous",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::zeros(&cpu, &[2, 3], DType::F32)?.t()?;
                expect_err!(
                    sgd_over(vec![p], Implementation::Fused),
                    OptimError::NonContiguous { shape, .. } if shape == &[3, 2]
                )
            },
        },
        Case {
            name: "sgd_with_one_parameter_listed_twice_is_unsupported_tensor",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    sgd_over(vec![p.clone(), p], Implementation::Fused),
                    OptimError::UnsupportedTensor { op: "SGD", .. }
                )
            },
        },
        Case {
            name: "sgd_over_two_views_of_one_storage_is_unsupported_tensor",
            run: || {
                let cpu = CpuBackend::new_ref();
                let whole = Tensor::zeros(&cpu, &[8], DType::F32)?;
                let (a, b) = (whole.narrow(0, 0, 5)?, whole.narrow(0, 3, 5)?);
                expect_err!(
                    sgd_over(vec![a, b], Implementation::Fused),
                    OptimError::UnsupportedTensor { op: "SGD", .. }
                )
            },
        },
        Case {
            name: "stepping_one_parameter_twice_in_a_call_is_invalid_argument",
            run: || {
                let mut sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                let (id, p) = sgd.params().remove(0);
                p.set_grad(Some(Tensor::ones(p.backend(), &[4], DType::F32)?))?;
                let res = expect_err!(
                    sgd.step_with(StepParams::Only(&[id, id]), Scaling::None),
                    OptimError::InvalidArgument { .. }
                );
                // Refused before any update.
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
            },
        },
        Case {
            name: "stepping_a_handle_of_another_optimizer_is_unknown_parameter",
            run: || {
                let cpu = CpuBackend::new_ref();
                let params: Vec<Tensor> = (0..3)
                    .map(|_| param(&cpu, &[1.0; 2]))
                    .collect::<Result<_, _>>()?;
                let big = Sgd::new(
                    vec![ParamGroup::new(params, SgdConfig::new(0.1))],
                    Implementation::Fused,
                )?;
                let foreign = big.params()[2].0;
                let mut small = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                expect_err!(
                    small.step_with(StepParams::Only(&[foreign]), Scaling::None),
                    OptimError::UnknownParameter { .. }
                )
            },
        },
        Case {
            name: "param_id_of_a_tensor_outside_the_optimizer_is_unknown_parameter",
            run: || {
                let sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                let cpu = CpuBackend::new_ref();
                expect_err!(
                    sgd.param_id(&param(&cpu, &[1.0; 4])?),
                    OptimError::UnknownParameter { .. }
                )
            },
        },
        Case {
            name: "a_gradient_scale_for_a_foreach_step_is_unsupported",
            run: || {
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::FOREACH)?;
                let scaling = GradScaling {
                    grad_scale: Some(1024.0),
                    found_inf: Some(0.0),
                };
                expect_err!(
                    adam.step_with(StepParams::All, Scaling::Host(scaling)),
                    OptimError::Unsupported { .. }
                )
            },
        },
        Case {
            name: "state_dict_of_garbage_bytes_is_a_safetensors_error",
            run: || {
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                expect_err!(
                    adam.load_state_dict(b"definitely not safetensors"),
                    OptimError::SafeTensors(_)
                )
            },
        },
        Case {
            name: "state_dict_of_another_models_shapes_is_state_dict_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 3])?;
                let mut three = Adam::new(
                    vec![ParamGroup::new(vec![p], AdamConfig::adam())],
                    Implementation::Fused,
                )?;
                three.step()?;
                let saved = three.state_dict()?;
                let mut four = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                expect_err!(four.load_state_dict(&saved), OptimError::StateDict(_))
            },
        },
        Case {
            name: "state_dict_of_sgd_into_adam_is_state_dict_error",
            run: || {
                let mut sgd = one_param_group(
                    SgdConfig {
                        momentum: 0.9,
                        ..SgdConfig::new(0.1)
                    },
                    Implementation::Fused,
                )?;
                let (_, p) = sgd.params().remove(0);
                p.set_grad(Some(Tensor::ones(p.backend(), &[4], DType::F32)?))?;
                sgd.step()?;
                let saved = sgd.state_dict()?;
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                expect_err!(adam.load_state_dict(&saved), OptimError::StateDict(_))
            },
        },
        Case {
            name: "clip_grad_norm_with_nan_max_norm_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 4])?;
                expect_err!(
                    clip_grad_norm_(&[p], f64::NAN, NormType::L2, false),
                    OptimError::InvalidArgument {
                        op: "clip_grad_norm_",
                        ..
                    }
                )
            },
        },
        Case {
            name: "clip_grad_norm_with_negative_max_norm_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 4])?;
                let res = expect_err!(
                    clip_grad_norm_(std::slice::from_ref(&p), -1.0, NormType::L2, false),
                    OptimError::InvalidArgument {
                        op: "clip_grad_norm_",
                        ..
                    }
                );
                // Whatever it answers, the gradients must not have changed sign.
                let grad = p.grad().ok_or("the gradient is gone")?.to_vec::<f32>()?;
                res.and_then(|()| expect_eq(grad, vec![1.0; 4]))
            },
        },
        Case {
            name: "clip_grad_norm_of_no_parameters_is_invalid_argument",
            run: || {
                expect_err!(
                    clip_grad_norm_(&[], 1.0, NormType::Inf, false),
                    OptimError::InvalidArgument {
                        op: "clip_grad_norm_",
                        ..
                    }
                )
            },
        },
        Case {
            name: "clip_grad_norm_of_an_infinite_gradient_with_error_if_nonfinite_changes_nothing",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0, 1.0])?;
                p.set_grad(Some(f32s(&cpu, &[f32::INFINITY, 3.0], &[2])?))?;
                let res = expect_err!(
                    clip_grad_norm_(std::slice::from_ref(&p), 1.0, NormType::L2, true),
                    OptimError::NonFiniteNorm {
                        norm_type: NormType::L2,
                        ..
                    }
                );
                let grad = p.grad().ok_or("the gradient is gone")?.to_vec::<f32>()?;
                res.and_then(|()| expect_eq(grad, vec![f32::INFINITY, 3.0]))
            },
        },
        Case {
            name: "clip_grad_value_with_a_negative_bound_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 4])?;
                expect_err!(
                    clip_grad_value_(&[p], -0.5),
                    OptimError::InvalidArgument {
                        op: "clip_grad_value_",
                        ..
                    }
                )
            },
        },
        Case {
            name: "clip_grad_norm_of_f64_gradients_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::ones(&cpu, &[2], DType::F64)?;
                p.requires_grad_(true)?;
                p.set_grad(Some(Tensor::ones(&cpu, &[2], DType::F64)?))?;
                expect_err!(
                    clip_grad_norm_(&[p], 1.0, NormType::L2, false),
                    OptimError::DType {
                        got: DType::F64,
                        ..
                    }
                )
            },
        },
        Case {
            name: "one_cycle_schedule_of_one_step_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::one_cycle(0.1, 1)),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "one_cycle_schedule_with_pct_start_above_1_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::OneCycle {
                        max_lr: 0.1,
                        total_steps: 100,
                        pct_start: 1.5,
                        div_factor: 25.0,
                        final_div_factor: 1e4,
                    }),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "one_cycle_schedule_with_div_factor_0_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::OneCycle {
                        max_lr: 0.1,
                        total_steps: 100,
                        pct_start: 0.3,
                        div_factor: 0.0,
                        final_div_factor: 1e4,
                    }),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "linear_warmup_with_negative_start_factor_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::LinearWarmup {
                        start_factor: -1.0,
                        warmup_steps: 10
                    }),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "adam_kernel_with_a_short_gradient_is_length_mismatch",
            run: || {
                let (mut param, grad) = (vec![1.0f32; 4], vec![0.5f32; 3]);
                let (mut exp_avg, mut exp_avg_sq) = (vec![0.0; 4], vec![0.0; 4]);
                let buffers = AdamBuffers {
                    param: &mut param,
                    grad: &grad,
                    exp_avg: &mut exp_avg,
                    exp_avg_sq: &mut exp_avg_sq,
                    max_exp_avg_sq: None,
                };
                let res = expect_err!(
                    adam_fused(&AdamConfig::adam(), 1, buffers, GradScaling::NONE),
                    OptimError::LengthMismatch {
                        expected: 4,
                        got: 3,
                        ..
                    }
                );
                res.and_then(|()| expect_eq(param, vec![1.0; 4]))
            },
        },
        Case {
            name: "adam_kernel_at_step_0_is_invalid_argument",
            run: || {
                let (mut param, grad) = (vec![1.0f32; 4], vec![0.5f32; 4]);
                let (mut exp_avg, mut exp_avg_sq) = (vec![0.0; 4], vec![0.0; 4]);
                let buffers = AdamBuffers {
                    param: &mut param,
                    grad: &grad,
                    exp_avg: &mut exp_avg,
                    exp_avg_sq: &mut exp_avg_sq,
                    max_exp_avg_sq: None,
                };
                // Step 0 divides by 1 - beta^0 = 0: every parameter would become NaN.
                let res = expect_err!(
                    adam_fused(&AdamConfig::adam(), 0, buffers, GradScaling::NONE),
                    OptimError::InvalidArgument { .. }
                );
                res.and_then(|()| expect_eq(param, vec![1.0; 4]))
            },
        },
        Case {
            name: "adam8bit_kernel_with_a_short_absmax_is_length_mismatch",
            run: || {
                let n = 600;
                let (qmap1, qmap2) = (dynamic_map(true), dynamic_map(false));
                let (mut param, grad) = (vec![0.1f32; n], vec![0.5f32; n]);
                let (mut state1, mut state2) = (vec![0u8; n], vec![0u8; n]);
                let mut absmax1 = vec![0.0f32; n_blocks(n) - 1];
                let mut absmax2 = vec![0.0f32; n_blocks(n)];
                let buffers = Adam8bitBuffers {
                    param: &mut param,
                    grad: &grad,
                    state1: &mut state1,
                    state2: &mut state2,
                    absmax1: &mut absmax1,
                    absmax2: &mut absmax2,
                };
                expect_err!(
                    adam8bit_blockwise(
                        &Adam8bitConfig::adam(),
                        1,
                        &qmap1,
                        &qmap2,
                        buffers,
                        GradScaling::NONE
                    ),
                    OptimError::LengthMismatch { .. }
                )
            },
        },
        Case {
            name: "param_step_of_an_index_past_its_group_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let (a, b) = (
                    param_with_grad(&cpu, &[1.0; 2])?,
                    param_with_grad(&cpu, &[1.0; 2])?,
                );
                let mut sgd = Sgd::new(
                    vec![
                        ParamGroup::new(vec![a], SgdConfig::new(0.1)),
                        ParamGroup::new(vec![b], SgdConfig::new(0.1)),
                    ],
                    Implementation::Fused,
                )?;
                sgd.step()?;
                // Group 0 has one parameter: index 1 is not one of its parameters.
                expect_err!(sgd.param_step(0, 1), OptimError::InvalidArgument { .. })
            },
        },
        Case {
            name: "param_step_of_a_group_out_of_range_is_invalid_argument",
            run: || {
                let sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                expect_err!(sgd.param_step(3, 0), OptimError::InvalidArgument { .. })
            },
        },
        Case {
            name: "adam8bit_kernel_at_step_0_is_invalid_argument",
            run: || {
                let n = 8;
                let (qmap1, qmap2) = (dynamic_map(true), dynamic_map(false));
                let (mut param, grad) = (vec![0.1f32; n], vec![0.5f32; n]);
                let (mut state1, mut state2) = (vec![0u8; n], vec![0u8; n]);
                let (mut absmax1, mut absmax2) = (vec![0.0f32; 1], vec![0.0f32; 1]);
                let buffers = Adam8bitBuffers {
                    param: &mut param,
                    grad: &grad,
                    state1: &mut state1,
                    state2: &mut state2,
                    absmax1: &mut absmax1,
                    absmax2: &mut absmax2,
                };
                let res = expect_err!(
                    adam8bit_blockwise(
                        &Adam8bitConfig::adam(),
                        0,
                        &qmap1,
                        &qmap2,
                        buffers,
                        GradScaling::NONE
                    ),
                    OptimError::InvalidArgument { .. }
                );
                res.and_then(|()| expect_eq(param, vec![0.1; n]))
            },
        },
        Case {
            name: "grad_scaling_by_0_in_a_fused_step_is_invalid_argument",
            run: || {
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                let (_, p) = adam.params().remove(0);
                p.set_grad(Some(Tensor::ones(p.backend(), &[4], DType::F32)?))?;
                let scaling = GradScaling {
                    grad_scale: Some(0.0),
                    found_inf: Some(0.0),
                };
                let res = expect_err!(
                    adam.step_with(StepParams::All, Scaling::Host(scaling)),
                    OptimError::InvalidArgument { .. }
                );
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
            },
        },
    ]
}
