//! The traced step's allocator history as a memory timeline and as a breakdown of its peak.
//!
//! The history holds every client allocation and free with its requested size and the context
//! label it happened under (`forward`, `backward`, `step`, `zero_grad`). Replaying it from the
//! requested bytes live when recording began gives the allocator's `requested_bytes` after each
//! event: the timeline. At the moment of its maximum, every live block is attributed:
//! - parameters and optimizer state: their exact byte counts (they were allocated before the
//!   traced step, so they are part of the starting figure);
//! - input and other: the rest of the starting figure (the input images; on CUDA the cuBLAS
//!   workspace) and blocks allocated outside any phase;
//! - activations: blocks the forward allocated that are still live;
//! - gradients: blocks the backward allocated that are still live when backward ends and hold a
//!   parameter's gradient then;
//! - backward temporaries: the other live blocks the backward allocated;
//! - step temporaries: live blocks the optimizer step (or `zero_grad`) allocated;
//! - allocator rounding: the step's peak allocated bytes minus its peak requested bytes (each
//!   block is rounded up, at least to 512 bytes, and a block too small to split keeps its
//!   remainder).
//!
//! The components add up to the traced step's peak allocated bytes exactly. This module knows
//! trace entries and byte counts only: no tensor, no model.

use std::collections::{HashMap, HashSet};

use anyhow::{bail, Result};
use headroom_caching_allocator::{TraceAction, TraceEntry};

use super::training::Phase;

/// Bytes held from before the traced step, known exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Persistent {
    /// Σ numel × 4 over the parameters.
    pub(crate) parameters: u64,
    /// Σ over the optimizer's state tensors.
    pub(crate) optimizer_state: u64,
}

/// Requested bytes live over the traced step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Timeline {
    /// Live requested bytes before the first event, then after each client allocation or free.
    pub(crate) bytes: Vec<u64>,
    /// When each figure of `bytes` began, in microseconds since the Unix epoch, from the
    /// history's entries (the host's clock when the allocation or free was made; on a GPU the
    /// kernels run later): the first event's time for the starting figure, then each event's.
    pub(crate) time_us: Vec<i64>,
    /// Where each phase's first event stands in `bytes`, with the phase.
    pub(crate) phase_starts: Vec<(usize, Phase)>,
    /// The first index of the maximum of `bytes`.
    pub(crate) peak_index: usize,
}

/// The traced step's peak allocated bytes by what held them (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AtPeak {
    /// The phase the peak fell in.
    pub(crate) phase: Option<Phase>,
    pub(crate) parameters: u64,
    pub(crate) optimizer_state: u64,
    pub(crate) input_and_other: u64,
    pub(crate) activations: u64,
    pub(crate) gradients: u64,
    pub(crate) backward_temporaries: u64,
    pub(crate) step_temporaries: u64,
    pub(crate) allocator_rounding: u64,
}

impl AtPeak {
    /// Component names (as in the JSON) and bytes, bottom of the stack first.
    pub(crate) fn components(&self) -> [(&'static str, u64); 8] {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_state", self.optimizer_state),
            ("activations", self.activations),
            ("backward_temporaries", self.backward_temporaries),
            ("step_temporaries", self.step_temporaries),
            ("input_and_other", self.input_and_other),
            ("allocator_rounding", self.allocator_rounding),
        ]
    }

    /// The sum of the components: the traced step's peak allocated bytes.
    pub(crate) fn total(&self) -> u64 {
        self.components().iter().map(|(_, bytes)| bytes).sum()
    }
}

#[derive(Debug, Clone, Copy)]
struct Block {
    size: u64,
    phase: Option<Phase>,
}

