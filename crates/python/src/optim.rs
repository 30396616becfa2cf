//! `headroom._native`'s optimizer steps: [`FusedAdam`] (Adam and AdamW, in the arithmetic of
//! PyTorch's own fused kernel, [`FusedAdamMath::Torch`]) and [`Adam8bit`]
//! (bitsandbytes' blockwise 8-bit Adam), each one headroom-optim raw-buffer optimizer stepping
//! the device pointers of torch's tensors in place, with no copies: one launch for every
//! parameter of a call (8-bit: one more for the 32-bit states of small tensors).
//!
//! Launches go to headroom-ops-cuda's stream, the legacy default stream, which is torch's
//! default stream (`torch.cuda.current_stream().cuda_stream == 0`); a call from any other
//! stream is refused with a `ValueError`, since the kernels would not be ordered after the
//! gradients' producers. One `CudaBackend` per device is shared by all optimizers (its own
//! small allocations — the launch table, the 8-bit lookup tables — come from its allocator).

use crate::device::{backend, on_default_stream};
use headroom_autograd_core::DType;
use headroom_optim::cuda::{
    Adam8bitMath, CudaAdam4bit, CudaAdam8bit, CudaFusedAdam, CudaSgd, DeviceAdam8bitParam,
    DeviceAdamParam, DeviceSgdParam, FusedAdamMath,
};
use headroom_optim::kernels::{
    adam4bit_blockwise, adam4bit_f32_states, adam_fused_stochastic, bf16, f16, is_quantized_4bit,
    sgd_fused, AdamStochasticBuffers, Bf16Rounding, BlockwiseBuffers, F32States, GradScaling,
    ParamElement, ParamRounding, SgdBuffers, AO_BLOCK_SIZE,
};
use headroom_optim::{
    Adam4bitConfig, Adam8bitConfig, AdamConfig, AdamStochasticConfig, OptimError, SgdConfig,
    WeightDecay,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<FusedAdam>()?;
    m.add_class::<AdamStochastic>()?;
    m.add_class::<Sgd>()?;
    m.add_class::<Adam4bit>()?;
    m.add_class::<Adam8bit>()?;
    m.add_class::<crate::adafactor::Adafactor>()?;
    m.add_function(wrap_pyfunction!(bnb_maps, m)?)?;
    Ok(())
}

pub(crate) fn optim_error(error: OptimError) -> PyErr {
    PyRuntimeError::new_err(error.to_string())
}

pub(crate) fn check_stream(stream: u64) -> PyResult<()> {
    on_default_stream(
        stream,
        "headroom optimizers step on torch's default stream; call step() outside \
         `with torch.cuda.stream(...)` (or synchronise that stream with the default one first)",
    )
}

/// A step of CPU tensors takes no loss scaling: its scale and flag would be device addresses.
fn refuse_host_scaling(grad_scale: Option<u64>, found_inf: Option<u64>) -> PyResult<()> {
    match (grad_scale, found_inf) {
        (None, None) => Ok(()),
        _ => Err(PyValueError::new_err(
            "loss scaling (grad_scale, found_inf) is for CUDA parameters",
        )),
    }
}

/// Checks that every list has `n` entries and no address is null.
fn check_lists(lists: &[(&str, &[u64])], n: usize) -> PyResult<()> {
    for (name, list) in lists {
        if list.len() != n {
            return Err(PyValueError::new_err(format!(
                "`{name}` has {} entries for {n} parameters",
                list.len()
            )));
        }
        if list.contains(&0) {
            return Err(PyValueError::new_err(format!(
                "`{name}` holds a null device pointer (an empty or CPU tensor?)"
            )));
        }
    }
    Ok(())
}

/// Fused Adam/AdamW over f32 device buffers.
#[pyclass]
pub(crate) struct FusedAdam {
    inner: CudaFusedAdam,
    params: Vec<DeviceAdamParam>,
}

#[pymethods]
impl FusedAdam {
    #[new]
    fn new(device: usize) -> PyResult<FusedAdam> {
        // SAFETY: no buffers yet; each step names its own.
        let inner = unsafe { CudaFusedAdam::new(backend(device)?, &[]) }
            .map_err(optim_error)?
            .with_math(FusedAdamMath::Torch);
        Ok(FusedAdam {
            inner,
            params: Vec::new(),
        })
    }

