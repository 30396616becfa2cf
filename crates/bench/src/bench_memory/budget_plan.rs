//! The `adam_auto` case: checkpointing planned for a memory budget, and the uniform
//! checkpointing it must beat.
//!
//! Before the protocol's steps, checkpoint's `BlockPlanner` measures the training step under
//! each candidate on the fresh model and optimizer (one warm-up step each, then one measured step
//! each): keep, recompute, 8-bit compression and fp8 linears (`Candidate::float8`, tensorwise),
//! and on a GPU offload to pinned host memory too (`Candidate::cuda_defaults`). It plans for `--budget` bytes: without one, halfway between the
//! lowest peak the planner can reach and the peak of no checkpointing (both predicted from the
//! same measurement). The plan is set as the encoder's block runner and the protocol measures it
//! as any case. From the same profile, the report also gives the plan of the exact candidates
//! but offload alone (keep, keep-intermediates, recompute, recompute-attention), predicted only.
//!
//! Then, on the same model and optimizer, uniform checkpointing (every k-th block,
//! `CheckpointBlocks::Every(k)`) at the fastest k whose predicted peak fits the budget runs one
//! step whose peak is checked against the budget (if it exceeds it, the next k is tried), and
//! then the plan and the uniform runner alternate, one step each, `--steps` times: the ratio of
//! their median step times is what the report gives, so a drift of the GPU's speed during the
//! case falls on both alike. When the plan is the uniform choice itself, the report says so.
//!
//! It sits on checkpoint's planner, nn's ViT and the probe of `cases`; the step itself is the
//! caller's.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_autograd_core::Float8Recipe;
use headroom_checkpoint::{
    BlockPlanner, BlockSelection, Candidate, CheckpointBlocks, CheckpointOptions, Compression,
    StepProbe, StepProfile,
};
use headroom_nn::BlockRunner;
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use serde_json::{json, Value};

use super::measure::CaseResult;
use super::models::Net;
use super::report::size;
use super::training::Probe;

/// What the planner decided and predicted for one `adam_auto` run.
#[derive(Debug, Clone)]
pub(crate) struct PlanOutcome {
    /// The budget planned for, in bytes.
    pub(crate) budget: u64,
    /// Whether `--budget` gave it (else the default).
    pub(crate) budget_given: bool,
    /// The lowest peak a plan reaches (predicted).
    pub(crate) min_budget: u64,
    /// The predicted peak without checkpointing.
    pub(crate) keep_all_peak: u64,
    pub(crate) predicted_peak: u64,
    pub(crate) predicted_step_ms: f64,
    /// Per block, its strategy.
    pub(crate) strategies: Vec<String>,
    /// The plan's table.
    pub(crate) table: String,
    /// Which lossy strategies the plan takes and why; `None` when every block's is exact.
    pub(crate) lossy: Option<String>,
    /// The fastest plan of the exact candidates alone within the budget, from the same profile
    /// (predicted only): its step time and its recomputed blocks.
    pub(crate) exact_only: Option<(f64, usize)>,
    /// Uniform checkpointing within the same budget, measured.
    pub(crate) uniform: Option<Uniform>,
}

/// Uniform checkpointing (every k-th block) measured at the plan's budget, alternating with the
/// plan.
#[derive(Debug, Clone)]
pub(crate) struct Uniform {
    pub(crate) every: usize,
    pub(crate) n_recomputed: usize,
    pub(crate) predicted_peak: u64,
    pub(crate) predicted_step_ms: f64,
    /// Peak allocated over its steps.
    pub(crate) peak: u64,
    /// Median of its alternated steps.
    pub(crate) step_ms: f64,
    /// Its fastest step.
    pub(crate) step_ms_min: f64,
    /// Median of the plan's steps, alternated with the uniform ones.
    pub(crate) plan_step_ms: f64,
    /// The plan's fastest alternated step.
    pub(crate) plan_step_ms_min: f64,
    /// Steps each ran, alternating.
    pub(crate) pairs: usize,
    /// The plan chose exactly the uniform configuration.
    pub(crate) same_choices: bool,
    /// Every k tried before, with its measured peak over the budget.
    pub(crate) over_budget: Vec<(usize, u64)>,
}

/// The planner's probe of the device `probe` runs on.
fn step_probe(probe: &Probe<'_>) -> Result<StepProbe> {
    let any = probe.backend.clone().into_any();
    if let Ok(cuda) = any.clone().downcast::<CudaBackend>() {
        return Ok(StepProbe::cuda(&cuda));
    }
    match any.downcast::<CpuBackend>() {
        Ok(cpu) => Ok(StepProbe::host(cpu)),
        Err(_) => bail!("adam_auto: the planner knows the CPU and CUDA backends only"),
    }
}

