//! [`InBackward`]: any optim optimizer, stepped from post-accumulate-grad hooks during backward.
//!
//! Each parameter gets a post-accumulate-grad hook. When its gradient is final, the hook adds
//! the parameter to the pending bucket; a bucket is stepped as soon as the next gradient would
//! take it past [`InBackwardConfig::bucket_bytes`] (the next one expected from the order the
//! hooks fired in the last pass), with one `step_with(Only(bucket))` call (one multi-tensor launch
//! per group and dtype on CUDA), and its gradients are freed right after. So
//! buckets form in the order gradients become final — reverse execution order — and gradients
//! never pile up: the peak is parameters + optimizer state + the activations live when backward
//! starts, plus one bucket. A backward-end callback steps the last bucket.
//!
//! Around that core:
//! - Gradient accumulation over `k` micro-batches: the first `k − 1` backwards leave gradients
//!   in `.grad`, the last one steps (a parameter that got a gradient in an earlier micro-batch
//!   but none in the last is stepped at the end of it, as the plain loop would).
//! - An LR scheduler advanced once per optimizer step ([`InBackward::set_lr_scheduler`]).
//! - Clipping, in two documented modes ([`ClipMode`]): exact (a first backward pass only measures
//!   the norm, a second one updates with the coefficient), or with the previous step's norm (one
//!   pass; the first step is unclipped).
//! - Loss scaling for fp16 ([`InBackward::backward_scaled`], with any optim [`LossScaler`], such
//!   as amp's `GradScaler`): a first pass measures `found_inf` over every gradient on the device,
//!   the second updates through the fused kernels, which skip the whole step when it is set —
//!   never a partial update.
//! - A parameter that gets no gradient in a step is not updated, and is counted
//!   ([`InBackwardStats::params_without_grad`]).
//! - An optimizer that steps asynchronously (optim's `OffloadedAdam`, whose host steps each
//!   bucket while backward goes on) lands its updates at the end of every pass that stepped
//!   ([`Optimizer::finish_steps`]), before the next forward can read the parameters.
//! - A backward pass that fails (an error from a hook or an op) leaves the buckets it stepped
//!   stepped and the rest of its gradients in `.grad`; the next pass starts clean (what the failed
//!   one left pending is dropped, never stepped twice).
//!
//! It is not an [`Optimizer`] itself (the steps happen inside backward, so nothing is left for
//! a `step` to do): it owns one. It sits on autograd-core's hooks and backward-end callbacks and
//! on optim's [`Optimizer`] and [`LossScaler`] traits; it knows no rule, no kernel and no device.

use std::sync::Arc;

use parking_lot::Mutex;

use headroom_autograd_core::{
    backward_pass_id, non_finite_check_, queue_backward_end_callback, BackwardOptions, DType,
    Device, HookHandle, Tensor, TensorError,
};
use headroom_optim::{
    DeviceGradScaling, LossScaler, LrScheduler, Optimizer, ParamId, Scaling, Schedule, SkipFlag,
    StepParams,
};

use crate::error::HooksError;
use crate::norm;
use crate::registry::Claim;
use headroom_optim::NormType;

/// Gradient bytes a bucket collects before it is stepped by default: PyTorch DDP's 25 MiB, which
/// keeps each fused launch long enough to stream at full bandwidth and the held gradients small.
pub const DEFAULT_BUCKET_BYTES: u64 = 25 << 20;

/// How an [`InBackward`] steps.
#[derive(Debug, Clone, PartialEq)]
pub struct InBackwardConfig {
    /// The most gradient bytes a bucket holds: it is stepped before the next gradient would take
    /// it past this (0: every parameter alone; a gradient larger than this is a bucket alone).
    pub bucket_bytes: u64,
    /// Micro-batches per optimizer step (1: step in every backward).
    pub accumulation: usize,
    /// Gradient-norm clipping, if any.
    pub clipping: Option<Clipping>,
}

impl Default for InBackwardConfig {
    /// Buckets of [`DEFAULT_BUCKET_BYTES`], no accumulation, no clipping.
    fn default() -> Self {
        InBackwardConfig {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            accumulation: 1,
            clipping: None,
        }
    }
}

/// Global gradient-norm clipping inside backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Clipping {
    /// The largest norm the update sees.
    pub max_norm: f64,
    /// L2 or inf.
    pub norm: NormType,
    /// Which norm is used.
    pub mode: ClipMode,
}

