//! The optimizer over autograd-core parameters: param groups, implementations, `step`,
//! `zero_grad`, a per-parameter step, and state dicts as safetensors.
//!
//! [`GroupOptimizer`] is generic over an [`UpdateRule`] (one per algorithm: `SgdConfig`,
//! `AdamConfig`, `AdafactorConfig`, `Adam8bitConfig`), which owns the per-parameter state and
//! runs the raw kernels on the tensors' host memory. [`Optimizer`] is the object-safe face that
//! schedulers, trainers and optimizer-in-backward hooks use. State tensors and every temporary
//! of a step are allocated from the parameters' backend, so `memory_allocated()` sees them.

use std::collections::HashMap;

use headroom_autograd_core::{DType, Tensor};
use safetensors::tensor::TensorView;

use crate::device::{DeviceGradScaling, StepDevice, StepScaling};
use crate::error::OptimError;
use crate::kernels::{GradScaling, StepOutcome};

/// Elements of temporaries the bounded foreach implementation holds at once by default:
/// 4 Mi f32 = 16 MiB. PyTorch's foreach holds one temporary of the size of all parameters
/// (4 GB for a 1e9-parameter model); 16 MiB keeps each op's pass long enough to stream at full
/// memory bandwidth while staying far below the 64 MB budget of issue 5.
pub const DEFAULT_FOREACH_CHUNK: usize = 1 << 22;

/// How the update is computed; results agree to float32 rounding, memory and passes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implementation {
    /// One parameter at a time, op by op (temporaries of one parameter).
    Single,
    /// Op by op across all parameters of a group, temporaries bounded by `chunk` elements
    /// (`None`: unbounded, PyTorch's ~1× parameters extra).
    Foreach {
        /// Elements of temporaries held at once.
        chunk: Option<usize>,
    },
    /// One pass per element, no temporaries; accepts a [`GradScaling`].
    Fused,
    /// bitsandbytes' 8-bit blockwise state (Adam only); accepts a [`GradScaling`].
    EightBit,
}

impl Implementation {
    /// Foreach with the default bound ([`DEFAULT_FOREACH_CHUNK`]).
    pub const FOREACH: Implementation = Implementation::Foreach {
        chunk: Some(DEFAULT_FOREACH_CHUNK),
    };
    /// Foreach as PyTorch does it: temporaries for the whole group at once.
    pub const FOREACH_UNBOUNDED: Implementation = Implementation::Foreach { chunk: None };
}

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

/// A parameter's state tensors by name (`exp_avg`, `momentum_buffer`, `state1`, ...).
pub type NamedTensors = Vec<(&'static str, Tensor)>;

/// One algorithm: its hyperparameters (the implementing type), its per-parameter state, and
/// how one step of a group's parameters is shaped (which tensors go to which kernels).
///
/// The kernels themselves come from the [`StepDevice`]: the host's over tensor memory, or a
/// CUDA device's. A rule never checks devices; the optimizer did that before the call.
pub trait UpdateRule: Clone + std::fmt::Debug + Send + 'static {
    /// The per-parameter state.
    type State: std::fmt::Debug + Send;
    /// Name used in errors and state dicts.
    const NAME: &'static str;
    /// The parameter dtypes the rule's kernels take (gradients and states are of the
    /// parameter's dtype, or f32 for a rule that takes only f32).
    const DTYPES: &'static [DType] = &[DType::F32];

    /// Checks the hyperparameters.
    fn validate(&self) -> Result<(), OptimError>;
    /// Whether the rule has this implementation.
    fn supports(&self, implementation: Implementation) -> bool;
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate.
    fn set_lr(&mut self, lr: f64);
    /// Fresh state for `param`, on its device.
    fn init_state(
        &self,
        implementation: Implementation,
        param: &Tensor,
    ) -> Result<Self::State, OptimError>;
    /// One step of `items` (parameters of one group with their gradients and states, in
    /// order, all of one dtype) with `implementation` on `device`. Host-scaled steps that must be skipped never
    /// get here; a device scaling reaches only the fused and 8-bit implementations.
    fn step(
        &self,
        device: &mut StepDevice,
        implementation: Implementation,
        items: &mut [StepItem<'_, Self::State>],
        scaling: StepScaling<'_>,
    ) -> Result<(), OptimError>;
    /// The state's tensors by name.
    fn state_tensors(state: &Self::State) -> NamedTensors;
    /// State rebuilt from named tensors (already on `param`'s backend).
    fn state_from_tensors(
        &self,
        param: &Tensor,
        tensors: HashMap<String, Tensor>,
    ) -> Result<Self::State, OptimError>;
}

/// A parameter handed to [`UpdateRule::step`].
#[derive(Debug)]
pub struct StepItem<'a, S> {
    /// Step number (1-based) this update is, as the host counts it (steps the device skipped
    /// under a [`DeviceGradScaling`] are subtracted by the kernels).
    pub step: u64,
    /// The parameter's index among all parameters of the optimizer (its skip counter).
    pub slot: usize,
    /// The parameter.
    pub param: &'a Tensor,
    /// Its gradient.
    pub grad: Tensor,
    /// Its state.
    pub state: &'a mut S,
}

