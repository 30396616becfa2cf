//! Hugging Face's `LlamaForCausalLM` (and `Qwen2ForCausalLM`, the same model with q/k/v
//! biases), with its structure and parameter names.
//!
//! Names, as `named_parameters()` yields them: `model.embed_tokens.weight`,
//! `model.layers.<i>.self_attn.{q,k,v,o}_proj.weight` (and `.bias` of q, k, v under
//! [`LlamaConfig::qkv_bias`]), `model.layers.<i>.mlp.{gate,up,down}_proj.weight`,
//! `model.layers.<i>.{input_layernorm,post_attention_layernorm}.weight`, `model.norm.weight`,
//! then `lm_head.weight` unless the head is tied to the embedding (then, as in PyTorch and in
//! Hugging Face's safetensors files, it is not listed). The forward pass is Hugging Face's:
//! embedding, pre-norm decoder layers sharing one rotary table per forward, final RMSNorm, the
//! head; [`LlamaForCausalLM::loss`] is its causal-LM loss (logits upcast to f32), and training
//! goes through [`CausalLm::forward_loss`], which fuses the head with the loss unless
//! [`LlamaForCausalLM::loss_path`] is [`LossPath::Unfused`]. Weights are
//! initialised as `_init_weights` does: N(0, `initializer_range`²) matrices and embedding, zero
//! biases, unit norms. The layers are a [`BlockStack`](crate::BlockStack), so checkpointing, offload and planners
//! attach as they do to GPT-2. `forward_packed` takes packed variable-length sequences (one row
//! of sequences end to end, FlashAttention's `cu_seqlens` as a [`PackedSequences`]): attention
//! within each sequence only and rotary positions restarting at each sequence start, so a packed
//! batch gives the loss of the same sequences padded, without the padding's work.
//!
//! `config.rs` holds the shapes and their checks, `hugging_face.rs` Hugging Face's checkpoint
//! directories (`config.json`, `model.safetensors`), `rope.rs` the rotary embedding, `block.rs` a
//! decoder layer, `activations.rs` the formula of what a layer keeps for backward; this file
//! assembles the model and knows nothing of a layer's inside.

mod activations;
mod block;
mod config;
mod hugging_face;
mod rope;

use std::sync::Arc;

use headroom_autograd_core::{
    embedding, BackendRef, DType, Generator, LinearCrossEntropyOptions, PackedSequences, Tensor,
};

pub use block::{
    repeat_kv, LlamaAttention, LlamaDecoderLayer, LlamaMlp, LlamaRmsNorm, TokenPositions,
};
pub use config::{Llama3RopeScaling, LlamaConfig};
pub use hugging_face::{HUGGING_FACE_CONFIG_FILE, HUGGING_FACE_WEIGHTS_FILE};
pub use rope::{apply_rotary, RotaryEmbedding};

use crate::blocks::{impl_block_stack, run_block, BlockRunner};
use crate::causal_lm::{
    causal_lm_head_loss, causal_lm_loss, causal_lm_loss_from_hidden, CausalLm, LossPath,
};
use crate::error::{NnError, Result};
use crate::init::{parameter, Init};
use crate::layers::{Embedding, Linear};
use crate::module::{child_name, Module};

/// Embedding, decoder layers and final norm (`LlamaModel`, the `model` of the causal LM).
#[derive(Debug, Clone)]
pub struct LlamaModel {
    /// Token embedding, `[vocab_size, hidden_size]`.
    pub embed_tokens: Embedding,
    /// The decoder layers, named `layers.<i>`.
    pub layers: Vec<LlamaDecoderLayer>,
    /// The final norm.
    pub norm: LlamaRmsNorm,
    /// The rotary frequencies every layer shares (a buffer, not a parameter).
    pub rotary_emb: RotaryEmbedding,
    /// Who runs the layers; `None` calls them directly. Set through [`BlockStack`](crate::BlockStack).
    block_runner: Option<Arc<dyn BlockRunner>>,
}

/// A decoder layer with the rotary tables of one forward: what a [`BlockRunner`] is handed, so
/// a runner that calls it again (a checkpoint in backward) reuses the same tables.
#[derive(Debug, Clone)]
struct LayerAtPositions {
    layer: LlamaDecoderLayer,
    cos: Tensor,
    sin: Tensor,
    packed: Option<PackedSequences>,
}

impl LayerAtPositions {
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let positions = TokenPositions {
            cos: &self.cos,
            sin: &self.sin,
            packed: self.packed.as_ref(),
        };
        self.layer.forward(hidden, positions)
    }
}

