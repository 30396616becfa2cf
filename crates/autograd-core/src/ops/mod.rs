//! Differentiable tensor ops, written once on top of the [`Backend`](crate::Backend) primitives.
//!
//! Each op checks its operands (typed errors that name the op and the shapes), allocates its
//! outputs from the backend's allocator, calls primitives, and — when [`needs_grad`] says so —
//! records a node whose backward closure holds [`SavedTensor`](crate::SavedTensor)s. Backward
//! closures are themselves written with ops (run with grad mode off). Files group ops by family:
//! `elementwise` (arithmetic, activations, casts), `inplace` (`add_`, `copy_`, `out=` forms),
//! `view` (reshape, permute, narrow, expand, contiguous), `reduce`, `linalg` (matmul, linear,
//! patch embedding), `nn` (softmax, layer norm, cross-entropy, dropout), `norm_linear` (a layer
//! norm and the linear it feeds, keeping the norm's input only), `linear_cross_entropy`
//! (a language model head's loss without its logits), `float8` (fp8 casts with a tensorwise scale
//! and the fp8 linear), `index` (embedding, gather/scatter,
//! cat/split, masked fill), `attention` (fused scaled-dot-product attention) and `llama` (fused
//! RMSNorm, SwiGLU and rotary embedding).
//! Nothing here knows how a backend computes.

mod attention;
mod elementwise;
mod float8;
mod float8_cast;
mod index;
mod inplace;
mod linalg;
mod linear_cross_entropy;
mod llama;
mod nn;
mod norm_linear;
mod reduce;
mod view;

pub use attention::{
    scaled_dot_product_attention, scaled_dot_product_attention_dropout,
    scaled_dot_product_attention_varlen, scaled_dot_product_attention_varlen_dropout,
    PackedSequences,
};
pub use float8::{Float8Linear, Float8Recipe, Float8Tensor};
pub use float8_cast::{Float8History, Float8Role};
pub use index::{cat, embedding};
pub use linalg::patch_embedding;
pub use linear_cross_entropy::{linear_cross_entropy, LinearCrossEntropyOptions};
pub use llama::{rms_norm, rotary_embedding, swiglu};
pub use nn::{cross_entropy, cross_entropy_f32, dropout, layer_norm};
pub use norm_linear::layer_norm_linear;

use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::graph::needs_grad;
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Fails unless both tensors are on one device.
fn check_device(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<()> {
    if lhs.device() != rhs.device() {
        return Err(TensorError::DeviceMismatch {
            op,
            lhs: lhs.device(),
            rhs: rhs.device(),
        });
    }
    Ok(())
}

/// Fails unless both tensors have one dtype (and are on one device).
fn check_same(op: &'static str, lhs: &Tensor, rhs: &Tensor) -> Result<()> {
    check_device(op, lhs, rhs)?;
    if lhs.dtype() != rhs.dtype() {
        return Err(TensorError::DtypeMismatch {
            op,
            lhs: lhs.dtype(),
            rhs: rhs.dtype(),
        });
    }
    Ok(())
}

/// Fails unless the tensor is floating point.
fn check_float(op: &'static str, tensor: &Tensor) -> Result<()> {
    if !tensor.dtype().is_float() {
        return Err(TensorError::UnsupportedDtype {
            op,
            dtype: tensor.dtype(),
        });
    }
    Ok(())
}

/// Fails unless the tensor has the given dtype.
fn check_dtype(op: &'static str, tensor: &Tensor, dtype: DType) -> Result<()> {
    if tensor.dtype() != dtype {
        return Err(TensorError::DtypeMismatch {
            op,
            lhs: dtype,
            rhs: tensor.dtype(),
        });
    }
    Ok(())
}

impl Tensor {
    /// Another handle on this tensor's storage with a different layout (no recording).
    pub(crate) fn alias(&self, layout: Layout) -> Tensor {
        Tensor::from_parts(Arc::clone(self.buffer()), layout, self.dtype(), true)
    }

    /// A freshly allocated dense result under another shape with the same element count (not a
    /// view: nothing else refers to the storage yet).
    pub(crate) fn into_shape(self, shape: &[usize]) -> Tensor {
        debug_assert!(self.is_contiguous() && !self.requires_grad());
        debug_assert_eq!(shape.iter().product::<usize>(), self.numel());
        Tensor::from_parts(
            Arc::clone(self.buffer()),
            Layout::contiguous(shape),
            self.dtype(),
            false,
        )
    }

    /// A new contiguous tensor on this tensor's backend.
    pub(crate) fn new_empty(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::empty(self.backend(), shape, dtype)
    }

    /// A new zero tensor on this tensor's backend.
    pub(crate) fn new_zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::zeros(self.backend(), shape, dtype)
    }
}

/// Whether an op on these inputs records a node (re-exported here for the op files).
fn records(inputs: &[&Tensor]) -> bool {
    needs_grad(inputs)
}
