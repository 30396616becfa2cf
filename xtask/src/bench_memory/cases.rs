//! The cases of `bench-memory` and the protocol that measures one: which optimizer a case
//! builds, and one training run from a fresh model and optimizer ([`Training`], [`Run`]).
//!
//! The protocol is `torch_reference.py`'s: input `rand(batch, 3, size, size)`, loss =
//! `model(x).sum()` (GPT-2: random tokens and Hugging Face's causal-LM loss, [`super::models`]),
//! f32 weights (bf16 for `fwd_bwd_bf16`, whose steps stop after backward, as `fwd_bwd`'s do);
//! the allocator's peak is reset, 3 warm-up steps from a fresh optimizer give the first-3 peak; the peak is reset again and the timed steps give the steady
//! peak (allocated and reserved) and the step time (forward + backward + optimizer step +
//! `zero_grad(set_to_none)`, the device synchronised before the clock is read). One more,
//! untimed, step is traced: history is recorded under the context labels `forward`, `backward`,
//! `step` and `zero_grad`, and the allocated bytes are sampled at each phase boundary.
//!
//! Mixed-precision cases (`adam_bf16`, `adam_fp16`, `adam_inbwd_ckpt_bf16`) run the forward under
//! amp's autocast policy (PyTorch's CUDA lists), `loss = model(x).float().sum()` as the reference
//! script does, and fp16 scales the loss with amp's GradScaler; the bytes autocast's cast cache
//! holds at the end of the forward (the half copies of the weights) are reported.
//!
//! It sits on nn (the ViT), optim (the optimizers), the technique crates and one backend's caching
//! allocator, reached through [`Probe`]; it knows nothing about reports, files or the progress
//! bar.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_amp::{AmpPolicy, GradScaler, GradScalerConfig};
use headroom_autograd_core::{autocast_stats, BackendRef, DType, Tensor};
use headroom_caching_allocator::{
    AllocatorView, HistoryOptions, Snapshot, TraceAction, TraceEvent,
};
use headroom_checkpoint::{
    BlockSelection, CheckpointBlocks, CompressBlocks, OffloadBlocks, OffloadOptions,
};
use headroom_hooks::{ClipMode, Clipping, InBackward, InBackwardConfig, DEFAULT_BUCKET_BYTES};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::StepOutcome;
use headroom_optim::{
    clip_grad_norm_, Adam8bitConfig, AdamConfig, GroupOptimizer, Implementation, NormType,
    OptimError, Optimizer, ParamGroup, ParamId, Scaling, SgdConfig, StepParams, UpdateRule,
};
use parking_lot::Mutex;

use super::budget_plan::{self, PlanOutcome};
pub(crate) use super::models::Model;
use super::models::{Input, Net};
use super::timeline::{self, AtPeak, Timeline};