/// Profiles `vit`'s step, plans for `budget` (or the default) and sets the plan as its block
/// runner; returns the outcome (without the uniform comparison) and the profile.
pub(crate) fn plan(
    probe: &Probe<'_>,
    vit: &mut Net,
    budget: Option<u64>,
    step: &mut dyn FnMut(&Net) -> Result<()>,
) -> Result<(PlanOutcome, StepProfile)> {
    let cuda = probe.device.starts_with("cuda");
    let candidates = if cuda {
        Candidate::cuda_defaults()
    } else {
        let mut candidates = Candidate::defaults();
        candidates.push(Candidate::compress(Compression::default()));
        candidates.push(Candidate::float8(Float8Recipe::TENSORWISE));
        candidates
    };
    let planner = BlockPlanner::new(step_probe(probe)?, candidates);
    vit.set_block_runner(Some(planner.runner()));
    let profile = {
        let vit: &Net = vit;
        planner.profile(|| step(vit).map_err(Into::into))?
    };
    let keep = profile
        .candidate_index("keep")
        .context("a keep candidate")?;
    let keep_all_peak = profile.predict(&vec![keep; profile.n_blocks()])?.peak_bytes;
    let min_budget = profile.min_budget()?;
    let budget_given = budget.is_some();
    let budget = budget.unwrap_or(min_budget + keep_all_peak.saturating_sub(min_budget) / 2);
    let plan = profile.plan(budget)?;
    let exact_only = exact_only(&profile, budget)?;
    let outcome = PlanOutcome {
        budget,
        budget_given,
        min_budget,
        keep_all_peak,
        predicted_peak: plan.predicted_peak(),
        predicted_step_ms: plan.predicted_step_ms(),
        strategies: (0..profile.n_blocks())
            .map(|i| plan.strategy(i).unwrap_or("?").to_owned())
            .collect(),
        table: plan.to_string(),
        lossy: plan.lossy_explanation(),
        exact_only,
        uniform: None,
    };
    vit.set_block_runner(Some(Arc::new(plan)));
    Ok((outcome, profile))
}

/// The fastest plan of the exact candidates but offload alone within `budget`, from `profile`'s
/// columns of those: its predicted step time and recomputed blocks; `None` when none fits.
fn exact_only(profile: &StepProfile, budget: u64) -> Result<Option<(f64, usize)>> {
    let columns: Vec<usize> = (0..profile.candidates.len())
        .filter(|&c| !profile.candidates[c].lossy && profile.candidates[c].name != "offload")
        .collect();
    let subset = StepProfile {
        candidates: columns
            .iter()
            .map(|&c| profile.candidates[c].clone())
            .collect(),
        blocks: profile
            .blocks
            .iter()
            .map(|costs| columns.iter().map(|&c| costs[c]).collect())
            .collect(),
        ..profile.clone()
    };
    Ok(subset.plan(budget).ok().map(|plan| {
        let recomputed = (0..subset.n_blocks())
            .filter(|&i| plan.strategy(i) == Some("recompute"))
            .count();
        (plan.predicted_step_ms(), recomputed)
    }))
}

