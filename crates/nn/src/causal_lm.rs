//! Hugging Face's causal-LM loss (`ForCausalLMLoss`), the one GPT-2 and the Llama family share:
//! the logits upcast to f32, position `t` predicting label `t + 1`, the mean over the
//! `batch × (seq - 1)` predictions, labels of -100 skipped. This module knows no model; each
//! model's `loss` names itself in the errors.

use headroom_autograd_core::{cross_entropy_f32, Reduction, Tensor};

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
    let shifted = next_token_targets(&labels.to_vec::<i64>()?, seq, IGNORE_INDEX);
    let target = Tensor::from_slice(logits.backend(), &shifted, &[batch * seq])?;
    // The f32 upcast happens inside the fused loss: f16/bf16 logits are not copied to f32.
    let logits = logits.reshape(&[batch * seq, vocab])?;
    Ok(cross_entropy_f32(
        &logits,
        &target,
        IGNORE_INDEX,
        Reduction::Mean,
    )?)
}
