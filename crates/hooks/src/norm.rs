//! Gradient norms and clipping coefficients as device tensors, for clipping inside backward.
//!
//! An optimizer in backward sees gradients one bucket at a time, so the global norm is built from
//! per-gradient parts: the sum of squares (L2) or the largest magnitude (inf) of each gradient,
//! in f32, then folded into the total and the clipping coefficient `min(1, max_norm / (total +
//! 1e-6))` — `torch.nn.utils.clip_grad_norm_`'s formula. Everything stays on the gradients'
//! device (one-element tensors), so nothing waits for the device. This module knows nothing
//! about buckets or optimizers.

use headroom_autograd_core::{cat, DType, Tensor, TensorError};

/// Which norm clips: PyTorch's `norm_type` 2 or inf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormType {
    /// The Euclidean norm.
    L2,
    /// The largest magnitude.
    Inf,
}

/// One gradient's part of the norm: its sum of squares (L2) or largest magnitude (inf), as a
/// one-element f32 tensor.
pub(crate) fn partial(grad: &Tensor, norm: NormType) -> Result<Tensor, TensorError> {
    let flat = grad.to_dtype(DType::F32)?.reshape(&[grad.numel()])?;
    match norm {
        NormType::L2 => flat.mul(&flat)?.sum(&[0], true),
        NormType::Inf => {
            let largest = flat.max_dim(0, true)?.0;
            let smallest = flat.neg()?.max_dim(0, true)?.0;
            Ok(cat(&[&largest, &smallest], 0)?.max_dim(0, true)?.0)
        }
    }
}

/// The total norm (one f32 element) from the parts of every gradient.
pub(crate) fn total(parts: &[Tensor], norm: NormType) -> Result<Tensor, TensorError> {
    let parts: Vec<&Tensor> = parts.iter().collect();
    let all = cat(&parts, 0)?;
    match norm {
        NormType::L2 => all.sum(&[0], true)?.sqrt(),
        NormType::Inf => Ok(all.max_dim(0, true)?.0),
    }
}

/// `min(1, max_norm / (total + 1e-6))`, one f32 element.
pub(crate) fn clip_coefficient(total: &Tensor, max_norm: f64) -> Result<Tensor, TensorError> {
    let backend = total.backend();
    let coefficient =
        Tensor::full(backend, &[1], max_norm, DType::F32)?.div(&total.add_scalar(1e-6)?)?;
    let minus_one = Tensor::full(backend, &[1], -1.0, DType::F32)?;
    let negated = cat(&[&coefficient.neg()?, &minus_one], 0)?;
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