/// Which global norm clips a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClipMode {
    /// This step's norm, as `clip_grad_norm_` before a plain step: [`InBackward::backward`]
    /// runs a first pass that only measures it (gradients are freed as they are measured), then
    /// the updating pass. Costs one more backward; gradients still never pile up. With
    /// accumulation, the last micro-batch's step waits for the end of its backward instead.
    Exact,
    /// The previous step's norm: one pass; each bucket is measured before it is stepped, and the
    /// coefficient from step `t`'s total clips step `t + 1`. The first step is not clipped. A
    /// spike is clipped one step late.
    PreviousStep,
}

/// What an [`InBackward`] has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InBackwardStats {
    /// Optimizer steps completed.
    pub steps: u64,
    /// Backward passes seen (micro-batches, measuring passes included).
    pub passes: u64,
    /// Buckets stepped.
    pub buckets: u64,
    /// Times a parameter had no gradient in a step and so was not updated.
    pub params_without_grad: u64,
}

/// What the current backward pass does when a gradient is final.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// A micro-batch before the last: the gradient stays in `.grad`.
    Accumulate,
    /// The first of two passes: measure the norm and `found_inf`, free the gradient.
    Measure,
    /// Step in buckets.
    Update,
    /// The last micro-batch when the step needs every gradient first: step all at the end.
    Deferred,
}

/// The optimizer and everything the hooks share.
struct State {
    optimizer: Box<dyn Optimizer>,
    params: Vec<Tensor>,
    ids: Vec<ParamId>,
    config: InBackwardConfig,
    scheduler: Option<LrScheduler>,
    /// Set by `backward` for its two passes; `None` outside them.
    armed: Option<Pass>,
    micro_batch: usize,
    /// The backward pass this optimizer's end callback is queued for.
    queued_pass: Option<u64>,
    /// Parameters whose hook fired in this pass.
    fired: Vec<bool>,
    /// The order the hooks fired in, in this pass so far.
    firing: Vec<usize>,
    /// The parameter expected after each one, from the last complete pass's firing order (before
    /// the first: reverse registration order, how a model's parameters usually come back).
    expected_next: Vec<Option<usize>>,
    pending: Vec<usize>,
    pending_bytes: u64,
    /// The norms of the gradients measured in this step, by parameter index.
    norm_parts: Vec<(usize, Tensor)>,
    /// The coefficient clipping this step's updates.
    clip: Option<Tensor>,
    /// The loss scale and overflow flag of this step (`backward_scaled`).
    scaling: Option<DeviceGradScaling>,
    stats: InBackwardStats,
}

/// An optimizer stepped inside backward. See the module docs.
///
/// ```
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_hooks::{InBackward, InBackwardConfig};
/// use headroom_optim::{Implementation, ParamGroup, Sgd, SgdConfig};
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let w = Tensor::from_f64s(&cpu, &[1.0, 2.0], &[2], DType::F32)?;
/// w.requires_grad_(true)?;
/// let sgd = Sgd::new(vec![ParamGroup::new(vec![w.clone()], SgdConfig::new(0.5))], Implementation::Fused)?;
/// let in_backward = InBackward::new(Box::new(sgd), InBackwardConfig::default())?;
/// // The step happens inside backward; the gradient is freed right after it.
/// w.mul(&w)?.sum_all()?.backward()?;
/// assert_eq!(w.to_vec::<f32>()?, [0.0, 0.0]);
/// assert!(w.grad().is_none());
/// assert_eq!(in_backward.stats().steps, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct InBackward {
    state: Arc<Mutex<State>>,
    hooks: Vec<HookHandle>,
    _claim: Claim,
}

impl std::fmt::Debug for InBackward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock();
        f.debug_struct("InBackward")
            .field("optimizer", &state.optimizer.name())
            .field("params", &state.params.len())
            .field("config", &state.config)
            .field("stats", &state.stats)
            .finish()
    }
}

