//! Fused scaled-dot-product attention (`torch.nn.functional.scaled_dot_product_attention` without
//! a mask tensor): one backend primitive forward and one backward.
//!
//! Dropout on the probabilities ([`scaled_dot_product_attention_dropout`]) stores no mask: the
//! forward takes one draw of `batch · heads · queries · keys` numbers from a [`Generator`], the
//! backends derive each probability's keep bit from its index in that draw, and backward replays
//! the same draw. The mask is the one `dropout` would draw for the materialised
//! `[batch, heads, queries, keys]` probabilities from the same generator state, so the fused and
//! the composed forms train alike.
//!
//! The composed form `softmax(q kᵀ · scale) v` materialises a `[queries, keys]` score matrix per
//! head (and saves the probabilities for backward); the fused primitive keeps each query's
//! log-sum-exp instead, and backward recomputes the probabilities from it — what PyTorch's
//! memory-efficient and flash kernels do. The result is allocated `[batch, queries, heads,
//! head_dim]` and returned as the `[batch, heads, queries, head_dim]` view, so merging the heads
//! afterwards (permute + reshape) is free; the input gradients are laid out the same way for the
//! same reason on the way back, and for a packed q/k/v projection as thirds of one gradient (see
//! `input_grads`).
//!
//! Grouped-query attention needs no copy: k and v may have fewer heads than q (a divisor of
//! q's), and the backend reads key/value head `h / group` for query head `h`; their gradients
//! come back with k's and v's head count, each the sum over its group. Packed variable-length
//! sequences ([`PackedSequences`], FlashAttention's `cu_seqlens`) go through
//! [`scaled_dot_product_attention_varlen`]: one batch row of sequences laid end to end, no query
//! seeing another sequence's keys, and the backends skip the tiles that would only be masked.

use crate::autocast::autocast_args;
use crate::backend::{
    check_cu_seqlens, AttentionBackward, AttentionForward, DropoutDraw, PackedBounds,
};
use crate::dtype::{stats_dtype, DType};
use crate::error::{Result, TensorError};
use crate::graph::record;
use crate::layout::Layout;
use crate::random::Generator;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_device, check_float, check_same, records};

/// The boundaries of packed variable-length sequences for
/// [`scaled_dot_product_attention_varlen`] (FlashAttention's `cu_seqlens`): sequence `n` holds
/// tokens `cu_seqlens[n]..cu_seqlens[n + 1]` of one batch row, from 0 to the token count without
/// decreasing. Kept twice, checked once: in host memory (for shape checks and host-side planning)
/// and as an I32 tensor on the device (which kernels read), so a model reuses one value across
/// all its layers and their backward with no device round trip.
#[derive(Debug, Clone)]
pub struct PackedSequences {
    host: Vec<i32>,
    device: Tensor,
}

impl PackedSequences {
    /// Boundaries from host values, uploaded to `backend`. Fails with
    /// [`TensorError::InvalidArgument`] unless they start at 0, never decrease and hold at least
    /// one sequence.
    pub fn new(
        backend: &crate::backend::BackendRef,
        cu_seqlens: &[i32],
    ) -> Result<PackedSequences> {
        let total = cu_seqlens.last().map_or(0, |&last| last.max(0) as usize);
        check_cu_seqlens(cu_seqlens, total)?;
        Ok(PackedSequences {
            host: cu_seqlens.to_vec(),
            device: Tensor::from_slice(backend, cu_seqlens, &[cu_seqlens.len()])?,
        })
    }

    /// Boundaries from a 1-D I32 tensor (read back to the host once). Fails with
    /// [`TensorError::DtypeMismatch`] for another dtype and as [`PackedSequences::new`] for bad
    /// values.
    pub fn from_tensor(cu_seqlens: &Tensor) -> Result<PackedSequences> {
        if cu_seqlens.dtype() != DType::I32 {
            return Err(TensorError::DtypeMismatch {
                op: "scaled_dot_product_attention_varlen",
                lhs: DType::I32,
                rhs: cu_seqlens.dtype(),
            });
        }
        if cu_seqlens.ndim() != 1 {
            return Err(TensorError::InvalidArgument {
                op: "scaled_dot_product_attention_varlen",
                reason: format!("cu_seqlens must be 1-D, got {:?}", cu_seqlens.shape()),
            });
        }
        PackedSequences::new(cu_seqlens.backend(), &cu_seqlens.to_vec::<i32>()?)
    }

