//! The fused pieces of a Llama decoder layer: RMSNorm, SwiGLU and the rotary embedding, each one
//! backend primitive forward and one backward.
//!
//! What each saves is the point: RMSNorm saves its input (as rows), its weight and one rstd per
//! row (the normalised value is recomputed in backward); SwiGLU saves only `gate` and `up`
//! (`silu(gate)` and its derivative are recomputed); the rotary embedding saves only its
//! `cos`/`sin` tables, since its backward is the inverse rotation of the output gradient, so the
//! projection output it rotates is freed as soon as attention has saved the rotated tensor.
//!
//! They do not consult autocast (they are not in [`AUTOCAST_OPS`](crate::AUTOCAST_OPS)): each
//! runs in its inputs' dtype, RMSNorm computing in f32 for f16 and bf16 inputs itself, as Hugging
//! Face's `LlamaRMSNorm` does. This module knows nothing about how a backend computes.

use std::sync::Arc;

use crate::backend::{
    GateUp, RmsNormBackward, RmsNormForward, RotaryArgs, SwiGluBackward, SwiGluForward,
};
use crate::dtype::stats_dtype;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::record;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_float, check_same, records};

/// Root-mean-square normalisation over the last dim with a scale `weight` `[n]` of the input's
/// dtype (Hugging Face's `LlamaRMSNorm`): `weight · round(x · rsqrt(mean(x²) + eps))`, where the
/// normalised value is computed in f32 for f16 and bf16 inputs (in the input's dtype for f32 and
/// f64) and rounded to the input's dtype before the scale.
pub fn rms_norm(input: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let op = "rms_norm";
    check_float(op, input)?;
    check_same(op, input, weight)?;
    let n = input.shape().last().copied().unwrap_or(0);
    if input.ndim() == 0 || weight.shape() != [n] {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: input.shape().to_vec(),
            rhs: weight.shape().to_vec(),
        });
    }
    let rows = input.numel() / n.max(1);
    let (dense, weight_dense) = {
        let _guard = no_grad();
        (
            input.contiguous()?.reshape(&[rows, n])?,
            weight.contiguous()?,
        )
    };
    let res = input.new_empty(&[rows, n], input.dtype())?;
    let rstd = input.new_empty(&[rows], stats_dtype(input.dtype()))?;
    input.backend().rms_norm(RmsNormForward {
        x: dense.view(),
        weight: weight_dense.view(),
        eps,
        out: res.view(),
        rstd: rstd.view(),
    })?;
    let res = res.into_shape(input.shape());
    if records(&[input, weight]) {
        let saved_x = SavedTensor::save(op, SaveRole::Input(0), &dense)?;
        let saved_weight = SavedTensor::save(op, SaveRole::Input(1), &weight_dense)?;
        let saved_rstd = SavedTensor::save(op, SaveRole::Intermediate("rstd"), &rstd)?;
        let wants = [input.requires_grad(), weight.requires_grad()];
        let input_shape = input.shape().to_vec();
        record(op, &[input, weight], &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let dy = grad.contiguous()?.reshape(&[rows, n])?;
            let (x, weight, rstd) = (
                saved_x.unpack()?,
                saved_weight.unpack()?,
                saved_rstd.unpack()?,
            );
            let new_grad = |wanted: bool, shape: &[usize]| {
                wanted.then(|| x.new_empty(shape, x.dtype())).transpose()
            };
            let dx = new_grad(wants[0], &[rows, n])?;
            let dweight = new_grad(wants[1], &[n])?;
            x.backend().rms_norm_backward(RmsNormBackward {
                dy: dy.view(),
                x: x.view(),
                rstd: rstd.view(),
                weight: weight.view(),
                dx: dx.as_ref().map(Tensor::view),
                dweight: dweight.as_ref().map(Tensor::view),
            })?;
            Ok(vec![dx.map(|dx| dx.into_shape(&input_shape)), dweight])
        });
    }
    Ok(res)
}

/// `tensor` as `[rows, n]` (`n` its last dim) without a copy when its strides allow it with a
/// contiguous last dim (a half of a packed projection does), else as a dense copy.
fn as_rows(tensor: &Tensor, rows: usize, n: usize) -> Result<Tensor> {
    let row_view = tensor
        .layout()
        .view(&[rows, n])
        .filter(|layout| n <= 1 || layout.strides()[1] == 1);
    match row_view {
        Some(layout) => Ok(tensor.alias(layout)),
        None => {
            let _guard = no_grad();
            tensor.contiguous()?.reshape(&[rows, n])
        }
    }
}

