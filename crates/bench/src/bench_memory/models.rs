//! The models `bench-memory` and `find-max-batch` train, their inputs and their losses:
//! torchvision's ViTs (`loss = model(x).sum()` on `rand(batch, 3, size, size)`) and the causal
//! language models, Hugging Face's GPT-2 family (`GPT2LMHeadModel` without dropout) and Llama
//! family (`LlamaForCausalLM` with the shapes of Llama 3.2 1B/3B and Llama 3.1 8B, and the tiny
//! golden Llama and Qwen2 for the CPU), each with the causal-LM loss on `seq` random tokens a
//! row, through nn's training-loss entry point ([`CausalLm::forward_loss`]): the head fused with
//! the loss unless the model was made [`Model::with_unfused_loss`] (`--unfused-loss`). The
//! language models share one path ([`LanguageConfig`], [`LanguageModel`]): their input, their
//! loss and their blocks are the same code whatever the family.
//!
//! It sits on nn (the models) and autograd-core (tensors); it knows nothing about optimizers,
//! cases, reports or devices.

use std::sync::Arc;

use anyhow::{bail, Result};
use headroom_autograd_core::{uniform, BackendRef, DType, Generator, Tensor};
use headroom_nn::{
    BlockRunner, BlockStack, CausalLm, Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaForCausalLM,
    LossPath, Module, VisionTransformer, VitConfig,
};
use rayon::prelude::*;

/// A model of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Model {
    /// Its name in reports.
    pub(crate) name: &'static str,
    /// What it is built from.
    pub(crate) arch: Arch,
    /// How many blocks the checkpointed cases recompute, the first ones
    /// ([`Model::with_checkpointed_blocks`], `--checkpoint-blocks`); `None`: each case's own
    /// choice (every block, or every block but the last).
    pub(crate) checkpointed_blocks: Option<usize>,
    /// The decoder layers `--layers` gave a Llama-family model instead of its own.
    pub(crate) layers: Option<usize>,
    /// Bytes of optimizer state the streamed cases' GPU may hold coming in, and as many going
    /// back (`--stream-budget-mib`); `None`: each case's own.
    pub(crate) stream_budget: Option<u64>,
}

/// A model's architecture and, for a language model, its sequence length and loss path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Arch {
    /// torchvision's constructor arguments.
    Vit(VitConfig),
    /// A causal language model's config, the tokens of each row and how its loss is computed
    /// (fused with the head unless [`Model::with_unfused_loss`]).
    Language {
        config: LanguageConfig,
        seq: usize,
        loss: LossPath,
    },
}

/// The config of a causal language model: GPT-2's (dropout off) or the Llama family's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum LanguageConfig {
    Gpt2(Gpt2Config),
    Llama(LlamaConfig),
}

impl LanguageConfig {
    /// Tokens in the vocabulary.
    fn vocab_size(&self) -> usize {
        match self {
            LanguageConfig::Gpt2(config) => config.vocab_size,
            LanguageConfig::Llama(config) => config.vocab_size,
        }
    }

    /// Its transformer layers.
    fn n_layers(&self) -> usize {
        match self {
            LanguageConfig::Gpt2(config) => config.n_layer,
            LanguageConfig::Llama(config) => config.num_hidden_layers,
        }
    }

    /// The most tokens a row takes: GPT-2's learned positions; a Llama's context (rotary
    /// positions have no table, so this is the config's `max_position_embeddings`).
    fn max_seq(&self) -> usize {
        match self {
            LanguageConfig::Gpt2(config) => config.n_positions,
            LanguageConfig::Llama(config) => config.max_position_embeddings,
        }
    }

    /// Tokens a row without `--seq`: GPT-2's full 1024 positions; 2048 for the Llama shapes
    /// (the measurements), the whole 64-token context of the tiny ones.
    fn default_seq(&self) -> usize {
        match self {
            LanguageConfig::Gpt2(_) => self.max_seq(),
            LanguageConfig::Llama(_) => self.max_seq().min(2048),
        }
    }
}