/// One optimizer implementation under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Case {
    /// Adam (lr 1e-4), foreach with temporaries bounded to [`headroom_optim::DEFAULT_FOREACH_CHUNK`].
    AdamForeach,
    /// Adam, foreach as PyTorch does it: temporaries for the whole parameter list.
    AdamForeachUnbounded,
    /// Adam, one parameter at a time (`foreach=False`).
    AdamSingle,
    /// Adam, one fused pass (`fused=True`).
    AdamFused,
    /// bitsandbytes' Adam8bit (lr 1e-4): 8-bit blockwise state.
    Adam8bit,
    /// SGD (lr 1e-3, no momentum), fused: no state, no temporaries.
    Sgd,
    /// Fused Adam stepped inside backward (hooks' `InBackward`, buckets of 25 MiB or 1/16 of the
    /// parameters, whichever is smaller): gradients are freed as they are used.
    AdamInbwd,
    /// 8-bit Adam stepped inside backward.
    Adam8bitInbwd,
    /// Fused Adam with every encoder block but the last checkpointed (only block inputs kept;
    /// `CheckpointBlocks::all_but_last`).
    AdamCkpt,
    /// Fused Adam inside backward with every block checkpointed (the last one too: leaving it
    /// alone would put the peak at the end of the forward).
    AdamInbwdCkpt,
    /// Fused Adam after `clip_grad_norm_(params, 1.0)` (L2): the plain loop's clipping.
    AdamFusedClip,
    /// Fused Adam inside backward, clipped exactly to the global L2 norm 1.0 (a first backward
    /// pass measures the norm, a second one updates).
    AdamInbwdClip,
    /// Fused Adam inside backward, clipped with the previous step's global L2 norm (one pass).
    AdamInbwdClipPrev,
    /// Fused Adam with the saved tensors of the first 7/12 of the encoder blocks offloaded to
    /// pinned host memory ([`offload_blocks`]; CUDA only).
    AdamOffload,
    /// Fused Adam with every encoder block's saved activations compressed to 8 bits (checkpoint's
    /// `CompressBlocks::all()`: no checkpointing; each op input or output a block saves, of 16 Ki
    /// elements or more, kept as signed bytes with one f32 absmax per 256 elements and decoded in
    /// backward; parameters, layer norm statistics and attention's log-sum-exp stay f32).
    AdamCkpt8bit,
    /// Fused Adam with checkpointing planned per block for a memory budget (`--budget`;
    /// [`super::budget_plan`]).
    AdamAuto,
    /// Fused Adam with the forward under bf16 autocast.
    AdamBf16,
    /// Fused Adam with the forward under f16 autocast and the loss scaled by a GradScaler (the
    /// kernels unscale and skip; no host read).
    AdamFp16,
    /// Fused Adam inside backward, every block checkpointed, the forward under bf16 autocast.
    AdamInbwdCkptBf16,
    /// Forward and backward only (no optimizer step; gradients set to none after), f32.
    FwdBwd,
    /// Forward and backward only, the whole model in bf16 (`model.bfloat16()`).
    FwdBwdBf16,
}

impl Case {
    /// Every case, in report order: pairs that differ by one technique sit next to each other
    /// (the HTML report draws two timelines a row).
    pub(crate) const ALL: [Case; 21] = [
        Case::AdamForeach,
        Case::AdamForeachUnbounded,
        Case::AdamSingle,
        Case::Sgd,
        Case::AdamFused,
        Case::AdamInbwd,
        Case::Adam8bit,
        Case::Adam8bitInbwd,
        Case::AdamCkpt,
        Case::AdamInbwdCkpt,
        Case::AdamFusedClip,
        Case::AdamInbwdClip,
        Case::AdamInbwdClipPrev,
        Case::AdamOffload,
        Case::AdamCkpt8bit,
        Case::AdamAuto,
        Case::AdamBf16,
        Case::AdamFp16,
        Case::AdamInbwdCkptBf16,
        Case::FwdBwd,
        Case::FwdBwdBf16,
    ];

