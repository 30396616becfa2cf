//! Choosing a candidate per block: the fastest step whose predicted peak fits a budget, exact
//! candidates preferred over lossy ones.
//!
//! Lossy candidates ([`Candidate::lossy`](crate::Candidate::lossy), compression) change what
//! training computes, so a plan takes one only when it must or when it pays: when no plan of the
//! exact candidates fits the budget, or when the fastest plan of all is faster than the fastest
//! exact one by more than [`LOSSY_MIN_GAIN`] of its step time (less is within a step's timing
//! noise: at small batches a compressor that finds nothing large enough to encode measures as
//! fast as keeping, and must not be chosen for that). The plan records which
//! ([`LossyReason`]).
//!
//! The peak constraints of a plan are, per block `i` under candidate `c` (with `F(i)` the
//! forward deltas of the blocks before `i`, and `entry` the bytes allocated when block 0 starts):
//! - in its forward: `entry + F(i) + forward_peak(i, c) ≤ budget`;
//! - in its backward: `entry + F(i + 1) + Σ_{j > i} net(j) + backward_peak(i, c) ≤ budget`,
//!   where `net(j)` is what block `j` leaves allocated over the whole step (its gradients): the
//!   level at the start of block `i`'s backward is everything the forward left, minus what the
//!   later blocks' backwards released.
//!
//! With `net(j)` taken as its largest value over the candidates (it is the same for strategies
//! that only move or drop what a block saved), both constraints read only the prefix `F`. So a
//! dynamic programme over the blocks in forward order, whose states are prefixes `F` with the
//! least time that reaches them, is exact: of two states, one with no more bytes and no more time
//! dominates the other for every continuation, and only the Pareto front is kept. Prefixes are
//! rounded up to a grid: the common divisor of the blocks' forward deltas (exact: allocators count
//! whole blocks), coarsened when their span would take more than 2^20 steps; that bounds the
//! front and keeps every rounding on the safe side.
//!
//! Monotone in the budget, by construction (within one set of candidates; the exact-first
//! preference may trade up to [`LOSSY_MIN_GAIN`] of step time for exactness at a larger budget): a larger budget removes no transition, so every
//! state reachable under a smaller budget is reachable or dominated under a larger one, and the
//! least time never grows. The lowest achievable peak is the least budget that has a plan,
//! found by bisection over this monotone feasibility.
//!
//! This module is arithmetic on a [`StepProfile`]; it runs nothing.

use crate::error::CheckpointError;
use crate::planner::plan::{BlockPlan, LossyReason};
use crate::planner::profile::StepProfile;

/// Prefixes take at most this many grid steps over their span.
const GRID_STEPS: i64 = 1 << 20;

/// The share of the fastest exact plan's step time a lossy plan must save to be chosen over it
/// (5%).
pub const LOSSY_MIN_GAIN: f64 = 0.05;

impl StepProfile {
    /// The fastest plan (least predicted step time) whose predicted peak is at most
    /// `budget_bytes`, of the exact candidates where one fits and a lossy plan is not faster by
    /// more than [`LOSSY_MIN_GAIN`]; with a table that explains it (its `Display`) and, when it
    /// takes a lossy candidate, why ([`BlockPlan::lossy_reason`]).
    ///
    /// Errors: [`CheckpointError::BudgetTooSmall`], naming the lowest peak a plan reaches, when
    /// the budget is below it.
    pub fn plan(&self, budget_bytes: u64) -> Result<BlockPlan, CheckpointError> {
        let every = Search::new(self, |_| true)?;
        let budget = clamp(budget_bytes);
        let Some(fastest) = every.solve(budget) else {
            return Err(CheckpointError::BudgetTooSmall {
                budget: budget_bytes,
                minimum: every.min_budget(),
            });
        };
        let takes_lossy = fastest.iter().any(|&c| self.candidates[c].lossy);
        if !takes_lossy {
            return BlockPlan::new(self.clone(), budget_bytes, fastest, None);
        }
        let Some(exact) = self.exact_search()? else {
            let reason = LossyReason::NoExactPlanFits {
                exact_minimum: None,
            };
            return BlockPlan::new(self.clone(), budget_bytes, fastest, Some(reason));
        };
        let reason = match exact.solve(budget) {
            None => LossyReason::NoExactPlanFits {
                exact_minimum: Some(exact.min_budget()),
            },
            Some(choices) => {
                let exact_step_ms = self.predict(&choices)?.step_ms;
                let lossy_step_ms = self.predict(&fastest)?.step_ms;
                if lossy_step_ms >= exact_step_ms * (1.0 - LOSSY_MIN_GAIN) {
                    return BlockPlan::new(self.clone(), budget_bytes, choices, None);
                }
                LossyReason::Faster { exact_step_ms }
            }
        };
        BlockPlan::new(self.clone(), budget_bytes, fastest, Some(reason))
    }

