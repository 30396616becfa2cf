//! What one measured step per candidate says, and the peak and time it predicts for any choice
//! of a candidate per block.
//!
//! A step is a chain of [`Segment`]s: the stretch before the first block, each block's forward
//! (until the next block starts), then each block's backward in reverse order (until the block
//! before it starts its backward). Each segment is measured under every candidate as bytes
//! allocated at its end minus at its start (`delta`), the most bytes allocated above its start
//! (`peak`) and its time. The prediction for a plan walks the chain with each block's segments
//! taken from its candidate's measurement: the allocated bytes at the start of a segment are the
//! step's start plus the deltas before it, and the plan's peak is the largest start-plus-peak.
//! This is exact when a block's segments do not depend on the other blocks' candidates — true
//! of strategies that decide only what their own block keeps — and every figure in it is the
//! allocator's (storage counted once, however many views share it).
//!
//! This module is arithmetic on measured figures; it runs nothing.

use crate::error::CheckpointError;
use crate::planner::measure::Candidate;

/// One stretch of a measured step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Segment {
    /// The most bytes allocated during the segment above what was allocated at its start.
    pub peak: u64,
    /// Bytes allocated at its end minus at its start.
    pub delta: i64,
    /// Its time, in milliseconds.
    pub ms: f64,
}

/// A block's two segments under one candidate.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BlockCost {
    /// From the block's forward to the next block's (for the last block: through the head, the
    /// loss and the head's backward, to the start of its own backward).
    pub forward: Segment,
    /// From the block's backward to the previous block's (for the first block: through the
    /// stem's backward and the optimizer step, to the end of the step).
    pub backward: Segment,
}

impl BlockCost {
    /// Its forward and backward time.
    pub fn ms(&self) -> f64 {
        self.forward.ms + self.backward.ms
    }

    /// What it leaves allocated over the whole step (its parameters' gradients, typically).
    pub fn net(&self) -> i64 {
        self.forward.delta + self.backward.delta
    }
}

/// A model's training step measured under each candidate: what a plan is made from.
#[derive(Debug, Clone)]
pub struct StepProfile {
    /// The candidates, in the order `blocks[i]` lists them.
    pub candidates: Vec<Candidate>,
    /// Bytes allocated when the step started: parameters, optimizer state, inputs, and whatever
    /// else lives from one step to the next.
    pub start_bytes: u64,
    /// The step before the first block (the model's stem).
    pub pre: Segment,
    /// Per block, in forward order, its cost under each candidate.
    pub blocks: Vec<Vec<BlockCost>>,
}

/// When, in a step, a predicted peak happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    /// Before the first block.
    Stem,
    /// During block `i`'s forward segment.
    Forward(usize),
    /// During block `i`'s backward segment.
    Backward(usize),
}

impl std::fmt::Display for Moment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Moment::Stem => f.write_str("before the first block"),
            Moment::Forward(i) => write!(f, "block {i}'s forward"),
            Moment::Backward(i) => write!(f, "block {i}'s backward"),
        }
    }
}

/// The peak and time a profile predicts for one choice of candidate per block.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The highest allocated bytes of the step.
    pub peak_bytes: u64,
    /// When it happens.
    pub at: Moment,
    /// The step's time, in milliseconds.
    pub step_ms: f64,
    /// Per block, the highest allocated bytes during its forward segment.
    pub forward_peaks: Vec<u64>,
    /// Per block, the highest allocated bytes during its backward segment.
    pub backward_peaks: Vec<u64>,
}

impl StepProfile {
    /// The number of blocks.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The index of the candidate named `name`.
    pub fn candidate_index(&self, name: &str) -> Option<usize> {
        self.candidates.iter().position(|c| c.name == name)
    }

    /// The peak and time of the step with block `i` under candidate `choices[i]`.
    pub fn predict(&self, choices: &[usize]) -> Result<Prediction, CheckpointError> {
        self.check_choices(choices)?;
        let n = self.n_blocks();
        let mut level = self.start_bytes as i64;
        let mut peak = (level + self.pre.peak as i64, Moment::Stem);
        level += self.pre.delta;
        let mut step_ms = self.pre.ms;
        let mut forward_peaks = vec![0; n];
        let mut backward_peaks = vec![0; n];
        let mut visit = |level: &mut i64, segment: &Segment, moment: Moment| {
            let top = *level + segment.peak as i64;
            if top > peak.0 {
                peak = (top, moment);
            }
            *level += segment.delta;
            step_ms += segment.ms;
            top.max(0) as u64
        };
        for (i, &c) in choices.iter().enumerate() {
            let segment = &self.blocks[i][c].forward;
            forward_peaks[i] = visit(&mut level, segment, Moment::Forward(i));
        }
        for (i, &c) in choices.iter().enumerate().rev() {
            let segment = &self.blocks[i][c].backward;
            backward_peaks[i] = visit(&mut level, segment, Moment::Backward(i));
        }
        Ok(Prediction {
            peak_bytes: peak.0.max(0) as u64,
            at: peak.1,
            step_ms,
            forward_peaks,
            backward_peaks,
        })
    }

    /// `Ok` when `choices` names one known candidate per block.
    pub(crate) fn check_choices(&self, choices: &[usize]) -> Result<(), CheckpointError> {
        if choices.len() != self.n_blocks() {
            return Err(CheckpointError::InvalidArgument {
                op: "StepProfile::predict",
                reason: format!(
                    "{} choices for a model of {} blocks; give one candidate index per block",
                    choices.len(),
                    self.n_blocks()
                ),
            });
        }
        if let Some(bad) = choices.iter().find(|&&c| c >= self.candidates.len()) {
            return Err(CheckpointError::InvalidArgument {
                op: "StepProfile::predict",
                reason: format!(
                    "candidate {bad} of {}; candidates are numbered from 0",
                    self.candidates.len()
                ),
            });
        }
        if let Some(i) = self
            .blocks
            .iter()
            .position(|costs| costs.len() != self.candidates.len())
        {
            return Err(CheckpointError::InvalidArgument {
                op: "StepProfile::predict",
                reason: format!(
                    "block {i} has {} costs for {} candidates; give one per candidate",
                    self.blocks[i].len(),
                    self.candidates.len()
                ),
            });
        }
        Ok(())
    }
}
