//! Gradient norms and clipping coefficients as device tensors, for clipping inside backward,
//! computed exactly as optim's `clip_grad_norm_` computes them.
//!
//! An optimizer in backward sees gradients one bucket at a time, so the global norm is built from
//! each gradient's norm. Each is taken with optim's `clip_grad_norm_` on that parameter alone (so
//! it is that function's per-gradient norm, bit for bit; the coefficient is clamped to 1, so the
//! gradient is left as it is), then the total and the coefficient follow its rounding: the
//! squares of the f32 norms summed in f64 in parameter order, the square root rounded to f32 (or
//! the largest norm, for inf), and `min(1, (1 / (total + 1e-6)) · max_norm)` in f32. Everything
//! stays on the gradients' device as one-element tensors, so nothing waits for the device. This
//! module knows nothing about buckets or optimizers' rules.

use headroom_autograd_core::{cat, DType, Tensor, TensorError};
use headroom_optim::{clip_grad_norm_, NormType};

use crate::error::HooksError;

/// The norm of `param`'s gradient, as `clip_grad_norm_` measures it: one f32 element.
pub(crate) fn gradient_norm(param: &Tensor, norm: NormType) -> Result<Tensor, HooksError> {
    // A bound no norm reaches: the coefficient is clamped to 1 and the gradient kept.
    Ok(clip_grad_norm_(
        std::slice::from_ref(param),
        f64::from(f32::MAX),
        norm,
        false,
    )?)
}

/// The total norm (one f32 element) from the gradients' norms, given by parameter index.
pub(crate) fn total(norms: &mut [(usize, Tensor)], norm: NormType) -> Result<Tensor, TensorError> {
    norms.sort_by_key(|(index, _)| *index);
    let norms: Vec<&Tensor> = norms.iter().map(|(_, n)| n).collect();
    let all = cat(&norms, 0)?;
    match norm {
        NormType::L2 => {
            let wide = all.to_dtype(DType::F64)?;
            wide.mul(&wide)?
                .sum(&[0], true)?
                .sqrt()?
                .to_dtype(DType::F32)
        }
        NormType::Inf => Ok(all.max_dim(0, true)?.0),
    }
}

/// `min(1, (1 / (total + 1e-6)) · max_norm)` in f32, one element, as PyTorch and optim compute it.
pub(crate) fn clip_coefficient(total: &Tensor, max_norm: f64) -> Result<Tensor, TensorError> {
    let backend = total.backend();
    let constant = |value: f32| Tensor::full(backend, &[1], f64::from(value), DType::F32);
    let shifted = total.add(&constant(1e-6)?)?;
    let coefficient = constant(1.0)?
        .div(&shifted)?
        .mul(&constant(max_norm as f32)?)?;
    let negated = cat(&[&coefficient.neg()?, &constant(-1.0)?], 0)?;
    negated.max_dim(0, true)?.0.neg()
}

/// Multiplies `grad` in place by the one-element f32 `factor` (in f32 for bf16/f16 gradients,
/// rounded once).
pub(crate) fn scale_in_place(grad: &Tensor, factor: &Tensor) -> Result<(), TensorError> {
    if grad.dtype() == DType::F32 {
        grad.mul_(factor)?;
    } else {
        let scaled = grad.to_dtype(DType::F32)?.mul(factor)?;
        grad.copy_(&scaled)?;
    }
    Ok(())
}