/// Measures uniform checkpointing at the fastest k that fits `budget`, alternating with the
/// plan that is `vit`'s block runner (see the module's documentation); `None` when no k fits.
pub(crate) fn compare_uniform(
    probe: &Probe<'_>,
    vit: &mut Net,
    profile: &StepProfile,
    plan_strategies: &[String],
    budget: u64,
    steps: usize,
    step: &mut dyn FnMut(&Net) -> Result<()>,
) -> Result<Option<Uniform>> {
    let (keep, recompute) = (
        profile
            .candidate_index("keep")
            .context("a keep candidate")?,
        profile
            .candidate_index("recompute")
            .context("a recompute candidate")?,
    );
    let plan_runner = vit
        .block_runner()
        .context("the plan as the model's block runner")?;
    let n = profile.n_blocks();
    let mut options = Vec::new();
    for every in 1..=n {
        let choices: Vec<usize> = (0..n)
            .map(|i| if i % every == 0 { recompute } else { keep })
            .collect();
        let prediction = profile.predict(&choices)?;
        if prediction.peak_bytes <= budget {
            options.push((every, choices, prediction));
        }
    }
    options.sort_by(|a, b| a.2.step_ms.total_cmp(&b.2.step_ms));
    let mut over_budget = Vec::new();
    for (every, choices, prediction) in options {
        let uniform: Arc<dyn BlockRunner> = Arc::new(CheckpointBlocks {
            selection: BlockSelection::Every(every),
            options: CheckpointOptions::default(),
        });
        vit.set_block_runner(Some(Arc::clone(&uniform)));
        // One step whose peak is the uniform runner's (the step after a change of runner is
        // the steady one: what a step allocates is freed by its end).
        probe.backend.synchronize()?;
        probe.allocator().reset_peak_stats();
        step(vit)?;
        probe.backend.synchronize()?;
        let mut peak = probe.allocator().max_memory_allocated();
        if peak > budget {
            over_budget.push((every, peak));
            continue;
        }
        let (mut plan_ms, mut uniform_ms) = (Vec::new(), Vec::new());
        for _ in 0..steps.max(1) {
            for (runner, times) in [(&plan_runner, &mut plan_ms), (&uniform, &mut uniform_ms)] {
                vit.set_block_runner(Some(Arc::clone(runner)));
                probe.backend.synchronize()?;
                probe.allocator().reset_peak_stats();
                let start = Instant::now();
                step(vit)?;
                probe.backend.synchronize()?;
                times.push(start.elapsed().as_secs_f64() * 1e3);
                if Arc::ptr_eq(runner, &uniform) {
                    peak = peak.max(probe.allocator().max_memory_allocated());
                }
            }
        }
        vit.set_block_runner(Some(Arc::clone(&plan_runner)));
        plan_ms.sort_by(f64::total_cmp);
        uniform_ms.sort_by(f64::total_cmp);
        return Ok(Some(Uniform {
            every,
            n_recomputed: choices.iter().filter(|&&c| c == recompute).count(),
            predicted_peak: prediction.peak_bytes,
            predicted_step_ms: prediction.step_ms,
            peak,
            step_ms: median(&uniform_ms),
            step_ms_min: uniform_ms[0],
            plan_step_ms: median(&plan_ms),
            plan_step_ms_min: plan_ms[0],
            pairs: plan_ms.len(),
            same_choices: choices
                .iter()
                .map(|&c| profile.candidates[c].name.as_str())
                .eq(plan_strategies.iter().map(String::as_str)),
            over_budget,
        }));
    }
    vit.set_block_runner(Some(plan_runner));
    Ok(None)
}

/// The median of sorted `values` (the mean of the middle two for an even count).
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// The report's lines on a planned case: the plan's figures, the uniform comparison, the table.
pub(crate) fn describe(r: &CaseResult) -> Option<String> {
    let plan = r.plan.as_ref()?;
    let mut counts: Vec<(usize, &str)> = Vec::new();
    for name in &plan.strategies {
        match counts.iter_mut().find(|(_, n)| *n == name.as_str()) {
            Some((count, _)) => *count += 1,
            None => counts.push((1, name)),
        }
    }
    let counts: Vec<String> = counts
        .iter()
        .map(|(n, name)| format!("{n} {name}"))
        .collect();
    let mut text = format!(
        "{} {} batch {}: budget {} ({} B{}); lowest reachable {}, no checkpointing {} \
         (predicted)\n  plan: {} of {} blocks; peak {} measured / {} predicted \
         ({:.4}); step {:.1} ms measured / {:.1} ms predicted\n",
        r.case.name(),
        r.model,
        r.batch,
        size(plan.budget),
        plan.budget,
        if plan.budget_given {
            ""
        } else {
            ", the default"
        },
        size(plan.min_budget),
        size(plan.keep_all_peak),
        counts.join(", "),
        plan.strategies.len(),
        size(r.peak_allocated_bytes),
        size(plan.predicted_peak),
        r.peak_allocated_bytes as f64 / plan.predicted_peak as f64,
        r.step_ms,
        plan.predicted_step_ms,
    );
    let offloads = plan.strategies.iter().any(|name| name == "offload");
    text += &prediction_flags(
        "plan",
        (r.peak_allocated_bytes, plan.predicted_peak),
        (r.step_ms, plan.predicted_step_ms),
        offloads,
    );
    match plan.exact_only {
        Some((ms, recomputed)) => {
            text += &format!(
                "  exact candidates alone (no offload): {recomputed} recomputed, {ms:.1} ms predicted \
                 (plan / that {:.3}, predicted)\n",
                plan.predicted_step_ms / ms
            );
        }
        None => text += "  exact candidates alone (no offload): no plan within the budget\n",
    }
    match &plan.uniform {
        Some(u) => {
            for (every, peak) in &u.over_budget {
                text += &format!(
                    "  uniform every {every}: measured peak {} over the budget\n",
                    size(*peak)
                );
            }
            text += &format!(
                "  uniform every {} ({} recomputed): peak {} measured / {} predicted; {:.1} ms \
                 predicted\n  alternating {} steps each: plan {:.1} ms, uniform {:.1} ms \
                 (medians; fastest {:.1} / {:.1}); plan / uniform step time {:.4}{}\n",
                u.every,
                u.n_recomputed,
                size(u.peak),
                size(u.predicted_peak),
                u.predicted_step_ms,
                u.pairs,
                u.plan_step_ms,
                u.step_ms,
                u.plan_step_ms_min,
                u.step_ms_min,
                u.plan_step_ms / u.step_ms,
                if u.same_choices {
                    " (the plan is this uniform choice)"
                } else {
                    ""
                },
            );
        }
        None => text += "  uniform checkpointing: no every-k fits the budget\n",
    }
    if let Some(u) = &plan.uniform {
        text += &prediction_flags(
            "uniform",
            (u.peak, u.predicted_peak),
            (u.step_ms, u.predicted_step_ms),
            false,
        );
    }
    text += &plan.table;
    Some(text)
}