    /// One step of every parameter at step number `step`: `hyper` = (lr, beta1, beta2, eps,
    /// weight_decay); `decoupled` for AdamW.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, step, hyper, decoupled, maximize, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lens, grad_scale=None, found_inf=None))]
    fn step(
        &mut self,
        stream: u64,
        step: u64,
        hyper: (f64, f64, f64, f64, f64),
        decoupled: bool,
        maximize: bool,
        params: Vec<u64>,
        grads: Vec<u64>,
        exp_avgs: Vec<u64>,
        exp_avg_sqs: Vec<u64>,
        max_exp_avg_sqs: Option<Vec<u64>>,
        lens: Vec<usize>,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
    ) -> PyResult<()> {
        check_stream(stream)?;
        let cfg = adam_config(hyper, decoupled, max_exp_avg_sqs.is_some(), maximize);
        let lists = (&params[..], &grads[..], &exp_avgs[..], &exp_avg_sqs[..]);
        adam_params(&mut self.params, lists, max_exp_avg_sqs.as_deref(), &lens)?;
        // SAFETY: `headroom.optim` passes the data pointers of live, contiguous f32 CUDA tensors
        // of `lens` elements on this optimizer's device, which it keeps alive across the call:
        // its `_LaunchPlan` checks every parameter (CUDA, f32, contiguous, one device, no two
        // sharing memory) and every state tensor against its parameter (dtype, device, shape,
        // contiguity) whenever the lists are built, and before each step compares each
        // parameter's (data_ptr, dtype, numel, device, contiguity) and the states' pointers
        // with what they were built from (rebuilding or raising on a change) and checks each
        // gradient's dtype, device, numel and contiguity against its parameter, and
        // `grad_scale`/`found_inf` (one f32 each on this device). Torch's default stream is the
        // stream of the launch (checked above), so the kernels run after the gradients are
        // written and before anything reads them.
        unsafe {
            self.inner
                .step_buffers(&cfg, step, &self.params, (grad_scale, found_inf))
        }
        .map_err(optim_error)
    }
}

/// The `AdamConfig` of a step's hyperparameters.
fn adam_config(
    (lr, beta1, beta2, eps, weight_decay): (f64, f64, f64, f64, f64),
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
) -> AdamConfig {
    AdamConfig {
        lr,
        betas: (beta1, beta2),
        eps,
        weight_decay,
        decay: if decoupled {
            WeightDecay::Decoupled
        } else {
            WeightDecay::L2
        },
        amsgrad,
        maximize,
    }
}

/// The dtype torch names `name` (`"float32"`, `"bfloat16"`, `"float16"`), if `who` steps it.
fn param_dtype(name: &str, allowed: &[DType], who: &str) -> PyResult<DType> {
    let dtype = match name {
        "float32" => Some(DType::F32),
        "bfloat16" => Some(DType::BF16),
        "float16" => Some(DType::F16),
        _ => None,
    };
    dtype
        .filter(|d| allowed.contains(d))
        .ok_or_else(|| PyValueError::new_err(format!("{name} parameters: {who} steps {allowed:?}")))
}

/// Checks the address lists of an Adam step as `headroom.optim` passes them (parameters,
/// gradients, first and second moments; one entry per parameter, no null address) and writes
/// them into `out`.
fn adam_params(
    out: &mut Vec<DeviceAdamParam>,
    (params, grads, exp_avgs, exp_avg_sqs): (&[u64], &[u64], &[u64], &[u64]),
    max_exp_avg_sqs: Option<&[u64]>,
    lens: &[usize],
) -> PyResult<()> {
    let n = lens.len();
    let mut lists = vec![
        ("params", params),
        ("grads", grads),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
    ];
    lists.extend(max_exp_avg_sqs.map(|max| ("max_exp_avg_sqs", max)));
    check_lists(&lists, n)?;
    out.clear();
    out.extend((0..n).map(|i| DeviceAdamParam {
        param: params[i],
        grad: grads[i],
        exp_avg: exp_avgs[i],
        exp_avg_sq: exp_avg_sqs[i],
        max_exp_avg_sq: max_exp_avg_sqs.map(|m| m[i]),
        len: lens[i],
    }));
    Ok(())
}

