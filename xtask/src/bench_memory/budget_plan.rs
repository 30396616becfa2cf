//! The `adam_auto` case: checkpointing planned for a memory budget, and the uniform
//! checkpointing it must beat.
//!
//! Before the protocol's steps, checkpoint's `BlockPlanner` measures one training step per
//! candidate (keep, recompute) on the fresh model and optimizer, after one warm-up step, and
//! plans for `--budget` bytes: without one, halfway between the lowest peak the planner can reach
//! and the peak of no checkpointing (both predicted from the same measurement). The plan is set as
//! the encoder's block runner and the protocol measures it as any case. Then, on the same model
//! and optimizer, uniform checkpointing (every k-th block, `CheckpointBlocks::Every(k)`) at the
//! fastest k whose predicted peak fits the budget runs one settling step and the timed steps; if
//! its measured peak exceeds the budget, the next k is tried. The report prints the plan's table,
//! the predicted and measured figures, and the uniform comparison.
//!
//! It sits on checkpoint's planner, nn's ViT and the probe of `cases`; the step itself is the
//! caller's.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_caching_allocator::Storage;
use headroom_checkpoint::{
    BlockPlanner, BlockSelection, Candidate, CheckpointBlocks, CheckpointOptions, StepProbe,
    StepProfile,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use serde_json::{json, Value};

use super::cases::{CaseResult, Probe};
use super::models::Net;
use super::report::size;

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
    /// Uniform checkpointing within the same budget, measured.
    pub(crate) uniform: Option<Uniform>,
}

/// Uniform checkpointing (every k-th block) measured at the plan's budget.
#[derive(Debug, Clone)]
pub(crate) struct Uniform {
    pub(crate) every: usize,
    pub(crate) n_recomputed: usize,
    pub(crate) predicted_peak: u64,
    pub(crate) predicted_step_ms: f64,
    /// Peak allocated over its timed steps.
    pub(crate) peak: u64,
    /// Median step time.
    pub(crate) step_ms: f64,
    /// Fastest step.
    pub(crate) step_ms_min: f64,
    /// Every k tried before, with its measured peak over the budget.
    pub(crate) over_budget: Vec<(usize, u64)>,
}

/// The planner's probe of the device `probe` runs on.
fn step_probe<S: Storage>(probe: &Probe<'_, S>) -> Result<StepProbe> {
    let any = probe.backend.clone().into_any();
    if let Ok(cuda) = any.clone().downcast::<CudaBackend>() {
        return Ok(StepProbe::cuda(&cuda));
    }
    match any.downcast::<CpuBackend>() {
        Ok(cpu) => Ok(StepProbe::host(cpu, CpuBackend::allocator)),
        Err(_) => bail!("adam_auto: the planner knows the CPU and CUDA backends only"),
    }
}

/// Profiles `vit`'s step, plans for `budget` (or the default) and sets the plan as its block
/// runner; returns the outcome (without the uniform comparison) and the profile.
pub(crate) fn plan<S: Storage>(
    probe: &Probe<'_, S>,
    vit: &mut Net,
    budget: Option<u64>,
    step: &mut dyn FnMut(&Net) -> Result<()>,
) -> Result<(PlanOutcome, StepProfile)> {
    let planner = BlockPlanner::new(step_probe(probe)?, Candidate::defaults());
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
        uniform: None,
    };
    vit.set_block_runner(Some(Arc::new(plan)));
    Ok((outcome, profile))
}

/// Measures uniform checkpointing at the fastest k that fits `budget` (see the module's
/// documentation); `None` when no k fits.
pub(crate) fn compare_uniform<S: Storage>(
    probe: &Probe<'_, S>,
    vit: &mut Net,
    profile: &StepProfile,
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
        vit.set_block_runner(Some(Arc::new(CheckpointBlocks {
            selection: BlockSelection::Every(every),
            options: CheckpointOptions::default(),
        })));
        let vit: &Net = vit;
        step(vit)?;
        (probe.synchronize)()?;
        probe.allocator.reset_peak_stats();
        let mut times_ms = Vec::with_capacity(steps);
        for _ in 0..steps {
            (probe.synchronize)()?;
            let start = Instant::now();
            step(vit)?;
            (probe.synchronize)()?;
            times_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let peak = probe.allocator.max_memory_allocated();
        if peak > budget {
            over_budget.push((every, peak));
            continue;
        }
        times_ms.sort_by(f64::total_cmp);
        return Ok(Some(Uniform {
            every,
            n_recomputed: choices.iter().filter(|&&c| c == recompute).count(),
            predicted_peak: prediction.peak_bytes,
            predicted_step_ms: prediction.step_ms,
            peak,
            step_ms: times_ms[times_ms.len() / 2],
            step_ms_min: times_ms[0],
            over_budget,
        }));
    }
    Ok(None)
}

/// The report's lines on a planned case: the plan's figures, the uniform comparison, the table.
pub(crate) fn describe(r: &CaseResult) -> Option<String> {
    let plan = r.plan.as_ref()?;
    let n_recomputed = plan.strategies.iter().filter(|s| *s == "recompute").count();
    let mut text = format!(
        "{} {} batch {}: budget {} ({} B{}); lowest reachable {}, no checkpointing {} \
         (predicted)\n  plan: {} of {} blocks recomputed; peak {} measured / {} predicted \
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
        n_recomputed,
        plan.strategies.len(),
        size(r.peak_allocated_bytes),
        size(plan.predicted_peak),
        r.peak_allocated_bytes as f64 / plan.predicted_peak as f64,
        r.step_ms,
        plan.predicted_step_ms,
    );
    match &plan.uniform {
        Some(u) => {
            for (every, peak) in &u.over_budget {
                text += &format!(
                    "  uniform every {every}: measured peak {} over the budget\n",
                    size(*peak)
                );
            }
            text += &format!(
                "  uniform every {} ({} recomputed): peak {} measured / {} predicted; step {:.1} \
                 ms measured / {:.1} ms predicted; plan / uniform step time {:.3}\n",
                u.every,
                u.n_recomputed,
                size(u.peak),
                size(u.predicted_peak),
                u.step_ms,
                u.predicted_step_ms,
                r.step_ms / u.step_ms,
            );
        }
        None => text += "  uniform checkpointing: no every-k fits the budget\n",
    }
    text += &plan.table;
    Some(text)
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
        "uniform": plan.uniform.as_ref().map(|u| json!({
            "every": u.every,
            "n_recomputed": u.n_recomputed,
            "predicted_peak_bytes": u.predicted_peak,
            "predicted_step_ms": u.predicted_step_ms,
            "peak_allocated_bytes": u.peak,
            "step_ms": u.step_ms,
            "step_ms_min": u.step_ms_min,
            "over_budget": u.over_budget.iter().map(|(every, peak)| json!({"every": every, "peak_allocated_bytes": peak})).collect::<Vec<_>>(),
        })),
    })
}
