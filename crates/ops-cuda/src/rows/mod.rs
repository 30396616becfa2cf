//! The rows family: launches of `kernels/rows.cu`, where one block (or warp) walks a row at a time
//! — reductions over trailing dims and max/min with indices (`reduce.rs`), column sums
//! (`column_sums.rs`), softmax along a dim (`softmax.rs`) and layer norm (`layer_norm.rs`),
//! forward and backward.
//!
//! Operands are described by one `RowArgs` (`args.rs`): the outer dims that pick a row, and the
//! inner dims walked within it, with per-operand strides. One block of 256 threads handles a row
//! at a time. This module is the family's entry point: it names what `backend.rs` calls, and
//! [`reduce()`] chooses between the row kernel and column sums.
//!
//! The family sits on the ground floor and imports no other family. Its rooms import `args.rs`,
//! never each other or this module.

mod args;
mod column_sums;
mod layer_norm;
mod reduce;
mod softmax;

use headroom_autograd_core::{ReduceOp, Result, TensorError, View};

use crate::device::CudaBackend;
use crate::kernels::float_suffix;

pub(crate) use layer_norm::{layer_norm, layer_norm_backward};
pub(crate) use reduce::reduce_with_index;
pub(crate) use softmax::{softmax, softmax_backward};

/// `out` = the sum, mean, max or min of `x` over its trailing `n_reduced` dims: column sums when
/// a sum or mean reads a matrix down its columns (`column_sums.rs`), else the row kernel.
pub(crate) fn reduce(
    backend: &CudaBackend,
    op: ReduceOp,
    x: View<'_>,
    n_reduced: usize,
    out: View<'_>,
) -> Result<()> {
    args::same_dtype("reduce", &[&x, &out])?;
    let ndim = x.layout.ndim();
    if n_reduced > ndim || out.layout.shape() != &x.layout.shape()[..ndim - n_reduced] {
        return Err(TensorError::ShapeMismatch {
            op: "reduce",
            lhs: x.layout.shape().to_vec(),
            rhs: out.layout.shape().to_vec(),
        });
    }
    let suffix = float_suffix("reduce", x.dtype)?;
    if let Some(columns) = column_sums::column_reduction(op, &x, n_reduced, &out) {
        return column_sums::column_sums(backend, suffix, &x, &out, columns);
    }
    reduce::reduce_rows(backend, op, x, n_reduced, out, suffix)
}
