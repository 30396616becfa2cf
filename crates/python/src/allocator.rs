//! `headroom._native`'s allocator functions: configuration before the first allocation, the
//! statistics, summary, history and snapshot PyTorch cannot ask a pluggable allocator for, and
//! `record_stream`. Each forwards to headroom-torch-allocator's C ABI or its Rust functions;
//! errors become `RuntimeError`s (`ValueError` for a bad setting) with the allocator's message.
//!
//! Reaching a device's plugin freezes the settings (`configure` fails after it), so the readers
//! here reach it only once the allocator serves allocations (`is_in_use`): before, they answer
//! `None`/`False` and `headroom.cuda` reports an allocator that has served nothing, as PyTorch
//! does before CUDA is initialised.

use std::ffi::{c_void, CString};

use headroom_torch_allocator::abi;
use headroom_torch_allocator::PluginError;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(configure, m)?)?;
    m.add_function(wrap_pyfunction!(use_host_memory, m)?)?;
    m.add_function(wrap_pyfunction!(is_in_use, m)?)?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(memory_stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(memory_summary, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_stats, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(record_history, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(function_addresses, m)?)?;
    Ok(())
}

fn to_py(error: PluginError) -> PyErr {
    match error {
        PluginError::Alloc(headroom_caching_allocator_error) => {
            let message = headroom_caching_allocator_error.to_string();
            if message.starts_with("invalid allocator setting") {
                PyValueError::new_err(message)
            } else {
                PyRuntimeError::new_err(message)
            }
        }
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

fn status(code: i32) -> PyResult<()> {
    match code {
        0 => Ok(()),
        _ => Err(PyRuntimeError::new_err(
            headroom_torch_allocator::last_error().unwrap_or_else(|| "unknown error".into()),
        )),
    }
}

/// Sets the allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`'s syntax) before the first
/// allocation.
#[pyfunction]
fn configure(conf: &str) -> PyResult<()> {
    headroom_torch_allocator::configure(conf).map_err(to_py)
}

/// Serves every device from host memory instead of CUDA (tests without a GPU).
#[pyfunction]
#[pyo3(signature = (capacity=None))]
fn use_host_memory(capacity: Option<u64>) -> PyResult<()> {
    headroom_torch_allocator::use_host_memory(capacity).map_err(to_py)
}

/// Whether the allocator has been reached (its settings are frozen).
#[pyfunction]
fn is_in_use() -> bool {
    headroom_torch_allocator::is_in_use()
}

/// The settings in force, every one written out.
#[pyfunction]
fn settings() -> String {
    headroom_torch_allocator::settings()
}

/// Whether the allocator serves allocations: only then may a reader reach a device's plugin
/// without freezing settings that `configure` may still change.
fn serving() -> bool {
    headroom_torch_allocator::is_in_use()
}

/// Every statistic of `torch.cuda.memory_stats()` for `device`, as a JSON object; `None` while
/// the allocator has served nothing (the settings stay open).
#[pyfunction]
fn memory_stats_json(device: i64) -> PyResult<Option<String>> {
    if !serving() {
        return Ok(None);
    }
    let plugin = headroom_torch_allocator::with_device(device).map_err(to_py)?;
    Ok(Some(plugin.memory_stats_json()))
}

/// `torch.cuda.memory_summary()`'s table for `device`; `None` while the allocator has served
/// nothing.
#[pyfunction]
#[pyo3(signature = (device, abbreviated=false))]
fn memory_summary(device: i64, abbreviated: bool) -> PyResult<Option<String>> {
    if !serving() {
        return Ok(None);
    }
    let plugin = headroom_torch_allocator::with_device(device).map_err(to_py)?;
    Ok(Some(plugin.memory_summary(abbreviated)))
}

/// Resets `device`'s peak statistics to their current values; `False` (nothing to reset)
/// while the allocator has served nothing.
#[pyfunction]
fn reset_peak_stats(device: i32) -> PyResult<bool> {
    if !serving() {
        return Ok(false);
    }
    status(abi::headroom_reset_peak_stats(device)).map(|()| true)
}

/// Releases `device`'s cached blocks that no allocation uses; `False` (nothing cached) while
/// the allocator has served nothing.
#[pyfunction]
fn empty_cache(device: i32) -> PyResult<bool> {
    if !serving() {
        return Ok(false);
    }
    status(abi::headroom_empty_cache(device)).map(|()| true)
}

/// Starts or stops recording `device`'s history (`max_entries` 0: the default). This reaches
/// the device's plugin, freezing the settings: `headroom.cuda` calls it once `use_allocator`
/// has chosen them (and keeps earlier requests until then).
#[pyfunction]
fn record_history(device: i32, enabled: bool, max_entries: u64) -> PyResult<()> {
    status(abi::headroom_record_history(
        device,
        i32::from(enabled),
        max_entries,
    ))
}

/// Writes `device`'s snapshot pickle to `path`; `False`, with nothing written, while the
/// allocator has served nothing.
#[pyfunction]
fn snapshot(device: i32, path: &str) -> PyResult<bool> {
    if !serving() {
        return Ok(false);
    }
    let path = CString::new(path).map_err(|_| PyValueError::new_err("path contains a NUL"))?;
    // SAFETY: a NUL-terminated string that outlives the call.
    status(unsafe { abi::headroom_snapshot(device, path.as_ptr()) }).map(|()| true)
}

/// The raw handle of `stream` if it is one of PyTorch's own streams of `device`: the default
/// stream or one of its per-device pools, which PyTorch creates once and never destroys.
///
/// `torch.cuda.ExternalStream` (or a `torch.cuda.Stream` rebuilt from an external stream's
/// id) wraps a handle someone else owns and may destroy while the allocator still records
/// events on it, so it is refused; so is anything that is not a `torch.cuda.Stream`. PyTorch's
/// stream ids say which is which (c10's `CUDAStream`: an external stream's id is its pointer,
/// whose lowest bit is 0; a pooled stream's id has its lowest bit set; the default stream's id
/// is 0).
fn pooled_stream(stream: &Bound<'_, PyAny>, device: i32) -> PyResult<u64> {
    let cuda = stream.py().import("torch.cuda")?;
    if !stream.is_instance(&cuda.getattr("Stream")?)? {
        return Err(PyTypeError::new_err(format!(
            "record_stream needs a torch.cuda.Stream, got {}",
            stream.get_type().name()?
        )));
    }
    let external = stream.is_instance(&cuda.getattr("ExternalStream")?)?;
    let id: i64 = stream.getattr("stream_id")?.extract()?;
    if external || (id != 0 && id & 1 == 0) {
        return Err(PyValueError::new_err(
            "record_stream needs one of PyTorch's own streams (torch.cuda.Stream(), \
             torch.cuda.current_stream()): the allocator records events on the stream when the \
             tensor is freed, and an external stream may be destroyed before that; keep the \
             tensor alive until the external stream's work is done instead",
        ));
    }
    let stream_device: i64 = stream.getattr("device_index")?.extract()?;
    if stream_device != i64::from(device) {
        return Err(PyValueError::new_err(format!(
            "record_stream: the tensor is on cuda:{device}, the stream on cuda:{stream_device}"
        )));
    }
    stream.getattr("cuda_stream")?.extract()
}

/// Marks the allocation at `ptr` (a storage's first byte) as used by `stream` as well: a
/// `torch.cuda.Stream` of `device` from PyTorch's pools (see [`pooled_stream`]).
#[pyfunction]
fn record_stream(ptr: u64, device: i32, stream: &Bound<'_, PyAny>) -> PyResult<()> {
    let raw = pooled_stream(stream, device)?;
    if !serving() {
        return Err(PyRuntimeError::new_err(
            "headroom's allocator has served no allocation, so this tensor is not its own",
        ));
    }
    // SAFETY: `raw` is the default stream or a pooled stream of `device` (checked by
    // `pooled_stream`), which PyTorch creates once per process and never destroys, so it stays
    // valid for as long as the allocator lives; `ptr` is only looked up among the allocator's
    // live allocations (an unknown address is an error, never a dereference).
    status(unsafe { abi::headroom_record_stream(ptr as *mut c_void, device, raw as *mut c_void) })
}

/// The addresses of `headroom_alloc` and `headroom_free` in this extension (what PyTorch's
/// `CUDAPluggableAllocator` looks up by name), as integers.
#[pyfunction]
fn function_addresses() -> (usize, usize) {
    (
        abi::headroom_alloc as *const () as usize,
        abi::headroom_free as *const () as usize,
    )
}
