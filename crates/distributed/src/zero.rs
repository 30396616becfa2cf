//! [`ShardedOptimizer`]: ZeRO-1 and ZeRO-2 — every rank keeps the whole model, updates only its
//! shard of each parameter with any element-wise optim rule, and all-gathers the rest.
//!
//! A step of a bucket of parameters is three moves: the bucket's gradients, packed in rows
//! (`crate::layout`), are reduce-scattered — summed over ranks in a fixed order and scaled by
//! `1 / world_size`, the gradient of the global batch's mean loss — so each rank holds the
//! averaged gradient of its shards only; the wrapped optimizer (built over the shards, so its
//! state is `1 / world_size` of a replicated one's) steps those shards; the ranks' updated shards
//! are all-gathered back into every rank's parameters. Bytes moved per step: one reduce-scatter
//! and one all-gather of the (padded) parameters, what a ring all-reduce of the gradients — plain
//! data parallelism — moves.
//!
//! How it is driven makes the stage:
//! - **ZeRO-1** (optimizer state sharded): as an ordinary optimizer after a plain backward,
//!   `step()` reduce-scatters every gradient in buckets of [`ShardConfig::bucket_bytes`], updates
//!   and all-gathers. The full gradients stay in `.grad` (`zero_grad` clears them) — ZeRO-1's
//!   memory. Accumulating micro-batches is backwards without a step: no communication at all.
//! - **ZeRO-2** (gradients sharded too): inside backward, through hooks' [`InBackward`]
//!   ([`ShardedOptimizer::into_in_backward`]). Each bucket InBackward steps with
//!   `step_with(Only(bucket))` as its gradients become final is reduce-scattered at once, each
//!   full gradient freed as soon as it is packed: a rank never holds more than a bucket of full
//!   gradients. A bucket of one parameter that the ranks divide needs no packing: its gradient is
//!   reduce-scattered as it is, and the parameter all-gathered in place. Without clipping the bucket's shards are updated and all-gathered at once;
//!   with clipping the shards' gradients (`1 / world_size` of the gradients) are held until the
//!   end of the pass, where the exact global norm is taken and every held bucket updated and
//!   gathered. InBackward's accumulation makes its first `k − 1` passes no-sync micro-steps
//!   (gradients stay in `.grad`, nothing is communicated).
//!
//! Clipping is exact across ranks: each rank takes the norm of its averaged shard gradients with
//! optim's `clip_grad_norm_`, the squares are all-reduced in f64 (the maxima, for the inf norm),
//! and the coefficient `min(1, max_norm / (total + 1e-6))` is PyTorch's. It equals the norm of the
//! global gradient up to the order of the float sums (parts per shard instead of per parameter).
//!
//! Loss scaling (fp16): a step's scaling (from amp's `GradScaler::step`, or hooks'
//! `InBackward::backward_scaled` with any optim `LossScaler`) reaches the shards' fused kernels,
//! which divide by the scale and skip on overflow. Each rank's overflow flag covers its own
//! gradients, so the flags are first all-reduced to their maximum — once per step, before any
//! shard is updated — and every rank skips or steps together; a clipped step's global norm is
//! divided by the scale, as a single rank's is.
//!
//! Requirements: the rule is element-wise (Adafactor's factored statistics need whole rows and
//! are refused); every rank has gradients for the same parameters and steps the same buckets in
//! the same order (the same model and graph on every rank, as DDP without
//! `find_unused_parameters`); under a loss scale, the fused implementation.
//!
//! It sits on the [`Communicator`] trait, optim's [`Optimizer`] trait and hooks' [`InBackward`];
//! it knows no transport, kernel or device.

use std::collections::HashMap;
use std::sync::Arc;

use headroom_autograd_core::{
    backward_pass_id, no_grad, queue_backward_end_callback, DType, Tensor, TensorError,
};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_optim::kernels::StepOutcome;
use headroom_optim::{
    clip_grad_norm_, DeviceGradScaling, GroupOptimizer, Implementation, NormType, OptimError,
    Optimizer, ParamGroup, ParamId, Scaling, StepParams, UpdateRule,
};
use parking_lot::Mutex;

