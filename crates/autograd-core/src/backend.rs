//! The backend trait: the primitives a device must run for every tensor op of the crate.
//!
//! # Design
//!
//! [`Backend`] has **28 methods**: 7 for the device and its memory (`device`, `into_any`,
//! `allocate`, `free`, `memory_stats`, `write_host`, `read_host`) and 21 compute primitives, 2 of
//! which (`linear`, `linear_weight_grad`) have default bodies composed of the others. The engine
//! and every op in `crate::ops` are written once on top of it; ops-cpu and ops-cuda implement it.
//! The technique seams (autocast, saved-tensor sites, backward-end callbacks, the non-finite
//! check) added no method: they are written with these. The reasoning:
//!
//! - **Primitives take strided views and write into a caller-allocated output.** The core
//!   allocates every output from the backend's caching allocator, so memory accounting lives in
//!   one place, and the same primitive serves out-of-place ops, in-place ops (`out` is the input)
//!   and `out=` variants. Inputs arrive already broadcast (stride-0 dims), so a backend iterates
//!   one shape, never broadcasts.
//! - **dtype is a run-time value** carried by each [`View`]; a backend dispatches on it and
//!   answers [`TensorError::UnsupportedDtype`](crate::TensorError) for what it lacks.
//! - **Op families are enums, not methods.** [`UnaryOp`], [`BinaryOp`], [`ReduceOp`] and
//!   [`MaskedOp`] keep the trait small: a new activation is a variant, not a method to forward
//!   through every decorator.
//! - **A fused primitive exists only where composing primitives would cost an extra memory pass
//!   or extra saved memory**: softmax (one read, one write, and its backward), layer norm (forward
//!   saves only mean and rstd; backward is one pass), cross-entropy (saves one log-sum-exp per
//!   row instead of a log-softmax matrix), dropout (mask and output in one pass), attention
//!   (saves one log-sum-exp per query instead of a `[seq, seq]` probability matrix per head), linear
//!   (a GEMM library adds the bias and writes the bias gradient in its epilogue, saving a pass
//!   each way; the default bodies compose `copy`, `matmul`, `unary` and `reduce`, so a backend
//!   without such a library implements nothing). Everything else (mean, patch embedding,
//!   cat/split, pow backward, ...) is composed in `crate::ops`.
//! - **No device types.** Views carry a [`Buffer`], whose address is a `u64`; no CUDA stream,
//!   handle or pointer type appears here.
//!
//! Contract for implementors: the trait is safe and [`View`]'s fields are public, so a backend
//! trusts no view. Before it touches memory, every primitive runs
//! [`check_operands`](crate::check_operands) with its own allocator's id (each view inside its
//! buffer, the buffer's memory from that allocator, no output reaching an element twice, outputs
//! sharing memory with inputs only as the very same view of an elementwise primitive,
//! [`Aliasing`](crate::Aliasing)), and checks `Buffer::check_owner` in the host transfers. A
//! backend that computes on the host also claims the operands' buffers
//! ([`claim_operands`](crate::claim_operands)) for the kernel, since tensors are `Send + Sync`.
//! Output views are dense (contiguous) unless the method says otherwise; `copy`, `fill`,
//! `scatter_add` and the elementwise primitives may write through a strided view, and an
//! elementwise output may be the same view as an input.

use std::sync::Arc;

use headroom_caching_allocator::{Allocation, MemoryStats};
use smallvec::SmallVec;

use crate::buffer::Buffer;
use crate::dtype::{stats_dtype, DType, Device};
use crate::error::{Result, TensorError};
use crate::layout::Layout;

/// A shared handle to a backend; tensors hold one through their storage.
pub type BackendRef = Arc<dyn Backend>;

/// A tensor's elements as a backend sees them: memory, layout and element type.
///
/// The fields are public, so a view proves nothing by existing: a backend checks it at the
/// primitive's entry ([`check_operands`](crate::check_operands)). A view from
/// [`Tensor::view`](crate::Tensor::view) always passes the bounds part.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    /// The storage.
    pub buffer: &'a Buffer,
    /// Where the elements are, in elements of `dtype`.
    pub layout: &'a Layout,
    /// The element type.
    pub dtype: DType,
}

