//! Adafactor on CUDA (`kernels/adafactor.cu`), one parameter at a time as on the CPU: the
//! parameter's norm, decay, the second moments, the update's norm, the write. The single form
//! keeps the update in a temporary of the parameter's size; the fused form recomputes it and
//! keeps only per-block partial sums; foreach runs parameters whose CPU scratch fits the chunk
//! through the single form and the rest through the fused form (unbounded: every temporary
//! allocated first), as `adafactor.rs` does on the host.
//!
//! The two norms and `α` stay on the device (a small f64 scalars tensor per parameter step), so
//! nothing waits for the GPU. A GradScaler's device values are not supported here (Adafactor's
//! host-valued scale is).

use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cuda::KernelArg;

use super::{address, CudaDevice, Module};
use crate::adafactor::AdafactorState;
use crate::device::StepScaling;
use crate::error::OptimError;
use crate::kernels::{adafactor_scratch_len, factors, AdafactorConfig, AdafactorConsts};
use crate::optimizer::{Implementation, StepItem};

const THREADS: u32 = 256;
/// Elements per block of the two norm sums.
const NORM_BLOCK: u64 = 16384;

// Gradient flags and `af_update` modes (`kernels/adafactor.cu`).
const SCALED: i32 = 1;
const MAXIMIZE: i32 = 2;
const READ_U: i32 = 1;
const WRITE_U: i32 = 2;
const NORM: i32 = 4;
const APPLY: i32 = 8;

/// Where the update lives between its norm and its write.
enum Form<'a> {
    /// In this temporary of the parameter's size.
    Single(&'a Tensor),
    /// Recomputed.
    Fused,
}

/// One step of the rule's `items` on the device.
pub(crate) fn step(
    device: &mut CudaDevice,
    cfg: &AdafactorConfig,
    implementation: Implementation,
    items: &mut [StepItem<'_, AdafactorState>],
    scaling: StepScaling<'_>,
) -> Result<(), OptimError> {
    if let StepScaling::Device(_) = scaling {
        return Err(OptimError::Unsupported {
            optimizer: "Adafactor",
            reason: "a device gradient scale (pass the scale as a value)".into(),
        });
    }
    let grad_scale = scaling.host().grad_scale;
    let temporary = |it: &StepItem<'_, AdafactorState>| {
        Tensor::empty(it.param.backend(), &[it.param.numel()], DType::F32)
    };
    match implementation {
        Implementation::Fused => {
            for it in items.iter() {
                step_one(device, cfg, it, Form::Fused, grad_scale)?;
            }
        }
        Implementation::Foreach { chunk: None } => {
            let temporaries = items.iter().map(temporary).collect::<Result<Vec<_>, _>>()?;
            for (it, u) in items.iter().zip(&temporaries) {
                step_one(device, cfg, it, Form::Single(u), None)?;
            }
        }
        Implementation::Foreach { chunk: Some(chunk) } => {
            for it in items.iter() {
                if adafactor_scratch_len(it.param.shape()) <= chunk {
                    step_one(device, cfg, it, Form::Single(&temporary(it)?), None)?;
                } else {
                    step_one(device, cfg, it, Form::Fused, None)?;
                }
            }
        }
        Implementation::Single | Implementation::EightBit => {
            for it in items.iter() {
                step_one(device, cfg, it, Form::Single(&temporary(it)?), None)?;
            }
        }
    }
    Ok(())
}

fn blocks(n: u64) -> u32 {
    n.div_ceil(u64::from(THREADS)).max(1) as u32
}