use crate::comm::{Communicator, ReduceOp};
use crate::error::DistributedError;
use crate::layout::{gather_rows, make_shard, scatter_rows, ShardLayout};

/// How a [`ShardedOptimizer`] steps. No `Default`: the bucket size and the clipping are the
/// caller's choice (hooks' `DEFAULT_BUCKET_BYTES`, 25 MiB, is DDP's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardConfig {
    /// Gradient bytes per reduce-scatter when `step()` reduces every gradient (ZeRO-1); under
    /// InBackward (ZeRO-2) its buckets are the communication buckets.
    pub bucket_bytes: u64,
    /// Exact global-norm clipping across ranks, if any.
    pub clipping: Option<ShardClipping>,
}

/// Global gradient-norm clipping over every rank's gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardClipping {
    /// The largest norm the update sees.
    pub max_norm: f64,
    /// L2 or inf.
    pub norm: NormType,
}

/// What a [`ShardedOptimizer`] has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardStats {
    /// Buckets reduce-scattered.
    pub buckets_reduced: u64,
    /// Buckets updated and all-gathered.
    pub buckets_gathered: u64,
    /// Global norms taken (clipped steps).
    pub norms: u64,
}

/// ZeRO-1 / ZeRO-2 over any element-wise optim rule. See the module docs.
///
/// ```
/// use std::sync::Arc;
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_distributed::{Communicator, InProcessGroup, ShardConfig, ShardedOptimizer};
/// use headroom_optim::{Implementation, Optimizer, ParamGroup, SgdConfig};
///
/// let ranks = InProcessGroup::ranks(2)?;
/// let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
///     let handles: Vec<_> = ranks.into_iter().map(|comm| scope.spawn(move || {
///         let cpu = headroom_ops_cpu::CpuBackend::new_ref();
///         let w = Tensor::from_slice(&cpu, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
///         w.requires_grad_(true).unwrap();
///         let comm: Arc<dyn Communicator> = Arc::new(comm);
///         let rank = comm.rank() as f64;
///         let groups = vec![ParamGroup::new(vec![w.clone()], SgdConfig::new(1.0))];
///         let config = ShardConfig { bucket_bytes: 1 << 20, clipping: None };
///         let mut sgd = ShardedOptimizer::new(groups, Implementation::Fused, comm, config).unwrap();
///         // Rank 0's gradient is 1, rank 1's is 3: the step uses their mean, 2.
///         w.mul_scalar(2.0 * rank + 1.0).unwrap().sum_all().unwrap().backward().unwrap();
///         sgd.step().unwrap();
///         w.to_vec::<f32>().unwrap()
///     })).collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(results, [[-1.0, 0.0, 1.0], [-1.0, 0.0, 1.0]]);
/// # Ok::<(), headroom_distributed::DistributedError>(())
/// ```
pub struct ShardedOptimizer {
    engine: Arc<Mutex<Engine>>,
}

/// A view of a [`ShardedOptimizer`]'s counters and layout that stays usable after the optimizer
/// was handed to an [`InBackward`].
#[derive(Clone)]
pub struct ShardedHandle {
    engine: Arc<Mutex<Engine>>,
}

impl std::fmt::Debug for ShardedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedHandle")
            .field("stats", &self.stats())
            .finish()
    }
}

impl ShardedHandle {
    /// What the optimizer has done so far.
    pub fn stats(&self) -> ShardStats {
        self.engine.lock().stats
    }

    /// How the parameters are split.
    pub fn layout(&self) -> ShardLayout {
        self.engine.lock().layout.clone()
    }
}

/// What a reduce does with the model's gradients once packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gradients {
    /// Leave them in `.grad` (a plain step: the caller clears them).
    Keep,
    /// Free them (in backward: InBackward would free them after the step anyway).
    Free,
}