/// Adam/AdamW on bf16 parameters with f32 moments (or bf16 moments, `bf16_state`), the new
/// parameters rounded to bf16 stochastically (headroom-optim's `AdamStochasticConfig`): on a CUDA
/// device one launch for every
/// parameter; on the CPU (`device` `None`) the host kernel, parameter by parameter. Both give
/// the same bits for the same seed, slots and steps.
#[pyclass]
pub(crate) struct AdamStochastic {
    inner: Option<CudaFusedAdam>,
    params: Vec<DeviceAdamParam>,
}

#[pymethods]
impl AdamStochastic {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(device: Option<usize>) -> PyResult<AdamStochastic> {
        let inner = match device {
            Some(ordinal) => {
                let backend = backend(ordinal)?;
                // SAFETY: no buffers yet; each step names its own.
                Some(unsafe { CudaFusedAdam::new(backend, &[]) }.map_err(optim_error)?)
            }
            None => None,
        };
        Ok(AdamStochastic {
            inner,
            params: Vec::new(),
        })
    }

    /// One step of every parameter at step number `step`: `hyper` = (lr, beta1, beta2, eps,
    /// weight_decay); `decoupled` for AdamW; `seed` and each parameter's `slots` entry key its
    /// rounding bits; `bf16_state`: the moments are bf16, else f32.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, step, hyper, decoupled, maximize, seed, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lens, slots, grad_scale=None, found_inf=None, bf16_state=false))]
    fn step(
        &mut self,
        stream: u64,
        step: u64,
        hyper: (f64, f64, f64, f64, f64),
        decoupled: bool,
        maximize: bool,
        seed: u64,
        params: Vec<u64>,
        grads: Vec<u64>,
        exp_avgs: Vec<u64>,
        exp_avg_sqs: Vec<u64>,
        max_exp_avg_sqs: Option<Vec<u64>>,
        lens: Vec<usize>,
        slots: Vec<usize>,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
        bf16_state: bool,
    ) -> PyResult<()> {
        if slots.len() != lens.len() {
            return Err(PyValueError::new_err(format!(
                "`slots` has {} entries for {} parameters",
                slots.len(),
                lens.len()
            )));
        }
        let cfg = AdamStochasticConfig::new(
            adam_config(hyper, decoupled, max_exp_avg_sqs.is_some(), maximize),
            seed,
        );
        let lists = (&params[..], &grads[..], &exp_avgs[..], &exp_avg_sqs[..]);
        adam_params(&mut self.params, lists, max_exp_avg_sqs.as_deref(), &lens)?;
        let Some(inner) = &mut self.inner else {
            refuse_host_scaling(grad_scale, found_inf)?;
            for (p, &slot) in self.params.iter().zip(&slots) {
                let key = cfg.key(slot, step);
                // SAFETY: `headroom.optim` passes the data pointers of live, contiguous CPU
                // tensors it holds during the call: a bf16 parameter and gradient and states of
                // the moments' dtype (bf16 with `bf16_state`, else f32) of `len` elements each,
                // checked against the parameter (dtype, device, shape, contiguity) when the
                // lists were built and the gradient at this step, no two sharing memory
                // (checked), so the slices alias nothing.
                unsafe {
                    if bf16_state {
                        host_stochastic_step::<bf16>(&cfg.adam, step, key, p)
                    } else {
                        host_stochastic_step::<f32>(&cfg.adam, step, key, p)
                    }
                }?;
            }
            return Ok(());
        };
        check_stream(stream)?;
        let moments = if bf16_state { DType::BF16 } else { DType::F32 };
        // SAFETY: `headroom.optim` passes the data pointers of live, contiguous bf16 parameters
        // and gradients and states of `moments` (the group's state dtype, checked when the lists
        // are built) of `lens` elements on this optimizer's device, checked as for
        // `FusedAdam::step` (every parameter and state when the lists are built, every gradient
        // and the scaling tensors at each step), kept alive across the call; torch's default
        // stream is the launch's (checked above).
        unsafe {
            inner.step_buffers_stochastic(
                &cfg,
                step,
                &self.params,
                &slots,
                moments,
                (grad_scale, found_inf),
            )
        }
        .map_err(optim_error)
    }
}

