//! Hugging Face's `GPT2LMHeadModel`, with its structure and parameter names.
//!
//! Names, as `named_parameters()` yields them: `transformer.wte.weight`,
//! `transformer.wpe.weight`, `transformer.h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2,
//! mlp.c_fc, mlp.c_proj}.*`, `transformer.ln_f.*`. `lm_head.weight` is tied to
//! `transformer.wte.weight` and, as in PyTorch, listed once under the embedding's name. GPT-2's
//! `Conv1D` stores its weight `[in, out]` (the transpose of `Linear`'s). The forward pass is
//! Hugging Face's: pre-norm blocks, causal attention (fused when attention dropout is inactive,
//! else the eager `masked_fill` to the dtype's lowest value), `gelu_new` (tanh GELU); [`Gpt2LMHeadModel::loss`] is its causal-LM loss,
//! which upcasts the logits to f32 as Hugging Face does (inside the fused loss, without an f32
//! copy of the logits). Training goes through [`CausalLm::forward_loss`], which fuses the tied
//! head with the loss unless [`Gpt2LMHeadModel::loss_path`] is [`LossPath::Unfused`].

use std::sync::{Arc, OnceLock};

use headroom_autograd_core::{BackendRef, DType, Generator, LinearCrossEntropyOptions, Tensor};

use crate::attention::{attention, merge_heads, split_heads, AttentionMask};
use crate::blocks::{impl_block_stack, run_block, BlockRunner};
use crate::causal_lm::{
    causal_lm_head_loss, causal_lm_loss, causal_lm_loss_from_hidden, CausalLm, LossPath,
};
use crate::error::{NnError, Result};
use crate::init::{parameter, Init};
use crate::layers::{Dropout, Embedding, LayerNorm};
use crate::module::{child_name, Module};

/// The hyperparameters of a GPT-2 model (Hugging Face's `GPT2Config` fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Config {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Longest sequence (rows of the position embedding).
    pub n_positions: usize,
    /// Width of the token vectors.
    pub n_embd: usize,
    /// Number of blocks.
    pub n_layer: usize,
    /// Attention heads per block; divides `n_embd`.
    pub n_head: usize,
    /// LayerNorm epsilon.
    pub layer_norm_epsilon: f64,
    /// Dropout on the summed embeddings.
    pub embd_pdrop: f64,
    /// Dropout on the attention weights.
    pub attn_pdrop: f64,
    /// Dropout on each residual branch.
    pub resid_pdrop: f64,
}

impl Gpt2Config {
    /// The golden tiny model: vocab 128, 64 positions, width 64, 2 layers, 4 heads, no dropout.
    pub fn tiny() -> Gpt2Config {
        Gpt2Config {
            vocab_size: 128,
            n_positions: 64,
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            layer_norm_epsilon: 1e-5,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            resid_pdrop: 0.0,
        }
    }

    /// GPT-2 small (124M parameters), Hugging Face's `GPT2Config()` defaults.
    pub fn gpt2() -> Gpt2Config {
        Gpt2Config {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            layer_norm_epsilon: 1e-5,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            resid_pdrop: 0.1,
        }
    }

    /// GPT-2 medium (355M parameters): Hugging Face's `gpt2-medium` config (width 1024, 24
    /// layers, 16 heads).
    pub fn gpt2_medium() -> Gpt2Config {
        Gpt2Config {
            n_embd: 1024,
            n_layer: 24,
            n_head: 16,
            ..Gpt2Config::gpt2()
        }
    }

    /// GPT-2 large (774M parameters): Hugging Face's `gpt2-large` config (width 1280, 36
    /// layers, 20 heads).
    pub fn gpt2_large() -> Gpt2Config {
        Gpt2Config {
            n_embd: 1280,
            n_layer: 36,
            n_head: 20,
            ..Gpt2Config::gpt2()
        }
    }

    /// The config of a Hugging Face model name: `gpt2`, `gpt2-medium` or `gpt2-large`.
    pub fn named(name: &str) -> Option<Gpt2Config> {
        match name {
            "gpt2" => Some(Gpt2Config::gpt2()),
            "gpt2-medium" => Some(Gpt2Config::gpt2_medium()),
            "gpt2-large" => Some(Gpt2Config::gpt2_large()),
            _ => None,
        }
    }