    /// The case's name on the command line and in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Case::AdamForeach => "adam_foreach",
            Case::AdamForeachUnbounded => "adam_foreach_unbounded",
            Case::AdamSingle => "adam_single",
            Case::AdamFused => "adam_fused",
            Case::Adam8bit => "adam8bit",
            Case::Sgd => "sgd",
            Case::AdamInbwd => "adam_inbwd",
            Case::Adam8bitInbwd => "adam8bit_inbwd",
            Case::AdamCkpt => "adam_ckpt",
            Case::AdamInbwdCkpt => "adam_inbwd_ckpt",
            Case::AdamFusedClip => "adam_fused_clip",
            Case::AdamInbwdClip => "adam_inbwd_clip",
            Case::AdamInbwdClipPrev => "adam_inbwd_clip_prev",
            Case::AdamOffload => "adam_offload",
            Case::AdamCkpt8bit => "adam_ckpt8bit",
            Case::AdamAuto => "adam_auto",
            Case::AdamBf16 => "adam_bf16",
            Case::AdamFp16 => "adam_fp16",
            Case::AdamInbwdCkptBf16 => "adam_inbwd_ckpt_bf16",
            Case::FwdBwd => "fwd_bwd",
            Case::FwdBwdBf16 => "fwd_bwd_bf16",
        }
    }

    /// Whether the optimizer steps inside backward.
    pub(crate) fn in_backward(self) -> bool {
        matches!(
            self,
            Case::AdamInbwd
                | Case::Adam8bitInbwd
                | Case::AdamInbwdCkpt
                | Case::AdamInbwdClip
                | Case::AdamInbwdClipPrev
                | Case::AdamInbwdCkptBf16
        )
    }

    /// How the case clips gradients to the global L2 norm [`CLIP_MAX_NORM`], if it does.
    pub(crate) fn clipping(self) -> Option<ClipMode> {
        match self {
            Case::AdamFusedClip | Case::AdamInbwdClip => Some(ClipMode::Exact),
            Case::AdamInbwdClipPrev => Some(ClipMode::PreviousStep),
            _ => None,
        }
    }

    /// Whether the encoder blocks are checkpointed (with the plain step every one but the last).
    pub(crate) fn checkpointed(self) -> bool {
        matches!(
            self,
            Case::AdamCkpt | Case::AdamInbwdCkpt | Case::AdamInbwdCkptBf16
        )
    }

    /// The autocast dtype of the forward, if any.
    pub(crate) fn autocast(self) -> Option<DType> {
        match self {
            Case::AdamBf16 | Case::AdamInbwdCkptBf16 => Some(DType::BF16),
            Case::AdamFp16 => Some(DType::F16),
            _ => None,
        }
    }

    /// The dtype of the model's parameters.
    pub(crate) fn param_dtype(self) -> DType {
        match self {
            Case::FwdBwdBf16 => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Whether the case steps no optimizer (forward and backward only).
    pub(crate) fn forward_backward_only(self) -> bool {
        matches!(self, Case::FwdBwd | Case::FwdBwdBf16)
    }

    /// Whether the loss is scaled by a GradScaler (f16).
    pub(crate) fn loss_scaled(self) -> bool {
        self == Case::AdamFp16
    }

    /// Whether the case runs on a CUDA device only (offload copies to pinned host memory).
    pub(crate) fn needs_cuda(self) -> bool {
        self == Case::AdamOffload
    }

    /// The case of `torch_reference.py` that computes the same update (PyTorch's foreach is
    /// unbounded, so both foreach cases compare with it).
    pub(crate) fn pytorch_name(self) -> &'static str {
        match self {
            Case::AdamForeachUnbounded => "adam_foreach",
            other => other.name(),
        }
    }

    /// The case named `name`.
    pub(crate) fn parse(name: &str) -> Result<Case> {
        Case::ALL
            .into_iter()
            .find(|case| case.name() == name)
            .with_context(|| {
                let names: Vec<_> = Case::ALL.iter().map(|c| c.name()).collect();
                format!("unknown case `{name}` (cases: {})", names.join(", "))
            })
    }

    /// The cases of a `--cases a,b,c` list (at least one).
    pub(crate) fn parse_list(list: &str) -> Result<Vec<Case>> {
        let cases = list
            .split(',')
            .filter(|name| !name.is_empty())
            .map(Case::parse)
            .collect::<Result<Vec<_>>>()?;
        if cases.is_empty() {
            bail!("--cases names no case");
        }
        Ok(cases)
    }

    fn optimizer(self, params: Vec<Tensor>) -> Result<Box<dyn BenchOptimizer>> {
        fn build<R: UpdateRule>(
            params: Vec<Tensor>,
            config: R,
            implementation: Implementation,
        ) -> Result<Box<dyn BenchOptimizer>> {
            let optimizer =
                GroupOptimizer::new(vec![ParamGroup::new(params, config)], implementation)?;
            Ok(Box::new(Arc::new(Mutex::new(optimizer))))
        }
        let adam = AdamConfig {
            lr: 1e-4,
            ..AdamConfig::adam()
        };
        let adam8bit = Adam8bitConfig {
            lr: 1e-4,
            ..Adam8bitConfig::adam()
        };
        match self {
            Case::AdamForeach => build::<AdamConfig>(params, adam, Implementation::FOREACH),
            Case::AdamForeachUnbounded => {
                build::<AdamConfig>(params, adam, Implementation::ForeachUnbounded)
            }
            Case::AdamSingle => build::<AdamConfig>(params, adam, Implementation::Single),
            Case::AdamFused
            | Case::AdamInbwd
            | Case::AdamCkpt
            | Case::AdamInbwdCkpt
            | Case::AdamFusedClip
            | Case::AdamInbwdClip
            | Case::AdamInbwdClipPrev
            | Case::AdamOffload
            | Case::AdamCkpt8bit
            | Case::AdamAuto
            | Case::AdamBf16
            | Case::AdamFp16
            | Case::AdamInbwdCkptBf16 => build::<AdamConfig>(params, adam, Implementation::Fused),
            Case::Adam8bit | Case::Adam8bitInbwd => {
                build::<Adam8bitConfig>(params, adam8bit, Implementation::Fused)
            }
            // The forward-and-backward cases never step: their SGD only sets gradients to none.
            Case::Sgd | Case::FwdBwd | Case::FwdBwdBf16 => {
                build::<SgdConfig>(params, SgdConfig::new(1e-3), Implementation::Fused)
            }
        }
    }
}

