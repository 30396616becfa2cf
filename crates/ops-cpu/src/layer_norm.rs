//! Fused layer norm: forward saves a mean and an rstd per row; backward is one pass over the
//! input and the output gradient.
//!
//! Rows are independent and spread over rayon; the weight and bias gradients are summed per
//! chunk of rows and the partial sums added at the end. Statistics are computed in f64 and kept
//! in the stats dtype (f32 for 16- and 32-bit inputs, f64 for f64).

use headroom_autograd_core::{LayerNormBackward, LayerNormForward, Result, TensorError, View};
use rayon::prelude::*;

use crate::element::{dispatch_float, Float, Real};
use crate::strided::HostPtr;

/// Rows per parallel task in backward (each task keeps its own weight/bias partial sums).
const ROWS_PER_TASK: usize = 64;

fn rows_and_width(x: &View<'_>) -> Result<(usize, usize)> {
    match *x.layout.shape() {
        [rows, n] if x.layout.is_contiguous() => Ok((rows, n)),
        _ => Err(TensorError::InvalidArgument {
            op: "layer_norm",
            reason: format!(
                "input must be a dense [rows, n] view, got shape {:?}",
                x.layout.shape()
            ),
        }),
    }
}

/// An optional `[n]` parameter as (memory, offset, stride).
fn param<T: Copy>(view: Option<View<'_>>) -> Option<(HostPtr<T>, usize, usize)> {
    view.map(|v| {
        (
            HostPtr::new(&v),
            v.layout.offset(),
            v.layout.strides().first().copied().unwrap_or(1),
        )
    })
}

pub(crate) fn layer_norm(args: LayerNormForward<'_>) -> Result<()> {
    rows_and_width(&args.x)?;
    dispatch_float!(args.x.dtype, "layer_norm", T => dispatch_float!(args.mean.dtype, "layer_norm", S => forward::<T, S>(args)));
    Ok(())
}

fn forward<T: Float, S: Float>(args: LayerNormForward<'_>) {
    let (rows, n) = rows_and_width(&args.x).expect("checked by the caller");
    let (x, out) = (HostPtr::<T>::new(&args.x), HostPtr::<T>::new(&args.out));
    let (x0, out0) = (args.x.layout.offset(), args.out.layout.offset());
    let (mean_ptr, rstd_ptr) = (HostPtr::<S>::new(&args.mean), HostPtr::<S>::new(&args.rstd));
    let (mean0, rstd0) = (args.mean.layout.offset(), args.rstd.layout.offset());
    let (weight, bias) = (param::<T>(args.weight), param::<T>(args.bias));
    let eps = args.eps;
    (0..rows).into_par_iter().for_each(|row| {
        let read = |j: usize| x.read(x0 + row * n + j).load().to_f64();
        let mean = (0..n).map(read).sum::<f64>() / n as f64;
        let var = (0..n).map(|j| (read(j) - mean).powi(2)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for j in 0..n {
            let mut value = (read(j) - mean) * rstd;
            if let Some((w, w0, ws)) = weight {
                value *= w.read(w0 + j * ws).load().to_f64();
            }
            if let Some((b, b0, bs)) = bias {
                value += b.read(b0 + j * bs).load().to_f64();
            }
            out.write(
                out0 + row * n + j,
                T::store(<T::C as Real>::from_f64(value)),
            );
        }
        mean_ptr.write(mean0 + row, S::store(<S::C as Real>::from_f64(mean)));
        rstd_ptr.write(rstd0 + row, S::store(<S::C as Real>::from_f64(rstd)));
    });
}

pub(crate) fn layer_norm_backward(args: LayerNormBackward<'_>) -> Result<()> {
    rows_and_width(&args.x)?;
    dispatch_float!(args.x.dtype, "layer_norm_backward", T => dispatch_float!(args.mean.dtype, "layer_norm_backward", S => backward::<T, S>(args)));
    Ok(())
}

fn backward<T: Float, S: Float>(args: LayerNormBackward<'_>) {
    let (rows, n) = rows_and_width(&args.x).expect("checked by the caller");
    let (x, dy) = (HostPtr::<T>::new(&args.x), HostPtr::<T>::new(&args.dy));
    let (x0, dy0) = (args.x.layout.offset(), args.dy.layout.offset());
    let (mean_ptr, rstd_ptr) = (HostPtr::<S>::new(&args.mean), HostPtr::<S>::new(&args.rstd));
    let (mean0, rstd0) = (args.mean.layout.offset(), args.rstd.layout.offset());
    let weight = param::<T>(args.weight);
    let dx = args.dx.as_ref().map(HostPtr::<T>::with_offset);
    let want_params = args.dweight.is_some() || args.dbias.is_some();
    let n_tasks = rows.div_ceil(ROWS_PER_TASK);
    let partial = |task: usize| -> (Vec<f64>, Vec<f64>) {
        let (mut dweight, mut dbias) = if want_params {
            (vec![0.0; n], vec![0.0; n])
        } else {
            (Vec::new(), Vec::new())
        };
        for row in task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(rows) {
            let mean = mean_ptr.read(mean0 + row).load().to_f64();
            let rstd = rstd_ptr.read(rstd0 + row).load().to_f64();
            let xhat = |j: usize| (x.read(x0 + row * n + j).load().to_f64() - mean) * rstd;
            let grad = |j: usize| dy.read(dy0 + row * n + j).load().to_f64();
            let scaled = |j: usize| match weight {
                Some((w, w0, ws)) => grad(j) * w.read(w0 + j * ws).load().to_f64(),
                None => grad(j),
            };
            if want_params {
                for j in 0..n {
                    dweight[j] += grad(j) * xhat(j);
                    dbias[j] += grad(j);
                }
            }
            if let Some((dx, dx0)) = dx {
                let mean_g = (0..n).map(scaled).sum::<f64>() / n as f64;
                let mean_gx = (0..n).map(|j| scaled(j) * xhat(j)).sum::<f64>() / n as f64;
                for j in 0..n {
                    let value = rstd * (scaled(j) - mean_g - xhat(j) * mean_gx);
                    dx.write(dx0 + row * n + j, T::store(<T::C as Real>::from_f64(value)));
                }
            }
        }
        (dweight, dbias)
    };
    let add = |(mut w1, mut b1): (Vec<f64>, Vec<f64>), (w2, b2): (Vec<f64>, Vec<f64>)| {
        if w1.is_empty() {
            return (w2, b2);
        }
        for (acc, v) in w1.iter_mut().zip(&w2) {
            *acc += v;
        }
        for (acc, v) in b1.iter_mut().zip(&b2) {
            *acc += v;
        }
        (w1, b1)
    };
    let (dweight, dbias) = (0..n_tasks)
        .into_par_iter()
        .map(partial)
        .reduce(|| (Vec::new(), Vec::new()), add);
    for (target, sums) in [(args.dweight, &dweight), (args.dbias, &dbias)] {
        if let Some(view) = target {
            let (ptr, off, stride) = (
                HostPtr::<T>::new(&view),
                view.layout.offset(),
                view.layout.strides().first().copied().unwrap_or(1),
            );
            for j in 0..n {
                ptr.write(
                    off + j * stride,
                    T::store(<T::C as Real>::from_f64(
                        sums.get(j).copied().unwrap_or(0.0),
                    )),
                );
            }
        }
    }
}
