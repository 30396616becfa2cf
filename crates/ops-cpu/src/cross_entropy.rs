//! Fused cross-entropy over the last dim: log-softmax and negative log-likelihood in one pass
//! per row, saving only the row's log-sum-exp for backward.
//!
//! Rows are spread over rayon. Targets equal to `ignore_index` contribute no loss and no
//! gradient, and are not counted by the mean (an all-ignored batch gives NaN, as in PyTorch).
//! Out-of-range targets are an error, never an out-of-bounds read.

use headroom_autograd_core::{
    cross_entropy_tile_dims, CrossEntropyArgs, CrossEntropyBackward, CrossEntropyForward,
    CrossEntropyTile, CrossEntropyTileBackward, DType, LogitTile, Reduction, Result, TensorError,
    View,
};
use rayon::prelude::*;

use crate::element::{dispatch_float, Float, Real};
use crate::strided::HostPtr;

/// Rows, classes, and the targets (validated).
fn validate(args: &CrossEntropyArgs<'_>) -> Result<(usize, usize, Vec<i64>)> {
    let [rows, classes] = *args.logits.layout.shape() else {
        return Err(TensorError::InvalidArgument {
            op: "cross_entropy",
            reason: "logits must be [rows, classes]".into(),
        });
    };
    if !args.logits.layout.is_contiguous() || args.target.layout.shape() != [rows] {
        return Err(TensorError::ShapeMismatch {
            op: "cross_entropy",
            lhs: args.logits.layout.shape().to_vec(),
            rhs: args.target.layout.shape().to_vec(),
        });
    }
    let ptr = HostPtr::<i64>::new(&args.target);
    let stride = args.target.layout.strides()[0];
    let targets: Vec<i64> = (0..rows)
        .map(|r| ptr.read(args.target.layout.offset() + r * stride))
        .collect();
    if let Some(bad) = targets
        .iter()
        .find(|&&t| t != args.ignore_index && (t < 0 || t as usize >= classes))
    {
        return Err(TensorError::InvalidArgument {
            op: "cross_entropy",
            reason: format!("target {bad} is out of bounds for {classes} classes"),
        });
    }
    Ok((rows, classes, targets))
}

pub(crate) fn cross_entropy(forward_args: CrossEntropyForward<'_>) -> Result<()> {
    let CrossEntropyForward {
        input: args,
        loss,
        lse,
    } = forward_args;
    let checked = validate(&args)?;
    check_loss_dtype("cross_entropy", &args, &loss)?;
    let value = dispatch_float!(args.logits.dtype, "cross_entropy", T => dispatch_float!(lse.dtype, "cross_entropy", S => forward::<T, S>(&args, checked, lse)));
    dispatch_float!(loss.dtype, "cross_entropy", L => write_scalar::<L>(&loss, value));
    Ok(())
}

fn write_scalar<L: Float>(view: &View<'_>, value: f64) {
    HostPtr::<L>::new(view).write(
        view.layout.offset(),
        L::store(<L::C as Real>::from_f64(value)),
    );
}

fn read_scalar<L: Float>(view: &View<'_>) -> f64 {
    HostPtr::<L>::new(view)
        .read(view.layout.offset())
        .load()
        .to_f64()
}

/// The loss (or its gradient) has the logits' dtype, or f32 for f16 and bf16 logits.
fn check_loss_dtype(op: &'static str, args: &CrossEntropyArgs<'_>, loss: &View<'_>) -> Result<()> {
    let upcast = matches!(args.logits.dtype, DType::F16 | DType::BF16) && loss.dtype == DType::F32;
    if loss.dtype == args.logits.dtype || upcast {
        Ok(())
    } else {
        Err(TensorError::UnsupportedDtype {
            op,
            dtype: loss.dtype,
        })
    }
}

