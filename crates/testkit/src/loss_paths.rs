//! nn's causal language models trained once with the fused loss and once with the unfused one:
//! the tiny models ([`TinyLm`]: GPT-2 with its head tied to the embedding, Llama with its own
//! head), their token batches, what a run leaves ([`Trajectory`]) and how far two runs are
//! apart ([`LossPathGap`]). The training loops are the technique crates' tests' own (in
//! backward, ZeRO-2): this module knows no technique.
//!
//! ```
//! use headroom_nn::LossPath;
//! use headroom_testkit::loss_paths::{tokens, TinyLm};
//!
//! let cpu = headroom_ops_cpu::CpuBackend::new_ref();
//! let model = TinyLm::Llama.build(&cpu, LossPath::Unfused, 1)?;
//! let ids = tokens(&cpu, TinyLm::Llama, 2, 0)?;
//! let loss = model.forward_loss(&ids, &ids)?.item()?;
//! // About ln(128): an untrained model's guess over 128 tokens.
//! assert!((loss - 128f64.ln()).abs() < 0.1, "{loss}");
//! # Ok::<(), headroom_testkit::Error>(())
//! ```

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Generator, Tensor};
use headroom_nn::{
    CausalLm, Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaForCausalLM, LossPath, Module,
};

use crate::inputs::Xorshift;
use crate::worst::{nan_max, nan_max_f32};
use crate::Result;

/// Tokens in each row of [`tokens`].
pub const SEQ: usize = 16;

/// A tiny causal language model of each family, in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyLm {
    /// [`Gpt2Config::tiny`]: vocabulary 128, its head tied to `transformer.wte.weight`.
    Gpt2,
    /// [`LlamaConfig::tiny`]: vocabulary 128, its own `lm_head.weight`.
    Llama,
}

impl TinyLm {
    /// Both families.
    pub const ALL: [TinyLm; 2] = [TinyLm::Gpt2, TinyLm::Llama];

    /// `gpt2` or `llama`.
    pub fn name(self) -> &'static str {
        match self {
            TinyLm::Gpt2 => "gpt2",
            TinyLm::Llama => "llama",
        }
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(self) -> usize {
        match self {
            TinyLm::Gpt2 => Gpt2Config::tiny().vocab_size,
            TinyLm::Llama => LlamaConfig::tiny().vocab_size,
        }
    }

    /// The name of the head's weight in `named_parameters()`: the tied embedding's for GPT-2.
    pub fn head_weight_name(self) -> &'static str {
        match self {
            TinyLm::Gpt2 => "transformer.wte.weight",
            TinyLm::Llama => "lm_head.weight",
        }
    }

    /// The model in f32 from `seed`, its training loss computed by `loss`.
    pub fn build(
        self,
        backend: &BackendRef,
        loss: LossPath,
        seed: u64,
    ) -> Result<Box<dyn CausalLm>> {
        Ok(match self {
            TinyLm::Gpt2 => {
                let generator = Arc::new(Generator::new(seed));
                let mut gpt2 =
                    Gpt2LMHeadModel::new(backend, Gpt2Config::tiny(), DType::F32, &generator)?;
                gpt2.loss_path = loss;
                Box::new(gpt2)
            }
            TinyLm::Llama => {
                let generator = Generator::new(seed);
                let mut llama =
                    LlamaForCausalLM::new(backend, LlamaConfig::tiny(), DType::F32, &generator)?;
                llama.loss_path = loss;
                Box::new(llama)
            }
        })
    }
}

/// Token ids `[rows, SEQ]` of step `step`, the same for every caller (one xorshift stream a
/// step), each in `[0, vocab)`.
pub fn tokens(backend: &BackendRef, lm: TinyLm, rows: usize, step: usize) -> Result<Tensor> {
    let mut random = Xorshift::new(1000 + step as u64);
    let ids: Vec<i64> = (0..rows * SEQ)
        .map(|_| random.next_below(lm.vocab_size() as u64) as i64)
        .collect();
    Ok(Tensor::from_slice(backend, &ids, &[rows, SEQ])?)
}

/// What a training run leaves: each step's loss and every parameter's values after the last.
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    /// The loss of each step, in order.
    pub losses: Vec<f64>,
    /// Each parameter's values, in `named_parameters()` order.
    pub params: Vec<Vec<f32>>,
}

impl Trajectory {
    /// The parameters of `model` now, after `losses`.
    pub fn of<M: Module + ?Sized>(model: &M, losses: Vec<f64>) -> Result<Trajectory> {
        let params = model
            .parameters()
            .iter()
            .map(|param| param.to_vec::<f32>())
            .collect::<Result<_, _>>()?;
        Ok(Trajectory { losses, params })
    }
}

