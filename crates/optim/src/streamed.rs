//! [`StreamedOptimizer`]: any rule's [`GroupOptimizer`] whose per-parameter state lives in
//! pinned host memory between steps and streams through the GPU, which steps it with the rule's
//! own CUDA kernels — so the result is the on-device optimizer's bit for bit, and the GPU holds
//! only the state of the buckets being stepped or prefetched. With the 4-bit rule
//! ([`Adam4bitConfig`](crate::kernels::Adam4bitConfig)) that is about 1.06 bytes of host memory
//! a parameter, and on the GPU only what the stream budget lets in ahead (the next step's first
//! buckets are prefetched at the end of a step): the largest-model recipe of a bf16 model with no
//! master copy.
//!
//! A step of some parameters (an in-backward bucket: hooks' `InBackward` calls
//! [`Optimizer::step_with`] with `StepParams::Only` as gradients become final) brings their states
//! in (prefetched during the forward and the earlier buckets, in the last step's bucket order, as
//! far ahead as the stream budget allows), puts them into the inner optimizer, steps it, takes
//! them out again and sends them back on a side stream; [`Optimizer::finish_steps`] ends the
//! step and starts the next step's first copies in. `StepParams::All` steps the parameters in
//! runs of at most the budget's bytes (their parameters' bytes before their first step), so the
//! GPU never holds every state at once. The copies, streams and budget are `cuda/state_stream.rs`'s,
//! which [`OffloadedAdam`](crate::OffloadedAdam)'s device stepper shares.
//!
//! On the CPU backend (or without the `cuda` feature) the state is in host memory already, and
//! the optimizer steps as the inner one does.
//!
//! A state dict reads the states from host memory (no trip through the GPU) under the inner
//! optimizer's names, so it loads into the same rule's plain optimizer and back; a load builds
//! each state on the device, checked by the rule, and copies it to host memory.
//!
//! It sits on the [`Optimizer`] trait, the group optimizer's slot table and state dict, and
//! with `cuda` on `cuda/state_stream.rs`; it knows no rule and no hook.

#[cfg(feature = "cuda")]
use std::borrow::Cow;

use headroom_autograd_core::{Device, Tensor};
#[cfg(feature = "cuda")]
use parking_lot::Mutex;

use crate::error::OptimError;
use crate::kernels::StepOutcome;
use crate::optimizer::{GroupOptimizer, Optimizer, ParamGroup};
use crate::rule::UpdateRule;
use crate::step::{Implementation, ParamId, Scaling, StepParams};

/// [`StreamedOptimizer`]'s default stream budget: 1 GiB of state coming in (and as much going
/// back) beyond the bucket being stepped.
pub const DEFAULT_STATE_STREAM_BYTES: u64 = 1 << 30;

/// A [`GroupOptimizer`] whose state lives in pinned host memory between steps (see the module
/// docs).
///
/// ```
/// use headroom_autograd_core::Tensor;
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::kernels::Adam4bitConfig;
/// use headroom_optim::{
///     Implementation, Optimizer, ParamGroup, StreamedOptimizer, DEFAULT_STATE_STREAM_BYTES,
/// };
///
/// let cpu = CpuBackend::new_ref();
/// let w = Tensor::from_slice(&cpu, &vec![0.5f32; 4096], &[4096])?;
/// w.requires_grad_(true)?;
/// let mut adam = StreamedOptimizer::new(
///     vec![ParamGroup::new(vec![w.clone()], Adam4bitConfig::adamw())],
///     Implementation::Fused,
///     DEFAULT_STATE_STREAM_BYTES,
/// )?;
/// w.mul(&w)?.sum_all()?.backward()?;
/// adam.step()?;
/// assert!(w.to_vec::<f32>()?[0] < 0.5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct StreamedOptimizer<R: UpdateRule> {
    inner: GroupOptimizer<R>,
    /// The states' stream on a CUDA device; `None` on the CPU.
    #[cfg(feature = "cuda")]
    stream: Mutex<Option<crate::cuda::state_stream::StateStream>>,
    /// Bytes of state a run of `StepParams::All` brings in at once.
    stream_bytes: u64,
}

