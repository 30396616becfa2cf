//! Training cases as data: which model, which data, how many steps, which optimizer, and how
//! close a technique must stay to the plain loop ([`TrainCase`]); and what a case builds (a
//! [`Model`], its [`Batch`]es, its optimizer).
//!
//! Everything a case builds is a function of its seed: the model's initial weights come from a
//! `Generator` seeded with it, the batches from an [`Xorshift`] stream of it, so two runs of a
//! case start from the same parameters and see the same data on any backend.

use std::fmt;
use std::sync::Arc;

use headroom_autograd_core::{cross_entropy, BackendRef, DType, Generator, Reduction, Tensor};
use headroom_nn::{
    Activation, BlockStack, Dropout, Gpt2Config, Gpt2LMHeadModel, Mlp, Module, VisionTransformer,
    VitConfig,
};
use headroom_optim::kernels::Bf16Rounding;
use headroom_optim::{
    Adafactor, AdafactorConfig, Adam, Adam4bit, Adam4bitConfig, Adam8bit, Adam8bitConfig,
    AdamConfig, AdamStochastic, AdamStochasticConfig, Implementation, OffloadConfig, OffloadedAdam,
    Optimizer, ParamGroup, Sgd, SgdConfig,
};

use crate::inputs::Xorshift;
use crate::Result;

/// One training run, as data.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainCase {
    /// Names the case in reports and failures.
    pub name: &'static str,
    /// The model and the shape of its data.
    pub model: ModelSpec,
    /// The parameters' dtype.
    pub dtype: DType,
    /// Examples per batch.
    pub batch: usize,
    /// Optimizer steps (one batch each).
    pub steps: usize,
    /// The optimizer of the plain loop.
    pub optimizer: OptimSpec,
    /// How close a technique's parameters must stay to the plain loop's, and why that close.
    pub tolerance: Tolerance,
    /// Seeds the initial weights and the batches.
    pub seed: u64,
}

/// A model configuration and the data it trains on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ModelSpec {
    /// torchvision's `VisionTransformer`: images `[batch, 3, size, size]` in [-1, 1), labels
    /// in [0, classes), cross-entropy.
    Vit(VitConfig),
    /// Hugging Face's `GPT2LMHeadModel`: token ids `[batch, seq]`, its causal-LM loss.
    Gpt2 {
        /// The model.
        config: Gpt2Config,
        /// Tokens per sequence (at most `config.n_positions`).
        seq: usize,
    },
    /// nn's `Mlp` (`width → hidden → width`, GELU) as a classifier over `width` classes:
    /// inputs `[batch, width]` in [-1, 1), cross-entropy.
    Mlp {
        /// Input features and classes.
        width: usize,
        /// Hidden features.
        hidden: usize,
    },
}

/// What a case builds from a [`ModelSpec`]. Techniques that run the blocks their way (activation
/// checkpointing, offload) reach them through [`Model::blocks_mut`]; others that change the
/// forward pass (autocast) match on it.
#[derive(Debug)]
pub enum Model {
    /// A [`ModelSpec::Vit`].
    Vit(VisionTransformer),
    /// A [`ModelSpec::Gpt2`].
    Gpt2(Gpt2LMHeadModel),
    /// A [`ModelSpec::Mlp`].
    Mlp(Mlp),
}

/// One batch: the model's input and what its loss compares the output with.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Images, token ids or features, batch first.
    pub input: Tensor,
    /// Class labels (ViT, MLP) or the token ids themselves (GPT-2), batch first.
    pub target: Tensor,
}

/// An optimizer as data; [`OptimSpec::build`] makes it.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimSpec {
    /// `torch.optim.SGD`.
    Sgd {
        /// Its hyperparameters.
        config: SgdConfig,
        /// How its update is computed.
        implementation: Implementation,
    },
    /// `torch.optim.Adam` or, with decoupled weight decay, `AdamW`.
    Adam {
        /// Its hyperparameters.
        config: AdamConfig,
        /// How its update is computed.
        implementation: Implementation,
    },
    /// bitsandbytes' `Adam8bit` (its one form is fused).
    Adam8bit {
        /// Its hyperparameters.
        config: Adam8bitConfig,
    },
    /// torchao's `Adam4bit` / `AdamW4bit` (its one form is fused).
    Adam4bit {
        /// Its hyperparameters.
        config: Adam4bitConfig,
    },
    /// `torch.optim.Adafactor`.
    Adafactor {
        /// Its hyperparameters.
        config: AdafactorConfig,
        /// How its update is computed.
        implementation: Implementation,
    },
    /// Adam or AdamW over bf16 parameters rounded stochastically, f32 moments (torchao's
    /// `_AdamW(bf16_stochastic_round=True)`; fused).
    AdamStochastic {
        /// Its hyperparameters and seed.
        config: AdamStochasticConfig,
    },
    /// Adam or AdamW with its state in host memory, stepped by the host (`OffloadedAdam`).
    Offloaded {
        /// Its hyperparameters, seed and queue depth.
        config: OffloadConfig,
    },
}