/// An optimizer whose state can be counted, shared so that an `InBackward` can step it.
trait BenchOptimizer: Send {
    /// A handle that steps the optimizer (through the shared lock).
    fn handle(&self) -> Box<dyn Optimizer>;
    /// Bytes of every state tensor (numel × element size).
    fn state_bytes(&self) -> u64;
}

impl<R: UpdateRule> BenchOptimizer for Arc<Mutex<GroupOptimizer<R>>> {
    fn handle(&self) -> Box<dyn Optimizer> {
        Box::new(SharedOptimizer(Arc::clone(self)))
    }

    fn state_bytes(&self) -> u64 {
        let optimizer = self.lock();
        let mut bytes = 0;
        for (g, group) in optimizer.groups().iter().enumerate() {
            for idx in 0..group.params.len() {
                bytes += optimizer
                    .param_state(g, idx)
                    .iter()
                    .map(|(_, tensor)| tensor_bytes(tensor))
                    .sum::<u64>();
            }
        }
        bytes
    }
}

/// A group optimizer behind a lock, as an [`Optimizer`]: the bench keeps one handle to count its
/// state while the training loop (or an `InBackward`) steps through another.
struct SharedOptimizer<R: UpdateRule>(Arc<Mutex<GroupOptimizer<R>>>);

impl<R: UpdateRule> Optimizer for SharedOptimizer<R> {
    fn name(&self) -> &'static str {
        self.0.lock().name()
    }

    fn n_groups(&self) -> usize {
        self.0.lock().n_groups()
    }

    fn lr(&self, group: usize) -> f64 {
        self.0.lock().lr(group)
    }

    fn set_lr(&mut self, group: usize, lr: f64) {
        self.0.lock().set_lr(group, lr)
    }

    fn params(&self) -> Vec<(ParamId, Tensor)> {
        self.0.lock().params()
    }

    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        self.0.lock().param_id(param)
    }

    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        self.0.lock().step_with(params, scaling)
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        self.0.lock().zero_grad(set_to_none)
    }

    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        self.0.lock().state_dict()
    }

    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        self.0.lock().load_state_dict(bytes)
    }
}

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
    /// Steps one case runs, the traced one included (for the progress bar).
    pub(crate) fn total_steps(self) -> usize {
        self.warmup + self.steps + 1
    }
}

/// The device under test: its backend (whose `allocator_view` and `synchronize` are what a
/// measurement reads and waits for), its name and its op profile.
pub(crate) struct Probe<'a> {
    /// The backend tensors are created on.
    pub(crate) backend: BackendRef,
    /// `cpu` or `cuda:0`.
    pub(crate) device: String,
    /// Runs the step it is given under the device's op profile and returns each primitive's
    /// label and device milliseconds (`None`: the device has no op profile).
    pub(crate) profile_ops: Option<&'a ProfileOps<'a>>,
}

/// What [`Probe::profile_ops`] is.
pub(crate) type ProfileOps<'a> =
    dyn Fn(&mut dyn FnMut() -> Result<()>) -> Result<Vec<(String, f64)>> + 'a;

impl Probe<'_> {
    /// The CPU backend `cpu`.
    pub(crate) fn cpu(cpu: &Arc<CpuBackend>) -> Probe<'static> {
        Probe {
            backend: cpu.clone(),
            device: "cpu".into(),
            profile_ops: None,
        }
    }

    /// The backend's caching allocator.
    pub(crate) fn allocator(&self) -> &dyn AllocatorView {
        self.backend.allocator_view()
    }
}

/// A phase of a training step, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Forward,
    Backward,
    Step,
    ZeroGrad,
}