/// One parameter's stochastic Adam step on the host, moments of `M`.
///
/// # Safety
/// `p`'s addresses are live, contiguous host buffers of `p.len` elements — a bf16 parameter and
/// gradient, states of `M` — that nothing else reads or writes during the call and that do not
/// overlap.
unsafe fn host_stochastic_step<M: ParamElement>(
    cfg: &AdamConfig,
    step: u64,
    key: u64,
    p: &DeviceAdamParam,
) -> PyResult<()> {
    // SAFETY: the caller's contract.
    let bufs = unsafe {
        AdamStochasticBuffers {
            param: std::slice::from_raw_parts_mut(p.param as *mut bf16, p.len),
            grad: std::slice::from_raw_parts(p.grad as *const bf16, p.len),
            exp_avg: std::slice::from_raw_parts_mut(p.exp_avg as *mut M, p.len),
            exp_avg_sq: std::slice::from_raw_parts_mut(p.exp_avg_sq as *mut M, p.len),
            max_exp_avg_sq: p
                .max_exp_avg_sq
                .map(|m| std::slice::from_raw_parts_mut(m as *mut M, p.len)),
        }
    };
    adam_fused_stochastic(cfg, step, key, bufs, GradScaling::NONE).map_err(optim_error)?;
    Ok(())
}

/// `torch.optim.SGD`'s update (momentum, dampening, Nesterov, weight decay, maximize) in the
/// order of operations of PyTorch's fused SGD in f32 arithmetic, over f32, bf16 or f16 parameters: on a CUDA device one
/// launch for every parameter, on the CPU (`device` `None`) the host kernel parameter by
/// parameter; the same bits.
#[pyclass]
pub(crate) struct Sgd {
    inner: Option<CudaSgd>,
    params: Vec<DeviceSgdParam>,
}

#[pymethods]
impl Sgd {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(device: Option<usize>) -> PyResult<Sgd> {
        let inner = device.map(backend).transpose()?.map(CudaSgd::new);
        Ok(Sgd {
            inner,
            params: Vec::new(),
        })
    }

