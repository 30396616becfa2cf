//! torchvision's `VisionTransformer`, with its structure and parameter names.
//!
//! Names, as `named_parameters()` yields them: `class_token`, `conv_proj.{weight,bias}`,
//! `encoder.pos_embedding`, `encoder.layers.encoder_layer_<i>.{ln_1, self_attention, ln_2,
//! mlp.0, mlp.3}.*`, `encoder.ln.*`, `heads.head.{weight,bias}`. The forward pass is
//! torchvision's step for step: patch embedding (a convolution with stride = kernel), class token
//! prepended, position embedding added, pre-norm encoder blocks (LayerNorm eps 1e-6, exact GELU),
//! final norm, the class token's row through the head. [`VitConfig`] holds the configurations
//! the project uses: the golden tiny model, `mini` (CPU benchmarks), `vit_b_16`, `vit_l_16` and
//! `vit_g_14` (the GPU examples' 1B-parameter model).

use std::sync::Arc;

use headroom_autograd_core::{cat, patch_embedding, BackendRef, DType, Generator, Tensor};

use crate::attention::{AttentionMask, MultiheadAttention};
use crate::blocks::{impl_block_stack, run_block, BlockRunner};
use crate::error::{NnError, Result};
use crate::init::{parameter, Init};
use crate::layers::{Activation, Dropout, LayerNorm, Linear, Mlp};
use crate::module::{child_name, Module};

/// The hyperparameters of a [`VisionTransformer`] (torchvision's constructor arguments).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VitConfig {
    /// Side of the square input image, in pixels.
    pub image_size: usize,
    /// Side of a square patch; divides `image_size`.
    pub patch_size: usize,
    /// Number of encoder blocks.
    pub num_layers: usize,
    /// Attention heads per block; divides `hidden_dim`.
    pub num_heads: usize,
    /// Width of the token vectors.
    pub hidden_dim: usize,
    /// Width of the MLP's hidden layer.
    pub mlp_dim: usize,
    /// Number of output logits.
    pub num_classes: usize,
    /// Dropout after the position embedding, attention and MLP layers.
    pub dropout: f64,
    /// Dropout on the attention weights.
    pub attention_dropout: f64,
    /// LayerNorm epsilon (torchvision uses 1e-6).
    pub layer_norm_eps: f64,
}

impl VitConfig {
    /// The golden tiny model: `VisionTransformer(image_size=32, patch_size=8, num_layers=2,
    /// num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=10)`.
    pub fn tiny() -> VitConfig {
        VitConfig {
            image_size: 32,
            patch_size: 8,
            num_layers: 2,
            num_heads: 4,
            hidden_dim: 64,
            mlp_dim: 128,
            num_classes: 10,
            dropout: 0.0,
            attention_dropout: 0.0,
            layer_norm_eps: 1e-6,
        }
    }

    /// torchvision's `vit_b_16` (86.6M parameters with 1000 classes).
    pub fn vit_b_16() -> VitConfig {
        VitConfig {
            image_size: 224,
            patch_size: 16,
            num_layers: 12,
            num_heads: 12,
            hidden_dim: 768,
            mlp_dim: 3072,
            num_classes: 1000,
            dropout: 0.0,
            attention_dropout: 0.0,
            layer_norm_eps: 1e-6,
        }
    }

    /// A small ViT for benchmarks on the CPU (`cargo xtask bench-memory` without a GPU, the
    /// optimizer examples): 64×64 images in 16×16 patches (17 tokens), 6 blocks of width 256
    /// with 8 heads, MLP 1024, 1000 classes — 5,197,544 parameters. Like ViT-L/16 at batch 1,
    /// parameters, gradients and optimizer state dominate its memory at batch 1; activations
    /// do at batch 32.
    pub fn mini() -> VitConfig {
        VitConfig {
            image_size: 64,
            patch_size: 16,
            num_layers: 6,
            num_heads: 8,
            hidden_dim: 256,
            mlp_dim: 1024,
            ..VitConfig::vit_b_16()
        }
    }

    /// torchvision's `vit_l_16` (304M parameters with 1000 classes).
    pub fn vit_l_16() -> VitConfig {
        VitConfig {
            image_size: 224,
            patch_size: 16,
            num_layers: 24,
            num_heads: 16,
            hidden_dim: 1024,
            mlp_dim: 4096,
            num_classes: 1000,
            dropout: 0.0,
            attention_dropout: 0.0,
            layer_norm_eps: 1e-6,
        }
    }

    /// ViT-g/14's shape (Zhai et al., "Scaling Vision Transformers"; torchvision has no such
    /// builder) at 224 pixels: 40 blocks of width 1408 with 16 heads, MLP 6144, 1000 classes,
    /// about 1.0B parameters; the rest as [`VitConfig::vit_l_16`].
    pub fn vit_g_14() -> VitConfig {
        VitConfig {
            patch_size: 14,
            num_layers: 40,
            hidden_dim: 1408,
            mlp_dim: 6144,
            ..VitConfig::vit_l_16()
        }
    }