/// Elementwise functions of one tensor (some with a scalar parameter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// Natural logarithm.
    Log,
    /// Square root.
    Sqrt,
    /// `1 / sqrt(x)`
    Rsqrt,
    /// Hyperbolic tangent.
    Tanh,
    /// `max(x, 0)`
    Relu,
    /// `x * Φ(x)` with the exact normal CDF.
    Gelu,
    /// GELU's tanh approximation (`approximate="tanh"`).
    GeluTanh,
    /// `x + c`
    AddScalar(f64),
    /// `x * c`
    MulScalar(f64),
    /// `x / c`
    DivScalar(f64),
    /// `x ^ c`
    PowScalar(f64),
}

/// Elementwise functions of two tensors of one shape (inputs already broadcast).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// `a ^ b`
    Pow,
    /// Gradient of relu: `a * (b > 0)` with `a` the output gradient and `b` the input.
    ReluBackward,
    /// Gradient of exact GELU: `a * gelu'(b)`.
    GeluBackward,
    /// Gradient of tanh-approximated GELU: `a * gelu_tanh'(b)`.
    GeluTanhBackward,
    /// Gradient of tanh from its output: `a * (1 - b²)`.
    TanhBackward,
    /// Gradient of sqrt from its output: `a / (2b)`.
    SqrtBackward,
    /// Gradient of rsqrt from its output: `-a * b³ / 2`.
    RsqrtBackward,
}

/// Reductions over the trailing dims of a view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Arithmetic mean (sum and divide in one pass).
    Mean,
    /// Largest element.
    Max,
    /// Smallest element.
    Min,
}

/// Elementwise functions of a tensor and a boolean mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaskedOp {
    /// `mask ? c : x` (`masked_fill`).
    Fill(f64),
    /// `mask ? x * c : 0` (dropout's forward and backward).
    Scale(f64),
}

/// How cross-entropy combines the per-sample losses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Mean over the samples whose target is not `ignore_index`.
    Mean,
    /// Sum over the samples.
    Sum,
}

/// Inputs of the fused layer-norm forward; `x` is dense `[rows, n]` (normalised over `n`).
#[derive(Debug, Clone, Copy)]
pub struct LayerNormForward<'a> {
    /// Input.
    pub x: View<'a>,
    /// Scale, `[n]`, if any.
    pub weight: Option<View<'a>>,
    /// Shift, `[n]`, if any.
    pub bias: Option<View<'a>>,
    /// Added to the variance.
    pub eps: f64,
    /// Output, like `x`.
    pub out: View<'a>,
    /// Per-row mean, `[rows]`, saved for backward.
    pub mean: View<'a>,
    /// Per-row `1/sqrt(var + eps)`, `[rows]`, saved for backward.
    pub rstd: View<'a>,
}

/// Inputs and outputs of the fused layer-norm backward (one pass over `x` and `dy`).
#[derive(Debug, Clone, Copy)]
pub struct LayerNormBackward<'a> {
    /// Output gradient, dense `[rows, n]`.
    pub dy: View<'a>,
    /// The forward input, dense `[rows, n]`.
    pub x: View<'a>,
    /// Saved per-row mean.
    pub mean: View<'a>,
    /// Saved per-row rstd.
    pub rstd: View<'a>,
    /// The forward scale, if any.
    pub weight: Option<View<'a>>,
    /// Input gradient, if wanted.
    pub dx: Option<View<'a>>,
    /// Scale gradient, if wanted.
    pub dweight: Option<View<'a>>,
    /// Shift gradient, if wanted.
    pub dbias: Option<View<'a>>,
}

