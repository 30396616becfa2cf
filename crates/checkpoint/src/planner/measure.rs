//! Measuring one training step per candidate strategy, block by block.
//!
//! A [`BlockPlanner`] owns a dispatching block runner: set [`BlockPlanner::runner`] as the model's
//! block runner once, then [`BlockPlanner::profile`] runs the caller's training step (forward,
//! backward, optimizer step) once per [`Candidate`] to warm it up (what a strategy allocates on
//! first use: offload's pinned pool, a kernel module, a library's workspace), then, for each of
//! [`BlockPlanner::measured_steps`] rounds, once per candidate with every block under that
//! candidate (the candidates alternate, so a drift of the machine's speed falls on all of them
//! alike). During a measured step the runner marks the start of each block's forward, and a
//! gradient hook on each block's output marks the start of its backward (the hook runs when
//! backward reaches the block's last op). Each mark reads the probe: allocated bytes, the peak
//! since the previous mark, and a point in time. The stretch between two marks is a
//! [`Segment`]; it belongs to the block whose mark opens it, so a block's forward segment runs
//! until the next block starts (for the last block: through the model's head, the loss and the
//! head's backward, until its own backward starts), and its backward segment until the block
//! before it starts its backward (for the first block: through the stem's backward and the
//! optimizer step, to the end of the step). Over the rounds, a segment's time is the median of
//! its times, its peak the highest of its peaks, and its delta the first round's (the allocator
//! counts what a step holds, the same every step for the strategies here).
//!
//! This module sits on nn's block seam, autograd-core's gradient hooks and the probe; it knows no
//! particular model or device. The candidates it names ([`Candidate::keep`],
//! [`Candidate::recompute`], [`Candidate::compress`], [`Candidate::float8`],
//! [`Candidate::offload`]) are the crate's block
//! runners, configured so that each keeps the consequences of its choice inside its own block.

use std::sync::Arc;

use parking_lot::Mutex;

use headroom_autograd_core::{is_grad_enabled, Float8Recipe, Tensor};
use headroom_nn::{BlockForward, BlockRunner};

use crate::blocks::{BlockSelection, CheckpointBlocks};
use crate::compress::{CompressBlocks, CompressOptions, Compression};
use crate::error::CheckpointError;
use crate::float8_blocks::Float8Blocks;
use crate::offload::{OffloadBlocks, OffloadOptions, OffloadPool};
use crate::planner::probe::{StepProbe, TimePoint};
use crate::planner::profile::{BlockCost, Segment, StepProfile};
use crate::policy::RecomputeBefore;
use crate::region::CheckpointOptions;

/// One way of running a block, as the planner sees it: a name for its tables and an nn
/// [`BlockRunner`] that runs every block it is given that way.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The name in plans and tables ("keep", "recompute", ...).
    pub name: String,
    /// Runs a block this way.
    pub runner: Arc<dyn BlockRunner>,
    /// Whether training under it differs from plain training (compression does; keep, recompute
    /// and offload do not). [`StepProfile::plan`] takes a lossy candidate only where no plan of
    /// the exact ones fits the budget or it makes the step clearly faster
    /// ([`LOSSY_MIN_GAIN`](crate::LOSSY_MIN_GAIN)), and its plan says which.
    pub lossy: bool,
}

impl Candidate {
    /// An exact candidate named `name` that runs blocks through `runner` (set
    /// [`Candidate::lossy`] for one that changes the gradients).
    pub fn new(name: impl Into<String>, runner: Arc<dyn BlockRunner>) -> Candidate {
        Candidate {
            name: name.into(),
            runner,
            lossy: false,
        }
    }

    /// `keep`: the block is called directly; what its ops save stays until backward.
    pub fn keep() -> Candidate {
        Candidate::new("keep", Arc::new(RunDirectly))
    }

    /// `keep-intermediates`: the block is called directly inside
    /// [`keep_intermediates`](headroom_autograd_core::keep_intermediates), so the fused ops
    /// that would run a cheap op again in backward (a norm or a GELU before a linear) keep its
    /// output instead: more memory than `keep`, no recomputation at all.
    pub fn keep_intermediates() -> Candidate {
        Candidate::new("keep-intermediates", Arc::new(KeepIntermediates))
    }

    /// `recompute`: the block is checkpointed ([`CheckpointBlocks::all`]): only its input stays,
    /// the rest is recomputed in backward.
    pub fn recompute() -> Candidate {
        Candidate::new("recompute", Arc::new(CheckpointBlocks::all()))
    }

