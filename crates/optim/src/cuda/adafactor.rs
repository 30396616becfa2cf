//! Adafactor on CUDA (`kernels/adafactor.cu`), one parameter at a time as on the CPU: the
//! parameter's norm, decay, the second moments, the update's norm, the write. The single form
//! keeps the update in a temporary of the parameter's size; the fused form recomputes it and
//! keeps only per-block partial sums; foreach runs parameters whose CPU scratch fits the chunk
//! through the single form and the rest through the fused form (unbounded: every temporary
//! allocated first) — the host's schedule, `driver::single_or_fused`.
//!
//! The two norms and `α` stay on the device (a small f64 scalars tensor per parameter step), so
//! nothing waits for the GPU. A GradScaler's device values are not read here (the rule's
//! kernel table says so, and the optimizer refuses them before a step; Adafactor's host-valued
//! scale is applied).

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cuda::{CudaBackend, KernelArg};

use super::launch::{address, CudaDevice, Module};
use crate::adafactor::AdafactorState;
use crate::driver::single_or_fused;
use crate::error::OptimError;
use crate::kernels::{adafactor_scratch_len, factors, AdafactorConfig, AdafactorConsts};
use crate::rule::CudaKernels;
use crate::step::RuleCall;

const THREADS: u32 = 256;
/// Elements per block of the two norm sums.
const NORM_BLOCK: u64 = 16384;

/// The gradient flags of the kernels that read the gradient (`kernels/adafactor.cu`).
mod grad_flags {
    pub(super) const SCALED: i32 = 1;
    pub(super) const MAXIMIZE: i32 = 2;
}

/// The modes of `af_update` (`kernels/adafactor.cu`).
mod update_mode {
    pub(super) const READ_U: i32 = 1;
    pub(super) const WRITE_U: i32 = 2;
    pub(super) const NORM: i32 = 4;
    pub(super) const APPLY: i32 = 8;
}

/// Where the update lives between its norm and its write.
enum Form {
    /// In the temporary of the parameter's size at this address.
    Single(u64),
    /// Recomputed.
    Fused,
}

/// The CUDA entry of Adafactor: each parameter through the single or the fused form, on the
/// schedule the host uses (`driver::single_or_fused`); a single form's temporary is an f32
/// tensor of the parameter's size. Its kernels take a host-valued gradient scale only.
impl CudaKernels<AdafactorState> for AdafactorConfig {
    const READS_DEVICE_SCALING: bool = false;

    fn cuda_step(
        &self,
        device: &mut CudaDevice,
        call: RuleCall<'_, '_, AdafactorState>,
    ) -> Result<(), OptimError> {
        step(self, device, call)
    }
}

fn step(
    rule: &AdafactorConfig,
    device: &mut CudaDevice,
    call: RuleCall<'_, '_, AdafactorState>,
) -> Result<(), OptimError> {
    let grad_scale = call.scaling.host().grad_scale;
    let items = &*call.items;
    let lens: Vec<usize> = items
        .iter()
        .map(|it| adafactor_scratch_len(it.param.shape()))
        .collect();
    single_or_fused(
        call.implementation,
        &lens,
        &mut |idx| {
            let param = items[idx].param;
            Ok(Tensor::empty(
                param.backend(),
                &[param.numel()],
                DType::F32,
            )?)
        },
        &mut |idx, tmp| {
            let form = tmp.map_or(Form::Fused, |t| Form::Single(address(t)));
            let it = &items[idx];
            let state = match &*it.state {
                AdafactorState::Factored { row_var, col_var } => RawState::Factored {
                    row_var: address(row_var),
                    col_var: address(col_var),
                },
                AdafactorState::Full { variance } => RawState::Full {
                    variance: address(variance),
                },
            };
            let raw = RawItem {
                param: address(it.param),
                grad: address(&it.grad),
                shape: it.param.shape(),
                step: it.step,
                state,
            };
            step_one(device, it.param.backend(), rule, &raw, form, grad_scale)
        },
    )
}

/// One parameter's step by addresses: f32 parameter and gradient of `shape`, its moments.
struct RawItem<'a> {
    param: u64,
    grad: u64,
    shape: &'a [usize],
    step: u64,
    state: RawState,
}

/// The moments of a [`RawItem`]: row and column moments of a tensor of two or more dims, or a
/// per-element one of a vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RawState {
    Factored { row_var: u64, col_var: u64 },
    Full { variance: u64 },
}

fn blocks(n: u64) -> u32 {
    n.div_ceil(u64::from(THREADS)).max(1) as u32
}

