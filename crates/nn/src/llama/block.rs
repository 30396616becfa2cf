//! One Llama decoder layer and its parts, as Hugging Face writes them: [`LlamaRmsNorm`],
//! [`LlamaAttention`] (grouped-query, rotary, causal), [`LlamaMlp`] (SwiGLU) and
//! [`LlamaDecoderLayer`] (pre-norm, two residual branches).
//!
//! Each piece runs on autograd-core's fused ops: RMSNorm is `rms_norm` (one rstd per row saved;
//! the normalised value computed in f32 for f16/bf16 inputs, Hugging Face's upcast, and in the
//! input's dtype otherwise: Hugging Face's `.to(float32)` would also round an f64 model to f32,
//! and keeping f64 exact lets the whole model be checked by finite differences), the MLP's
//! `silu(gate) · up` is `swiglu` (only gate and up saved), the rotary embedding is
//! `rotary_embedding` (nothing of the projection saved), and attention hands the un-repeated
//! key/value heads to the fused causal grouped-query attention (no `repeat_kv` copy), which keeps
//! a log-sum-exp per query rather than the probabilities, and takes packed variable-length
//! sequences (`cu_seqlens`) when given.
//! This module knows nothing about the model around a layer or how its blocks are run.

use headroom_autograd_core::{
    rms_norm, scaled_dot_product_attention, scaled_dot_product_attention_varlen, swiglu,
    PackedSequences, Tensor,
};

use super::rope::apply_rotary;
use crate::attention::merge_heads;
use crate::error::{NnError, Result};
use crate::layers::Linear;
use crate::module::{child_name, Module};

/// Implements [`Module`] for a layer whose parameters are those of its children, each named
/// after its field (Hugging Face's names: `q_proj`, `mlp`, ...), visited in the order given; the
/// layer has no dropout, so `set_training` changes nothing.
macro_rules! impl_module_of_children {
    ($layer:ty: $($child:ident),+ $(,)?) => {
        impl Module for $layer {
            fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
                $(self.$child.visit_parameters(&child_name(prefix, stringify!($child)), visit);)+
            }

            fn set_training(&mut self, _training: bool) {}
        }
    };
}

/// Where a layer's tokens stand: the rotary tables of their positions (`[seq, head_dim]`, or
/// `[tokens, head_dim]` with each token's position within its sequence when packed) and, for
/// packed sequences, their boundaries.
#[derive(Debug, Clone, Copy)]
pub struct TokenPositions<'a> {
    /// Cosines of the rotary angles.
    pub cos: &'a Tensor,
    /// Sines of the rotary angles.
    pub sin: &'a Tensor,
    /// The boundaries of packed sequences, or `None` for a plain batch.
    pub packed: Option<&'a PackedSequences>,
}

/// Root-mean-square normalisation with a scale (Hugging Face's `LlamaRMSNorm`): `weight *
/// (x * rsqrt(mean(x², -1) + eps))`, computed in f32 for f16 and bf16 inputs.
#[derive(Debug, Clone)]
pub struct LlamaRmsNorm {
    /// Scale, `[dim]`, initialised to ones.
    pub weight: Tensor,
    /// Added to the mean square.
    pub eps: f64,
}

impl LlamaRmsNorm {
    /// Normalises over the last dim; the result has the weight's dtype.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        if self.weight.dtype() == hidden.dtype() {
            return Ok(rms_norm(hidden, &self.weight, self.eps)?);
        }
        // A weight of another dtype (an f32 weight on f16/bf16 activations): the normalised
        // value rounded to the input's dtype (the fused op with a unit weight writes exactly
        // that), then Hugging Face's `weight * hidden.to(input_dtype)` in the weight's dtype.
        let unit = Tensor::ones(hidden.backend(), self.weight.shape(), hidden.dtype())?;
        let normed = rms_norm(hidden, &unit, self.eps)?.to_dtype(self.weight.dtype())?;
        Ok(self.weight.mul(&normed)?)
    }
}

impl Module for LlamaRmsNorm {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "weight"), &self.weight);
    }

    fn set_training(&mut self, _training: bool) {}
}

