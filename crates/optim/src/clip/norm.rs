//! What a clip of the total norm is, on either device: the norm it measures ([`NormType`]),
//! its checked arguments ([`NormClip`]) and PyTorch's coefficient ([`clip_coef`]).
//!
//! It sits on nothing of this crate (the crate's error type names [`NormType`]); the host side
//! (`host.rs`) and the CUDA side (`cuda/clip.rs`) compute with it.

/// The norm [`clip_grad_norm_`](crate::clip_grad_norm_) measures gradients with (PyTorch's
/// `norm_type`).
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

impl NormClip {
    /// Whether `total` fails the clip: NaN or infinite under `error_if_nonfinite`.
    pub(crate) fn rejects(self, total: f32) -> bool {
        self.error_if_nonfinite && !total.is_finite()
    }
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