/// The launches of one parameter's step; its temporaries come from `backend`.
fn step_one(
    device: &mut CudaDevice,
    backend: &BackendRef,
    cfg: &AdafactorConfig,
    it: &RawItem<'_>,
    form: Form,
    grad_scale: Option<f32>,
) -> Result<(), OptimError> {
    use update_mode::{APPLY, NORM, READ_U, WRITE_U};
    use KernelArg::{F32, F64, I32, U32, U64};
    let n = it.shape.iter().product::<usize>() as u64;
    if n == 0 {
        return Ok(());
    }
    let c = AdafactorConsts::without_norm(cfg, it.step);
    let n_partials = n.div_ceil(NORM_BLOCK);
    let scalars = Tensor::empty(backend, &[2 + n_partials as usize], DType::F64)?;
    let (scalars_at, partials) = (address(&scalars), address(&scalars) + 16);
    let (p, g) = (it.param, it.grad);
    let flags = i32::from(grad_scale.is_some()) * grad_flags::SCALED
        + i32::from(c.maximize) * grad_flags::MAXIMIZE;
    let scale = grad_scale.unwrap_or(1.0);
    // The second-moment kernels (`af_rows`, `af_cols`, `af_variance`) take the gradient, their
    // moment and its geometry, then the moment's weight and the gradient's scale and flags.
    let moment_args = |head: &[KernelArg]| -> Vec<KernelArg> {
        let tail = [F32(c.weight), F32(scale), I32(flags)];
        [&[U64(g)], head, &tail].concat()
    };
    let kernel = Module::Adafactor;
    // Every launch below: the arguments follow each kernel's parameters in order and type; the
    // addresses are the step's checked tensors, its state tensors and the temporaries of this
    // call, alive until every launch is queued (frees are stream-ordered).
    // SAFETY: see above.
    unsafe {
        device.launch(
            kernel,
            "af_sum_squares",
            n_partials as u32,
            THREADS,
            &[U64(p), U64(n), U64(NORM_BLOCK), U64(partials)],
        )?;
        let alpha_args = [
            U64(scalars_at),
            U64(partials),
            U32(n_partials as u32),
            U64(n),
            F64(cfg.eps.1),
            F64(c.rho),
        ];
        device.launch(kernel, "af_alpha", 1, 1, &alpha_args)?;
        if let Some(factor) = c.decay_factor {
            device.launch(
                kernel,
                "af_scale_param",
                blocks(n),
                THREADS,
                &[U64(p), U64(n), F32(factor)],
            )?;
        }
    }
    let floors;
    let (row_var, col_var, variance, floors_at, rows, cols) = match (it.state, factors(it.shape)) {
        (RawState::Factored { row_var, col_var }, Some((batch, rows, cols))) => {
            let (batch, rows, cols) = (batch as u64, rows as u64, cols as u64);
            floors = Some(Tensor::empty(backend, &[batch as usize], DType::F32)?);
            let floors_at = floors.as_ref().map_or(0, address);
            let (r, cv) = (row_var, col_var);
            // SAFETY: see above.
            unsafe {
                device.launch(
                    kernel,
                    "af_rows",
                    blocks(batch * rows),
                    THREADS,
                    &moment_args(&[U64(r), U64(batch * rows), U64(cols)]),
                )?;
                device.launch(
                    kernel,
                    "af_cols",
                    blocks(batch * cols),
                    THREADS,
                    &moment_args(&[U64(cv), U64(batch), U64(rows), U64(cols)]),
                )?;
                device.launch(
                    kernel,
                    "af_floors",
                    blocks(batch),
                    THREADS,
                    &[U64(r), U64(floors_at), U64(batch), U64(rows), F32(c.eps1)],
                )?;
            }
            (r, cv, 0, floors_at, rows, cols)
        }
        (RawState::Full { variance }, None) => {
            floors = None;
            let v = variance;
            // SAFETY: see above.
            unsafe {
                device.launch(
                    kernel,
                    "af_variance",
                    blocks(n),
                    THREADS,
                    &moment_args(&[U64(v), U64(n)]),
                )?;
            }
            (0, 0, v, 0, 1, 0)
        }
        _ => {
            return Err(OptimError::InvalidArgument {
                op: "Adafactor",
                reason: "state does not match the parameter's shape".into(),
            })
        }
    };
    let (u, norm_mode, apply_mode) = match form {
        Form::Single(u) => (u, WRITE_U | NORM, READ_U | APPLY),
        Form::Fused => (0, NORM, APPLY),
    };
    let update_args = |mode: i32| {
        [
            I32(mode),
            U64(g),
            U64(p),
            U64(u),
            U64(row_var),
            U64(col_var),
            U64(floors_at),
            U64(variance),
            U64(n),
            U64(rows),
            U64(cols),
            U64(NORM_BLOCK),
            F32(c.eps1_sq),
            F32(scale),
            I32(flags),
            U64(partials),
            U64(scalars_at),
        ]
    };
    // SAFETY: see above.
    unsafe {
        device.launch(
            kernel,
            "af_update",
            n_partials as u32,
            THREADS,
            &update_args(norm_mode),
        )?;
        let value_args = [
            U64(scalars_at),
            U64(partials),
            U32(n_partials as u32),
            U64(n),
            F64(c.d),
        ];
        device.launch(kernel, "af_value", 1, 1, &value_args)?;
        device.launch(
            kernel,
            "af_update",
            n_partials as u32,
            THREADS,
            &update_args(apply_mode),
        )?;
    }
    drop((scalars, floors));
    Ok(())
}

