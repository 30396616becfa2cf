//! `checkpoint`: run a region now, keep (almost) nothing it saves, rebuild it in backward.
//!
//! Non-reentrant, through saved-tensor hooks, as PyTorch's `use_reentrant=False`: the region
//! runs once with grad mode as it is, building the ordinary graph, while a pack hook replaces
//! every tensor an op saves by a small holder (or keeps it, where the [`SavePolicy`] says
//! [`Decision::Save`]). The region's inputs are saved the ordinary way — so they need not
//! require grad, and an outer checkpoint drops them too (nesting). The first time backward
//! unpacks a dropped tensor, the region runs again on its inputs, with grad mode on, the forward's
//! autocast policy and the forward's random draws replayed (dropout masks equal), and the
//! rebuilt tensors fill the holders; the run stops as soon as the last tensor still needed is
//! rebuilt (early stop), and each rebuilt tensor is released after its single use. A rebuilt
//! tensor unlike the forward's at the same position (op, role, shape, dtype), too few saves, or
//! other random draws are typed errors, never silently wrong gradients; so is a region that
//! writes its inputs in place.
//!
//! This module sits on autograd-core's seams (saved-tensor hooks and their `SaveSite`, grad mode,
//! the autocast scope, draw recording); it knows no kernel, no device and no model.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use headroom_autograd_core::{
    autocast, autocast_disabled, autocast_policy, is_grad_enabled, record_draws, replay_draws,
    saved_tensor_hooks, set_grad_enabled, AutocastPolicy, DType, Packed, RecordedDraws, SaveRole,
    SaveSite, SavedTensor, Tensor, TensorError,
};

use crate::error::CheckpointError;
use crate::policy::{Decision, RecomputeAll, SavePolicy};

/// A checkpointed region: inputs to outputs, callable again in backward.
pub type Region = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>, TensorError> + Send + Sync;

/// How [`checkpoint_with`] treats a region.
#[derive(Debug, Clone)]
pub struct CheckpointOptions {
    /// Which saved tensors are kept and which are recomputed.
    pub policy: Arc<dyn SavePolicy>,
    /// Replay the forward's random draws on recompute (dropout masks equal the forward's).
    pub preserve_rng: bool,
    /// Stop the recomputation once the last tensor backward still needs is rebuilt.
    pub early_stop: bool,
    /// Check that each rebuilt tensor has the forward's op, role, shape and dtype.
    pub determinism_check: bool,
}

impl Default for CheckpointOptions {
    /// Recompute everything, preserve RNG, stop early, check: PyTorch's non-reentrant defaults.
    fn default() -> Self {
        CheckpointOptions {
            policy: Arc::new(RecomputeAll),
            preserve_rng: true,
            early_stop: true,
            determinism_check: true,
        }
    }
}

/// Runs `region` on `inputs`, keeping only its inputs for backward and recomputing what it saved
/// when backward needs it (PyTorch's `checkpoint(fn, *inputs, use_reentrant=False)`), with the
/// default [`CheckpointOptions`].
///
/// ```
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_checkpoint::checkpoint;
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let x = Tensor::from_f64s(&cpu, &[0.5, 1.0, 2.0], &[3], DType::F64)?;
/// x.requires_grad_(true)?;
/// let y = checkpoint(|xs| Ok(vec![xs[0].exp()?.tanh()?]), &[x.clone()])?;
/// y[0].sum_all()?.backward()?;
/// let expected: Vec<f64> = [0.5f64, 1.0, 2.0]
///     .iter()
///     .map(|v| (1.0 - v.exp().tanh().powi(2)) * v.exp())
///     .collect();
/// let grad = x.grad().unwrap().to_vec_f64()?;
/// assert!(grad.iter().zip(&expected).all(|(g, e)| (g - e).abs() < 1e-12));
/// # Ok::<(), headroom_checkpoint::CheckpointError>(())
/// ```
pub fn checkpoint(
    region: impl Fn(&[Tensor]) -> Result<Vec<Tensor>, TensorError> + Send + Sync + 'static,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>, CheckpointError> {
    checkpoint_with(region, inputs, &CheckpointOptions::default())
}