impl InBackward {
    /// Takes `optimizer` over: registers a post-accumulate-grad hook on each of its parameters,
    /// which from now on are stepped inside backward. Fails if a parameter does not require grad
    /// or is stepped in backward already.
    pub fn new(
        optimizer: Box<dyn Optimizer>,
        config: InBackwardConfig,
    ) -> Result<InBackward, HooksError> {
        if config.accumulation == 0 {
            return Err(HooksError::InvalidArgument {
                op: "InBackward",
                reason: "accumulation over 0 micro-batches; use 1 to step every backward".into(),
            });
        }
        if let Some(clipping) = &config.clipping {
            if !(clipping.max_norm.is_finite() && clipping.max_norm > 0.0) {
                return Err(HooksError::InvalidArgument {
                    op: "InBackward",
                    reason: format!("max_norm {} is not a positive number", clipping.max_norm),
                });
            }
        }
        let (ids, params): (Vec<ParamId>, Vec<Tensor>) = optimizer.params().into_iter().unzip();
        if let Some(index) = params.iter().position(|p| !p.requires_grad()) {
            return Err(HooksError::DoesNotRequireGrad { index });
        }
        let claim = Claim::new(&params)?;
        let n = params.len();
        let state = Arc::new(Mutex::new(State {
            optimizer,
            params: params.clone(),
            ids,
            config,
            scheduler: None,
            armed: None,
            micro_batch: 0,
            queued_pass: None,
            fired: vec![false; n],
            firing: Vec::with_capacity(n),
            expected_next: (0..n).map(|index| index.checked_sub(1)).collect(),
            pending: Vec::new(),
            pending_bytes: 0,
            norm_parts: Vec::new(),
            clip: None,
            scaling: None,
            stats: InBackwardStats::default(),
        }));
        let mut hooks = Vec::with_capacity(n);
        for (index, param) in params.iter().enumerate() {
            let state = Arc::clone(&state);
            let hook = param.register_post_accumulate_grad_hook(move |_| {
                gradient_final(&state, index).map_err(|err| match err {
                    HooksError::Tensor(err) => err,
                    other => TensorError::hook("InBackward", other),
                })
            })?;
            hooks.push(hook);
        }
        Ok(InBackward {
            state,
            hooks,
            _claim: claim,
        })
    }

    /// Drives the learning rates with `schedule`, advanced once per optimizer step (after the
    /// step, as PyTorch's `scheduler.step()` after `optimizer.step()`).
    pub fn set_lr_scheduler(&self, schedule: Schedule) -> Result<(), HooksError> {
        let mut state = self.state.lock();
        let scheduler = LrScheduler::new(schedule, state.optimizer.as_mut())?;
        state.scheduler = Some(scheduler);
        Ok(())
    }

    /// Backward from `loss` (one element) with the updates inside it. A plain `loss.backward()`
    /// does the same unless the configuration clips exactly, which needs two passes: this runs
    /// them.
    pub fn backward(&self, loss: &Tensor) -> Result<(), HooksError> {
        self.run(loss, None)
    }

    /// [`InBackward::backward`] under a loss scale (fp16 training): `scaler` scales `loss` and
    /// opens the step ([`LossScaler::begin_step`]); a first pass sets the step's overflow flag
    /// from every gradient, then the updating pass unscales in the fused kernels, which skip the
    /// whole step when the flag is set — never a partial update; then `scaler` updates its scale
    /// from the flag ([`LossScaler::end_step`]). Returns whether the step was skipped: known on
    /// the CPU, still on the device on CUDA (nothing waits). With accumulation, a micro-batch
    /// before the last only backwards its scaled loss (`Known(false)`: no step), and the last one
    /// opens, runs and closes the scaler's step over every accumulated gradient. A disabled
    /// scaler makes it a plain [`InBackward::backward`]. Needs the fused implementation.
    pub fn backward_scaled(
        &self,
        loss: &Tensor,
        scaler: &mut dyn LossScaler,
    ) -> Result<SkipFlag, HooksError> {
        if self.state.lock().clip_mode() == Some(ClipMode::PreviousStep) {
            return Err(HooksError::InvalidArgument {
                op: "InBackward::backward_scaled",
                reason: "previous-step clipping would carry an overflowed step's norm into the \
                         next step; clip with ClipMode::Exact under a loss scale"
                    .into(),
            });
        }
        let scaled = scaler.scale_loss(loss)?;
        let steps_now = {
            let state = self.state.lock();
            state.micro_batch + 1 == state.config.accumulation
        };
        if !steps_now {
            // A micro-batch before the last: scaled gradients accumulate; the step, and with it
            // the scaler's, comes with the last one.
            self.run(&scaled, None)?;
            return Ok(SkipFlag::Known(false));
        }
        let Some(scaling) = scaler.begin_step()? else {
            self.run(&scaled, None)?;
            return Ok(SkipFlag::Known(false));
        };
        check_scaling(&scaling)?;
        self.run(&scaled, Some(scaling.clone()))?;
        scaler.end_step(&scaling)?;
        let found_inf = scaling.found_inf.expect("checked by check_scaling");
        Ok(match found_inf.device() {
            Device::Cpu => SkipFlag::Known(found_inf.item()? != 0.0),
            Device::Cuda(_) => SkipFlag::OnDevice(found_inf),
        })
    }