/// Replays `entries` from `requested_before` live requested bytes. `grad_addresses` are the
/// gradients' buffer addresses when backward ended; `peak_allocated` is the step's peak
/// allocated bytes.
pub(crate) fn analyse(
    entries: &[TraceEntry],
    requested_before: u64,
    grad_addresses: &HashSet<u64>,
    persistent: Persistent,
    peak_allocated: u64,
) -> Result<(Timeline, AtPeak)> {
    let events: Vec<(&TraceEntry, Option<Phase>)> = entries
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                TraceAction::Alloc
                    | TraceAction::FreeRequested
                    | TraceAction::FreeCompleted
                    | TraceAction::Free
            )
        })
        .map(|e| (e, phase_of(e)))
        .collect();

    // First pass: the timeline and its peak.
    let mut live: HashMap<u64, Block> = HashMap::new();
    let mut awaiting = HashSet::new();
    let mut current = requested_before;
    let mut bytes = Vec::with_capacity(events.len() + 1);
    bytes.push(current);
    let mut time_us = Vec::with_capacity(events.len() + 1);
    time_us.push(events.first().map_or(0, |(entry, _)| entry.time_us));
    let mut phase_starts = Vec::new();
    for &(entry, phase) in &events {
        if let Some(phase) = phase {
            if phase_starts.last().map(|(_, p)| *p) != Some(phase) {
                phase_starts.push((bytes.len() - 1, phase));
            }
        }
        current = apply(&mut live, &mut awaiting, &mut 0, entry, phase, current)?;
        bytes.push(current);
        time_us.push(entry.time_us);
    }
    let peak_requested = bytes.iter().copied().max().unwrap_or(current);
    let peak_index = bytes.iter().position(|b| *b == peak_requested).unwrap_or(0);

    // Second pass: what is live at the peak, and which backward blocks outlive backward.
    live.clear();
    awaiting.clear();
    let mut baseline_freed = 0;
    let mut current = requested_before;
    for &(entry, phase) in &events[..peak_index] {
        current = apply(
            &mut live,
            &mut awaiting,
            &mut baseline_freed,
            entry,
            phase,
            current,
        )?;
    }
    let mut freed_in_backward = HashSet::new();
    for &(entry, phase) in &events[peak_index..] {
        if !matches!(phase, Some(Phase::Forward | Phase::Backward)) {
            break;
        }
        if entry.action != TraceAction::Alloc && live.contains_key(&entry.addr) {
            freed_in_backward.insert(entry.addr);
        }
    }
    let mut at_peak = AtPeak {
        phase: events
            .get(peak_index.saturating_sub(1))
            .and_then(|(_, phase)| *phase),
        parameters: persistent.parameters,
        optimizer_state: persistent.optimizer_state,
        input_and_other: 0,
        activations: 0,
        gradients: 0,
        backward_temporaries: 0,
        step_temporaries: 0,
        allocator_rounding: 0,
    };
    let Some(rest) = (requested_before - baseline_freed)
        .checked_sub(persistent.parameters + persistent.optimizer_state)
    else {
        bail!(
            "{requested_before} bytes live before the traced step ({baseline_freed} freed before \
             its peak) hold less than the parameters and optimizer state ({persistent:?})"
        );
    };
    at_peak.input_and_other = rest;
    for (address, block) in &live {
        let slot = match block.phase {
            None => &mut at_peak.input_and_other,
            Some(Phase::Forward) => &mut at_peak.activations,
            Some(Phase::Backward)
                if grad_addresses.contains(address) && !freed_in_backward.contains(address) =>
            {
                &mut at_peak.gradients
            }
            Some(Phase::Backward) => &mut at_peak.backward_temporaries,
            Some(Phase::Step | Phase::ZeroGrad) => &mut at_peak.step_temporaries,
        };
        *slot += block.size;
    }
    debug_assert_eq!(at_peak.total(), current);
    let Some(rounding) = peak_allocated.checked_sub(peak_requested) else {
        bail!("peak allocated {peak_allocated} below peak requested {peak_requested}");
    };
    at_peak.allocator_rounding = rounding;
    let timeline = Timeline {
        bytes,
        time_us,
        phase_starts,
        peak_index,
    };
    Ok((timeline, at_peak))
}

/// Applies one event to the live blocks and returns the new live requested bytes; frees of
/// blocks allocated before recording began are added to `baseline_freed`.
fn apply(
    live: &mut HashMap<u64, Block>,
    awaiting: &mut HashSet<u64>,
    baseline_freed: &mut u64,
    entry: &TraceEntry,
    phase: Option<Phase>,
    current: u64,
) -> Result<u64> {
    match entry.action {
        TraceAction::Alloc => {
            let size = entry.size;
            live.insert(entry.addr, Block { size, phase });
            return Ok(current + size);
        }
        // A free counts when it is requested, as the allocator's `allocated` does; a block
        // that waits for another stream's work (`record_stream`) completes later, and that
        // completion frees nothing more.
        TraceAction::FreeRequested => {
            awaiting.insert(entry.addr);
        }
        TraceAction::FreeCompleted if awaiting.remove(&entry.addr) => return Ok(current),
        _ => {}
    }
    let size = match live.remove(&entry.addr) {
        Some(block) => block.size,
        None => {
            *baseline_freed += entry.size;
            entry.size
        }
    };
    match current.checked_sub(size) {
        Some(next) => Ok(next),
        None => bail!(
            "the trace frees {size} bytes at {:#x} with {current} live",
            entry.addr
        ),
    }
}

