//! `headroom._native`'s allocator functions: configuration before the first allocation, the
//! statistics, summary, history and snapshot PyTorch cannot ask a pluggable allocator for, and
//! `record_stream`. Each forwards to headroom-torch-allocator's C ABI or its Rust functions;
//! errors become `RuntimeError`s (`ValueError` for a bad setting) with the allocator's message.

use std::ffi::{c_void, CString};

use headroom_torch_allocator::abi;
use headroom_torch_allocator::PluginError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
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

/// Every statistic of `torch.cuda.memory_stats()` for `device`, as a JSON object.
#[pyfunction]
fn memory_stats_json(device: i64) -> PyResult<String> {
    let plugin = headroom_torch_allocator::with_device(device).map_err(to_py)?;
    Ok(plugin.memory_stats_json())
}

/// `torch.cuda.memory_summary()`'s table for `device`.
#[pyfunction]
#[pyo3(signature = (device, abbreviated=false))]
fn memory_summary(device: i64, abbreviated: bool) -> PyResult<String> {
    let plugin = headroom_torch_allocator::with_device(device).map_err(to_py)?;
    Ok(plugin.memory_summary(abbreviated))
}

/// Resets `device`'s peak statistics to their current values.
#[pyfunction]
fn reset_peak_stats(device: i32) -> PyResult<()> {
    status(abi::headroom_reset_peak_stats(device))
}

/// Releases `device`'s cached blocks that no allocation uses.
#[pyfunction]
fn empty_cache(device: i32) -> PyResult<()> {
    status(abi::headroom_empty_cache(device))
}

/// Starts or stops recording `device`'s history (`max_entries` 0: the default).
#[pyfunction]
fn record_history(device: i32, enabled: bool, max_entries: u64) -> PyResult<()> {
    status(abi::headroom_record_history(
        device,
        i32::from(enabled),
        max_entries,
    ))
}

/// Writes `device`'s snapshot pickle to `path`.
#[pyfunction]
fn snapshot(device: i32, path: &str) -> PyResult<()> {
    let path = CString::new(path).map_err(|_| PyValueError::new_err("path contains a NUL"))?;
    // SAFETY: a NUL-terminated string that outlives the call.
    status(unsafe { abi::headroom_snapshot(device, path.as_ptr()) })
}

/// Marks the allocation at `ptr` as used by raw stream `stream` as well.
#[pyfunction]
fn record_stream(ptr: u64, device: i32, stream: u64) -> PyResult<()> {
    // SAFETY: `stream` comes from `torch.cuda.Stream.cuda_stream`: PyTorch's streams live for
    // the rest of the process (documented in `headroom.cuda.record_stream`).
    status(unsafe {
        abi::headroom_record_stream(ptr as *mut c_void, device, stream as *mut c_void)
    })
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
