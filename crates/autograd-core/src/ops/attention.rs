//! Fused scaled-dot-product attention (`torch.nn.functional.scaled_dot_product_attention` without
//! a mask tensor or dropout): one backend primitive forward and one backward.
//!
//! The composed form `softmax(q kᵀ · scale) v` materialises a `[queries, keys]` score matrix per
//! head (and saves the probabilities for backward); the fused primitive keeps each query's
//! log-sum-exp instead, and backward recomputes the probabilities from it — what PyTorch's
//! memory-efficient and flash kernels do. The result is allocated `[batch, queries, heads,
//! head_dim]` and returned as the `[batch, heads, queries, head_dim]` view, so merging the heads
//! afterwards (permute + reshape) is free; the input gradients are laid out the same way for the
//! same reason on the way back, and for a packed q/k/v projection as thirds of one gradient (see
//! `input_grads`).

use crate::autocast::autocast_args;
use crate::backend::{AttentionBackward, AttentionForward};
use crate::dtype::stats_dtype;
use crate::error::{Result, TensorError};
use crate::graph::record;
use crate::layout::Layout;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_float, check_same, records};

/// A new `[batch, heads, seq, head_dim]` tensor stored `[batch, seq, heads, head_dim]`.
fn heads_last_but_one(like: &Tensor) -> Result<Tensor> {
    let [batch, heads, seq, head_dim] = *like.shape() else {
        return Err(TensorError::InvalidArgument {
            op: "scaled_dot_product_attention",
            reason: format!("expected a 4-D operand, got {:?}", like.shape()),
        });
    };
    let dense = like.new_empty(&[batch, seq, heads, head_dim], like.dtype())?;
    let layout = dense.layout().permute("attention", &[0, 2, 1, 3])?;
    Ok(Tensor::from_parts(
        std::sync::Arc::clone(dense.buffer()),
        layout,
        dense.dtype(),
        false,
    ))
}

/// Gradients for `q`, `k` and `v`. When the three are the thirds of one packed projection (a
/// `[batch, seq, 3 · heads · head_dim]` tensor split in three and viewed as heads, as nn's attention
/// makes them), they are the same slices of one new tensor of that shape, so the split's backward
/// takes it whole instead of copying three gradients into one; otherwise one tensor each, laid out
/// as [`heads_last_but_one`].
fn input_grads(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<[Tensor; 3]> {
    if let [batch, heads, seq, head_dim] = *q.shape() {
        let width = heads * head_dim;
        let packed_strides = [seq * 3 * width, head_dim, 3 * width, 1];
        let shared = std::sync::Arc::ptr_eq(q.buffer(), k.buffer())
            && std::sync::Arc::ptr_eq(q.buffer(), v.buffer());
        let offset = q.layout().offset();
        let packed = shared
            && [k, v].iter().all(|t| t.shape() == q.shape())
            && [q, k, v]
                .iter()
                .all(|t| t.layout().strides() == packed_strides.as_slice())
            && k.layout().offset() == offset + width
            && v.layout().offset() == offset + 2 * width;
        if packed {
            let grads = q.new_empty(&[batch, seq, 3 * width], q.dtype())?;
            let third = |i: usize| -> Result<Tensor> {
                let layout =
                    Layout::from_parts(&[batch, heads, seq, head_dim], &packed_strides, i * width)?;
                Ok(Tensor::from_parts(
                    std::sync::Arc::clone(grads.buffer()),
                    layout,
                    q.dtype(),
                    false,
                ))
            };
            return Ok([third(0)?, third(1)?, third(2)?]);
        }
    }
    Ok([
        heads_last_but_one(q)?,
        heads_last_but_one(k)?,
        heads_last_but_one(v)?,
    ])
}

/// The primitive's arguments for `[q, k, v, out, lse]`.
fn forward_args<'a>(
    [q, k, v, out, lse]: [&'a Tensor; 5],
    scale: f64,
    causal: bool,
) -> AttentionForward<'a> {
    AttentionForward {
        q: q.view(),
        k: k.view(),
        v: v.view(),
        scale,
        causal,
        out: out.view(),
        lse: lse.view(),
    }
}

/// `t` itself when its last dim is contiguous, else a copy that is.
fn last_dim_contiguous(t: &Tensor) -> Result<Tensor> {
    if t.shape()[3] <= 1 || t.layout().strides()[3] == 1 {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// Scaled dot-product attention of `q` (`[batch, heads, queries, head_dim]`), `k` and `v`
/// (`[batch, heads, keys, head_dim]`): `softmax(q kᵀ · scale) v`, with key `j` hidden from query
/// `i` when `causal` and `j > i`. `scale` defaults to `1 / sqrt(head_dim)`. Differentiable in all
/// three inputs; saves the inputs, the output and one log-sum-exp per query.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: Option<f64>,
) -> Result<Tensor> {
    let op = "scaled_dot_product_attention";
    if let Some([q, k, v]) = autocast_args(op, [q, k, v])? {
        return scaled_dot_product_attention(&q, &k, &v, causal, scale);
    }
    check_float(op, q)?;
    check_same(op, q, k)?;
    check_same(op, q, v)?;
    if q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "q, k and v must be [batch, heads, seq, head_dim], got {:?}, {:?} and {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            ),
        });
    }
    let (q, k, v) = (
        last_dim_contiguous(q)?,
        last_dim_contiguous(k)?,
        last_dim_contiguous(v)?,
    );
    let head_dim = q.shape()[3];
    let scale = scale.unwrap_or(1.0 / (head_dim.max(1) as f64).sqrt());
    let out = heads_last_but_one(&q)?;
    let lse = q.new_empty(&q.shape()[..3], stats_dtype(q.dtype()))?;
    q.backend()
        .attention(forward_args([&q, &k, &v, &out, &lse], scale, causal))?;
    if records(&[&q, &k, &v]) {
        let roles = [
            SaveRole::Input(0),
            SaveRole::Input(1),
            SaveRole::Input(2),
            SaveRole::Output(0),
            SaveRole::Intermediate("lse"),
        ];
        let mut roles = roles.into_iter();
        let saved = [&q, &k, &v, &out, &lse]
            .map(|t| SavedTensor::save(op, roles.next().expect("one role per tensor"), t));
        let [q_saved, k_saved, v_saved, out_saved, lse_saved] = saved;
        let (q_saved, k_saved, v_saved) = (q_saved?, k_saved?, v_saved?);
        let (out_saved, lse_saved) = (out_saved?, lse_saved?);
        record(op, &[&q, &k, &v], &[&out], move |grads| {
            let dout = last_dim_contiguous(grads[0].as_ref().expect("one output"))?;
            let (q, k, v) = (q_saved.unpack()?, k_saved.unpack()?, v_saved.unpack()?);
            let (out, lse) = (out_saved.unpack()?, lse_saved.unpack()?);
            let [dq, dk, dv] = input_grads(&q, &k, &v)?;
            q.backend().attention_backward(AttentionBackward {
                forward: forward_args([&q, &k, &v, &out, &lse], scale, causal),
                dout: dout.view(),
                dq: dq.view(),
                dk: dk.view(),
                dv: dv.view(),
            })?;
            Ok(vec![Some(dq), Some(dk), Some(dv)])
        });
    }
    Ok(out)
}
