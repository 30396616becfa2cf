//! One training run of a `bench-memory` case from a fresh model and optimizer ([`Training`],
//! [`Run`]): input `rand(batch, 3, size, size)`, loss = `model(x).sum()` (GPT-2: random tokens and
//! Hugging Face's causal-LM loss, [`super::models`]), f32 weights (bf16 for `fwd_bwd_bf16`, whose
//! steps stop after backward, as `fwd_bwd`'s do); a step is forward, backward, optimizer step and
//! `zero_grad(set_to_none)` ([`Phase`]), and the traced step records history under those phase
//! labels and samples the allocated bytes at each boundary ([`PhaseBytes`]).
//!
//! Mixed-precision cases (`adam_bf16`, `adam_fp16`, `adam_inbwd_ckpt_bf16`) run the forward under
//! amp's autocast policy (PyTorch's CUDA lists), `loss = model(x).float().sum()` as the reference
//! script does, and fp16 scales the loss with amp's GradScaler; the bytes autocast's cast cache
//! holds at the end of the forward (the half copies of the weights) are kept for the report.
//!
//! It sits on nn (the models), the technique crates and one backend's caching allocator, reached
//! through [`Probe`]; it knows nothing about the protocol's step counts, reports or files.

use std::collections::HashSet;
use std::sync::Arc;

use anyhow::{Context, Result};
use headroom_amp::{AmpPolicy, Float8Policy, GradScaler, GradScalerConfig};
use headroom_autograd_core::{autocast, autocast_stats, AutocastPolicy, BackendRef, Tensor};
use headroom_caching_allocator::{AllocatorView, HistoryOptions};
use headroom_checkpoint::{
    BlockSelection, CheckpointBlocks, CompressBlocks, OffloadBlocks, OffloadOptions, SplitBlocks,
};
use headroom_hooks::{Clipping, InBackward, InBackwardConfig, DEFAULT_BUCKET_BYTES};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{clip_grad_norm_, NormType, Optimizer};

use super::cases::{BenchOptimizer, Case};
use super::measure::Protocol;
use super::models::{Input, Model, Net};

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

/// A case's model and optimizer, built once: [`Training::run`] trains it on one input.
pub(crate) struct Training {
    pub(crate) net: Net,
    pub(super) optimizer: Box<dyn BenchOptimizer>,
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
            // of the forward instead: there every block is recomputed (and in the case that
            // checkpoints as Hugging Face does).
            let blocks = if let Some(first) = model.checkpointed_blocks {
                CheckpointBlocks {
                    selection: BlockSelection::First(first),
                    options: Default::default(),
                }
            } else if case.checkpoints_the_last_block() {
                CheckpointBlocks::all()
            } else {
                CheckpointBlocks::all_but_last(model.n_blocks())
            };
            net.set_block_runner(Some(Arc::new(blocks)));
        }
        if case == Case::AdamOffload {
            net.set_block_runner(Some(Arc::new(offload_blocks(model.n_blocks()))));
        }
        if case == Case::AdamOffloadCkpt {
            let runner = offload_checkpoint_blocks(model.n_blocks(), model.checkpointed_blocks);
            net.set_block_runner(Some(Arc::new(runner)));
        }
        if case == Case::AdamCkpt8bit {
            net.set_block_runner(Some(Arc::new(CompressBlocks::all())));
        }
        let params = net.parameters();
        let n_params = params.iter().map(Tensor::numel).sum();
        let param_bytes = params.iter().map(tensor_bytes).sum();
        let optimizer = case.optimizer(params, model.stream_budget)?;
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
            let scaler = GradScaler::new(GradScalerConfig::default())?;
            Stepper::Scaled {
                optimizer: self.optimizer.handle(),
                scaler,
            }
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
            policy: self.forward_policy(case)?,
            cast_cache_bytes: 0,
        })
    }

    /// `case`'s forward and loss alone (its autocast, no backward): what was saved is freed
    /// with the loss.
    pub(crate) fn forward_only(&self, input: &Input, case: Case) -> Result<()> {
        let policy = self.forward_policy(case)?;
        let _autocast = policy.map(autocast);
        self.net.loss(input).map(drop)
    }

    /// `case`'s autocast policy for this model, if any: amp's lists in the case's dtype, and for
    /// the fp8 cases every linear but the head in fp8 (amp's `Float8Policy` over those lists).
    pub(crate) fn forward_policy(&self, case: Case) -> Result<Option<Arc<dyn AutocastPolicy>>> {
        let Some(dtype) = case.autocast() else {
            return Ok(None);
        };
        let lists = AmpPolicy::torch_cuda(dtype)?;
        if !case.float8() {
            return Ok(Some(Arc::new(lists)));
        }
        let named = self.net.named_parameters();
        let policy = Float8Policy::new(Some(lists)).with_linears(
            named.iter().map(|(name, tensor)| (name.as_str(), tensor)),
            // Not the head, nor the embeddings (a tied head is the token embedding's weight).
            |name| {
                !["head", "embed", "wte", "wpe"]
                    .iter()
                    .any(|not| name.contains(not))
            },
        );
        Ok(Some(Arc::new(policy)))
    }

    /// Sets every gradient to none (what an interrupted step left behind).
    pub(crate) fn clear_grads(&self) -> Result<()> {
        Ok(self.optimizer.handle().zero_grad(true)?)
    }
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

