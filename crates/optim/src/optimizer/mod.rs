//! The optimizer over autograd-core parameters: the object-safe [`Optimizer`] trait, and
//! [`GroupOptimizer`], which runs one [`UpdateRule`] over parameter groups. The words of a step
//! — parameter handles ([`ParamId`]), what a step updates ([`StepParams`]), how its gradients are
//! scaled ([`Scaling`]) — are the step vocabulary's (`step.rs`); what a rule is, `rule.rs`'s.
//!
//! [`GroupOptimizer`] keeps one flat slot table — parameter, group, step count, state — indexed
//! by [`ParamId`], resolved once when the optimizer is built. A step selects slots (all of them,
//! or the handles it is given, in O(their number)), checks their gradients, creates missing
//! state, and makes one rule call per run of parameters that share a group and a dtype (as
//! PyTorch groups tensors by dtype). The rule call goes to the [`StepDevice`], which picks the
//! host or the CUDA side once (`device.rs`) and calls the rule's entry there; the rules' front
//! ends (`sgd.rs`, `adam.rs`, ...) say only which buffers go to which kernels (`driver.rs`). State tensors and every temporary
//! of a step are allocated from the parameters' backend, so `memory_allocated()` sees them.
//! State dicts are in `state_dict.rs`.

mod state_dict;

#[cfg(feature = "cuda")]
pub(crate) use state_dict::{tensor_bytes, StateBytes};

use headroom_autograd_core::{DType, Tensor};

use crate::device::StepDevice;
use crate::error::OptimError;
use crate::kernels::StepOutcome;
use crate::rule::UpdateRule;
use crate::step::{Implementation, NamedTensors, ParamId, RuleCall, Scaling, StepItem, StepParams};

/// Parameters that share hyperparameters.
#[derive(Debug, Clone)]
pub struct ParamGroup<R> {
    /// The parameters (leaf tensors, contiguous, on one device; f32, or bf16/f16 for SGD and
    /// Adam).
    pub params: Vec<Tensor>,
    /// The group's hyperparameters; a scheduler changes its learning rate.
    pub config: R,
}

impl<R> ParamGroup<R> {
    /// A group of `params` with `config`.
    pub fn new(params: Vec<Tensor>, config: R) -> ParamGroup<R> {
        ParamGroup { params, config }
    }
}

/// The object-safe optimizer interface: what schedulers, trainers, optimizer-in-backward hooks
/// and GradScalers build on. Everything else derives from `step_with`.
pub trait Optimizer: Send {
    /// The algorithm's name.
    fn name(&self) -> &'static str;
    /// Number of parameter groups.
    fn n_groups(&self) -> usize;
    /// Learning rate of a group.
    fn lr(&self, group: usize) -> f64;
    /// Sets the learning rate of a group (what schedulers call).
    fn set_lr(&mut self, group: usize, lr: f64);
    /// Every parameter with its handle, in registration order.
    fn params(&self) -> Vec<(ParamId, Tensor)>;
    /// The handle of `param` (the same tensor, or a tensor over the same memory). It searches
    /// all parameters: call it once per parameter, at registration.
    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError>;
    /// One step of the selected parameters that have a gradient, their gradients scaled as
    /// `scaling` says. Costs O(selected parameters) — never a pass over all of them for
    /// [`StepParams::Only`]. [`StepOutcome::Skipped`] when a host-valued overflow flag skipped
    /// the step (a CUDA device's flag is read by the kernels, and the call returns `Stepped`;
    /// on the CPU a device flag is a host value, and a set one returns `Skipped`).
    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError>;
    /// One step of every parameter that has a gradient.
    fn step(&mut self) -> Result<(), OptimError> {
        self.step_with(StepParams::All, Scaling::None).map(|_| ())
    }
    /// Returns once every update that earlier [`Optimizer::step_with`] calls queued is ordered
    /// before the device's later work, with the first error they met. An optimizer that updates
    /// within the call (every one but an asynchronous one, such as
    /// [`OffloadedAdam`](crate::OffloadedAdam) stepping buckets on the host) has nothing to do.
    /// hooks' `InBackward` calls it at the end of every backward that stepped.
    fn finish_steps(&mut self) -> Result<(), OptimError> {
        Ok(())
    }
    /// Whether [`Optimizer::step_with`] takes a [`Scaling::Device`]: its kernels divide the
    /// gradients by a scale and skip an overflowed step themselves, reading both from device
    /// tensors, so a GradScaler hands them its scale and flag instead of unscaling the gradients
    /// and reading the flag on the host (PyTorch's `_step_supports_amp_scaling`). `false` unless
    /// the optimizer says otherwise.
    fn takes_device_scaling(&self) -> bool {
        false
    }
    /// Clears every parameter's gradient (drops it when `set_to_none`).
    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError>;
    /// The state (steps, state tensors, hyperparameters) as safetensors bytes.
    fn state_dict(&self) -> Result<Vec<u8>, OptimError>;
    /// Restores what [`Optimizer::state_dict`] saved (same groups and parameter shapes).
    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError>;
}

