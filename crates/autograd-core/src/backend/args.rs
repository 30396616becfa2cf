//! The words of the backend trait: [`View`] (a tensor's elements as a primitive sees them), the
//! op families ([`UnaryOp`], [`BinaryOp`], [`ReduceOp`], [`MaskedOp`]), and the argument structs
//! of the fused primitives (layer norm, cross-entropy, attention, linear), each with the
//! [`Operands`] a backend checks and claims, and [`DropoutDraw`], which elements dropout keeps.
//!
//! It sits on buffers, layouts and dtypes; it knows no backend and no shape rule (`dims.rs`).

use smallvec::SmallVec;

use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::layout::Layout;

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

impl<'a> Operands<'a> {
    /// The operands of one primitive: the views it `writes` and those it `reads`, each given as
    /// a view or as an optional one (an absent optional operand is left out).
    pub fn new<W, R>(writes: W, reads: R) -> Self
    where
        W: IntoIterator,
        W::Item: Into<Option<View<'a>>>,
        R: IntoIterator,
        R::Item: Into<Option<View<'a>>>,
    {
        Operands {
            writes: writes.into_iter().filter_map(Into::into).collect(),
            reads: reads.into_iter().filter_map(Into::into).collect(),
        }
    }
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

impl<'a> LayerNormForward<'a> {
    /// `out`, `mean` and `rstd` written; `x`, `weight` and `bias` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [self.out, self.mean, self.rstd],
            [Some(self.x), self.weight, self.bias],
        )
    }
}

/// Inputs and outputs of [`Backend::reduce_with_index`](super::Backend::reduce_with_index): max
/// or min of `x` over its last dim, with the index of the first extreme element.
#[derive(Debug, Clone, Copy)]
pub struct ReduceWithIndex<'a> {
    /// [`ReduceOp::Max`] or [`ReduceOp::Min`].
    pub op: ReduceOp,
    /// The input.
    pub x: View<'a>,
    /// The extremes, dense, `x`'s leading dims.
    pub values: View<'a>,
    /// Their indices along the last dim, I64, like `values`.
    pub indices: View<'a>,
}

/// Inputs and outputs of [`Backend::softmax_backward`](super::Backend::softmax_backward): the
/// gradient of softmax (or log-softmax) along `dim` from the forward's output and its gradient.
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxBackward<'a> {
    /// The forward's output.
    pub y: View<'a>,
    /// Gradient of `y`, like it.
    pub dy: View<'a>,
    /// The dim the forward normalised over.
    pub dim: usize,
    /// The forward was log-softmax.
    pub log: bool,
    /// The input's gradient, dense like `y` (written, not accumulated).
    pub dx: View<'a>,
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

impl<'a> LayerNormBackward<'a> {
    /// The wanted gradients written; `dy`, `x`, `mean`, `rstd` and `weight` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [self.dx, self.dweight, self.dbias],
            [self.dy, self.x, self.mean, self.rstd]
                .into_iter()
                .chain(self.weight),
        )
    }
}

/// Which elements [`Backend::dropout`](super::Backend::dropout) keeps: element `i` (in row-major
/// order) is kept when [`uniform`](crate::uniform)`(seed, offset + i) >= p`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutDraw {
    /// The probability of zeroing an element, in `[0, 1]`.
    pub p: f64,
    /// The generator's seed.
    pub seed: u64,
    /// The counter of element 0.
    pub offset: u64,
}

impl DropoutDraw {
    /// Whether element `index` (row-major) is kept.
    pub fn keeps(&self, index: u64) -> bool {
        crate::random::uniform(self.seed, self.offset + index) >= self.p
    }

    /// What a kept element is multiplied by: `1 / (1 - p)`, or 0 when `p` is 1 (nothing is kept).
    pub fn scale(&self) -> f64 {
        if self.p < 1.0 {
            1.0 / (1.0 - self.p)
        } else {
            0.0
        }
    }

    /// The same test in integers, for kernels: element `index` is kept when the 24 random bits
    /// of its number (`uniform · 2^24`) are at least this, `ceil(p · 2^24)` (0 keeps everything,
    /// 2^24 nothing).
    ///
    /// ```
    /// use headroom_autograd_core::DropoutDraw;
    ///
    /// let draw = DropoutDraw { p: 0.1, seed: 7, offset: 0 };
    /// assert_eq!(draw.keep_threshold(), 1_677_722);
    /// assert_eq!(DropoutDraw { p: 0.0, ..draw }.keep_threshold(), 0);
    /// ```
    pub fn keep_threshold(&self) -> u32 {
        (self.p.clamp(0.0, 1.0) * f64::from(1u32 << 24)).ceil() as u32
    }
}