    /// The same model with every dropout probability 0 (Hugging Face's `attn_pdrop=0,
    /// resid_pdrop=0, embd_pdrop=0`): the forward is deterministic and attention takes the
    /// fused path in training mode.
    pub fn without_dropout(self) -> Gpt2Config {
        Gpt2Config {
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            resid_pdrop: 0.0,
            ..self
        }
    }
}

/// GPT-2's `Conv1D`: `y = x W + b` with `weight` stored `[in, out]`.
#[derive(Debug, Clone)]
pub struct Conv1D {
    /// `[in_features, out_features]`.
    pub weight: Tensor,
    /// `[out_features]`.
    pub bias: Tensor,
}

impl Conv1D {
    /// A layer with N(0, `std`²) weights and zero bias (Hugging Face's GPT-2 init).
    pub fn new(
        backend: &BackendRef,
        in_features: usize,
        out_features: usize,
        std: f64,
        dtype: DType,
        generator: &Generator,
    ) -> Result<Conv1D> {
        Ok(Conv1D {
            weight: parameter(
                backend,
                &[in_features, out_features],
                dtype,
                Init::normal(0.0, std),
                generator,
            )?,
            bias: parameter(
                backend,
                &[out_features],
                dtype,
                Init::Constant(0.0),
                generator,
            )?,
        })
    }

    /// Applies the layer over the last dim (an addmm with the weight taken as stored).
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        Ok(input.linear(&self.weight.t()?, Some(&self.bias))?)
    }
}

impl Module for Conv1D {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "weight"), &self.weight);
        visit(&child_name(prefix, "bias"), &self.bias);
    }

    fn set_training(&mut self, _training: bool) {}
}

/// Causal self-attention (`GPT2Attention`, eager).
#[derive(Debug, Clone)]
pub struct Gpt2Attention {
    /// Packed q, k, v projection, `[n_embd, 3 n_embd]`.
    pub c_attn: Conv1D,
    /// Output projection.
    pub c_proj: Conv1D,
    /// Dropout on the attention weights.
    pub attn_dropout: Dropout,
    /// Dropout on the output.
    pub resid_dropout: Dropout,
    /// Number of heads.
    pub n_head: usize,
}

impl Gpt2Attention {
    /// `[batch, seq, n_embd]` → the same shape, causal.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.attend(&self.c_attn.forward(hidden)?)
    }

    /// `self.forward(&norm.forward(hidden)?)` with the norm and `c_attn` as one op
    /// ([`LayerNorm::then_linear`]), which keeps `hidden` for backward but not the norm's
    /// output: the same values and gradients, bit for bit.
    pub fn forward_normed(&self, norm: &LayerNorm, hidden: &Tensor) -> Result<Tensor> {
        let c_attn = &self.c_attn;
        self.attend(&norm.then_linear(hidden, &c_attn.weight.t()?, Some(&c_attn.bias))?)
    }

    /// Heads, causal attention, `c_proj` and dropout, from `c_attn`'s output.
    fn attend(&self, qkv: &Tensor) -> Result<Tensor> {
        let width = self.c_proj.weight.shape()[0];
        let qkv = qkv.split(width, -1)?;
        let [q, k, v] = [&qkv[0], &qkv[1], &qkv[2]].map(|t| split_heads(t, self.n_head));
        let context = attention(&q?, &k?, &v?, AttentionMask::Causal, &self.attn_dropout)?;
        let out = self.c_proj.forward(&merge_heads(&context)?)?;
        self.resid_dropout.forward(&out)
    }
}

impl Module for Gpt2Attention {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.c_attn
            .visit_parameters(&child_name(prefix, "c_attn"), visit);
        self.c_proj
            .visit_parameters(&child_name(prefix, "c_proj"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.attn_dropout.set_training(training);
        self.resid_dropout.set_training(training);
    }
}

/// The feed-forward block (`GPT2MLP`): `c_fc`, `gelu_new`, `c_proj`, dropout.
#[derive(Debug, Clone)]
pub struct Gpt2Mlp {
    /// `n_embd → 4 n_embd`.
    pub c_fc: Conv1D,
    /// `4 n_embd → n_embd`.
    pub c_proj: Conv1D,
    /// Dropout on the output.
    pub dropout: Dropout,
}

impl Gpt2Mlp {
    /// Applies the block: `gelu_new` and `c_proj` as one op ([`Tensor::gelu_tanh_linear`]),
    /// which keeps `c_fc`'s output for backward but not the activation (the same values and
    /// gradients, bit for bit, for a quarter less of a block's saved bytes).
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.after_c_fc(&self.c_fc.forward(hidden)?)
    }

