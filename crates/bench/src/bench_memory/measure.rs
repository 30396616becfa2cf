//! The protocol that measures one `bench-memory` case ([`measure`]), `torch_reference.py`'s: the
//! allocator's peak is reset, 3 warm-up steps from a fresh optimizer give the first-3 peak; the
//! peak is reset again and the timed steps give the steady peak (allocated and reserved) and the
//! step time (forward + backward + optimizer step + `zero_grad(set_to_none)`, the device
//! synchronised before the clock is read), with the peak of pinned host memory beside them. One more, untimed, step is traced (history under the
//! phase labels, [`super::training`]) and split by what held the memory at its peak
//! ([`super::timeline`]); a language model's loss then runs once more alone, for its logits'
//! bytes at their peak ([`super::loss_logits`]). What it measured is a [`CaseResult`].
//!
//! It sits on [`super::training`] (the runs), [`super::budget_plan`] (`adam_auto`'s plan) and
//! one backend's caching allocator, reached through [`Probe`]; it knows nothing about reports,
//! files or the progress bar.

use std::time::Instant;

use anyhow::Result;
use headroom_caching_allocator::{HistoryOptions, Snapshot, TraceAction, TraceEvent};

use super::block_saves::{self, BlockSaves};
use super::budget_plan::{self, PlanOutcome};
use super::cases::Case;
use super::loss_logits;
use super::models::{Input, Model, Net};
use super::timeline::{self, AtPeak, Timeline};
use super::training::{plain_step, PhaseBytes, Probe, Training};

/// How many steps of each kind a case runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Protocol {
    /// Warm-up steps from the fresh optimizer (their peak is the first-3 peak).
    pub(crate) warmup: usize,
    /// Timed steps (at least 1).
    pub(crate) steps: usize,
    /// Bucket size of the in-backward cases; `None`: 1/16 of the parameters, at most hooks'
    /// default (25 MiB).
    pub(crate) bucket_bytes: Option<u64>,
    /// The memory budget of `adam_auto`, in bytes (`None`: its default).
    pub(crate) budget: Option<u64>,
    /// After the timed steps, one more step with the device's op profile, printed as a table.
    pub(crate) op_profile: bool,
    /// Whether the allocator's events are recorded from the model's creation to the end of the
    /// timed steps ([`CaseResult::events`], `--trace`).
    pub(crate) record_events: bool,
}

impl Protocol {
    /// One step and nothing else: find-max-batch's probe of a batch.
    pub(crate) const ONE_STEP: Protocol = Protocol {
        warmup: 0,
        steps: 1,
        bucket_bytes: None,
        budget: None,
        op_profile: false,
        record_events: false,
    };

    /// Steps one case runs, the traced one included (for the progress bar).
    pub(crate) fn total_steps(self) -> usize {
        self.warmup + self.steps + 1
    }
}

/// What one case measured.
#[derive(Debug, Clone)]
pub(crate) struct CaseResult {
    pub(crate) case: Case,
    pub(crate) model: &'static str,
    /// The blocks a checkpointed case recomputed when `--checkpoint-blocks` set them.
    pub(crate) checkpointed_blocks: Option<usize>,
    /// The decoder layers when `--layers` set them.
    pub(crate) layers: Option<usize>,
    /// The streamed cases' budget when `--stream-budget-mib` set it.
    pub(crate) stream_budget: Option<u64>,
    pub(crate) batch: usize,
    pub(crate) device: String,
    /// Scalar parameters.
    pub(crate) n_params: usize,
    /// Σ numel × 4 over the parameters.
    pub(crate) param_bytes: u64,
    /// Σ numel × 4 over the gradients after backward.
    pub(crate) grad_bytes: u64,
    /// Σ numel × element size over the optimizer's state tensors after the steps.
    pub(crate) state_bytes: u64,
    /// Bytes of optimizer state in host memory after the steps (an offloaded optimizer's).
    pub(crate) host_state_bytes: u64,
    /// Allocated after the forward (loss computed) minus allocated before it: what the forward
    /// keeps for backward.
    pub(crate) activation_bytes: u64,
    /// Bytes of the half copies of the weights autocast's cast cache held at the end of the
    /// traced forward (0 without autocast).
    pub(crate) cast_cache_bytes: u64,
    /// Peak allocated over the warm-up steps.
    pub(crate) first3_peak_allocated_bytes: u64,
    /// Peak allocated over the timed steps.
    pub(crate) peak_allocated_bytes: u64,
    /// Peak reserved over the timed steps.
    pub(crate) peak_reserved_bytes: u64,
    /// Peak reserved pinned host memory over the timed steps (offloaded activations or state;
    /// `None` on a backend without pinned memory, the CPU's).
    pub(crate) host_peak_reserved_bytes: Option<u64>,
    /// Median step time (`sorted[n / 2]`, as `torch_reference.py` takes it).
    pub(crate) step_ms: f64,
    /// Fastest step.
    pub(crate) step_ms_min: f64,
    /// Every timed step, in order.
    pub(crate) times_ms: Vec<f64>,
    /// The traced step's phases.
    pub(crate) phases: Vec<PhaseBytes>,
    /// The traced step's peak allocated bytes, split by what held them.
    pub(crate) at_peak: AtPeak,
    /// The traced step's requested bytes after each allocator event.
    pub(crate) timeline: Timeline,
    /// `adam_auto`'s plan, predictions and uniform comparison.
    pub(crate) plan: Option<PlanOutcome>,
    /// With [`Protocol::record_events`], the allocations and completed frees from the model's
    /// creation to the end of the timed steps, each with its step (0: building the model and
    /// optimizer, then 1 to warm-up + timed steps); empty otherwise.
    pub(crate) events: Vec<(usize, TraceEvent)>,
    /// The last block's saved tensors, named, from one more forward ([`block_saves`]); `None`
    /// when that forward failed.
    pub(crate) block_saves: Option<BlockSaves>,
    /// A language model's loss alone: the most bytes its temporaries held at once, the logits
    /// and their gradient unfused, one chunk fused ([`loss_logits`]); `None` for a ViT or when
    /// that run failed.
    pub(crate) logits_bytes: Option<u64>,
}

