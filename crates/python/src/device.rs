//! The CUDA devices `headroom._native` launches on: one `CudaBackend` per device, shared by the
//! optimizers and the activation codec (its own small allocations come from its allocator), and
//! the rule that a launch is made from torch's default stream, the legacy default stream where
//! headroom-ops-cuda's kernels run, so that it is ordered after the work that wrote its inputs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use headroom_autograd_core::DType;
use headroom_ops_cuda::CudaBackend;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

/// The shared backend of device `ordinal`.
pub(crate) fn backend(ordinal: usize) -> PyResult<Arc<CudaBackend>> {
    static BACKENDS: OnceLock<Mutex<HashMap<usize, Arc<CudaBackend>>>> = OnceLock::new();
    let mut backends = BACKENDS
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| PyRuntimeError::new_err("a previous launch panicked"))?;
    if let Some(backend) = backends.get(&ordinal) {
        return Ok(Arc::clone(backend));
    }
    let backend = CudaBackend::new(ordinal).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    backends.insert(ordinal, Arc::clone(&backend));
    Ok(backend)
}

/// `Ok` when `stream` (torch's current stream's handle) is the legacy default stream, else a
/// `ValueError` with `message`.
pub(crate) fn on_default_stream(stream: u64, message: &'static str) -> PyResult<()> {
    match stream {
        0 => Ok(()),
        _ => Err(PyValueError::new_err(message)),
    }
}

/// The float element type torch names `dtype` (`"float32"`, `"float64"`, `"bfloat16"`,
/// `"float16"`), else a `TypeError`: "<dtype> tensors are not <refusal> (the four)".
pub(crate) fn float_dtype(dtype: &str, refusal: &str) -> PyResult<DType> {
    match dtype {
        "float32" => Ok(DType::F32),
        "float64" => Ok(DType::F64),
        "bfloat16" => Ok(DType::BF16),
        "float16" => Ok(DType::F16),
        other => Err(PyTypeError::new_err(format!(
            "{other} tensors are not {refusal} (float32, float64, bfloat16, float16)"
        ))),
    }
}