    /// Sequences packed, lengths `lengths`, from 0 (each length at most `i32::MAX` in total).
    pub fn from_lengths(
        backend: &crate::backend::BackendRef,
        lengths: &[usize],
    ) -> Result<PackedSequences> {
        let mut cu_seqlens = Vec::with_capacity(lengths.len() + 1);
        let mut total = 0usize;
        cu_seqlens.push(0);
        for &length in lengths {
            total += length;
            cu_seqlens.push(
                i32::try_from(total).map_err(|_| TensorError::InvalidArgument {
                    op: "scaled_dot_product_attention_varlen",
                    reason: format!("{total} packed tokens exceed cu_seqlens' i32"),
                })?,
            );
        }
        PackedSequences::new(backend, &cu_seqlens)
    }

    /// The cumulative starts, `[n_seqs + 1]`.
    pub fn cu_seqlens(&self) -> &[i32] {
        &self.host
    }

    /// The same on the device: I32 `[n_seqs + 1]`.
    pub fn device(&self) -> &Tensor {
        &self.device
    }

    /// Number of sequences.
    pub fn n_seqs(&self) -> usize {
        self.host.len() - 1
    }

    /// Tokens in all sequences together.
    pub fn total_tokens(&self) -> usize {
        self.host.last().map_or(0, |&last| last as usize)
    }

    /// Each token's position within its sequence (0 at every sequence start): the position ids
    /// of rotary embeddings for a packed batch.
    pub fn positions(&self) -> Vec<usize> {
        self.host
            .windows(2)
            .flat_map(|pair| 0..(pair[1] - pair[0]) as usize)
            .collect()
    }

    /// The longest sequence's length.
    pub fn max_len(&self) -> usize {
        self.host
            .windows(2)
            .map(|pair| (pair[1] - pair[0]) as usize)
            .max()
            .unwrap_or(0)
    }

    fn bounds(&self) -> PackedBounds<'_> {
        PackedBounds {
            cu_seqlens: self.device.view(),
            host: &self.host,
        }
    }
}

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
    packed: Option<&'a PackedSequences>,
    dropout: Option<DropoutDraw>,
) -> AttentionForward<'a> {
    AttentionForward {
        q: q.view(),
        k: k.view(),
        v: v.view(),
        scale,
        causal,
        packed: packed.map(PackedSequences::bounds),
        dropout,
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
/// (`[batch, kv_heads, keys, head_dim]`, `kv_heads` a divisor of `heads`: query head `h` reads
/// key/value head `h / (heads / kv_heads)`, PyTorch's `enable_gqa`): `softmax(q kᵀ · scale) v`,
/// with key `j` hidden from query `i` when `causal` and `j > i`. `scale` defaults to
/// `1 / sqrt(head_dim)`. Differentiable in all three inputs; saves the inputs, the output and one
/// log-sum-exp per query.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: Option<f64>,
) -> Result<Tensor> {
    attention(
        "scaled_dot_product_attention",
        [q, k, v],
        causal,
        scale,
        None,
        None,
    )
}

/// [`scaled_dot_product_attention`] with dropout on the probabilities (PyTorch's `dropout_p`,
/// for training): each is zeroed with probability `p` and the rest scaled by `1 / (1 - p)`,
/// drawn from `generator` (one draw of `batch · heads · queries · keys` numbers, the mask
/// `dropout` would draw for the materialised probabilities). No mask is stored: backward replays
/// the draw. `p` 0 is plain attention; `p` outside `[0, 1]` is
/// [`TensorError::InvalidArgument`].
///
/// ```
/// use headroom_autograd_core::{
///     scaled_dot_product_attention, scaled_dot_product_attention_dropout, Generator, Tensor,
/// };
/// use headroom_ops_cpu::CpuBackend;
///
/// let cpu = CpuBackend::new_ref();
/// let values: Vec<f32> = (0..2 * 4 * 8).map(|i| (i % 7) as f32 / 7.0).collect();
/// let q = Tensor::from_slice(&cpu, &values, &[1, 2, 4, 8]).unwrap();
/// let generator = Generator::new(0);
/// let dropped =
///     scaled_dot_product_attention_dropout(&q, &q, &q, true, None, 0.5, &generator).unwrap();
/// // One draw of batch · heads · queries · keys numbers; backward replays it.
/// assert_eq!(generator.state().offset, 2 * 4 * 4);
/// let plain = scaled_dot_product_attention(&q, &q, &q, true, None).unwrap();
/// assert_eq!(dropped.shape(), plain.shape());
/// assert_ne!(dropped.to_vec_f64().unwrap(), plain.to_vec_f64().unwrap());
/// ```
pub fn scaled_dot_product_attention_dropout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: Option<f64>,
    p: f64,
    generator: &Generator,
) -> Result<Tensor> {
    attention(
        "scaled_dot_product_attention",
        [q, k, v],
        causal,
        scale,
        None,
        Some((p, generator)),
    )
}