/// One f32 parameter's device buffers for [`CudaAdafactor::step_buffers`], by address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAdafactorParam {
    /// The parameter, contiguous, of `shape`.
    pub param: u64,
    /// Its gradient, contiguous, of `shape`.
    pub grad: u64,
    /// The parameter's shape: with two or more dims the second moment is factored.
    pub shape: Vec<usize>,
    /// Its moments: with two or more dims `row_var` (`[..., rows]`, f32) and `col_var`
    /// (`[..., cols]`), else `variance` (like the parameter); the others `None`.
    pub row_var: Option<u64>,
    /// See `row_var`.
    pub col_var: Option<u64>,
    /// See `row_var`.
    pub variance: Option<u64>,
    /// This update's step number (from 1): Adafactor's β2 and ρ follow each parameter's count.
    pub step: u64,
}

/// Adafactor over device buffers given per call, for a caller whose tensors are not Headroom's
/// (the `headroom` wheel's torch tensors): each parameter in the fused form (the update
/// recomputed, no temporary of its size), its small temporaries (the two norms' partial sums, a
/// factored moment's floors) from the backend's allocator, on the backend's stream (the legacy
/// default stream) — the kernels, and so the bits, of [`crate::Adafactor`] on CUDA.
#[derive(Debug)]
pub struct CudaAdafactor {
    backend: BackendRef,
    device: CudaDevice,
}

impl CudaAdafactor {
    /// Adafactor on `backend`'s device.
    pub fn new(backend: Arc<CudaBackend>) -> CudaAdafactor {
        CudaAdafactor {
            backend: backend.clone(),
            device: CudaDevice::new(backend, 0),
        }
    }

    /// One step of every parameter of `params` with `cfg`, each at its own `step`; a gradient
    /// scale applied on the host side (`grad_scale`: the gradients are divided by it), as the
    /// Adafactor kernels take.
    ///
    /// # Safety
    /// Every address is a live, contiguous f32 buffer of the backend's device of the size its
    /// field says until the launches complete, and no two parameters' buffers overlap.
    pub unsafe fn step_buffers(
        &mut self,
        cfg: &AdafactorConfig,
        params: &[DeviceAdafactorParam],
        grad_scale: Option<f32>,
    ) -> Result<(), OptimError> {
        const OP: &str = "CudaAdafactor::step_buffers";
        cfg.validate()?;
        let mut raws = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let refuse = |reason: String| OptimError::InvalidArgument {
                op: OP,
                reason: format!("parameter {i}: {reason}"),
            };
            if p.step == 0 {
                return Err(refuse("step numbers start at 1".into()));
            }
            let state = match (factors(&p.shape), p.row_var, p.col_var, p.variance) {
                (Some(_), Some(row_var), Some(col_var), None) => {
                    RawState::Factored { row_var, col_var }
                }
                (None, None, None, Some(variance)) => RawState::Full { variance },
                _ => {
                    return Err(refuse(format!(
                        "a parameter of shape {:?} takes row and column moments with two or \
                         more dims, a variance otherwise",
                        p.shape
                    )))
                }
            };
            let addresses = [
                Some(p.param),
                Some(p.grad),
                p.row_var,
                p.col_var,
                p.variance,
            ];
            if addresses.iter().flatten().any(|&a| a == 0) {
                return Err(refuse("a null address".into()));
            }
            raws.push(RawItem {
                param: p.param,
                grad: p.grad,
                shape: &p.shape,
                step: p.step,
                state,
            });
        }
        for raw in &raws {
            step_one(
                &mut self.device,
                &self.backend,
                cfg,
                raw,
                Form::Fused,
                grad_scale,
            )?;
        }
        Ok(())
    }
}