impl<R: UpdateRule> std::fmt::Debug for StreamedOptimizer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedOptimizer")
            .field("inner", &self.inner)
            .field("stream_bytes", &self.stream_bytes)
            .field("host_state_bytes", &self.host_state_bytes())
            .finish_non_exhaustive()
    }
}

impl<R: UpdateRule> StreamedOptimizer<R> {
    /// The rule's optimizer over `groups` (as [`GroupOptimizer::new`] checks them), its states
    /// in host memory, the GPU holding at most `stream_bytes` of them coming in and as many going
    /// back beyond the bucket being stepped. More lets the copies in start earlier in the
    /// forward and overlap more of the step, at up to twice that much GPU memory.
    pub fn new(
        groups: Vec<ParamGroup<R>>,
        implementation: Implementation,
        stream_bytes: u64,
    ) -> Result<StreamedOptimizer<R>, OptimError> {
        let inner = GroupOptimizer::new(groups, implementation)?;
        #[cfg(feature = "cuda")]
        let stream = {
            let params = inner.params();
            match params.first() {
                Some((_, first)) if first.device() != Device::Cpu => {
                    Some(crate::cuda::state_stream::StateStream::new(
                        R::NAME,
                        first,
                        params.len(),
                        stream_bytes,
                    )?)
                }
                _ => None,
            }
        };
        #[cfg(not(feature = "cuda"))]
        if let Some((_, first)) = inner.params().first() {
            if first.device() != Device::Cpu {
                return Err(OptimError::UnsupportedTensor {
                    op: R::NAME,
                    reason: format!(
                        "parameters on {:?}; build headroom-optim with its `cuda` feature",
                        first.device()
                    ),
                });
            }
        }
        Ok(StreamedOptimizer {
            inner,
            #[cfg(feature = "cuda")]
            stream: Mutex::new(stream),
            stream_bytes,
        })
    }

    /// The inner optimizer (its groups, configs and steps; its states are in host memory
    /// between steps, so its `param_state` is empty there).
    pub fn inner(&self) -> &GroupOptimizer<R> {
        &self.inner
    }

    /// Bytes of pinned host memory the states hold (0 on the CPU, where they are the inner
    /// optimizer's).
    pub fn host_state_bytes(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &*self.stream.lock() {
            return stream.host_bytes();
        }
        0
    }

    /// Steps `slots` (ascending, of this optimizer) as one bucket: their states come in, the
    /// inner optimizer steps the ones with a gradient, and every state it then holds goes back,
    /// stepped or not, whatever the step returned.
    #[cfg(feature = "cuda")]
    fn step_bucket(
        inner: &mut GroupOptimizer<R>,
        stream: &mut crate::cuda::state_stream::StateStream,
        slots: &[usize],
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        let stepped: Vec<usize> = slots
            .iter()
            .copied()
            .filter(|&slot| inner.slot_param(slot).grad().is_some())
            .collect();
        // Every state comes in (a first one is created and its pinned block reserved) before
        // anything steps: an error here leaves every parameter and state as it was.
        let mut outcome = Ok(StepOutcome::Stepped);
        for &slot in &stepped {
            let prepared = match stream.arrive(slot) {
                Ok(Some(tensors)) => inner.restore_state(slot, tensors),
                Ok(None) => inner
                    .ensure_state(slot)
                    .and_then(|tensors| stream.reserve(slot, &tensors)),
                Err(error) => Err(error),
            };
            if let Err(error) = prepared {
                outcome = Err(error);
                break;
            }
        }
        if outcome.is_ok() {
            let ids: Vec<ParamId> = stepped.iter().map(|&slot| ParamId(slot)).collect();
            outcome = inner.step_with(StepParams::Only(&ids), scaling);
        }
        // Every state the inner optimizer holds goes back, stepped or not; one whose pinned
        // block could not be reserved never stepped and is dropped, as a failed first step
        // forgets its state.
        let mut returned = Ok(());
        for &slot in &stepped {
            if let Some(state) = inner.take_state(slot) {
                if stream.has_host_state(slot) {
                    let departed = stream.depart(slot, R::state_tensors(&state));
                    returned = returned.and(departed);
                }
            }
        }
        stream.end_bucket(stepped)?;
        returned?;
        outcome
    }
}