/// The state the optimizer and its end-of-pass callback share.
struct Engine {
    comm: Arc<dyn Communicator>,
    /// The rule over this rank's shards, one group per model group.
    inner: Box<dyn Optimizer>,
    /// The model's parameters, in optimizer order.
    params: Vec<Tensor>,
    /// This rank's shard of each.
    shards: Vec<Tensor>,
    /// The inner optimizer's handle of each shard.
    inner_ids: Vec<ParamId>,
    index_of: HashMap<ParamId, usize>,
    layout: ShardLayout,
    config: ShardConfig,
    /// Buckets reduced in this pass whose update waits for the global norm.
    held: Vec<Vec<usize>>,
    /// The backward pass the end callback is queued for.
    queued_pass: Option<u64>,
    /// The current step's loss scaling, its overflow flag agreed across ranks.
    scaling: Option<DeviceGradScaling>,
    /// The backward pass whose overflow flag was agreed (reduced once per pass).
    agreed_pass: Option<u64>,
    /// Whether the last update skipped (its flag was set).
    skipped: bool,
    stats: ShardStats,
}

impl std::fmt::Debug for ShardedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let engine = self.engine.lock();
        f.debug_struct("ShardedOptimizer")
            .field("inner", &engine.inner.name())
            .field("rank", &engine.layout.rank)
            .field("world_size", &engine.layout.world_size)
            .field("params", &engine.params.len())
            .field("config", &engine.config)
            .finish()
    }
}

impl ShardedOptimizer {
    /// The rule `R` over this rank's shards of `groups`' parameters (same groups, same
    /// hyperparameters), in `implementation`, communicating through `comm`. Every rank must build
    /// it from the same parameters (same shapes, same order) and the same initial values.
    pub fn new<R: UpdateRule>(
        groups: Vec<ParamGroup<R>>,
        implementation: Implementation,
        comm: Arc<dyn Communicator>,
        config: ShardConfig,
    ) -> Result<ShardedOptimizer, DistributedError> {
        if R::NAME == "Adafactor" {
            return Err(DistributedError::InvalidArgument {
                op: "ShardedOptimizer::new",
                reason: "Adafactor factors each gradient's square by rows and columns, which a \
                         shard of the flattened parameter does not have; shard an element-wise \
                         rule (SGD, Adam, AdamW, Adam8bit)"
                    .into(),
            });
        }
        if let Some(clipping) = config.clipping {
            if !(clipping.max_norm.is_finite() && clipping.max_norm > 0.0) {
                return Err(DistributedError::InvalidArgument {
                    op: "ShardedOptimizer::new",
                    reason: format!("max_norm {} is not a positive number", clipping.max_norm),
                });
            }
        }
        let params: Vec<Tensor> = groups.iter().flat_map(|g| g.params.clone()).collect();
        let layout = ShardLayout::new(&params, comm.rank(), comm.world_size())?;
        let shards = (0..params.len())
            .map(|index| make_shard(&params[index], &layout, index))
            .collect::<Result<Vec<_>, _>>()?;
        let mut next = 0;
        let shard_groups = groups
            .into_iter()
            .map(|group| {
                let n = group.params.len();
                next += n;
                ParamGroup::new(shards[next - n..next].to_vec(), group.config)
            })
            .collect();
        let inner: Box<dyn Optimizer> =
            Box::new(GroupOptimizer::<R>::new(shard_groups, implementation)?);
        let inner_ids: Vec<ParamId> = inner.params().into_iter().map(|(id, _)| id).collect();
        let index_of = inner_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i))
            .collect();
        Ok(ShardedOptimizer {
            engine: Arc::new(Mutex::new(Engine {
                comm,
                inner,
                params,
                shards,
                inner_ids,
                index_of,
                layout,
                config,
                held: Vec::new(),
                queued_pass: None,
                scaling: None,
                agreed_pass: None,
                skipped: false,
                stats: ShardStats::default(),
            })),
        })
    }

    /// A handle on the counters and layout, for after the optimizer is handed on.
    pub fn handle(&self) -> ShardedHandle {
        ShardedHandle {
            engine: Arc::clone(&self.engine),
        }
    }

    /// This rank's shard of each parameter (views of the parameters' memory where they lie
    /// inside it), in optimizer order.
    pub fn shards(&self) -> Vec<Tensor> {
        self.engine.lock().shards.clone()
    }

    /// ZeRO-2: the optimizer stepped inside backward by hooks' [`InBackward`], each of its
    /// buckets reduce-scattered as its gradients become final. `config` sets the buckets and
    /// the accumulation (no-sync micro-steps); it must not clip — InBackward would measure this
    /// rank's local gradients — so clip with [`ShardConfig::clipping`] instead.
    pub fn into_in_backward(
        self,
        config: InBackwardConfig,
    ) -> Result<InBackward, DistributedError> {
        if config.clipping.is_some() {
            return Err(DistributedError::InvalidArgument {
                op: "ShardedOptimizer::into_in_backward",
                reason: "InBackward's clipping would take this rank's local gradient norm, not \
                         the global one; set ShardConfig::clipping and leave \
                         InBackwardConfig::clipping None"
                    .into(),
            });
        }
        InBackward::new(Box::new(self), config).map_err(DistributedError::from_hooks)
    }
}