    /// The lowest budget [`StepProfile::plan`] meets: the least peak any plan reaches.
    pub fn min_budget(&self) -> Result<u64, CheckpointError> {
        Ok(Search::new(self, |_| true)?.min_budget())
    }

    /// The search over the exact candidates alone; `None` when every candidate is lossy.
    fn exact_search(&self) -> Result<Option<Search<'_>>, CheckpointError> {
        if self.candidates.iter().all(|candidate| candidate.lossy) {
            return Ok(None);
        }
        let exact: Vec<bool> = self.candidates.iter().map(|c| !c.lossy).collect();
        Search::new(self, |c| exact[c]).map(Some)
    }
}

fn clamp(bytes: u64) -> i64 {
    bytes.min(i64::MAX as u64 / 4) as i64
}

/// One state of the programme: a prefix of forward deltas reached in the least time.
#[derive(Debug, Clone, Copy)]
struct State {
    /// The prefix `F`, rounded up to the grid.
    kept: i64,
    ms: f64,
    /// The highest constraint's left side on the way.
    peak: i64,
    /// The state of the previous layer it came from, and the candidate taken.
    parent: usize,
    choice: usize,
}

/// The constraints of a profile, ready for the programme.
struct Search<'a> {
    profile: &'a StepProfile,
    /// Bytes allocated when the first block starts.
    entry: i64,
    /// The highest allocated bytes before the first block.
    floor: i64,
    /// Per candidate, whether the search may take it.
    allowed: Vec<bool>,
    /// `later_net[i]`: the largest `net` over the allowed candidates, summed over blocks `i..`.
    later_net: Vec<i64>,
    grid: i64,
}

