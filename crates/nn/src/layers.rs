//! The basic layers: [`Linear`], [`LayerNorm`], [`Embedding`], [`Dropout`] and [`Mlp`], with
//! PyTorch's parameter names (`weight`, `bias`; `Mlp`'s linears as `0` and `3`, torchvision's
//! `MLPBlock` / `torchvision.ops.MLP` indices).
//!
//! Each layer is a thin owner of its parameters over one autograd-core op (`linear`,
//! `layer_norm`, `embedding`, `dropout`); the ops record the graph, so a layer has no backward
//! of its own.

use std::sync::Arc;

use headroom_autograd_core::{
    dropout, embedding, layer_norm, layer_norm_linear, BackendRef, DType, Generator, Tensor,
};

use crate::error::Result;
use crate::init::{parameter, Init};
use crate::module::{child_name, Module};

/// `y = x Wᵀ + b` over the last dim (`torch.nn.Linear`); `weight` is `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`, if any.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A layer initialised as PyTorch does: weight and bias uniform in ±1/sqrt(in_features).
    pub fn new(
        backend: &BackendRef,
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
        generator: &Generator,
    ) -> Result<Linear> {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let init = Init::uniform(-bound, bound);
        let bias_init = if bias { Some(init) } else { None };
        Linear::with_init(
            backend,
            [in_features, out_features],
            init,
            bias_init,
            dtype,
            generator,
        )
    }

    /// A layer `[in_features, out_features]` whose weight is drawn by `weight_init` and whose
    /// bias, if `bias_init` is given, by that (the schemes models use instead of the default).
    pub fn with_init(
        backend: &BackendRef,
        [in_features, out_features]: [usize; 2],
        weight_init: Init,
        bias_init: Option<Init>,
        dtype: DType,
        generator: &Generator,
    ) -> Result<Linear> {
        let weight = parameter(
            backend,
            &[out_features, in_features],
            dtype,
            weight_init,
            generator,
        )?;
        let bias = match bias_init {
            Some(init) => Some(parameter(backend, &[out_features], dtype, init, generator)?),
            None => None,
        };
        Ok(Linear { weight, bias })
    }

    /// Applies the layer.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        Ok(input.linear(&self.weight, self.bias.as_ref())?)
    }
}

impl Module for Linear {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "weight"), &self.weight);
        if let Some(bias) = &self.bias {
            visit(&child_name(prefix, "bias"), bias);
        }
    }

    fn set_training(&mut self, _training: bool) {}
}

/// Layer normalisation over the last dim with a scale and a shift (`torch.nn.LayerNorm`).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// Scale, `[dim]`, initialised to ones.
    pub weight: Tensor,
    /// Shift, `[dim]`, initialised to zeros.
    pub bias: Tensor,
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNorm {
    /// A layer over a last dim of `dim`.
    pub fn new(
        backend: &BackendRef,
        dim: usize,
        eps: f64,
        dtype: DType,
        generator: &Generator,
    ) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: parameter(backend, &[dim], dtype, Init::Constant(1.0), generator)?,
            bias: parameter(backend, &[dim], dtype, Init::Constant(0.0), generator)?,
            eps,
        })
    }

    /// Applies the layer.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let dim = self.weight.shape()[0];
        Ok(layer_norm(
            input,
            &[dim],
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
        )?)
    }

    /// `self.forward(input)?.linear(weight, bias)` as one op that keeps only `input` for
    /// backward, not the norm's output ([`layer_norm_linear`]): the same values and gradients,
    /// bit for bit.
    pub fn then_linear(
        &self,
        input: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let dim = self.weight.shape()[0];
        Ok(layer_norm_linear(
            input,
            &[dim],
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
            weight,
            bias,
        )?)
    }
}

impl Module for LayerNorm {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "weight"), &self.weight);
        visit(&child_name(prefix, "bias"), &self.bias);
    }

    fn set_training(&mut self, _training: bool) {}
}

/// A lookup table of `num` vectors (`torch.nn.Embedding`); indices are I64.
#[derive(Debug, Clone)]
pub struct Embedding {
    /// `[num_embeddings, embedding_dim]`.
    pub weight: Tensor,
}

impl Embedding {
    /// A table initialised from N(0, `std`²) (PyTorch's default is `std` = 1).
    pub fn new(
        backend: &BackendRef,
        num_embeddings: usize,
        embedding_dim: usize,
        std: f64,
        dtype: DType,
        generator: &Generator,
    ) -> Result<Embedding> {
        let init = Init::normal(0.0, std);
        Ok(Embedding {
            weight: parameter(
                backend,
                &[num_embeddings, embedding_dim],
                dtype,
                init,
                generator,
            )?,
        })
    }

    /// The rows picked by `indices` (any shape): `[..indices, embedding_dim]`.
    pub fn forward(&self, indices: &Tensor) -> Result<Tensor> {
        Ok(embedding(&self.weight, indices)?)
    }
}

impl Module for Embedding {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        visit(&child_name(prefix, "weight"), &self.weight);
    }

    fn set_training(&mut self, _training: bool) {}
}

/// Zeroes elements with probability `p` in training and scales the rest by `1 / (1 - p)`
/// (`torch.nn.Dropout`); the identity in evaluation or when `p` is 0. Draws come from a
/// generator shared by the model, whose state can be saved and restored.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub p: f64,
    /// Whether the layer drops (PyTorch's `training`).
    pub training: bool,
    generator: Arc<Generator>,
}

