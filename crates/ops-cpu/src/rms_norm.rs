//! Fused RMSNorm (Hugging Face's `LlamaRMSNorm`): forward saves one rstd per row; backward is one
//! pass over the input and the output gradient, the normalised value recomputed from `x` and
//! `rstd`.
//!
//! The rounding is Hugging Face's: rstd is computed in f64 and kept in the stats dtype (f32 for
//! 16- and 32-bit inputs, f64 for f64), the normalised value `x · rstd` is computed in the input's
//! compute type (f32 for f32, f16 and bf16; f64 for f64) and rounded to the input's dtype, then
//! multiplied by the weight and rounded again. Backward computes in f64 and rounds once. Rows are
//! spread over rayon; the weight gradient is summed per chunk of rows, then the chunks added.

use headroom_autograd_core::{Result, RmsNormBackward, RmsNormForward};
use rayon::prelude::*;

use crate::element::{dispatch_float, Float, Real};
use crate::strided::HostPtr;

/// Rows per parallel task in backward (each task keeps its own weight-gradient partial sums).
const ROWS_PER_TASK: usize = 64;

/// A `[n]` parameter as (memory, offset, stride).
fn param<T: Copy>(view: &headroom_autograd_core::View<'_>) -> (HostPtr<T>, usize, usize) {
    (
        HostPtr::new(view),
        view.layout.offset(),
        view.layout.strides().first().copied().unwrap_or(1),
    )
}

/// `x · rstd` in `T`'s compute type, rounded to `T`: the normalised value as Hugging Face's
/// `hidden_states * torch.rsqrt(..)` followed by `.to(input_dtype)` rounds it.
fn normalised<T: Float, S: Float>(x: T, rstd: S) -> T::C {
    let rstd = <T::C as Real>::from_f64(rstd.load().to_f64());
    T::store(x.load() * rstd).load()
}

pub(crate) fn rms_norm(args: RmsNormForward<'_>) -> Result<()> {
    let dims = args.dims()?;
    dispatch_float!(args.x.dtype, "rms_norm", T => dispatch_float!(args.rstd.dtype, "rms_norm", S => forward::<T, S>(args, dims)));
    Ok(())
}

fn forward<T: Float, S: Float>(args: RmsNormForward<'_>, (rows, n): (usize, usize)) {
    let (x, x0) = HostPtr::<T>::with_offset(&args.x);
    let (out, out0) = HostPtr::<T>::with_offset(&args.out);
    let (rstd_ptr, rstd0) = HostPtr::<S>::with_offset(&args.rstd);
    let (w, w0, ws) = param::<T>(&args.weight);
    let eps = args.eps;
    (0..rows).into_par_iter().for_each(|row| {
        let read = |j: usize| x.read(x0 + row * n + j);
        let mean_square = (0..n).map(|j| read(j).load().to_f64().powi(2)).sum::<f64>() / n as f64;
        let rstd = S::store(<S::C as Real>::from_f64(1.0 / (mean_square + eps).sqrt()));
        for j in 0..n {
            let scaled = w.read(w0 + j * ws).load() * normalised::<T, S>(read(j), rstd);
            out.write(out0 + row * n + j, T::store(scaled));
        }
        rstd_ptr.write(rstd0 + row, rstd);
    });
}

pub(crate) fn rms_norm_backward(args: RmsNormBackward<'_>) -> Result<()> {
    let dims = args.dims()?;
    dispatch_float!(args.x.dtype, "rms_norm_backward", T => dispatch_float!(args.rstd.dtype, "rms_norm_backward", S => backward::<T, S>(args, dims)));
    Ok(())
}

fn backward<T: Float, S: Float>(args: RmsNormBackward<'_>, (rows, n): (usize, usize)) {
    let (x, x0) = HostPtr::<T>::with_offset(&args.x);
    let (dy, dy0) = HostPtr::<T>::with_offset(&args.dy);
    let (rstd_ptr, rstd0) = HostPtr::<S>::with_offset(&args.rstd);
    let (w, w0, ws) = param::<T>(&args.weight);
    let dx = args.dx.as_ref().map(HostPtr::<T>::with_offset);
    let wants_weight = args.dweight.is_some();
    let partial = |task: usize| -> Vec<f64> {
        let mut dweight = if wants_weight {
            vec![0.0; n]
        } else {
            Vec::new()
        };
        for row in task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(rows) {
            let rstd = rstd_ptr.read(rstd0 + row);
            let x_at = |j: usize| x.read(x0 + row * n + j);
            let grad = |j: usize| dy.read(dy0 + row * n + j).load().to_f64();
            if wants_weight {
                for (j, acc) in dweight.iter_mut().enumerate() {
                    *acc += grad(j) * normalised::<T, S>(x_at(j), rstd).to_f64();
                }
            }
            if let Some((dx, dx0)) = dx {
                let rstd = rstd.load().to_f64();
                let x_hat = |j: usize| x_at(j).load().to_f64() * rstd;
                let scaled = |j: usize| grad(j) * w.read(w0 + j * ws).load().to_f64();
                let mean_gx = (0..n).map(|j| scaled(j) * x_hat(j)).sum::<f64>() / n as f64;
                for j in 0..n {
                    let value = rstd * (scaled(j) - x_hat(j) * mean_gx);
                    dx.write(dx0 + row * n + j, T::store(<T::C as Real>::from_f64(value)));
                }
            }
        }
        dweight
    };
    let add = |mut lhs: Vec<f64>, rhs: Vec<f64>| {
        if lhs.is_empty() {
            return rhs;
        }
        for (acc, v) in lhs.iter_mut().zip(&rhs) {
            *acc += v;
        }
        lhs
    };
    let dweight = (0..rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(partial)
        .reduce(Vec::new, add);
    if let Some(view) = args.dweight {
        let (ptr, off, stride) = param::<T>(&view);
        for j in 0..n {
            let sum = dweight.get(j).copied().unwrap_or(0.0);
            ptr.write(off + j * stride, T::store(<T::C as Real>::from_f64(sum)));
        }
    }
}
