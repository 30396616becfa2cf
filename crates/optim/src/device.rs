//! Where a step runs: the one place that sends a rule's update to the host kernels or to the
//! CUDA kernels, and the checks that put a tensor on one side or the other.
//!
//! A [`GroupOptimizer`](crate::GroupOptimizer) picks its [`StepDevice`] once, from its first
//! parameter, and every other parameter, gradient and state tensor must sit on the same device
//! and be contiguous (typed errors otherwise; the optimizer checks dtypes against its rule).
//! [`StepDevice::step`] is the only match on the device: it calls the rule's host entry,
//! [`UpdateRule::host_step`] (the shared host driver, `driver.rs`, over tensor memory as slices,
//! `host.rs`), or its CUDA entry, [`CudaKernels`](crate::rule::CudaKernels)`::cuda_step` (feature
//! `cuda`: `cuda/` launches the PTX kernels on the parameters' `CudaBackend`, whose launch table
//! and GradScaler skip counters live here between steps). Gradient clipping and a GradScaler's
//! overflow check pick their side here the same way (`clip/host.rs` or `cuda/clip.rs`,
//! `cuda/grad_scale.rs`). Nothing here knows an algorithm.
//!
//! A host step turns tensor memory into slices, so it takes the guarantees those slices need
//! here: every tensor's memory is host memory (`Buffer::is_host_memory`, not merely a tensor
//! that says `Device::Cpu`), and for the whole update the step holds a host claim on every buffer
//! it touches (`HostAccess`: parameters and state alone, gradients with no writer). Another
//! thread's CPU op on one of those tensors during the step is a `ConcurrentAccess` error on one
//! side, never a race.

use std::sync::Arc;

use headroom_autograd_core::{Access, Buffer, DType, Device, HostAccess, Tensor};

use crate::clip::host::{host_norm, host_value};
use crate::clip::norm::NormClip;
use crate::error::OptimError;
use crate::kernels::GradScaling;
use crate::rule::UpdateRule;
use crate::step::{DeviceGradScaling, RuleCall};

/// The device a group optimizer's steps run on: the host (the `kernels` module over tensor
/// memory) or, with the `cuda` feature, the CUDA device of the parameters (its kernels, plus the
/// launch table and skip counters kept between steps).
#[derive(Debug)]
pub struct StepDevice {
    kind: DeviceKind,
}

#[derive(Debug)]
enum DeviceKind {
    Host,
    /// Boxed: the device's launch table and counters are far larger than the host's nothing.
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::launch::CudaDevice>),
}

/// Checks that `tensor` is contiguous.
fn check_layout(op: &'static str, tensor: &Tensor) -> Result<(), OptimError> {
    if !tensor.is_contiguous() {
        return Err(OptimError::NonContiguous {
            op,
            shape: tensor.shape().to_vec(),
            strides: tensor.strides().to_vec(),
        });
    }
    Ok(())
}

