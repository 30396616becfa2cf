//! Gradient clipping over the gradients of autograd-core parameters, with PyTorch 2.11's
//! semantics: [`clip_grad_norm_`] (`torch.nn.utils.clip_grad_norm_`, norms 2 and inf) and
//! [`clip_grad_value_`] (`torch.nn.utils.clip_grad_value_`), on the CPU or, with the `cuda`
//! feature, on a CUDA device.
//!
//! Both take the `.grad` of each parameter that has one; the gradients must be contiguous f32,
//! bf16 or f16 tensors of one device (typed errors otherwise). Arithmetic is f32, and a bf16 or
//! f16 gradient is rounded once when it is written back. The total norm follows PyTorch's CPU
//! path: each gradient's norm (its squares summed in f64, in fixed blocks of 32 Ki
//! elements combined in order), rounded to f32, then the norm of those norms (their
//! squares summed in f64) rounded to f32; for norm inf, the largest magnitude (NaN propagates).
//! The coefficient is `max_norm / (total_norm + 1e-6)` as PyTorch computes it in f32 (the
//! reciprocal of the sum, times `max_norm`), clamped to at most 1, and every gradient is
//! multiplied by it — also when it is 1, as PyTorch does.
//!
//! This file holds the checks every device shares and the host side (the gradients' memory as
//! slices, `host.rs`); [`StepDevice`] picks the host or the CUDA side (`cuda/clip.rs`, three
//! launches for any number of tensors: partial reductions, a finishing kernel that leaves the
//! total and the coefficient in device memory, the scaling — no host synchronisation unless
//! `error_if_nonfinite` asks for the norm). It knows no optimizer.

use headroom_autograd_core::{DType, Element, Tensor};
use rayon::prelude::*;

use crate::device::StepDevice;
use crate::error::OptimError;
use crate::host::{check_disjoint, host_slice, host_slice_mut};
use crate::kernels::{bf16, f16, ParamElement};

/// Elements per partial reduction of a gradient's norm on the host (and per task of the host's
/// element-wise passes); partial results combine in order, so the norm does not depend on the
/// number of threads.
const NORM_BLOCK: usize = 1 << 15;

/// The norm [`clip_grad_norm_`] measures gradients with (PyTorch's `norm_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormType {
    /// The Euclidean norm (`norm_type=2`).
    L2,
    /// The largest magnitude (`norm_type=inf`).
    Inf,
}

/// What a clip of the total norm needs once its arguments are checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NormClip {
    /// `max_norm` as the f32 PyTorch multiplies with.
    pub(crate) max_norm: f32,
    pub(crate) norm_type: NormType,
    pub(crate) error_if_nonfinite: bool,
}

/// Scales the gradients of `params` so that their total norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)` does, and
/// returns the total norm before clipping: a one-element f32 tensor on the gradients' device
/// (a zero when no parameter has a gradient).
///
/// With `error_if_nonfinite`, a NaN or infinite total norm is an [`OptimError::NonFiniteNorm`]
/// and no gradient changes; on CUDA that one check reads the norm (a host synchronisation),
/// otherwise nothing waits for the device. Errors: no parameters, a negative or non-finite
/// `max_norm`,
/// gradients on different devices, of another dtype than f32, bf16 and f16, non-contiguous, or
/// sharing memory.
///
/// ```
/// use headroom_autograd_core::Tensor;
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{clip_grad_norm_, NormType};
///
/// let cpu = CpuBackend::new_ref();
/// let (a, b) = (
///     Tensor::from_slice(&cpu, &[0.0f32, 0.0], &[2])?,
///     Tensor::from_slice(&cpu, &[0.0f32], &[1])?,
/// );
/// a.set_grad(Some(Tensor::from_slice(&cpu, &[3.0f32, 0.0], &[2])?))?;
/// b.set_grad(Some(Tensor::from_slice(&cpu, &[4.0f32], &[1])?))?;
/// // The total norm is 5: clipping to 1 scales every gradient by about 1/5.
/// let total = clip_grad_norm_(&[a.clone(), b.clone()], 1.0, NormType::L2, false)?;
/// assert_eq!(total.to_vec::<f32>()?, [5.0]);
/// let clipped = b.grad().unwrap().to_vec::<f32>()?[0];
/// assert!((clipped - 0.8).abs() < 1e-6);
/// // Under the bound nothing moves (the coefficient is clamped to 1).
/// let total = clip_grad_norm_(&[a.clone(), b.clone()], 10.0, NormType::Inf, false)?;
/// assert!((total.to_vec::<f32>()?[0] - 0.8).abs() < 1e-6);
/// assert_eq!(b.grad().unwrap().to_vec::<f32>()?, [clipped]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn clip_grad_norm_(
    params: &[Tensor],
    max_norm: f64,
    norm_type: NormType,
    error_if_nonfinite: bool,
) -> Result<Tensor, OptimError> {
    const OP: &str = "clip_grad_norm_";
    if !(max_norm.is_finite() && max_norm >= 0.0) {
        return Err(OptimError::InvalidArgument {
            op: OP,
            reason: format!(
                "max_norm must be finite and at least 0, got {max_norm} (a negative bound would \
                 flip every gradient's sign)"
            ),
        });
    }
    let Some((mut device, grads)) = gradients(OP, params)? else {
        let backend = params[0].backend();
        return Ok(Tensor::zeros(backend, &[1], DType::F32)?);
    };
    let clip = NormClip {
        max_norm: max_norm as f32,
        norm_type,
        error_if_nonfinite,
    };
    device.clip_norm(&grads, clip)
}