/// How far a measurement may be from its prediction before the report flags it.
const PREDICTION_TOLERANCE: f64 = 0.10;

/// A line per figure of `what` (peak bytes, step time; each as measured and predicted) more than
/// 10% off its prediction, with its likely cause; empty when both are within 10%. `offloads`:
/// whether the runner offloads (its peak depends on when the copies finish).
pub(crate) fn prediction_flags(
    what: &str,
    (peak, predicted_peak): (u64, u64),
    (step_ms, predicted_step_ms): (f64, f64),
    offloads: bool,
) -> String {
    let off = |measured: f64, predicted: f64| -> Option<f64> {
        let ratio = measured / predicted;
        (predicted > 0.0 && (ratio - 1.0).abs() > PREDICTION_TOLERANCE).then_some(ratio)
    };
    let mut text = String::new();
    if let Some(ratio) = off(peak as f64, predicted_peak as f64) {
        let cause = if offloads {
            "offload's device memory is given back when its copies finish, which happened at \
             other times than in the profiled step"
        } else {
            "the measured steps allocate differently from the profiled one (a block's memory \
             depends on its neighbours' strategies, which the prediction assumes it does not)"
        };
        text += &format!(
            "  ! {what}: peak {ratio:.2}x its prediction, more than 10% off; likely cause: \
             {cause}\n"
        );
    }
    if let Some(ratio) = off(step_ms, predicted_step_ms) {
        text += &format!(
            "  ! {what}: step time {ratio:.2}x its prediction, more than 10% off; likely cause: \
             timing noise (the profile times each strategy over few steps, and other work on \
             the machine shifts them; more --steps, or a quieter machine, narrow it)\n"
        );
    }
    text
}

/// The plan of a planned case as JSON.
pub(crate) fn json(plan: &PlanOutcome) -> Value {
    json!({
        "budget_bytes": plan.budget,
        "budget_given": plan.budget_given,
        "min_budget_bytes": plan.min_budget,
        "no_checkpointing_predicted_peak_bytes": plan.keep_all_peak,
        "predicted_peak_bytes": plan.predicted_peak,
        "predicted_step_ms": plan.predicted_step_ms,
        "strategies": plan.strategies,
        "table": plan.table,
        "lossy": plan.lossy,
        "exact_only": plan.exact_only.map(|(ms, recomputed)| json!({
            "predicted_step_ms": ms,
            "n_recomputed": recomputed,
        })),
        "uniform": plan.uniform.as_ref().map(|u| json!({
            "every": u.every,
            "n_recomputed": u.n_recomputed,
            "predicted_peak_bytes": u.predicted_peak,
            "predicted_step_ms": u.predicted_step_ms,
            "peak_allocated_bytes": u.peak,
            "step_ms": u.step_ms,
            "step_ms_min": u.step_ms_min,
            "plan_step_ms": u.plan_step_ms,
            "plan_step_ms_min": u.plan_step_ms_min,
            "alternated_steps": u.pairs,
            "same_choices": u.same_choices,
            "over_budget": u.over_budget.iter().map(|(every, peak)| json!({"every": every, "peak_allocated_bytes": peak})).collect::<Vec<_>>(),
        })),
    })
}