    fn run(&self, loss: &Tensor, scaling: Option<DeviceGradScaling>) -> Result<(), HooksError> {
        let two_passes = {
            let mut state = self.state.lock();
            state.scaling = scaling;
            let pass = state.next_pass();
            state.armed = Some(pass);
            pass == Pass::Measure
        };
        let res = self.run_passes(loss, two_passes);
        let mut state = self.state.lock();
        state.armed = None;
        state.scaling = None;
        res
    }

    fn run_passes(&self, loss: &Tensor, two_passes: bool) -> Result<(), HooksError> {
        if two_passes {
            loss.backward_with(None, BackwardOptions { retain_graph: true })
                .map_err(HooksError::from_engine)?;
            let mut state = self.state.lock();
            state.finish_measuring()?;
            state.armed = Some(Pass::Update);
        }
        loss.backward().map_err(HooksError::from_engine)
    }

    /// What this optimizer in backward has done so far.
    pub fn stats(&self) -> InBackwardStats {
        self.state.lock().stats
    }

    /// The learning rate of a group.
    pub fn lr(&self, group: usize) -> f64 {
        self.state.lock().optimizer.lr(group)
    }

    /// The wrapped optimizer's state dict.
    pub fn state_dict(&self) -> Result<Vec<u8>, HooksError> {
        Ok(self.state.lock().optimizer.state_dict()?)
    }

    /// Removes the hooks and gives the optimizer back (gradients left in `.grad` stay). Fails
    /// if called from inside a backward pass that is still using it.
    pub fn into_optimizer(mut self) -> Result<Box<dyn Optimizer>, HooksError> {
        for hook in std::mem::take(&mut self.hooks) {
            hook.remove();
        }
        let state = Arc::clone(&self.state);
        drop(self);
        let state = Arc::try_unwrap(state).map_err(|_| HooksError::InvalidArgument {
            op: "InBackward::into_optimizer",
            reason: "a backward pass is still using it; call it after backward returns".into(),
        })?;
        Ok(state.into_inner().optimizer)
    }
}

impl Drop for InBackward {
    /// Removes the hooks: the parameters are no longer stepped in backward.
    fn drop(&mut self) {
        for hook in std::mem::take(&mut self.hooks) {
            hook.remove();
        }
    }
}

/// Checks what a [`LossScaler`] opened: a scale of one f32 element and an overflow flag, as the
/// fused kernels read them (a scaler of another crate could hand anything).
fn check_scaling(scaling: &DeviceGradScaling) -> Result<(), HooksError> {
    let one_f32 = |tensor: &Tensor| {
        tensor.dtype() == DType::F32 && tensor.numel() == 1 && tensor.is_contiguous()
    };
    match (&scaling.grad_scale, &scaling.found_inf) {
        (Some(scale), Some(found_inf)) if one_f32(scale) && one_f32(found_inf) => Ok(()),
        _ => {
            Err(HooksError::InvalidArgument {
                op: "InBackward::backward_scaled",
                reason: format!(
                "a loss scaler opened a step without a one-element f32 scale and overflow flag \
                 ({:?}, {:?})",
                scaling.grad_scale.as_ref().map(|t| (t.dtype(), t.shape().to_vec())),
                scaling.found_inf.as_ref().map(|t| (t.dtype(), t.shape().to_vec()))
            ),
            })
        }
    }
}