    /// `self.forward(&norm.forward(hidden)?)` with the norm and `c_fc` as one op
    /// ([`LayerNorm::then_linear`]), which keeps `hidden` for backward but not the norm's
    /// output: the same values and gradients, bit for bit.
    pub fn forward_normed(&self, norm: &LayerNorm, hidden: &Tensor) -> Result<Tensor> {
        let c_fc = &self.c_fc;
        self.after_c_fc(&norm.then_linear(hidden, &c_fc.weight.t()?, Some(&c_fc.bias))?)
    }

    /// `gelu_new`, `c_proj` and dropout, from `c_fc`'s output.
    fn after_c_fc(&self, pre_activation: &Tensor) -> Result<Tensor> {
        let out =
            pre_activation.gelu_tanh_linear(&self.c_proj.weight.t()?, Some(&self.c_proj.bias))?;
        self.dropout.forward(&out)
    }
}

impl Module for Gpt2Mlp {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.c_fc
            .visit_parameters(&child_name(prefix, "c_fc"), visit);
        self.c_proj
            .visit_parameters(&child_name(prefix, "c_proj"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.dropout.set_training(training);
    }
}

/// One pre-norm block (`GPT2Block`).
#[derive(Debug, Clone)]
pub struct Gpt2Block {
    /// Norm before attention.
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: Gpt2Attention,
    /// Norm before the MLP.
    pub ln_2: LayerNorm,
    /// Feed-forward block.
    pub mlp: Gpt2Mlp,
}

impl Gpt2Block {
    /// `x + attn(ln_1(x))`, then `+ mlp(ln_2(·))`.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        // Each norm runs inside the linear it feeds (`LayerNorm::then_linear`), so the norms'
        // outputs are not kept for backward.
        let x = self.attn.forward_normed(&self.ln_1, hidden)?.add(hidden)?;
        let y = self.mlp.forward_normed(&self.ln_2, &x)?;
        Ok(y.add(&x)?)
    }
}

impl Module for Gpt2Block {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.ln_1
            .visit_parameters(&child_name(prefix, "ln_1"), visit);
        self.attn
            .visit_parameters(&child_name(prefix, "attn"), visit);
        self.ln_2
            .visit_parameters(&child_name(prefix, "ln_2"), visit);
        self.mlp.visit_parameters(&child_name(prefix, "mlp"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.attn.set_training(training);
        self.mlp.set_training(training);
    }
}

/// Embeddings, blocks and final norm (`GPT2Model`, the `transformer` of the LM model).
#[derive(Debug, Clone)]
pub struct Gpt2Model {
    /// Token embedding, `[vocab_size, n_embd]`; also the LM head's weight.
    pub wte: Embedding,
    /// Position embedding, `[n_positions, n_embd]`.
    pub wpe: Embedding,
    /// Dropout on the summed embeddings.
    pub drop: Dropout,
    /// The blocks, named `h.<i>`.
    pub h: Vec<Gpt2Block>,
    /// The final norm.
    pub ln_f: LayerNorm,
    /// Who runs the blocks (a checkpointing runner, say); `None` calls them directly. Set
    /// through [`BlockStack`](crate::BlockStack), on the body or on its [`Gpt2LMHeadModel`].
    block_runner: Option<Arc<dyn BlockRunner>>,
    /// The position ids `0 .. n_positions` on the embeddings' device, uploaded by the first
    /// forward and narrowed to each input's length after, so that a forward copies nothing from
    /// the host (which a CUDA graph could not replay).
    position_ids: Arc<OnceLock<Tensor>>,
}

impl Gpt2Model {
    /// Hidden states `[batch, seq, n_embd]` of token ids `[batch, seq]` (I64).
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let [_, seq] = *input_ids.shape() else {
            return Err(NnError::InvalidInput {
                module: "Gpt2Model",
                reason: format!(
                    "expected input ids [batch, seq], got {:?}",
                    input_ids.shape()
                ),
            });
        };
        let n_positions = self.wpe.weight.shape()[0];
        if seq > n_positions {
            return Err(NnError::InvalidInput {
                module: "Gpt2Model",
                reason: format!("{seq} tokens exceed the {n_positions} positions"),
            });
        }
        let all_positions = match self.position_ids.get() {
            Some(ids) => ids,
            None => {
                let positions: Vec<i64> = (0..n_positions as i64).collect();
                let ids = Tensor::from_slice(input_ids.backend(), &positions, &[n_positions])?;
                self.position_ids.get_or_init(|| ids)
            }
        };
        let position_ids = all_positions.narrow(0, 0, seq)?;
        // The embeddings' sum is released once dropout has used it (with p > 0 it is not what
        // the blocks read, so it must not be held while they run).
        let mut hidden = {
            let embeds = self
                .wte
                .forward(input_ids)?
                .add(&self.wpe.forward(&position_ids)?)?;
            self.drop.forward(&embeds)?
        };
        for (index, block) in self.h.iter().enumerate() {
            hidden = run_block(
                self.block_runner.as_ref(),
                index,
                block,
                Gpt2Block::forward,
                &hidden,
            )?;
        }
        self.ln_f.forward(&hidden)
    }
}