impl Engine {
    /// `indices` that have a gradient, in runs of one dtype and at most `bucket_bytes` each
    /// (a parameter larger than that is a bucket alone).
    fn buckets(&self, indices: &[usize], bucket_bytes: u64) -> Vec<Vec<usize>> {
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut bytes = 0u64;
        for &index in indices {
            let shard = &self.layout.params[index];
            let size = (shard.numel * shard.dtype.size_in_bytes()) as u64;
            let fits = buckets.last().is_some_and(|bucket| {
                self.layout.params[bucket[0]].dtype == shard.dtype && bytes + size <= bucket_bytes
            });
            if fits {
                bytes += size;
                if let Some(bucket) = buckets.last_mut() {
                    bucket.push(index);
                }
            } else {
                bytes = size;
                buckets.push(vec![index]);
            }
        }
        buckets
    }

    /// Reduce-scatters the bucket's gradients: each shard's `.grad` becomes its part of the
    /// average over ranks. The model's gradients are kept (ZeRO-1) or freed as soon as they are
    /// packed (ZeRO-2).
    fn reduce(&mut self, bucket: &[usize], gradients: Gradients) -> Result<(), DistributedError> {
        let _no_grad = no_grad();
        let world_size = self.layout.world_size;
        let dtype = self.layout.params[bucket[0]].dtype;
        let width: usize = bucket.iter().map(|&i| self.layout.params[i].chunk).sum();
        let backend = self.params[bucket[0]].backend().clone();
        let reduced = Tensor::empty(&backend, &[width], dtype)?;
        if let Some(index) = self.whole(bucket) {
            // One parameter that splits evenly: its gradient is the rows already.
            if let Some(grad) = self.params[index].grad() {
                let flat = grad
                    .contiguous()?
                    .reshape(&[self.layout.params[index].numel])?;
                if gradients == Gradients::Free {
                    self.params[index].set_grad(None)?;
                }
                self.comm.reduce_scatter(&flat, &reduced, ReduceOp::Sum)?;
            }
        } else {
            let rows = Tensor::zeros(&backend, &[world_size, width], dtype)?;
            let mut offset = 0;
            for &index in bucket {
                let shard = self.layout.params[index];
                if let Some(grad) = self.params[index].grad() {
                    let flat = grad.contiguous()?.reshape(&[shard.numel])?;
                    scatter_rows(&flat, &rows, offset, &shard)?;
                    if gradients == Gradients::Free {
                        drop((grad, flat));
                        self.params[index].set_grad(None)?;
                    }
                }
                offset += shard.chunk;
            }
            self.comm.reduce_scatter(
                &rows.reshape(&[world_size * width])?,
                &reduced,
                ReduceOp::Sum,
            )?;
        }
        if world_size > 1 {
            let factor = Tensor::full(&backend, &[1], 1.0 / world_size as f64, dtype)?;
            reduced.mul_(&factor)?;
        }
        let mut offset = 0;
        for &index in bucket {
            let chunk = self.layout.params[index].chunk;
            self.shards[index].set_grad(Some(reduced.narrow(0, offset, chunk)?))?;
            offset += chunk;
        }
        self.stats.buckets_reduced += 1;
        Ok(())
    }

