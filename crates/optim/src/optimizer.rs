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
    /// The parameters (leaf tensors, f32, contiguous, on the CPU for now).
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
/// how to run the raw kernels on a parameter's tensors.
pub trait UpdateRule: Clone + std::fmt::Debug + Send + 'static {
    /// The per-parameter state.
    type State: std::fmt::Debug + Send;
    /// Name used in errors and state dicts.
    const NAME: &'static str;

    /// Checks the hyperparameters.
    fn validate(&self) -> Result<(), OptimError>;
    /// Whether the rule has this implementation.
    fn supports(&self, implementation: Implementation) -> bool;
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate.
    fn set_lr(&mut self, lr: f64);
    /// Fresh state for `param`.
    fn init_state(
        &self,
        implementation: Implementation,
        param: &Tensor,
    ) -> Result<Self::State, OptimError>;
    /// Step number `step` (1-based) of one parameter with the single, fused or 8-bit form.
    fn step_one(
        &self,
        implementation: Implementation,
        step: u64,
        param: &Tensor,
        grad: &Tensor,
        state: &mut Self::State,
        scaling: GradScaling,
    ) -> Result<StepOutcome, OptimError>;
    /// One foreach step over parameters of a group, temporaries bounded by `chunk` elements
    /// (`None`: unbounded).
    fn step_foreach(
        &self,
        chunk: Option<usize>,
        items: &mut [ForeachItem<'_, Self::State>],
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

/// A parameter handed to [`UpdateRule::step_foreach`].
#[derive(Debug)]
pub struct ForeachItem<'a, S> {
    /// Step number (1-based) this update is.
    pub step: u64,
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
    /// One step of a single parameter (what an optimizer-in-backward hook calls once the
    /// parameter's gradient is final).
    fn step_param(
        &mut self,
        param: &Tensor,
        scaling: GradScaling,
    ) -> Result<StepOutcome, OptimError>;
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

/// An optimizer of parameter groups with one [`UpdateRule`] and one [`Implementation`].
#[derive(Debug)]
pub struct GroupOptimizer<R: UpdateRule> {
    groups: Vec<ParamGroup<R>>,
    states: Vec<Vec<Option<ParamState<R::State>>>>,
    implementation: Implementation,
}

impl<R: UpdateRule> GroupOptimizer<R> {
    /// An optimizer over `groups`. Fails on invalid hyperparameters, an implementation the rule
    /// lacks, or parameters that are not distinct contiguous f32 CPU tensors.
    pub fn new(
        groups: Vec<ParamGroup<R>>,
        implementation: Implementation,
    ) -> Result<GroupOptimizer<R>, OptimError> {
        let mut all = Vec::new();
        for group in &groups {
            group.config.validate()?;
            if !group.config.supports(implementation) {
                return Err(OptimError::Unsupported {
                    optimizer: R::NAME,
                    reason: format!("no {implementation:?} implementation"),
                });
            }
            for param in &group.params {
                crate::host::check_host::<f32>(R::NAME, param)?;
                all.push(param);
            }
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

    /// The number of steps taken by a parameter (0 before its first).
    pub fn param_step(&self, group: usize, idx: usize) -> u64 {
        self.states[group][idx].as_ref().map_or(0, |s| s.step)
    }

    /// A parameter's state tensors by name (empty before its first step).
    pub fn param_state(&self, group: usize, idx: usize) -> NamedTensors {
        self.states[group][idx]
            .as_ref()
            .map(|s| R::state_tensors(&s.state))
            .unwrap_or_default()
    }

    fn check_scaling(&self, scaling: GradScaling) -> Result<(), OptimError> {
        let scaled = scaling != GradScaling::NONE;
        if scaled
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
        Ok(())
    }

    fn step_one_at(
        &mut self,
        group: usize,
        idx: usize,
        grad: &Tensor,
        scaling: GradScaling,
    ) -> Result<StepOutcome, OptimError> {
        let param = &self.groups[group].params[idx];
        let config = &self.groups[group].config;
        check_grad(R::NAME, param, grad)?;
        let slot = &mut self.states[group][idx];
        if slot.is_none() {
            if scaling.skips() {
                return Ok(StepOutcome::Skipped);
            }
            *slot = Some(ParamState {
                step: 0,
                state: config.init_state(self.implementation, param)?,
            });
        }
        let entry = slot.as_mut().expect("initialised above");
        let outcome = config.step_one(
            self.implementation,
            entry.step + 1,
            param,
            grad,
            &mut entry.state,
            scaling,
        )?;
        if outcome == StepOutcome::Stepped {
            entry.step += 1;
        }
        Ok(outcome)
    }
}

fn check_grad(op: &'static str, param: &Tensor, grad: &Tensor) -> Result<(), OptimError> {
    crate::host::check_host::<f32>(op, grad)?;
    if grad.shape() != param.shape() {
        return Err(OptimError::UnsupportedTensor {
            op,
            reason: format!(
                "gradient shape {:?} for a parameter of shape {:?}",
                grad.shape(),
                param.shape()
            ),
        });
    }
    crate::host::check_disjoint(op, &[param, grad])
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
        self.check_scaling(scaling)?;
        if scaling.skips() {
            return Ok(StepOutcome::Skipped);
        }
        for group in 0..self.groups.len() {
            if let Implementation::Foreach { chunk } = self.implementation {
                let ParamGroup { params, config } = &self.groups[group];
                let mut grads = Vec::new();
                for (idx, param) in params.iter().enumerate() {
                    if let Some(grad) = param.grad() {
                        check_grad(R::NAME, param, &grad)?;
                        if self.states[group][idx].is_none() {
                            self.states[group][idx] = Some(ParamState {
                                step: 0,
                                state: config.init_state(self.implementation, param)?,
                            });
                        }
                        grads.push((idx, grad));
                    }
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
                    items.push(ForeachItem {
                        step: entry.step,
                        param: &params[idx],
                        grad,
                        state: &mut entry.state,
                    });
                }
                config.step_foreach(chunk, &mut items)?;
            } else {
                for idx in 0..self.groups[group].params.len() {
                    if let Some(grad) = self.groups[group].params[idx].grad() {
                        self.step_one_at(group, idx, &grad, scaling)?;
                    }
                }
            }
        }
        Ok(StepOutcome::Stepped)
    }

    fn step_param(
        &mut self,
        param: &Tensor,
        scaling: GradScaling,
    ) -> Result<StepOutcome, OptimError> {
        self.check_scaling(scaling)?;
        let found = self.groups.iter().enumerate().find_map(|(g, group)| {
            group
                .params
                .iter()
                .position(|p| {
                    p.same_tensor(param)
                        || (crate::host::byte_range(p) == crate::host::byte_range(param)
                            && p.shape() == param.shape())
                })
                .map(|idx| (g, idx))
        });
        let Some((group, idx)) = found else {
            return Err(OptimError::UnknownParameter { optimizer: R::NAME });
        };
        let Some(grad) = self.groups[group].params[idx].grad() else {
            return Ok(StepOutcome::Skipped);
        };
        if let Implementation::Foreach { chunk } = self.implementation {
            // A single parameter through the foreach form.
            let param = &self.groups[group].params[idx];
            let config = &self.groups[group].config;
            check_grad(R::NAME, param, &grad)?;
            let slot = &mut self.states[group][idx];
            if slot.is_none() {
                *slot = Some(ParamState {
                    step: 0,
                    state: config.init_state(self.implementation, param)?,
                });
            }
            let entry = slot.as_mut().expect("initialised above");
            entry.step += 1;
            let mut items = [ForeachItem {
                step: entry.step,
                param,
                grad,
                state: &mut entry.state,
            }];
            config.step_foreach(chunk, &mut items)?;
            return Ok(StepOutcome::Stepped);
        }
        self.step_one_at(group, idx, &grad, scaling)
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
        for (g, group) in self.groups.iter().enumerate() {
            metadata.insert(format!("group.{g}.lr"), format!("{:?}", group.config.lr()));
            metadata.insert(format!("group.{g}.config"), format!("{:?}", group.config));
            for (idx, slot) in self.states[g].iter().enumerate() {
                let Some(entry) = slot else { continue };
                metadata.insert(format!("state.{g}.{idx}.step"), entry.step.to_string());
                for (name, tensor) in R::state_tensors(&entry.state) {
                    let bytes = match tensor.dtype() {
                        DType::F32 => tensor
                            .to_vec::<f32>()?
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
        Ok(())
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