/// SwiGLU, `silu(gate) · up` with `silu(g) = g · sigmoid(g)` (the activation of Llama's MLP),
/// computed in f32 for f16 and bf16 and rounded once. `gate` and `up` have one shape and dtype;
/// they may be strided views (the two halves of one packed projection are read in place).
/// Backward recomputes `silu(gate)`, so only `gate` and `up` are saved.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let op = "swiglu";
    check_float(op, gate)?;
    check_same(op, gate, up)?;
    if gate.shape() != up.shape() || gate.ndim() == 0 {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: gate.shape().to_vec(),
            rhs: up.shape().to_vec(),
        });
    }
    let n = gate.shape().last().copied().unwrap_or(1);
    let rows = gate.numel() / n.max(1);
    let (gate_rows, up_rows) = (as_rows(gate, rows, n)?, as_rows(up, rows, n)?);
    let res = gate.new_empty(&[rows, n], gate.dtype())?;
    gate.backend().swiglu(SwiGluForward {
        inputs: GateUp {
            gate: gate_rows.view(),
            up: up_rows.view(),
        },
        out: res.view(),
    })?;
    let res = res.into_shape(gate.shape());
    if records(&[gate, up]) {
        let saved_gate = SavedTensor::save(op, SaveRole::Input(0), &gate_rows)?;
        let saved_up = SavedTensor::save(op, SaveRole::Input(1), &up_rows)?;
        let wants = [gate.requires_grad(), up.requires_grad()];
        let shape = gate.shape().to_vec();
        record(op, &[gate, up], &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let dout = grad.contiguous()?.reshape(&[rows, n])?;
            let (gate, up) = (saved_gate.unpack()?, saved_up.unpack()?);
            let dgate = gate.new_empty(&[rows, n], gate.dtype())?;
            let dup = gate.new_empty(&[rows, n], gate.dtype())?;
            gate.backend().swiglu_backward(SwiGluBackward {
                inputs: GateUp {
                    gate: gate.view(),
                    up: up.view(),
                },
                dout: dout.view(),
                grads: GateUp {
                    gate: dgate.view(),
                    up: dup.view(),
                },
            })?;
            Ok(vec![
                wants[0].then(|| dgate.into_shape(&shape)),
                wants[1].then(|| dup.into_shape(&shape)),
            ])
        });
    }
    Ok(res)
}

/// A new tensor with `like`'s shape and dtype whose memory order is `like`'s (dims ordered by
/// decreasing stride): the rotary embedding of a `[batch, heads, seq, head_dim]` view of a
/// `[batch, seq, heads · head_dim]` projection is laid out like the projection, so merging the
/// heads of its gradient costs no copy.
fn new_empty_in_memory_order(op: &'static str, like: &Tensor) -> Result<Tensor> {
    let mut order: Vec<usize> = (0..like.ndim()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(like.strides()[d]));
    let dense_shape: Vec<usize> = order.iter().map(|&d| like.shape()[d]).collect();
    let dense = like.new_empty(&dense_shape, like.dtype())?;
    let mut inverse = vec![0; order.len()];
    for (position, &d) in order.iter().enumerate() {
        inverse[d] = position;
    }
    let layout = dense.layout().permute(op, &inverse)?;
    Ok(Tensor::from_parts(
        Arc::clone(dense.buffer()),
        layout,
        dense.dtype(),
        false,
    ))
}

/// Rotary position embedding of `x` `[.., seq, head_dim]` (two to four dims, any strides, e.g.
/// `[batch, heads, seq, head_dim]` heads of a projection) with tables `cos`, `sin`
/// `[seq, head_dim]`: `x · cos + rotate_half(x) · sin` (Hugging Face's `apply_rotary_pos_emb`),
/// computed in f32 for f16 and bf16 and rounded once. The tables are cast to `x`'s dtype and are
/// constants: no gradient reaches them. Backward applies the inverse rotation to the output
/// gradient, so nothing of `x` is saved; the result is laid out in `x`'s memory order.
pub fn rotary_embedding(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let op = "rotary_embedding";
    check_float(op, x)?;
    let ndim = x.ndim();
    let tables_fit = |table: &Tensor| ndim >= 2 && table.shape() == &x.shape()[ndim - 2..];
    for table in [cos, sin] {
        if !(2..=4).contains(&ndim) || !tables_fit(table) || !x.shape()[ndim - 1].is_multiple_of(2)
        {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: x.shape().to_vec(),
                rhs: table.shape().to_vec(),
            });
        }
    }
    let (cos, sin) = {
        let _guard = no_grad();
        (
            cos.to_dtype(x.dtype())?.contiguous()?,
            sin.to_dtype(x.dtype())?.contiguous()?,
        )
    };
    check_same(op, x, &cos)?;
    let res = new_empty_in_memory_order(op, x)?;
    x.backend().rotary_embedding(RotaryArgs {
        x: x.view(),
        cos: cos.view(),
        sin: sin.view(),
        transpose: false,
        out: res.view(),
    })?;
    if records(&[x]) {
        let saved_cos = SavedTensor::save(op, SaveRole::Input(1), &cos)?;
        let saved_sin = SavedTensor::save(op, SaveRole::Input(2), &sin)?;
        record(op, &[x], &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let (cos, sin) = (saved_cos.unpack()?, saved_sin.unpack()?);
            let dx = new_empty_in_memory_order(op, grad)?;
            grad.backend().rotary_embedding(RotaryArgs {
                x: grad.view(),
                cos: cos.view(),
                sin: sin.view(),
                transpose: true,
                out: dx.view(),
            })?;
            Ok(vec![Some(dx)])
        });
    }
    Ok(res)
}