/// Runs `case` on `model` at `batch` with `protocol` and measures it; `tick` is called after
/// every step.
pub(crate) fn measure(
    probe: &Probe<'_>,
    model: Model,
    batch: usize,
    case: Case,
    protocol: Protocol,
    tick: &mut dyn FnMut(),
) -> Result<CaseResult> {
    let allocator = probe.allocator();
    allocator.empty_cache()?;
    if protocol.record_events {
        allocator.record_history(Some(HistoryOptions {
            max_entries: 1 << 26,
            record_context: true,
        }));
    }
    let step_label = |step: usize| format!("step {step}");
    let mut training = Training::new(probe, model, case)?;
    let input = Input::new(&probe.backend, model, batch)?;
    let (n_params, param_bytes) = (training.n_params, training.param_bytes);
    let optimizer = &training.optimizer;
    let mut plain_step = |net: &Net| plain_step(net, &input, optimizer.as_ref());
    let mut planned = match case {
        Case::AdamAuto => Some(budget_plan::plan(
            probe,
            &mut training.net,
            protocol.budget,
            &mut plain_step,
        )?),
        _ => None,
    };
    let mut run = training.run(&input, case, protocol)?;

    probe.backend.synchronize()?;
    allocator.reset_peak_stats();
    for step in 1..=protocol.warmup {
        let _context = protocol
            .record_events
            .then(|| allocator.push_context(&step_label(step)));
        run.step()?;
        tick();
    }
    probe.backend.synchronize()?;
    let first3_peak = allocator.max_memory_allocated();

    allocator.reset_peak_stats();
    let host = probe.backend.host_allocator_view();
    if let Some(host) = host {
        host.reset_peak_stats();
    }
    let mut times_ms = Vec::with_capacity(protocol.steps);
    for step in protocol.warmup + 1..=protocol.warmup + protocol.steps {
        let _context = protocol
            .record_events
            .then(|| allocator.push_context(&step_label(step)));
        probe.backend.synchronize()?;
        let start = Instant::now();
        run.step()?;
        probe.backend.synchronize()?;
        times_ms.push(start.elapsed().as_secs_f64() * 1e3);
        tick();
    }
    let stats = allocator.memory_stats();
    let host_peak_reserved_bytes = host.map(|host| host.max_memory_reserved());
    if let (true, Some(profile_ops)) = (protocol.op_profile, probe.profile_ops) {
        probe.backend.synchronize()?;
        let start = Instant::now();
        let timings = profile_ops(&mut || run.step())?;
        let wall_ms = start.elapsed().as_secs_f64() * 1e3;
        println!("{}", op_profile_table(case.name(), wall_ms, &timings));
    }
    let mut sorted = times_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let events = if protocol.record_events {
        let events = recorded_events(&allocator.snapshot());
        allocator.record_history(None);
        events
    } else {
        Vec::new()
    };

    let traced = run.traced_step(probe)?;
    tick();
    let cast_cache_bytes = run.cast_cache_bytes;
    drop(run);
    if let Some((outcome, profile)) = &mut planned {
        outcome.uniform = budget_plan::compare_uniform(
            probe,
            &mut training.net,
            profile,
            &outcome.strategies,
            outcome.budget,
            protocol.steps,
            &mut plain_step,
        )?;
    }
    // One more forward names the last block's saves; a failure (out of memory at the edge)
    // leaves the case's figures as measured.
    let block_saves = match block_saves::record(&mut training, &input, model, batch, case) {
        Ok(saves) => Some(saves),
        Err(err) => {
            eprintln!(
                "bench-memory: {} at batch {batch}: the block's saves were not recorded: {err:#}",
                case.name()
            );
            None
        }
    };
    let logits_bytes = loss_logits::measure(probe, &training, &input, case).unwrap_or_else(|err| {
        eprintln!(
            "bench-memory: {} at batch {batch}: the loss's logits were not measured: {err:#}",
            case.name()
        );
        None
    });
    let state_bytes = training.optimizer.state_bytes();
    let host_state_bytes = training.optimizer.host_state_bytes();
    let (timeline, at_peak) = timeline::analyse(
        &traced.entries,
        traced.requested_before,
        &traced.grad_addresses,
        timeline::Persistent {
            parameters: param_bytes,
            optimizer_state: state_bytes,
        },
        traced.peak_allocated,
    )?;
    let forward = traced.phases[0];
    Ok(CaseResult {
        case,
        model: model.name,
        checkpointed_blocks: model.checkpointed_blocks,
        layers: model.layers,
        stream_budget: model.stream_budget,
        batch,
        device: probe.device.clone(),
        n_params,
        param_bytes,
        grad_bytes: traced.grad_bytes,
        state_bytes,
        host_state_bytes,
        activation_bytes: forward.after.saturating_sub(forward.before),
        cast_cache_bytes,
        first3_peak_allocated_bytes: first3_peak,
        peak_allocated_bytes: stats.allocated_bytes.all.peak as u64,
        peak_reserved_bytes: stats.reserved_bytes.all.peak as u64,
        host_peak_reserved_bytes,
        step_ms: sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN),
        step_ms_min: sorted.first().copied().unwrap_or(f64::NAN),
        times_ms,
        phases: traced.phases,
        at_peak,
        timeline,
        plan: planned.map(|(outcome, _)| outcome),
        events,
        block_saves,
        logits_bytes,
    })
}