/// How close a technique's parameters must stay to the plain loop's after the last step, with
/// the reason that makes the bound right (shown in every failure).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tolerance {
    /// The same bits in every element: the technique runs the same float operations in the same
    /// order on deterministic kernels.
    Bitwise {
        /// Why the technique must not change a bit.
        why: &'static str,
    },
    /// Every element within `max` units in the last place of the parameter's dtype.
    Ulps {
        /// The largest distance allowed.
        max: u64,
        /// Where the differences come from and why they stay this small.
        why: &'static str,
    },
    /// Per parameter, `max |technique - baseline| / max |baseline| <= max` (an element-wise
    /// ratio means nothing for entries that are zero up to rounding).
    Relative {
        /// The largest relative error allowed.
        max: f64,
        /// Where the differences come from and why they stay this small.
        why: &'static str,
    },
}

impl TrainCase {
    /// The model of this case on `backend`, initialised from the case's seed.
    pub fn build_model(&self, backend: &BackendRef) -> Result<Model> {
        self.model.build(backend, self.dtype, self.seed)
    }
}

impl ModelSpec {
    /// The model on `backend` in `dtype`, its weights drawn from `Generator::new(seed)`.
    pub fn build(&self, backend: &BackendRef, dtype: DType, seed: u64) -> Result<Model> {
        let generator = Arc::new(Generator::new(seed));
        Ok(match *self {
            ModelSpec::Vit(config) => {
                Model::Vit(VisionTransformer::new(backend, config, dtype, &generator)?)
            }
            ModelSpec::Gpt2 { config, .. } => {
                Model::Gpt2(Gpt2LMHeadModel::new(backend, config, dtype, &generator)?)
            }
            ModelSpec::Mlp { width, hidden } => Model::Mlp(Mlp::new(
                backend,
                width,
                hidden,
                Activation::Gelu,
                Dropout::new(0.0, Arc::clone(&generator)),
                dtype,
                &generator,
            )?),
        })
    }

    /// A batch of `size` examples drawn from `random`; float inputs in `dtype`.
    pub fn batch(
        &self,
        backend: &BackendRef,
        dtype: DType,
        size: usize,
        random: &mut Xorshift,
    ) -> Result<Batch> {
        let mut floats = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|_| f64::from(random.next_signed_f32()))
                .collect()
        };
        match *self {
            ModelSpec::Vit(config) => {
                let side = config.image_size;
                let images = floats(size * 3 * side * side);
                let input = Tensor::from_f64s(backend, &images, &[size, 3, side, side], dtype)?;
                let target = labels(backend, size, config.num_classes, random)?;
                Ok(Batch { input, target })
            }
            ModelSpec::Gpt2 { config, seq } => {
                let ids = labels(backend, size * seq, config.vocab_size, random)?;
                let input = ids.reshape(&[size, seq])?;
                Ok(Batch {
                    target: input.clone(),
                    input,
                })
            }
            ModelSpec::Mlp { width, .. } => {
                let features = floats(size * width);
                let input = Tensor::from_f64s(backend, &features, &[size, width], dtype)?;
                let target = labels(backend, size, width, random)?;
                Ok(Batch { input, target })
            }
        }
    }
}

/// `n` class ids in [0, classes) as an I64 tensor `[n]`.
fn labels(backend: &BackendRef, n: usize, classes: usize, random: &mut Xorshift) -> Result<Tensor> {
    let ids: Vec<i64> = (0..n)
        .map(|_| random.next_below(classes as u64) as i64)
        .collect();
    Ok(Tensor::from_slice(backend, &ids, &[n])?)
}