    /// `recompute-attention`: the block is checkpointed with [`RecomputeBefore::mlp`]: what its
    /// attention half saves is recomputed (its norm, q/k/v product and attention), what its MLP
    /// saves is kept, so it keeps more than `recompute` and less than `keep`, for less
    /// recomputation than `recompute` (a pre-norm block whose MLP starts with a
    /// `layer_norm_linear`, ViT's and GPT-2's; another block recomputes everything under it).
    pub fn recompute_attention() -> Candidate {
        Candidate::new(
            "recompute-attention",
            Arc::new(CheckpointBlocks {
                selection: BlockSelection::All,
                options: CheckpointOptions {
                    policy: Arc::new(RecomputeBefore::mlp()),
                    ..CheckpointOptions::default()
                },
            }),
        )
    }

    /// `compress-int8` or `compress-bf16`: what the block saves for backward is kept encoded
    /// ([`CompressBlocks`] with the default policy: op inputs and outputs of 16 Ki elements or
    /// more, 0.254× of f32 in 8 bits, 0.5× in bf16) and decoded when backward needs it. Lossy
    /// ([`Candidate::lossy`]):
    /// gradients move within the codec's error (see `compress`), so it is not in
    /// [`Candidate::defaults`].
    pub fn compress(compression: Compression) -> Candidate {
        let name = match compression {
            Compression::Int8Blockwise { .. } => "compress-int8",
            Compression::Bf16 => "compress-bf16",
        };
        Candidate {
            lossy: true,
            ..Candidate::new(
                name,
                Arc::new(CompressBlocks {
                    selection: BlockSelection::All,
                    options: CompressOptions::new(compression),
                    checkpoint: None,
                }),
            )
        }
    }

    /// `fp8`: the block runs with every plain linear in fp8 under `recipe` ([`Float8Blocks`]):
    /// each such linear keeps its input in one byte an element. Lossy ([`Candidate::lossy`]):
    /// the block's products and gradients move within fp8's rounding, so it is not in
    /// [`Candidate::defaults`].
    pub fn float8(recipe: Float8Recipe) -> Candidate {
        Candidate {
            lossy: true,
            ..Candidate::new(
                "fp8",
                Arc::new(Float8Blocks {
                    selection: BlockSelection::All,
                    recipe,
                }),
            )
        }
    }

    /// `offload`: what the block saves goes to `pool`'s pinned host memory
    /// ([`OffloadBlocks`]; CUDA only) and comes back when backward reaches the block.
    ///
    /// Configured so that the block's device memory is its own business, as the planner's
    /// prediction needs: its device memory is given back at the end of its own forward
    /// (`release_after_blocks: 0`: the compute stream waits there for the block's copies, which
    /// overlap the rest of the block's forward) and its copies back start when backward reaches
    /// it (`prefetch_blocks: 0`). A block offloaded this way keeps almost nothing on the device,
    /// and its time is its copies' time beyond what its own compute hides. Its peak inside the
    /// block depends on the copies' timing (a save finding an earlier copy complete gives that
    /// memory back at once), so a prediction with it is as close as two steps' timings are; the
    /// highest of [`BlockPlanner::measured_steps`] rounds is the safe side. Copies that overlap
    /// later blocks (`OffloadBlocks` with `release_after_blocks` > 0, as the `adam_offload`
    /// bench case runs it) hold one block's memory through the next blocks' segments, which no
    /// per-block choice can describe; use them as a whole-model runner instead.
    pub fn offload(pool: OffloadPool) -> Candidate {
        Candidate::new(
            "offload",
            Arc::new(OffloadBlocks {
                selection: BlockSelection::All,
                options: OffloadOptions {
                    release_after_blocks: 0,
                    prefetch_blocks: 0,
                    pool,
                    ..OffloadOptions::default()
                },
            }),
        )
    }

    /// The strategies the planner chooses among by default: [`Candidate::keep`],
    /// [`Candidate::recompute`], [`Candidate::keep_intermediates`] and
    /// [`Candidate::recompute_attention`], all exact (training under any plan of them equals
    /// plain training bit for bit). Another strategy is one more `Candidate::new(name, runner)`.
    pub fn defaults() -> Vec<Candidate> {
        vec![
            Candidate::keep(),
            Candidate::recompute(),
            Candidate::keep_intermediates(),
            Candidate::recompute_attention(),
        ]
    }