/// Clamps every element of the gradients of `params` to `[-clip_value, clip_value]` in place,
/// as `torch.nn.utils.clip_grad_value_(params, clip_value)` does (NaN stays NaN; for bf16 and
/// f16 gradients the bounds are rounded to their type first, as PyTorch rounds a clamp's
/// bounds). Errors: no parameters, a negative or NaN `clip_value`, and the gradients' errors of
/// [`clip_grad_norm_`].
///
/// ```
/// use headroom_autograd_core::Tensor;
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::clip_grad_value_;
///
/// let cpu = CpuBackend::new_ref();
/// let param = Tensor::from_slice(&cpu, &[0.0f32; 3], &[3])?;
/// param.set_grad(Some(Tensor::from_slice(&cpu, &[-2.0f32, 0.25, 3.0], &[3])?))?;
/// clip_grad_value_(&[param.clone()], 0.5)?;
/// assert_eq!(param.grad().unwrap().to_vec::<f32>()?, [-0.5, 0.25, 0.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn clip_grad_value_(params: &[Tensor], clip_value: f64) -> Result<(), OptimError> {
    const OP: &str = "clip_grad_value_";
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(OptimError::InvalidArgument {
            op: OP,
            reason: format!("clip_value {clip_value} (a non-negative bound)"),
        });
    }
    match gradients(OP, params)? {
        Some((mut device, grads)) => device.clip_value(&grads, clip_value as f32),
        None => Ok(()),
    }
}

/// The gradients of `params` that have one, checked, with the device they are on; `None` when
/// no parameter has a gradient.
fn gradients(
    op: &'static str,
    params: &[Tensor],
) -> Result<Option<(StepDevice, Vec<Tensor>)>, OptimError> {
    if params.is_empty() {
        return Err(OptimError::InvalidArgument {
            op,
            reason: "no parameters".into(),
        });
    }
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    let Some(first) = grads.first() else {
        return Ok(None);
    };
    let device = StepDevice::of(op, first, 0)?;
    for grad in &grads {
        device.check(op, grad)?;
        if ![DType::F32, DType::BF16, DType::F16].contains(&grad.dtype()) {
            return Err(OptimError::DType {
                op,
                expected: DType::F32,
                got: grad.dtype(),
            });
        }
    }
    check_disjoint(op, &grads.iter().collect::<Vec<_>>())?;
    Ok(Some((device, grads)))
}

/// PyTorch's clamped coefficient: `max_norm / (total + 1e-6)` evaluated as PyTorch does for a
/// tensor `total` — the reciprocal of `total + 1e-6` times `max_norm`, in f32 — clamped to at
/// most 1 (NaN stays NaN).
pub(crate) fn clip_coef(max_norm: f32, total: f32) -> f32 {
    let coef = (1.0 / (total + 1e-6)) * max_norm;
    if coef > 1.0 {
        1.0
    } else {
        coef
    }
}

/// The error of `clip_grad_norm_` with `error_if_nonfinite` when `total` is NaN or infinite.
pub(crate) fn check_finite(clip: NormClip, total: f32) -> Result<(), OptimError> {
    if clip.error_if_nonfinite && !total.is_finite() {
        return Err(OptimError::NonFiniteNorm {
            norm_type: clip.norm_type,
            total,
        });
    }
    Ok(())
}

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
    check_finite(clip, total)?;
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