/// The hook: parameter `index`'s gradient is final for this pass.
fn gradient_final(shared: &Arc<Mutex<State>>, index: usize) -> Result<(), HooksError> {
    let mut state = shared.lock();
    let pass = backward_pass_id();
    if state.queued_pass != pass {
        // A new pass. What a pass that failed left pending is dropped: its gradients stay in
        // `.grad`, and the buckets it stepped stay stepped.
        state.pending.clear();
        state.pending_bytes = 0;
        state.norm_parts.clear();
        state.fired.iter_mut().for_each(|fired| *fired = false);
        state.firing.clear();
        state.queued_pass = pass;
        let shared = Arc::clone(shared);
        queue_backward_end_callback(move || {
            pass_finished(&shared).map_err(|err| match err {
                HooksError::Tensor(err) => err,
                other => TensorError::hook("InBackward", other),
            })
        })?;
    }
    state.fired[index] = true;
    state.firing.push(index);
    match state.pass()? {
        Pass::Accumulate | Pass::Deferred => Ok(()),
        Pass::Measure => state.measure(index),
        Pass::Update => {
            let bytes = state.param_bytes(index);
            state.pending.push(index);
            state.pending_bytes += bytes;
            // Step before the next gradient would take the bucket past its size, so that no more
            // than `bucket_bytes` of gradients wait at once (a bucket that overshoots holds one
            // more gradient, up to a whole weight matrix, at the moment memory is tightest).
            let next_bytes = state.expected_next[index].map_or(0, |next| state.param_bytes(next));
            if state.pending_bytes + next_bytes > state.config.bucket_bytes {
                state.step_pending()?;
            }
            Ok(())
        }
    }
}

/// The pass's end callback: step what is left, finish the step.
fn pass_finished(shared: &Arc<Mutex<State>>) -> Result<(), HooksError> {
    let mut state = shared.lock();
    state.queued_pass = None;
    state.stats.passes += 1;
    let pass = state.pass()?;
    let res = match pass {
        Pass::Accumulate => {
            state.micro_batch += 1;
            Ok(())
        }
        Pass::Measure => Ok(()),
        Pass::Update | Pass::Deferred => state.finish_step(pass),
    };
    state.learn_firing_order();
    state.fired.iter_mut().for_each(|fired| *fired = false);
    res
}

impl State {
    fn param_bytes(&self, index: usize) -> u64 {
        self.params[index].numel() as u64 * self.params[index].dtype().size_in_bytes() as u64
    }

    /// After a complete pass, the order its hooks fired in predicts the next pass's.
    fn learn_firing_order(&mut self) {
        if self.firing.is_empty() {
            return;
        }
        self.expected_next.iter_mut().for_each(|next| *next = None);
        for pair in self.firing.windows(2) {
            self.expected_next[pair[0]] = Some(pair[1]);
        }
        self.firing.clear();
    }

    /// What this pass does: as `backward` armed it, else (a plain `loss.backward()`) accumulate
    /// or update, or refuse when the configuration needs two passes.
    fn pass(&self) -> Result<Pass, HooksError> {
        match self.armed {
            Some(pass) => Ok(pass),
            None => match self.next_pass() {
                Pass::Measure => Err(HooksError::NeedsTwoPasses),
                pass => Ok(pass),
            },
        }
    }

    /// What the next backward pass must do: accumulate before the last micro-batch; on the last,
    /// measure first (one micro-batch) or defer to the end (several) when the step needs every
    /// gradient before any update — exact clipping, or a loss scale — else update in buckets.
    fn next_pass(&self) -> Pass {
        let last = self.micro_batch + 1 == self.config.accumulation;
        let needs_all = self.clip_mode() == Some(ClipMode::Exact) || self.scaling.is_some();
        match () {
            _ if !last => Pass::Accumulate,
            _ if needs_all && self.config.accumulation == 1 => Pass::Measure,
            _ if needs_all => Pass::Deferred,
            _ => Pass::Update,
        }
    }

    /// The clipping mode, if the configuration clips.
    fn clip_mode(&self) -> Option<ClipMode> {
        self.config.clipping.map(|clipping| clipping.mode)
    }

    /// First pass: the gradient's norm part and overflow flag, then free it.
    fn measure(&mut self, index: usize) -> Result<(), HooksError> {
        let param = self.params[index].clone();
        let Some(grad) = param.grad() else {
            return Ok(());
        };
        if let Some(clipping) = self.config.clipping {
            let part = norm::gradient_norm(&param, clipping.norm)?;
            self.norm_parts.push((index, part));
        }
        if let Some(found_inf) = self.scaling.as_ref().and_then(|s| s.found_inf.as_ref()) {
            non_finite_check_(&[&grad], found_inf)?;
        }
        drop(grad);
        param.zero_grad(true)?;
        Ok(())
    }

    /// After the measuring pass: this step's clipping coefficient.
    fn finish_measuring(&mut self) -> Result<(), HooksError> {
        if let Some(clipping) = self.config.clipping {
            self.clip = self.coefficient(clipping)?;
        }
        Ok(())
    }