    /// Tokens per image: one per patch plus the class token.
    pub fn seq_length(&self) -> usize {
        (self.image_size / self.patch_size).pow(2) + 1
    }

    fn validate(&self) -> Result<()> {
        if self.patch_size == 0 || !self.image_size.is_multiple_of(self.patch_size) {
            return Err(NnError::InvalidConfig {
                reason: format!(
                    "patch size {} does not divide image size {}",
                    self.patch_size, self.image_size
                ),
            });
        }
        Ok(())
    }
}

/// A convolution whose stride equals its kernel (`conv_proj`): image patches to tokens.
#[derive(Debug, Clone)]
pub struct PatchEmbedding {
    /// `[hidden_dim, channels, patch, patch]`.
    pub weight: Tensor,
    /// `[hidden_dim]`.
    pub bias: Tensor,
}

impl PatchEmbedding {
    /// `[batch, channels, h, w]` → `[batch, hidden_dim, h / patch, w / patch]`.
    pub fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let patch = self.weight.shape()[2];
        Ok(patch_embedding(
            images,
            &self.weight,
            Some(&self.bias),
            patch,
        )?)
    }
}

impl Module for PatchEmbedding {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "weight"), &self.weight);
        visit(&child_name(prefix, "bias"), &self.bias);
    }

    fn set_training(&mut self, _training: bool) {}
}

/// One pre-norm transformer block (torchvision's `EncoderBlock`).
#[derive(Debug, Clone)]
pub struct EncoderBlock {
    /// Norm before attention.
    pub ln_1: LayerNorm,
    /// Self-attention.
    pub self_attention: MultiheadAttention,
    /// Dropout after attention.
    pub dropout: Dropout,
    /// Norm before the MLP.
    pub ln_2: LayerNorm,
    /// Linear, GELU, dropout, linear, dropout (`mlp.0`, `mlp.3`).
    pub mlp: Mlp,
}

impl EncoderBlock {
    /// `x + attn(ln_1(x))`, then `+ mlp(ln_2(·))`.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        // Attention's output is released before the MLP runs, as torchvision's rebinding of `x`
        // releases it: held to the end of the function, it would add one activation-sized
        // tensor to every block's MLP (and to the forward's peak).
        // Each norm runs inside the linear it feeds (`LayerNorm::then_linear`), so the norms'
        // outputs are not kept for backward.
        let x = {
            let attended =
                self.self_attention
                    .forward_normed(&self.ln_1, input, AttentionMask::None)?;
            self.dropout.forward(&attended)?.add(input)?
        };
        let y = self.mlp.forward_normed(&self.ln_2, &x)?;
        Ok(x.add(&y)?)
    }
}

impl Module for EncoderBlock {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.ln_1
            .visit_parameters(&child_name(prefix, "ln_1"), visit);
        self.self_attention
            .visit_parameters(&child_name(prefix, "self_attention"), visit);
        self.ln_2
            .visit_parameters(&child_name(prefix, "ln_2"), visit);
        self.mlp.visit_parameters(&child_name(prefix, "mlp"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.self_attention.set_training(training);
        self.dropout.set_training(training);
        self.mlp.set_training(training);
    }
}

/// Position embedding, blocks and final norm (torchvision's `Encoder`).
#[derive(Debug, Clone)]
pub struct Encoder {
    /// `[1, seq_length, hidden_dim]`.
    pub pos_embedding: Tensor,
    /// Dropout after adding the position embedding.
    pub dropout: Dropout,
    /// `encoder_layer_0`, `encoder_layer_1`, ...
    pub layers: Vec<EncoderBlock>,
    /// The final norm.
    pub ln: LayerNorm,
    /// Who runs the blocks (a checkpointing runner, say); `None` calls them directly. Set
    /// through [`BlockStack`](crate::BlockStack), on the encoder or on its [`VisionTransformer`].
    block_runner: Option<Arc<dyn BlockRunner>>,
}

impl Encoder {
    /// `[batch, seq_length, hidden_dim]` → the same shape.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        self.ln.forward(&self.forward_blocks(input.clone())?)
    }

    /// Everything but the final norm, on an input the caller gives up: it is released once the
    /// position embedding is added, so it is not held while the blocks run.
    pub(crate) fn forward_blocks(&self, input: Tensor) -> Result<Tensor> {
        let x = self.add_positions(input)?;
        self.run_blocks(x, 0)
    }

    /// `dropout(tokens + pos_embedding)`; the tokens are released.
    fn add_positions(&self, tokens: Tensor) -> Result<Tensor> {
        add_positions(&self.pos_embedding, &self.dropout, tokens)
    }

