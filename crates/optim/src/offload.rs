//! [`OffloadedAdam`]: Adam or AdamW whose whole state lives in host memory and is stepped by the
//! host, so the GPU holds only the parameters, their gradients and the activations.
//!
//! Per parameter the host keeps the moments (f32) and a copy of the parameter (its dtype: f32,
//! or bf16 rounded stochastically as [`AdamStochastic`](crate::AdamStochastic) does — no f32
//! master copy — or, with [`OffloadConfig::master_weights`], an f32 master of a bf16 parameter,
//! stepped by f32 Adam and rounded to nearest into the parameter). A step of some parameters (an in-backward bucket: hooks'
//! `InBackward` calls [`Optimizer::step_with`] with `StepParams::Only` as gradients become final)
//! copies their gradients to the host, steps them with the CPU kernels (`adam_fused`,
//! `adam_fused_stochastic`: rayon over 32 Ki-element chunks), and copies the new parameters
//! back. On a CUDA device (`cuda` feature) that runs behind the backward: the gradients go out on
//! a side stream into one pinned staging block per bucket, a host thread steps the bucket as soon
//! as its copy lands and queues the parameters' copy back on a second stream, and
//! [`Optimizer::finish_steps`] (which `InBackward` calls at the end of every backward that
//! stepped, and `step_with(StepParams::All)` itself) waits for the host and orders the compute
//! stream after the copies back. At most [`OffloadConfig::buckets_in_flight`] buckets wait for
//! the host at once (their staging blocks are the pinned memory offload takes, from the backend's
//! pinned pool and under its budget). On the CPU backend the same host step runs in the call.
//!
//! The result is bitwise the on-device optimizer's: `Adam` (f32) or `AdamStochastic` (bf16, the
//! same random stream, keyed by the seed, the parameter's index and its step), whose CUDA kernels
//! compute the CPU kernels' bits.
//!
//! The host copy of a parameter is what the next step updates. A parameter changed through a
//! tensor op since the last step (its version counter moved: loading a checkpoint, a manual
//! edit) is read back from the device first, so nothing written to it is lost.
//!
//! It sits on the host slots (`offload_state.rs`: the moments, the host copy, the host step), the
//! step vocabulary and the [`Optimizer`] trait, and with `cuda` on `cuda/offload.rs`; it knows no
//! model and no hook.

use std::collections::HashMap;
use std::sync::Arc;

use headroom_autograd_core::{DType, Device, Tensor};
use parking_lot::Mutex;
use safetensors::tensor::TensorView;

use crate::error::OptimError;
use crate::kernels::{bf16, AdamConfig, StepOutcome};
use crate::offload_state::{HostSlot, NamedMoment, SavedSlot, NAME};
use crate::optimizer::Optimizer;
use crate::step::{ParamId, Scaling, StepParams};

/// Buckets that may wait for the host at once by default: enough to keep the copy engines and
/// the host busy while backward produces the next ones, few enough that their pinned staging
/// stays a small multiple of a bucket.
pub const DEFAULT_BUCKETS_IN_FLIGHT: usize = 4;

/// What an [`OffloadedAdam`] steps with.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadConfig {
    /// The update (Adam or AdamW; `amsgrad` keeps a third host buffer).
    pub adam: AdamConfig,
    /// Seeds the stochastic rounding of bf16 parameters (as `AdamStochasticConfig::seed`).
    pub seed: u64,
    /// With [`OffloadStepper::Host`]: buckets whose gradients may wait for the host at once
    /// (at least 1); a step that would queue one more first waits for the oldest.
    pub buckets_in_flight: usize,
    /// bf16 parameters keep an f32 master copy on the host (4 more bytes a parameter there):
    /// Adam steps the master and the parameter is its rounding to nearest, as amp's
    /// `MasterWeights` over `Adam` does on the device. Off: the parameter is updated in bf16 with
    /// stochastic rounding (`seed`). f32 parameters are their own master either way.
    pub master_weights: bool,
    /// Who steps the state: the host ([`OffloadStepper::Host`]) or the GPU, streaming it in
    /// and out ([`OffloadStepper::Device`]).
    pub stepper: OffloadStepper,
    /// With [`OffloadStepper::Device`]: the bytes of moments the GPU may hold fetched ahead of
    /// the bucket being stepped (and as many on their way back). More lets the copies in start
    /// during the forward and overlap more of the step, at up to twice that much GPU memory.
    pub stream_bytes: u64,
}