impl Phase {
    pub(crate) const ALL: [Phase; 4] = [
        Phase::Forward,
        Phase::Backward,
        Phase::Step,
        Phase::ZeroGrad,
    ];

    /// The context label the traced step records it under.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Step => "step",
            Phase::ZeroGrad => "zero_grad",
        }
    }
}

/// Allocated bytes around one phase of the traced step (exact, from the allocator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PhaseBytes {
    pub(crate) phase: Phase,
    /// Allocated when the phase began.
    pub(crate) before: u64,
    /// Allocated when it ended.
    pub(crate) after: u64,
    /// The largest allocated figure during the phase.
    pub(crate) peak: u64,
}

/// What one case measured.
#[derive(Debug, Clone)]
pub(crate) struct CaseResult {
    pub(crate) case: Case,
    pub(crate) model: &'static str,
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
}

/// A case's model and optimizer, built once: [`Training::run`] trains it on one input.
pub(crate) struct Training {
    pub(crate) net: Net,
    optimizer: Box<dyn BenchOptimizer>,
    /// Scalar parameters.
    pub(crate) n_params: usize,
    /// Σ numel × element size over the parameters.
    pub(crate) param_bytes: u64,
}

impl Training {
    /// `model` with `case`'s parameter dtype, block runner and optimizer (no state yet).
    pub(crate) fn new(probe: &Probe<'_>, model: Model, case: Case) -> Result<Training> {
        let mut net = Net::new(&probe.backend, model, case.param_dtype())?;
        if case.checkpointed() {
            // With the plain step the peak is at the end of backward, where leaving the last
            // block alone costs nothing and saves its recompute. Stepping in backward, no
            // gradients pile up and the last block's saved tensors would set the peak at the end
            // of the forward instead: there every block is recomputed.
            let blocks = if case.in_backward() {
                CheckpointBlocks::all()
            } else {
                CheckpointBlocks::all_but_last(model.n_blocks())
            };
            net.set_block_runner(Some(Arc::new(blocks)));
        }
        if case == Case::AdamOffload {
            net.set_block_runner(Some(Arc::new(offload_blocks(model.n_blocks()))));
        }
        if case == Case::AdamCkpt8bit {
            net.set_block_runner(Some(Arc::new(CompressBlocks::all())));
        }
        let params = net.parameters();
        let n_params = params.iter().map(Tensor::numel).sum();
        let param_bytes = params.iter().map(tensor_bytes).sum();
        let optimizer = case.optimizer(params)?;
        Ok(Training {
            net,
            optimizer,
            n_params,
            param_bytes,
        })
    }

    /// The training loop of `case` on `input`: a fresh stepper (in-backward hooks, GradScaler)
    /// around the optimizer, whose state persists.
    pub(crate) fn run<'a>(
        &'a self,
        input: &'a Input,
        case: Case,
        protocol: Protocol,
    ) -> Result<Run<'a>> {
        let stepper = if case.loss_scaled() {
            let scaler = GradScaler::new(self.optimizer.handle(), GradScalerConfig::default())?;
            Stepper::Scaled(scaler)
        } else if case.in_backward() {
            // Unless asked otherwise, buckets of at most 1/16 of the parameters, so a small model
            // shows what a large one does with the default 25 MiB.
            let config = InBackwardConfig {
                bucket_bytes: protocol
                    .bucket_bytes
                    .unwrap_or((self.param_bytes / 16).min(DEFAULT_BUCKET_BYTES)),
                clipping: case.clipping().map(|mode| Clipping {
                    max_norm: CLIP_MAX_NORM,
                    norm: NormType::L2,
                    mode,
                }),
                ..InBackwardConfig::default()
            };
            Stepper::InBackward(InBackward::new(self.optimizer.handle(), config)?)
        } else if case.forward_backward_only() {
            Stepper::NoStep {
                optimizer: self.optimizer.handle(),
            }
        } else {
            Stepper::Plain {
                optimizer: self.optimizer.handle(),
                clip: case.clipping().map(|_| self.net.parameters()),
            }
        };
        Ok(Run {
            net: &self.net,
            input,
            stepper,
            policy: case.autocast().map(AmpPolicy::torch_cuda).transpose()?,
            cast_cache_bytes: 0,
        })
    }

    /// Sets every gradient to none (what an interrupted step left behind).
    pub(crate) fn clear_grads(&self) -> Result<()> {
        Ok(self.optimizer.handle().zero_grad(true)?)
    }
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
    let state_bytes = training.optimizer.state_bytes();
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
        batch,
        device: probe.device.clone(),
        n_params,
        param_bytes,
        grad_bytes: traced.grad_bytes,
        state_bytes,
        activation_bytes: forward.after.saturating_sub(forward.before),
        cast_cache_bytes,
        first3_peak_allocated_bytes: first3_peak,
        peak_allocated_bytes: stats.allocated_bytes.all.peak as u64,
        peak_reserved_bytes: stats.reserved_bytes.all.peak as u64,
        step_ms: sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN),
        step_ms_min: sorted.first().copied().unwrap_or(f64::NAN),
        times_ms,
        phases: traced.phases,
        at_peak,
        timeline,
        plan: planned.map(|(outcome, _)| outcome),
        events,
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

