//! Reduction kernels: sum, mean, max and min over trailing dims, and max/min with indices.
//!
//! Output elements are independent, so they are computed in parallel; each one walks its
//! reduced elements serially and accumulates in f64 (more accurate than PyTorch's f32 cascade
//! for f32 inputs, identical order for f64 within rounding). Nothing here allocates.

use headroom_autograd_core::{ReduceOp, ReduceWithIndex, Result, TensorError, View};

use crate::element::{dispatch_float, Float, Real};
use crate::strided::{for_each_run_serial, for_each_run_weighted, HostPtr};

/// Outer shape, outer strides, reduced shape, reduced strides.
type SplitDims<'a> = (&'a [usize], &'a [usize], &'a [usize], &'a [usize]);

fn split_dims<'a>(x: &View<'a>, n_reduced: usize, op: &'static str) -> Result<SplitDims<'a>> {
    let ndim = x.layout.ndim();
    if n_reduced > ndim {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "cannot reduce {n_reduced} dims of shape {:?}",
                x.layout.shape()
            ),
        });
    }
    let (outer_shape, inner_shape) = x.layout.shape().split_at(ndim - n_reduced);
    let (outer_strides, inner_strides) = x.layout.strides().split_at(ndim - n_reduced);
    Ok((outer_shape, outer_strides, inner_shape, inner_strides))
}

/// Reduces the last `n_reduced` dims of `x` into dense `out`.
pub(crate) fn reduce(op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()> {
    let (outer_shape, _, _, _) = split_dims(&x, n_reduced, "reduce")?;
    if out.layout.shape() != outer_shape {
        return Err(TensorError::ShapeMismatch {
            op: "reduce",
            lhs: x.layout.shape().to_vec(),
            rhs: out.layout.shape().to_vec(),
        });
    }
    dispatch_float!(x.dtype, "reduce", T => reduce_typed::<T>(op, x, n_reduced, out)?);
    Ok(())
}

fn reduce_typed<T: Float>(
    op: ReduceOp,
    x: View<'_>,
    n_reduced: usize,
    out: View<'_>,
) -> Result<()> {
    let (_, outer_strides, inner_shape, inner_strides) = split_dims(&x, n_reduced, "reduce")?;
    let count: usize = inner_shape.iter().product();
    if count == 0 && matches!(op, ReduceOp::Max | ReduceOp::Min) {
        return Err(TensorError::InvalidArgument {
            op: "reduce",
            reason: "max/min of an empty dim".into(),
        });
    }
    let (from, to) = (HostPtr::<T>::new(&x), HostPtr::<T>::new(&out));
    for_each_run_weighted(
        out.layout.shape(),
        [out.layout.strides(), outer_strides],
        [out.layout.offset(), x.layout.offset()],
        count,
        |o, s, len| {
            for i in 0..len {
                let mut acc = match op {
                    ReduceOp::Sum | ReduceOp::Mean => 0.0,
                    ReduceOp::Max => f64::NEG_INFINITY,
                    ReduceOp::Min => f64::INFINITY,
                };
                for_each_run_serial(
                    inner_shape,
                    [inner_strides],
                    [o[1] + i * s[1]],
                    |b, t, n| {
                        let mut value = acc;
                        for j in 0..n {
                            let v = from.read(b[0] + j * t[0]).load().to_f64();
                            value = match op {
                                ReduceOp::Sum | ReduceOp::Mean => value + v,
                                ReduceOp::Max if v > value || v.is_nan() => v,
                                ReduceOp::Min if v < value || v.is_nan() => v,
                                _ => value,
                            };
                        }
                        acc = value;
                    },
                );
                let value = match op {
                    ReduceOp::Mean => acc / count as f64,
                    _ => acc,
                };
                to.write(o[0] + i * s[0], T::store(<T::C as Real>::from_f64(value)));
            }
        },
    );
    Ok(())
}

/// Max or min over the last dim with the index of the first extreme element.
pub(crate) fn reduce_with_index(args: ReduceWithIndex<'_>) -> Result<()> {
    let ReduceWithIndex {
        op,
        x,
        values,
        indices,
    } = args;
    if !matches!(op, ReduceOp::Max | ReduceOp::Min) {
        return Err(TensorError::InvalidArgument {
            op: "reduce_with_index",
            reason: format!("{op:?} has no index"),
        });
    }
    let (outer_shape, _, inner_shape, _) = split_dims(&x, 1, "reduce_with_index")?;
    if values.layout.shape() != outer_shape
        || indices.layout.shape() != outer_shape
        || inner_shape[0] == 0
    {
        return Err(TensorError::ShapeMismatch {
            op: "reduce_with_index",
            lhs: x.layout.shape().to_vec(),
            rhs: values.layout.shape().to_vec(),
        });
    }
    dispatch_float!(x.dtype, "reduce_with_index", T => arg_reduce_typed::<T>(op == ReduceOp::Max, x, values, indices));
    Ok(())
}

fn arg_reduce_typed<T: Float>(is_max: bool, x: View<'_>, values: View<'_>, indices: View<'_>) {
    let ndim = x.layout.ndim();
    let (outer_strides, lane_stride, lane_len) = (
        &x.layout.strides()[..ndim - 1],
        x.layout.strides()[ndim - 1],
        x.layout.shape()[ndim - 1],
    );
    let (from, to, at) = (
        HostPtr::<T>::new(&x),
        HostPtr::<T>::new(&values),
        HostPtr::<i64>::new(&indices),
    );
    for_each_run_weighted(
        values.layout.shape(),
        [
            values.layout.strides(),
            indices.layout.strides(),
            outer_strides,
        ],
        [
            values.layout.offset(),
            indices.layout.offset(),
            x.layout.offset(),
        ],
        lane_len,
        |o, s, len| {
            for i in 0..len {
                let base = o[2] + i * s[2];
                let (mut best, mut best_idx) = (from.read(base).load(), 0usize);
                for j in 1..lane_len {
                    let v = from.read(base + j * lane_stride).load();
                    let better = if is_max { v > best } else { v < best };
                    if !(best.to_f64().is_nan()) && (better || v.to_f64().is_nan()) {
                        best = v;
                        best_idx = j;
                    }
                }
                to.write(o[0] + i * s[0], T::store(best));
                at.write(o[1] + i * s[1], best_idx as i64);
            }
        },
    );
}