/// Inputs and outputs of fused cross-entropy (log-softmax + NLL over the last dim).
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyArgs<'a> {
    /// Logits, dense `[rows, classes]`.
    pub logits: View<'a>,
    /// Class indices, `[rows]`, I64.
    pub target: View<'a>,
    /// Samples with this target contribute nothing.
    pub ignore_index: i64,
    /// How to combine per-sample losses.
    pub reduction: Reduction,
}

/// Inputs and outputs of fused scaled-dot-product attention,
/// `out = softmax(q kᵀ · scale, masked above the diagonal when causal) v`.
///
/// `q` is `[batch, heads, queries, head_dim]`, `k` and `v` `[batch, heads, keys, head_dim]`,
/// `out` like `q`: strided views whose last dim is contiguous (heads are views of a packed
/// projection, and `out` may be laid out `[batch, queries, heads, head_dim]` so merging the heads
/// costs no copy). `lse` is dense `[batch, heads, queries]` in f32 (f64 for f64 inputs): each
/// query's log-sum-exp of its scaled, masked scores, all backward needs besides the inputs.
#[derive(Debug, Clone, Copy)]
pub struct AttentionForward<'a> {
    /// Queries.
    pub q: View<'a>,
    /// Keys.
    pub k: View<'a>,
    /// Values.
    pub v: View<'a>,
    /// Multiplies the scores (PyTorch's default is `1 / sqrt(head_dim)`).
    pub scale: f64,
    /// Key `j` is hidden from query `i` when `j > i` (requires as many queries as keys).
    pub causal: bool,
    /// The result, like `q`.
    pub out: View<'a>,
    /// Per-query log-sum-exp, saved for backward.
    pub lse: View<'a>,
}

/// Inputs and outputs of the fused attention backward: the forward's operands, its output and
/// log-sum-exp, the output gradient, and the three input gradients (strided like the forward's
/// views, last dim contiguous; written, not accumulated).
#[derive(Debug, Clone, Copy)]
pub struct AttentionBackward<'a> {
    /// The forward's operands and options (`out` and `lse` are its results).
    pub forward: AttentionForward<'a>,
    /// Gradient of `out`.
    pub dout: View<'a>,
    /// Gradient of `q`.
    pub dq: View<'a>,
    /// Gradient of `k`.
    pub dk: View<'a>,
    /// Gradient of `v`.
    pub dv: View<'a>,
}

/// What [`Backend::linear`] applies after adding the bias.
#[derive(Debug, Clone, Copy)]
pub enum LinearEpilogue<'a> {
    /// `out = input weightᵀ + bias`.
    None,
    /// `pre_activation = input weightᵀ + bias`, then `out = gelu(pre_activation)` with the exact
    /// normal CDF (`torch.nn.GELU()`); `pre_activation` (dense, like `out`) is what the GELU's
    /// backward needs.
    Gelu {
        /// Receives the product plus bias.
        pre_activation: View<'a>,
    },
}

/// Inputs and outputs of [`Backend::linear`], `out = epilogue(input weightᵀ + bias)`
/// (`torch.nn.functional.linear`, optionally followed by GELU).
#[derive(Debug, Clone, Copy)]
pub struct LinearForward<'a> {
    /// `[rows, in]`, possibly strided.
    pub input: View<'a>,
    /// `[out, in]` as a `Linear` layer stores it, possibly strided.
    pub weight: View<'a>,
    /// `[out]`, if any.
    pub bias: Option<View<'a>>,
    /// What follows the bias.
    pub epilogue: LinearEpilogue<'a>,
    /// The result, dense `[rows, out]`.
    pub out: View<'a>,
}

/// Inputs and outputs of [`Backend::linear_weight_grad`]: `grad_weight = grad_outᵀ input` and
/// `grad_bias` the column sums of `grad_out`, both written (not accumulated).
#[derive(Debug, Clone, Copy)]
pub struct LinearWeightGrad<'a> {
    /// Gradient of the linear's output, `[rows, out]`, possibly strided.
    pub grad_out: View<'a>,
    /// The forward input, `[rows, in]`, possibly strided.
    pub input: View<'a>,
    /// Weight gradient, dense `[out, in]`.
    pub grad_weight: View<'a>,
    /// Bias gradient, dense `[out]`, if wanted.
    pub grad_bias: Option<View<'a>>,
}