    /// The strategies for a model on a CUDA device: [`Candidate::defaults`], then 8-bit
    /// compression ([`Candidate::compress`], lossy), fp8 linears under torchao's tensorwise
    /// recipe ([`Candidate::float8`], lossy; Hopper's fp8 GEMMs) and offload to a new pool
    /// ([`Candidate::offload`]). On another device the offload candidate's step fails with
    /// [`CheckpointError::OffloadNeedsCuda`]; there, use `defaults()`, `compress` and `float8`.
    pub fn cuda_defaults() -> Vec<Candidate> {
        vec![
            Candidate::keep(),
            Candidate::recompute(),
            Candidate::keep_intermediates(),
            Candidate::recompute_attention(),
            Candidate::compress(Compression::default()),
            Candidate::float8(Float8Recipe::TENSORWISE),
            Candidate::offload(OffloadPool::new()),
        ]
    }
}

/// Calls each block directly: the block runner of a model without one.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunDirectly;

impl BlockRunner for RunDirectly {
    fn run(
        &self,
        _index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        block(input)
    }
}

/// Calls each block directly inside
/// [`keep_intermediates`](headroom_autograd_core::keep_intermediates): the fused ops keep the
/// intermediates they would otherwise run again in backward.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeepIntermediates;

impl BlockRunner for KeepIntermediates {
    fn run(
        &self,
        _index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        let _keep = headroom_autograd_core::keep_intermediates();
        block(input)
    }
}

/// The error a training step returns to [`BlockPlanner::profile`].
pub type StepError = Box<dyn std::error::Error + Send + Sync>;

/// Measures a model's training step under each candidate, block by block (see the module's
/// documentation), and gives a [`StepProfile`] to plan from.
///
/// ```
/// use std::sync::Arc;
/// use headroom_autograd_core::{DType, Generator, Tensor};
/// use headroom_checkpoint::{BlockPlanner, Candidate, StepProbe};
/// use headroom_nn::{BlockStack, Module, VisionTransformer, VitConfig};
/// use headroom_ops_cpu::CpuBackend;
///
/// let cpu = Arc::new(CpuBackend::default());
/// let backend: headroom_autograd_core::BackendRef = cpu.clone();
/// let generator = Arc::new(Generator::new(0));
/// let mut vit = VisionTransformer::new(&backend, VitConfig::tiny(), DType::F32, &generator)?;
/// let images = Tensor::ones(&backend, &[4, 3, 32, 32], DType::F32)?;
///
/// let probe = StepProbe::host(cpu.clone());
/// let planner = BlockPlanner::new(probe, Candidate::defaults());
/// vit.set_block_runner(Some(planner.runner()));
/// let profile = planner.profile(|| {
///     vit.forward(&images)?.sum_all()?.backward()?;
///     for p in vit.parameters() {
///         p.zero_grad(true)?; // where the optimizer's step and zero_grad go
///     }
///     Ok(())
/// })?;
/// let budget = (profile.min_budget()? + profile.predict(&[0; 2])?.peak_bytes) / 2;
/// let plan = profile.plan(budget)?;
/// assert!(plan.predicted_peak() <= budget);
/// println!("{plan}");
/// vit.set_block_runner(Some(Arc::new(plan)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct BlockPlanner {
    probe: StepProbe,
    candidates: Vec<Candidate>,
    dispatch: Arc<Dispatch>,
    rounds: usize,
}

impl BlockPlanner {
    /// A planner that reads `probe` and chooses among `candidates` (at least one; the first runs
    /// the warm-up step and every block while the planner is not measuring).
    pub fn new(probe: StepProbe, candidates: Vec<Candidate>) -> BlockPlanner {
        let dispatch = Arc::new(Dispatch {
            probe: probe.clone(),
            state: Mutex::new(DispatchState {
                candidate: candidates.first().map(|c| Arc::clone(&c.runner)),
                recording: None,
            }),
        });
        BlockPlanner {
            probe,
            candidates,
            dispatch,
            rounds: 1,
        }
    }

    /// Measures `rounds` steps per candidate (at least 1; 1 unless set), alternating the
    /// candidates: each segment's time is then the median of its times, which a slow step (a
    /// clock boost ending, another process) does not move.
    pub fn measured_steps(mut self, rounds: usize) -> BlockPlanner {
        self.rounds = rounds.max(1);
        self
    }

    /// The candidates, in the order plans number them.
    pub fn candidates(&self) -> &[Candidate] {
        &self.candidates
    }

    /// The block runner to set on the model before [`BlockPlanner::profile`]
    /// ([`BlockStack::set_block_runner`](headroom_nn::BlockStack::set_block_runner)). Outside a
    /// measurement it runs every block as the first candidate does.
    pub fn runner(&self) -> Arc<dyn BlockRunner> {
        Arc::clone(&self.dispatch) as Arc<dyn BlockRunner>
    }

