//! Hugging Face's causal-LM loss (`ForCausalLMLoss`), the one GPT-2 and the Llama family share:
//! the logits upcast to f32, position `t` predicting label `t + 1`, the mean over the
//! `batch × (seq - 1)` predictions, labels of -100 skipped. [`causal_lm_loss_from_hidden`] is the
//! same loss taken from the last hidden states and the head's weight with the fused
//! [`linear_cross_entropy`], so the `[batch, seq, vocab]` logits never exist.
//!
//! [`CausalLm`] is what a causal language model offers a training loop: its hidden states, its
//! head's weight and one training-loss entry point, [`CausalLm::forward_loss`], which takes the
//! fused path unless the model's [`LossPath`] says [`LossPath::Unfused`]. This module knows no
//! model; each model names itself in the errors.

use headroom_autograd_core::{
    cross_entropy_f32, linear_cross_entropy, DType, LinearCrossEntropyOptions, Reduction, Tensor,
};

use crate::error::{NnError, Result};
use crate::module::Module;

/// The label Hugging Face's loss skips.
pub const IGNORE_INDEX: i64 = -100;

/// How a causal language model computes its training loss ([`CausalLm::forward_loss`]): both
/// paths give Hugging Face's causal-LM loss (shift by one, -100 skipped, the mean in f32) and
/// the same gradients within f32 rounding; they differ in what they hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossPath {
    /// The head and the loss in one [`linear_cross_entropy`], chunked as the options say (their
    /// `ignore_index` and `reduction` are replaced by the loss's own: -100 and the mean): the
    /// `[batch, seq, vocab]` logits and their gradient never exist. The default, with
    /// [`LinearCrossEntropyOptions::default`] (64 MiB chunks).
    Fused(LinearCrossEntropyOptions),
    /// The logits `[batch, seq, vocab]` in the model's dtype (held for backward with their
    /// gradient), then the loss on them: what `model.loss(&model.forward(ids)?, labels)` does.
    Unfused,
}

impl Default for LossPath {
    fn default() -> Self {
        LossPath::Fused(LinearCrossEntropyOptions::default())
    }
}

/// A causal language model as a training loop sees it: the body's last hidden states, the
/// head's weight, and the training loss ([`CausalLm::forward_loss`]), fused by default.
///
/// ```
/// use std::sync::Arc;
/// use headroom_autograd_core::{DType, Generator, Tensor};
/// use headroom_nn::{CausalLm, Gpt2Config, Gpt2LMHeadModel, LossPath};
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let mut model =
///     Gpt2LMHeadModel::new(&cpu, Gpt2Config::tiny(), DType::F32, &Arc::new(Generator::new(0)))?;
/// let ids = Tensor::from_slice(&cpu, &[1i64, 5, 9, 2, 7, 3], &[2, 3])?;
/// // Fused: the head and the loss in one linear_cross_entropy, no [2, 3, 128] logits.
/// assert!(matches!(model.loss_path, LossPath::Fused(_)));
/// let fused = model.forward_loss(&ids, &ids)?;
/// fused.backward()?;
/// // Unfused: the logits, then `loss` on them; the same value within f32 rounding.
/// model.loss_path = LossPath::Unfused;
/// let unfused = model.forward_loss(&ids, &ids)?.item()?;
/// assert!((fused.item()? - unfused).abs() <= 1e-6 * unfused.abs());
/// # Ok::<(), headroom_nn::NnError>(())
/// ```
pub trait CausalLm: Module {
    /// The body's last hidden states `[batch, seq, features]` of token ids `[batch, seq]` (I64):
    /// everything but the head.
    fn hidden_states(&self, input_ids: &Tensor) -> Result<Tensor>;

    /// The head's weight, `[vocab, features]` (the token embedding's when tied).
    fn head_weight(&self) -> &Tensor;

    /// Hugging Face's causal-LM loss of the logits of `hidden` (from
    /// [`CausalLm::hidden_states`]) against `labels` `[batch, seq]` (I64), by the model's
    /// [`LossPath`]: fused, or the logits then the loss. The loss is f32 (f64 for an f64 model).
    fn head_loss(&self, hidden: &Tensor, labels: &Tensor) -> Result<Tensor>;

    /// The training loss of token ids `[batch, seq]` against `labels` `[batch, seq]` (usually
    /// the ids themselves; -100 skips a position): the body, then [`CausalLm::head_loss`].
    fn forward_loss(&self, input_ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.head_loss(&self.hidden_states(input_ids)?, labels)
    }
}