impl Model {
    /// Names accepted by `--model`.
    pub(crate) const NAMES: [&'static str; 15] = [
        "vit_l_16",
        "vit_b_16",
        "vit_mini",
        "vit_tiny",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "llama-tiny",
        "qwen2-tiny",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "llama-3.1-8b",
        "qwen2.5-14b",
        "qwen2.5-32b",
        "llama-3.1-70b",
    ];

    /// The language models' names (`--seq` applies to them).
    const LANGUAGE_NAMES: &'static str =
        "gpt2, gpt2-medium, gpt2-large, llama-tiny, qwen2-tiny, llama-3.2-1b, llama-3.2-3b, \
         llama-3.1-8b, qwen2.5-14b, qwen2.5-32b, llama-3.1-70b";

    /// The model named `name`: torchvision's `vit_l_16` and `vit_b_16`; `vit_mini`, the CPU
    /// default ([`VitConfig::mini`], 5.2 M parameters, 17 tokens an image, so that, like
    /// ViT-L/16 at batch 1, parameters, gradients and optimizer state dominate at batch 1 and
    /// activations at batch 32); `vit_tiny`, the golden tests' model, for quick checks; Hugging
    /// Face's `gpt2`, `gpt2-medium` and `gpt2-large` without dropout (so attention takes the
    /// fused path, as `attn_implementation="sdpa"` does), at their full 1024 positions; and the
    /// Llama family ([`LlamaConfig::named`]: `llama-3.2-1b`, `llama-3.2-3b`, `llama-3.1-8b`,
    /// `qwen2.5-14b`, `qwen2.5-32b` and `llama-3.1-70b` at 2048 tokens a row, `llama-tiny` and `qwen2-tiny` at 64, the CPU's) until
    /// [`Model::with_seq`].
    pub(crate) fn named(name: &str) -> Result<Model> {
        let language = |config: LanguageConfig| Arch::Language {
            config,
            seq: config.default_seq(),
            loss: LossPath::default(),
        };
        let arch = match name {
            "vit_l_16" => Arch::Vit(VitConfig::vit_l_16()),
            "vit_b_16" => Arch::Vit(VitConfig::vit_b_16()),
            "vit_mini" => Arch::Vit(VitConfig::mini()),
            "vit_tiny" => Arch::Vit(VitConfig::tiny()),
            other => match (Gpt2Config::named(other), LlamaConfig::named(other)) {
                (Some(config), _) => language(LanguageConfig::Gpt2(config.without_dropout())),
                (None, Some(config)) => language(LanguageConfig::Llama(config)),
                (None, None) => bail!(
                    "unknown model `{other}` (models: {})",
                    Model::NAMES.join(", ")
                ),
            },
        };
        let name = Model::NAMES
            .into_iter()
            .find(|n| *n == name)
            .expect("matched above");
        Ok(Model {
            name,
            arch,
            checkpointed_blocks: None,
            layers: None,
            stream_budget: None,
        })
    }

    /// The language model with `seq` tokens a row (`--seq`).
    pub(crate) fn with_seq(self, seq: usize) -> Result<Model> {
        let Arch::Language { config, loss, .. } = self.arch else {
            bail!(
                "--seq is for language models ({}), not {}",
                Model::LANGUAGE_NAMES,
                self.name
            );
        };
        if seq < 2 || seq > config.max_seq() {
            bail!(
                "--seq {seq}: {} takes 2 to {} tokens a row",
                self.name,
                config.max_seq()
            );
        }
        Ok(Model {
            arch: Arch::Language { config, seq, loss },
            ..self
        })
    }

