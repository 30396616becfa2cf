//! Softmax and log-softmax along any dim, forward and backward, one lane at a time.
//!
//! A lane is the run of elements along the softmax dim; lanes are independent and spread over
//! rayon. Each lane is read twice and written once (max, then sum of exponentials and the
//! output), with sums in f64. Nothing here allocates.

use headroom_autograd_core::{Result, SoftmaxBackward, TensorError, View};

use crate::element::{dispatch_float, Float, Real};
use crate::strided::{for_each_run_weighted, HostPtr};

/// Shape and per-operand strides with `dim` removed, and each operand's stride along `dim`.
fn lanes<const N: usize>(
    views: [&View<'_>; N],
    dim: usize,
) -> (Vec<usize>, [Vec<usize>; N], [usize; N]) {
    let mut shape = views[0].layout.shape().to_vec();
    shape.remove(dim);
    let strides = std::array::from_fn(|k| {
        let mut res = views[k].layout.strides().to_vec();
        res.remove(dim);
        res
    });
    (
        shape,
        strides,
        std::array::from_fn(|k| views[k].layout.strides()[dim]),
    )
}

fn check(op: &'static str, views: &[&View<'_>], dim: usize) -> Result<()> {
    let first = views[0];
    for view in views {
        if view.layout.shape() != first.layout.shape() {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: first.layout.shape().to_vec(),
                rhs: view.layout.shape().to_vec(),
            });
        }
        if view.dtype != first.dtype {
            return Err(TensorError::DtypeMismatch {
                op,
                lhs: first.dtype,
                rhs: view.dtype,
            });
        }
    }
    if dim >= first.layout.ndim() {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!("dim {dim} of shape {:?}", first.layout.shape()),
        });
    }
    Ok(())
}

/// Softmax (or log-softmax) of `x` along `dim` into `out`.
pub(crate) fn softmax(x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()> {
    check("softmax", &[&x, &out], dim)?;
    dispatch_float!(x.dtype, "softmax", T => softmax_typed::<T>(x, dim, log, out));
    Ok(())
}

fn softmax_typed<T: Float>(x: View<'_>, dim: usize, log: bool, out: View<'_>) {
    let (shape, strides, lane) = lanes([&out, &x], dim);
    let len = x.layout.shape()[dim];
    let (from, to) = (HostPtr::<T>::new(&x), HostPtr::<T>::new(&out));
    for_each_run_weighted(
        &shape,
        [&strides[0], &strides[1]],
        [out.layout.offset(), x.layout.offset()],
        len,
        |o, s, n| {
            for i in 0..n {
                let (ob, xb) = (o[0] + i * s[0], o[1] + i * s[1]);
                from.check_run(xb, lane[1], len);
                to.check_run(ob, lane[0], len);
                // SAFETY: both lanes were checked above and every `j < len`.
                let read = |j: usize| unsafe { from.read_in_run(xb, lane[1], j) }.load().to_f64();
                let max = (0..len).map(read).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = (0..len).map(|j| (read(j) - max).exp()).sum();
                let log_sum = sum.ln();
                for j in 0..len {
                    let shifted = read(j) - max;
                    let value = if log {
                        shifted - log_sum
                    } else {
                        shifted.exp() / sum
                    };
                    let value = T::store(<T::C as Real>::from_f64(value));
                    // SAFETY: the lane was checked above and `j < len`.
                    unsafe { to.write_in_run(ob, lane[0], j, value) };
                }
            }
        },
    );
}

/// Gradient of softmax (or log-softmax) from the output `y` and its gradient `dy`.
pub(crate) fn softmax_backward(args: SoftmaxBackward<'_>) -> Result<()> {
    let SoftmaxBackward { y, dy, dx, .. } = args;
    let (dim, log) = (args.dim, args.log);
    check("softmax_backward", &[&y, &dy, &dx], dim)?;
    dispatch_float!(y.dtype, "softmax_backward", T => softmax_backward_typed::<T>(y, dy, dim, log, dx));
    Ok(())
}

fn softmax_backward_typed<T: Float>(
    y: View<'_>,
    dy: View<'_>,
    dim: usize,
    log: bool,
    dx: View<'_>,
) {
    let (shape, strides, lane) = lanes([&dx, &y, &dy], dim);
    let len = y.layout.shape()[dim];
    let (out, grad, to) = (
        HostPtr::<T>::new(&y),
        HostPtr::<T>::new(&dy),
        HostPtr::<T>::new(&dx),
    );
    let offsets = [dx.layout.offset(), y.layout.offset(), dy.layout.offset()];
    for_each_run_weighted(
        &shape,
        [&strides[0], &strides[1], &strides[2]],
        offsets,
        len,
        |o, s, n| {
            for i in 0..n {
                let (db, yb, gb) = (o[0] + i * s[0], o[1] + i * s[1], o[2] + i * s[2]);
                to.check_run(db, lane[0], len);
                out.check_run(yb, lane[1], len);
                grad.check_run(gb, lane[2], len);
                let read = |j: usize| {
                    // SAFETY: the lanes were checked above and every `j < len`.
                    unsafe {
                        (
                            out.read_in_run(yb, lane[1], j).load().to_f64(),
                            grad.read_in_run(gb, lane[2], j).load().to_f64(),
                        )
                    }
                };
                let dot: f64 = (0..len)
                    .map(|j| {
                        let (yv, gv) = read(j);
                        if log {
                            gv
                        } else {
                            gv * yv
                        }
                    })
                    .sum();
                for j in 0..len {
                    let (yv, gv) = read(j);
                    let value = if log {
                        gv - yv.exp() * dot
                    } else {
                        yv * (gv - dot)
                    };
                    let value = T::store(<T::C as Real>::from_f64(value));
                    // SAFETY: the lane was checked above and `j < len`.
                    unsafe { to.write_in_run(db, lane[0], j, value) };
                }
            }
        },
    );
}