/// Inputs and outputs of fused scaled-dot-product attention,
/// `out = softmax(q kᵀ · scale, masked above the diagonal when causal) v`.
///
/// `q` is `[batch, heads, queries, head_dim]`, `k` and `v` `[batch, kv_heads, keys, head_dim]`
/// with `kv_heads` dividing `heads` (grouped-query attention: query head `h` reads key/value head
/// `h / (heads / kv_heads)`; `kv_heads == heads` is plain multi-head attention), `out` like `q`:
/// strided views whose last dim is contiguous (heads are views of a packed projection, and `out`
/// may be laid out `[batch, queries, heads, head_dim]` so merging the heads costs no copy). `lse`
/// is dense `[batch, heads, queries]` in f32 (f64 for f64 inputs): each query's log-sum-exp of
/// its scaled, masked scores, all backward needs besides the inputs. With `packed` the batch is
/// one row of sequences laid end to end, and no query sees a key of another sequence.
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
    /// Packed variable-length sequences (batch 1, as many queries as keys), or `None`.
    pub packed: Option<PackedBounds<'a>>,
    /// Dropout on the probabilities, or `None`: probability `(b, h, i, j)` is kept when
    /// [`DropoutDraw::keeps`] its index in the row-major `[batch, heads, queries, keys]`
    /// probability matrix (the mask `torch.nn.functional.dropout` would draw for that matrix from
    /// the same generator state), and kept ones are multiplied by [`DropoutDraw::scale`]. The
    /// log-sum-exp is of the undropped scores; backward replays the same mask from the draw.
    pub dropout: Option<DropoutDraw>,
    /// The result, like `q`.
    pub out: View<'a>,
    /// Per-query log-sum-exp, saved for backward.
    pub lse: View<'a>,
}

impl<'a> AttentionForward<'a> {
    /// `out` and `lse` written; `q`, `k`, `v` (and `cu_seqlens`) read.
    pub fn operands(&self) -> Operands<'a> {
        let cu_seqlens = self.packed.map(|packed| packed.cu_seqlens);
        Operands::new(
            [self.out, self.lse],
            [self.q, self.k, self.v].into_iter().chain(cu_seqlens),
        )
    }
}

/// The sequence boundaries of a packed attention batch (FlashAttention's varlen convention):
/// sequence `n` holds tokens `cu_seqlens[n]..cu_seqlens[n + 1]`, from 0 to the token count,
/// never decreasing (an empty sequence is allowed). Query `i` sees key `j` only when both lie in
/// one sequence (and `j <= i` when causal).
///
/// The same boundaries twice: `cu_seqlens` on the backend's device (I32, `[n_seqs + 1]`, dense),
/// which kernels read, and `host`, which shape checks and host-side planning read without a
/// device round trip. The caller keeps the two equal (autograd-core's `PackedSequences` does).
#[derive(Debug, Clone, Copy)]
pub struct PackedBounds<'a> {
    /// Cumulative sequence starts on the device, I32 `[n_seqs + 1]`.
    pub cu_seqlens: View<'a>,
    /// The same values in host memory.
    pub host: &'a [i32],
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

impl<'a> AttentionBackward<'a> {
    /// `dq`, `dk` and `dv` written; the forward's operands, output and log-sum-exp and `dout`
    /// read.
    pub fn operands(&self) -> Operands<'a> {
        let f = &self.forward;
        let cu_seqlens = f.packed.map(|packed| packed.cu_seqlens);
        Operands::new(
            [self.dq, self.dk, self.dv],
            [f.q, f.k, f.v, f.out, f.lse, self.dout]
                .into_iter()
                .chain(cu_seqlens),
        )
    }
}

/// What [`Backend::linear`](super::Backend::linear) applies after adding the bias.
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

/// Inputs and outputs of [`Backend::linear`](super::Backend::linear),
/// `out = epilogue(input weightᵀ + bias)` (`torch.nn.functional.linear`, optionally followed by
/// GELU).
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

impl<'a> LinearForward<'a> {
    /// `out` (and a GELU's `pre_activation`) written; `input`, `weight` and `bias` read.
    pub fn operands(&self) -> Operands<'a> {
        let pre_activation = match self.epilogue {
            LinearEpilogue::None => None,
            LinearEpilogue::Gelu { pre_activation } => Some(pre_activation),
        };
        Operands::new(
            [Some(self.out), pre_activation],
            [Some(self.input), Some(self.weight), self.bias],
        )
    }
}

/// Inputs and outputs of [`Backend::linear_weight_grad`](super::Backend::linear_weight_grad):
/// `grad_weight = grad_outᵀ input` and `grad_bias` the column sums of `grad_out`, both written
/// (not accumulated).
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

impl<'a> LinearWeightGrad<'a> {
    /// `grad_weight` (and `grad_bias`) written; `grad_out` and `input` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [Some(self.grad_weight), self.grad_bias],
            [self.grad_out, self.input],
        )
    }
}

/// Inputs and outputs of the fused RMSNorm forward (Hugging Face's `LlamaRMSNorm`):
/// `out = weight · round(x · rstd)`, `rstd = 1 / sqrt(mean(x²) + eps)` per row, where `round` is
/// the rounding to `x`'s dtype (the normalised value is computed in f32 for f16 and bf16 inputs,
/// then rounded, then scaled).
#[derive(Debug, Clone, Copy)]
pub struct RmsNormForward<'a> {
    /// Input, dense `[rows, n]` (normalised over `n`).
    pub x: View<'a>,
    /// Scale, `[n]`, of `x`'s dtype.
    pub weight: View<'a>,
    /// Added to the mean square.
    pub eps: f64,
    /// Output, dense, like `x`.
    pub out: View<'a>,
    /// Per-row `1/sqrt(mean(x²) + eps)`, dense `[rows]` in the stats dtype (f32, or f64 for
    /// f64 inputs), saved for backward.
    pub rstd: View<'a>,
}

