//! Modules with PyTorch's parameter names, and the reference models: torchvision's
//! `VisionTransformer`, and Hugging Face's GPT-2 and Llama family (Llama 3, Qwen2).
//!
//! A [`Module`] owns its parameters (leaf [`Tensor`](headroom_autograd_core::Tensor)s that require grad) and walks them by
//! name in PyTorch's `named_parameters()` order, so weights load from and save to safetensors
//! files by the names PyTorch uses ([`load_weights`], [`save_weights`]) and an optimizer sees
//! parameters in PyTorch's order. Layers: [`Linear`], [`LayerNorm`], [`Embedding`],
//! [`Dropout`], [`MultiheadAttention`], [`Mlp`]. Models: [`VisionTransformer`] ([`VitConfig`]:
//! the golden tiny model, `vit_b_16`, `vit_l_16`, `vit_g_14`) and [`Gpt2LMHeadModel`] ([`Gpt2Config`];
//! `Conv1D` weights stored `[in, out]`, `lm_head` tied to `wte`). Tests check both, in float64,
//! against PyTorch's logits, loss and every parameter's gradient. [`LlamaForCausalLM`]
//! ([`LlamaConfig`]: the tiny golden Llama and Qwen2, Llama-3.2-1B/3B and Llama-3.1-8B shapes)
//! has RMSNorm, rotary embeddings with Llama 3's scaling, grouped-query attention and a SwiGLU
//! MLP, composed from autograd-core's ops. Both causal language models are a [`CausalLm`]: their
//! training loss, [`CausalLm::forward_loss`], fuses the head with Hugging Face's causal-LM loss
//! (autograd-core's `linear_cross_entropy`, no `[batch, seq, vocab]` logits) unless their
//! `loss_path` is [`LossPath::Unfused`].
//!
//! This crate sits on autograd-core's ops and is generic over its `Backend`: it names no device
//! and has no backward of its own (the ops record the graph). Models are plain structs with
//! public fields; there is no module registry and no hooks of its own (hooks are the engine's).
//! One seam is nn's: the models with a stack of blocks run each block through an optional
//! [`BlockRunner`], attached the same way on every such model ([`BlockStack::set_block_runner`]),
//! so activation checkpointing or a memory planner can take the blocks over without editing the
//! model, and code that attaches one takes any model with blocks.
//!
//! ```
//! use std::sync::Arc;
//! use headroom_autograd_core::{DType, Generator, Tensor};
//! use headroom_nn::{Linear, Module};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let generator = Arc::new(Generator::new(0));
//! let layer = Linear::new(&cpu, 4, 2, true, DType::F32, &generator)?;
//! let names: Vec<String> = layer.named_parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(names, ["weight", "bias"]);
//! let y = layer.forward(&Tensor::ones(&cpu, &[3, 4], DType::F32)?)?;
//! assert_eq!(y.shape(), [3, 2]);
//! # Ok::<(), headroom_nn::NnError>(())
//! ```

mod attention;
mod blocks;
mod causal_lm;
pub use causal_lm::{next_token_targets, CausalLm, LossPath, IGNORE_INDEX};
mod error;
mod gpt2;
mod init;
mod layers;
mod llama;
mod module;
mod vit;
mod weights;

pub use attention::{
    attention, causal_mask, finfo_min, merge_heads, split_heads, AttentionMask, MultiheadAttention,
};
pub use blocks::{BlockForward, BlockRunner, BlockStack};
pub use error::{NnError, Result};
pub use gpt2::{Conv1D, Gpt2Attention, Gpt2Block, Gpt2Config, Gpt2LMHeadModel, Gpt2Mlp, Gpt2Model};
pub use init::{parameter, Init};
pub use layers::{Activation, Dropout, Embedding, LayerNorm, Linear, Mlp};
pub use llama::{
    apply_rotary, repeat_kv, Llama3RopeScaling, LlamaAttention, LlamaConfig, LlamaDecoderLayer,
    LlamaForCausalLM, LlamaMlp, LlamaModel, LlamaRmsNorm, RotaryEmbedding, TokenPositions,
    HUGGING_FACE_CONFIG_FILE, HUGGING_FACE_WEIGHTS_FILE,
};
pub use module::{child_name, Module};
pub use vit::{Encoder, EncoderBlock, PatchEmbedding, VisionTransformer, VitConfig};
pub use weights::{
    load_file, load_weights, load_weights_renamed, read_tensor, save_file, save_weights,
};