    /// The blocks from `first` on, each through the runner when there is one.
    fn run_blocks(&self, mut x: Tensor, first: usize) -> Result<Tensor> {
        for (index, layer) in self.layers.iter().enumerate().skip(first) {
            x = run_block(
                self.block_runner.as_ref(),
                index,
                layer,
                EncoderBlock::forward,
                &x,
            )?;
        }
        Ok(x)
    }
}

/// What a block runner gets as block 0 of a [`VisionTransformer`]: the embedding (patches, class
/// token, position embedding) and the first encoder block, from the images. A runner that
/// checkpoints or offloads block 0 then keeps the images, which the patch embedding's weight
/// gradient keeps anyway, instead of a `[batch, seq, hidden]` activation (25.8 MB at ViT-L/16
/// batch 32); recomputing the embedding is one small product.
#[derive(Debug, Clone)]
struct EmbeddingAndFirstBlock {
    class_token: Tensor,
    conv_proj: PatchEmbedding,
    pos_embedding: Tensor,
    dropout: Dropout,
    layer: EncoderBlock,
}

impl EmbeddingAndFirstBlock {
    fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let tokens = embed_patches(&self.conv_proj, &self.class_token, images)?;
        let x = add_positions(&self.pos_embedding, &self.dropout, tokens)?;
        self.layer.forward(&x)
    }
}

/// `dropout(tokens + pos_embedding)`; the tokens are released.
fn add_positions(pos_embedding: &Tensor, dropout: &Dropout, tokens: Tensor) -> Result<Tensor> {
    dropout.forward(&tokens.add(pos_embedding)?)
}

/// `[batch, 3, h, w]` images to `[batch, 1 + patches, hidden]` tokens, the class token first.
/// Each intermediate is released as soon as the next one exists (torchvision rebinds `x`): the
/// patch grid once the tokens are concatenated.
fn embed_patches(
    conv_proj: &PatchEmbedding,
    class_token: &Tensor,
    images: &Tensor,
) -> Result<Tensor> {
    let batch = images.shape()[0];
    let hidden_dim = class_token.shape()[2];
    let patches = conv_proj.forward(images)?;
    let n_patches = patches.shape()[2] * patches.shape()[3];
    let tokens = patches
        .reshape(&[batch, hidden_dim, n_patches])?
        .permute(&[0, 2, 1])?;
    let class_tokens = class_token.expand(&[batch, 1, hidden_dim])?;
    Ok(cat(&[&class_tokens, &tokens], 1)?)
}

impl_block_stack!(Encoder, blocks: layers);

impl Module for Encoder {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "pos_embedding"), &self.pos_embedding);
        let layers = child_name(prefix, "layers");
        for (layer_idx, layer) in self.layers.iter().enumerate() {
            let name = child_name(&layers, &format!("encoder_layer_{layer_idx}"));
            layer.visit_parameters(&name, visit);
        }
        self.ln.visit_parameters(&child_name(prefix, "ln"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.dropout.set_training(training);
        for layer in &mut self.layers {
            layer.set_training(training);
        }
    }
}

/// torchvision's `VisionTransformer` (without a representation layer): images to class logits.
#[derive(Debug, Clone)]
pub struct VisionTransformer {
    /// The hyperparameters it was built with.
    pub config: VitConfig,
    /// `[1, 1, hidden_dim]`, prepended to every image's tokens.
    pub class_token: Tensor,
    /// Patches to tokens.
    pub conv_proj: PatchEmbedding,
    /// The transformer.
    pub encoder: Encoder,
    /// The classifier (`heads.head`).
    pub head: Linear,
}

