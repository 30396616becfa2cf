//! [`clip_grad_norm`]: PyTorch's `torch.nn.utils.clip_grad_norm_(params, max_norm)` (L2) on the
//! gradients of candle `Var`s in a `GradStore`: each gradient's norm in f32, the norm of those
//! norms, and every gradient multiplied by `max_norm / (total + 1e-6)` when that is under 1, in
//! the gradient's dtype.
//!
//! It sits on candle's tensor ops; it knows nothing of the optimizers.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::CandleOptimError;

/// Clips the gradients of `vars` in `grads` to a total L2 norm of `max_norm` (finite, at least
/// 0), as `clip_grad_norm_` does, and returns the total norm before clipping. `Var`s without a
/// gradient are skipped; with none at all the norm is 0. A non-finite total norm clips nothing
/// and is returned (PyTorch's `error_if_nonfinite=False`).
pub fn clip_grad_norm(
    vars: &[Var],
    grads: &mut GradStore,
    max_norm: f64,
) -> candle_core::Result<f32> {
    if !(max_norm.is_finite() && max_norm >= 0.0) {
        return Err(CandleOptimError::Unsupported {
            optimizer: "clip_grad_norm",
            reason: format!("max_norm must be finite and at least 0, got {max_norm}"),
        }
        .into());
    }
    let mut squares = Vec::new();
    for var in vars {
        if let Some(grad) = grads.get(var.as_tensor()) {
            let norm = grad.to_dtype(DType::F32)?.sqr()?.sum_all()?.sqrt()?;
            squares.push(norm.sqr()?);
        }
    }
    if squares.is_empty() {
        return Ok(0.0);
    }
    let total = Tensor::stack(&squares, 0)?
        .sum_all()?
        .sqrt()?
        .to_scalar::<f32>()?;
    let coef = max_norm as f32 / (total + 1e-6);
    if !(total.is_finite() && coef < 1.0) {
        return Ok(total);
    }
    for var in vars {
        if let Some(grad) = grads.get(var.as_tensor()) {
            let clipped = (grad * f64::from(coef))?;
            grads.insert(var.as_tensor(), clipped);
        }
    }
    Ok(total)
}