    /// One step of every parameter at step number `step` (1: the momentum buffers take the
    /// gradients): `hyper` = (lr, momentum, dampening, weight_decay); `dtype` the parameters'
    /// (`"float32"`, `"bfloat16"`, `"float16"`); `momentum_buffers` `None` without momentum.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, step, hyper, nesterov, maximize, dtype, params, grads, momentum_buffers, lens, grad_scale=None, found_inf=None))]
    fn step(
        &mut self,
        stream: u64,
        step: u64,
        hyper: (f64, f64, f64, f64),
        nesterov: bool,
        maximize: bool,
        dtype: &str,
        params: Vec<u64>,
        grads: Vec<u64>,
        momentum_buffers: Option<Vec<u64>>,
        lens: Vec<usize>,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
    ) -> PyResult<()> {
        let dtype = param_dtype(dtype, &[DType::F32, DType::BF16, DType::F16], "SGD")?;
        let n = lens.len();
        let mut lists = vec![("params", &params[..]), ("grads", &grads[..])];
        lists.extend(momentum_buffers.as_deref().map(|b| ("momentum_buffers", b)));
        check_lists(&lists, n)?;
        let (lr, momentum, dampening, weight_decay) = hyper;
        let cfg = SgdConfig {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize,
        };
        cfg.validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.params.clear();
        self.params.extend((0..n).map(|i| DeviceSgdParam {
            param: params[i],
            grad: grads[i],
            momentum_buffer: momentum_buffers.as_ref().map(|b| b[i]),
            len: lens[i],
        }));
        let Some(inner) = &mut self.inner else {
            refuse_host_scaling(grad_scale, found_inf)?;
            fn run<T: ParamElement>(
                cfg: &SgdConfig,
                step: u64,
                params: &[DeviceSgdParam],
            ) -> Result<(), OptimError> {
                for p in params {
                    // SAFETY: `headroom.optim` passes the data pointers of live, contiguous CPU
                    // tensors it holds during the call: the parameter, its gradient and its
                    // momentum buffer, `len` elements of T each (checked against the parameter
                    // when the lists were built, the gradient at this step), no two sharing
                    // memory (checked), so the slices alias nothing.
                    let bufs = unsafe {
                        SgdBuffers {
                            param: std::slice::from_raw_parts_mut(p.param as *mut T, p.len),
                            grad: std::slice::from_raw_parts(p.grad as *const T, p.len),
                            momentum_buffer: p
                                .momentum_buffer
                                .map(|b| std::slice::from_raw_parts_mut(b as *mut T, p.len)),
                            first_step: step == 1,
                        }
                    };
                    sgd_fused(cfg, bufs, GradScaling::NONE)?;
                }
                Ok(())
            }
            return match dtype {
                DType::F32 => run::<f32>(&cfg, step, &self.params),
                DType::BF16 => run::<bf16>(&cfg, step, &self.params),
                _ => run::<f16>(&cfg, step, &self.params),
            }
            .map_err(optim_error);
        };
        check_stream(stream)?;
        // SAFETY: `headroom.optim` passes the data pointers of live, contiguous CUDA tensors of
        // `dtype` on this optimizer's device (parameters, gradients, momentum buffers of `lens`
        // elements), checked as for `FusedAdam::step` and kept alive across the call; torch's
        // default stream is the launch's (checked above).
        unsafe { inner.step_buffers(&cfg, dtype, step, &self.params, (grad_scale, found_inf)) }
            .map_err(optim_error)
    }
}

/// torchao's 4-bit Adam/AdamW (its code tables and blocks of 128; f32 states where torchao does
/// not quantise) over f32 or bf16 parameters, a bf16 parameter rounded to nearest or
/// stochastically: on a CUDA device two launches for every parameter, on the CPU (`device`
/// `None`) the host kernels parameter by parameter; the same bits.
#[pyclass]
pub(crate) struct Adam4bit {
    inner: Option<CudaAdam4bit>,
    params: Vec<DeviceAdam8bitParam>,
}

#[pymethods]
impl Adam4bit {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(device: Option<usize>) -> PyResult<Adam4bit> {
        let inner = device.map(backend).transpose()?.map(CudaAdam4bit::new);
        Ok(Adam4bit {
            inner,
            params: Vec::new(),
        })
    }