/// The object-safe optimizer interface.
pub trait Optimizer: Send {
    /// The algorithm's name.
    fn name(&self) -> &'static str;
    /// The implementation in use.
    fn implementation(&self) -> Implementation;
    /// Number of parameter groups.
    fn n_groups(&self) -> usize;
    /// Learning rate of a group.
    fn lr(&self, group: usize) -> f64;
    /// Sets the learning rate of a group (what schedulers call).
    fn set_lr(&mut self, group: usize, lr: f64);
    /// One step over every parameter that has a gradient.
    fn step(&mut self) -> Result<(), OptimError> {
        self.step_scaled(GradScaling::NONE).map(|_| ())
    }
    /// One step with in-kernel unscale and skip (fused and 8-bit implementations only).
    fn step_scaled(&mut self, scaling: GradScaling) -> Result<StepOutcome, OptimError>;
    /// One step with the scale and found-inf flag in device memory (fused and 8-bit on CUDA):
    /// nothing waits for the device; a skipped step is counted there and does not advance the
    /// parameters' step numbers.
    fn step_device_scaled(&mut self, scaling: &DeviceGradScaling) -> Result<(), OptimError>;
    /// One step of a single parameter (what an optimizer-in-backward hook calls once the
    /// parameter's gradient is final).
    fn step_param(
        &mut self,
        param: &Tensor,
        scaling: GradScaling,
    ) -> Result<StepOutcome, OptimError>;
    /// [`Optimizer::step_param`] with a device scaling (see
    /// [`Optimizer::step_device_scaled`]).
    fn step_param_device_scaled(
        &mut self,
        param: &Tensor,
        scaling: &DeviceGradScaling,
    ) -> Result<(), OptimError>;
    /// Clears every parameter's gradient (drops it when `set_to_none`).
    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError>;
    /// The state (steps, state tensors, hyperparameters) as safetensors bytes.
    fn state_dict(&self) -> Result<Vec<u8>, OptimError>;
    /// Restores what [`Optimizer::state_dict`] saved (same groups and parameter shapes).
    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError>;
}

#[derive(Debug)]
struct ParamState<S> {
    step: u64,
    state: S,
}

/// An optimizer of parameter groups with one [`UpdateRule`] and one [`Implementation`], on the
/// device of its parameters (the CPU, or a CUDA device with the `cuda` feature).
#[derive(Debug)]
pub struct GroupOptimizer<R: UpdateRule> {
    groups: Vec<ParamGroup<R>>,
    states: Vec<Vec<Option<ParamState<R::State>>>>,
    implementation: Implementation,
    device: StepDevice,
}