impl Model {
    /// The model's output for `input`: class logits (ViT, MLP) or next-token logits (GPT-2).
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Model::Vit(vit) => vit.forward(input)?,
            Model::Gpt2(gpt2) => gpt2.forward(input)?,
            Model::Mlp(mlp) => mlp.forward(input)?,
        })
    }

    /// The mean loss of `output` against the batch's target: cross-entropy, or GPT-2's
    /// causal-LM loss (logits upcast to f32, as Hugging Face does).
    pub fn loss(&self, output: &Tensor, batch: &Batch) -> Result<Tensor> {
        Ok(match self {
            Model::Gpt2(gpt2) => gpt2.loss(output, &batch.target)?,
            Model::Vit(_) | Model::Mlp(_) => {
                cross_entropy(output, &batch.target, -100, Reduction::Mean)?
            }
        })
    }

    /// The model as a [`Module`]: parameters, names, `zero_grad`.
    pub fn module(&self) -> &dyn Module {
        match self {
            Model::Vit(vit) => vit,
            Model::Gpt2(gpt2) => gpt2,
            Model::Mlp(mlp) => mlp,
        }
    }

    /// The model's stack of blocks, where a technique attaches its block runner; `None` for the
    /// MLP, which has no blocks.
    pub fn blocks_mut(&mut self) -> Option<&mut dyn BlockStack> {
        match self {
            Model::Vit(vit) => Some(vit),
            Model::Gpt2(gpt2) => Some(gpt2),
            Model::Mlp(_) => None,
        }
    }
}

impl Module for Model {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.module().visit_parameters(prefix, visit);
    }

    fn set_training(&mut self, training: bool) {
        match self {
            Model::Vit(vit) => vit.set_training(training),
            Model::Gpt2(gpt2) => gpt2.set_training(training),
            Model::Mlp(mlp) => mlp.set_training(training),
        }
    }
}