/// A boxed optimizer is an optimizer (so decorators and trainers take `Box<dyn Optimizer>`).
impl<O: Optimizer + ?Sized> Optimizer for Box<O> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn n_groups(&self) -> usize {
        (**self).n_groups()
    }
    fn lr(&self, group: usize) -> f64 {
        (**self).lr(group)
    }
    fn set_lr(&mut self, group: usize, lr: f64) {
        (**self).set_lr(group, lr)
    }
    fn params(&self) -> Vec<(ParamId, Tensor)> {
        (**self).params()
    }
    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        (**self).param_id(param)
    }
    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        (**self).step_with(params, scaling)
    }
    fn step(&mut self) -> Result<(), OptimError> {
        (**self).step()
    }

    fn finish_steps(&mut self) -> Result<(), OptimError> {
        (**self).finish_steps()
    }
    fn takes_device_scaling(&self) -> bool {
        (**self).takes_device_scaling()
    }
    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        (**self).zero_grad(set_to_none)
    }
    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        (**self).state_dict()
    }
    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        (**self).load_state_dict(bytes)
    }
}

/// A parameter's entry in the slot table.
#[derive(Debug)]
struct Slot<S> {
    param: Tensor,
    group: usize,
    /// Steps taken, as the host counts them (device-skipped steps are subtracted on read).
    step: u64,
    /// Created at the parameter's first step.
    state: Option<S>,
}

/// An optimizer of parameter groups with one [`UpdateRule`] and one [`Implementation`], on the
/// device of its parameters (the CPU, or a CUDA device with the `cuda` feature).
#[derive(Debug)]
pub struct GroupOptimizer<R: UpdateRule> {
    groups: Vec<ParamGroup<R>>,
    /// The slot of each group's first parameter.
    group_starts: Vec<usize>,
    slots: Vec<Slot<R::State>>,
    implementation: Implementation,
    device: StepDevice,
}

impl<R: UpdateRule> GroupOptimizer<R> {
    /// An optimizer over `groups`. Fails on invalid hyperparameters, an implementation the rule
    /// lacks, or parameters that are not distinct contiguous tensors of one device and of a
    /// dtype the rule takes.
    pub fn new(
        groups: Vec<ParamGroup<R>>,
        implementation: Implementation,
    ) -> Result<GroupOptimizer<R>, OptimError> {
        let all: Vec<&Tensor> = groups.iter().flat_map(|g| &g.params).collect();
        for param in &all {
            if !R::DTYPES.contains(&param.dtype()) {
                return Err(OptimError::DType {
                    op: R::NAME,
                    expected: R::DTYPES[0],
                    got: param.dtype(),
                });
            }
        }
        let device = match all.first() {
            Some(first) => StepDevice::of(R::NAME, first, all.len())?,
            None => StepDevice::host(),
        };
        for group in &groups {
            group.config.validate()?;
            if !group.config.supports(implementation) {
                return Err(OptimError::Unsupported {
                    optimizer: R::NAME,
                    reason: format!("no {implementation:?} implementation"),
                });
            }
        }
        for param in &all {
            device.check(R::NAME, param)?;
        }
        crate::host::check_disjoint(R::NAME, &all)?;
        let mut group_starts = Vec::with_capacity(groups.len());
        let mut slots = Vec::with_capacity(all.len());
        for (group, g) in groups.iter().enumerate() {
            group_starts.push(slots.len());
            slots.extend(g.params.iter().map(|param| Slot {
                param: param.clone(),
                group,
                step: 0,
                state: None,
            }));
        }
        Ok(GroupOptimizer {
            groups,
            group_starts,
            slots,
            implementation,
            device,
        })
    }

    /// The implementation in use.
    pub fn implementation(&self) -> Implementation {
        self.implementation
    }

    /// The parameter groups.
    pub fn groups(&self) -> &[ParamGroup<R>] {
        &self.groups
    }

