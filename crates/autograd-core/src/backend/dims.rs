//! The shape, dtype and layout rules of the fused primitives that every backend shares (linear,
//! attention, matmul, gather/scatter), and the default bodies of the composed ones
//! (`compose_linear`, `compose_linear_weight_grad`): a backend checks its arguments with these
//! before it touches memory, and falls back on the compositions where it has no fused path.
//!
//! It sits on the argument structs (`args.rs`) and the trait (`mod.rs`) whose primitives the
//! compositions call.

use super::args::{
    AttentionForward, LinearEpilogue, LinearForward, LinearWeightGrad, PackedBounds, View,
};
use super::{Backend, ReduceOp, UnaryOp};
use crate::dtype::{stats_dtype, DType};
use crate::error::{Result, TensorError};

/// The shape and dtype rule of [`Backend::linear`], shared by every backend: 2-D `input` and
/// `weight` with one inner size, `bias` `[out]`, `out` (and a GELU's `pre_activation`) dense
/// `[rows, out]`, all of one dtype. Returns `(rows, in, out)`.
pub fn linear_dims(args: &LinearForward<'_>) -> Result<(usize, usize, usize)> {
    let ([rows, in_features], [out_features, _]) =
        matrices_sharing_a_size(&args.input, &args.weight, (1, 1))?;
    if let Some(bias) = &args.bias {
        if bias.layout.shape() != [out_features] {
            return Err(linear_mismatch(&args.weight, bias));
        }
    }
    let mut outputs = vec![(args.out, vec![rows, out_features])];
    if let LinearEpilogue::Gelu { pre_activation } = args.epilogue {
        outputs.push((pre_activation, vec![rows, out_features]));
    }
    let inputs = [args.input, args.weight].into_iter().chain(args.bias);
    check_linear_operands("linear", inputs, &outputs)?;
    Ok((rows, in_features, out_features))
}

/// The shape and dtype rule of [`Backend::linear_weight_grad`], shared by every backend.
/// Returns `(rows, in, out)`.
pub fn linear_weight_grad_dims(args: &LinearWeightGrad<'_>) -> Result<(usize, usize, usize)> {
    let ([rows, out_features], [_, in_features]) =
        matrices_sharing_a_size(&args.grad_out, &args.input, (0, 0))?;
    let mut outputs = vec![(args.grad_weight, vec![out_features, in_features])];
    outputs.extend(args.grad_bias.map(|bias| (bias, vec![out_features])));
    check_linear_operands("linear_weight_grad", [args.grad_out, args.input], &outputs)?;
    Ok((rows, in_features, out_features))
}

/// Fails unless every output is dense with its expected shape and every view has the first
/// input's dtype.
fn check_linear_operands<'a>(
    op: &'static str,
    inputs: impl IntoIterator<Item = View<'a>>,
    outputs: &[(View<'a>, Vec<usize>)],
) -> Result<()> {
    for (view, shape) in outputs {
        if view.layout.shape() != shape.as_slice() || !view.layout.is_contiguous() {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "outputs must be dense {shape:?}, got shape {:?} strides {:?}",
                    view.layout.shape(),
                    view.layout.strides()
                ),
            });
        }
    }
    let mut views = inputs
        .into_iter()
        .chain(outputs.iter().map(|(view, _)| *view));
    let Some(first) = views.next() else {
        return Ok(());
    };
    for view in views {
        if view.dtype != first.dtype {
            return Err(TensorError::DtypeMismatch {
                op,
                lhs: first.dtype,
                rhs: view.dtype,
            });
        }
    }
    Ok(())
}