/// What each position of `labels` (rows of `seq`, flattened) predicts: the next label in its row,
/// and `ignore_index` at a row's last position (causal-LM loss's shift, done on the host).
pub fn next_token_targets(labels: &[i64], seq: usize, ignore_index: i64) -> Vec<i64> {
    (0..labels.len())
        .map(|idx| {
            if idx % seq + 1 < seq {
                labels[idx + 1]
            } else {
                ignore_index
            }
        })
        .collect()
}

/// The causal-LM loss of `logits` `[batch, seq, vocab]` against `labels` `[batch, seq]` (I64),
/// errors naming `module`.
pub(crate) fn causal_lm_loss(
    module: &'static str,
    logits: &Tensor,
    labels: &Tensor,
) -> Result<Tensor> {
    let (batch, seq) = rows_of_labels(module, ["logits", "vocab"], logits, labels)?;
    let vocab = logits.shape()[2];
    let target = shifted_targets(logits, labels, batch * seq, seq)?;
    // The f32 upcast happens inside the fused loss: f16/bf16 logits are not copied to f32.
    let logits = logits.reshape(&[batch * seq, vocab])?;
    Ok(cross_entropy_f32(
        &logits,
        &target,
        IGNORE_INDEX,
        Reduction::Mean,
    )?)
}

/// The causal-LM loss of the logits `hidden @ head_weightᵀ` (`hidden` `[batch, seq, features]`,
/// `head_weight` `[vocab, features]`) against `labels` `[batch, seq]`, computed by the fused
/// [`linear_cross_entropy`] with `options` (their `ignore_index` and `reduction` are Hugging
/// Face's: -100 and the mean); errors name `module`. Equal to [`causal_lm_loss`] of the logits
/// within the fused op's tolerance, without holding them.
pub(crate) fn causal_lm_loss_from_hidden(
    module: &'static str,
    hidden: &Tensor,
    head_weight: &Tensor,
    labels: &Tensor,
    options: &LinearCrossEntropyOptions,
) -> Result<Tensor> {
    let (batch, seq) = rows_of_labels(module, ["hidden states", "features"], hidden, labels)?;
    let target = shifted_targets(hidden, labels, batch * seq, seq)?.reshape(&[batch, seq])?;
    let options = LinearCrossEntropyOptions {
        ignore_index: IGNORE_INDEX,
        reduction: Some(Reduction::Mean),
        ..*options
    };
    Ok(linear_cross_entropy(
        hidden,
        head_weight,
        None,
        &target,
        &options,
    )?)
}

/// [`CausalLm::head_loss`] of a model named `module` whose head has no bias: the fused loss, or
/// the logits `hidden @ head_weightᵀ` and [`causal_lm_loss`] on them.
pub(crate) fn causal_lm_head_loss(
    module: &'static str,
    path: &LossPath,
    hidden: &Tensor,
    head_weight: &Tensor,
    labels: &Tensor,
) -> Result<Tensor> {
    match path {
        LossPath::Fused(options) => {
            causal_lm_loss_from_hidden(module, hidden, head_weight, labels, options)
        }
        LossPath::Unfused => causal_lm_loss(module, &hidden.linear(head_weight, None)?, labels),
    }
}

/// `[batch, seq]` of `states` `[batch, seq, last]` (the logits or the hidden states, named by
/// `[what, last]` in the errors), checked to be the shape of `labels`.
fn rows_of_labels(
    module: &'static str,
    [what, last]: [&str; 2],
    states: &Tensor,
    labels: &Tensor,
) -> Result<(usize, usize)> {
    let [batch, seq, _] = *states.shape() else {
        return Err(NnError::InvalidInput {
            module,
            reason: format!(
                "expected {what} [batch, seq, {last}], got {:?}",
                states.shape()
            ),
        });
    };
    if labels.shape() != [batch, seq] {
        return Err(NnError::InvalidInput {
            module,
            reason: format!(
                "labels {:?} do not match {what} {:?}",
                labels.shape(),
                states.shape()
            ),
        });
    }
    Ok((batch, seq))
}

/// The next-token targets of `labels` as an I64 tensor of `rows` elements on `like`'s backend.
fn shifted_targets(like: &Tensor, labels: &Tensor, rows: usize, seq: usize) -> Result<Tensor> {
    // On the labels' device, reading nothing back: a CUDA graph can capture the loss.
    let shifted = Tensor::full(
        like.backend(),
        &[rows / seq.max(1), seq],
        IGNORE_INDEX as f64,
        DType::I64,
    )?;
    if seq > 1 {
        shifted
            .narrow(1, 0, seq - 1)?
            .copy_(&labels.narrow(1, 1, seq - 1)?)?;
    }
    Ok(shifted.reshape(&[rows])?)
}