    /// A group's hyperparameters, to change between steps. A CUDA graph that captured a step of
    /// this optimizer is marked stale: it would replay the old values ([`GraphedStep`] captures
    /// the step again).
    ///
    /// [`GraphedStep`]: https://docs.rs/headroom-ops-cuda/latest/headroom_ops_cuda/struct.GraphedStep.html
    pub fn config_mut(&mut self, group: usize) -> &mut R {
        self.device.invalidate_captures(HYPERPARAMETERS_CHANGED);
        &mut self.groups[group].config
    }

    /// The device the steps run on.
    pub fn device(&self) -> &StepDevice {
        &self.device
    }

    /// The number of steps taken by parameter `idx` of group `group` (0 before its first).
    /// After steps under a [`DeviceGradScaling`](crate::DeviceGradScaling) this reads the device's skip counts (and
    /// waits for the device).
    pub fn param_step(&self, group: usize, idx: usize) -> Result<u64, OptimError> {
        let slot = self.slot_of(group, idx)?;
        Ok(self.steps_taken()?[slot])
    }

    /// Every slot's steps taken: the host's count, plus the replays of CUDA graphs that captured
    /// its step, less the steps skipped on the device (reading those waits for the device).
    pub(super) fn steps_taken(&self) -> Result<Vec<u64>, OptimError> {
        let mut steps: Vec<i64> = self.slots.iter().map(|slot| slot.step as i64).collect();
        for (slot, delta) in self.device.replay_deltas() {
            steps[slot] += delta;
        }
        let skipped = self.device.skipped_steps(self.slots.len())?;
        Ok(steps
            .iter()
            .zip(skipped)
            .map(|(&step, skipped)| (step.max(0) as u64).saturating_sub(skipped))
            .collect())
    }

    /// Adds the replays of CUDA graphs that captured steps to the host's step counts.
    fn count_replays(&mut self) {
        for (slot, delta) in self.device.replay_deltas() {
            let step = &mut self.slots[slot].step;
            *step = (*step as i64 + delta).max(0) as u64;
        }
        self.device.count_replays();
    }

    /// The slot of parameter `idx` of group `group`, or a typed error naming what is out of
    /// range.
    fn slot_of(&self, group: usize, idx: usize) -> Result<usize, OptimError> {
        let Some(group_params) = self.groups.get(group).map(|g| g.params.len()) else {
            return Err(OptimError::InvalidArgument {
                op: R::NAME,
                reason: format!("group {group} of {}", self.groups.len()),
            });
        };
        if idx >= group_params {
            return Err(OptimError::InvalidArgument {
                op: R::NAME,
                reason: format!("parameter {idx} of group {group}, which has {group_params}"),
            });
        }
        Ok(self.group_starts[group] + idx)
    }

    /// The state tensors of parameter `idx` of group `group`, by name (empty before its first
    /// step).
    pub fn param_state(&self, group: usize, idx: usize) -> NamedTensors {
        self.slots[self.group_starts[group] + idx]
            .state
            .as_ref()
            .map(R::state_tensors)
            .unwrap_or_default()
    }

    /// Slot `slot`'s parameter (slots are parameters in registration order).
    #[cfg(feature = "cuda")]
    pub(crate) fn slot_param(&self, slot: usize) -> &Tensor {
        &self.slots[slot].param
    }

    /// Takes slot `slot`'s state out (a wrapper keeping it elsewhere between steps).
    #[cfg(feature = "cuda")]
    pub(crate) fn take_state(&mut self, slot: usize) -> Option<R::State> {
        self.slots[slot].state.take()
    }

    /// Slot `slot`'s state tensors, its fresh state created first if it has none (as its first
    /// step would): a wrapper keeping states elsewhere makes room for it before the step.
    #[cfg(feature = "cuda")]
    pub(crate) fn ensure_state(&mut self, slot: usize) -> Result<NamedTensors, OptimError> {
        let Slot {
            param,
            group,
            state,
            ..
        } = &mut self.slots[slot];
        if state.is_none() {
            *state = Some(self.groups[*group].config.init_state(param)?);
        }
        Ok(R::state_tensors(state.as_ref().expect("created above")))
    }

    /// Puts back a state [`GroupOptimizer::take_state`] took, rebuilt from its tensors by name
    /// (`R::state_from_tensors` checks their dtypes and shapes).
    #[cfg(feature = "cuda")]
    pub(crate) fn restore_state(
        &mut self,
        slot: usize,
        tensors: NamedTensors,
    ) -> Result<(), OptimError> {
        let param = self.slots[slot].param.clone();
        let named = tensors
            .into_iter()
            .map(|(name, tensor)| (name.to_string(), tensor))
            .collect();
        let mut saved = crate::rule::SavedTensors::new(param, named);
        let config = &self.groups[self.slots[slot].group].config;
        self.slots[slot].state = Some(config.state_from_tensors(&mut saved)?);
        Ok(())
    }

