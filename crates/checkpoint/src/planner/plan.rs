//! A plan: one candidate per block, applied as an nn block runner, and the table that explains it.
//!
//! A [`BlockPlan`] runs block `i` through the runner of its chosen candidate. Its `Display` is the
//! table: per block, the strategy, the bytes its forward leaves allocated until its backward,
//! its forward-plus-backward time and what that costs over the block's fastest candidate, and
//! the predicted highest allocated bytes during its forward and during its backward; then the
//! predicted peak (and when it happens), the budget and the predicted step time.
//!
//! This module sits on the profile's prediction and nn's block seam; it measures nothing.

use std::fmt;

use headroom_autograd_core::Tensor;
use headroom_nn::{BlockForward, BlockRunner};

use crate::error::CheckpointError;
use crate::planner::profile::{Prediction, StepProfile};

/// One candidate per block, chosen for a budget; an nn [`BlockRunner`] that applies it.
#[derive(Debug, Clone)]
pub struct BlockPlan {
    profile: StepProfile,
    budget: u64,
    choices: Vec<usize>,
    prediction: Prediction,
    lossy_reason: Option<LossyReason>,
}

/// Why a plan takes a lossy candidate ([`Candidate::lossy`](crate::Candidate::lossy)) for some
/// blocks rather than an exact one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossyReason {
    /// No plan of the exact candidates fits the budget.
    NoExactPlanFits {
        /// The lowest peak the exact candidates reach (`None`: there are none).
        exact_minimum: Option<u64>,
    },
    /// The fastest exact plan within the budget is slower by more than
    /// [`LOSSY_MIN_GAIN`](crate::LOSSY_MIN_GAIN) of its step time.
    Faster {
        /// That exact plan's predicted step time, in milliseconds.
        exact_step_ms: f64,
    },
}

impl BlockPlan {
    /// The plan with block `i` under candidate `choices[i]` of `profile`, made for `budget`.
    pub(crate) fn new(
        profile: StepProfile,
        budget: u64,
        choices: Vec<usize>,
        lossy_reason: Option<LossyReason>,
    ) -> Result<BlockPlan, CheckpointError> {
        let prediction = profile.predict(&choices)?;
        Ok(BlockPlan {
            profile,
            budget,
            choices,
            prediction,
            lossy_reason,
        })
    }

    /// Why the plan takes a lossy candidate; `None` when every block's candidate is exact.
    pub fn lossy_reason(&self) -> Option<LossyReason> {
        self.lossy_reason
    }

    /// The reason of [`BlockPlan::lossy_reason`] in a sentence, for reports: which lossy
    /// candidates the plan takes, on how many blocks, and why.
    pub fn lossy_explanation(&self) -> Option<String> {
        let reason = self.lossy_reason?;
        let mut lossy: Vec<(&str, usize)> = Vec::new();
        for &c in &self.choices {
            let candidate = &self.profile.candidates[c];
            if !candidate.lossy {
                continue;
            }
            match lossy.iter_mut().find(|(name, _)| *name == candidate.name) {
                Some((_, n)) => *n += 1,
                None => lossy.push((candidate.name.as_str(), 1)),
            }
        }
        let taken: Vec<String> = lossy
            .iter()
            .map(|(name, n)| format!("{name} on {n} block{}", if *n == 1 { "" } else { "s" }))
            .collect();
        let why = match reason {
            LossyReason::NoExactPlanFits {
                exact_minimum: Some(minimum),
            } => format!(
                "no plan of exact strategies fits the budget (their lowest peak is {}, {minimum} B)",
                size(minimum as i64)
            ),
            LossyReason::NoExactPlanFits {
                exact_minimum: None,
            } => "no exact strategy is a candidate".to_owned(),
            LossyReason::Faster { exact_step_ms } => format!(
                "{:.1} ms predicted against {exact_step_ms:.1} ms for the fastest exact plan \
                 within the budget ({:.0}% faster)",
                self.prediction.step_ms,
                (1.0 - self.prediction.step_ms / exact_step_ms) * 100.0
            ),
        };
        Some(format!("lossy: {}, because {why}", taken.join(", ")))
    }