/// The phase an entry was recorded under (its innermost context label).
fn phase_of(entry: &TraceEntry) -> Option<Phase> {
    let label = entry.frames.first()?.name.as_str();
    Phase::ALL.into_iter().find(|phase| phase.label() == label)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use headroom_caching_allocator::{Frame, TraceAction, TraceEntry};
    use TraceAction::{Alloc, FreeCompleted};

    use super::*;

    fn entry(action: TraceAction, addr: u64, size: u64, label: &str) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 0,
            time_us: 0,
            frames: Arc::from(vec![Frame {
                filename: "headroom:context".into(),
                line: 0,
                name: label.into(),
            }]),
        }
    }

    /// An allocator event as the tests write it: (action, address, bytes).
    type Event = (TraceAction, u64, u64);

    /// `events` labelled with `phase`.
    fn in_phase(phase: &str, events: &[Event]) -> Vec<TraceEntry> {
        let in_phase = |&(action, addr, size): &Event| entry(action, addr, size, phase);
        events.iter().map(in_phase).collect()
    }

    /// Both tests' start, then `then` (phase, its events): forward saves 50 and 30 bytes,
    /// backward makes a 7-byte temporary and a 100-byte gradient.
    fn saves_and_a_gradient_then(then: &[(&str, &[Event])]) -> Vec<TraceEntry> {
        let start = [
            ("forward", &[(Alloc, 0x1000, 50), (Alloc, 0x2000, 30)][..]),
            ("backward", &[(Alloc, 0x3000, 7), (Alloc, 0x4000, 100)]),
        ];
        start
            .iter()
            .chain(then)
            .flat_map(|&(phase, events)| in_phase(phase, events))
            .collect()
    }

    #[test]
    fn the_peak_is_split_by_phase_and_adds_up_to_the_allocated_peak() {
        // Baseline: 100 parameters + 200 state + 10 input. Forward saves 50 and 30; backward
        // makes a 7-byte temporary and a 100-byte gradient, frees the 30 and the temporary;
        // the step allocates a 40-byte temporary (the peak: 310 + 50 + 100 + 40 = 500).
        let entries = saves_and_a_gradient_then(&[
            (
                "backward",
                &[(FreeCompleted, 0x2000, 30), (FreeCompleted, 0x3000, 7)],
            ),
            ("backward", &[(FreeCompleted, 0x1000, 50)]),
            ("step", &[(Alloc, 0x5000, 40), (Alloc, 0x6000, 50)]),
            (
                "step",
                &[(FreeCompleted, 0x5000, 40), (FreeCompleted, 0x6000, 50)],
            ),
            ("zero_grad", &[(FreeCompleted, 0x4000, 100)]),
        ]);
        // Ten microseconds apart.
        let entries: Vec<TraceEntry> = entries
            .into_iter()
            .zip((1_000..).step_by(10))
            .map(|(entry, time_us)| TraceEntry { time_us, ..entry })
            .collect();
        let grads = HashSet::from([0x4000]);
        let persistent = Persistent {
            parameters: 100,
            optimizer_state: 200,
        };
        let (timeline, at_peak) = analyse(&entries, 310, &grads, persistent, 512 * 3).unwrap();
        assert_eq!(timeline.bytes[timeline.peak_index], 500);
        assert_eq!(timeline.peak_index, 9);
        // Each figure carries its event's time; the starting one the first event's.
        assert_eq!(timeline.time_us.len(), timeline.bytes.len());
        assert_eq!(timeline.time_us[..3], [1_000, 1_000, 1_010]);
        assert_eq!(timeline.time_us[12], 1_110);
        assert_eq!(
            timeline.phase_starts,
            [
                (0, Phase::Forward),
                (2, Phase::Backward),
                (7, Phase::Step),
                (11, Phase::ZeroGrad)
            ]
        );
        assert_eq!(at_peak.phase, Some(Phase::Step));
        assert_eq!(
            at_peak.components(),
            [
                ("parameters", 100),
                ("gradients", 100),
                ("optimizer_state", 200),
                ("activations", 0),
                ("backward_temporaries", 0),
                ("step_temporaries", 90),
                ("input_and_other", 10),
                ("allocator_rounding", 512 * 3 - 500),
            ]
        );
        assert_eq!(at_peak.total(), 512 * 3);
    }

    #[test]
    fn a_backward_peak_separates_gradients_from_temporaries_and_activations() {
        // The peak falls in backward (after the 0x4000 allocation): 10 + 50 + 30 + 7 + 100.
        // 0x3000 is freed later in backward and reused by a gradient: it is a temporary.
        let entries = saves_and_a_gradient_then(&[
            (
                "backward",
                &[(FreeCompleted, 0x3000, 7), (Alloc, 0x3000, 7)],
            ),
            (
                "backward",
                &[(FreeCompleted, 0x2000, 30), (FreeCompleted, 0x1000, 50)],
            ),
        ]);
        let grads = HashSet::from([0x3000, 0x4000]);
        let persistent = Persistent {
            parameters: 10,
            optimizer_state: 0,
        };
        let (timeline, at_peak) = analyse(&entries, 10, &grads, persistent, 200).unwrap();
        assert_eq!(timeline.peak_index, 4);
        assert_eq!(at_peak.phase, Some(Phase::Backward));
        assert_eq!(
            (
                at_peak.activations,
                at_peak.gradients,
                at_peak.backward_temporaries,
                at_peak.allocator_rounding
            ),
            (80, 100, 7, 3)
        );
        assert_eq!(at_peak.total(), 200);
    }

    #[test]
    fn a_baseline_smaller_than_parameters_and_state_is_an_error() {
        let persistent = Persistent {
            parameters: 100,
            optimizer_state: 200,
        };
        let err = analyse(&[], 250, &HashSet::new(), persistent, 250).unwrap_err();
        assert!(err.to_string().contains("hold less than"), "{err}");
    }
}