    fn check_scaling(&self, scaling: Scaling<'_>) -> Result<(), OptimError> {
        if scaling.is_scaled() && self.implementation != Implementation::Fused {
            return Err(OptimError::Unsupported {
                optimizer: R::NAME,
                reason: format!(
                    "a gradient scale or found-inf flag needs the fused implementation, not {:?}",
                    self.implementation
                ),
            });
        }
        if let Scaling::Host(host_scaling) = scaling {
            crate::kernels::check_host_scaling(R::NAME, host_scaling)?;
        }
        if let Scaling::Device(device_scaling) = scaling {
            self.device.check_scaling(R::NAME, device_scaling)?;
            #[cfg(feature = "cuda")]
            if !<R as crate::rule::CudaKernels<R::State>>::READS_DEVICE_SCALING {
                return Err(OptimError::Unsupported {
                    optimizer: R::NAME,
                    reason: "a device gradient scale (pass the scale as a value)".into(),
                });
            }
        }
        Ok(())
    }

    /// The slots `params` selects, ascending; typed errors for a handle this optimizer does not
    /// have and for a handle given twice.
    pub(crate) fn selected_slots(&self, params: StepParams<'_>) -> Result<Vec<usize>, OptimError> {
        let ids = match params {
            StepParams::All => return Ok((0..self.slots.len()).collect()),
            StepParams::Only(ids) => ids,
        };
        let mut slots: Vec<usize> = ids.iter().map(|id| id.0).collect();
        if slots.iter().any(|&slot| slot >= self.slots.len()) {
            return Err(OptimError::UnknownParameter { optimizer: R::NAME });
        }
        slots.sort_unstable();
        if slots.windows(2).any(|w| w[0] == w[1]) {
            return Err(OptimError::InvalidArgument {
                op: R::NAME,
                reason: "a parameter is listed twice in one step".into(),
            });
        }
        Ok(slots)
    }

    /// One step of the parameters of `selected` (ascending slots) that have a gradient: per
    /// group, in order, their gradients are checked and missing states created, then each run of
    /// one dtype is one rule call.
    fn step_slots(&mut self, selected: &[usize], scaling: Scaling<'_>) -> Result<(), OptimError> {
        self.count_replays();
        let GroupOptimizer {
            groups,
            slots,
            implementation,
            device,
            ..
        } = self;
        let mut with_grads: Vec<(usize, &mut Slot<R::State>, Tensor)> =
            Vec::with_capacity(selected.len());
        for (slot_idx, slot) in selected.iter().zip(select_mut(slots, selected)) {
            if let Some(grad) = slot.param.grad() {
                with_grads.push((*slot_idx, slot, grad));
            }
        }
        for run in with_grads.chunk_by_mut(|a, b| a.1.group == b.1.group) {
            let config = &groups[run[0].1.group].config;
            // Slots whose state this call creates: a failed step forgets it again.
            let mut created = Vec::new();
            for (slot_idx, slot, grad) in run.iter_mut() {
                check_grad(device, &slot.param, grad)?;
                if slot.state.is_none() {
                    slot.state = Some(config.init_state(&slot.param)?);
                    created.push(*slot_idx);
                }
            }
            let mut items: Vec<StepItem<'_, R::State>> = run
                .iter_mut()
                .map(|(slot_idx, slot, grad)| {
                    let Slot {
                        param, step, state, ..
                    } = &mut **slot;
                    *step += 1;
                    StepItem {
                        step: *step,
                        slot: *slot_idx,
                        param,
                        grad: grad.clone(),
                        state: state.as_mut().expect("created above"),
                    }
                })
                .collect();
            // One rule call per dtype, as PyTorch groups tensors by dtype (the order of
            // parameters within a call changes no result).
            items.sort_by_key(|it| dtype_order(it.param.dtype()));
            let mut stepped = 0;
            let mut failure = None;
            for same_dtype in items.chunk_by_mut(|a, b| a.param.dtype() == b.param.dtype()) {
                let n = same_dtype.len();
                let call = RuleCall {
                    implementation: *implementation,
                    items: same_dtype,
                    scaling,
                };
                if let Err(error) = device.step(config, call) {
                    failure = Some(error);
                    break;
                }
                stepped += n;
            }
            if let Some(error) = failure {
                // The calls that failed (and the ones after) queued nothing: their parameters
                // keep their step count, and a state made for them goes, so a step taken again
                // (after an out-of-memory error, or eagerly after a refused CUDA graph capture)
                // equals one that never failed.
                let unstepped: Vec<usize> = items[stepped..].iter().map(|it| it.slot).collect();
                drop(items);
                for (slot_idx, slot, _) in run.iter_mut() {
                    if unstepped.contains(slot_idx) {
                        slot.step -= 1;
                        if created.contains(slot_idx) {
                            slot.state = None;
                        }
                    }
                }
                return Err(error);
            }
        }
        Ok(())
    }
}