impl<R: UpdateRule> GroupOptimizer<R> {
    /// An optimizer over `groups`. Fails on invalid hyperparameters, an implementation the rule
    /// lacks, or parameters that are not distinct contiguous f32 tensors of one device.
    pub fn new(
        groups: Vec<ParamGroup<R>>,
        implementation: Implementation,
    ) -> Result<GroupOptimizer<R>, OptimError> {
        let all: Vec<&Tensor> = groups.iter().flat_map(|g| &g.params).collect();
        for param in &all {
            if !R::DTYPES.contains(&param.dtype()) {
                return Err(OptimError::DType {
                    op: R::NAME,
                    expected: DType::F32,
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
        if let Implementation::Foreach { chunk: Some(0) } = implementation {
            return Err(OptimError::InvalidArgument {
                op: R::NAME,
                reason: "a foreach chunk of 0 elements".into(),
            });
        }
        let states = groups
            .iter()
            .map(|g| g.params.iter().map(|_| None).collect())
            .collect();
        Ok(GroupOptimizer {
            groups,
            states,
            implementation,
            device,
        })
    }

    /// The parameter groups.
    pub fn groups(&self) -> &[ParamGroup<R>] {
        &self.groups
    }

    /// A group's hyperparameters, to change between steps.
    pub fn config_mut(&mut self, group: usize) -> &mut R {
        &mut self.groups[group].config
    }

    /// The device the steps run on.
    pub fn device(&self) -> &StepDevice {
        &self.device
    }

    /// The number of steps taken by a parameter (0 before its first). After steps under a
    /// [`DeviceGradScaling`] this reads the device's skip counts (and waits for the device).
    pub fn param_step(&self, group: usize, idx: usize) -> Result<u64, OptimError> {
        let host = self.states[group][idx].as_ref().map_or(0, |s| s.step);
        let skipped = self.device.skipped_steps(self.n_slots())?[self.slot(group, idx)];
        Ok(host - skipped)
    }

    /// A parameter's state tensors by name (empty before its first step).
    pub fn param_state(&self, group: usize, idx: usize) -> NamedTensors {
        self.states[group][idx]
            .as_ref()
            .map(|s| R::state_tensors(&s.state))
            .unwrap_or_default()
    }

    fn n_slots(&self) -> usize {
        self.groups.iter().map(|g| g.params.len()).sum()
    }

    fn slot(&self, group: usize, idx: usize) -> usize {
        self.groups[..group]
            .iter()
            .map(|g| g.params.len())
            .sum::<usize>()
            + idx
    }

    fn check_scaling(&self, scaling: StepScaling<'_>) -> Result<(), OptimError> {
        if scaling.is_scaled()
            && !matches!(
                self.implementation,
                Implementation::Fused | Implementation::EightBit
            )
        {
            return Err(OptimError::Unsupported {
                optimizer: R::NAME,
                reason: format!(
                    "a gradient scale or found-inf flag needs the fused or 8-bit implementation, \
                     not {:?}",
                    self.implementation
                ),
            });
        }
        if let StepScaling::Device(device_scaling) = scaling {
            self.device.check_scaling(R::NAME, device_scaling)?;
        }
        Ok(())
    }

    /// One step of the parameters `which` selects in each group (those with a gradient).
    fn step_where(
        &mut self,
        scaling: StepScaling<'_>,
        which: &dyn Fn(usize, usize) -> bool,
    ) -> Result<(), OptimError> {
        let mut slot_base = 0;
        for group in 0..self.groups.len() {
            let ParamGroup { params, config } = &self.groups[group];
            let mut grads = Vec::new();
            for (idx, param) in params.iter().enumerate() {
                if !which(group, idx) {
                    continue;
                }
                let Some(grad) = param.grad() else { continue };
                check_grad(&self.device, param, &grad)?;
                if self.states[group][idx].is_none() {
                    self.states[group][idx] = Some(ParamState {
                        step: 0,
                        state: config.init_state(self.implementation, param)?,
                    });
                }
                grads.push((idx, grad));
            }
            let mut items = Vec::with_capacity(grads.len());
            let mut grads = grads.into_iter().peekable();
            for (idx, slot) in self.states[group].iter_mut().enumerate() {
                if grads.peek().map(|(i, _)| *i) != Some(idx) {
                    continue;
                }
                let (_, grad) = grads.next().expect("peeked");
                let entry = slot.as_mut().expect("initialised above");
                entry.step += 1;
                items.push(StepItem {
                    step: entry.step,
                    slot: slot_base + idx,
                    param: &params[idx],
                    grad,
                    state: &mut entry.state,
                });
            }
            // One step per dtype, as PyTorch groups tensors by dtype (the order of parameters
            // within a step changes no result).
            items.sort_by_key(|it| dtype_order(it.param.dtype()));
            for run in items.chunk_by_mut(|a, b| a.param.dtype() == b.param.dtype()) {
                config.step(&mut self.device, self.implementation, run, scaling)?;
            }
            slot_base += params.len();
        }
        Ok(())
    }

    /// The (group, index) of `param`: the same tensor, or a tensor over the same memory.
    fn find(&self, param: &Tensor) -> Result<(usize, usize), OptimError> {
        self.groups
            .iter()
            .enumerate()
            .find_map(|(g, group)| {
                group
                    .params
                    .iter()
                    .position(|p| {
                        p.same_tensor(param)
                            || (crate::host::byte_range(p) == crate::host::byte_range(param)
                                && p.device() == param.device()
                                && p.shape() == param.shape())
                    })
                    .map(|idx| (g, idx))
            })
            .ok_or(OptimError::UnknownParameter { optimizer: R::NAME })
    }
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
    crate::host::check_disjoint("gradient", &[param, grad])
}

impl<R: UpdateRule> Optimizer for GroupOptimizer<R> {
    fn name(&self) -> &'static str {
        R::NAME
    }

    fn implementation(&self) -> Implementation {
        self.implementation
    }

    fn n_groups(&self) -> usize {
        self.groups.len()
    }

    fn lr(&self, group: usize) -> f64 {
        self.groups[group].config.lr()
    }

    fn set_lr(&mut self, group: usize, lr: f64) {
        self.groups[group].config.set_lr(lr);
    }

    fn step_scaled(&mut self, scaling: GradScaling) -> Result<StepOutcome, OptimError> {
        self.check_scaling(StepScaling::Host(scaling))?;
        if scaling.skips() {
            return Ok(StepOutcome::Skipped);
        }
        self.step_where(StepScaling::Host(scaling), &|_, _| true)?;
        Ok(StepOutcome::Stepped)
    }

    fn step_device_scaled(&mut self, scaling: &DeviceGradScaling) -> Result<(), OptimError> {
        self.check_scaling(StepScaling::Device(scaling))?;
        self.step_where(StepScaling::Device(scaling), &|_, _| true)
    }

    fn step_param(
        &mut self,
        param: &Tensor,
        scaling: GradScaling,
    ) -> Result<StepOutcome, OptimError> {
        self.check_scaling(StepScaling::Host(scaling))?;
        let (group, idx) = self.find(param)?;
        if scaling.skips() || self.groups[group].params[idx].grad().is_none() {
            return Ok(StepOutcome::Skipped);
        }
        self.step_where(StepScaling::Host(scaling), &|g, i| (g, i) == (group, idx))?;
        Ok(StepOutcome::Stepped)
    }

    fn step_param_device_scaled(
        &mut self,
        param: &Tensor,
        scaling: &DeviceGradScaling,
    ) -> Result<(), OptimError> {
        self.check_scaling(StepScaling::Device(scaling))?;
        let (group, idx) = self.find(param)?;
        self.step_where(StepScaling::Device(scaling), &|g, i| (g, i) == (group, idx))
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        for group in &self.groups {
            for param in &group.params {
                param.zero_grad(set_to_none)?;
            }
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        let mut metadata = HashMap::new();
        metadata.insert("optimizer".to_string(), R::NAME.to_string());
        metadata.insert(
            "implementation".to_string(),
            format!("{:?}", self.implementation),
        );
        let mut blobs: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
        let skipped = self.device.skipped_steps(self.n_slots())?;
        for (g, group) in self.groups.iter().enumerate() {
            metadata.insert(format!("group.{g}.lr"), format!("{:?}", group.config.lr()));
            metadata.insert(format!("group.{g}.config"), format!("{:?}", group.config));
            for (idx, slot) in self.states[g].iter().enumerate() {
                let Some(entry) = slot else { continue };
                let step = entry.step - skipped[self.slot(g, idx)];
                metadata.insert(format!("state.{g}.{idx}.step"), step.to_string());
                for (name, tensor) in R::state_tensors(&entry.state) {
                    let bytes = match tensor.dtype() {
                        DType::F32 => tensor
                            .to_vec::<f32>()?
                            .iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect(),
                        DType::BF16 => tensor
                            .to_vec::<half::bf16>()?
                            .iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect(),
                        DType::F16 => tensor
                            .to_vec::<half::f16>()?
                            .iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect(),
                        DType::U8 => tensor.to_vec::<u8>()?,
                        other => {
                            return Err(OptimError::StateDict(format!(
                                "state tensor {name} has dtype {other:?}"
                            )))
                        }
                    };
                    blobs.push((
                        format!("state.{g}.{idx}.{name}"),
                        tensor.dtype(),
                        tensor.shape().to_vec(),
                        bytes,
                    ));
                }
            }
        }
        let views = blobs
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                let dtype = match dtype {
                    DType::U8 => safetensors::Dtype::U8,
                    DType::BF16 => safetensors::Dtype::BF16,
                    DType::F16 => safetensors::Dtype::F16,
                    _ => safetensors::Dtype::F32,
                };
                Ok((name.clone(), TensorView::new(dtype, shape.clone(), bytes)?))
            })
            .collect::<Result<Vec<_>, OptimError>>()?;
        Ok(safetensors::serialize(views, &Some(metadata))?)
    }

    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)?;
        let metadata = header.metadata().clone().unwrap_or_default();
        if metadata.get("optimizer").map(String::as_str) != Some(R::NAME) {
            return Err(OptimError::StateDict(format!(
                "saved by {:?}, loading into {}",
                metadata.get("optimizer"),
                R::NAME
            )));
        }
        let tensors = safetensors::SafeTensors::deserialize(bytes)?;
        let mut states = Vec::with_capacity(self.groups.len());
        for (g, group) in self.groups.iter_mut().enumerate() {
            if let Some(lr) = metadata.get(&format!("group.{g}.lr")) {
                let lr = lr
                    .parse::<f64>()
                    .map_err(|e| OptimError::StateDict(format!("group {g} lr {lr:?}: {e}")))?;
                group.config.set_lr(lr);
            }
            let mut group_states = Vec::with_capacity(group.params.len());
            for (idx, param) in group.params.iter().enumerate() {
                let Some(step) = metadata.get(&format!("state.{g}.{idx}.step")) else {
                    group_states.push(None);
                    continue;
                };
                let step = step
                    .parse::<u64>()
                    .map_err(|e| OptimError::StateDict(format!("step {step:?}: {e}")))?;
                let prefix = format!("state.{g}.{idx}.");
                let mut named = HashMap::new();
                for (name, view) in tensors.tensors() {
                    let Some(key) = name.strip_prefix(&prefix) else {
                        continue;
                    };
                    let tensor = match view.dtype() {
                        safetensors::Dtype::F32 => {
                            let values: Vec<f32> = view
                                .data()
                                .chunks_exact(4)
                                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                                .collect();
                            Tensor::from_slice(param.backend(), &values, view.shape())?
                        }
                        safetensors::Dtype::BF16 => {
                            let values: Vec<half::bf16> = view
                                .data()
                                .chunks_exact(2)
                                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]))
                                .collect();
                            Tensor::from_slice(param.backend(), &values, view.shape())?
                        }
                        safetensors::Dtype::F16 => {
                            let values: Vec<half::f16> = view
                                .data()
                                .chunks_exact(2)
                                .map(|b| half::f16::from_le_bytes([b[0], b[1]]))
                                .collect();
                            Tensor::from_slice(param.backend(), &values, view.shape())?
                        }
                        safetensors::Dtype::U8 => {
                            Tensor::from_slice(param.backend(), view.data(), view.shape())?
                        }
                        other => {
                            return Err(OptimError::StateDict(format!(
                                "{name} has dtype {other:?}"
                            )))
                        }
                    };
                    named.insert(key.to_string(), tensor);
                }
                let state = group.config.state_from_tensors(param, named)?;
                group_states.push(Some(ParamState { step, state }));
            }
            states.push(group_states);
        }
        self.states = states;
        self.device.reset_skipped_steps()
    }
}

/// Takes a named state tensor of `shape` and dtype `dtype` out of a loaded map.
pub(crate) fn take_state(
    tensors: &mut HashMap<String, Tensor>,
    name: &str,
    shape: &[usize],
    dtype: DType,
) -> Result<Tensor, OptimError> {
    let tensor = tensors
        .remove(name)
        .ok_or_else(|| OptimError::StateDict(format!("missing {name}")))?;
    if tensor.shape() != shape || tensor.dtype() != dtype {
        return Err(OptimError::StateDict(format!(
            "{name} is {:?} {:?}, expected {dtype:?} {shape:?}",
            tensor.dtype(),
            tensor.shape()
        )));
    }
    Ok(tensor)
}