/// The shapes of `lhs` and `rhs` when both are 2-D and `lhs`'s dim `shared.0` has the size of
/// `rhs`'s dim `shared.1` (the product's inner size), else a shape mismatch naming both.
fn matrices_sharing_a_size(
    lhs: &View<'_>,
    rhs: &View<'_>,
    shared: (usize, usize),
) -> Result<([usize; 2], [usize; 2])> {
    match (lhs.layout.shape(), rhs.layout.shape()) {
        (&[l0, l1], &[r0, r1]) if [l0, l1][shared.0] == [r0, r1][shared.1] => {
            Ok(([l0, l1], [r0, r1]))
        }
        _ => Err(linear_mismatch(lhs, rhs)),
    }
}

fn linear_mismatch(lhs: &View<'_>, rhs: &View<'_>) -> TensorError {
    TensorError::ShapeMismatch {
        op: "linear",
        lhs: lhs.layout.shape().to_vec(),
        rhs: rhs.layout.shape().to_vec(),
    }
}

/// [`Backend::linear`] composed of primitives (its default body, and a backend's fallback for
/// cases its fused path does not take): the bias broadcast into the output, the product
/// accumulated onto it (addmm), then the GELU into `out`.
pub fn compose_linear<B: Backend + ?Sized>(backend: &B, args: LinearForward<'_>) -> Result<()> {
    let (rows, _, out_features) = linear_dims(&args)?;
    let product = match args.epilogue {
        LinearEpilogue::None => args.out,
        LinearEpilogue::Gelu { pre_activation } => pre_activation,
    };
    if let Some(bias) = &args.bias {
        let spread = bias.layout.expand("linear", &[rows, out_features])?;
        backend.copy(
            View {
                layout: &spread,
                ..*bias
            },
            product,
        )?;
    }
    let weight_t = args.weight.layout.permute("linear", &[1, 0])?;
    let weight_t = View {
        layout: &weight_t,
        ..args.weight
    };
    backend.matmul(args.input, weight_t, product, args.bias.is_some())?;
    if let LinearEpilogue::Gelu { pre_activation } = args.epilogue {
        backend.unary(UnaryOp::Gelu, pre_activation, args.out)?;
    }
    Ok(())
}

/// [`Backend::linear_weight_grad`] composed of primitives (its default body, and a backend's
/// fallback): one product for the weight, one reduction over the rows for the bias.
pub fn compose_linear_weight_grad<B: Backend + ?Sized>(
    backend: &B,
    args: LinearWeightGrad<'_>,
) -> Result<()> {
    linear_weight_grad_dims(&args)?;
    let grad_t = args.grad_out.layout.permute("linear", &[1, 0])?;
    let grad_t = View {
        layout: &grad_t,
        ..args.grad_out
    };
    backend.matmul(grad_t, args.input, args.grad_weight, false)?;
    if let Some(grad_bias) = args.grad_bias {
        backend.reduce(ReduceOp::Sum, grad_t, 1, grad_bias)?;
    }
    Ok(())
}

/// Sizes of a fused attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    /// Batch size.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads: a divisor of `heads`; query head `h` reads key/value head
    /// `h / (heads / kv_heads)`.
    pub kv_heads: usize,
    /// Query positions.
    pub queries: usize,
    /// Key (and value) positions.
    pub keys: usize,
    /// Elements per head (queries, keys and values alike).
    pub head_dim: usize,
}

impl AttentionDims {
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
}