/// Writes each row's log-sum-exp; returns the reduced loss.
fn forward<T: Float, S: Float>(
    args: &CrossEntropyArgs<'_>,
    (rows, classes, targets): (usize, usize, Vec<i64>),
    lse: View<'_>,
) -> f64 {
    let logits = HostPtr::<T>::new(&args.logits);
    let x0 = args.logits.layout.offset();
    let lse_ptr = HostPtr::<S>::new(&lse);
    let lse0 = lse.layout.offset();
    let per_row: Vec<Option<f64>> = (0..rows)
        .into_par_iter()
        .map(|row| {
            let read = |j: usize| logits.read(x0 + row * classes + j).load().to_f64();
            let max = (0..classes).map(read).fold(f64::NEG_INFINITY, f64::max);
            let log_sum_exp = max
                + (0..classes)
                    .map(|j| (read(j) - max).exp())
                    .sum::<f64>()
                    .ln();
            lse_ptr.write(lse0 + row, S::store(<S::C as Real>::from_f64(log_sum_exp)));
            let target = targets[row];
            (target != args.ignore_index).then(|| log_sum_exp - read(target as usize))
        })
        .collect();
    let total: f64 = per_row.iter().flatten().sum();
    let count = per_row.iter().flatten().count();
    match args.reduction {
        Reduction::Mean => total / count as f64,
        Reduction::Sum => total,
    }
}

pub(crate) fn cross_entropy_backward(backward_args: CrossEntropyBackward<'_>) -> Result<()> {
    let CrossEntropyBackward {
        input: args,
        lse,
        dloss,
        dlogits,
    } = backward_args;
    let checked = validate(&args)?;
    if dlogits.layout.shape() != args.logits.layout.shape() || !dlogits.layout.is_contiguous() {
        return Err(TensorError::ShapeMismatch {
            op: "cross_entropy_backward",
            lhs: args.logits.layout.shape().to_vec(),
            rhs: dlogits.layout.shape().to_vec(),
        });
    }
    check_loss_dtype("cross_entropy_backward", &args, &dloss)?;
    let grad =
        dispatch_float!(dloss.dtype, "cross_entropy_backward", L => read_scalar::<L>(&dloss));
    dispatch_float!(args.logits.dtype, "cross_entropy_backward", T => dispatch_float!(lse.dtype, "cross_entropy_backward", S => backward::<T, S>(&args, checked, lse, grad, dlogits)));
    Ok(())
}

fn backward<T: Float, S: Float>(
    args: &CrossEntropyArgs<'_>,
    (rows, classes, targets): (usize, usize, Vec<i64>),
    lse: View<'_>,
    grad: f64,
    dlogits: View<'_>,
) {
    let logits = HostPtr::<T>::new(&args.logits);
    let x0 = args.logits.layout.offset();
    let lse_ptr = HostPtr::<S>::new(&lse);
    let lse0 = lse.layout.offset();
    let out = HostPtr::<T>::new(&dlogits);
    let out0 = dlogits.layout.offset();
    let count = targets.iter().filter(|&&t| t != args.ignore_index).count();
    let scale = match args.reduction {
        Reduction::Mean => grad / count as f64,
        Reduction::Sum => grad,
    };
    (0..rows).into_par_iter().for_each(|row| {
        let target = targets[row];
        let log_sum_exp = lse_ptr.read(lse0 + row).load().to_f64();
        for j in 0..classes {
            let value = if target == args.ignore_index {
                0.0
            } else {
                let p = (logits.read(x0 + row * classes + j).load().to_f64() - log_sum_exp).exp();
                (p - f64::from(u8::from(j as i64 == target))) * scale
            };
            out.write(
                out0 + row * classes + j,
                T::store(<T::C as Real>::from_f64(value)),
            );
        }
    });
}

/// Each row's target (read once; not validated: a target outside the tile is not in it).
fn read_targets(target: &View<'_>, rows: usize) -> Vec<i64> {
    let ptr = HostPtr::<i64>::new(target);
    let stride = target.layout.strides()[0];
    (0..rows)
        .map(|r| ptr.read(target.layout.offset() + r * stride))
        .collect()
}

/// `target`'s column in a tile of `n` classes from `class_start`, if it is in it.
fn tile_column(target: i64, ignore_index: i64, class_start: usize, n: usize) -> Option<usize> {
    let column = usize::try_from(target).ok()?.checked_sub(class_start)?;
    (target != ignore_index && column < n).then_some(column)
}