/// [`scaled_dot_product_attention`] over packed variable-length sequences: `q`, `k` and `v` are
/// one batch row (`[1, heads, tokens, head_dim]`, k and v possibly with fewer heads) holding the
/// sequences of `packed` end to end, `tokens == packed.total_tokens()`; query `i` sees key `j`
/// only when both lie in one sequence (and `j <= i` when `causal`). The result equals running
/// each sequence on its own, with no padding and no work for the masked-out pairs.
pub fn scaled_dot_product_attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    packed: &PackedSequences,
    causal: bool,
    scale: Option<f64>,
) -> Result<Tensor> {
    let op = "scaled_dot_product_attention_varlen";
    check_packed(op, [q, k, v], packed)?;
    attention(op, [q, k, v], causal, scale, Some(packed), None)
}

/// `q`, `k` and `v` are one batch row of `packed`'s tokens, on its device.
fn check_packed(op: &'static str, qkv: [&Tensor; 3], packed: &PackedSequences) -> Result<()> {
    check_device(op, qkv[0], &packed.device)?;
    let tokens = packed.total_tokens();
    for t in qkv {
        if t.ndim() != 4 || t.shape()[0] != 1 || t.shape()[2] != tokens {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "packed operands must be [1, heads, {tokens}, head_dim] for cu_seqlens {:?}, \
                     got {:?}",
                    packed.cu_seqlens(),
                    t.shape()
                ),
            });
        }
    }
    Ok(())
}

/// [`scaled_dot_product_attention_varlen`] with dropout on the probabilities, as
/// [`scaled_dot_product_attention_dropout`] (the draw covers the one batch row's
/// `heads · tokens · tokens` probabilities, of which each sequence's own are used).
#[allow(clippy::too_many_arguments)]
pub fn scaled_dot_product_attention_varlen_dropout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    packed: &PackedSequences,
    causal: bool,
    scale: Option<f64>,
    p: f64,
    generator: &Generator,
) -> Result<Tensor> {
    let op = "scaled_dot_product_attention_varlen";
    check_packed(op, [q, k, v], packed)?;
    attention(
        op,
        [q, k, v],
        causal,
        scale,
        Some(packed),
        Some((p, generator)),
    )
}

/// The draw of a dropout with probability `p` over `probabilities` elements, or `None` when `p`
/// is 0.
fn dropout_draw(
    op: &'static str,
    probabilities: u64,
    p: f64,
    generator: &Generator,
) -> Result<Option<DropoutDraw>> {
    if !(0.0..=1.0).contains(&p) {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!("dropout probability {p} is outside [0, 1]"),
        });
    }
    if p == 0.0 {
        return Ok(None);
    }
    let (seed, offset) = generator.advance(probabilities);
    Ok(Some(DropoutDraw { p, seed, offset }))
}

fn attention(
    op: &'static str,
    [q, k, v]: [&Tensor; 3],
    causal: bool,
    scale: Option<f64>,
    packed: Option<&PackedSequences>,
    dropout: Option<(f64, &Generator)>,
) -> Result<Tensor> {
    if let Some([q, k, v]) = autocast_args(op, [q, k, v])? {
        return attention(op, [&q, &k, &v], causal, scale, packed, dropout);
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
    let dropout = match dropout {
        Some((p, generator)) => {
            let [batch, heads, queries] = [q.shape()[0], q.shape()[1], q.shape()[2]];
            let probabilities = [batch, heads, queries, k.shape()[2]]
                .iter()
                .try_fold(1u64, |count, &n| count.checked_mul(n as u64))
                .ok_or_else(|| TensorError::InvalidArgument {
                    op,
                    reason: "the dropout draw exceeds 2^64 numbers".into(),
                })?;
            dropout_draw(op, probabilities, p, generator)?
        }
        None => None,
    };
    let out = heads_last_but_one(&q)?;
    let lse = q.new_empty(&q.shape()[..3], stats_dtype(q.dtype()))?;
    q.backend().attention(forward_args(
        [&q, &k, &v, &out, &lse],
        scale,
        causal,
        packed,
        dropout,
    ))?;
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
        let packed = packed.cloned();
        record(op, &[&q, &k, &v], &[&out], move |grads| {
            let dout = last_dim_contiguous(grads[0].as_ref().expect("one output"))?;
            let (q, k, v) = (q_saved.unpack()?, k_saved.unpack()?, v_saved.unpack()?);
            let (out, lse) = (out_saved.unpack()?, lse_saved.unpack()?);
            let [dq, dk, dv] = input_grads(&q, &k, &v)?;
            q.backend().attention_backward(AttentionBackward {
                forward: forward_args(
                    [&q, &k, &v, &out, &lse],
                    scale,
                    causal,
                    packed.as_ref(),
                    dropout,
                ),
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
