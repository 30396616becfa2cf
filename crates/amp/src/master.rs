//! fp32 master weights for a low-precision model (apex O2), as a decorator over any optim
//! [`Optimizer`].
//!
//! The model's parameters are f16 or bf16 (forward and backward run in that dtype, gradients
//! arrive in it); [`MasterWeights`] keeps an f32 copy of each, and the wrapped optimizer is built
//! over the copies, so its update and its state are f32. A step widens the gradients of a bucket
//! of parameters to f32 into the masters' `.grad`, steps the optimizer on that bucket (one
//! multi-tensor call), rounds the masters back into the model's parameters, and frees the f32
//! gradients: the f32 temporaries are bounded by the bucket (25 MiB by default), not by the
//! model. A GradScaler on top passes its scaling through: the optimizer's kernels divide the f32
//! gradients by the scale and skip an overflowed step (a skipped step leaves the masters, and so
//! the rounded parameters, as they were). Memory per parameter with Adam: 2 (model) + 2
//! (gradient) + 4 (master) + 8 (moments) = 16 bytes; [`AdamStochastic`](headroom_optim::AdamStochastic)
//! trains bf16 parameters in 12 without a master copy.
//!
//! This module knows no rule and no kernel: it steps through the `Optimizer` trait and casts
//! with autograd-core's ops.

use std::collections::HashMap;

use headroom_autograd_core::{no_grad, DType, Tensor};
use headroom_optim::kernels::StepOutcome;
use headroom_optim::{OptimError, Optimizer, ParamId, Scaling, StepParams};

use crate::error::AmpError;
use crate::state::{read_state, write_state, RawTensor};

/// f32 gradient bytes a step widens at once by default (one optimizer call per bucket).
pub const DEFAULT_MASTER_BUCKET_BYTES: u64 = 25 << 20;

/// An optimizer over f32 master copies of a low-precision model's parameters.
///
/// ```
/// use headroom_amp::MasterWeights;
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_ops_cpu::CpuBackend;
/// use headroom_optim::{Implementation, Optimizer, ParamGroup, Sgd, SgdConfig};
///
/// let cpu = CpuBackend::new_ref();
/// let p = Tensor::ones(&cpu, &[4], DType::BF16)?;
/// p.requires_grad_(true)?;
/// let mut opt = MasterWeights::new(vec![p.clone()], |masters| {
///     Sgd::new(vec![ParamGroup::new(masters, SgdConfig::new(1e-3))], Implementation::Fused)
/// })?;
/// for _ in 0..4 {
///     p.sum_all()?.backward()?;
///     opt.step()?;
///     opt.zero_grad(true)?;
/// }
/// // 1 - 4e-3 in f32, rounded to bf16 once: plain bf16 SGD would have lost every 1e-3 step.
/// assert!((opt.masters()[0].to_vec::<f32>()?[0] - 0.996).abs() < 1e-6);
/// assert_eq!(p.to_vec_f64()?[0], 0.99609375);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct MasterWeights<O> {
    model: Vec<Tensor>,
    masters: Vec<Tensor>,
    inner: O,
    /// The wrapped optimizer's handle of each master, in model order.
    inner_ids: Vec<ParamId>,
    /// Model order of each handle.
    index_of: HashMap<ParamId, usize>,
    bucket_bytes: u64,
}

impl<O: Optimizer> MasterWeights<O> {
    /// f32 copies of `model` (f16 or bf16 parameters) and the optimizer `build` makes over them.
    pub fn new(
        model: Vec<Tensor>,
        build: impl FnOnce(Vec<Tensor>) -> Result<O, OptimError>,
    ) -> Result<MasterWeights<O>, AmpError> {
        let _no_grad = no_grad();
        let mut masters = Vec::with_capacity(model.len());
        for (index, param) in model.iter().enumerate() {
            if !matches!(param.dtype(), DType::F16 | DType::BF16) {
                return Err(AmpError::ParameterDType {
                    index,
                    got: param.dtype(),
                    why: "master weights keep f32 copies of f16 or bf16 parameters (train an f32 \
                          parameter with the optimizer directly)"
                        .into(),
                });
            }
            masters.push(param.detach().to_dtype(DType::F32)?);
        }
        let inner = build(masters.clone())?;
        let inner_ids = masters
            .iter()
            .map(|master| inner.param_id(master))
            .collect::<Result<Vec<_>, _>>()?;
        let index_of = inner_ids
            .iter()
            .enumerate()
            .map(|(i, id)| (*id, i))
            .collect();
        Ok(MasterWeights {
            model,
            masters,
            inner,
            inner_ids,
            index_of,
            bucket_bytes: DEFAULT_MASTER_BUCKET_BYTES,
        })
    }

    /// The same with f32 gradients widened `bucket_bytes` at a time (at least one parameter).
    pub fn with_bucket_bytes(mut self, bucket_bytes: u64) -> MasterWeights<O> {
        self.bucket_bytes = bucket_bytes;
        self
    }

    /// The f32 master copies, in the model's order.
    pub fn masters(&self) -> &[Tensor] {
        &self.masters
    }