impl_block_stack!(Gpt2Model, blocks: h);

impl Module for Gpt2Model {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.wte.visit_parameters(&child_name(prefix, "wte"), visit);
        self.wpe.visit_parameters(&child_name(prefix, "wpe"), visit);
        let blocks = child_name(prefix, "h");
        for (block_idx, block) in self.h.iter().enumerate() {
            block.visit_parameters(&child_name(&blocks, &block_idx.to_string()), visit);
        }
        self.ln_f
            .visit_parameters(&child_name(prefix, "ln_f"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.drop.set_training(training);
        for block in &mut self.h {
            block.set_training(training);
        }
    }
}

/// GPT-2 with its language-model head tied to the token embedding (`GPT2LMHeadModel`).
#[derive(Debug, Clone)]
pub struct Gpt2LMHeadModel {
    /// The hyperparameters it was built with.
    pub config: Gpt2Config,
    /// The body (`transformer.*`).
    pub transformer: Gpt2Model,
    /// How [`CausalLm::forward_loss`] computes the training loss: fused with the head (the
    /// default, [`LossPath::default`]) or, with [`LossPath::Unfused`], the logits of
    /// [`Gpt2LMHeadModel::forward`] then [`Gpt2LMHeadModel::loss`].
    pub loss_path: LossPath,
}

impl Gpt2LMHeadModel {
    /// Loads a Hugging Face GPT-2 checkpoint: names with or without the `transformer.` prefix
    /// (`GPT2LMHeadModel` or `GPT2Model` files), the causal-mask buffers older checkpoints carry
    /// (`attn.bias`, `attn.masked_bias`) skipped, and a stored `lm_head.weight` skipped because
    /// it is tied to `transformer.wte.weight`. Every parameter must be present with its shape.
    pub fn load_hugging_face(&self, tensors: &safetensors::SafeTensors<'_>) -> Result<()> {
        crate::weights::load_weights_renamed(self, tensors, &|name| {
            let is_buffer = name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
            if is_buffer || name == "lm_head.weight" {
                return None;
            }
            let name = name.strip_prefix("transformer.").unwrap_or(name);
            Some(format!("transformer.{name}"))
        })
    }