    /// Steps the bucket's shards, frees their gradients and all-gathers the shards into every
    /// rank's parameters.
    fn update(&mut self, bucket: &[usize]) -> Result<(), DistributedError> {
        let ids: Vec<ParamId> = bucket.iter().map(|&i| self.inner_ids[i]).collect();
        let scaling = match &self.scaling {
            Some(scaling) => Scaling::Device(scaling),
            None => Scaling::None,
        };
        let outcome = self
            .inner
            .step_with(StepParams::Only(&ids), scaling)
            .map_err(DistributedError::from_optim)?;
        self.skipped = outcome == StepOutcome::Skipped;
        for &index in bucket {
            self.shards[index].set_grad(None)?;
        }
        let _no_grad = no_grad();
        let world_size = self.layout.world_size;
        let dtype = self.layout.params[bucket[0]].dtype;
        let width: usize = bucket.iter().map(|&i| self.layout.params[i].chunk).sum();
        let backend = self.params[bucket[0]].backend().clone();
        if let Some(index) = self.whole(bucket) {
            // One parameter that splits evenly, its shard a view at offset `rank × chunk`: an
            // all-gather in place (NCCL's in-place form), straight into the parameter.
            let target = self.params[index]
                .detach()
                .reshape(&[self.layout.params[index].numel])?;
            self.comm.all_gather(&self.shards[index], &target)?;
            self.stats.buckets_gathered += 1;
            return Ok(());
        }
        let local = Tensor::empty(&backend, &[width], dtype)?;
        let mut offset = 0;
        for &index in bucket {
            let chunk = self.layout.params[index].chunk;
            local.narrow(0, offset, chunk)?.copy_(&self.shards[index])?;
            offset += chunk;
        }
        let gathered = Tensor::empty(&backend, &[world_size * width], dtype)?;
        self.comm.all_gather(&local, &gathered)?;
        drop(local);
        let rows = gathered.reshape(&[world_size, width])?;
        let mut offset = 0;
        for &index in bucket {
            let shard = self.layout.params[index];
            let target = self.params[index].detach().reshape(&[shard.numel])?;
            gather_rows(&rows, &target, offset, &shard)?;
            offset += shard.chunk;
        }
        self.stats.buckets_gathered += 1;
        Ok(())
    }

    /// The parameter of a bucket of one parameter whose elements split evenly over the ranks
    /// (its rows are its own memory, so no packing is needed).
    fn whole(&self, bucket: &[usize]) -> Option<usize> {
        match *bucket {
            [index] if self.layout.is_view(index, self.layout.world_size - 1) => Some(index),
            _ => None,
        }
    }

    /// Scales the shard gradients of `indices` by the coefficient of the global norm.
    fn clip(&mut self, indices: &[usize], clipping: ShardClipping) -> Result<(), DistributedError> {
        let _no_grad = no_grad();
        let shards: Vec<Tensor> = indices.iter().map(|&i| self.shards[i].clone()).collect();
        let backend = self.params[0].backend().clone();
        let local = if shards.is_empty() {
            Tensor::zeros(&backend, &[1], DType::F32)?
        } else {
            clip_grad_norm_(&shards, f64::from(f32::MAX), clipping.norm, false)
                .map_err(DistributedError::from_optim)?
                .reshape(&[1])?
                .contiguous()?
        };
        let total = match clipping.norm {
            NormType::L2 => {
                let wide = local.to_dtype(DType::F64)?;
                let square = wide.mul(&wide)?;
                self.comm.all_reduce(&square, ReduceOp::Sum)?;
                square.sqrt()?.to_dtype(DType::F32)?
            }
            NormType::Inf => {
                self.comm.all_reduce(&local, ReduceOp::Max)?;
                local
            }
        };
        // The shards' gradients carry the loss scale: the norm of the true gradients is the
        // norm over the scale, as a single rank's loss-scaled clipping takes it.
        let total = match self.scaling.as_ref().and_then(|s| s.grad_scale.as_ref()) {
            Some(scale) => total.div(&scale.reshape(&[1])?)?,
            None => total,
        };
        let coefficient = clip_coefficient(&total, clipping.max_norm)?;
        for shard in &shards {
            if let Some(grad) = shard.grad() {
                if grad.dtype() == DType::F32 {
                    grad.mul_(&coefficient)?;
                } else {
                    grad.copy_(&grad.to_dtype(DType::F32)?.mul(&coefficient)?)?;
                }
            }
        }
        self.stats.norms += 1;
        Ok(())
    }

