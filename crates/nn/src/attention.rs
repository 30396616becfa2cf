//! Multi-head self-attention: [`MultiheadAttention`] with `torch.nn.MultiheadAttention`'s
//! parameters (`in_proj_weight` `[3E, E]`, `in_proj_bias`, `out_proj.weight`, `out_proj.bias`),
//! and [`attention`], the eager scaled-dot-product core it shares with GPT-2.
//!
//! With no mask or a causal one, the core is autograd-core's fused
//! [`scaled_dot_product_attention`] (what PyTorch's SDPA kernels do: no `[seq, seq]` matrix is
//! stored, and its output is laid out so merging the heads is free), and dropout on the weights
//! in training is fused into it ([`scaled_dot_product_attention_dropout`]: the mask is drawn from
//! the layer's generator exactly as the materialised weights' dropout would draw it, and replayed
//! in backward, never stored). With a custom mask it is written the way PyTorch's math path and
//! Hugging Face's `eager_attention_forward` are: `softmax(mask(q kᵀ / sqrt(d))) v`, with the mask
//! applied by `masked_fill` to the dtype's lowest value, then the weights' dropout. Both give the
//! reference implementations' gradients. Heads are views (reshape and permute of the
//! projection), never copies; the kernels take them strided.

use headroom_autograd_core::{
    scaled_dot_product_attention, scaled_dot_product_attention_dropout, BackendRef, DType,
    Generator, Tensor,
};

use crate::error::{NnError, Result};
use crate::init::{parameter, Init};
use crate::layers::{Dropout, LayerNorm, Linear};
use crate::module::{child_name, Module};

/// The lowest finite value of a floating dtype (`torch.finfo(dtype).min`), the fill of masked
/// attention scores.
pub fn finfo_min(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::MIN,
        DType::F16 => -65504.0,
        DType::BF16 => -3.389_531_389_251_535_5e38,
        _ => f64::from(f32::MIN),
    }
}

/// A `[seq, seq]` Bool mask that is true above the diagonal: the positions a causal model must
/// not attend to.
pub fn causal_mask(backend: &BackendRef, seq: usize) -> Result<Tensor> {
    let values: Vec<f64> = (0..seq * seq)
        .map(|idx| f64::from(u8::from(idx % seq > idx / seq)))
        .collect();
    Ok(Tensor::from_f64s(
        backend,
        &values,
        &[seq, seq],
        DType::Bool,
    )?)
}

/// Which scores attention hides.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query `i` sees keys `0..=i` (GPT-2's causal mask).
    Causal,
    /// Positions where this Bool mask (broadcast to `[batch, heads, queries, keys]`) is true
    /// are hidden.
    Custom(&'a Tensor),
}

/// Scaled dot-product attention of `q`, `k`, `v` (`[batch, heads, seq, head_dim]`):
/// `softmax(q kᵀ / sqrt(head_dim))` with the positions `mask` hides set to the dtype's lowest
/// value before the softmax, dropout on the weights, times `v`. Runs fused, dropout included,
/// when the mask is `None` or `Causal`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: AttentionMask<'_>,
    dropout: &Dropout,
) -> Result<Tensor> {
    let causal = match mask {
        AttentionMask::None => false,
        AttentionMask::Causal => true,
        AttentionMask::Custom(mask) => return materialised_attention(q, k, v, mask, dropout),
    };
    Ok(if dropout.is_identity() {
        scaled_dot_product_attention(q, k, v, causal, None)?
    } else {
        scaled_dot_product_attention_dropout(q, k, v, causal, None, dropout.p, dropout.generator())?
    })
}

/// [`attention`] with its `[batch, heads, queries, keys]` weights materialised: PyTorch's math
/// path, for a custom Bool `mask` (true hides).
fn materialised_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    dropout: &Dropout,
) -> Result<Tensor> {
    let head_dim = *q.shape().last().unwrap_or(&1);
    let scores = q
        .matmul(&k.transpose(-1, -2)?)?
        .div_scalar((head_dim as f64).sqrt())?
        .masked_fill(mask, finfo_min(q.dtype()))?;
    let weights = dropout.forward(&scores.softmax(-1)?)?;
    Ok(weights.matmul(v)?)
}

/// `[batch, seq, heads * head_dim]` → `[batch, heads, seq, head_dim]` (a view when it can be).
pub fn split_heads(x: &Tensor, n_heads: usize) -> Result<Tensor> {
    let [batch, seq, width] = *x.shape() else {
        return Err(NnError::InvalidInput {
            module: "attention",
            reason: format!("expected [batch, seq, width], got {:?}", x.shape()),
        });
    };
    Ok(x.reshape(&[batch, seq, n_heads, width / n_heads])?
        .permute(&[0, 2, 1, 3])?)
}