    /// One step of every parameter at step number `step`: `hyper` = (lr, beta1, beta2, eps,
    /// weight_decay); `decoupled` for AdamW; `dtype` the parameters' (`"float32"` or
    /// `"bfloat16"`); `seed` `None` to round bf16 parameters to nearest, else stochastically
    /// with streams keyed by it, each parameter's `slots` entry and the step. Parameters whose
    /// length torchao quantises have packed codes in `state1`/`state2` and scales in
    /// `absmax1`/`absmax2`; the others f32 states and absmax addresses of 0.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, step, hyper, decoupled, dtype, seed, params, grads, state1, state2, absmax1, absmax2, lens, slots, grad_scale=None, found_inf=None))]
    fn step(
        &mut self,
        stream: u64,
        step: u64,
        hyper: (f64, f64, f64, f64, f64),
        decoupled: bool,
        dtype: &str,
        seed: Option<u64>,
        params: Vec<u64>,
        grads: Vec<u64>,
        state1: Vec<u64>,
        state2: Vec<u64>,
        absmax1: Vec<u64>,
        absmax2: Vec<u64>,
        lens: Vec<usize>,
        slots: Vec<usize>,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
    ) -> PyResult<()> {
        let dtype = param_dtype(dtype, &[DType::F32, DType::BF16], "4-bit Adam")?;
        let n = lens.len();
        check_lists(
            &[
                ("params", &params[..]),
                ("grads", &grads[..]),
                ("state1", &state1[..]),
                ("state2", &state2[..]),
            ],
            n,
        )?;
        if [absmax1.len(), absmax2.len(), slots.len()] != [n; 3] {
            return Err(PyValueError::new_err(
                "absmax and slot lists must have one entry per parameter",
            ));
        }
        let (lr, beta1, beta2, eps, weight_decay) = hyper;
        let cfg = Adam4bitConfig {
            lr,
            betas: (beta1, beta2),
            eps,
            weight_decay,
            decoupled,
            amsgrad: false,
            bf16_rounding: match seed {
                Some(seed) => Bf16Rounding::Stochastic { seed },
                None => Bf16Rounding::Nearest,
            },
        };
        cfg.validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.params.clear();
        self.params.extend((0..n).map(|i| DeviceAdam8bitParam {
            param: params[i],
            grad: grads[i],
            state1: state1[i],
            state2: state2[i],
            absmax1: absmax1[i],
            absmax2: absmax2[i],
            len: lens[i],
        }));
        let Some(inner) = &mut self.inner else {
            refuse_host_scaling(grad_scale, found_inf)?;
            if let Some(p) = self
                .params
                .iter()
                .find(|p| (p.absmax1 != 0 && p.absmax2 != 0) != is_quantized_4bit(p.len))
            {
                return Err(PyValueError::new_err(format!(
                    "a parameter of {} elements with the wrong absmax buffers",
                    p.len
                )));
            }
            return match dtype {
                DType::F32 => host_4bit::<f32>(&cfg, step, &self.params, &slots),
                _ => host_4bit::<bf16>(&cfg, step, &self.params, &slots),
            }
            .map_err(optim_error);
        };
        check_stream(stream)?;
        // SAFETY: `headroom.optim` passes the data pointers of live, contiguous CUDA tensors of
        // this optimizer's device, checked against their parameter as for `Adam8bit::step` (the
        // codes half the parameter's length in bytes, one scale per block of 128, f32 states of
        // its length where torchao does not quantise) and kept alive across the call; torch's
        // default stream is the launch's (checked above).
        unsafe {
            inner.step_buffers(
                &cfg,
                dtype,
                step,
                &self.params,
                &slots,
                (grad_scale, found_inf),
            )
        }
        .map_err(optim_error)
    }
}

/// 4-bit Adam's step on the host over the memory of CPU tensors.
fn host_4bit<T: ParamElement>(
    cfg: &Adam4bitConfig,
    step: u64,
    params: &[DeviceAdam8bitParam],
    slots: &[usize],
) -> Result<(), OptimError> {
    for (p, &slot) in params.iter().zip(slots) {
        let rounding = ParamRounding::of(cfg.bf16_rounding, slot, step);
        let n = p.len;
        // SAFETY: `headroom.optim` passes the data pointers of live, contiguous CPU tensors it
        // holds during the call, checked against the parameter when the lists were built (and
        // the gradient at this step), no two sharing memory: the parameter and gradient of `n`
        // elements of T, and either packed codes of `n / 2` bytes and `n / 128` f32 scales
        // (lengths torchao quantises, checked above) or f32 states of `n` elements.
        unsafe {
            let param = std::slice::from_raw_parts_mut(p.param as *mut T, n);
            let grad = std::slice::from_raw_parts(p.grad as *const T, n);
            if is_quantized_4bit(n) {
                let scales = n / AO_BLOCK_SIZE;
                let bufs = BlockwiseBuffers {
                    param,
                    grad,
                    state1: std::slice::from_raw_parts_mut(p.state1 as *mut u8, n / 2),
                    state2: std::slice::from_raw_parts_mut(p.state2 as *mut u8, n / 2),
                    absmax1: std::slice::from_raw_parts_mut(p.absmax1 as *mut f32, scales),
                    absmax2: std::slice::from_raw_parts_mut(p.absmax2 as *mut f32, scales),
                };
                adam4bit_blockwise(cfg, step, bufs, GradScaling::NONE, rounding)?;
            } else {
                let bufs = F32States {
                    param,
                    grad,
                    state1: std::slice::from_raw_parts_mut(p.state1 as *mut f32, n),
                    state2: std::slice::from_raw_parts_mut(p.state2 as *mut f32, n),
                };
                adam4bit_f32_states(cfg, step, bufs, GradScaling::NONE, rounding)?;
            }
        }
    }
    Ok(())
}