    /// Runs `step` (one forward, backward and optimizer step of the model whose block runner is
    /// [`BlockPlanner::runner`]) once per candidate to warm up (the optimizer's state, the
    /// libraries' workspaces, what a candidate allocates on first use), then
    /// [`BlockPlanner::measured_steps`] times per candidate, alternating, with every block under
    /// it, measuring each block's forward and backward.
    ///
    /// Errors: the step's own error ([`CheckpointError::Step`]); a step whose blocks did not
    /// run through the planner's runner, or ran in another order than forward then backward
    /// in reverse ([`CheckpointError::Profile`]).
    pub fn profile(
        &self,
        mut step: impl FnMut() -> Result<(), StepError>,
    ) -> Result<StepProfile, CheckpointError> {
        let Some(first) = self.candidates.first() else {
            return Err(CheckpointError::Profile {
                reason: "no candidate strategies to choose among; give at least one (for \
                         example Candidate::defaults())"
                    .into(),
            });
        };
        for candidate in &self.candidates {
            self.dispatch.select(&candidate.runner, None);
            let warmed = step().map_err(CheckpointError::Step);
            self.dispatch.select(&first.runner, None);
            warmed?;
        }
        // Per candidate, per round: the blocks' costs.
        let mut measured: Vec<Vec<Vec<BlockCost>>> = vec![Vec::new(); self.candidates.len()];
        let mut start_bytes = 0;
        let mut pre = Segment::default();
        for round in 0..self.rounds {
            for (index, candidate) in self.candidates.iter().enumerate() {
                let recording = Arc::new(Recording::default());
                self.dispatch
                    .select(&candidate.runner, Some(Arc::clone(&recording)));
                let outcome = self.measure(&recording, &mut step);
                self.dispatch.select(&first.runner, None);
                let marks = outcome?;
                let (start, step_pre, blocks) = segments(&self.probe, &candidate.name, &marks)?;
                if round == 0 && index == 0 {
                    (start_bytes, pre) = (start, step_pre);
                }
                measured[index].push(blocks);
            }
        }
        let n_blocks = measured[0][0].len();
        if let Some((name, blocks)) = self
            .candidates
            .iter()
            .zip(&measured)
            .flat_map(|(candidate, rounds)| rounds.iter().map(move |r| (candidate, r)))
            .find(|(_, blocks)| blocks.len() != n_blocks)
        {
            return Err(CheckpointError::Profile {
                reason: format!(
                    "the step ran {n_blocks} blocks under `{}` but {} under `{}`; every \
                     measured step must run the same model",
                    self.candidates[0].name,
                    blocks.len(),
                    name.name
                ),
            });
        }
        let per_candidate: Vec<Vec<BlockCost>> = measured
            .iter()
            .map(|rounds| (0..n_blocks).map(|block| combine(rounds, block)).collect())
            .collect();
        let blocks = (0..n_blocks)
            .map(|block| per_candidate.iter().map(|costs| costs[block]).collect())
            .collect();
        Ok(StepProfile {
            candidates: self.candidates.clone(),
            start_bytes,
            pre,
            blocks,
        })
    }

    /// One measured step: a mark before, the runner's and hooks' marks during, one after.
    fn measure(
        &self,
        recording: &Arc<Recording>,
        step: &mut impl FnMut() -> Result<(), StepError>,
    ) -> Result<Vec<Mark>, CheckpointError> {
        recording.mark(&self.probe, MarkKind::StepStart)?;
        step().map_err(CheckpointError::Step)?;
        recording.mark(&self.probe, MarkKind::StepEnd)?;
        if let Some(err) = recording.error.lock().take() {
            return Err(err);
        }
        Ok(std::mem::take(&mut *recording.marks.lock()))
    }
}

/// What opens a segment of a measured step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MarkKind {
    StepStart,
    ForwardStart(usize),
    BackwardStart(usize),
    StepEnd,
}

/// One reading of the probe.
#[derive(Debug)]
struct Mark {
    kind: MarkKind,
    /// Allocated bytes at the mark.
    allocated: u64,
    /// The peak since the previous mark.
    peak_before: u64,
    time: TimePoint,
}

/// The marks of the step being measured.
#[derive(Debug, Default)]
struct Recording {
    marks: Mutex<Vec<Mark>>,
    /// The first error a hook met (a hook's own error would abort the user's backward).
    error: Mutex<Option<CheckpointError>>,
}

impl Recording {
    fn mark(&self, probe: &StepProbe, kind: MarkKind) -> Result<(), CheckpointError> {
        let peak_before = probe.memory.take_peak();
        let allocated = probe.memory.allocated();
        let time = probe.clock.now()?;
        self.marks.lock().push(Mark {
            kind,
            allocated,
            peak_before,
            time,
        });
        Ok(())
    }
}