/// `adam_offload_ckpt`'s runner: the first `recomputed` blocks (default a third of them, 8 of
/// ViT-L/16's 24) checkpointed, the next three quarters of the others offloaded to pinned host
/// memory, the rest kept (checkpoint's [`SplitBlocks`]).
///
/// Under a plain step the peak is at the end of backward, where every gradient is alive: there
/// only the recomputed blocks' saves come back, one block at a time, as under uniform
/// checkpointing. The offloaded blocks come back earlier, one block ahead of backward (their
/// copy, 4.7 ms at ViT-L/16 batch 32, hides behind a block's 7.6 ms of backward; three ahead
/// would add 0.8 GB at the peak), while few gradients exist; the kept ones are freed first. Their
/// copies to the host run behind the later blocks' forward, so they cost little time; each
/// recomputed block costs its forward again. Measured on the H200 (`results/2026-12-04-3730f8f`):
/// 8 recomputed (the default) 5.27 GB at 1.079× of `adam_fused`, 4: 5.36 GB at 1.075×, 12:
/// 5.27 GB at 1.119×, against uniform checkpointing's 5.27 GB at 1.210×.
pub(crate) fn offload_checkpoint_blocks(n_blocks: usize, recomputed: Option<usize>) -> SplitBlocks {
    let recomputed = recomputed.unwrap_or(n_blocks / 3).min(n_blocks);
    let rest = n_blocks - recomputed;
    let offloaded = rest * 3 / 4;
    let checkpoint = CheckpointBlocks {
        selection: BlockSelection::First(recomputed),
        options: Default::default(),
    };
    let offload = OffloadBlocks {
        selection: BlockSelection::Indices((recomputed..recomputed + offloaded).collect()),
        options: OffloadOptions {
            release_after_blocks: (rest - offloaded).saturating_sub(1),
            prefetch_blocks: 1,
            ..OffloadOptions::default()
        },
    };
    SplitBlocks {
        split: recomputed,
        first: Arc::new(checkpoint),
        rest: Arc::new(offload),
    }
}

/// One training step of `net` with the optimizer stepped after backward.
pub(super) fn plain_step(net: &Net, input: &Input, optimizer: &dyn BenchOptimizer) -> Result<()> {
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
pub(super) struct Traced {
    pub(super) entries: Vec<headroom_caching_allocator::TraceEntry>,
    pub(super) requested_before: u64,
    pub(super) peak_allocated: u64,
    pub(super) phases: Vec<PhaseBytes>,
    pub(super) grad_addresses: HashSet<u64>,
    pub(super) grad_bytes: u64,
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
    /// A GradScaler: backward of the scaled loss, then its step of the optimizer and update.
    Scaled {
        optimizer: Box<dyn Optimizer>,
        scaler: GradScaler,
    },
}

/// A model, its input and its optimizer: one training step at a time.
pub(crate) struct Run<'a> {
    net: &'a Net,
    input: &'a Input,
    stepper: Stepper,
    /// The forward's autocast policy, if any.
    policy: Option<Arc<dyn AutocastPolicy>>,
    /// The cast cache's bytes at the end of the last forward.
    pub(super) cast_cache_bytes: u64,
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
                let _autocast = self.policy.clone().map(autocast);
                *loss = Some(self.net.loss(self.input)?);
                self.cast_cache_bytes = autocast_stats().cached_bytes;
            }
            Phase::Backward => {
                let loss = loss.take().context("backward without a loss")?;
                match &mut self.stepper {
                    Stepper::Plain { .. } | Stepper::NoStep { .. } => loss.backward()?,
                    Stepper::InBackward(in_backward) => in_backward.backward(&loss)?,
                    Stepper::Scaled { scaler, .. } => scaler.scale(&loss)?.backward()?,
                }
            }
            Phase::Step => match &mut self.stepper {
                Stepper::Plain { optimizer, clip } => {
                    if let Some(params) = clip {
                        clip_grad_norm_(params, CLIP_MAX_NORM, NormType::L2, false)?;
                    }
                    optimizer.step()?;
                }
                Stepper::Scaled { optimizer, scaler } => {
                    scaler.step(optimizer.as_mut())?;
                    scaler.update()?;
                }
                Stepper::InBackward(_) | Stepper::NoStep { .. } => {}
            },
            Phase::ZeroGrad => match &self.stepper {
                Stepper::Plain { optimizer, .. } | Stepper::NoStep { optimizer } => {
                    optimizer.zero_grad(true)?
                }
                Stepper::Scaled { optimizer, .. } => optimizer.zero_grad(true)?,
                Stepper::InBackward(_) => {}
            },
        }
        Ok(())
    }

    /// One step with history recorded under phase labels, and the allocated bytes and peak of
    /// each phase (the peak is reset at each boundary, so the step's peak is their maximum).
    pub(super) fn traced_step(&mut self, probe: &Probe<'_>) -> Result<Traced> {
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