/// Why a CUDA graph that captured a step of an optimizer may not replay it any more.
const HYPERPARAMETERS_CHANGED: &str =
    "the optimizer's hyperparameters changed after its step was captured";

/// Mutable references to the elements of `slice` at `sorted` (ascending, distinct, in range)
/// indices, in O(their number).
fn select_mut<'a, T>(mut rest: &'a mut [T], sorted: &[usize]) -> Vec<&'a mut T> {
    let mut res = Vec::with_capacity(sorted.len());
    let mut base = 0;
    for &idx in sorted {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(idx - base);
        let (item, tail) = tail
            .split_first_mut()
            .expect("a selected index is in range");
        res.push(item);
        rest = tail;
        base = idx + 1;
    }
    res
}

/// A sort key that groups tensors by dtype.
fn dtype_order(dtype: DType) -> usize {
    [DType::F32, DType::BF16, DType::F16]
        .iter()
        .position(|&d| d == dtype)
        .unwrap_or(usize::MAX)
}

fn check_grad(device: &StepDevice, param: &Tensor, grad: &Tensor) -> Result<(), OptimError> {
    device.check("gradient", grad)?;
    check_grad_like(param, grad)?;
    crate::host::check_disjoint("gradient", &[param, grad])
}

/// Checks that `grad` has `param`'s dtype and shape (what every optimizer asks of a gradient).
pub(crate) fn check_grad_like(param: &Tensor, grad: &Tensor) -> Result<(), OptimError> {
    if grad.dtype() != param.dtype() {
        return Err(OptimError::DType {
            op: "gradient",
            expected: param.dtype(),
            got: grad.dtype(),
        });
    }
    if grad.shape() != param.shape() {
        return Err(OptimError::UnsupportedTensor {
            op: "gradient",
            reason: format!(
                "gradient shape {:?} for a parameter of shape {:?}",
                grad.shape(),
                param.shape()
            ),
        });
    }
    Ok(())
}

impl<R: UpdateRule> Optimizer for GroupOptimizer<R> {
    fn name(&self) -> &'static str {
        R::NAME
    }

    fn n_groups(&self) -> usize {
        self.groups.len()
    }

    fn lr(&self, group: usize) -> f64 {
        self.groups[group].config.lr()
    }

    fn set_lr(&mut self, group: usize, lr: f64) {
        if lr.to_bits() != self.groups[group].config.lr().to_bits() {
            self.device.invalidate_captures(HYPERPARAMETERS_CHANGED);
        }
        self.groups[group].config.set_lr(lr);
    }

    fn params(&self) -> Vec<(ParamId, Tensor)> {
        self.slots
            .iter()
            .enumerate()
            .map(|(idx, slot)| (ParamId(idx), slot.param.clone()))
            .collect()
    }

    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        self.slots
            .iter()
            .position(|slot| {
                let p = &slot.param;
                p.same_tensor(param)
                    || (crate::host::byte_range(p) == crate::host::byte_range(param)
                        && p.device() == param.device()
                        && p.shape() == param.shape())
            })
            .map(ParamId)
            .ok_or(OptimError::UnknownParameter { optimizer: R::NAME })
    }

    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        self.check_scaling(scaling)?;
        let selected = self.selected_slots(params)?;
        // On the CPU a device scaling's tensors are host memory: the host kernels take their
        // values, read in place.
        let scaling = match scaling {
            Scaling::Device(device_scaling) => self
                .device
                .host_values(device_scaling)
                .map_or(scaling, Scaling::Host),
            other => other,
        };
        if scaling.host().skips() {
            return Ok(StepOutcome::Skipped);
        }
        self.step_slots(&selected, scaling)?;
        Ok(StepOutcome::Stepped)
    }

    fn takes_device_scaling(&self) -> bool {
        #[cfg(feature = "cuda")]
        let cuda_reads = <R as crate::rule::CudaKernels<R::State>>::READS_DEVICE_SCALING;
        #[cfg(not(feature = "cuda"))]
        let cuda_reads = false;
        self.implementation == Implementation::Fused && self.device.takes_device_scaling(cuda_reads)
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        for slot in &self.slots {
            slot.param.zero_grad(set_to_none)?;
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        self.save_state()
    }

    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        self.load_state(bytes)
    }
}