/// The tile's shape rule (see [`cross_entropy_tile_dims`]), then its rows, width and targets.
fn checked_tile(
    op: &'static str,
    tile: &LogitTile<'_>,
    per_row: &[&View<'_>],
) -> Result<(usize, usize, Vec<i64>)> {
    let (rows, n) = cross_entropy_tile_dims(op, tile, per_row)?;
    Ok((rows, n, read_targets(&tile.target, rows)))
}

pub(crate) fn cross_entropy_tile(args: CrossEntropyTile<'_>) -> Result<()> {
    let op = "cross_entropy_tile";
    let mut per_row = vec![&args.row_max, &args.row_sum, &args.target_logit];
    per_row.extend(args.logit_sum.as_ref());
    let checked = checked_tile(op, &args.tile, &per_row)?;
    dispatch_float!(args.tile.logits.dtype, op, T => dispatch_float!(args.row_max.dtype, op, S => tile_forward::<T, S>(&args, &checked)));
    Ok(())
}

fn tile_forward<T: Float, S: Float>(
    args: &CrossEntropyTile<'_>,
    (rows, n, targets): &(usize, usize, Vec<i64>),
) {
    let (rows, n, tile) = (*rows, *n, &args.tile);
    let logits = HostPtr::<T>::new(&tile.logits);
    let x0 = tile.logits.layout.offset();
    let (max_ptr, max0) = HostPtr::<S>::with_offset(&args.row_max);
    let (sum_ptr, sum0) = HostPtr::<S>::with_offset(&args.row_sum);
    let (label_ptr, label0) = HostPtr::<S>::with_offset(&args.target_logit);
    let logit_sum = args.logit_sum.as_ref().map(HostPtr::<S>::with_offset);
    let load = |ptr: &HostPtr<S>, at: usize| ptr.read(at).load().to_f64();
    let store = |ptr: &HostPtr<S>, at: usize, value: f64| {
        ptr.write(at, S::store(<S::C as Real>::from_f64(value)));
    };
    (0..rows).into_par_iter().for_each(|row| {
        let read = |j: usize| logits.read(x0 + row * n + j).load().to_f64();
        let tile_max = (0..n).map(read).fold(f64::NEG_INFINITY, f64::max);
        let (old_max, old_sum) = (load(&max_ptr, max0 + row), load(&sum_ptr, sum0 + row));
        let max = old_max.max(tile_max);
        if max > f64::NEG_INFINITY {
            let tile_sum: f64 = (0..n).map(|j| (read(j) - max).exp()).sum();
            store(&max_ptr, max0 + row, max);
            store(
                &sum_ptr,
                sum0 + row,
                old_sum * (old_max - max).exp() + tile_sum,
            );
        }
        if let Some(column) = tile_column(targets[row], tile.ignore_index, tile.class_start, n) {
            store(&label_ptr, label0 + row, read(column));
        }
        if let Some((ptr, at)) = &logit_sum {
            let total: f64 = (0..n).map(read).sum();
            store(ptr, at + row, load(ptr, at + row) + total);
        }
    });
}

pub(crate) fn cross_entropy_tile_backward(args: CrossEntropyTileBackward<'_>) -> Result<()> {
    let op = "cross_entropy_tile_backward";
    let checked = checked_tile(op, &args.tile, &[&args.lse, &args.scale, &args.factor])?;
    dispatch_float!(args.tile.logits.dtype, op, T => dispatch_float!(args.lse.dtype, op, S => tile_backward::<T, S>(&args, &checked)));
    Ok(())
}

fn tile_backward<T: Float, S: Float>(
    args: &CrossEntropyTileBackward<'_>,
    (rows, n, targets): &(usize, usize, Vec<i64>),
) {
    let (rows, n, tile) = (*rows, *n, &args.tile);
    let logits = HostPtr::<T>::new(&tile.logits);
    let x0 = tile.logits.layout.offset();
    let row_value = |view: &View<'_>, row: usize| {
        HostPtr::<S>::new(view)
            .read(view.layout.offset() + row)
            .load()
            .to_f64()
    };
    let uniform = args.smoothing / args.classes as f64;
    (0..rows).into_par_iter().for_each(|row| {
        let lse = row_value(&args.lse, row);
        let scale = row_value(&args.scale, row);
        let factor = row_value(&args.factor, row);
        let hit = tile_column(targets[row], tile.ignore_index, tile.class_start, n);
        for j in 0..n {
            let at = x0 + row * n + j;
            let p = (logits.read(at).load().to_f64() - lse).exp();
            let onehot = if hit == Some(j) {
                1.0 - args.smoothing
            } else {
                0.0
            };
            let value = p * scale - factor * (uniform + onehot);
            logits.write(at, T::store(<T::C as Real>::from_f64(value)));
        }
    });
}
