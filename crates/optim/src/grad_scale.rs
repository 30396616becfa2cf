//! A GradScaler's overflow check over the gradients of a step: [`non_finite_check_and_unscale_`],
//! PyTorch's `torch._amp_foreach_non_finite_check_and_unscale_`.
//!
//! On a CUDA device (feature `cuda`) it is one launch per element type present, whatever the
//! number of gradients (`cuda/grad_scale.rs`: each block checks its slice of one gradient and,
//! when asked, unscales it in the same pass; the flag is set in device memory). Elsewhere — the
//! host, and gradients the kernels do not take (strided, f64) — it is autograd-core's portable
//! [`non_finite_check_`] (two reductions per tensor) and one multiplication per gradient. Neither
//! reads anything back to the host. It knows no optimizer and no scaler: amp's GradScaler calls
//! it.

use headroom_autograd_core::{no_grad, non_finite_check_, DType, Tensor, TensorError};

use crate::device::StepDevice;
use crate::error::OptimError;

/// Sets `found_inf` (one f32 element on the gradients' device) to 1 when any element of `grads`
/// is NaN or ±infinity, and leaves it as it was otherwise, so calls accumulate; with `inv_scale`
/// (one f32 element there), multiplies every gradient by it in place, in f32 arithmetic (an f16
/// or bf16 element widened, multiplied, rounded back once; non-finite elements too, as PyTorch
/// does). Nothing is read back to the host. Gradients may be of any floating-point dtype and
/// strided (the CUDA kernels take contiguous f32, bf16 and f16 ones; others are checked and
/// unscaled op by op).
///
/// Errors: a flag or scale that is not one f32 element, tensors on different devices, a
/// gradient of an integer dtype.
///
/// ```
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::non_finite_check_and_unscale_;
///
/// let cpu = CpuBackend::new_ref();
/// let grad = Tensor::from_slice(&cpu, &[2.0f32, -4.0], &[2])?;
/// let found_inf = Tensor::zeros(&cpu, &[1], DType::F32)?;
/// let inv_scale = Tensor::from_slice(&cpu, &[0.5f32], &[1])?;
/// non_finite_check_and_unscale_(&[grad.clone()], &found_inf, Some(&inv_scale))?;
/// assert_eq!(grad.to_vec::<f32>()?, [1.0, -2.0]);
/// assert_eq!(found_inf.to_vec::<f32>()?, [0.0]);
///
/// let overflowed = Tensor::from_slice(&cpu, &[f32::INFINITY], &[1])?;
/// non_finite_check_and_unscale_(&[grad, overflowed], &found_inf, None)?;
/// assert_eq!(found_inf.to_vec::<f32>()?, [1.0]);
/// # Ok::<(), headroom_optim::OptimError>(())
/// ```
pub fn non_finite_check_and_unscale_(
    grads: &[Tensor],
    found_inf: &Tensor,
    inv_scale: Option<&Tensor>,
) -> Result<(), OptimError> {
    const OP: &str = "non_finite_check_and_unscale_";
    for scalar in std::iter::once(found_inf).chain(inv_scale) {
        if scalar.dtype() != DType::F32 || scalar.numel() != 1 {
            return Err(OptimError::InvalidArgument {
                op: OP,
                reason: format!(
                    "found_inf and inv_scale are one f32 element each, got {:?} of shape {:?}",
                    scalar.dtype(),
                    scalar.shape()
                ),
            });
        }
        if scalar.device() != found_inf.device() {
            return Err(TensorError::DeviceMismatch {
                op: OP,
                lhs: found_inf.device(),
                rhs: scalar.device(),
            }
            .into());
        }
    }
    let grads: Vec<Tensor> = grads.iter().filter(|g| g.numel() > 0).cloned().collect();
    if grads.is_empty() {
        return Ok(());
    }
    if with_kernels(OP, &grads, found_inf, inv_scale)? {
        return Ok(());
    }
    let _no_grad = no_grad();
    non_finite_check_(&grads.iter().collect::<Vec<_>>(), found_inf)?;
    if let Some(inv_scale) = inv_scale {
        let inv_scale = inv_scale.reshape(&[])?;
        for grad in &grads {
            unscale(grad, &inv_scale)?;
        }
    }
    Ok(())
}

/// The check through the device's own kernels, when it has them and they take every tensor
/// (contiguous f32, bf16 and f16 gradients of the flag's backend); `false` otherwise.
fn with_kernels(
    op: &'static str,
    grads: &[Tensor],
    found_inf: &Tensor,
    inv_scale: Option<&Tensor>,
) -> Result<bool, OptimError> {
    // A device the optimizers cannot step (another backend's, or CUDA without the `cuda`
    // feature) has no kernels here: the portable form serves it.
    let Ok(mut device) = StepDevice::of(op, found_inf, 0) else {
        return Ok(false);
    };
    let takes = |t: &Tensor| device.check(op, t).is_ok();
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    if !(inv_scale.is_none_or(takes)
        && grads
            .iter()
            .all(|g| dtypes.contains(&g.dtype()) && takes(g)))
    {
        return Ok(false);
    }
    device.non_finite_check(grads, found_inf, inv_scale)
}

/// `grad × inv_scale` in place, in f32 arithmetic (f16/bf16 widened, rounded back once; f64
/// multiplied by the f32 scale widened).
fn unscale(grad: &Tensor, inv_scale: &Tensor) -> Result<(), OptimError> {
    match grad.dtype() {
        DType::F32 => {
            grad.mul_(inv_scale)?;
        }
        DType::F64 => {
            grad.mul_(&inv_scale.to_dtype(DType::F64)?)?;
        }
        _ => {
            let unscaled = grad.to_dtype(DType::F32)?.mul(inv_scale)?;
            grad.copy_(&unscaled)?;
        }
    }
    Ok(())
}