/// The launches of one parameter's step.
fn step_one(
    device: &mut CudaDevice,
    cfg: &AdafactorConfig,
    it: &StepItem<'_, AdafactorState>,
    form: Form<'_>,
    grad_scale: Option<f32>,
) -> Result<(), OptimError> {
    use KernelArg::{F32, F64, I32, U32, U64};
    let n = it.param.numel() as u64;
    if n == 0 {
        return Ok(());
    }
    let c = AdafactorConsts::without_norm(cfg, it.step);
    let n_partials = n.div_ceil(NORM_BLOCK);
    let scalars = Tensor::empty(it.param.backend(), &[2 + n_partials as usize], DType::F64)?;
    let (scalars_at, partials) = (address(&scalars), address(&scalars) + 16);
    let (p, g) = (address(it.param), address(&it.grad));
    let flags = i32::from(grad_scale.is_some()) * SCALED + i32::from(c.maximize) * MAXIMIZE;
    let scale = grad_scale.unwrap_or(1.0);
    let kernel = Module::Adafactor;
    // Every launch below: the arguments follow each kernel's parameters in order and type; the
    // addresses are the step's checked tensors, its state tensors and the temporaries of this
    // call, alive until every launch is queued (frees are stream-ordered).
    // SAFETY: see above.
    unsafe {
        device.launch(
            kernel,
            "af_sum_squares",
            n_partials as u32,
            THREADS,
            &[U64(p), U64(n), U64(NORM_BLOCK), U64(partials)],
        )?;
        let alpha_args = [
            U64(scalars_at),
            U64(partials),
            U32(n_partials as u32),
            U64(n),
            F64(cfg.eps.1),
            F64(c.rho),
        ];
        device.launch(kernel, "af_alpha", 1, 1, &alpha_args)?;
        if let Some(factor) = c.decay_factor {
            device.launch(
                kernel,
                "af_scale_param",
                blocks(n),
                THREADS,
                &[U64(p), U64(n), F32(factor)],
            )?;
        }
    }
    let floors;
    let (row_var, col_var, variance, floors_at, rows, cols) =
        match (&*it.state, factors(it.param.shape())) {
            (AdafactorState::Factored { row_var, col_var }, Some((batch, rows, cols))) => {
                let (batch, rows, cols) = (batch as u64, rows as u64, cols as u64);
                floors = Some(Tensor::empty(
                    it.param.backend(),
                    &[batch as usize],
                    DType::F32,
                )?);
                let floors_at = floors.as_ref().map_or(0, address);
                let (r, cv) = (address(row_var), address(col_var));
                // SAFETY: see above.
                unsafe {
                    device.launch(
                        kernel,
                        "af_rows",
                        blocks(batch * rows),
                        THREADS,
                        &[
                            U64(g),
                            U64(r),
                            U64(batch * rows),
                            U64(cols),
                            F32(c.weight),
                            F32(scale),
                            I32(flags),
                        ],
                    )?;
                    device.launch(
                        kernel,
                        "af_cols",
                        blocks(batch * cols),
                        THREADS,
                        &[
                            U64(g),
                            U64(cv),
                            U64(batch),
                            U64(rows),
                            U64(cols),
                            F32(c.weight),
                            F32(scale),
                            I32(flags),
                        ],
                    )?;
                    device.launch(
                        kernel,
                        "af_floors",
                        blocks(batch),
                        THREADS,
                        &[U64(r), U64(floors_at), U64(batch), U64(rows), F32(c.eps1)],
                    )?;
                }
                (r, cv, 0, floors_at, rows, cols)
            }
            (AdafactorState::Full { variance }, None) => {
                floors = None;
                let v = address(variance);
                // SAFETY: see above.
                unsafe {
                    device.launch(
                        kernel,
                        "af_variance",
                        blocks(n),
                        THREADS,
                        &[
                            U64(g),
                            U64(v),
                            U64(n),
                            F32(c.weight),
                            F32(scale),
                            I32(flags),
                        ],
                    )?;
                }
                (0, 0, v, 0, 1, 0)
            }
            _ => {
                return Err(OptimError::InvalidArgument {
                    op: "Adafactor",
                    reason: "state does not match the parameter's shape".into(),
                })
            }
        };
    let (u, norm_mode, apply_mode) = match form {
        Form::Single(u) => (address(u), WRITE_U | NORM, READ_U | APPLY),
        Form::Fused => (0, NORM, APPLY),
    };
    let update_args = |mode: i32| {
        [
            I32(mode),
            U64(g),
            U64(p),
            U64(u),
            U64(row_var),
            U64(col_var),
            U64(floors_at),
            U64(variance),
            U64(n),
            U64(rows),
            U64(cols),
            U64(NORM_BLOCK),
            F32(c.eps1_sq),
            F32(scale),
            I32(flags),
            U64(partials),
            U64(scalars_at),
        ]
    };
    // SAFETY: see above.
    unsafe {
        device.launch(
            kernel,
            "af_update",
            n_partials as u32,
            THREADS,
            &update_args(norm_mode),
        )?;
        let value_args = [
            U64(scalars_at),
            U64(partials),
            U32(n_partials as u32),
            U64(n),
            F64(c.d),
        ];
        device.launch(kernel, "af_value", 1, 1, &value_args)?;
        device.launch(
            kernel,
            "af_update",
            n_partials as u32,
            THREADS,
            &update_args(apply_mode),
        )?;
    }
    drop((scalars, floors));
    Ok(())
}
