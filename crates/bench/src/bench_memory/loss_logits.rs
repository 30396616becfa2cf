//! What the loss's logits take at their peak: for a causal language model, one more forward and
//! backward of the loss alone, after a case's steps, on the last hidden states of its input.
//!
//! The body runs without recording a graph and its hidden states become a leaf that requires
//! grad, so the loss's allocations are its own. The head and the loss run forward and backward
//! by the model's loss path (under the case's autocast) with the allocator's history on, and the
//! loss is dropped. Every block the loss allocated and freed again before the end is a
//! temporary (what outlives it is the gradients it leaves, the hidden states' and the head
//! weight's, and the cast cache's copies); the figure is the most requested bytes of temporaries
//! live at once:
//!
//! - Unfused (`--unfused-loss`): the logits `rows × vocab × b` (`b` the head's dtype bytes,
//!   `rows = batch × seq`), which the loss saves, and their gradient, as much again, live
//!   together in the loss's backward: `2 · rows · vocab · b`, plus the per-row I64 targets and
//!   the loss's per-row statistics. The loss upcasts the logits to f32 in registers, so a
//!   half-precision model adds no f32 copy.
//! - Fused (the default): autograd-core's `linear_cross_entropy` holds one tile of logits at a
//!   time, within its budget: [`LinearCrossEntropyOptions::chunk_bytes`] (64 MiB) plus 8 bytes a
//!   row (see its documentation), whatever the vocabulary; below the budget one tile holds every
//!   row.
//!
//! It sits on nn's [`CausalLm`] (hidden states and head loss) and one backend's caching
//! allocator, reached through [`Probe`]; it knows nothing about reports or the protocol.
//!
//! [`LinearCrossEntropyOptions::chunk_bytes`]: headroom_autograd_core::LinearCrossEntropyOptions::chunk_bytes
//! [`CausalLm`]: headroom_nn::CausalLm

use std::collections::HashMap;

use anyhow::{Context, Result};
use headroom_autograd_core::{autocast, no_grad};
use headroom_caching_allocator::{HistoryOptions, TraceAction, TraceEntry};

use super::cases::Case;
use super::models::{Input, Net};
use super::training::{Probe, Training};

/// The most bytes the loss of `training`'s language model held in temporaries at once (see the
/// module's documentation); `None` for a ViT. The gradients are cleared before and after.
pub(crate) fn measure(
    probe: &Probe<'_>,
    training: &Training,
    input: &Input,
    case: Case,
) -> Result<Option<u64>> {
    let (Net::Language(lm), Input::Tokens(ids)) = (&training.net, input) else {
        return Ok(None);
    };
    training.clear_grads()?;
    let _autocast = training.forward_policy(case)?.map(autocast);
    let hidden = {
        let _no_grad = no_grad();
        lm.hidden_states(ids)?
    };
    hidden.requires_grad_(true)?;
    let allocator = probe.allocator();
    probe.backend.synchronize()?;
    allocator.record_history(Some(HistoryOptions {
        max_entries: 1 << 22,
        record_context: false,
    }));
    let ran = lm
        .head_loss(&hidden, ids)
        .map_err(anyhow::Error::from)
        .and_then(|loss| Ok(loss.backward()?))
        .context("the loss alone");
    let synchronized = probe.backend.synchronize();
    let snapshot = allocator.snapshot();
    allocator.record_history(None);
    ran?;
    synchronized?;
    drop(hidden);
    training.clear_grads()?;
    let entries: Vec<&TraceEntry> = snapshot.device_traces.iter().flatten().collect();
    Ok(Some(peak_of_temporaries(&entries)))
}

/// The most requested bytes live at once in blocks that `entries` both allocate and free.
fn peak_of_temporaries(entries: &[&TraceEntry]) -> u64 {
    let is_free = |action| {
        matches!(
            action,
            TraceAction::FreeCompleted | TraceAction::Free | TraceAction::FreeRequested
        )
    };
    // Which allocations (by index) are freed within the entries.
    let mut open: HashMap<u64, usize> = HashMap::new();
    let mut freed = vec![false; entries.len()];
    for (index, entry) in entries.iter().enumerate() {
        if entry.action == TraceAction::Alloc {
            open.insert(entry.addr, index);
        } else if is_free(entry.action) {
            if let Some(allocated) = open.remove(&entry.addr) {
                freed[allocated] = true;
            }
        }
    }
    let (mut live, mut peak) = (HashMap::new(), 0u64);
    let mut current = 0u64;
    for (index, entry) in entries.iter().enumerate() {
        if entry.action == TraceAction::Alloc && freed[index] {
            live.insert(entry.addr, entry.size);
            current += entry.size;
            peak = peak.max(current);
        } else if is_free(entry.action) {
            current -= live.remove(&entry.addr).unwrap_or(0);
        }
    }
    peak
}