    /// The language model with the unfused loss (`--unfused-loss`): the `[batch, seq, vocab]`
    /// logits, then the loss on them, as Hugging Face computes it.
    pub(crate) fn with_unfused_loss(self) -> Result<Model> {
        let Arch::Language { config, seq, .. } = self.arch else {
            bail!(
                "--unfused-loss is for language models ({}), not {}",
                Model::LANGUAGE_NAMES,
                self.name
            );
        };
        Ok(Model {
            arch: Arch::Language {
                config,
                seq,
                loss: LossPath::Unfused,
            },
            ..self
        })
    }

    /// The Llama-family model with `layers` decoder layers instead of its own (`--layers`): the
    /// shapes between the standard ones that `plan --find-max-model` walks.
    pub(crate) fn with_layers(self, layers: usize) -> Result<Model> {
        let Arch::Language {
            config: LanguageConfig::Llama(mut config),
            seq,
            loss,
        } = self.arch
        else {
            bail!(
                "--layers is for the Llama family (llama-tiny, qwen2-tiny, {}), not {}",
                LlamaConfig::STANDARD_NAMES.join(", "),
                self.name
            );
        };
        if layers == 0 {
            bail!("--layers 0: a model needs at least one layer");
        }
        config.num_hidden_layers = layers;
        Ok(Model {
            arch: Arch::Language {
                config: LanguageConfig::Llama(config),
                seq,
                loss,
            },
            layers: Some(layers),
            ..self
        })
    }

    /// The model whose checkpointed cases recompute its first `blocks` blocks and keep every
    /// activation of the others (`--checkpoint-blocks`): a plan's partial checkpointing.
    pub(crate) fn with_checkpointed_blocks(self, blocks: usize) -> Result<Model> {
        if blocks > self.n_blocks() {
            bail!(
                "--checkpoint-blocks {blocks}: {} has {} blocks",
                self.name,
                self.n_blocks()
            );
        }
        Ok(Model {
            checkpointed_blocks: Some(blocks),
            ..self
        })
    }

    /// The model whose streamed cases hold at most `bytes` of optimizer state coming in (and as
    /// many going back) instead of their own budget.
    pub(crate) fn with_stream_budget(self, bytes: u64) -> Model {
        Model {
            stream_budget: Some(bytes),
            ..self
        }
    }

    /// Its blocks (encoder blocks or transformer layers).
    pub(crate) fn n_blocks(&self) -> usize {
        match self.arch {
            Arch::Vit(config) => config.num_layers,
            Arch::Language { config, .. } => config.n_layers(),
        }
    }
}

/// A causal language model the benchmark trains, whatever its family: its training loss, its
/// parameters and its blocks.
pub(crate) trait LanguageModel: CausalLm + BlockStack + Send + Sync {}

impl<M: CausalLm + BlockStack + Send + Sync> LanguageModel for M {}

/// A model built on a backend.
pub(crate) enum Net {
    Vit(VisionTransformer),
    Language(Box<dyn LanguageModel>),
}

impl Net {
    /// `model` with `dtype` parameters, initialised from seed 0 (a language model with its loss
    /// path).
    pub(crate) fn new(backend: &BackendRef, model: Model, dtype: DType) -> Result<Net> {
        let generator = Arc::new(Generator::new(0));
        Ok(match model.arch {
            Arch::Vit(config) => {
                Net::Vit(VisionTransformer::new(backend, config, dtype, &generator)?)
            }
            Arch::Language { config, loss, .. } => Net::Language(match config {
                LanguageConfig::Gpt2(config) => {
                    let mut gpt2 = Gpt2LMHeadModel::new(backend, config, dtype, &generator)?;
                    gpt2.loss_path = loss;
                    Box::new(gpt2)
                }
                LanguageConfig::Llama(config) => {
                    let mut llama = LlamaForCausalLM::new(backend, config, dtype, &generator)?;
                    llama.loss_path = loss;
                    Box::new(llama)
                }
            }),
        })
    }