/// [`checkpoint`] with explicit options (a selective policy, RNG, early stop, checks).
pub fn checkpoint_with(
    region: impl Fn(&[Tensor]) -> Result<Vec<Tensor>, TensorError> + Send + Sync + 'static,
    inputs: &[Tensor],
    options: &CheckpointOptions,
) -> Result<Vec<Tensor>, CheckpointError> {
    if !is_grad_enabled() {
        return region(inputs).map_err(CheckpointError::from_engine);
    }
    let frame = Arc::new(Frame::new(Box::new(region), inputs, options)?);
    let versions: Vec<u64> = inputs.iter().map(Tensor::version).collect();
    let recording = options.preserve_rng.then(record_draws);
    let outputs = {
        let packing = Arc::clone(&frame);
        let _hooks = saved_tensor_hooks(move |site, tensor| Ok(packing.pack(site, tensor)), unpack);
        (frame.region)(inputs)
    };
    if let Some(recording) = recording {
        *frame.draws.lock() = recording.finish();
    }
    let outputs = outputs.map_err(CheckpointError::from_engine)?;
    for (input, (tensor, version)) in inputs.iter().zip(versions).enumerate() {
        if tensor.version() != version {
            return Err(CheckpointError::RegionWritesInput { input });
        }
    }
    Ok(outputs)
}

/// What a checkpointed region keeps between its forward and its backward.
struct Frame {
    region: Box<Region>,
    /// The inputs, saved like any op's (an outer checkpoint may drop them too).
    inputs: Vec<SavedTensor>,
    input_requires_grad: Vec<bool>,
    autocast: Option<Arc<dyn AutocastPolicy>>,
    options: CheckpointOptions,
    draws: Mutex<RecordedDraws>,
    saves: Mutex<Vec<SaveRecord>>,
}

/// One tensor the region saved, as the forward saw it.
struct SaveRecord {
    op: &'static str,
    role: SaveRole,
    shape: Vec<usize>,
    dtype: DType,
    decision: Decision,
    /// Whether its holder still exists (backward has not used and released it).
    alive: bool,
    /// Rebuilt by a recomputation and not used yet.
    rebuilt: Option<Tensor>,
}

/// What a saved tensor became: the tensor itself when kept, else a place in its frame.
struct Holder {
    frame: Arc<Frame>,
    index: usize,
    kept: Option<Tensor>,
}

impl Drop for Holder {
    fn drop(&mut self) {
        let mut saves = self.frame.saves.lock();
        let record = &mut saves[self.index];
        record.alive = false;
        record.rebuilt = None;
    }
}

/// Ends a recomputation early: carried through the region as its error and caught.
#[derive(Debug)]
struct StopRecompute;

impl std::fmt::Display for StopRecompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("every tensor backward needs is rebuilt")
    }
}

impl std::error::Error for StopRecompute {}

fn unpack(packed: &Packed) -> Result<Tensor, TensorError> {
    let holder = packed
        .downcast_ref::<Holder>()
        .expect("checkpoint's hooks unpack only what they packed");
    match &holder.kept {
        Some(kept) => Ok(kept.clone()),
        None => holder
            .frame
            .take_rebuilt(holder.index)
            .map_err(CheckpointError::into_tensor_error),
    }
}