impl StepDevice {
    /// The device of `param` (contiguous), for an optimizer of `n_slots` parameters.
    pub(crate) fn of(
        op: &'static str,
        param: &Tensor,
        n_slots: usize,
    ) -> Result<StepDevice, OptimError> {
        check_layout(op, param)?;
        let kind = match param.device() {
            Device::Cpu => DeviceKind::Host,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let device = crate::cuda::launch::CudaDevice::of(op, param, n_slots)?;
                DeviceKind::Cuda(Box::new(device))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                let _ = n_slots;
                return Err(OptimError::UnsupportedTensor {
                    op,
                    reason: "CUDA tensors need headroom-optim's `cuda` feature".into(),
                });
            }
        };
        Ok(StepDevice { kind })
    }

    /// The device of an optimizer without parameters (nothing ever runs).
    pub(crate) fn host() -> StepDevice {
        StepDevice {
            kind: DeviceKind::Host,
        }
    }

    /// The device, as autograd-core names it.
    pub fn device(&self) -> Device {
        match &self.kind {
            DeviceKind::Host => Device::Cpu,
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => cuda.device(),
        }
    }

    /// Checks that `tensor` is a contiguous tensor on this device (and, for CUDA, of the same
    /// backend, whose stream and allocator the kernels use).
    pub(crate) fn check(&self, op: &'static str, tensor: &Tensor) -> Result<(), OptimError> {
        check_layout(op, tensor)?;
        let same = match &self.kind {
            DeviceKind::Host => {
                if tensor.device() == Device::Cpu
                    && tensor.numel() > 0
                    && !tensor.buffer().is_host_memory()
                {
                    return Err(OptimError::UnsupportedTensor {
                        op,
                        reason: "a CPU tensor whose memory is not host memory (its backend's \
                                 storage is not a host storage) cannot be stepped on the host"
                            .into(),
                    });
                }
                tensor.device() == Device::Cpu
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => cuda.owns(tensor),
        };
        if !same {
            return Err(OptimError::MixedDevices {
                op,
                expected: self.device(),
                got: tensor.device(),
            });
        }
        Ok(())
    }

    /// One call of `rule`'s kernels on this device (the optimizer checked the call's tensors
    /// and scaling).
    pub(crate) fn step<R: UpdateRule>(
        &mut self,
        rule: &R,
        call: RuleCall<'_, '_, R::State>,
    ) -> Result<(), OptimError> {
        match &mut self.kind {
            DeviceKind::Host => {
                let buffers = claimed_buffers::<R>(&call);
                let _access = HostAccess::claim(
                    R::NAME,
                    buffers.iter().map(|(buffer, access)| (&**buffer, *access)),
                )?;
                rule.host_step(call)
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => rule.cuda_step(cuda, call),
        }
    }

    /// `clip_grad_norm_` of `grads` (checked: on this device, contiguous, disjoint, f32/bf16/f16).
    pub(crate) fn clip_norm(
        &mut self,
        grads: &[Tensor],
        clip: NormClip,
    ) -> Result<Tensor, OptimError> {
        match &mut self.kind {
            DeviceKind::Host => {
                // The norm reads the gradients, the scaling writes them.
                let _access = HostAccess::claim(
                    "clip_grad_norm_",
                    grads.iter().map(|grad| (&**grad.buffer(), Access::Write)),
                )?;
                host_norm(grads, clip)
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => crate::cuda::clip::clip_norm(cuda, grads, clip),
        }
    }

    /// `clip_grad_value_` of `grads` (checked as for [`StepDevice::clip_norm`]).
    pub(crate) fn clip_value(
        &mut self,
        grads: &[Tensor],
        clip_value: f32,
    ) -> Result<(), OptimError> {
        match &mut self.kind {
            DeviceKind::Host => {
                let _access = HostAccess::claim(
                    "clip_grad_value_",
                    grads.iter().map(|grad| (&**grad.buffer(), Access::Write)),
                )?;
                host_value(grads, clip_value)
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => crate::cuda::clip::clip_value(cuda, grads, clip_value),
        }
    }

    /// A GradScaler's overflow check of `grads` (and their unscaling by `inv_scale`) with this
    /// device's own kernels (checked by `grad_scale.rs`: contiguous f32, bf16 and f16 tensors of
    /// this device); `false` where it has none (the host: the caller composes it of tensor ops).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn non_finite_check(
        &mut self,
        grads: &[Tensor],
        found_inf: &Tensor,
        inv_scale: Option<&Tensor>,
    ) -> Result<bool, OptimError> {
        match &mut self.kind {
            DeviceKind::Host => Ok(false),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => {
                crate::cuda::grad_scale::non_finite_check(cuda, grads, found_inf, inv_scale)?;
                Ok(true)
            }
        }
    }

    /// Checks a device scaling's tensors (one f32 element each, on this device), and that this
    /// device reads them: only the CUDA kernels do.
    pub(crate) fn check_scaling(
        &self,
        op: &'static str,
        scaling: &DeviceGradScaling,
    ) -> Result<(), OptimError> {
        for tensor in scaling.grad_scale.iter().chain(&scaling.found_inf) {
            self.check(op, tensor)?;
            if tensor.dtype() != DType::F32 {
                return Err(OptimError::DType {
                    op,
                    expected: DType::F32,
                    got: tensor.dtype(),
                });
            }
            if tensor.numel() != 1 {
                return Err(OptimError::InvalidArgument {
                    op,
                    reason: format!(
                        "a gradient scale or found-inf flag has one element, not {:?}",
                        tensor.shape()
                    ),
                });
            }
        }
        Ok(())
    }

    /// A device scaling's values where the host kernels run: on the CPU its one-element
    /// tensors are host memory, read in place (no transfer, nothing to wait for); `None` on a
    /// CUDA device, whose kernels read the tensors themselves.
    pub(crate) fn host_values(&self, scaling: &DeviceGradScaling) -> Option<GradScaling> {
        match self.kind {
            DeviceKind::Host => {
                let read = |tensor: &Option<Tensor>| {
                    tensor.as_ref().map(|tensor| {
                        // SAFETY: `check_scaling` checked a contiguous one-element f32 CPU
                        // tensor; nothing writes it while the step runs on this thread.
                        unsafe { crate::host::host_slice::<f32>(tensor)[0] }
                    })
                };
                Some(GradScaling {
                    grad_scale: read(&scaling.grad_scale),
                    found_inf: read(&scaling.found_inf),
                })
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(_) => None,
        }
    }

    /// Whether a rule whose CUDA kernels read device scaling when `cuda_reads` does on this
    /// device: the host kernels always take it (as values read in place).
    #[cfg_attr(
        not(feature = "cuda"),
        expect(unused_variables, reason = "only a CUDA device asks the rule")
    )]
    pub(crate) fn takes_device_scaling(&self, cuda_reads: bool) -> bool {
        match self.kind {
            DeviceKind::Host => true,
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(_) => cuda_reads,
        }
    }

    /// The steps each parameter slot skipped on the device (GradScaler overflows seen by the
    /// kernels); all zero on the host. Reading them waits for the device.
    pub(crate) fn skipped_steps(&self, n_slots: usize) -> Result<Vec<u64>, OptimError> {
        match &self.kind {
            DeviceKind::Host => Ok(vec![0; n_slots]),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => cuda.skipped_steps(n_slots),
        }
    }

    /// How far each slot's step is from the host's count by the replays of CUDA graphs that
    /// captured its steps (`(slot, delta)`; none on the host).
    pub(crate) fn replay_deltas(&self) -> Vec<(usize, i64)> {
        match &self.kind {
            DeviceKind::Host => Vec::new(),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => cuda.replay_deltas(),
        }
    }

    /// Marks [`StepDevice::replay_deltas`] as added to the host's counts.
    pub(crate) fn count_replays(&mut self) {
        #[cfg(feature = "cuda")]
        if let DeviceKind::Cuda(cuda) = &mut self.kind {
            cuda.count_replays();
        }
    }

    /// Marks every CUDA graph that replays a step of this optimizer stale with `reason`.
    pub(crate) fn invalidate_captures(&self, reason: &str) {
        #[cfg(feature = "cuda")]
        if let DeviceKind::Cuda(cuda) = &self.kind {
            cuda.invalidate_captures(reason);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = reason;
    }

    /// Forgets the device's skip counts (after loading a state dict, whose steps are exact).
    pub(crate) fn reset_skipped_steps(&mut self) -> Result<(), OptimError> {
        match &mut self.kind {
            DeviceKind::Host => Ok(()),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda(cuda) => cuda.reset_skip_counters(),
        }
    }
}

/// The buffers a host step of `call` touches: parameters and state written, gradients read.
fn claimed_buffers<R: UpdateRule>(call: &RuleCall<'_, '_, R::State>) -> Vec<(Arc<Buffer>, Access)> {
    let mut buffers = Vec::with_capacity(4 * call.items.len());
    for item in call.items.iter() {
        buffers.push((Arc::clone(item.param.buffer()), Access::Write));
        buffers.push((Arc::clone(item.grad.buffer()), Access::Read));
        for (_, state) in R::state_tensors(item.state) {
            buffers.push((Arc::clone(state.buffer()), Access::Write));
        }
    }
    buffers
}