/// The planner's block runner: the selected candidate, with marks while measuring.
#[derive(Debug)]
struct Dispatch {
    probe: StepProbe,
    state: Mutex<DispatchState>,
}

#[derive(Debug)]
struct DispatchState {
    candidate: Option<Arc<dyn BlockRunner>>,
    recording: Option<Arc<Recording>>,
}

impl Dispatch {
    fn select(&self, runner: &Arc<dyn BlockRunner>, recording: Option<Arc<Recording>>) {
        let mut state = self.state.lock();
        state.candidate = Some(Arc::clone(runner));
        state.recording = recording;
    }
}

impl BlockRunner for Dispatch {
    fn run(
        &self,
        index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        let (candidate, recording) = {
            let state = self.state.lock();
            (state.candidate.clone(), state.recording.clone())
        };
        let Some(candidate) = candidate else {
            return block(input);
        };
        let Some(recording) = recording.filter(|_| is_grad_enabled()) else {
            return candidate.run(index, block, input);
        };
        recording
            .mark(&self.probe, MarkKind::ForwardStart(index))
            .map_err(CheckpointError::into_nn_error)?;
        let output = candidate.run(index, block, input)?;
        if output.requires_grad() {
            let probe = self.probe.clone();
            let hook_recording = Arc::clone(&recording);
            output.register_hook(move |_grad| {
                if let Err(err) = hook_recording.mark(&probe, MarkKind::BackwardStart(index)) {
                    hook_recording.error.lock().get_or_insert(err);
                }
                Ok(None)
            })?;
        }
        Ok(output)
    }
}

/// A measured step's marks as the bytes allocated when it started, the segment before the first
/// block, and each block's forward and backward segments. The marks must be: the step's start,
/// every block's forward start in order 0, 1, …, n − 1, every block's backward start in order
/// n − 1, …, 0, the step's end.
fn segments(
    probe: &StepProbe,
    candidate: &str,
    marks: &[Mark],
) -> Result<(u64, Segment, Vec<BlockCost>), CheckpointError> {
    let n_blocks = marks
        .iter()
        .filter(|m| matches!(m.kind, MarkKind::ForwardStart(_)))
        .count();
    let expected: Vec<MarkKind> = std::iter::once(MarkKind::StepStart)
        .chain((0..n_blocks).map(MarkKind::ForwardStart))
        .chain((0..n_blocks).rev().map(MarkKind::BackwardStart))
        .chain(std::iter::once(MarkKind::StepEnd))
        .collect();
    let got: Vec<MarkKind> = marks.iter().map(|m| m.kind).collect();
    if n_blocks == 0 || got != expected {
        let reason = if n_blocks == 0 {
            format!(
                "no block ran through the planner's runner in the step under `{candidate}`: set \
                 BlockPlanner::runner() as the model's block runner, and run the forward with \
                 grad mode on"
            )
        } else {
            format!(
                "the step under `{candidate}` ran its blocks as {got:?}; the planner needs each \
                 block's forward once, in order, then each block's backward in reverse order \
                 (one forward and one backward per step, every block's output used by the loss)"
            )
        };
        return Err(CheckpointError::Profile { reason });
    }
    let segment = |k: usize| -> Result<Segment, CheckpointError> {
        let (open, close) = (&marks[k], &marks[k + 1]);
        Ok(Segment {
            peak: close.peak_before.saturating_sub(open.allocated),
            delta: close.allocated as i64 - open.allocated as i64,
            ms: probe.clock.elapsed_ms(&open.time, &close.time)?,
        })
    };
    let blocks = (0..n_blocks)
        .map(|block| {
            Ok(BlockCost {
                forward: segment(1 + block)?,
                backward: segment(2 * n_blocks - block)?,
            })
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    Ok((marks[0].allocated, segment(0)?, blocks))
}

/// Block `block`'s cost over the rounds: the first round's deltas, the highest peaks and the
/// median times.
fn combine(rounds: &[Vec<BlockCost>], block: usize) -> BlockCost {
    let first = rounds[0][block];
    let segment = |pick: fn(&BlockCost) -> &Segment| Segment {
        peak: rounds
            .iter()
            .map(|r| pick(&r[block]).peak)
            .max()
            .unwrap_or(0),
        delta: pick(&first).delta,
        ms: median(rounds.iter().map(|r| pick(&r[block]).ms).collect()),
    };
    BlockCost {
        forward: segment(|cost| &cost.forward),
        backward: segment(|cost| &cost.backward),
    }
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}