impl LlamaModel {
    /// Hidden states `[batch, seq, hidden_size]` of token ids `[batch, seq]` (I64).
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.forward_packed(input_ids, None)
    }

    /// [`LlamaModel::forward`], and with `packed` the ids are one row (`[1, tokens]`) of
    /// sequences laid end to end: attention stays within each sequence and rotary positions
    /// restart at every sequence start (derived from `cu_seqlens`), so each sequence's hidden
    /// states are what it would get alone, with no padding.
    pub fn forward_packed(
        &self,
        input_ids: &Tensor,
        packed: Option<&PackedSequences>,
    ) -> Result<Tensor> {
        let [_, seq] = *input_ids.shape() else {
            return Err(NnError::InvalidInput {
                module: "LlamaModel",
                reason: format!(
                    "expected input ids [batch, seq], got {:?}",
                    input_ids.shape()
                ),
            });
        };
        if let Some(packed) = packed {
            if input_ids.shape() != [1, packed.total_tokens()] {
                return Err(NnError::InvalidInput {
                    module: "LlamaModel",
                    reason: format!(
                        "packed input ids must be [1, {}] for cu_seqlens {:?}, got {:?}",
                        packed.total_tokens(),
                        packed.cu_seqlens(),
                        input_ids.shape()
                    ),
                });
            }
        }
        let mut hidden = self.embed_tokens.forward(input_ids)?;
        let (cos, sin) = match packed {
            None => self
                .rotary_emb
                .cos_sin(input_ids.backend(), seq, hidden.dtype())?,
            Some(packed) => {
                // The tables' rows at each token's position within its sequence.
                let (cos, sin) = self.rotary_emb.cos_sin(
                    input_ids.backend(),
                    packed.max_len(),
                    hidden.dtype(),
                )?;
                let positions: Vec<i64> =
                    packed.positions().into_iter().map(|p| p as i64).collect();
                let positions =
                    Tensor::from_slice(input_ids.backend(), &positions, &[positions.len()])?;
                (embedding(&cos, &positions)?, embedding(&sin, &positions)?)
            }
        };
        for (index, layer) in self.layers.iter().enumerate() {
            let at_positions = LayerAtPositions {
                layer: layer.clone(),
                cos: cos.clone(),
                sin: sin.clone(),
                packed: packed.cloned(),
            };
            hidden = run_block(
                self.block_runner.as_ref(),
                index,
                &at_positions,
                LayerAtPositions::forward,
                &hidden,
            )?;
        }
        self.norm.forward(&hidden)
    }
}

impl_block_stack!(LlamaModel, blocks: layers);

impl Module for LlamaModel {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.embed_tokens
            .visit_parameters(&child_name(prefix, "embed_tokens"), visit);
        let layers = child_name(prefix, "layers");
        for (layer_idx, layer) in self.layers.iter().enumerate() {
            layer.visit_parameters(&child_name(&layers, &layer_idx.to_string()), visit);
        }
        self.norm
            .visit_parameters(&child_name(prefix, "norm"), visit);
    }

    fn set_training(&mut self, _training: bool) {}
}

/// A Llama-family language model (`LlamaForCausalLM`; `Qwen2ForCausalLM` with
/// [`LlamaConfig::qkv_bias`]).
#[derive(Debug, Clone)]
pub struct LlamaForCausalLM {
    /// The hyperparameters it was built with.
    pub config: LlamaConfig,
    /// The body (`model.*`).
    pub model: LlamaModel,
    /// The head, `[vocab_size, hidden_size]`; `None` when tied to `model.embed_tokens`.
    pub lm_head: Option<Linear>,
    /// How [`CausalLm::forward_loss`] computes the training loss: fused with the head (the
    /// default, [`LossPath::default`]) or, with [`LossPath::Unfused`], the logits of
    /// [`LlamaForCausalLM::forward`] then [`LlamaForCausalLM::loss`].
    pub loss_path: LossPath,
}

