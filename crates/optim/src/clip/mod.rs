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
//! This file holds the public calls and the checks every device shares; `norm.rs` what a clip of
//! the total norm is (its norm type, its coefficient), shared by both sides; `host.rs` the host
//! side (the gradients' memory as slices). [`StepDevice`] picks the host or the CUDA side
//! (`cuda/clip.rs`, three launches for any number of tensors: partial reductions, a finishing
//! kernel that leaves the total and the coefficient in device memory, the scaling — no host
//! synchronisation unless `error_if_nonfinite` asks for the norm). It knows no optimizer.

pub(crate) mod host;
pub(crate) mod norm;

use headroom_autograd_core::{DType, Tensor};

use crate::device::StepDevice;
use crate::error::OptimError;
use crate::host::check_disjoint;
use norm::NormClip;

pub use norm::NormType;

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