impl Dropout {
    /// A layer in training mode.
    pub fn new(p: f64, generator: Arc<Generator>) -> Dropout {
        Dropout {
            p,
            training: true,
            generator,
        }
    }

    /// Applies the layer.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        Ok(dropout(input, self.p, self.training, &self.generator)?)
    }

    /// Whether [`forward`](Dropout::forward) returns its input as it is (evaluation, or `p` 0),
    /// so ops on either side of it may fuse.
    pub fn is_identity(&self) -> bool {
        !self.training || self.p == 0.0
    }

    /// The generator the layer draws from (shared by the model): for an op that fuses the same
    /// dropout, drawing the same numbers.
    pub fn generator(&self) -> &Generator {
        &self.generator
    }
}

impl Module for Dropout {
    fn visit_parameters(&self, _prefix: &str, _visit: &mut dyn FnMut(&str, &Tensor)) {}

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}

/// The activation between an [`Mlp`]'s two linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// GELU with the exact normal CDF (`torch.nn.GELU()`).
    Gelu,
    /// GELU's tanh approximation (`GELU(approximate="tanh")`, GPT-2's `gelu_new`).
    GeluTanh,
}

impl Activation {
    /// Applies the activation.
    pub fn forward(self, input: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Activation::Relu => input.relu()?,
            Activation::Gelu => input.gelu()?,
            Activation::GeluTanh => input.gelu_tanh()?,
        })
    }
}

/// Linear, activation, dropout, linear, dropout — torchvision's `MLPBlock`, whose linears are
/// named `0` and `3`.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// The first linear (`0`), `in → hidden`.
    pub fc1: Linear,
    /// The activation (`1`).
    pub activation: Activation,
    /// Dropout after the activation (`2`) and after the second linear (`4`).
    pub dropout: Dropout,
    /// The second linear (`3`), `hidden → out`.
    pub fc2: Linear,
}

impl Mlp {
    /// An MLP `in_dim → hidden_dim → in_dim` with biases, initialised like `Linear`.
    pub fn new(
        backend: &BackendRef,
        in_dim: usize,
        hidden_dim: usize,
        activation: Activation,
        dropout: Dropout,
        dtype: DType,
        generator: &Generator,
    ) -> Result<Mlp> {
        Ok(Mlp {
            fc1: Linear::new(backend, in_dim, hidden_dim, true, dtype, generator)?,
            activation,
            dropout,
            fc2: Linear::new(backend, hidden_dim, in_dim, true, dtype, generator)?,
        })
    }

    /// Applies the block. With a GELU and no dropout between, the activation and the second
    /// linear are one op ([`Tensor::gelu_linear`]): same values and gradients, bit for bit, but
    /// only the pre-activation is kept for backward, not the activation too. With dropout, the
    /// exact GELU fuses with the first linear instead ([`Tensor::linear_gelu`]: same values,
    /// gradients and saved tensors).
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        if self.fuses_activation() {
            return self.after_first_linear(&self.fc1.forward(input)?);
        }
        let hidden = match self.activation {
            Activation::Gelu => input.linear_gelu(&self.fc1.weight, self.fc1.bias.as_ref())?,
            activation => activation.forward(&self.fc1.forward(input)?)?,
        };
        self.after_activation(&hidden)
    }

    /// `self.forward(&norm.forward(input)?)` with the norm and the first linear as one op
    /// ([`LayerNorm::then_linear`]), which keeps `input` for backward but not the norm's
    /// output: the same values and gradients, bit for bit (a pre-norm block's MLP).
    pub fn forward_normed(&self, norm: &LayerNorm, input: &Tensor) -> Result<Tensor> {
        let pre_activation = norm.then_linear(input, &self.fc1.weight, self.fc1.bias.as_ref())?;
        self.after_first_linear(&pre_activation)
    }

    /// Whether the activation runs inside the second linear's op: a GELU, no dropout between.
    fn fuses_activation(&self) -> bool {
        self.dropout.is_identity() && self.activation != Activation::Relu
    }

    /// The block from the first linear's output on.
    fn after_first_linear(&self, pre_activation: &Tensor) -> Result<Tensor> {
        let (weight, bias) = (&self.fc2.weight, self.fc2.bias.as_ref());
        match self.activation {
            _ if !self.fuses_activation() => {
                self.after_activation(&self.activation.forward(pre_activation)?)
            }
            Activation::GeluTanh => Ok(pre_activation.gelu_tanh_linear(weight, bias)?),
            _ => Ok(pre_activation.gelu_linear(weight, bias)?),
        }
    }

    /// Dropout, the second linear, dropout.
    fn after_activation(&self, hidden: &Tensor) -> Result<Tensor> {
        let hidden = self.dropout.forward(hidden)?;
        self.dropout.forward(&self.fc2.forward(&hidden)?)
    }
}

impl Module for Mlp {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(&str, &Tensor)) {
        self.fc1.visit_parameters(&child_name(prefix, "0"), visit);
        self.fc2.visit_parameters(&child_name(prefix, "3"), visit);
    }

    fn set_training(&mut self, training: bool) {
        self.dropout.set_training(training);
    }
}