/// How far two runs are apart, relative: for each step's loss `|a − b| / |b|`, and for each
/// parameter `max |a − b| / max |b|` (against its own largest value, so an element near zero is
/// not divided by itself).
#[derive(Debug, Clone, PartialEq)]
pub struct LossPathGap {
    /// The worst step's relative loss difference.
    pub loss: f64,
    /// Each parameter's relative difference, in `named_parameters()` order.
    pub params: Vec<f64>,
}

impl LossPathGap {
    /// The gap between `ours` and `reference` (same steps, same parameters).
    pub fn between(ours: &Trajectory, reference: &Trajectory) -> LossPathGap {
        assert_eq!(ours.losses.len(), reference.losses.len(), "steps");
        assert_eq!(ours.params.len(), reference.params.len(), "parameters");
        let loss = ours
            .losses
            .iter()
            .zip(&reference.losses)
            .map(|(a, b)| (a - b).abs() / b.abs())
            .fold(0.0, nan_max);
        let params = ours
            .params
            .iter()
            .zip(&reference.params)
            .map(|(a, b)| {
                let scale = b
                    .iter()
                    .fold(f32::MIN_POSITIVE, |m, v| nan_max_f32(m, v.abs()));
                let worst = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, nan_max_f32);
                f64::from(worst / scale)
            })
            .collect();
        LossPathGap { loss, params }
    }

    /// Each parameter's name (from `model`, whose parameters the runs' are) with its gap.
    pub fn named<M: Module + ?Sized>(&self, model: &M) -> Vec<(String, f64)> {
        let names = model.named_parameters().into_iter().map(|(name, _)| name);
        names.zip(self.params.iter().copied()).collect()
    }

    /// Prints the gap (the worst loss, the worst parameter and the key biases' worst) under
    /// `what` and checks it against [`LOSS_BOUND`], [`PARAM_BOUND`] and [`KEY_BIAS_BOUND`]
    /// (GPT-2's `attn.c_attn.bias`); `model` names the parameters.
    pub fn assert_within<M: Module + ?Sized>(&self, what: &str, model: &M) {
        let named = self.named(model);
        let is_key_bias = |name: &str| name.ends_with("attn.c_attn.bias");
        let worst = |key_bias: bool| {
            named
                .iter()
                .filter(|(name, _)| is_key_bias(name) == key_bias)
                .fold(("-", 0.0), |most, (name, gap)| {
                    if gap.is_nan() || *gap > most.1 {
                        (name.as_str(), *gap)
                    } else {
                        most
                    }
                })
        };
        let (param, key_bias) = (worst(false), worst(true));
        println!(
            "{what}: loss {:.2e}, parameters {:.2e} ({}), key biases {:.2e}",
            self.loss, param.1, param.0, key_bias.1
        );
        assert!(self.loss <= LOSS_BOUND, "{what}: loss {:e}", self.loss);
        assert!(param.1 <= PARAM_BOUND, "{what}: {} {:e}", param.0, param.1);
        assert!(
            key_bias.1 <= KEY_BIAS_BOUND,
            "{what}: key biases {:e}",
            key_bias.1
        );
    }
}

/// The bound on each step's relative loss difference between the fused and the unfused loss
/// over 20 AdamW steps (lr 1e-3) in f32 on the CPU: the two sum the same loss in different orders
/// (the fused op's chunked log-sum-exp against the full logits'), a few ulps a step; measured at
/// most 1.3e-7 (tiny GPT-2 and Llama, in backward and under ZeRO-2), the bound about 8 times that.
pub const LOSS_BOUND: f64 = 1e-6;

/// The bound on a parameter's gap ([`LossPathGap::params`]) after those 20 steps: the gradients'
/// rounding differences go through AdamW's `m / sqrt(v)`, which magnifies them where a gradient
/// element is small; measured at most 4.9e-5 (the tiny Llama under ZeRO-2; 4.2e-5 for GPT-2),
/// the bound about 4 times that.
pub const PARAM_BOUND: f64 = 2e-4;

/// The bound for GPT-2's packed q/k/v bias, `attn.c_attn.bias`: its key third has a gradient of
/// 0 in exact arithmetic (a key bias adds the same score to every key of a query, which the
/// softmax ignores), so each run steps it by its own rounding noise, which Adam scales up to
/// steps of about `lr · noise / eps`; measured at most 3.2e-4 (under ZeRO-2; 2.1e-4 in
/// backward), the bound about 3 times that.
pub const KEY_BIAS_BOUND: f64 = 1e-3;