/// `[batch, heads, seq, head_dim]` → `[batch, seq, heads * head_dim]`.
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let [batch, heads, seq, head_dim] = *x.shape() else {
        return Err(NnError::InvalidInput {
            module: "attention",
            reason: format!(
                "expected [batch, heads, seq, head_dim], got {:?}",
                x.shape()
            ),
        });
    };
    Ok(x.permute(&[0, 2, 1, 3])?
        .reshape(&[batch, seq, heads * head_dim])?)
}

/// Multi-head self-attention with batch-first inputs (`torch.nn.MultiheadAttention(embed_dim,
/// num_heads, dropout, batch_first=True)` called as `attn(x, x, x, need_weights=False)`).
#[derive(Debug, Clone)]
pub struct MultiheadAttention {
    /// The packed q, k, v projection, `[3 * embed_dim, embed_dim]`.
    pub in_proj_weight: Tensor,
    /// `[3 * embed_dim]`.
    pub in_proj_bias: Tensor,
    /// The output projection (`out_proj`).
    pub out_proj: Linear,
    /// Dropout on the attention weights.
    pub dropout: Dropout,
    /// Number of heads.
    pub num_heads: usize,
}

impl MultiheadAttention {
    /// A layer initialised as PyTorch does (Xavier-uniform packed projection, zero biases,
    /// `Linear`-uniform output weight).
    pub fn new(
        backend: &BackendRef,
        embed_dim: usize,
        num_heads: usize,
        dropout: Dropout,
        dtype: DType,
        generator: &Generator,
    ) -> Result<MultiheadAttention> {
        if num_heads == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(NnError::InvalidConfig {
                reason: format!("{num_heads} heads do not divide an embedding of {embed_dim}"),
            });
        }
        let bound = (6.0 / (4 * embed_dim) as f64).sqrt();
        let in_proj_weight = parameter(
            backend,
            &[3 * embed_dim, embed_dim],
            dtype,
            Init::uniform(-bound, bound),
            generator,
        )?;
        let zeros = Init::Constant(0.0);
        let in_proj_bias = parameter(backend, &[3 * embed_dim], dtype, zeros, generator)?;
        let out_bound = 1.0 / (embed_dim as f64).sqrt();
        let out_proj = Linear::with_init(
            backend,
            [embed_dim, embed_dim],
            Init::uniform(-out_bound, out_bound),
            Some(zeros),
            dtype,
            generator,
        )?;
        Ok(MultiheadAttention {
            in_proj_weight,
            in_proj_bias,
            out_proj,
            dropout,
            num_heads,
        })
    }

    /// Self-attention over `x` (`[batch, seq, embed_dim]`), masked as `mask` says.
    pub fn forward(&self, x: &Tensor, mask: AttentionMask<'_>) -> Result<Tensor> {
        self.check_input(x)?;
        let qkv = x.linear(&self.in_proj_weight, Some(&self.in_proj_bias))?;
        self.attend(&qkv, mask)
    }

    /// `self.forward(&norm.forward(input)?, mask)` with the norm and the q/k/v projection as
    /// one op ([`LayerNorm::then_linear`]), which keeps `input` for backward but not the norm's
    /// output: the same values and gradients, bit for bit (a pre-norm block's attention).
    pub fn forward_normed(
        &self,
        norm: &LayerNorm,
        input: &Tensor,
        mask: AttentionMask<'_>,
    ) -> Result<Tensor> {
        self.check_input(input)?;
        let qkv = norm.then_linear(input, &self.in_proj_weight, Some(&self.in_proj_bias))?;
        self.attend(&qkv, mask)
    }

    /// Fails unless `x` is `[batch, seq, embed_dim]`.
    fn check_input(&self, x: &Tensor) -> Result<()> {
        let embed_dim = self.in_proj_weight.shape()[1];
        if x.ndim() != 3 || x.shape()[2] != embed_dim {
            return Err(NnError::InvalidInput {
                module: "MultiheadAttention",
                reason: format!("expected [batch, seq, {embed_dim}], got {:?}", x.shape()),
            });
        }
        Ok(())
    }

    /// Heads, attention and the output projection, from the packed q/k/v projection.
    fn attend(&self, qkv: &Tensor, mask: AttentionMask<'_>) -> Result<Tensor> {
        let embed_dim = self.in_proj_weight.shape()[1];
        let qkv = qkv.split(embed_dim, -1)?;
        let [q, k, v] = [&qkv[0], &qkv[1], &qkv[2]].map(|t| split_heads(t, self.num_heads));
        let context = attention(&q?, &k?, &v?, mask, &self.dropout)?;
        self.out_proj.forward(&merge_heads(&context)?)
    }
}

impl Module for MultiheadAttention {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "in_proj_weight"), &self.in_proj_weight);
        visit(&child_name(prefix, "in_proj_bias"), &self.in_proj_bias);
        self.out_proj
            .visit_parameters(&child_name(prefix, "out_proj"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.dropout.set_training(training);
    }
}