/// What a fused primitive writes and reads, as [`check_operands`](crate::check_operands) and
/// [`claim_operands`](crate::claim_operands) take them: one list per argument struct, so every
/// backend checks the same views (optional ones included when present).
#[derive(Debug, Clone, Default)]
pub struct Operands<'a> {
    /// The outputs (written, possibly also read).
    pub writes: SmallVec<[View<'a>; 4]>,
    /// The inputs (only read).
    pub reads: SmallVec<[View<'a>; 8]>,
}

impl<'a> LayerNormForward<'a> {
    /// `out`, `mean` and `rstd` written; `x`, `weight` and `bias` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands {
            writes: [self.out, self.mean, self.rstd].into_iter().collect(),
            reads: [Some(self.x), self.weight, self.bias]
                .into_iter()
                .flatten()
                .collect(),
        }
    }
}

impl<'a> LayerNormBackward<'a> {
    /// The wanted gradients written; `dy`, `x`, `mean`, `rstd` and `weight` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands {
            writes: [self.dx, self.dweight, self.dbias]
                .into_iter()
                .flatten()
                .collect(),
            reads: [
                Some(self.dy),
                Some(self.x),
                Some(self.mean),
                Some(self.rstd),
            ]
            .into_iter()
            .chain([self.weight])
            .flatten()
            .collect(),
        }
    }
}

impl<'a> AttentionForward<'a> {
    /// `out` and `lse` written; `q`, `k` and `v` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands {
            writes: [self.out, self.lse].into_iter().collect(),
            reads: [self.q, self.k, self.v].into_iter().collect(),
        }
    }
}

impl<'a> AttentionBackward<'a> {
    /// `dq`, `dk` and `dv` written; the forward's operands, output and log-sum-exp and `dout`
    /// read.
    pub fn operands(&self) -> Operands<'a> {
        let f = &self.forward;
        Operands {
            writes: [self.dq, self.dk, self.dv].into_iter().collect(),
            reads: [f.q, f.k, f.v, f.out, f.lse, self.dout]
                .into_iter()
                .collect(),
        }
    }
}

impl<'a> LinearForward<'a> {
    /// `out` (and a GELU's `pre_activation`) written; `input`, `weight` and `bias` read.
    pub fn operands(&self) -> Operands<'a> {
        let pre_activation = match self.epilogue {
            LinearEpilogue::None => None,
            LinearEpilogue::Gelu { pre_activation } => Some(pre_activation),
        };
        Operands {
            writes: [Some(self.out), pre_activation]
                .into_iter()
                .flatten()
                .collect(),
            reads: [Some(self.input), Some(self.weight), self.bias]
                .into_iter()
                .flatten()
                .collect(),
        }
    }
}

impl<'a> LinearWeightGrad<'a> {
    /// `grad_weight` (and `grad_bias`) written; `grad_out` and `input` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands {
            writes: [Some(self.grad_weight), self.grad_bias]
                .into_iter()
                .flatten()
                .collect(),
            reads: [self.grad_out, self.input].into_iter().collect(),
        }
    }
}