    /// The model as a stack of blocks.
    fn blocks(&self) -> &dyn BlockStack {
        match self {
            Net::Vit(vit) => vit,
            Net::Language(lm) => lm.as_ref(),
        }
    }

    /// The parameters, in `named_parameters()` order.
    pub(crate) fn parameters(&self) -> Vec<Tensor> {
        match self {
            Net::Vit(vit) => vit.parameters(),
            Net::Language(lm) => lm.parameters(),
        }
    }

    /// The parameters by name (Hugging Face's or torchvision's names).
    pub(crate) fn named_parameters(&self) -> Vec<(String, Tensor)> {
        match self {
            Net::Vit(vit) => vit.named_parameters(),
            Net::Language(lm) => lm.named_parameters(),
        }
    }

    /// Who runs the blocks now (`None`: they are called directly).
    pub(crate) fn block_runner(&self) -> Option<Arc<dyn BlockRunner>> {
        self.blocks().block_runner().cloned()
    }

    /// Runs the blocks through `runner` (checkpointing, offload, compression, a plan).
    pub(crate) fn set_block_runner(&mut self, runner: Option<Arc<dyn BlockRunner>>) {
        match self {
            Net::Vit(vit) => vit.set_block_runner(runner),
            Net::Language(lm) => lm.set_block_runner(runner),
        }
    }

    /// The forward and the loss: `model(x).float().sum()` for a ViT (the images cast to the
    /// parameters' dtype), Hugging Face's causal-LM loss (logits in f32, mean over the predicted
    /// positions, the labels the ids) for a language model, by its training-loss entry point
    /// ([`CausalLm::forward_loss`], fused unless `--unfused-loss`).
    pub(crate) fn loss(&self, input: &Input) -> Result<Tensor> {
        match (self, input) {
            (Net::Vit(vit), Input::Images(images)) => {
                // A half-precision model takes its images in its own dtype (`x.bfloat16()`).
                let dtype = vit.parameters().first().map_or(DType::F32, Tensor::dtype);
                let output = if dtype == images.dtype() {
                    vit.forward(images)?
                } else {
                    vit.forward(&images.to_dtype(dtype)?)?
                };
                Ok(output.to_dtype(DType::F32)?.sum_all()?)
            }
            (Net::Language(lm), Input::Tokens(ids)) => Ok(lm.forward_loss(ids, ids)?),
            _ => bail!("the input does not match the model"),
        }
    }
}

/// One batch of a model's input.
pub(crate) enum Input {
    /// `rand(batch, 3, size, size)`.
    Images(Tensor),
    /// Token ids `[batch, seq]`, also the labels (the loss shifts them: each position predicts
    /// the next token).
    Tokens(Tensor),
}

impl Input {
    /// `model`'s input at `batch` from autograd-core's counter-based stream (seed 0): uniform
    /// pixels, or uniform token ids.
    pub(crate) fn new(backend: &BackendRef, model: Model, batch: usize) -> Result<Input> {
        match model.arch {
            Arch::Vit(config) => {
                let size = config.image_size;
                // Each pixel is a pure function of its index: drawn on every thread (a probe of
                // find-max-batch at batch 800 is 120M of them).
                let pixels: Vec<f32> = (0..batch * 3 * size * size)
                    .into_par_iter()
                    .with_min_len(1 << 15)
                    .map(|i| uniform(0, i as u64) as f32)
                    .collect();
                Ok(Input::Images(Tensor::from_slice(
                    backend,
                    &pixels,
                    &[batch, 3, size, size],
                )?))
            }
            Arch::Language { config, seq, .. } => {
                let vocab = config.vocab_size();
                let ids: Vec<i64> = (0..batch * seq)
                    .map(|i| ((uniform(0, i as u64) * vocab as f64) as usize).min(vocab - 1) as i64)
                    .collect();
                Ok(Input::Tokens(Tensor::from_slice(
                    backend,
                    &ids,
                    &[batch, seq],
                )?))
            }
        }
    }
}
