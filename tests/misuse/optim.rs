//! Misuse of headroom-optim: hyperparameters out of range, parameters of a dtype or layout an
//! optimizer does not take or listed twice, handles of another optimizer, state dicts that do not
//! fit, gradient clipping and schedules out of range, and the raw kernels given short buffers,
//! step 0 or a gradient scale of 0.

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{
    adam8bit_blockwise, adam_fused, dynamic_map, n_blocks, AdafactorConfig, Adam8bitBuffers,
    Adam8bitConfig, AdamBuffers, AdamConfig, GradScaling, ParamRounding, SgdConfig, StepOutcome,
};
use headroom_optim::{
    clip_grad_norm_, clip_grad_value_, Adam, Adam8bit, AdamStochasticConfig, GroupOptimizer,
    Implementation, LrScheduler, NormType, OptimError, Optimizer, ParamGroup, Scaling, Schedule,
    Sgd, StepParams,
};

use crate::{
    expect_eq, expect_err, f32s, one_param_group, param, param_with_grad, sgd_over, Case, Outcome,
};
use headroom_testkit::misuse_cases;
use Implementation::{ForeachUnbounded, Fused, Single};

pub(crate) fn cases() -> Vec<Case> {
    /// `config` refused by the optimizer's constructor, the error naming its config type.
    fn refused<R: headroom_optim::UpdateRule>(
        config: R,
        implementation: Implementation,
    ) -> Outcome {
        let config_type = std::any::type_name::<R>()
            .rsplit("::")
            .next()
            .unwrap_or_default();
        expect_err!(
            one_param_group(config, implementation),
            OptimError::InvalidArgument { op, .. } if *op == config_type
        )
    }
    /// Adam's raw kernel at `step` over four parameters of 1 and `grad_len` gradients: its
    /// answer, and the parameters after it.
    fn adam_kernel(step: u64, grad_len: usize) -> (Result<StepOutcome, OptimError>, Vec<f32>) {
        let (mut param, grad) = (vec![1.0f32; 4], vec![0.5f32; grad_len]);
        let (mut exp_avg, mut exp_avg_sq) = (vec![0.0; 4], vec![0.0; 4]);
        let buffers = AdamBuffers {
            param: &mut param,
            grad: &grad,
            exp_avg: &mut exp_avg,
            exp_avg_sq: &mut exp_avg_sq,
            max_exp_avg_sq: None,
        };
        let res = adam_fused(&AdamConfig::adam(), step, buffers, GradScaling::NONE);
        (res, param)
    }
    /// An optimizer of `config` over `p` refused with a dtype error naming `p`'s dtype.
    fn dtype_refused<R: headroom_optim::UpdateRule>(p: Tensor, config: R) -> Outcome {
        let dtype = p.dtype();
        expect_err!(
            GroupOptimizer::new(vec![ParamGroup::new(vec![p], config)], Fused),
            OptimError::DType { got, .. } if *got == dtype
        )
    }
    /// The raw 8-bit Adam kernel at `step` over `n` parameters of 0.1 whose first absmax buffer
    /// holds `absmax1_len` blocks: its answer, and the parameters after it.
    fn adam8bit_kernel(
        step: u64,
        n: usize,
        absmax1_len: usize,
    ) -> (Result<StepOutcome, OptimError>, Vec<f32>) {
        let (qmap1, qmap2) = (dynamic_map(true), dynamic_map(false));
        let (mut param, grad) = (vec![0.1f32; n], vec![0.5f32; n]);
        let (mut state1, mut state2) = (vec![0u8; n], vec![0u8; n]);
        let (mut absmax1, mut absmax2) = (vec![0.0f32; absmax1_len], vec![0.0f32; n_blocks(n)]);
        let buffers = Adam8bitBuffers {
            param: &mut param,
            grad: &grad,
            state1: &mut state1,
            state2: &mut state2,
            absmax1: &mut absmax1,
            absmax2: &mut absmax2,
        };
        let config = Adam8bitConfig::adam();
        let res = adam8bit_blockwise(
            &config,
            step,
            &qmap1,
            &qmap2,
            buffers,
            GradScaling::NONE,
            ParamRounding::NEAREST,
        );
        (res, param)
    }
    /// A scheduler over a fresh SGD optimizer of one parameter.
    fn scheduler(schedule: Schedule) -> Result<LrScheduler, OptimError> {
        let mut sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
        LrScheduler::new(schedule, &mut sgd)
    }
    misuse_cases![
        sgd_with_negative_lr_is_invalid_argument => refused(SgdConfig::new(-0.1), Fused),
        sgd_with_nan_momentum_is_invalid_argument =>
            refused(SgdConfig { momentum: f64::NAN, ..SgdConfig::new(0.1) }, Single),
        sgd_nesterov_without_momentum_is_invalid_argument =>
            refused(SgdConfig { nesterov: true, ..SgdConfig::new(0.1) }, Implementation::FOREACH),
        adam_with_negative_lr_is_invalid_argument =>
            refused(AdamConfig { lr: -1e-3, ..AdamConfig::adam() }, Fused),
        adam_with_beta2_of_1_is_invalid_argument =>
            refused(AdamConfig { betas: (0.9, 1.0), ..AdamConfig::adamw() }, Fused),
        adam_with_nan_eps_is_invalid_argument =>
            refused(AdamConfig { eps: f64::NAN, ..AdamConfig::adam() }, ForeachUnbounded),
        adam_with_negative_weight_decay_is_invalid_argument =>
            refused(AdamConfig { weight_decay: -0.1, ..AdamConfig::adamw() }, Single),
        adafactor_with_positive_beta2_decay_is_invalid_argument =>
            refused(AdafactorConfig { beta2_decay: 0.8, ..AdafactorConfig::new() }, Fused),
        adafactor_with_d_below_1_is_invalid_argument =>
            refused(AdafactorConfig { d: 0.5, ..AdafactorConfig::new() }, Single),
        adafactor_with_negative_weight_decay_is_invalid_argument =>
            refused(AdafactorConfig { weight_decay: -0.1, ..AdafactorConfig::new() }, Fused),
        adafactor_with_negative_eps_is_invalid_argument =>
            refused(
                AdafactorConfig { eps: (Some(-1e-30), -1e-3), ..AdafactorConfig::new() },
                Fused,
            ),
        adam8bit_with_beta1_above_1_is_invalid_argument =>
            refused(Adam8bitConfig { betas: (1.5, 0.999), ..Adam8bitConfig::adam() }, Fused),
        adam8bit_with_negative_eps_is_invalid_argument =>
            refused(Adam8bitConfig { eps: -1e-8, ..Adam8bitConfig::adamw() }, Fused),
        adam8bit_single_is_unsupported => {
            let adam8bit: Result<Adam8bit, _> = one_param_group(Adam8bitConfig::adam(), Single);
            expect_err!(adam8bit, OptimError::Unsupported { .. })
        },
        adam_on_an_integer_parameter_is_dtype_error => {
            let p = Tensor::from_slice(&CpuBackend::new_ref(), &[1i64, 2], &[2])?;
            dtype_refused(p, AdamConfig::adam())
        },
        adafactor_on_a_bf16_parameter_is_dtype_error => {
            let p = Tensor::ones(&CpuBackend::new_ref(), &[2, 2], DType::BF16)?;
            dtype_refused(p, AdafactorConfig::new())
        },
        adam_stochastic_on_an_f32_parameter_is_dtype_error => {
            let p = param(&CpuBackend::new_ref(), &[1.0; 4])?;
            dtype_refused(p, AdamStochasticConfig::new(AdamConfig::adam(), 0))
        },
        sgd_on_a_non_contiguous_parameter_is_non_contiguous => {
            let cpu = CpuBackend::new_ref();
            let p = Tensor::zeros(&cpu, &[2, 3], DType::F32)?.t()?;
            expect_err!(
                sgd_over(vec![p], Implementation::Fused),
                OptimError::NonContiguous { shape, .. } if shape == &[3, 2]
            )
        },
        sgd_with_one_parameter_listed_twice_is_unsupported_tensor => {
            let cpu = CpuBackend::new_ref();
            let p = param(&cpu, &[1.0; 4])?;
            expect_err!(
                sgd_over(vec![p.clone(), p], Implementation::Fused),
                OptimError::UnsupportedTensor { op: "SGD", .. }
            )
        },
        sgd_over_two_views_of_one_storage_is_unsupported_tensor => {
            let cpu = CpuBackend::new_ref();
            let whole = Tensor::zeros(&cpu, &[8], DType::F32)?;
            let (a, b) = (whole.narrow(0, 0, 5)?, whole.narrow(0, 3, 5)?);
            expect_err!(
                sgd_over(vec![a, b], Implementation::Fused),
                OptimError::UnsupportedTensor { op: "SGD", .. }
            )
        },
        stepping_one_parameter_twice_in_a_call_is_invalid_argument => {
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
        stepping_a_handle_of_another_optimizer_is_unknown_parameter => {
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
        param_id_of_a_tensor_outside_the_optimizer_is_unknown_parameter => {
            let sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
            let cpu = CpuBackend::new_ref();
            expect_err!(
                sgd.param_id(&param(&cpu, &[1.0; 4])?),
                OptimError::UnknownParameter { .. }
            )
        },
        a_gradient_scale_for_a_foreach_step_is_unsupported => {
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
        state_dict_of_garbage_bytes_is_a_safetensors_error => {
            let mut adam = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
            expect_err!(
                adam.load_state_dict(b"definitely not safetensors"),
                OptimError::SafeTensors(_)
            )
        },
        state_dict_of_another_models_shapes_is_state_dict_error => {
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
        state_dict_of_sgd_into_adam_is_state_dict_error => {
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
        clip_grad_norm_with_nan_max_norm_is_invalid_argument => {
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
        clip_grad_norm_with_negative_max_norm_is_invalid_argument => {
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
        clip_grad_norm_of_no_parameters_is_invalid_argument => {
            expect_err!(
                clip_grad_norm_(&[], 1.0, NormType::Inf, false),
                OptimError::InvalidArgument {
                    op: "clip_grad_norm_",
                    ..
                }
            )
        },
        clip_grad_norm_of_an_infinite_gradient_with_error_if_nonfinite_changes_nothing => {
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
        clip_grad_value_with_a_negative_bound_is_invalid_argument => {
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
        clip_grad_norm_of_f64_gradients_is_dtype_error => {
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
        one_cycle_schedule_of_one_step_is_invalid_argument => {
            expect_err!(
                scheduler(Schedule::one_cycle(0.1, 1)),
                OptimError::InvalidArgument {
                    op: "LrScheduler",
                    ..
                }
            )
        },
        one_cycle_schedule_with_pct_start_above_1_is_invalid_argument => {
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
        one_cycle_schedule_with_div_factor_0_is_invalid_argument => {
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
        linear_warmup_with_negative_start_factor_is_invalid_argument => {
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
        adam_kernel_with_a_short_gradient_is_length_mismatch => {
            let (res, param) = adam_kernel(1, 3);
            expect_err!(res, OptimError::LengthMismatch { expected: 4, got: 3, .. })
                .and_then(|()| expect_eq(param, vec![1.0; 4]))
        },
        // Step 0 divides by 1 - beta^0 = 0: every parameter would become NaN.
        adam_kernel_at_step_0_is_invalid_argument => {
            let (res, param) = adam_kernel(0, 4);
            expect_err!(res, OptimError::InvalidArgument { .. })
                .and_then(|()| expect_eq(param, vec![1.0; 4]))
        },
        adam8bit_kernel_with_a_short_absmax_is_length_mismatch => {
            let n = 600;
            let (res, _) = adam8bit_kernel(1, n, n_blocks(n) - 1);
            expect_err!(res, OptimError::LengthMismatch { .. })
        },
        param_step_of_an_index_past_its_group_is_invalid_argument => {
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
        param_step_of_a_group_out_of_range_is_invalid_argument => {
            let sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
            expect_err!(sgd.param_step(3, 0), OptimError::InvalidArgument { .. })
        },
        adam8bit_kernel_at_step_0_is_invalid_argument => {
            let (res, param) = adam8bit_kernel(0, 8, 1);
            expect_err!(res, OptimError::InvalidArgument { .. })
                .and_then(|()| expect_eq(param, vec![0.1; 8]))
        },
        grad_scaling_by_0_in_a_fused_step_is_invalid_argument => {
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
    ]
}