/// Grouped-query causal self-attention with rotary embeddings (`LlamaAttention`, and
/// `Qwen2Attention` when q, k and v have biases).
#[derive(Debug, Clone)]
pub struct LlamaAttention {
    /// `hidden → heads · head_dim`.
    pub q_proj: Linear,
    /// `hidden → kv_heads · head_dim`.
    pub k_proj: Linear,
    /// `hidden → kv_heads · head_dim`.
    pub v_proj: Linear,
    /// `heads · head_dim → hidden`, no bias.
    pub o_proj: Linear,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads; each serves `num_heads / num_key_value_heads` query heads.
    pub num_key_value_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl LlamaAttention {
    /// `[batch, seq, hidden]` → the same shape, causal, with the rotary tables of `positions`
    /// applied to queries and keys. With packed sequences the batch is one row of sequences laid
    /// end to end (`[1, tokens, hidden]`), causal within each sequence and blind across them.
    pub fn forward(&self, hidden: &Tensor, positions: TokenPositions<'_>) -> Result<Tensor> {
        let TokenPositions { cos, sin, packed } = positions;
        let [batch, seq, _] = *hidden.shape() else {
            return Err(NnError::InvalidInput {
                module: "LlamaAttention",
                reason: format!("expected [batch, seq, hidden], got {:?}", hidden.shape()),
            });
        };
        let heads = |proj: &Linear, n_heads: usize| -> Result<Tensor> {
            Ok(proj
                .forward(hidden)?
                .reshape(&[batch, seq, n_heads, self.head_dim])?
                .permute(&[0, 2, 1, 3])?)
        };
        let q = apply_rotary(&heads(&self.q_proj, self.num_heads)?, cos, sin)?;
        let k = apply_rotary(&heads(&self.k_proj, self.num_key_value_heads)?, cos, sin)?;
        let v = heads(&self.v_proj, self.num_key_value_heads)?;
        let context = match packed {
            Some(packed) => scaled_dot_product_attention_varlen(&q, &k, &v, packed, true, None)?,
            None => scaled_dot_product_attention(&q, &k, &v, true, None)?,
        };
        self.o_proj.forward(&merge_heads(&context)?)
    }
}

/// `[batch, kv_heads, seq, head_dim]` → `[batch, kv_heads · n_rep, seq, head_dim]`, each head
/// repeated `n_rep` times in a row (Hugging Face's `repeat_kv`, `repeat_interleave` on dim 1);
/// the tensor itself when `n_rep` is 1. Attention no longer needs it (the fused op reads grouped
/// heads in place); kept as the reference the grouped-query tests compare against.
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let [batch, kv_heads, seq, head_dim] = *x.shape() else {
        return Err(NnError::InvalidInput {
            module: "repeat_kv",
            reason: format!(
                "expected [batch, heads, seq, head_dim], got {:?}",
                x.shape()
            ),
        });
    };
    Ok(x.unsqueeze(2)?
        .expand(&[batch, kv_heads, n_rep, seq, head_dim])?
        .reshape(&[batch, kv_heads * n_rep, seq, head_dim])?)
}

impl_module_of_children!(LlamaAttention: q_proj, k_proj, v_proj, o_proj);

/// The SwiGLU feed-forward block (`LlamaMLP`): `down_proj(silu(gate_proj(x)) * up_proj(x))`,
/// no biases.
#[derive(Debug, Clone)]
pub struct LlamaMlp {
    /// `hidden → intermediate`, through SiLU.
    pub gate_proj: Linear,
    /// `hidden → intermediate`.
    pub up_proj: Linear,
    /// `intermediate → hidden`.
    pub down_proj: Linear,
}

impl LlamaMlp {
    /// Applies the block; `silu(gate) · up` is one fused op that saves only its two inputs.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let gate = self.gate_proj.forward(hidden)?;
        let up = self.up_proj.forward(hidden)?;
        self.down_proj.forward(&swiglu(&gate, &up)?)
    }
}

impl_module_of_children!(LlamaMlp: gate_proj, up_proj, down_proj);

/// One pre-norm decoder layer (`LlamaDecoderLayer`).
#[derive(Debug, Clone)]
pub struct LlamaDecoderLayer {
    /// Grouped-query attention.
    pub self_attn: LlamaAttention,
    /// SwiGLU MLP.
    pub mlp: LlamaMlp,
    /// Norm before attention.
    pub input_layernorm: LlamaRmsNorm,
    /// Norm before the MLP.
    pub post_attention_layernorm: LlamaRmsNorm,
}

impl LlamaDecoderLayer {
    /// `x + attn(norm(x))`, then `+ mlp(norm(·))`, at `positions` (see
    /// [`LlamaAttention::forward`]).
    pub fn forward(&self, hidden: &Tensor, positions: TokenPositions<'_>) -> Result<Tensor> {
        let normed = self.input_layernorm.forward(hidden)?;
        let attended = self.self_attn.forward(&normed, positions)?;
        let hidden = hidden.add(&attended)?;
        let mlp_out = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&hidden)?)?;
        Ok(hidden.add(&mlp_out)?)
    }
}

impl_module_of_children!(
    LlamaDecoderLayer: self_attn, mlp, input_layernorm, post_attention_layernorm
);