/// [`OffloadConfig::stream_bytes`]'s default: 1 GiB.
pub const DEFAULT_STREAM_BYTES: u64 = 1 << 30;

/// Who steps an [`OffloadedAdam`]'s state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadStepper {
    /// The host steps it with the CPU kernels: a gradient goes out and a parameter comes back
    /// per step (2 bytes each way for bf16), and the host reads and writes the moments and its
    /// copy of the parameter (about 24 bytes a bf16 parameter) — for hosts with fast CPUs and
    /// memory.
    #[default]
    Host,
    /// The moments live in pinned host memory and stream through the GPU, which steps them
    /// with the on-device fused kernels (8 bytes a parameter each way, 12 with AMSGrad; the
    /// gradients and parameters never leave the device) — for hosts whose CPUs are slow; the
    /// GPU holds up to [`OffloadConfig::stream_bytes`] of moments coming in and as many going
    /// back. On CUDA only (the CPU backend steps on the host either way); no `master_weights`.
    Device,
}

impl OffloadConfig {
    /// `adam` with seed 0 and [`DEFAULT_BUCKETS_IN_FLIGHT`].
    pub fn new(adam: AdamConfig) -> OffloadConfig {
        OffloadConfig {
            adam,
            seed: 0,
            buckets_in_flight: DEFAULT_BUCKETS_IN_FLIGHT,
            master_weights: false,
            stepper: OffloadStepper::Host,
            stream_bytes: DEFAULT_STREAM_BYTES,
        }
    }

    fn validate(&self) -> Result<(), OptimError> {
        self.adam.validate()?;
        if self.buckets_in_flight == 0 {
            return Err(OptimError::InvalidArgument {
                op: NAME,
                reason: "buckets_in_flight is 0; use 1 to step one bucket at a time".into(),
            });
        }
        if self.master_weights && self.stepper == OffloadStepper::Device {
            return Err(OptimError::InvalidArgument {
                op: NAME,
                reason: "master_weights with OffloadStepper::Device: the device stepper keeps \
                         no master copy; use OffloadStepper::Host for f32 masters"
                    .into(),
            });
        }
        Ok(())
    }
}

/// Adam or AdamW with its state in host memory, stepped by the host (see the module docs).
///
/// ```
/// use headroom_autograd_core::Tensor;
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{AdamConfig, OffloadConfig, OffloadedAdam, Optimizer};
///
/// let cpu = CpuBackend::new_ref();
/// let w = Tensor::from_slice(&cpu, &[1.0f32, -2.0], &[2])?;
/// w.requires_grad_(true)?;
/// let mut adam = OffloadedAdam::new(vec![w.clone()], OffloadConfig::new(AdamConfig::adamw()))?;
/// w.mul(&w)?.sum_all()?.backward()?;
/// adam.step()?;
/// // AdamW's first step moves each weight by about lr (1e-3) against its gradient.
/// let moved = w.to_vec::<f32>()?;
/// assert!((moved[0] - 0.999).abs() < 1e-4 && (moved[1] + 1.999).abs() < 1e-4);
/// assert_eq!(adam.host_state_bytes(), 2 * 4 * 3); // moments and the host copy, f32
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct OffloadedAdam {
    config: OffloadConfig,
    params: Vec<Tensor>,
    slots: Arc<Vec<Mutex<HostSlot>>>,
    transport: Mutex<Transport>,
}

impl std::fmt::Debug for OffloadedAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadedAdam")
            .field("config", &self.config)
            .field("params", &self.params.len())
            .field("host_state_bytes", &self.host_state_bytes())
            .finish()
    }
}

/// The moments' state-dict names, in the order a device-stepped parameter keeps them.
#[cfg(feature = "cuda")]
const MOMENT_NAMES: [&str; 3] = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"];

/// How gradients reach the host and parameters come back.
enum Transport {
    /// CPU tensors: the host steps in the call.
    Host,
    /// A CUDA device: side streams and a host thread.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::offload::CudaOffload),
    /// A CUDA device stepping the moments it streams in and out.
    #[cfg(feature = "cuda")]
    Streamed(Box<crate::cuda::offload_stream::StreamedOffload>),
}