impl<R: UpdateRule> Optimizer for StreamedOptimizer<R> {
    fn name(&self) -> &'static str {
        R::NAME
    }

    fn n_groups(&self) -> usize {
        self.inner.n_groups()
    }

    fn lr(&self, group: usize) -> f64 {
        self.inner.lr(group)
    }

    fn set_lr(&mut self, group: usize, lr: f64) {
        self.inner.set_lr(group, lr);
    }

    fn params(&self) -> Vec<(ParamId, Tensor)> {
        self.inner.params()
    }

    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        self.inner.param_id(param)
    }

    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &mut *self.stream.lock() {
            let all = matches!(params, StepParams::All);
            let slots = self.inner.selected_slots(params)?;
            let runs: Vec<Vec<usize>> = if all {
                runs_within(&self.inner, stream, &slots, self.stream_bytes)
            } else {
                vec![slots]
            };
            let mut outcome = StepOutcome::Stepped;
            for run in &runs {
                if Self::step_bucket(&mut self.inner, stream, run, scaling)? == StepOutcome::Skipped
                {
                    outcome = StepOutcome::Skipped;
                }
            }
            if all {
                stream.finish()?;
            }
            return Ok(outcome);
        }
        self.inner.step_with(params, scaling)
    }

    fn finish_steps(&mut self) -> Result<(), OptimError> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &mut *self.stream.lock() {
            stream.finish()?;
        }
        self.inner.finish_steps()
    }

    fn takes_device_scaling(&self) -> bool {
        self.inner.takes_device_scaling()
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        self.inner.zero_grad(set_to_none)
    }

    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &mut *self.stream.lock() {
            stream.settle()?;
            let stream = &*stream;
            return self
                .inner
                .save_state_with(|slot, _| stream.host_state(slot));
        }
        self.inner.state_dict()
    }

    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &mut *self.stream.lock() {
            stream.settle()?;
            // Each loaded state is read to host bytes as it loads (the device holds one at a
            // time); the host blocks change only once every slot has loaded.
            let mut loaded: Vec<Option<Vec<crate::optimizer::StateBytes<'static>>>> =
                vec![None; self.inner.params().len()];
            self.inner.load_state_with(bytes, |slot, state| {
                let pieces = R::state_tensors(&state)
                    .into_iter()
                    .map(|(name, tensor)| {
                        let bytes = crate::optimizer::tensor_bytes(name, &tensor)?;
                        Ok((
                            name,
                            tensor.dtype(),
                            tensor.shape().to_vec(),
                            Cow::Owned(bytes),
                        ))
                    })
                    .collect::<Result<Vec<_>, OptimError>>()?;
                loaded[slot] = Some(pieces);
                Ok(None)
            })?;
            for (slot, pieces) in loaded.into_iter().enumerate() {
                stream.restore(slot, pieces)?;
            }
            return Ok(());
        }
        self.inner.load_state_dict(bytes)
    }
}

/// `slots` (ascending) in runs of consecutive slots whose states (their parameters' bytes
/// before a first step) add up to at most `budget` bytes, one slot at least.
#[cfg(feature = "cuda")]
fn runs_within<R: UpdateRule>(
    inner: &GroupOptimizer<R>,
    stream: &crate::cuda::state_stream::StateStream,
    slots: &[usize],
    budget: u64,
) -> Vec<Vec<usize>> {
    let mut runs: Vec<Vec<usize>> = Vec::new();
    let mut run_bytes = 0;
    for &slot in slots {
        let bytes = match stream.state_bytes_of(slot) {
            0 => {
                let param = inner.slot_param(slot);
                (param.numel() * param.dtype().size_in_bytes()) as u64
            }
            bytes => bytes,
        };
        match runs.last_mut() {
            Some(run) if run_bytes + bytes <= budget => {
                run.push(slot);
                run_bytes += bytes;
            }
            _ => {
                runs.push(vec![slot]);
                run_bytes = bytes;
            }
        }
    }
    runs
}
