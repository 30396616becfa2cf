//! Misuse of headroom-amp: GradScaler settings and loaded states out of range, its calls out of
//! order (step or update before a scale, unscale twice or after step, step twice, update without
//! step), autocast policies and master weights of a dtype that is not half.

use std::error::Error;

use headroom_amp::{AmpError, AmpPolicy, GradScaler, GradScalerConfig, MasterWeights, OptLevel};
use headroom_autograd_core::{CastPolicy, DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::SgdConfig;
use headroom_optim::{Implementation, ParamGroup, Sgd};

use crate::{expect_eq, expect_err, one_param_group, param, sgd_over, Case, Outcome};
use headroom_testkit::misuse_cases;

pub(crate) fn cases() -> Vec<Case> {
    /// A GradScaler and SGD (fused) of one parameter `p`, a scaled loss backwarded.
    #[allow(clippy::type_complexity)]
    fn scaled() -> Result<(GradScaler, Sgd, Tensor), Box<dyn Error + Send + Sync>> {
        let cpu = CpuBackend::new_ref();
        let p = param(&cpu, &[1.0; 4])?;
        let sgd = sgd_over(vec![p.clone()], Implementation::Fused)?;
        let mut scaler = GradScaler::new(GradScalerConfig::default())?;
        scaler.scale(&p.sum_all()?)?.backward()?;
        Ok((scaler, sgd, p))
    }
    /// A scaler and SGD in the single form (no device scaling: `unscale_` then `step`).
    fn scaled_single() -> Result<(GradScaler, Sgd), Box<dyn Error + Send + Sync>> {
        let cpu = CpuBackend::new_ref();
        let p = param(&cpu, &[1.0; 4])?;
        let sgd = sgd_over(vec![p.clone()], Implementation::Single)?;
        let mut scaler = GradScaler::new(GradScalerConfig::default())?;
        scaler.scale(&p.sum_all()?)?.backward()?;
        Ok((scaler, sgd))
    }
    fn config_refused(config: GradScalerConfig) -> Outcome {
        expect_err!(
            GradScaler::new(config),
            AmpError::InvalidScalerConfig { .. }
        )
    }
    fn init_scale_refused(init_scale: f64) -> Outcome {
        config_refused(GradScalerConfig {
            init_scale,
            ..GradScalerConfig::default()
        })
    }
    misuse_cases![
        grad_scaler_with_init_scale_1e_50_is_invalid_scaler_config => init_scale_refused(1e-50),
        grad_scaler_with_subnormal_init_scale_1e_40_is_invalid_scaler_config =>
            init_scale_refused(1e-40),
        grad_scaler_with_init_scale_0_is_invalid_scaler_config => init_scale_refused(0.0),
        grad_scaler_with_nan_init_scale_is_invalid_scaler_config => init_scale_refused(f64::NAN),
        grad_scaler_with_init_scale_past_f32_is_invalid_scaler_config => init_scale_refused(1e39),
        grad_scaler_with_growth_factor_1_is_invalid_scaler_config => {
            config_refused(GradScalerConfig {
                growth_factor: 1.0,
                ..GradScalerConfig::default()
            })
        },
        grad_scaler_with_backoff_factor_0_is_invalid_scaler_config => {
            config_refused(GradScalerConfig {
                backoff_factor: 0.0,
                ..GradScalerConfig::default()
            })
        },
        grad_scaler_with_growth_interval_0_is_invalid_scaler_config => {
            config_refused(GradScalerConfig {
                growth_interval: 0,
                ..GradScalerConfig::default()
            })
        },
        update_to_0_is_invalid_scaler_config_and_keeps_the_scale => {
            let (mut scaler, _, _) = scaled()?;
            let res = expect_err!(scaler.update_to(0.0), AmpError::InvalidScalerConfig { .. });
            res.and_then(|()| expect_eq(scaler.get_scale()?, 65536.0))
        },
        update_to_a_subnormal_scale_is_invalid_scaler_config => {
            let (mut scaler, _, _) = scaled()?;
            expect_err!(
                scaler.update_to(1e-40),
                AmpError::InvalidScalerConfig { .. }
            )
        },
        update_to_before_any_scale_is_not_scaled => {
            let mut scaler = GradScaler::new(GradScalerConfig::default())?;
            expect_err!(scaler.update_to(1024.0), AmpError::NotScaled)
        },
        step_before_any_scale_is_not_scaled => {
            let mut sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
            let mut scaler = GradScaler::new(GradScalerConfig::default())?;
            expect_err!(scaler.step(&mut sgd), AmpError::NotScaled)
        },
        unscale_twice_is_already_unscaled => {
            let (mut scaler, sgd, _) = scaled()?;
            scaler.unscale_(&sgd)?;
            expect_err!(scaler.unscale_(&sgd), AmpError::AlreadyUnscaled)
        },
        unscale_after_step_is_unscale_after_step => {
            let (mut scaler, mut sgd) = scaled_single()?;
            scaler.step(&mut sgd)?;
            expect_err!(scaler.unscale_(&sgd), AmpError::UnscaleAfterStep)
        },
        step_twice_is_step_twice_and_updates_once => {
            let (mut scaler, mut sgd, p) = scaled()?;
            scaler.step(&mut sgd)?;
            let res = expect_err!(scaler.step(&mut sgd), AmpError::StepTwice);
            // One SGD step of lr 0.1 on a gradient of ones.
            res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![0.9; 4]))
        },
        update_without_step_is_update_without_check => {
            let (mut scaler, _, _) = scaled()?;
            expect_err!(scaler.update(), AmpError::UpdateWithoutCheck)
        },
        load_state_with_growth_tracker_u32_max_is_invalid_scaler_config => {
            let (mut scaler, _, _) = scaled()?;
            let state = scaler.state()?;
            let res = expect_err!(
                scaler.load_state(headroom_amp::GradScalerState {
                    growth_tracker: u32::MAX,
                    ..state
                }),
                AmpError::InvalidScalerConfig { .. }
            );
            res.and_then(|()| expect_eq(scaler.state()?, state))
        },
        load_state_with_scale_0_is_invalid_scaler_config => {
            let (mut scaler, _, _) = scaled()?;
            let state = scaler.state()?;
            expect_err!(
                scaler.load_state(headroom_amp::GradScalerState {
                    scale: 0.0,
                    ..state
                }),
                AmpError::InvalidScalerConfig { .. }
            )
        },
        autocast_policy_in_f32_is_not_half => {
            expect_err!(
                AmpPolicy::torch_cuda(DType::F32),
                AmpError::NotHalf {
                    dtype: DType::F32,
                    ..
                }
            )
        },
        autocast_override_of_an_unknown_op_is_unknown_op_naming_it => {
            expect_err!(
                AmpPolicy::torch_cuda(DType::BF16)?.with_override("conv9d", CastPolicy::Keep),
                AmpError::UnknownOp { op } if op == "conv9d",
                naming "conv9d"
            )
        },
        master_weights_of_an_f32_parameter_is_parameter_dtype => {
            let cpu = CpuBackend::new_ref();
            let half = Tensor::ones(&cpu, &[2], DType::BF16)?;
            let full = Tensor::ones(&cpu, &[2], DType::F32)?;
            let build = |masters: Vec<Tensor>| {
                Sgd::new(
                    vec![ParamGroup::new(masters, SgdConfig::new(0.1))],
                    Implementation::Fused,
                )
            };
            expect_err!(
                MasterWeights::new(vec![half, full], build),
                AmpError::ParameterDType {
                    index: 1,
                    got: DType::F32,
                    ..
                }
            )
        },
        opt_level_with_an_f32_half_dtype_is_not_half => {
            expect_err!(
                OptLevel::O2.properties(DType::F32),
                AmpError::NotHalf {
                    dtype: DType::F32,
                    ..
                }
            )
        },
    ]
}
