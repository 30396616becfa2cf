//! What a step needs from candle's CUDA device: the device buffers of `Var`s, gradients and
//! states as addresses, Headroom's backend on the same device (its kernels launch there), and
//! the order between candle's stream and that backend's.
//!
//! Headroom's backend launches on the context's legacy default stream; candle launches on its
//! device's stream (the per-thread default stream of `CudaDevice::new`, or a stream of its own).
//! Each step makes the legacy stream wait for the work queued on candle's stream, launches, then
//! makes candle's stream wait for the launch: no host synchronisation, and correct whichever
//! stream candle uses.
//!
//! It sits on candle's CUDA storage and cudarc (candle's re-export), and on headroom-ops-cuda's
//! backend; it knows no update rule.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaDevice, DType, Device, Layout, Storage, Tensor};
use headroom_ops_cuda::CudaBackend;

use crate::error::CandleCudaError;

/// Headroom's backend of device `ordinal`, one per process and device (its allocator holds the
/// launches' piece tables).
pub(crate) fn backend(
    optimizer: &'static str,
    ordinal: usize,
) -> Result<Arc<CudaBackend>, CandleCudaError> {
    static BACKENDS: OnceLock<Mutex<HashMap<usize, Arc<CudaBackend>>>> = OnceLock::new();
    let mut backends = BACKENDS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(backend) = backends.get(&ordinal) {
        return Ok(backend.clone());
    }
    let backend = CudaBackend::new(ordinal).map_err(|e| CandleCudaError::Device {
        optimizer,
        op: "CudaBackend::new",
        reason: e.to_string(),
    })?;
    backends.insert(ordinal, backend.clone());
    Ok(backend)
}

/// The device address of `tensor`'s first element (contiguous, on `device`), and its dtype.
pub(crate) fn address(
    optimizer: &'static str,
    what: &str,
    tensor: &Tensor,
    device: &CudaDevice,
) -> Result<u64, CandleCudaError> {
    let unsupported = |reason: String| CandleCudaError::Unsupported { optimizer, reason };
    if !tensor.device().same_device(&Device::Cuda(device.clone())) {
        return Err(unsupported(format!(
            "the {what} is on {:?}, not on the Vars' device; keep every Var of an optimizer on \
             one CUDA device",
            tensor.device().location()
        )));
    }
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        return Err(unsupported(format!("the {what} is not in CUDA memory")));
    };
    let start = contiguous_start(optimizer, what, layout)?;
    let stream = device.cuda_stream();
    let base = match &storage.slice {
        CudaStorageSlice::F32(slice) => pointer(slice, &stream),
        CudaStorageSlice::BF16(slice) => pointer(slice, &stream),
        CudaStorageSlice::F16(slice) => pointer(slice, &stream),
        CudaStorageSlice::U8(slice) => pointer(slice, &stream),
        _ => {
            return Err(unsupported(format!(
                "a {:?} {what}; the optimizers step f32, bf16 and f16",
                tensor.dtype()
            )))
        }
    };
    Ok(base + (start * tensor.dtype().size_in_bytes()) as u64)
}

/// The first element's offset of a contiguous `layout`.
fn contiguous_start(
    optimizer: &'static str,
    what: &str,
    layout: &Layout,
) -> Result<usize, CandleCudaError> {
    layout
        .contiguous_offsets()
        .map(|(start, _)| start)
        .ok_or_else(|| CandleCudaError::Unsupported {
            optimizer,
            reason: format!("a non-contiguous {what}; step contiguous Vars"),
        })
}

/// The device address of `slice`, ordered after its last write on `stream` where candle tracks
/// events.
fn pointer<T>(
    slice: &candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    stream: &Arc<CudaStream>,
) -> u64 {
    let (address, _sync) = slice.device_ptr(stream);
    address
}

/// Zeros of `dtype` and `len` elements on `device`, a 1-d tensor of its own storage.
pub(crate) fn zeros(device: &CudaDevice, dtype: DType, len: usize) -> candle_core::Result<Tensor> {
    Tensor::zeros(len, dtype, &Device::Cuda(device.clone()))
}

/// Runs `launch` on Headroom's stream ordered between candle's work before and after it.
pub(crate) fn ordered<T>(
    optimizer: &'static str,
    device: &CudaDevice,
    launch: impl FnOnce() -> Result<T, CandleCudaError>,
) -> Result<T, CandleCudaError> {
    let candle = device.cuda_stream();
    let legacy = candle.context().default_stream();
    let failed = |op: &'static str| {
        move |e: candle_core::cuda_backend::cudarc::driver::DriverError| CandleCudaError::Device {
            optimizer,
            op,
            reason: e.to_string(),
        }
    };
    legacy
        .join(&candle)
        .map_err(failed("wait for candle's stream"))?;
    let outcome = launch();
    // Whatever the launch did, candle's later work waits for it.
    candle
        .join(&legacy)
        .map_err(failed("order candle's stream after the step"))?;
    outcome
}