/// `adam_offload`'s runner: the saved tensors of the first 7/12 of the blocks (14 of ViT-L/16's
/// 24) go to pinned host memory. Backward needs them last, and their copies to the host run
/// behind the forward of the blocks after them: each block's device memory is given back when
/// the forward is `n - offloaded - 1` blocks further on (the last offloaded block's at the end of
/// the next-to-last block), and backward prefetches three blocks ahead.
///
/// Measured on the H200 (ViT-L/16, batch 32; a block saves 0.41 GB in 3.8 ms of forward, PCIe
/// moves 55 GB/s each way, so a block's copy takes twice its forward): the peak is the blocks
/// kept plus the one still in flight at the forward's end. 13 blocks: 8.41 GB at 1.04×; 14: 8.00
/// GB at 1.06×; 15: 7.58 GB at 1.09×; 16: 7.17 GB at 1.12× of `adam_fused` (13.78 GB, 285.6 ms).
/// The forward waits for the copies (+17.6 ms at 14 blocks); backward's copies back overlap it
/// completely.
pub(crate) fn offload_blocks(n_blocks: usize) -> OffloadBlocks {
    let offloaded = (n_blocks * 7).div_ceil(12);
    OffloadBlocks {
        selection: BlockSelection::Indices((0..offloaded).collect()),
        options: OffloadOptions {
            release_after_blocks: n_blocks.saturating_sub(offloaded + 1),
            prefetch_blocks: 3,
            ..OffloadOptions::default()
        },
    }
}

/// One training step of `net` with the optimizer stepped after backward.
fn plain_step(net: &Net, input: &Input, optimizer: &dyn BenchOptimizer) -> Result<()> {
    Run {
        net,
        input,
        stepper: Stepper::Plain {
            optimizer: optimizer.handle(),
            clip: None,
        },
        policy: None,
        cast_cache_bytes: 0,
    }
    .step()
}

/// Bytes of a tensor's elements.
pub(crate) fn tensor_bytes(tensor: &Tensor) -> u64 {
    (tensor.numel() * tensor.dtype().size_in_bytes()) as u64
}

/// What the traced step recorded.
struct Traced {
    entries: Vec<headroom_caching_allocator::TraceEntry>,
    requested_before: u64,
    peak_allocated: u64,
    phases: Vec<PhaseBytes>,
    grad_addresses: HashSet<u64>,
    grad_bytes: u64,
}

/// The global norm the clipping cases clip to.
pub(crate) const CLIP_MAX_NORM: f64 = 1.0;

/// How a run steps its optimizer.
enum Stepper {
    /// After backward, `step()` then `zero_grad(set_to_none)`; with `clip`, the step phase
    /// first clips those parameters' gradients to [`CLIP_MAX_NORM`] (`clip_grad_norm_`).
    Plain {
        optimizer: Box<dyn Optimizer>,
        clip: Option<Vec<Tensor>>,
    },
    /// Inside backward; the step and zero-grad phases are empty.
    InBackward(InBackward),
    /// No step: `zero_grad(set_to_none)` after backward.
    NoStep { optimizer: Box<dyn Optimizer> },
    /// A GradScaler: backward of the scaled loss, then its step and update.
    Scaled(GradScaler<Box<dyn Optimizer>>),
}