/// bitsandbytes' 8-bit blockwise Adam (and its 32-bit path under 4096 elements) over device
/// buffers.
#[pyclass]
pub(crate) struct Adam8bit {
    inner: CudaAdam8bit,
    params: Vec<DeviceAdam8bitParam>,
}

#[pymethods]
impl Adam8bit {
    /// `bitsandbytes_arithmetic`: step with bitsandbytes' own (fast-math) instructions,
    /// `Adam8bitMath::Bitsandbytes` (the default, bitwise equal to bitsandbytes), or with the
    /// portable, correctly rounded arithmetic.
    #[new]
    #[pyo3(signature = (device, bitsandbytes_arithmetic=true))]
    fn new(device: usize, bitsandbytes_arithmetic: bool) -> PyResult<Adam8bit> {
        let math = if bitsandbytes_arithmetic {
            Adam8bitMath::Bitsandbytes
        } else {
            Adam8bitMath::Portable
        };
        // SAFETY: no buffers yet; each step names its own.
        let inner = unsafe { CudaAdam8bit::new(backend(device)?, &[]) }
            .map_err(optim_error)?
            .with_math(math);
        Ok(Adam8bit {
            inner,
            params: Vec::new(),
        })
    }

    /// One step of every parameter at step number `step`: `hyper` = (lr, beta1, beta2, eps,
    /// weight_decay). Parameters under 4096 elements have f32 states and absmax pointers of 0.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, step, hyper, params, grads, state1, state2, absmax1, absmax2, lens, grad_scale=None, found_inf=None))]
    fn step(
        &mut self,
        stream: u64,
        step: u64,
        hyper: (f64, f64, f64, f64, f64),
        params: Vec<u64>,
        grads: Vec<u64>,
        state1: Vec<u64>,
        state2: Vec<u64>,
        absmax1: Vec<u64>,
        absmax2: Vec<u64>,
        lens: Vec<usize>,
        grad_scale: Option<u64>,
        found_inf: Option<u64>,
    ) -> PyResult<()> {
        check_stream(stream)?;
        let n = lens.len();
        check_lists(
            &[
                ("params", &params[..]),
                ("grads", &grads[..]),
                ("state1", &state1[..]),
                ("state2", &state2[..]),
            ],
            n,
        )?;
        if absmax1.len() != n || absmax2.len() != n {
            return Err(PyValueError::new_err(
                "absmax lists must have one entry per parameter",
            ));
        }
        let (lr, beta1, beta2, eps, weight_decay) = hyper;
        let cfg = Adam8bitConfig {
            lr,
            betas: (beta1, beta2),
            eps,
            weight_decay,
            bf16_rounding: Bf16Rounding::Nearest,
        };
        cfg.validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.params.clear();
        self.params.extend((0..n).map(|i| DeviceAdam8bitParam {
            param: params[i],
            grad: grads[i],
            state1: state1[i],
            state2: state2[i],
            absmax1: absmax1[i],
            absmax2: absmax2[i],
            len: lens[i],
        }));
        // SAFETY: as `FusedAdam::step`, checked the same way by `headroom.optim`: live
        // contiguous f32 parameters and gradients, u8 states of the parameter's shape and f32
        // absmax of one entry per 256-element block (f32 states and absmax pointers of 0 under
        // 4096 elements, which the kernel does not read), on this device, stepped on torch's
        // default stream.
        unsafe {
            self.inner
                .step_buffers(&cfg, step, &self.params, (grad_scale, found_inf))
        }
        .map_err(optim_error)
    }
}

/// bitsandbytes' two 256-entry quantization maps (signed `dynamic`, unsigned `udynamic`), as
/// its `qmap1` and `qmap2` state hold them.
#[pyfunction]
fn bnb_maps() -> (Vec<f32>, Vec<f32>) {
    let (signed, unsigned) = headroom_optim::bnb_maps();
    (signed.to_vec(), unsigned.to_vec())
}