impl<'a> Search<'a> {
    /// The search over the candidates `allowed` accepts (by index; at least one).
    fn new(
        profile: &'a StepProfile,
        allowed: impl Fn(usize) -> bool,
    ) -> Result<Search<'a>, CheckpointError> {
        if profile.n_blocks() == 0 {
            return Err(CheckpointError::InvalidArgument {
                op: "StepProfile::plan",
                reason: "the profile has no blocks; profile a model whose blocks run through \
                         the planner's runner"
                    .into(),
            });
        }
        profile.check_choices(&vec![0; profile.n_blocks()])?;
        let allowed: Vec<bool> = (0..profile.candidates.len()).map(allowed).collect();
        let start = profile.start_bytes as i64;
        let mut later_net = vec![0; profile.n_blocks() + 1];
        for (i, costs) in profile.blocks.iter().enumerate().rev() {
            let most = costs
                .iter()
                .zip(&allowed)
                .filter(|(_, &allowed)| allowed)
                .map(|(c, _)| c.net())
                .max()
                .unwrap_or(0);
            later_net[i] = later_net[i + 1] + most;
        }
        let span: i64 = profile
            .blocks
            .iter()
            .map(|costs| {
                let deltas = costs.iter().map(|c| c.forward.delta);
                deltas.clone().max().unwrap_or(0) - deltas.min().unwrap_or(0)
            })
            .sum();
        // Allocators count bytes in whole blocks (512 bytes and up): a grid of their common
        // divisor rounds nothing.
        let unit = profile
            .blocks
            .iter()
            .flatten()
            .fold(0, |acc, cost| gcd(acc, cost.forward.delta.unsigned_abs()))
            .max(1) as i64;
        Ok(Search {
            profile,
            entry: start + profile.pre.delta,
            floor: start + profile.pre.peak as i64,
            allowed,
            later_net,
            grid: unit * (span / unit / GRID_STEPS + 1),
        })
    }

    /// `bytes` rounded up to the grid.
    fn round_up(&self, bytes: i64) -> i64 {
        let steps = bytes.div_euclid(self.grid) + i64::from(bytes.rem_euclid(self.grid) != 0);
        steps * self.grid
    }

    /// The fastest choice of a candidate per block within `budget`, if there is one.
    fn solve(&self, budget: i64) -> Option<Vec<usize>> {
        self.solve_states(budget).map(|(choices, _)| choices)
    }

    /// The fastest plan within `budget` and the highest constraint's left side on its way.
    fn solve_states(&self, budget: i64) -> Option<(Vec<usize>, i64)> {
        if self.floor > budget {
            return None;
        }
        let mut layers: Vec<Vec<State>> = vec![vec![State {
            kept: 0,
            ms: 0.0,
            peak: self.floor,
            parent: 0,
            choice: 0,
        }]];
        for (i, costs) in self.profile.blocks.iter().enumerate() {
            let mut next = Vec::new();
            for (parent, state) in layers[i].iter().enumerate() {
                for (choice, cost) in costs.iter().enumerate() {
                    if !self.allowed[choice] {
                        continue;
                    }
                    let forward_top = self.entry + state.kept + cost.forward.peak as i64;
                    let kept = self.round_up(state.kept + cost.forward.delta);
                    let backward_top =
                        self.entry + kept + self.later_net[i + 1] + cost.backward.peak as i64;
                    if forward_top > budget || backward_top > budget {
                        continue;
                    }
                    next.push(State {
                        kept,
                        ms: state.ms + cost.ms(),
                        peak: state.peak.max(forward_top).max(backward_top),
                        parent,
                        choice,
                    });
                }
            }
            let front = pareto_front(next);
            if front.is_empty() {
                return None;
            }
            layers.push(front);
        }
        // The front's last state is its fastest (bytes ascending, time strictly descending).
        let last = layers.last()?.len() - 1;
        let peak = layers.last()?[last].peak;
        let mut choices = vec![0; self.profile.n_blocks()];
        let mut at = last;
        for i in (0..self.profile.n_blocks()).rev() {
            let state = layers[i + 1][at];
            choices[i] = state.choice;
            at = state.parent;
        }
        Some((choices, peak))
    }

    /// The least budget that has a plan.
    fn min_budget(&self) -> u64 {
        let (_, mut high) = self
            .solve_states(i64::MAX / 4)
            .expect("without a budget every choice is allowed");
        let mut low = self.floor.max(0);
        // Invariant: `high` has a plan; every budget below `low` has none.
        while low < high {
            let mid = low + (high - low) / 2;
            if self.solve(mid).is_some() {
                high = mid;
            } else {
                low = mid + 1;
            }
        }
        high.max(0) as u64
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The states no other state dominates (as many bytes or fewer and as much time or less),
/// bytes ascending and time strictly descending.
fn pareto_front(mut states: Vec<State>) -> Vec<State> {
    states.sort_by(|a, b| a.kept.cmp(&b.kept).then_with(|| a.ms.total_cmp(&b.ms)));
    let mut front: Vec<State> = Vec::with_capacity(states.len());
    for state in states {
        if front.last().is_none_or(|best| state.ms < best.ms) {
            front.push(state);
        }
    }
    front
}
