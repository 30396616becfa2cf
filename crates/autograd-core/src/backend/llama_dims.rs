//! The shape, dtype and layout rules of the Llama primitives (RMSNorm, SwiGLU, rotary embedding)
//! that every backend shares: a backend checks its arguments with these before it touches
//! memory, so a wrong call is the same typed error on every device.
//!
//! It sits on the argument structs (`args.rs`) and knows no backend.

use super::args::{
    GateUp, RmsNormBackward, RmsNormForward, RotaryArgs, SwiGluBackward, SwiGluForward, View,
};
use crate::dtype::{stats_dtype, DType};
use crate::error::{Result, TensorError};

fn invalid(op: &'static str, reason: String) -> TensorError {
    TensorError::InvalidArgument { op, reason }
}

/// Fails unless `view` is floating point and of `dtype`.
fn check_dtype(op: &'static str, view: &View<'_>, dtype: DType) -> Result<()> {
    if !view.dtype.is_float() {
        return Err(TensorError::UnsupportedDtype {
            op,
            dtype: view.dtype,
        });
    }
    if view.dtype != dtype {
        return Err(TensorError::DtypeMismatch {
            op,
            lhs: dtype,
            rhs: view.dtype,
        });
    }
    Ok(())
}

/// Fails unless `view` has `shape`.
fn check_shape(op: &'static str, view: &View<'_>, shape: &[usize]) -> Result<()> {
    if view.layout.shape() != shape {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: shape.to_vec(),
            rhs: view.layout.shape().to_vec(),
        });
    }
    Ok(())
}

/// Fails unless `view` is dense (contiguous).
fn check_dense(op: &'static str, view: &View<'_>, what: &str) -> Result<()> {
    if !view.layout.is_contiguous() {
        return Err(invalid(
            op,
            format!(
                "{what} must be dense, got strides {:?}",
                view.layout.strides()
            ),
        ));
    }
    Ok(())
}

/// `(rows, n)` of RMSNorm's dense `[rows, n]` input `x`, checking `rows_like` (dense `[rows, n]`),
/// `params` (`[n]`, any stride) and `rstd` (dense `[rows]` in the stats dtype) against it.
fn rms_norm_dims(
    op: &'static str,
    x: &View<'_>,
    rstd: &View<'_>,
    rows_like: &[View<'_>],
    params: &[View<'_>],
) -> Result<(usize, usize)> {
    let &[rows, n] = x.layout.shape() else {
        return Err(invalid(
            op,
            format!("x must be [rows, n], got {:?}", x.layout.shape()),
        ));
    };
    check_dtype(op, x, x.dtype)?;
    check_dense(op, x, "x")?;
    for view in rows_like {
        check_dtype(op, view, x.dtype)?;
        check_shape(op, view, &[rows, n])?;
        check_dense(op, view, "a row operand")?;
    }
    for view in params {
        check_dtype(op, view, x.dtype)?;
        check_shape(op, view, &[n])?;
    }
    check_dtype(op, rstd, stats_dtype(x.dtype))?;
    check_shape(op, rstd, &[rows])?;
    check_dense(op, rstd, "rstd")?;
    Ok((rows, n))
}

impl RmsNormForward<'_> {
    /// `(rows, n)`: `x` and `out` dense `[rows, n]` of one float dtype, `weight` `[n]` of it,
    /// `rstd` dense `[rows]` in f32 (f64 for f64).
    pub fn dims(&self) -> Result<(usize, usize)> {
        rms_norm_dims("rms_norm", &self.x, &self.rstd, &[self.out], &[self.weight])
    }
}

impl RmsNormBackward<'_> {
    /// `(rows, n)`, checked as [`RmsNormForward::dims`] with `dy` and `dx` like `x` and
    /// `dweight` like `weight`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        let rows_like: Vec<View<'_>> = [Some(self.dy), self.dx].into_iter().flatten().collect();
        let params: Vec<View<'_>> = [Some(self.weight), self.dweight]
            .into_iter()
            .flatten()
            .collect();
        rms_norm_dims(
            "rms_norm_backward",
            &self.x,
            &self.rstd,
            &rows_like,
            &params,
        )
    }
}