/// The shape and dtype rule of [`Backend::linear`], shared by every backend: 2-D `input` and
/// `weight` with one inner size, `bias` `[out]`, `out` (and a GELU's `pre_activation`) dense
/// `[rows, out]`, all of one dtype. Returns `(rows, in, out)`.
pub fn linear_dims(args: &LinearForward<'_>) -> Result<(usize, usize, usize)> {
    let (&[rows, in_features], &[out_features, weight_in]) =
        (args.input.layout.shape(), args.weight.layout.shape())
    else {
        return Err(linear_mismatch(&args.input, &args.weight));
    };
    if weight_in != in_features {
        return Err(linear_mismatch(&args.input, &args.weight));
    }
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
    let (&[rows, out_features], &[input_rows, in_features]) =
        (args.grad_out.layout.shape(), args.input.layout.shape())
    else {
        return Err(linear_mismatch(&args.grad_out, &args.input));
    };
    if input_rows != rows {
        return Err(linear_mismatch(&args.grad_out, &args.input));
    }
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
    /// Heads.
    pub heads: usize,
    /// Query positions.
    pub queries: usize,
    /// Key (and value) positions.
    pub keys: usize,
    /// Elements per head (queries, keys and values alike).
    pub head_dim: usize,
}

/// The shape, dtype and layout rule of [`Backend::attention`] and its backward, shared by every
/// backend: 4-D operands of one float dtype with a contiguous last dim, `lse` dense in f32 (f64
/// for f64), equal query and key counts when causal; `grads` (`dout`, `dq`, `dk`, `dv`) are
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
    let kv_shape = [batch, heads, keys, head_dim];
    if args.k.layout.shape() != kv_shape {
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
        queries,
        keys,
        head_dim,
    })
}