impl OffloadedAdam {
    /// An optimizer over `params` (contiguous f32 or bf16 tensors of one device), with no state
    /// yet: each parameter's host state is created at its first step.
    pub fn new(params: Vec<Tensor>, config: OffloadConfig) -> Result<OffloadedAdam, OptimError> {
        config.validate()?;
        let device = params.first().map(Tensor::device).unwrap_or(Device::Cpu);
        for param in &params {
            check_param(param, device)?;
        }
        crate::host::check_disjoint(NAME, &params.iter().collect::<Vec<_>>())?;
        let transport = match device {
            Device::Cpu => Transport::Host,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) if config.stepper == OffloadStepper::Device => {
                Transport::Streamed(Box::new(crate::cuda::offload_stream::StreamedOffload::new(
                    &params,
                    config.adam.amsgrad,
                    config.stream_bytes,
                )?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Transport::Cuda(crate::cuda::offload::CudaOffload::new(
                &params[0],
                config.buckets_in_flight,
            )?),
            #[cfg(not(feature = "cuda"))]
            other => {
                return Err(OptimError::UnsupportedTensor {
                    op: NAME,
                    reason: format!(
                        "parameters on {other:?}; build headroom-optim with its `cuda` feature"
                    ),
                })
            }
        };
        let slots = params
            .iter()
            .enumerate()
            .map(|(index, param)| {
                Mutex::new(HostSlot::new(index, param.clone(), config.master_weights))
            })
            .collect();
        Ok(OffloadedAdam {
            config,
            params,
            slots: Arc::new(slots),
            transport: Mutex::new(transport),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &OffloadConfig {
        &self.config
    }

    /// Bytes of host memory the state holds (moments and the parameters' host copies), after
    /// the steps queued so far.
    pub fn host_state_bytes(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Transport::Streamed(streamed) = &*self.transport.lock() {
            return streamed.state_bytes();
        }
        self.slots
            .iter()
            .map(|slot| slot.lock().state_bytes())
            .sum()
    }

    /// How many steps parameter `index` has taken (after the steps queued so far).
    pub fn param_step(&self, index: usize) -> Result<u64, OptimError> {
        self.finish_queued()?;
        let slot = self
            .slots
            .get(index)
            .ok_or(OptimError::UnknownParameter { optimizer: NAME })?;
        #[cfg(feature = "cuda")]
        if let Transport::Streamed(streamed) = &*self.transport.lock() {
            return Ok(streamed.step(index));
        }
        let step = slot.lock().step();
        Ok(step)
    }

    /// Waits for the steps queued so far and reports their first error.
    fn finish_queued(&self) -> Result<(), OptimError> {
        match &mut *self.transport.lock() {
            Transport::Host => Ok(()),
            #[cfg(feature = "cuda")]
            Transport::Cuda(cuda) => cuda.finish(),
            #[cfg(feature = "cuda")]
            Transport::Streamed(streamed) => streamed.finish(),
        }
    }

    /// The slots of `params`, ascending and distinct.
    fn selected(&self, params: StepParams<'_>) -> Result<Vec<usize>, OptimError> {
        let mut slots: Vec<usize> = match params {
            StepParams::All => (0..self.params.len()).collect(),
            StepParams::Only(ids) => ids.iter().map(|id| id.index()).collect(),
        };
        if slots.iter().any(|&slot| slot >= self.params.len()) {
            return Err(OptimError::UnknownParameter { optimizer: NAME });
        }
        slots.sort_unstable();
        if slots.windows(2).any(|w| w[0] == w[1]) {
            return Err(OptimError::InvalidArgument {
                op: NAME,
                reason: "a parameter is listed twice in one step".into(),
            });
        }
        Ok(slots)
    }
}

impl Drop for OffloadedAdam {
    fn drop(&mut self) {
        // The host thread finishes what is queued; errors have no one left to report to.
        let _ = self.finish_queued();
    }
}

/// Checks that `param` is a contiguous f32 or bf16 tensor on `device`.
fn check_param(param: &Tensor, device: Device) -> Result<(), OptimError> {
    if param.device() != device {
        return Err(OptimError::MixedDevices {
            op: NAME,
            expected: device,
            got: param.device(),
        });
    }
    if !matches!(param.dtype(), DType::F32 | DType::BF16) {
        return Err(OptimError::DType {
            op: NAME,
            expected: DType::F32,
            got: param.dtype(),
        });
    }
    if !param.is_contiguous() {
        return Err(OptimError::NonContiguous {
            op: NAME,
            shape: param.shape().to_vec(),
            strides: param.layout().strides().to_vec(),
        });
    }
    Ok(())
}

/// Checks `grad` against its parameter: same dtype, shape and device, contiguous.
pub(crate) fn check_grad(param: &Tensor, grad: &Tensor) -> Result<(), OptimError> {
    check_param(grad, param.device())?;
    crate::optimizer::check_grad_like(param, grad)
}

/// One step of CPU parameters, in the call: each gradient is read into an aligned buffer, the
/// host steps it, and the new values are written into the parameter.
fn step_on_host(
    slots: &[Mutex<HostSlot>],
    selected: &[(usize, Tensor)],
    config: &OffloadConfig,
) -> Result<(), OptimError> {
    for (index, grad) in selected {
        let mut slot = slots[*index].lock();
        slot.sync_from_device(config.adam.amsgrad)?;
        let bytes = grad.numel() * grad.dtype().size_in_bytes();
        let mut staging = vec![0u64; bytes.div_ceil(8)];
        let region = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut staging)[..bytes];
        match grad.dtype() {
            DType::BF16 => region.copy_from_slice(bytemuck::cast_slice(&grad.to_vec::<bf16>()?)),
            _ => region.copy_from_slice(bytemuck::cast_slice(&grad.to_vec::<f32>()?)),
        }
        slot.update(&config.adam, config.seed, region)?;
        let param = &slot.param;
        let offset = param.layout().offset() * param.dtype().size_in_bytes();
        param.backend().write_host(param.buffer(), offset, region)?;
        slot.mark_synced();
    }
    Ok(())
}

impl Optimizer for OffloadedAdam {
    fn name(&self) -> &'static str {
        NAME
    }

    fn n_groups(&self) -> usize {
        1
    }

    fn lr(&self, _group: usize) -> f64 {
        self.config.adam.lr
    }

    fn set_lr(&mut self, _group: usize, lr: f64) {
        self.config.adam.lr = lr;
    }

    fn params(&self) -> Vec<(ParamId, Tensor)> {
        self.params
            .iter()
            .enumerate()
            .map(|(index, param)| (ParamId(index), param.clone()))
            .collect()
    }

    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        self.params
            .iter()
            .position(|p| {
                p.same_tensor(param)
                    || (crate::host::byte_range(p) == crate::host::byte_range(param)
                        && p.device() == param.device()
                        && p.shape() == param.shape())
            })
            .map(ParamId)
            .ok_or(OptimError::UnknownParameter { optimizer: NAME })
    }

    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        if !matches!(scaling, Scaling::None) {
            return Err(OptimError::Unsupported {
                optimizer: NAME,
                reason: "a gradient scale: unscale the gradients first (a GradScaler's host path)"
                    .into(),
            });
        }
        let selected = self.selected(params)?;
        let mut with_grads = Vec::with_capacity(selected.len());
        for index in selected {
            if let Some(grad) = self.params[index].grad() {
                check_grad(&self.params[index], &grad)?;
                with_grads.push((index, grad));
            }
        }
        match &mut *self.transport.lock() {
            Transport::Host => step_on_host(&self.slots, &with_grads, &self.config)?,
            #[cfg(feature = "cuda")]
            Transport::Cuda(cuda) => {
                cuda.submit(&self.slots, with_grads, &self.config.adam, self.config.seed)?;
                if matches!(params, StepParams::All) {
                    cuda.finish()?;
                }
            }
            #[cfg(feature = "cuda")]
            Transport::Streamed(streamed) => {
                streamed.submit(with_grads, &self.config.adam, self.config.seed)?;
                if matches!(params, StepParams::All) {
                    streamed.finish()?;
                }
            }
        }
        Ok(StepOutcome::Stepped)
    }

    fn finish_steps(&mut self) -> Result<(), OptimError> {
        self.finish_queued()
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        // A gradient still being copied out must not be zeroed under the copy.
        self.finish_queued()?;
        for param in &self.params {
            param.zero_grad(set_to_none)?;
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        self.finish_queued()?;
        let mut metadata = HashMap::new();
        metadata.insert("optimizer".to_string(), NAME.to_string());
        metadata.insert(
            "group.0.lr".to_string(),
            format!("{:?}", self.config.adam.lr),
        );
        metadata.insert("group.0.config".to_string(), format!("{:?}", self.config));
        let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut add = |index: usize, step: u64, moments: Vec<NamedMoment<'_>>| {
            metadata.insert(format!("state.0.{index}.step"), step.to_string());
            for (name, values) in moments {
                blobs.push((
                    format!("state.0.{index}.{name}"),
                    self.params[index].shape().to_vec(),
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ));
            }
        };
        #[cfg(feature = "cuda")]
        if let Transport::Streamed(streamed) = &mut *self.transport.lock() {
            streamed.settle()?;
            for index in 0..self.params.len() {
                if let Some((step, moments)) = streamed.saved(index)? {
                    add(
                        index,
                        step,
                        MOMENT_NAMES
                            .into_iter()
                            .zip(&moments)
                            .map(|(n, m)| (n, m.as_slice()))
                            .collect(),
                    );
                }
            }
        }
        for (index, slot) in self.slots.iter().enumerate() {
            let slot = slot.lock();
            if let Some((step, moments)) = slot.saved() {
                add(index, step, moments);
            }
        }
        let views = blobs
            .iter()
            .map(|(name, shape, bytes)| {
                Ok((
                    name.clone(),
                    TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)?,
                ))
            })
            .collect::<Result<Vec<_>, OptimError>>()?;
        Ok(safetensors::serialize(views, &Some(metadata))?)
    }

    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        self.finish_queued()?;
        let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes)?;
        let metadata = metadata.metadata().clone().unwrap_or_default();
        if metadata.get("optimizer").map(String::as_str) != Some(NAME) {
            return Err(OptimError::StateDict(format!(
                "a state dict of {:?}, not of {NAME}",
                metadata.get("optimizer")
            )));
        }
        let tensors = safetensors::SafeTensors::deserialize(bytes)?;
        let mut restored = Vec::with_capacity(self.slots.len());
        for (index, param) in self.params.iter().enumerate() {
            let Some(step) = metadata.get(&format!("state.0.{index}.step")) else {
                restored.push(None);
                continue;
            };
            let step: u64 = step
                .parse()
                .map_err(|_| OptimError::StateDict(format!("state.0.{index}.step: {step:?}")))?;
            let read = |name: &str| -> Result<Vec<f32>, OptimError> {
                let key = format!("state.0.{index}.{name}");
                let view = tensors
                    .tensor(&key)
                    .map_err(|_| OptimError::StateDict(format!("missing {key}")))?;
                if view.dtype() != safetensors::Dtype::F32 || view.shape() != param.shape() {
                    return Err(OptimError::StateDict(format!(
                        "{key} is {:?} {:?}, expected F32 {:?}",
                        view.dtype(),
                        view.shape(),
                        param.shape()
                    )));
                }
                Ok(view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect())
            };
            let exp_avg = read("exp_avg")?;
            let exp_avg_sq = read("exp_avg_sq")?;
            let keeps_master = self.config.master_weights && param.dtype() == DType::BF16;
            let master = keeps_master.then(|| read("master_weight")).transpose()?;
            let max_exp_avg_sq = self
                .config
                .adam
                .amsgrad
                .then(|| read("max_exp_avg_sq"))
                .transpose()?;
            restored.push(Some(SavedSlot {
                step,
                exp_avg,
                exp_avg_sq,
                max_exp_avg_sq,
                master,
            }));
        }
        #[cfg(feature = "cuda")]
        if let Transport::Streamed(streamed) = &mut *self.transport.lock() {
            streamed.settle()?;
            for (index, restored) in restored.into_iter().enumerate() {
                let moments = restored.map(|saved| {
                    let max = saved.max_exp_avg_sq.into_iter();
                    let moments = [saved.exp_avg, saved.exp_avg_sq].into_iter().chain(max);
                    (saved.step, moments.collect())
                });
                streamed.restore(index, moments)?;
            }
            return Ok(());
        }
        for (slot, restored) in self.slots.iter().zip(restored) {
            slot.lock().restore(restored);
        }
        Ok(())
    }
}