    /// The step's scaling, its overflow flag agreed across ranks: each rank's flag covers its
    /// own gradients, so the flags are all-reduced to their maximum before any shard is updated —
    /// in backward once per pass (every bucket of the pass shares the flag), outside it at each
    /// step. Host values become one-element tensors on the parameters' backend.
    fn agree(&mut self, scaling: Scaling<'_>, pass: Option<u64>) -> Result<(), DistributedError> {
        let _no_grad = no_grad();
        // A flag of the caller's (device scaling) is reduced in place once per pass: every
        // bucket of the pass shares it. Host values are this call's alone: reduced every call.
        let shared_flag = matches!(scaling, Scaling::Device(_));
        let scaling = match scaling {
            Scaling::None => None,
            Scaling::Host(values) if values.grad_scale.is_none() && values.found_inf.is_none() => {
                None
            }
            Scaling::Host(values) => {
                let backend = self.params[0].backend().clone();
                let one = |value: f32| Tensor::full(&backend, &[1], f64::from(value), DType::F32);
                Some(DeviceGradScaling {
                    grad_scale: values.grad_scale.map(one).transpose()?,
                    found_inf: Some(one(values.found_inf.unwrap_or(0.0))?),
                })
            }
            Scaling::Device(scaling) => Some(scaling.clone()),
        };
        let agreed_already = shared_flag && pass.is_some() && self.agreed_pass == pass;
        if let Some(found_inf) = scaling.as_ref().and_then(|s| s.found_inf.as_ref()) {
            if !agreed_already {
                self.comm.all_reduce(found_inf, ReduceOp::Max)?;
                self.agreed_pass = pass;
            }
        }
        self.scaling = scaling;
        Ok(())
    }

    /// A whole step of `indices` (outside backward, or ZeRO-1): reduce every bucket, clip,
    /// update and gather.
    fn step_all(&mut self, indices: &[usize]) -> Result<(), DistributedError> {
        let buckets = self.buckets(indices, self.config.bucket_bytes);
        match self.config.clipping {
            Some(clipping) => {
                for bucket in &buckets {
                    self.reduce(bucket, Gradients::Keep)?;
                }
                self.clip(indices, clipping)?;
                for bucket in &buckets {
                    self.update(bucket)?;
                }
            }
            None => {
                for bucket in &buckets {
                    self.reduce(bucket, Gradients::Keep)?;
                    self.update(bucket)?;
                }
            }
        }
        Ok(())
    }

    /// One of InBackward's buckets (ZeRO-2): reduce it now; update it now, or hold it for the
    /// end of the pass when clipping.
    fn bucket_in_backward(
        &mut self,
        indices: &[usize],
        pass: u64,
        shared: &Arc<Mutex<Engine>>,
    ) -> Result<(), DistributedError> {
        for bucket in self.buckets(indices, u64::MAX) {
            self.reduce(&bucket, Gradients::Free)?;
            if self.config.clipping.is_some() {
                self.held.push(bucket);
            } else {
                self.update(&bucket)?;
            }
        }
        if self.config.clipping.is_some() && self.queued_pass != Some(pass) {
            self.queued_pass = Some(pass);
            let shared = Arc::clone(shared);
            queue_backward_end_callback(move || {
                shared
                    .lock()
                    .finish_held()
                    .map_err(|err| TensorError::hook("ShardedOptimizer", err))
            })?;
        }
        Ok(())
    }

    /// The end of a clipped ZeRO-2 pass: the global norm over every held shard, then the
    /// updates and gathers in the order the buckets were reduced.
    fn finish_held(&mut self) -> Result<(), DistributedError> {
        self.queued_pass = None;
        let held = std::mem::take(&mut self.held);
        if let Some(clipping) = self.config.clipping {
            let indices: Vec<usize> = held.iter().flatten().copied().collect();
            self.clip(&indices, clipping)?;
        }
        for bucket in &held {
            self.update(bucket)?;
        }
        Ok(())
    }
}