impl LlamaForCausalLM {
    /// A model of `config` (checked by [`LlamaConfig::validate`]) initialised as Hugging Face
    /// does, up to the random numbers: N(0, `initializer_range`²) weights and embedding, zero
    /// biases, norms of ones.
    pub fn new(
        backend: &BackendRef,
        config: LlamaConfig,
        dtype: DType,
        generator: &Generator,
    ) -> Result<LlamaForCausalLM> {
        config.validate()?;
        let LlamaConfig {
            vocab_size,
            hidden_size: hidden,
            intermediate_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            initializer_range: std,
            ..
        } = config;
        let weights = Init::normal(0.0, std);
        let linear = |[in_features, out_features]: [usize; 2], bias: bool| {
            let bias = bias.then_some(Init::Constant(0.0));
            Linear::with_init(
                backend,
                [in_features, out_features],
                weights,
                bias,
                dtype,
                generator,
            )
        };
        let norm = || -> Result<LlamaRmsNorm> {
            Ok(LlamaRmsNorm {
                weight: parameter(backend, &[hidden], dtype, Init::Constant(1.0), generator)?,
                eps: rms_norm_eps,
            })
        };
        let embed_tokens = Embedding::new(backend, vocab_size, hidden, std, dtype, generator)?;
        let (q_width, kv_width) = (
            num_attention_heads * head_dim,
            num_key_value_heads * head_dim,
        );
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for _ in 0..config.num_hidden_layers {
            layers.push(LlamaDecoderLayer {
                self_attn: LlamaAttention {
                    q_proj: linear([hidden, q_width], config.qkv_bias)?,
                    k_proj: linear([hidden, kv_width], config.qkv_bias)?,
                    v_proj: linear([hidden, kv_width], config.qkv_bias)?,
                    o_proj: linear([q_width, hidden], false)?,
                    num_heads: num_attention_heads,
                    num_key_value_heads,
                    head_dim,
                },
                mlp: LlamaMlp {
                    gate_proj: linear([hidden, intermediate_size], false)?,
                    up_proj: linear([hidden, intermediate_size], false)?,
                    down_proj: linear([intermediate_size, hidden], false)?,
                },
                input_layernorm: norm()?,
                post_attention_layernorm: norm()?,
            });
        }
        let model = LlamaModel {
            embed_tokens,
            layers,
            norm: norm()?,
            rotary_emb: RotaryEmbedding::new(&config),
            block_runner: None,
        };
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(linear([hidden, vocab_size], false)?)
        };
        Ok(LlamaForCausalLM {
            config,
            model,
            lm_head,
            loss_path: LossPath::default(),
        })
    }

    /// The head's weight: `lm_head.weight`, or the embedding's when tied.
    pub fn lm_head_weight(&self) -> &Tensor {
        match &self.lm_head {
            Some(head) => &head.weight,
            None => &self.model.embed_tokens.weight,
        }
    }

    /// Logits `[batch, seq, vocab_size]` of token ids `[batch, seq]` (I64).
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let hidden = self.model.forward(input_ids)?;
        Ok(hidden.linear(self.lm_head_weight(), None)?)
    }

    /// Logits of packed sequences (`[1, tokens]` ids laid end to end, boundaries in `packed`; see
    /// [`LlamaModel::forward_packed`]), or of a plain batch when `packed` is `None`.
    pub fn forward_packed(
        &self,
        input_ids: &Tensor,
        packed: Option<&PackedSequences>,
    ) -> Result<Tensor> {
        let hidden = self.model.forward_packed(input_ids, packed)?;
        Ok(hidden.linear(self.lm_head_weight(), None)?)
    }

    /// Hugging Face's causal-LM loss with `labels` `[batch, seq]` (usually the input ids): the
    /// logits upcast to f32, position `t` predicting label `t + 1`, mean over the
    /// `batch × (seq - 1)` predictions (labels of -100 are skipped). The loss is f32.
    pub fn loss(&self, logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
        causal_lm_loss("LlamaForCausalLM", logits, labels)
    }

    /// [`LlamaForCausalLM::loss`] of the logits of `hidden_states` (`self.model.forward(ids)`,
    /// `[batch, seq, hidden_size]`) without the logits: the head and the loss fused by
    /// [`linear_cross_entropy`](headroom_autograd_core::linear_cross_entropy), chunked as
    /// `options` says (its `ignore_index` and `reduction` are the loss's own). A tied head's
    /// weight gets both its embedding and its head gradient.
    pub fn loss_from_hidden(
        &self,
        hidden_states: &Tensor,
        labels: &Tensor,
        options: &LinearCrossEntropyOptions,
    ) -> Result<Tensor> {
        let weight = self.lm_head_weight();
        causal_lm_loss_from_hidden("LlamaForCausalLM", hidden_states, weight, labels, options)
    }
}

impl CausalLm for LlamaForCausalLM {
    fn hidden_states(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.model.forward(input_ids)
    }

    /// [`LlamaForCausalLM::lm_head_weight`].
    fn head_weight(&self) -> &Tensor {
        self.lm_head_weight()
    }

    fn head_loss(&self, hidden: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let weight = self.lm_head_weight();
        causal_lm_head_loss("LlamaForCausalLM", &self.loss_path, hidden, weight, labels)
    }
}

// The layers of its body (`model.layers`).
impl_block_stack!(LlamaForCausalLM, through: model);

impl Module for LlamaForCausalLM {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.model
            .visit_parameters(&child_name(prefix, "model"), visit);
        if let Some(head) = &self.lm_head {
            head.visit_parameters(&child_name(prefix, "lm_head"), visit);
        }
    }

    fn set_training(&mut self, _training: bool) {}
}