impl VisionTransformer {
    /// A model initialised as torchvision does (up to the random numbers): zero class token
    /// and head, N(0, 0.02²) position embedding, N(0, 1/fan_in) patch weights, Xavier-uniform MLP
    /// weights, PyTorch's defaults elsewhere. Dropout layers draw from `generator`.
    pub fn new(
        backend: &BackendRef,
        config: VitConfig,
        dtype: DType,
        generator: &Arc<Generator>,
    ) -> Result<VisionTransformer> {
        config.validate()?;
        let VitConfig {
            patch_size,
            hidden_dim,
            mlp_dim,
            num_classes,
            ..
        } = config;
        let zeros = Init::Constant(0.0);
        let dropout = Dropout::new(config.dropout, Arc::clone(generator));
        let class_token = parameter(backend, &[1, 1, hidden_dim], dtype, zeros, generator)?;
        let fan_in = 3 * patch_size * patch_size;
        let conv_proj = PatchEmbedding {
            weight: parameter(
                backend,
                &[hidden_dim, 3, patch_size, patch_size],
                dtype,
                Init::normal(0.0, (1.0 / fan_in as f64).sqrt()),
                generator,
            )?,
            bias: parameter(backend, &[hidden_dim], dtype, zeros, generator)?,
        };
        let pos_embedding = parameter(
            backend,
            &[1, config.seq_length(), hidden_dim],
            dtype,
            Init::normal(0.0, 0.02),
            generator,
        )?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for _ in 0..config.num_layers {
            let layer_norm = |generator: &Generator| {
                LayerNorm::new(backend, hidden_dim, config.layer_norm_eps, dtype, generator)
            };
            let ln_1 = layer_norm(generator)?;
            let self_attention = MultiheadAttention::new(
                backend,
                hidden_dim,
                config.num_heads,
                Dropout::new(config.attention_dropout, Arc::clone(generator)),
                dtype,
                generator,
            )?;
            let ln_2 = layer_norm(generator)?;
            let bound = (6.0 / (hidden_dim + mlp_dim) as f64).sqrt();
            let xavier = Init::uniform(-bound, bound);
            let tiny_normal = Some(Init::normal(0.0, 1e-6));
            let mlp = Mlp {
                fc1: Linear::with_init(
                    backend,
                    [hidden_dim, mlp_dim],
                    xavier,
                    tiny_normal,
                    dtype,
                    generator,
                )?,
                activation: Activation::Gelu,
                dropout: dropout.clone(),
                fc2: Linear::with_init(
                    backend,
                    [mlp_dim, hidden_dim],
                    xavier,
                    tiny_normal,
                    dtype,
                    generator,
                )?,
            };
            layers.push(EncoderBlock {
                ln_1,
                self_attention,
                dropout: dropout.clone(),
                ln_2,
                mlp,
            });
        }
        let encoder = Encoder {
            pos_embedding,
            dropout,
            layers,
            ln: LayerNorm::new(backend, hidden_dim, config.layer_norm_eps, dtype, generator)?,
            block_runner: None,
        };
        let head = Linear::with_init(
            backend,
            [hidden_dim, num_classes],
            zeros,
            Some(zeros),
            dtype,
            generator,
        )?;
        Ok(VisionTransformer {
            config,
            class_token,
            conv_proj,
            encoder,
            head,
        })
    }

    /// Class logits `[batch, num_classes]` of images `[batch, 3, image_size, image_size]`.
    pub fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let size = self.config.image_size;
        if images.ndim() != 4 || images.shape()[1..] != [3, size, size] {
            return Err(NnError::InvalidInput {
                module: "VisionTransformer",
                reason: format!(
                    "expected images [batch, 3, {size}, {size}], got {:?}",
                    images.shape()
                ),
            });
        }
        // With a block runner, block 0 is the embedding and the first encoder block, from the
        // images (`EmbeddingAndFirstBlock`); without one the tokens are released once the
        // encoder has added its position embedding.
        let hidden = match &self.encoder.block_runner {
            Some(runner) if !self.encoder.layers.is_empty() => {
                let first = EmbeddingAndFirstBlock {
                    class_token: self.class_token.clone(),
                    conv_proj: self.conv_proj.clone(),
                    pos_embedding: self.encoder.pos_embedding.clone(),
                    dropout: self.encoder.dropout.clone(),
                    layer: self.encoder.layers[0].clone(),
                };
                let x = run_block(
                    Some(runner),
                    0,
                    &first,
                    EmbeddingAndFirstBlock::forward,
                    images,
                )?;
                self.encoder.run_blocks(x, 1)?
            }
            _ => {
                let tokens = embed_patches(&self.conv_proj, &self.class_token, images)?;
                self.encoder.forward_blocks(tokens)?
            }
        };
        // Only the class token's row reaches the head, and the final norm acts on each token
        // alone, so the row is taken first (a copy, so nothing keeps the blocks' output alive)
        // and normed by itself: the same values as torchvision's `ln(x)[:, 0]`, without a
        // `[batch, seq, hidden]` norm output in the forward or its gradient in backward.
        let class_row = hidden.narrow(1, 0, 1)?.squeeze_dim(1)?.compact()?;
        let first = self.encoder.ln.forward(&class_row)?;
        self.head.forward(&first)
    }
}

// The encoder's blocks, block 0 handed over with the embedding in front of it (from the images):
// a runner that keeps block 0's input keeps the images rather than a sequence activation.
impl_block_stack!(VisionTransformer, through: encoder);

impl Module for VisionTransformer {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "class_token"), &self.class_token);
        self.conv_proj
            .visit_parameters(&child_name(prefix, "conv_proj"), visit);
        self.encoder
            .visit_parameters(&child_name(prefix, "encoder"), visit);
        self.head
            .visit_parameters(&child_name(prefix, "heads.head"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.encoder.set_training(training);
    }
}