    /// The coefficient from the norm parts collected (of scaled gradients under a loss scale),
    /// `None` when nothing was measured.
    fn coefficient(&mut self, clipping: Clipping) -> Result<Option<Tensor>, HooksError> {
        let mut parts = std::mem::take(&mut self.norm_parts);
        if parts.is_empty() {
            return Ok(None);
        }
        let mut total = norm::total(&mut parts, clipping.norm)?;
        if let Some(scale) = self.scaling.as_ref().and_then(|s| s.grad_scale.as_ref()) {
            total = total.div(&scale.reshape(&[1])?)?;
        }
        Ok(Some(norm::clip_coefficient(&total, clipping.max_norm)?))
    }

    /// Steps the pending bucket and frees its gradients.
    fn step_pending(&mut self) -> Result<(), HooksError> {
        let bucket = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        if bucket.is_empty() {
            return Ok(());
        }
        let grads: Vec<Tensor> = bucket
            .iter()
            .filter_map(|&index| self.params[index].grad())
            .collect();
        if let Some(Clipping {
            norm,
            mode: ClipMode::PreviousStep,
            ..
        }) = self.config.clipping
        {
            for &index in &bucket {
                if self.params[index].grad().is_some() {
                    let part = norm::gradient_norm(&self.params[index], norm)?;
                    self.norm_parts.push((index, part));
                }
            }
        }
        if let Some(clip) = &self.clip {
            for grad in &grads {
                norm::scale_in_place(grad, clip)?;
            }
        }
        drop(grads);
        let ids: Vec<ParamId> = bucket.iter().map(|&index| self.ids[index]).collect();
        // On the CPU the host kernels read the scale and flag in place; on CUDA the kernels do.
        let scaling = match &self.scaling {
            Some(scaling) => Scaling::Device(scaling),
            None => Scaling::None,
        };
        self.optimizer.step_with(StepParams::Only(&ids), scaling)?;
        self.stats.buckets += 1;
        for &index in &bucket {
            self.params[index].zero_grad(true)?;
        }
        Ok(())
    }

    /// The end of an updating pass: step what is left (in a deferred pass, everything, after
    /// measuring it), advance the scheduler and the step count.
    fn finish_step(&mut self, pass: Pass) -> Result<(), HooksError> {
        // Parameters that got a gradient in an earlier micro-batch but none in this one.
        let leftover: Vec<usize> = (0..self.params.len())
            .filter(|&index| !self.fired[index] || pass == Pass::Deferred)
            .filter(|&index| self.params[index].grad().is_some())
            .collect();
        let without_grad = (0..self.params.len())
            .filter(|&index| !self.fired[index] && self.params[index].grad().is_none())
            .count();
        if pass == Pass::Deferred {
            self.measure_deferred(&leftover)?;
        }
        self.pending.extend(leftover);
        self.step_pending()?;
        // An optimizer that steps asynchronously (host offload) lands its updates before the
        // next forward can read the parameters.
        self.optimizer.finish_steps()?;
        self.stats.params_without_grad += without_grad as u64;
        self.stats.steps += 1;
        self.micro_batch = 0;
        match self.config.clipping {
            Some(
                clipping @ Clipping {
                    mode: ClipMode::PreviousStep,
                    ..
                },
            ) => self.clip = self.coefficient(clipping)?,
            _ => self.clip = None,
        }
        if let Some(scheduler) = &mut self.scheduler {
            scheduler.step(self.optimizer.as_mut());
        }
        Ok(())
    }

    /// A deferred step's measurements over every gradient, before any update.
    fn measure_deferred(&mut self, indices: &[usize]) -> Result<(), HooksError> {
        let grads: Vec<Tensor> = indices
            .iter()
            .filter_map(|&index| self.params[index].grad())
            .collect();
        if let Some(found_inf) = self.scaling.as_ref().and_then(|s| s.found_inf.as_ref()) {
            let refs: Vec<&Tensor> = grads.iter().collect();
            non_finite_check_(&refs, found_inf)?;
        }
        if let Some(clipping) = self.config.clipping {
            for &index in indices {
                if self.params[index].grad().is_some() {
                    let part = norm::gradient_norm(&self.params[index], clipping.norm)?;
                    self.norm_parts.push((index, part));
                }
            }
            self.clip = self.coefficient(clipping)?;
        }
        Ok(())
    }
}