    /// A model initialised as Hugging Face does (up to the random numbers): N(0, 0.02²)
    /// weights and embeddings, output projections scaled by 1/sqrt(2 n_layer), zero biases.
    pub fn new(
        backend: &BackendRef,
        config: Gpt2Config,
        dtype: DType,
        generator: &Arc<Generator>,
    ) -> Result<Gpt2LMHeadModel> {
        let Gpt2Config {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            layer_norm_epsilon: eps,
            ..
        } = config;
        if n_head == 0 || n_embd % n_head != 0 {
            return Err(NnError::InvalidConfig {
                reason: format!("{n_head} heads do not divide an embedding of {n_embd}"),
            });
        }
        let std = 0.02;
        let proj_std = std / ((2 * n_layer) as f64).sqrt();
        let dropout = |p: f64| Dropout::new(p, Arc::clone(generator));
        let wte = Embedding::new(backend, vocab_size, n_embd, std, dtype, generator)?;
        let wpe = Embedding::new(backend, n_positions, n_embd, std, dtype, generator)?;
        let mut h = Vec::with_capacity(n_layer);
        for _ in 0..n_layer {
            h.push(Gpt2Block {
                ln_1: LayerNorm::new(backend, n_embd, eps, dtype, generator)?,
                attn: Gpt2Attention {
                    c_attn: Conv1D::new(backend, n_embd, 3 * n_embd, std, dtype, generator)?,
                    c_proj: Conv1D::new(backend, n_embd, n_embd, proj_std, dtype, generator)?,
                    attn_dropout: dropout(config.attn_pdrop),
                    resid_dropout: dropout(config.resid_pdrop),
                    n_head,
                },
                ln_2: LayerNorm::new(backend, n_embd, eps, dtype, generator)?,
                mlp: Gpt2Mlp {
                    c_fc: Conv1D::new(backend, n_embd, 4 * n_embd, std, dtype, generator)?,
                    c_proj: Conv1D::new(backend, 4 * n_embd, n_embd, proj_std, dtype, generator)?,
                    dropout: dropout(config.resid_pdrop),
                },
            });
        }
        let transformer = Gpt2Model {
            position_ids: Arc::default(),
            wte,
            wpe,
            drop: dropout(config.embd_pdrop),
            h,
            ln_f: LayerNorm::new(backend, n_embd, eps, dtype, generator)?,
            block_runner: None,
        };
        Ok(Gpt2LMHeadModel {
            config,
            transformer,
            loss_path: LossPath::default(),
        })
    }

    /// Logits `[batch, seq, vocab_size]` of token ids `[batch, seq]` (I64).
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let hidden = self.transformer.forward(input_ids)?;
        Ok(hidden.linear(&self.transformer.wte.weight, None)?)
    }

    /// Hugging Face's causal-LM loss with `labels = input ids`: the logits upcast to f32,
    /// position `t` predicting token `t + 1`, mean over the `batch × (seq - 1)` predictions
    /// (labels of -100 are skipped).
    pub fn loss(&self, logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
        causal_lm_loss("Gpt2LMHeadModel", logits, labels)
    }

    /// [`Gpt2LMHeadModel::loss`] of the logits of `hidden` (`self.transformer.forward(ids)`,
    /// `[batch, seq, n_embd]`) without the logits: the head and the loss fused by
    /// [`linear_cross_entropy`](headroom_autograd_core::linear_cross_entropy), chunked as
    /// `options` says (its `ignore_index` and `reduction` are the loss's own). The tied weight
    /// gets both its embedding and its head gradient.
    pub fn loss_from_hidden(
        &self,
        hidden: &Tensor,
        labels: &Tensor,
        options: &LinearCrossEntropyOptions,
    ) -> Result<Tensor> {
        let weight = &self.transformer.wte.weight;
        causal_lm_loss_from_hidden("Gpt2LMHeadModel", hidden, weight, labels, options)
    }
}

impl CausalLm for Gpt2LMHeadModel {
    fn hidden_states(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.transformer.forward(input_ids)
    }

    /// The token embedding's weight (the head is tied to it).
    fn head_weight(&self) -> &Tensor {
        &self.transformer.wte.weight
    }

    fn head_loss(&self, hidden: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let weight = &self.transformer.wte.weight;
        causal_lm_head_loss("Gpt2LMHeadModel", &self.loss_path, hidden, weight, labels)
    }
}

// The blocks of its body (`transformer.h`).
impl_block_stack!(Gpt2LMHeadModel, through: transformer);

impl Module for Gpt2LMHeadModel {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.transformer
            .visit_parameters(&child_name(prefix, "transformer"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.transformer.set_training(training);
    }
}