/// `min(1, (1 / (total + 1e-6)) · max_norm)` in f32, one element, as PyTorch computes it.
fn clip_coefficient(total: &Tensor, max_norm: f64) -> Result<Tensor, TensorError> {
    let backend = total.backend();
    let constant = |value: f32| Tensor::full(backend, &[1], f64::from(value), DType::F32);
    let coefficient = constant(1.0)?
        .div(&total.add(&constant(1e-6)?)?)?
        .mul(&constant(max_norm as f32)?)?;
    let ones = constant(1.0)?;
    // min(c, 1) = -max(-c, -1).
    let both = headroom_autograd_core::cat(&[&coefficient.neg()?, &ones.neg()?], 0)?;
    both.max_dim(0, true)?.0.neg()
}

impl Optimizer for ShardedOptimizer {
    fn name(&self) -> &'static str {
        "ShardedOptimizer"
    }

    fn n_groups(&self) -> usize {
        self.engine.lock().inner.n_groups()
    }

    fn lr(&self, group: usize) -> f64 {
        self.engine.lock().inner.lr(group)
    }

    fn set_lr(&mut self, group: usize, lr: f64) {
        self.engine.lock().inner.set_lr(group, lr);
    }

    /// The model's parameters (whose gradients a step reads), each with the wrapped optimizer's
    /// handle of its shard.
    fn params(&self) -> Vec<(ParamId, Tensor)> {
        let engine = self.engine.lock();
        engine
            .inner_ids
            .iter()
            .copied()
            .zip(engine.params.iter().cloned())
            .collect()
    }

    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        let engine = self.engine.lock();
        engine
            .params
            .iter()
            .position(|p| p.same_tensor(param) || Arc::ptr_eq(p.buffer(), param.buffer()))
            .map(|i| engine.inner_ids[i])
            .ok_or(OptimError::UnknownParameter {
                optimizer: "ShardedOptimizer",
            })
    }

    /// `All` (a plain step, ZeRO-1): every gradient reduce-scattered in buckets, clipped,
    /// updated and gathered. `Only(bucket)` inside backward (from InBackward, ZeRO-2): that
    /// bucket reduce-scattered now, updated now or at the end of the pass. `Only` outside
    /// backward: those parameters as a whole step (clipped over them). Under a loss scale the
    /// ranks' overflow flags are agreed first; `Skipped` when the host knows the step skipped.
    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        let shared = Arc::clone(&self.engine);
        let mut engine = shared.lock();
        let indices: Vec<usize> = match params {
            StepParams::All => (0..engine.params.len()).collect(),
            StepParams::Only(ids) => ids
                .iter()
                .map(|id| {
                    engine
                        .index_of
                        .get(id)
                        .copied()
                        .ok_or(OptimError::UnknownParameter {
                            optimizer: "ShardedOptimizer",
                        })
                })
                .collect::<Result<_, _>>()?,
        };
        let with_grad: Vec<usize> = indices
            .into_iter()
            .filter(|&i| engine.params[i].grad().is_some())
            .collect();
        if with_grad.is_empty() {
            return Ok(StepOutcome::Stepped);
        }
        let pass = backward_pass_id();
        engine
            .agree(scaling, pass)
            .map_err(DistributedError::into_optim)?;
        engine.skipped = false;
        let res = match (params, pass) {
            (StepParams::Only(_), Some(pass)) => {
                engine.bucket_in_backward(&with_grad, pass, &shared)
            }
            _ => {
                // A step outside backward (of every parameter, or of those given, clipped over
                // them): reverse order, as gradients become final.
                let mut order = with_grad;
                order.reverse();
                engine.step_all(&order)
            }
        };
        res.map_err(DistributedError::into_optim)?;
        Ok(match engine.skipped {
            true => StepOutcome::Skipped,
            false => StepOutcome::Stepped,
        })
    }

    /// Yes: the shards' fused kernels take the scale and flag, after the ranks' flags are
    /// agreed.
    fn takes_device_scaling(&self) -> bool {
        true
    }

    fn finish_steps(&mut self) -> Result<(), OptimError> {
        self.engine.lock().inner.finish_steps()
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        let engine = self.engine.lock();
        for param in &engine.params {
            param.zero_grad(set_to_none)?;
        }
        Ok(())
    }

    /// This rank's state: the wrapped optimizer's, over its shards.
    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        self.engine.lock().inner.state_dict()
    }

    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        self.engine.lock().inner.load_state_dict(bytes)
    }
}