/// The shape, dtype and layout rule of [`Backend::attention`] and its backward, shared by every
/// backend: 4-D operands of one float dtype with a contiguous last dim, k and v with a number of
/// heads that divides q's (a [`TensorError::ShapeMismatch`] naming q's and k's shapes otherwise),
/// `lse` dense in f32 (f64 for f64), equal query and key counts when causal or packed, packed
/// boundaries as [`PackedBounds`] describes (batch 1); `grads` (`dout`, `dq`, `dk`, `dv`) are
/// checked against their forward counterparts.
pub fn attention_dims(args: &AttentionForward<'_>, grads: &[View<'_>]) -> Result<AttentionDims> {
    let op = "attention";
    let [batch, heads, queries, head_dim] = *args.q.layout.shape() else {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "q must be [batch, heads, queries, head_dim], got {:?}",
                args.q.layout.shape()
            ),
        });
    };
    let keys = args.k.layout.shape().get(2).copied().unwrap_or(0);
    let mismatch = |lhs: &View<'_>, rhs: &View<'_>| TensorError::ShapeMismatch {
        op,
        lhs: lhs.layout.shape().to_vec(),
        rhs: rhs.layout.shape().to_vec(),
    };
    let kv_heads = args.k.layout.shape().get(1).copied().unwrap_or(0);
    let kv_shape = [batch, kv_heads, keys, head_dim];
    let divides = kv_heads > 0 && heads.is_multiple_of(kv_heads) || heads == 0 && kv_heads == 0;
    if args.k.layout.shape() != kv_shape || !divides {
        return Err(mismatch(&args.q, &args.k));
    }
    if args.v.layout.shape() != kv_shape {
        return Err(mismatch(&args.k, &args.v));
    }
    if args.out.layout.shape() != args.q.layout.shape() {
        return Err(mismatch(&args.q, &args.out));
    }
    let stats = stats_dtype(args.q.dtype);
    if args.lse.layout.shape() != [batch, heads, queries]
        || !args.lse.layout.is_contiguous()
        || args.lse.dtype != stats
    {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "lse must be dense {stats:?} [{batch}, {heads}, {queries}], got {:?} {:?}",
                args.lse.dtype,
                args.lse.layout.shape()
            ),
        });
    }
    if args.causal && queries != keys {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "causal attention needs as many queries as keys, got {queries} and {keys}"
            ),
        });
    }
    if let Some(packed) = &args.packed {
        packed_bounds(packed, batch, queries, keys)?;
    }
    let forward = [args.q, args.k, args.v, args.out];
    let like = [args.q, args.q, args.k, args.v];
    for (view, reference) in forward.iter().chain(grads).zip(forward.iter().chain(&like)) {
        if view.layout.shape() != reference.layout.shape() {
            return Err(mismatch(reference, view));
        }
        if view.dtype != args.q.dtype {
            return Err(TensorError::DtypeMismatch {
                op,
                lhs: args.q.dtype,
                rhs: view.dtype,
            });
        }
        if head_dim > 1 && view.layout.strides()[3] != 1 {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "operands need a contiguous last dim, got strides {:?}",
                    view.layout.strides()
                ),
            });
        }
    }
    Ok(AttentionDims {
        batch,
        heads,
        kv_heads,
        queries,
        keys,
        head_dim,
    })
}

/// The rule of [`PackedBounds`] for a call with these sizes: batch 1, as many queries as keys,
/// `cu_seqlens` dense I32 `[n_seqs + 1]` like `host`, `host` from 0 to the token count without
/// decreasing.
fn packed_bounds(
    packed: &PackedBounds<'_>,
    batch: usize,
    queries: usize,
    keys: usize,
) -> Result<()> {
    let op = "attention";
    let invalid = |reason: String| Err(TensorError::InvalidArgument { op, reason });
    if batch != 1 || queries != keys {
        return invalid(format!(
            "packed sequences need batch 1 and as many queries as keys, got batch {batch}, \
             {queries} queries and {keys} keys"
        ));
    }
    let device = &packed.cu_seqlens;
    if device.dtype != DType::I32 {
        return Err(TensorError::DtypeMismatch {
            op,
            lhs: DType::I32,
            rhs: device.dtype,
        });
    }
    if device.layout.shape() != [packed.host.len()] || !device.layout.is_contiguous() {
        return invalid(format!(
            "cu_seqlens must be dense [{}] like its host copy, got {:?}",
            packed.host.len(),
            device.layout.shape()
        ));
    }
    check_cu_seqlens(packed.host, queries)
}