impl Batch {
    /// Examples `start..start + len` of the batch (views, no copy), for techniques that split a
    /// batch into micro-batches.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Batch> {
        Ok(Batch {
            input: self.input.narrow(0, start, len)?,
            target: self.target.narrow(0, start, len)?,
        })
    }

    /// Examples in the batch.
    pub fn len(&self) -> usize {
        self.input.shape()[0]
    }

    /// Whether the batch holds no example.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl OptimSpec {
    /// Plain SGD (`torch.optim.SGD(lr=lr)`), fused.
    pub fn sgd(lr: f64) -> OptimSpec {
        OptimSpec::Sgd {
            config: SgdConfig::new(lr),
            implementation: Implementation::Fused,
        }
    }

    /// SGD with momentum, fused.
    pub fn sgd_momentum(lr: f64, momentum: f64) -> OptimSpec {
        OptimSpec::Sgd {
            config: SgdConfig {
                momentum,
                ..SgdConfig::new(lr)
            },
            implementation: Implementation::Fused,
        }
    }

    /// `torch.optim.Adam(lr=lr)` with PyTorch's other defaults, fused.
    pub fn adam(lr: f64) -> OptimSpec {
        OptimSpec::Adam {
            config: AdamConfig {
                lr,
                ..AdamConfig::adam()
            },
            implementation: Implementation::Fused,
        }
    }

    /// `torch.optim.AdamW(lr=lr, weight_decay=weight_decay)`, fused.
    pub fn adamw(lr: f64, weight_decay: f64) -> OptimSpec {
        OptimSpec::Adam {
            config: AdamConfig {
                lr,
                weight_decay,
                ..AdamConfig::adamw()
            },
            implementation: Implementation::Fused,
        }
    }

    /// bitsandbytes' `Adam8bit(lr=lr)` (blockwise 8-bit states).
    pub fn adam8bit(lr: f64) -> OptimSpec {
        OptimSpec::Adam8bit {
            config: Adam8bitConfig {
                lr,
                ..Adam8bitConfig::adam()
            },
        }
    }

    /// torchao's `AdamW4bit(lr=lr)` (blockwise 4-bit states).
    pub fn adamw4bit(lr: f64) -> OptimSpec {
        OptimSpec::Adam4bit {
            config: Adam4bitConfig {
                lr,
                ..Adam4bitConfig::adamw()
            },
        }
    }

    /// `torch.optim.Adafactor(lr=lr)` with PyTorch's other defaults, fused.
    pub fn adafactor(lr: f64) -> OptimSpec {
        OptimSpec::Adafactor {
            config: AdafactorConfig {
                lr,
                ..AdafactorConfig::new()
            },
            implementation: Implementation::Fused,
        }
    }

    /// AdamW (`lr`, weight decay 1e-2) over bf16 parameters rounded stochastically with `seed`.
    pub fn adamw_stochastic(lr: f64, seed: u64) -> OptimSpec {
        OptimSpec::AdamStochastic {
            config: AdamStochasticConfig::new(
                AdamConfig {
                    lr,
                    ..AdamConfig::adamw()
                },
                seed,
            ),
        }
    }

    /// `adam` (Adam or AdamW) with its state in host memory, bf16 parameters rounded
    /// stochastically with `seed` (the same bits as [`OptimSpec::AdamStochastic`] of `adam` and
    /// `seed`, or as [`OptimSpec::Adam`] of `adam` on f32 parameters).
    pub fn offloaded(adam: AdamConfig, seed: u64) -> OptimSpec {
        OptimSpec::Offloaded {
            config: OffloadConfig {
                seed,
                ..OffloadConfig::new(adam)
            },
        }
    }

    /// The same optimizer computed another way (8- and 4-bit Adam have one way: fused).
    pub fn with_implementation(self, implementation: Implementation) -> OptimSpec {
        match self {
            OptimSpec::Sgd { config, .. } => OptimSpec::Sgd {
                config,
                implementation,
            },
            OptimSpec::Adam { config, .. } => OptimSpec::Adam {
                config,
                implementation,
            },
            OptimSpec::Adafactor { config, .. } => OptimSpec::Adafactor {
                config,
                implementation,
            },
            fused_only @ (OptimSpec::Adam8bit { .. }
            | OptimSpec::Adam4bit { .. }
            | OptimSpec::AdamStochastic { .. }
            | OptimSpec::Offloaded { .. }) => fused_only,
        }
    }

    /// The same optimizer storing bf16 parameters by `rounding` (8- and 4-bit Adam; the other
    /// rules round to nearest, unchanged).
    pub fn with_bf16_rounding(self, rounding: Bf16Rounding) -> OptimSpec {
        match self {
            OptimSpec::Adam8bit { config } => OptimSpec::Adam8bit {
                config: Adam8bitConfig {
                    bf16_rounding: rounding,
                    ..config
                },
            },
            OptimSpec::Adam4bit { config } => OptimSpec::Adam4bit {
                config: Adam4bitConfig {
                    bf16_rounding: rounding,
                    ..config
                },
            },
            other => other,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimSpec::Sgd { config, .. } => config.lr,
            OptimSpec::Adam { config, .. } => config.lr,
            OptimSpec::Adam8bit { config } => config.lr,
            OptimSpec::Adam4bit { config } => config.lr,
            OptimSpec::Adafactor { config, .. } => config.lr,
            OptimSpec::AdamStochastic { config } => config.adam.lr,
            OptimSpec::Offloaded { config } => config.adam.lr,
        }
    }

    /// The same optimizer with learning rate `lr`.
    pub fn with_lr(mut self, lr: f64) -> OptimSpec {
        match &mut self {
            OptimSpec::Sgd { config, .. } => config.lr = lr,
            OptimSpec::Adam { config, .. } => config.lr = lr,
            OptimSpec::Adam8bit { config } => config.lr = lr,
            OptimSpec::Adam4bit { config } => config.lr = lr,
            OptimSpec::Adafactor { config, .. } => config.lr = lr,
            OptimSpec::AdamStochastic { config } => config.adam.lr = lr,
            OptimSpec::Offloaded { config } => config.adam.lr = lr,
        }
        self
    }

    /// The optimizer over `params` (one group).
    pub fn build(&self, params: Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
        Ok(match self {
            OptimSpec::Sgd {
                config,
                implementation,
            } => Box::new(Sgd::new(
                vec![ParamGroup::new(params, config.clone())],
                *implementation,
            )?),
            OptimSpec::Adam {
                config,
                implementation,
            } => Box::new(Adam::new(
                vec![ParamGroup::new(params, config.clone())],
                *implementation,
            )?),
            OptimSpec::Adam8bit { config } => Box::new(Adam8bit::new(
                vec![ParamGroup::new(params, config.clone())],
                Implementation::Fused,
            )?),
            OptimSpec::Adam4bit { config } => Box::new(Adam4bit::new(
                vec![ParamGroup::new(params, config.clone())],
                Implementation::Fused,
            )?),
            OptimSpec::Adafactor {
                config,
                implementation,
            } => Box::new(Adafactor::new(
                vec![ParamGroup::new(params, config.clone())],
                *implementation,
            )?),
            OptimSpec::AdamStochastic { config } => Box::new(AdamStochastic::new(
                vec![ParamGroup::new(params, config.clone())],
                Implementation::Fused,
            )?),
            OptimSpec::Offloaded { config } => {
                Box::new(OffloadedAdam::new(params, config.clone())?)
            }
        })
    }
}

impl fmt::Display for Tolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tolerance::Bitwise { why } => write!(f, "bitwise equality ({why})"),
            Tolerance::Ulps { max, why } => write!(f, "{max} ulps ({why})"),
            Tolerance::Relative { max, why } => {
                write!(f, "a relative error of {max:e} per parameter ({why})")
            }
        }
    }
}