impl<'a> RmsNormForward<'a> {
    /// `out` and `rstd` written; `x` and `weight` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new([self.out, self.rstd], [self.x, self.weight])
    }
}

/// Inputs and outputs of the fused RMSNorm backward: one pass over `x` and `dy`, the normalised
/// value recomputed from `x` and `rstd`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormBackward<'a> {
    /// Output gradient, dense `[rows, n]`.
    pub dy: View<'a>,
    /// The forward input, dense `[rows, n]`.
    pub x: View<'a>,
    /// Saved per-row rstd.
    pub rstd: View<'a>,
    /// The forward scale, `[n]`.
    pub weight: View<'a>,
    /// Input gradient, dense, if wanted.
    pub dx: Option<View<'a>>,
    /// Scale gradient (the column sums of `dy · round(x · rstd)`), dense `[n]`, if wanted.
    pub dweight: Option<View<'a>>,
}

impl<'a> RmsNormBackward<'a> {
    /// The wanted gradients written; `dy`, `x`, `rstd` and `weight` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [self.dx, self.dweight],
            [self.dy, self.x, self.rstd, self.weight],
        )
    }
}

/// The two halves of a SwiGLU: `gate` and `up` (or their gradients), `[rows, n]` views with a
/// contiguous last dim. Their row strides are free, so both may be halves of one packed
/// `[rows, 2n]` projection.
#[derive(Debug, Clone, Copy)]
pub struct GateUp<'a> {
    /// The gate projection (through SiLU).
    pub gate: View<'a>,
    /// The up projection.
    pub up: View<'a>,
}

/// Inputs and outputs of the fused SwiGLU, `out = silu(gate) · up` with
/// `silu(g) = g / (1 + e^-g)`, computed in f32 for f16 and bf16; `out` is dense `[rows, n]`.
#[derive(Debug, Clone, Copy)]
pub struct SwiGluForward<'a> {
    /// Gate and up.
    pub inputs: GateUp<'a>,
    /// The result.
    pub out: View<'a>,
}

impl<'a> SwiGluForward<'a> {
    /// `out` written; `gate` and `up` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new([self.out], [self.inputs.gate, self.inputs.up])
    }
}

/// Inputs and outputs of the fused SwiGLU backward: `silu(gate)` and its derivative are
/// recomputed from `gate`, so the forward saves only its two inputs.
/// `dgate = dout · up · silu'(gate)`, `dup = dout · silu(gate)`; `dout` and the gradients dense
/// `[rows, n]`.
#[derive(Debug, Clone, Copy)]
pub struct SwiGluBackward<'a> {
    /// The forward's gate and up.
    pub inputs: GateUp<'a>,
    /// Gradient of the output.
    pub dout: View<'a>,
    /// Their gradients (written).
    pub grads: GateUp<'a>,
}

impl<'a> SwiGluBackward<'a> {
    /// `dgate` and `dup` written; `gate`, `up` and `dout` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [self.grads.gate, self.grads.up],
            [self.inputs.gate, self.inputs.up, self.dout],
        )
    }
}

/// Inputs and outputs of the fused rotary embedding (Hugging Face's `apply_rotary_pos_emb`,
/// `rotate_half` convention: element `j` of a head's first half pairs with element `j + d/2`).
///
/// Forward: `out = x · cos + rotate_half(x) · sin`, i.e. `out₁ = x₁ cos₁ − x₂ sin₁` and
/// `out₂ = x₂ cos₂ + x₁ sin₂` for the halves of each head. With `transpose` it applies the
/// transposed map, `out₁ = x₁ cos₁ + x₂ sin₂` and `out₂ = x₂ cos₂ − x₁ sin₁`: the backward, whose
/// input is the output gradient, so it needs no saved activation.
///
/// `x` and `out` are `[.., seq, head_dim]` (up to four dims, any strides, `head_dim` even);
/// `cos` and `sin` are dense `[seq, head_dim]` of `x`'s dtype. Computed in f32 for f16 and bf16.
#[derive(Debug, Clone, Copy)]
pub struct RotaryArgs<'a> {
    /// Input (the projection's heads, or the output gradient with `transpose`).
    pub x: View<'a>,
    /// Cosine table.
    pub cos: View<'a>,
    /// Sine table.
    pub sin: View<'a>,
    /// Apply the transposed (inverse) rotation.
    pub transpose: bool,
    /// The result, like `x`.
    pub out: View<'a>,
}

impl<'a> RotaryArgs<'a> {
    /// `out` written; `x`, `cos` and `sin` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new([self.out], [self.x, self.cos, self.sin])
    }
}