/// The allocations and completed frees of `snapshot`'s history, each with the step its
/// context label names (0 outside a step).
fn recorded_events(snapshot: &Snapshot) -> Vec<(usize, TraceEvent)> {
    snapshot
        .device_traces
        .iter()
        .flatten()
        .filter(|entry| {
            matches!(
                entry.action,
                TraceAction::Alloc | TraceAction::FreeCompleted
            )
        })
        .map(|entry| {
            let step = entry
                .frames
                .iter()
                .find_map(|frame| frame.name.strip_prefix("step ")?.parse().ok())
                .unwrap_or(0);
            let event = TraceEvent {
                action: entry.action,
                addr: entry.addr,
                size: entry.size,
                stream: entry.stream,
            };
            (step, event)
        })
        .collect()
}

/// The op profile of one step as a Markdown table: device time per label (summed over its
/// calls), largest first, and the step's wall time beside the sum of its primitives' spans.
pub(crate) fn op_profile_table(case: &str, wall_ms: f64, timings: &[(String, f64)]) -> String {
    let mut by_label: Vec<(&str, usize, f64)> = Vec::new();
    let mut index = std::collections::HashMap::new();
    for (label, ms) in timings {
        let slot = *index.entry(label.as_str()).or_insert_with(|| {
            by_label.push((label.as_str(), 0, 0.0));
            by_label.len() - 1
        });
        by_label[slot].1 += 1;
        by_label[slot].2 += ms;
    }
    by_label.sort_by(|a, b| b.2.total_cmp(&a.2));
    let total: f64 = timings.iter().map(|(_, ms)| ms).sum();
    let mut text = format!(
        "op profile, {case}: {} primitives, {total:.2} ms on the device inside them, step wall time \
         {wall_ms:.2} ms (events around every primitive)\n\n| ms | % | calls | primitive |\n|---:|---:|---:|---|\n",
        timings.len()
    );
    for (label, calls, ms) in by_label {
        text += &format!(
            "| {ms:.3} | {:.1} | {calls} | {label} |\n",
            100.0 * ms / total.max(1e-9)
        );
    }
    text
}
