//! `headroom._native.Adafactor`: `torch.optim.Adafactor`'s update (headroom-optim's
//! `AdafactorConfig`) over the pointers of torch's f32 tensors — on a CUDA device through
//! `CudaAdafactor::step_buffers` (the fused form: the update recomputed, only small
//! temporaries, from the device's shared backend), on the CPU through the host kernel
//! `adafactor_fused`, parameter by parameter.
//!
//! It sits on headroom-optim's raw entry points and `optim.rs`'s error and stream rules; it knows
//! nothing of torch's tensors: `headroom/optim.py` checks them and hands over their pointers.

use headroom_optim::cuda::{CudaAdafactor, DeviceAdafactorParam};
use headroom_optim::kernels::{adafactor_fused, AdafactorBuffers, AdafactorConfig, GradScaling};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::device::backend;
use crate::optim::{check_stream, optim_error};

/// Adafactor over f32 buffers: one step of every parameter handed over.
#[pyclass]
pub(crate) struct Adafactor {
    inner: Option<CudaAdafactor>,
}

/// A pointer, or `None` for 0.
fn some(address: u64) -> Option<u64> {
    (address != 0).then_some(address)
}

#[pymethods]
impl Adafactor {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(device: Option<usize>) -> PyResult<Adafactor> {
        let inner = device.map(backend).transpose()?.map(CudaAdafactor::new);
        Ok(Adafactor { inner })
    }

    /// Step number `step` of every parameter: `hyper` = (lr, beta2_decay, eps1 or None, eps2,
    /// d, weight_decay); per parameter its pointer, its gradient's, its moments' (0 where it has
    /// none: row and column moments with two or more dims, a variance otherwise) and its shape.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, step, hyper, maximize, params, grads, row_vars, col_vars, variances, shapes))]
    fn step(
        &mut self,
        stream: u64,
        step: u64,
        hyper: (f64, f64, Option<f64>, f64, f64, f64),
        maximize: bool,
        params: Vec<u64>,
        grads: Vec<u64>,
        row_vars: Vec<u64>,
        col_vars: Vec<u64>,
        variances: Vec<u64>,
        shapes: Vec<Vec<usize>>,
    ) -> PyResult<()> {
        let n = params.len();
        for (name, len) in [
            ("grads", grads.len()),
            ("row_vars", row_vars.len()),
            ("col_vars", col_vars.len()),
            ("variances", variances.len()),
            ("shapes", shapes.len()),
        ] {
            if len != n {
                return Err(PyValueError::new_err(format!(
                    "`{name}` has {len} entries for {n} parameters"
                )));
            }
        }
        let (lr, beta2_decay, eps1, eps2, d, weight_decay) = hyper;
        let cfg = AdafactorConfig {
            lr,
            beta2_decay,
            eps: (eps1, eps2),
            d,
            weight_decay,
            maximize,
        };
        cfg.validate().map_err(optim_error)?;
        let list: Vec<DeviceAdafactorParam> = (0..n)
            .map(|i| DeviceAdafactorParam {
                param: params[i],
                grad: grads[i],
                shape: shapes[i].clone(),
                row_var: some(row_vars[i]),
                col_var: some(col_vars[i]),
                variance: some(variances[i]),
                step,
            })
            .collect();
        if list.iter().any(|p| p.param == 0 || p.grad == 0) {
            return Err(PyValueError::new_err(
                "a null parameter or gradient pointer (an empty tensor?)",
            ));
        }
        let Some(inner) = &mut self.inner else {
            for p in &list {
                // SAFETY: `headroom.optim` passes the data pointers of live, contiguous f32 CPU
                // tensors it holds during the call — the parameter and gradient of `shape`, the
                // moments of torch's Adafactor shapes (the same elements in the same order) —
                // checked against the parameter when the lists were built and the gradient at
                // this step, no two sharing memory (checked), so the slices alias nothing.
                unsafe { host_step(&cfg, step, p) }?;
            }
            return Ok(());
        };
        check_stream(stream)?;
        // SAFETY: as above for device tensors of this optimizer's device, kept alive across the
        // call; torch's default stream is the launch's (checked above).
        unsafe { inner.step_buffers(&cfg, &list, None) }.map_err(optim_error)
    }
}

/// One parameter's Adafactor step on the host.
///
/// # Safety
/// `p`'s addresses are live, contiguous f32 host buffers — the parameter and gradient of
/// `p.shape`, with two or more dims row moments of `batch × rows` and column moments of
/// `batch × cols` elements, else a variance like the parameter — that nothing else reads or
/// writes during the call and that do not overlap.
unsafe fn host_step(cfg: &AdafactorConfig, step: u64, p: &DeviceAdafactorParam) -> PyResult<()> {
    let numel: usize = p.shape.iter().product();
    let (batch, rows, cols) = match p.shape.len() {
        0 | 1 => (1, numel, 0),
        k => (
            p.shape[..k - 2].iter().product(),
            p.shape[k - 2],
            p.shape[k - 1],
        ),
    };
    let factored = p.shape.len() >= 2;
    let moments_fit = match factored {
        true => p.row_var.is_some() && p.col_var.is_some() && p.variance.is_none(),
        false => p.row_var.is_none() && p.col_var.is_none() && p.variance.is_some(),
    };
    if !moments_fit {
        return Err(PyValueError::new_err(format!(
            "a parameter of shape {:?} takes row and column moments with two or more dims, a \
             variance otherwise",
            p.shape
        )));
    }
    // SAFETY: the caller's contract; each slice's length is the size that contract states.
    let bufs = unsafe {
        let moment = |address: Option<u64>, len: usize| -> Option<&mut [f32]> {
            address.map(|a| std::slice::from_raw_parts_mut(a as *mut f32, len))
        };
        AdafactorBuffers {
            param: std::slice::from_raw_parts_mut(p.param as *mut f32, numel),
            grad: std::slice::from_raw_parts(p.grad as *const f32, numel),
            shape: &p.shape,
            row_var: moment(p.row_var, batch * rows),
            col_var: moment(p.col_var, batch * cols),
            variance: moment(p.variance, numel),
        }
    };
    adafactor_fused(cfg, step, bufs, GradScaling::NONE).map_err(optim_error)?;
    Ok(())
}
