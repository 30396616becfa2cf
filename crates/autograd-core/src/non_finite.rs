//! Whether any element of many tensors is NaN or infinite, answered on the tensors' device.
//!
//! A GradScaler must skip a step whose gradients overflowed without reading them back to the
//! host: a host synchronisation per step would stall the launch queue. [`non_finite_check_`]
//! leaves its answer in a one-element f32 tensor (`found_inf`, PyTorch's name) on the device,
//! which fused optimizer kernels and the scaler's update then read there. It is composed of the
//! backend's primitives: per tensor, its max and min into one slot each of a scratch vector
//! (a finite tensor has finite extremes; an infinity is an extreme, and both backends' max and min
//! propagate NaN); then the slots times zero, summed (0, or NaN when any slot was not finite),
//! folded into the flag by comparisons. So two reductions per tensor and a handful of one-element
//! ops per dtype, and little memory: two elements per tensor, and one partial per row of a large
//! tensor, which is reduced as rows of [`ROW_LEN`] elements and then across the rows (a backend
//! reduces one row per block, so a whole multi-million-element gradient reduced as one row would
//! run on one block). A backend with a multi-tensor
//! kernel of its own can do the same in one pass (headroom-optim's
//! `non_finite_check_and_unscale_` does on CUDA, and falls back to this function elsewhere); this
//! is the portable form. This module knows no kernel and no device.

use std::sync::Arc;

use crate::backend::{BinaryOp, ReduceOp, UnaryOp};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Sets `found_inf` (one f32 element, on the tensors' device) to 1 when any element of `tensors`
/// is NaN or ±infinity, and leaves it as it was otherwise, so calls accumulate (as PyTorch's
/// `_amp_foreach_non_finite_check_and_unscale_` does). Nothing is read back to the host.
/// Tensors may be of any floating-point dtype, strided, and empty.
pub fn non_finite_check_(tensors: &[&Tensor], found_inf: &Tensor) -> Result<()> {
    let op = "non_finite_check_";
    if found_inf.dtype() != DType::F32 || found_inf.numel() != 1 {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "found_inf must be one f32 element, got {:?} of shape {:?}",
                found_inf.dtype(),
                found_inf.shape()
            ),
        });
    }
    for tensor in tensors {
        if tensor.device() != found_inf.device() {
            return Err(TensorError::DeviceMismatch {
                op,
                lhs: found_inf.device(),
                rhs: tensor.device(),
            });
        }
        if !tensor.dtype().is_float() {
            return Err(TensorError::UnsupportedDtype {
                op,
                dtype: tensor.dtype(),
            });
        }
    }
    let _guard = no_grad();
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let group: Vec<&Tensor> = tensors
            .iter()
            .copied()
            .filter(|t| t.dtype() == dtype && t.numel() > 0)
            .collect();
        if !group.is_empty() {
            fold_group(&group, dtype, found_inf)?;
        }
    }
    Ok(())
}

/// A new flag: 1.0 when any element of `tensors` (on `like`'s device) is NaN or ±infinity, else
/// 0.0, as a one-element f32 tensor on that device.
pub fn found_non_finite(tensors: &[&Tensor], like: &Tensor) -> Result<Tensor> {
    let found_inf = Tensor::zeros(like.backend(), &[1], DType::F32)?;
    non_finite_check_(tensors, &found_inf)?;
    Ok(found_inf)
}

/// Elements per row when a large tensor is reduced in two stages.
const ROW_LEN: usize = 4096;

/// Tensors of at least this many elements are reduced in two stages.
const SPLIT_FROM: usize = 1 << 15;

/// The max or min (`op`) of every element of `tensor` into the one-element view `out`: directly,
/// or for a large contiguous tensor as rows of [`ROW_LEN`] (and its tail) into partials, then
/// across them.
fn reduce_extreme(tensor: &Tensor, op: ReduceOp, out: &Tensor) -> Result<()> {
    let backend = out.backend();
    let n = tensor.numel();
    if n < SPLIT_FROM || !tensor.is_contiguous() {
        return backend.reduce(op, tensor.view(), tensor.ndim(), out.view());
    }
    let flat = tensor.reshape(&[n])?;
    let (rows, tail) = (n / ROW_LEN, n % ROW_LEN);
    let partials = Tensor::empty(backend, &[rows + usize::from(tail > 0)], tensor.dtype())?;
    let body = flat
        .narrow(0, 0, rows * ROW_LEN)?
        .reshape(&[rows, ROW_LEN])?;
    backend.reduce(op, body.view(), 1, partials.narrow(0, 0, rows)?.view())?;
    if tail > 0 {
        let last = partials.narrow(0, rows, 1)?.reshape(&[])?;
        backend.reduce(
            op,
            flat.narrow(0, rows * ROW_LEN, tail)?.view(),
            1,
            last.view(),
        )?;
    }
    backend.reduce(op, partials.view(), 1, out.view())
}

/// Folds the tensors of one dtype into the flag.
fn fold_group(group: &[&Tensor], dtype: DType, found_inf: &Tensor) -> Result<()> {
    let backend = found_inf.backend();
    let extremes = Tensor::empty(backend, &[2 * group.len()], dtype)?;
    for (idx, tensor) in group.iter().enumerate() {
        for (slot, op) in [(2 * idx, ReduceOp::Max), (2 * idx + 1, ReduceOp::Min)] {
            let out = Tensor::from_parts(
                Arc::clone(extremes.buffer()),
                Layout::from_parts(&[], &[], slot)?,
                dtype,
                false,
            );
            reduce_extreme(tensor, op, &out)?;
        }
    }
    // 0 when every extreme is finite, NaN otherwise (0 · ±inf and 0 · NaN are NaN).
    let zeros_or_nan = extremes.unary_raw(UnaryOp::MulScalar(0.0), "non_finite_check_")?;
    let flat_sum = Tensor::empty(backend, &[], dtype)?;
    backend.reduce(ReduceOp::Sum, zeros_or_nan.view(), 1, flat_sum.view())?;
    let verdict = flat_sum.to_dtype_contiguous_copy(DType::F32)?;
    // a = verdict + found_inf: NaN, or the flag's 0 or 1. Then 1 - [0.5 - a > 0] maps NaN and 1
    // to 1, and 0 to 0 (a comparison with NaN is false).
    let flag = found_inf.reshape(&[])?;
    let sum = verdict.binary_raw(BinaryOp::Add, &flag, "non_finite_check_")?;
    let margin = sum
        .unary_raw(UnaryOp::Neg, "non_finite_check_")?
        .unary_raw(UnaryOp::AddScalar(0.5), "non_finite_check_")?;
    let ones = Tensor::ones(backend, &[], DType::F32)?;
    let stays_clear = ones.binary_raw(BinaryOp::ReluBackward, &margin, "non_finite_check_")?;
    let found = stays_clear
        .unary_raw(UnaryOp::Neg, "non_finite_check_")?
        .unary_raw(UnaryOp::AddScalar(1.0), "non_finite_check_")?;
    backend.copy(found.view(), flag.view())?;
    found_inf.buffer().bump_version();
    Ok(())
}