    /// The budget the plan was made for, in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Per block, the index of its candidate in the profile's list.
    pub fn choices(&self) -> &[usize] {
        &self.choices
    }

    /// The name of block `index`'s strategy.
    pub fn strategy(&self, index: usize) -> Option<&str> {
        let choice = *self.choices.get(index)?;
        Some(self.profile.candidates[choice].name.as_str())
    }

    /// The predicted peak of allocated bytes of a training step under the plan.
    pub fn predicted_peak(&self) -> u64 {
        self.prediction.peak_bytes
    }

    /// The predicted step time, in milliseconds.
    pub fn predicted_step_ms(&self) -> f64 {
        self.prediction.step_ms
    }

    /// The whole prediction: peak, when, time, and each block's highest bytes.
    pub fn prediction(&self) -> &Prediction {
        &self.prediction
    }

    /// The profile the plan was made from.
    pub fn profile(&self) -> &StepProfile {
        &self.profile
    }
}

impl BlockRunner for BlockPlan {
    fn run(
        &self,
        index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        let Some(&choice) = self.choices.get(index) else {
            let err = CheckpointError::InvalidArgument {
                op: "BlockPlan",
                reason: format!(
                    "block {index} of a model the plan knows with {} blocks; profile and plan \
                     the model it runs",
                    self.choices.len()
                ),
            };
            return Err(err.into_nn_error());
        };
        self.profile.candidates[choice]
            .runner
            .run(index, block, input)
    }
}

/// Bytes as decimal GB from 1 GB on, else MB, for the table.
fn size(bytes: i64) -> String {
    let value = bytes as f64;
    if value.abs() >= 1e9 {
        format!("{:.2} GB", value / 1e9)
    } else {
        format!("{:.1} MB", value / 1e6)
    }
}

impl fmt::Display for BlockPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self
            .choices
            .iter()
            .map(|&c| self.profile.candidates[c].name.as_str())
            .collect();
        let width = names.iter().map(|n| n.len()).max().unwrap_or(0).max(8);
        writeln!(
            f,
            "{:>5}  {:<width$}  {:>11}  {:>9}  {:>9}  {:>12}  {:>12}",
            "block", "strategy", "kept", "fwd+bwd", "cost", "peak in fwd", "peak in bwd"
        )?;
        for (i, &choice) in self.choices.iter().enumerate() {
            let costs = &self.profile.blocks[i];
            let cost = &costs[choice];
            let fastest = costs.iter().map(|c| c.ms()).fold(f64::INFINITY, f64::min);
            writeln!(
                f,
                "{:>5}  {:<width$}  {:>11}  {:>6.1} ms  {:>+6.1} ms  {:>12}  {:>12}",
                i,
                names[i],
                size(cost.forward.delta),
                cost.ms(),
                cost.ms() - fastest,
                size(self.prediction.forward_peaks[i] as i64),
                size(self.prediction.backward_peaks[i] as i64),
            )?;
        }
        let mut counts: Vec<(usize, &str)> = self
            .profile
            .candidates
            .iter()
            .enumerate()
            .map(|(c, candidate)| {
                (
                    self.choices.iter().filter(|&&x| x == c).count(),
                    candidate.name.as_str(),
                )
            })
            .filter(|(n, _)| *n > 0)
            .collect();
        counts.sort_by_key(|count| std::cmp::Reverse(count.0));
        let counts: Vec<String> = counts
            .iter()
            .map(|(n, name)| format!("{n} {name}"))
            .collect();
        write!(
            f,
            "{}; predicted peak {} ({} B) in {}, budget {} ({} B); predicted step {:.1} ms",
            counts.join(", "),
            size(self.prediction.peak_bytes as i64),
            self.prediction.peak_bytes,
            self.prediction.at,
            size(self.budget as i64),
            self.budget,
            self.prediction.step_ms,
        )?;
        match self.lossy_explanation() {
            Some(explanation) => write!(f, "\n{explanation}"),
            None => Ok(()),
        }
    }
}
