//! Gradient clipping on the host: the norms of host gradients (f64 sums in fixed blocks, so the
//! result does not depend on the number of threads), their scaling and clamping, each element
//! rounded once to the gradient's type.
//!
//! It sits on the gradients' memory as slices (`host.rs`, checked by the caller: CPU, contiguous,
//! disjoint, f32/bf16/f16) and on what a clip is (`norm.rs`); `device.rs` calls it.

use headroom_autograd_core::{DType, Element, Tensor};
use rayon::prelude::*;

use super::norm::{clip_coef, NormClip, NormType};
use crate::error::OptimError;
use crate::host::{host_slice, host_slice_mut};
use crate::kernels::{bf16, f16, ParamElement};

/// Elements per partial reduction of a gradient's norm on the host (and per task of the host's
/// element-wise passes); partial results combine in order, so the norm does not depend on the
/// number of threads.
const NORM_BLOCK: usize = 1 << 15;

/// `clip_grad_norm_` on host gradients (checked: CPU, contiguous, disjoint, f32/bf16/f16).
pub(crate) fn host_norm(grads: &[Tensor], clip: NormClip) -> Result<Tensor, OptimError> {
    // The norm of the norms: squares of the f32 norms summed in f64 (norm 2), or their maximum.
    let mut acc = 0.0f64;
    for grad in grads {
        let norm = on_elements(grad, Norm(clip.norm_type));
        acc = match clip.norm_type {
            NormType::L2 => acc + f64::from(norm) * f64::from(norm),
            NormType::Inf => max_nan(acc, f64::from(norm)),
        };
    }
    let total = match clip.norm_type {
        NormType::L2 => acc.sqrt() as f32,
        NormType::Inf => acc as f32,
    };
    if clip.rejects(total) {
        return Err(OptimError::NonFiniteNorm {
            norm_type: clip.norm_type,
            total,
        });
    }
    let coef = clip_coef(clip.max_norm, total);
    for grad in grads {
        on_elements(grad, Scale(coef));
    }
    Ok(Tensor::from_slice(grads[0].backend(), &[total], &[1])?)
}

/// `clip_grad_value_` on host gradients (checked as for [`host_norm`]).
pub(crate) fn host_value(grads: &[Tensor], clip_value: f32) -> Result<(), OptimError> {
    for grad in grads {
        on_elements(grad, Clamp(clip_value));
    }
    Ok(())
}

/// An operation on one host gradient's elements, for each element type.
trait ElementOp {
    type Output;
    /// Runs on `grad`, a checked host tensor of `T` that nothing else reads or writes meanwhile.
    fn run<T: ParamElement + Element>(self, grad: &Tensor) -> Self::Output;
}

/// `op` on `grad`'s elements, of its type.
fn on_elements<O: ElementOp>(grad: &Tensor, op: O) -> O::Output {
    match grad.dtype() {
        DType::BF16 => op.run::<bf16>(grad),
        DType::F16 => op.run::<f16>(grad),
        _ => op.run::<f32>(grad),
    }
}

/// A gradient's norm, rounded to f32 (PyTorch's CPU `vector_norm` sums in f64).
struct Norm(NormType);

impl ElementOp for Norm {
    type Output = f32;

    fn run<T: ParamElement + Element>(self, grad: &Tensor) -> f32 {
        // SAFETY: a checked CPU tensor of `T`; clipping reads it on these threads only.
        let values = unsafe { host_slice::<T>(grad) };
        let norm_type = self.0;
        let block = |chunk: &[T]| -> f64 {
            chunk.iter().fold(0.0, |acc, x| {
                let v = f64::from(x.to_f32());
                match norm_type {
                    NormType::L2 => v.mul_add(v, acc),
                    NormType::Inf => max_nan(acc, v.abs()),
                }
            })
        };
        let partials: Vec<f64> = if values.len() < 2 * NORM_BLOCK {
            values.chunks(NORM_BLOCK).map(block).collect()
        } else {
            values.par_chunks(NORM_BLOCK).map(block).collect()
        };
        match norm_type {
            NormType::L2 => partials.iter().sum::<f64>().sqrt() as f32,
            NormType::Inf => partials.into_iter().fold(0.0, max_nan) as f32,
        }
    }
}

/// Every element times the coefficient, rounded once to the gradient's type.
struct Scale(f32);

impl ElementOp for Scale {
    type Output = ();

    fn run<T: ParamElement + Element>(self, grad: &Tensor) {
        // SAFETY: a checked CPU tensor of `T`, disjoint from the other gradients; nothing else
        // reads or writes it during the clip.
        let values = unsafe { host_slice_mut::<T>(grad) };
        let coef = self.0;
        for_each_block(values, &|x: f32| x * coef);
    }
}

/// Every element clamped to the bound and its negative, both rounded to the gradient's type.
struct Clamp(f32);

impl ElementOp for Clamp {
    type Output = ();

    fn run<T: ParamElement + Element>(self, grad: &Tensor) {
        // SAFETY: as for `Scale`.
        let values = unsafe { host_slice_mut::<T>(grad) };
        let (lo, hi) = (T::from_f32(-self.0).to_f32(), T::from_f32(self.0).to_f32());
        for_each_block(values, &|x: f32| {
            if x.is_nan() {
                x
            } else {
                x.max(lo).min(hi)
            }
        });
    }
}

/// `values[i] = f(values[i])` in f32, each result rounded once to `T`, on the calling thread for
/// a small gradient and in blocks of [`NORM_BLOCK`] on rayon's threads for a large one.
fn for_each_block<T: ParamElement>(values: &mut [T], f: &(dyn Fn(f32) -> f32 + Sync)) {
    let block = |chunk: &mut [T]| {
        chunk
            .iter_mut()
            .for_each(|x| *x = T::from_f32(f(x.to_f32())))
    };
    if values.len() < 2 * NORM_BLOCK {
        block(values);
    } else {
        values.par_chunks_mut(NORM_BLOCK).for_each(block);
    }
}

/// The larger of two magnitudes, NaN from either side (torch's max reduction propagates NaN).
fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}