impl Frame {
    fn new(
        region: Box<Region>,
        inputs: &[Tensor],
        options: &CheckpointOptions,
    ) -> Result<Frame, CheckpointError> {
        let saved = inputs
            .iter()
            .enumerate()
            .map(|(i, input)| SavedTensor::save("checkpoint", SaveRole::Input(i), input))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Frame {
            region,
            inputs: saved,
            input_requires_grad: inputs.iter().map(Tensor::requires_grad).collect(),
            autocast: autocast_policy(),
            options: options.clone(),
            draws: Mutex::new(RecordedDraws::default()),
            saves: Mutex::new(Vec::new()),
        })
    }

    /// The forward's pack hook.
    fn pack(self: &Arc<Self>, site: &SaveSite, tensor: Tensor) -> Packed {
        let mut saves = self.saves.lock();
        let mut earlier = saves.iter().map(|record| (record.op, record.role));
        let decision = self.options.policy.decide_in_region(site, &mut earlier);
        let index = saves.len();
        saves.push(SaveRecord {
            op: site.op,
            role: site.role,
            shape: site.shape.to_vec(),
            dtype: site.dtype,
            decision,
            alive: true,
            rebuilt: None,
        });
        Box::new(Holder {
            frame: Arc::clone(self),
            index,
            kept: (decision == Decision::Save).then_some(tensor),
        })
    }

    /// Save `index`, rebuilt (running the region again if it is not rebuilt yet).
    fn take_rebuilt(self: &Arc<Self>, index: usize) -> Result<Tensor, CheckpointError> {
        if let Some(tensor) = self.saves.lock()[index].rebuilt.take() {
            return Ok(tensor);
        }
        self.recompute()?;
        let rebuilt = self.saves.lock()[index].rebuilt.take();
        rebuilt.ok_or_else(|| CheckpointError::SaveCount {
            expected: self.saves.lock().len(),
            got: index,
        })
    }

    /// Runs the region again and rebuilds every dropped save backward still holds.
    fn recompute(self: &Arc<Self>) -> Result<(), CheckpointError> {
        let (last_needed, n_saves) = {
            let saves = self.saves.lock();
            let needed = saves.iter().rposition(|record| {
                record.decision == Decision::Recompute && record.alive && record.rebuilt.is_none()
            });
            (needed, saves.len())
        };
        let Some(last_needed) = last_needed else {
            return Ok(());
        };
        let inputs = self.rebuilt_inputs()?;
        let _grad_mode = set_grad_enabled(true);
        let _autocast = match &self.autocast {
            Some(policy) => autocast(Arc::clone(policy)),
            None => autocast_disabled(),
        };
        let draws = self.draws.lock().clone();
        let replay = self.options.preserve_rng.then(|| replay_draws(&draws));
        let n_rebuilt = Arc::new(AtomicUsize::new(0));
        let outcome = {
            let frame = Arc::clone(self);
            let counter = Arc::clone(&n_rebuilt);
            let _hooks = saved_tensor_hooks(
                move |site, tensor| frame.repack(&counter, site, tensor, last_needed),
                |_| {
                    Err(TensorError::Autograd {
                        op: "checkpoint",
                        reason: "a recomputation's own graph is never differentiated".into(),
                    })
                },
            );
            (self.region)(&inputs)
        };
        let faithful = replay.is_none_or(|replay| replay.finish());
        match outcome {
            Err(err) if err.hook_source::<StopRecompute>().is_some() => {}
            Err(err) => return Err(CheckpointError::from_engine(err)),
            Ok(_) => {
                let got = n_rebuilt.load(Ordering::SeqCst);
                if got < n_saves && self.options.determinism_check {
                    return Err(CheckpointError::SaveCount {
                        expected: n_saves,
                        got,
                    });
                }
            }
        }
        if !faithful {
            return Err(CheckpointError::RandomDrawsDiffer);
        }
        Ok(())
    }

    /// The region's inputs for a recomputation: detached, requiring grad as they did.
    fn rebuilt_inputs(&self) -> Result<Vec<Tensor>, CheckpointError> {
        let mut res = Vec::with_capacity(self.inputs.len());
        for (input, (saved, requires_grad)) in self
            .inputs
            .iter()
            .zip(&self.input_requires_grad)
            .enumerate()
        {
            let tensor = saved.unpack().map_err(|err| match err {
                TensorError::ModifiedInPlace {
                    saved_version,
                    current_version,
                    ..
                } => CheckpointError::InputModified {
                    input,
                    saved: saved_version,
                    current: current_version,
                },
                other => CheckpointError::from_engine(other),
            })?;
            let detached = tensor.detach();
            if *requires_grad && detached.dtype().is_float() {
                detached.requires_grad_(true)?;
            }
            res.push(detached);
        }
        Ok(res)
    }

    /// The recomputation's pack hook: fills the holders still waiting, checks the rest, and
    /// stops the run after save `last_needed`.
    fn repack(
        &self,
        counter: &AtomicUsize,
        site: &SaveSite,
        tensor: Tensor,
        last_needed: usize,
    ) -> Result<Packed, TensorError> {
        let index = counter.fetch_add(1, Ordering::SeqCst);
        {
            let mut saves = self.saves.lock();
            let n_saves = saves.len();
            let Some(record) = saves.get_mut(index) else {
                let err = CheckpointError::SaveCount {
                    expected: n_saves,
                    got: index + 1,
                };
                return Err(err.into_tensor_error());
            };
            let same = record.op == site.op
                && record.role == site.role
                && record.shape == site.shape.as_slice()
                && record.dtype == site.dtype;
            if self.options.determinism_check && !same {
                let err = CheckpointError::Nondeterministic {
                    index,
                    op: record.op,
                    shape: record.shape.clone(),
                    dtype: record.dtype,
                    got_op: site.op,
                    got_shape: site.shape.to_vec(),
                    got_dtype: site.dtype,
                };
                return Err(err.into_tensor_error());
            }
            if record.decision == Decision::Recompute && record.alive && record.rebuilt.is_none() {
                record.rebuilt = Some(tensor);
            }
        }
        if self.options.early_stop && index == last_needed {
            return Err(TensorError::hook("checkpoint", StopRecompute));
        }
        Ok(Box::new(()))
    }
}