/// The shape and dtype rule of [`Backend::matmul`], shared by every backend: `out = a @ b` over
/// equal batch dims, all three of one dtype. Returns `(m, k, n)`.
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
    if a.dtype != b.dtype || a.dtype != out.dtype {
        return Err(TensorError::DtypeMismatch {
            op: "matmul",
            lhs: a.dtype,
            rhs: b.dtype,
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

/// A device that stores tensors and runs the core's primitives. See the module docs.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// The device this backend drives.
    fn device(&self) -> Device;

    /// The backend as `Any`, so a crate with kernels of its own for one device (optim's CUDA
    /// updates) can reach the concrete backend: `backend.clone().into_any().downcast::<T>()`.
    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;

    /// Allocates `bytes` from this backend's caching allocator.
    fn allocate(&self, bytes: u64) -> Result<Allocation>;

    /// Returns an allocation. Called from `Drop`, so it cannot fail: a backend records an error
    /// from its allocator where the user can query it, and never panics.
    fn free(&self, allocation: Allocation);

    /// The allocator's statistics (`allocated_bytes.all.current` is `memory_allocated()`).
    fn memory_stats(&self) -> MemoryStats;

    /// Copies host bytes into `dst` starting `byte_offset` bytes in.
    fn write_host(&self, dst: &Buffer, byte_offset: usize, data: &[u8]) -> Result<()>;

    /// Copies bytes of `src` starting `byte_offset` bytes in to the host.
    fn read_host(&self, src: &Buffer, byte_offset: usize, out: &mut [u8]) -> Result<()>;

    /// `dst = src` elementwise, converting dtype; `dst` may be strided, shapes are equal.
    fn copy(&self, src: View<'_>, dst: View<'_>) -> Result<()>;

    /// Sets every element of `dst` (possibly strided) to `value` converted to its dtype.
    fn fill(&self, dst: View<'_>, value: f64) -> Result<()>;

    /// `out = op(x)`; shapes and dtypes are equal.
    fn unary(&self, op: UnaryOp, x: View<'_>, out: View<'_>) -> Result<()>;

    /// `out = op(a, b)`; shapes and dtypes are equal.
    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: View<'_>) -> Result<()>;

    /// `out = op(x, mask)`; `mask` is Bool or U8 of the same shape.
    fn masked(&self, op: MaskedOp, x: View<'_>, mask: View<'_>, out: View<'_>) -> Result<()>;

    /// Reduces the last `n_reduced` dims of `x` into dense `out`, whose shape is the leading
    /// dims of `x`.
    fn reduce(&self, op: ReduceOp, x: View<'_>, n_reduced: usize, out: View<'_>) -> Result<()>;

    /// Max or min over the last dim of `x`, with the index (I64) of the first extreme element.
    fn reduce_with_index(
        &self,
        op: ReduceOp,
        x: View<'_>,
        values: View<'_>,
        indices: View<'_>,
    ) -> Result<()>;

    /// Batched matrix product over equal batch dims: `out[.., m, n] (+)= a[.., m, k] b[.., k, n]`.
    /// Inputs may be strided (transposes are free); `accumulate` adds to `out`.
    fn matmul(&self, a: View<'_>, b: View<'_>, out: View<'_>, accumulate: bool) -> Result<()>;

    /// `out = epilogue(input weightᵀ + bias)`: the forward of a linear layer, optionally followed
    /// by GELU (see [`LinearForward`]). The default body is [`compose_linear`].
    fn linear(&self, args: LinearForward<'_>) -> Result<()> {
        compose_linear(self, args)
    }

    /// A linear layer's weight gradient and, if asked, its bias gradient in one call (see
    /// [`LinearWeightGrad`]). The default body is [`compose_linear_weight_grad`].
    fn linear_weight_grad(&self, args: LinearWeightGrad<'_>) -> Result<()> {
        compose_linear_weight_grad(self, args)
    }

    /// Softmax (or log-softmax) of `x` along `dim` into dense `out`.
    fn softmax(&self, x: View<'_>, dim: usize, log: bool, out: View<'_>) -> Result<()>;

    /// Gradient of softmax (or log-softmax) from its output `y` and output gradient `dy`.
    fn softmax_backward(
        &self,
        y: View<'_>,
        dy: View<'_>,
        dim: usize,
        log: bool,
        dx: View<'_>,
    ) -> Result<()>;

    /// Fused layer-norm forward.
    fn layer_norm(&self, args: LayerNormForward<'_>) -> Result<()>;

    /// Fused layer-norm backward.
    fn layer_norm_backward(&self, args: LayerNormBackward<'_>) -> Result<()>;

    /// Fused cross-entropy: writes the reduced loss (a 0-dim view) and each row's log-sum-exp.
    /// The loss has the logits' dtype, or f32 for f16 and bf16 logits ([`crate::cross_entropy_f32`]).
    fn cross_entropy(
        &self,
        args: CrossEntropyArgs<'_>,
        loss: View<'_>,
        lse: View<'_>,
    ) -> Result<()>;

    /// Gradient of fused cross-entropy w.r.t. the logits, scaled by the 0-dim `dloss` (of the
    /// loss's dtype: the logits', or f32 for f16 and bf16 logits).
    fn cross_entropy_backward(
        &self,
        args: CrossEntropyArgs<'_>,
        lse: View<'_>,
        dloss: View<'_>,
        dlogits: View<'_>,
    ) -> Result<()>;

    /// `out[i][j] = x[i][index[i][j]]` along `dim` (PyTorch's `gather`); `index` is I64 with
    /// `out`'s shape (often expanded).
    fn gather(&self, x: View<'_>, dim: usize, index: View<'_>, out: View<'_>) -> Result<()>;

    /// `dst[i][index[i][j]] += src[i][j]` along `dim` (PyTorch's `scatter_add_`).
    fn scatter_add(&self, dst: View<'_>, dim: usize, index: View<'_>, src: View<'_>) -> Result<()>;

    /// Fused scaled-dot-product attention: no `[queries, keys]` matrix reaches memory.
    fn attention(&self, args: AttentionForward<'_>) -> Result<()>;

    /// Gradients of fused attention, recomputing the probabilities from `lse`.
    fn attention_backward(&self, args: AttentionBackward<'_>) -> Result<()>;

    /// Dropout in one pass: element `i` is kept with probability `1 - p` when
    /// `crate::random::uniform(seed, offset + i) >= p`; `out = kept ? x / (1 - p) : 0` and
    /// `mask` (Bool) records which were kept.
    fn dropout(
        &self,
        x: View<'_>,
        p: f64,
        seed: u64,
        offset: u64,
        out: View<'_>,
        mask: View<'_>,
    ) -> Result<()>;
}