    /// The model's parameters.
    pub fn model_params(&self) -> &[Tensor] {
        &self.model
    }

    /// The wrapped optimizer (over the masters).
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, to change its settings.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Steps the parameters at `indices` (model order) that have a gradient, bucket by bucket.
    fn step_indices(
        &mut self,
        indices: &[usize],
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        let with_grads: Vec<usize> = indices
            .iter()
            .copied()
            .filter(|&i| self.model[i].grad().is_some())
            .collect();
        let mut outcome = StepOutcome::Stepped;
        let mut start = 0;
        while start < with_grads.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < with_grads.len() && (end == start || bytes < self.bucket_bytes) {
                bytes += 4 * self.model[with_grads[end]].numel() as u64;
                end += 1;
            }
            let bucket = &with_grads[start..end];
            {
                let _no_grad = no_grad();
                for &i in bucket {
                    let grad = self.model[i].grad().expect("filtered above");
                    self.masters[i].set_grad(Some(grad.to_dtype(DType::F32)?))?;
                }
            }
            let ids: Vec<ParamId> = bucket.iter().map(|&i| self.inner_ids[i]).collect();
            let stepped = self.inner.step_with(StepParams::Only(&ids), scaling);
            let _no_grad = no_grad();
            for &i in bucket {
                self.masters[i].set_grad(None)?;
            }
            if stepped? == StepOutcome::Skipped {
                outcome = StepOutcome::Skipped;
            }
            // An asynchronous inner optimizer (host offload) lands the masters' updates here.
            self.inner.finish_steps()?;
            for &i in bucket {
                self.model[i].copy_(&self.masters[i])?;
            }
            start = end;
        }
        Ok(outcome)
    }
}

impl<O: Optimizer> Optimizer for MasterWeights<O> {
    fn name(&self) -> &'static str {
        self.inner.name()
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

    /// The model's parameters (whose gradients a step reads), each with the wrapped
    /// optimizer's handle of its master.
    fn params(&self) -> Vec<(ParamId, Tensor)> {
        self.inner_ids
            .iter()
            .copied()
            .zip(self.model.iter().cloned())
            .collect()
    }

    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        self.model
            .iter()
            .position(|p| p.same_tensor(param))
            .map(|i| self.inner_ids[i])
            .ok_or(OptimError::UnknownParameter {
                optimizer: "MasterWeights",
            })
    }

    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        let indices: Vec<usize> = match params {
            StepParams::All => (0..self.model.len()).collect(),
            StepParams::Only(ids) => ids
                .iter()
                .map(|id| {
                    self.index_of
                        .get(id)
                        .copied()
                        .ok_or(OptimError::UnknownParameter {
                            optimizer: "MasterWeights",
                        })
                })
                .collect::<Result<_, _>>()?,
        };
        self.step_indices(&indices, scaling)
    }

    fn takes_device_scaling(&self) -> bool {
        self.inner.takes_device_scaling()
    }

    fn finish_steps(&mut self) -> Result<(), OptimError> {
        self.inner.finish_steps()
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        for param in &self.model {
            param.zero_grad(set_to_none)?;
        }
        Ok(())
    }

    /// The wrapped optimizer's state dict with the masters (`master_weights.{i}`, f32).
    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        let inner = self.inner.state_dict()?;
        let mut tensors = Vec::with_capacity(self.masters.len());
        for (i, master) in self.masters.iter().enumerate() {
            let bytes = master
                .to_vec::<f32>()?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            let raw = RawTensor {
                dtype: safetensors::Dtype::F32,
                shape: master.shape().to_vec(),
                bytes,
            };
            tensors.push((format!("master_weights.{i}"), raw));
        }
        let count = [("master_weights.count", self.masters.len().to_string())];
        write_state(&inner, &count, tensors).map_err(OptimError::from)
    }

    /// Restores the wrapped optimizer and the masters, and rounds the masters into the model.
    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        let saved = read_state(bytes, "master_weights.").map_err(OptimError::from)?;
        let _no_grad = no_grad();
        let mut values = Vec::with_capacity(self.masters.len());
        for (i, master) in self.masters.iter().enumerate() {
            let raw = saved
                .tensors
                .get(&format!("master_weights.{i}"))
                .ok_or_else(|| {
                    OptimError::StateDict(format!(
                        "no master_weights.{i} (saved by MasterWeights?)"
                    ))
                })?;
            if raw.dtype != safetensors::Dtype::F32 || raw.shape != master.shape() {
                return Err(OptimError::StateDict(format!(
                    "master_weights.{i} is {:?} {:?}, expected F32 {:?}",
                    raw.dtype,
                    raw.shape,
                    master.shape()
                )));
            }
            let floats: Vec<f32> = raw
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            values.push(floats);
        }
        self.inner.load_state_dict(&saved.inner)?;
        for ((master, model), floats) in self.masters.iter().zip(&self.model).zip(values) {
            let loaded = Tensor::from_slice(master.backend(), &floats, master.shape())?;
            master.copy_(&loaded)?;
            model.copy_(master)?;
        }
        Ok(())
    }
}