/// `(rows, n)` of SwiGLU's `gate`: `[rows, n]` with a contiguous last dim, `up` likewise, each of
/// `dense` dense `[rows, n]`, all of one float dtype.
fn swiglu_dims(
    op: &'static str,
    inputs: &GateUp<'_>,
    dense: &[View<'_>],
) -> Result<(usize, usize)> {
    let (gate, up) = (&inputs.gate, &inputs.up);
    let &[rows, n] = gate.layout.shape() else {
        return Err(invalid(
            op,
            format!("gate must be [rows, n], got {:?}", gate.layout.shape()),
        ));
    };
    for view in [gate, up] {
        check_dtype(op, view, gate.dtype)?;
        check_shape(op, view, &[rows, n])?;
        if n > 1 && view.layout.strides()[1] != 1 {
            return Err(invalid(
                op,
                format!(
                    "gate and up need a contiguous last dim, got strides {:?}",
                    view.layout.strides()
                ),
            ));
        }
    }
    for view in dense {
        check_dtype(op, view, gate.dtype)?;
        check_shape(op, view, &[rows, n])?;
        check_dense(op, view, "a SwiGLU output or gradient")?;
    }
    Ok((rows, n))
}

impl SwiGluForward<'_> {
    /// `(rows, n)`: `gate` and `up` `[rows, n]` with a contiguous last dim (any row stride),
    /// `out` dense `[rows, n]`, all of one float dtype.
    pub fn dims(&self) -> Result<(usize, usize)> {
        swiglu_dims("swiglu", &self.inputs, &[self.out])
    }
}

impl SwiGluBackward<'_> {
    /// `(rows, n)`, checked as [`SwiGluForward::dims`] with `dout` and the gradients dense.
    pub fn dims(&self) -> Result<(usize, usize)> {
        let dense = [self.dout, self.grads.gate, self.grads.up];
        swiglu_dims("swiglu_backward", &self.inputs, &dense)
    }
}

/// Sizes and strides of a rotary-embedding call, its operands padded to four dims
/// `[outer, heads, seq, head_dim]` (leading size-1 dims added).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotaryDims {
    /// The padded shape; `shape[2]` is the positions, `shape[3]` the (even) head width.
    pub shape: [usize; 4],
    /// `x`'s strides, padded.
    pub x_strides: [usize; 4],
    /// `out`'s strides, padded.
    pub out_strides: [usize; 4],
}

impl RotaryArgs<'_> {
    /// The padded dims: `x` and `out` of one float dtype and shape `[.., seq, head_dim]` (two to
    /// four dims, any strides, `head_dim` even), `cos` and `sin` dense `[seq, head_dim]` of it.
    pub fn dims(&self) -> Result<RotaryDims> {
        let op = "rotary_embedding";
        let shape = self.x.layout.shape();
        let ndim = shape.len();
        if !(2..=4).contains(&ndim) || !shape[ndim - 1].is_multiple_of(2) {
            return Err(invalid(
                op,
                format!(
                    "x must be [.., seq, head_dim] (2 to 4 dims, head_dim even), got {shape:?}"
                ),
            ));
        }
        check_dtype(op, &self.x, self.x.dtype)?;
        check_dtype(op, &self.out, self.x.dtype)?;
        check_shape(op, &self.out, shape)?;
        for table in [&self.cos, &self.sin] {
            check_dtype(op, table, self.x.dtype)?;
            check_shape(op, table, &shape[ndim - 2..])?;
            check_dense(op, table, "a rotary table")?;
        }
        let pad = |values: &[usize], fill: usize| -> [usize; 4] {
            let mut padded = [fill; 4];
            padded[4 - values.len()..].copy_from_slice(values);
            padded
        };
        Ok(RotaryDims {
            shape: pad(shape, 1),
            x_strides: pad(self.x.layout.strides(), 0),
            out_strides: pad(self.out.layout.strides(), 0),
        })
    }
}