/// `cu_seqlens` runs from 0 to `tokens` without decreasing and holds at least one sequence: the
/// rule of packed sequences (FlashAttention's varlen convention).
pub fn check_cu_seqlens(cu_seqlens: &[i32], tokens: usize) -> Result<()> {
    let invalid = |reason: String| {
        Err(TensorError::InvalidArgument {
            op: "attention",
            reason,
        })
    };
    match (cu_seqlens.first(), cu_seqlens.last()) {
        (Some(&0), Some(&last)) if cu_seqlens.len() >= 2 => {
            if usize::try_from(last).ok() != Some(tokens) {
                return invalid(format!(
                    "cu_seqlens must end at the token count {tokens}, got {last}"
                ));
            }
        }
        _ => {
            return invalid(format!(
                "cu_seqlens must start at 0 and hold at least two entries, got {cu_seqlens:?}"
            ))
        }
    }
    if let Some(at) = cu_seqlens.windows(2).position(|pair| pair[1] < pair[0]) {
        return invalid(format!(
            "cu_seqlens must not decrease, got {} then {} at entry {at}",
            cu_seqlens[at],
            cu_seqlens[at + 1]
        ));
    }
    Ok(())
}

/// The shape and dtype rule of [`Backend::matmul`], shared by every backend: `out = a @ b` over
/// equal batch dims, all three of one dtype, or f16/bf16 `a` and `b` with an f32 `out` (the
/// product's f32 accumulation, unrounded). Returns `(m, k, n)`.
pub fn matmul_dims(a: &View<'_>, b: &View<'_>, out: &View<'_>) -> Result<(usize, usize, usize)> {
    let nd = out.layout.ndim();
    let (sa, sb, so) = (a.layout.shape(), b.layout.shape(), out.layout.shape());
    let fits = nd >= 2
        && a.layout.ndim() == nd
        && b.layout.ndim() == nd
        && sa[..nd - 2] == so[..nd - 2]
        && sb[..nd - 2] == so[..nd - 2]
        && sa[nd - 2] == so[nd - 2]
        && sb[nd - 1] == so[nd - 1]
        && sa[nd - 1] == sb[nd - 2];
    if !fits {
        return Err(TensorError::ShapeMismatch {
            op: "matmul",
            lhs: sa.to_vec(),
            rhs: sb.to_vec(),
        });
    }
    if a.dtype != b.dtype {
        return Err(TensorError::DtypeMismatch {
            op: "matmul",
            lhs: a.dtype,
            rhs: b.dtype,
        });
    }
    // f16 and bf16 products accumulate in f32 on every backend, so an f32 `out` takes the
    // accumulation unrounded (and an accumulating product adds to it in f32).
    let widened = matches!(a.dtype, DType::F16 | DType::BF16) && out.dtype == DType::F32;
    if a.dtype != out.dtype && !widened {
        return Err(TensorError::DtypeMismatch {
            op: "matmul",
            lhs: a.dtype,
            rhs: out.dtype,
        });
    }
    Ok((so[nd - 2], sa[nd - 1], so[nd - 1]))
}

/// The shape rule of [`Backend::gather`] and [`Backend::scatter_add`], shared by every backend:
/// `index` is I64 with `data`'s rank and no larger than `data` off `dim`, and `other` (the
/// gathered output or the scattered source) has `index`'s shape. Returns `data`'s strides with
/// `dim`'s zeroed, which walk `data` over `index`'s shape; the index values are the backend's to
/// check.
pub fn index_strides(
    op: &'static str,
    data: &View<'_>,
    dim: usize,
    index: &View<'_>,
    other: &View<'_>,
) -> Result<Vec<usize>> {
    let nd = data.layout.ndim();
    let fits = index.dtype == DType::I64
        && dim < nd
        && index.layout.ndim() == nd
        && other.layout.shape() == index.layout.shape()
        && (0..nd).all(|d| d == dim || index.layout.shape()[d] <= data.layout.shape()[d]);
    if !fits {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: data.layout.shape().to_vec(),
            rhs: index.layout.shape().to_vec(),
        });
    }
    let mut strides = data.layout.strides().to_vec();
    strides[dim] = 0;
    Ok(strides)
}
