//! Hugging Face's causal-LM loss (`ForCausalLMLoss`), the one GPT-2 and the Llama family share:
//! the logits upcast to f32, position `t` predicting label `t + 1`, the mean over the
//! `batch × (seq - 1)` predictions, labels of -100 skipped. This module knows no model; each
//! model's `loss` names itself in the errors. [`causal_lm_loss_from_hidden`] is the same loss
//! taken from the last hidden states and the head's weight with the fused
//! [`linear_cross_entropy`], so the `[batch, seq, vocab]` logits never exist.

use headroom_autograd_core::{
    cross_entropy_f32, linear_cross_entropy, LinearCrossEntropyOptions, Reduction, Tensor,
};

use crate::error::{NnError, Result};

/// The label Hugging Face's loss skips.
pub const IGNORE_INDEX: i64 = -100;

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
    let [batch, seq, vocab] = *logits.shape() else {
        return Err(NnError::InvalidInput {
            module,
            reason: format!(
                "expected logits [batch, seq, vocab], got {:?}",
                logits.shape()
            ),
        });
    };
    if labels.shape() != [batch, seq] {
        return Err(NnError::InvalidInput {
            module,
            reason: format!(
                "labels {:?} do not match logits {:?}",
                labels.shape(),
                logits.shape()
            ),
        });
    }
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
    let [batch, seq, _] = *hidden.shape() else {
        return Err(NnError::InvalidInput {
            module,
            reason: format!(
                "expected hidden states [batch, seq, features], got {:?}",
                hidden.shape()
            ),
        });
    };
    if labels.shape() != [batch, seq] {
        return Err(NnError::InvalidInput {
            module,
            reason: format!(
                "labels {:?} do not match hidden states {:?}",
                labels.shape(),
                hidden.shape()
            ),
        });
    }
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

/// The next-token targets of `labels` as an I64 tensor of `rows` elements on `like`'s backend.
fn shifted_targets(like: &Tensor, labels: &Tensor, rows: usize, seq: usize) -> Result<Tensor> {
    let shifted = next_token_targets(&labels.to_vec::<i64>()?, seq, IGNORE_INDEX);
    Ok(Tensor::from_slice(like.backend(), &shifted, &[rows])?)
}