/// A model, its input and its optimizer: one training step at a time.
pub(crate) struct Run<'a> {
    net: &'a Net,
    input: &'a Input,
    stepper: Stepper,
    /// The forward's autocast policy, if any.
    policy: Option<AmpPolicy>,
    /// The cast cache's bytes at the end of the last forward.
    cast_cache_bytes: u64,
}

impl Run<'_> {
    /// One training step: forward, backward, optimizer step, `zero_grad(set_to_none)`.
    pub(crate) fn step(&mut self) -> Result<()> {
        let mut loss = None;
        for phase in Phase::ALL {
            self.phase(phase, &mut loss)?;
        }
        Ok(())
    }

    /// Runs one phase; `loss` carries the forward's result to backward, which drops it.
    fn phase(&mut self, phase: Phase, loss: &mut Option<Tensor>) -> Result<()> {
        match phase {
            Phase::Forward => {
                let _autocast = self.policy.as_ref().map(AmpPolicy::enter);
                *loss = Some(self.net.loss(self.input)?);
                self.cast_cache_bytes = autocast_stats().cached_bytes;
            }
            Phase::Backward => {
                let loss = loss.take().context("backward without a loss")?;
                match &mut self.stepper {
                    Stepper::Plain { .. } | Stepper::NoStep { .. } => loss.backward()?,
                    Stepper::InBackward(in_backward) => in_backward.backward(&loss)?,
                    Stepper::Scaled(scaler) => scaler.scale(&loss)?.backward()?,
                }
            }
            Phase::Step => match &mut self.stepper {
                Stepper::Plain { optimizer, clip } => {
                    if let Some(params) = clip {
                        clip_grad_norm_(params, CLIP_MAX_NORM, NormType::L2, false)?;
                    }
                    optimizer.step()?;
                }
                Stepper::Scaled(scaler) => {
                    scaler.step()?;
                    scaler.update()?;
                }
                Stepper::InBackward(_) | Stepper::NoStep { .. } => {}
            },
            Phase::ZeroGrad => match &self.stepper {
                Stepper::Plain { optimizer, .. } | Stepper::NoStep { optimizer } => {
                    optimizer.zero_grad(true)?
                }
                Stepper::Scaled(scaler) => scaler.zero_grad(true)?,
                Stepper::InBackward(_) => {}
            },
        }
        Ok(())
    }

    /// One step with history recorded under phase labels, and the allocated bytes and peak of
    /// each phase (the peak is reset at each boundary, so the step's peak is their maximum).
    fn traced_step(&mut self, probe: &Probe<'_>) -> Result<Traced> {
        let allocator = probe.allocator();
        probe.backend.synchronize()?;
        let requested_before = allocator.memory_stats().requested_bytes.all.current as u64;
        allocator.record_history(Some(HistoryOptions {
            max_entries: 1 << 24,
            record_context: true,
        }));
        let mut phases = Vec::with_capacity(Phase::ALL.len());
        let mut loss = None;
        let mut grads = (HashSet::new(), 0);
        for phase in Phase::ALL {
            let _context = allocator.push_context(phase.label());
            allocator.reset_peak_stats();
            let before = allocator.memory_allocated();
            self.phase(phase, &mut loss)?;
            phases.push(PhaseBytes {
                phase,
                before,
                after: allocator.memory_allocated(),
                peak: allocator.max_memory_allocated(),
            });
            if phase == Phase::Backward {
                grads = gradients(self.net);
            }
        }
        probe.backend.synchronize()?;
        let snapshot = allocator.snapshot();
        allocator.record_history(None);
        let entries = snapshot.device_traces.into_iter().flatten().collect();
        Ok(Traced {
            entries,
            requested_before,
            peak_allocated: phases.iter().map(|p| p.peak).max().unwrap_or(0),
            phases,
            grad_addresses: grads.0,
            grad_bytes: grads.1,
        })
    }
}

/// The buffer addresses of the model's gradients, and their bytes.
fn gradients(net: &Net) -> (HashSet<u64>, u64) {
    let mut addresses = HashSet::new();
    let mut bytes = 0;
    for param in net.parameters() {
        if let Some(grad) = param.grad() {
            addresses.insert(grad.buffer().address());
            bytes += tensor_bytes(&grad);
        }
    }
    (addresses, bytes)
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
