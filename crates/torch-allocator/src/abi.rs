//! The C ABI: the functions PyTorch's `CUDAPluggableAllocator` loads by name, and the ones it
//! cannot ask a pluggable allocator for.
//!
//! PyTorch calls `headroom_alloc(size, device, stream)` and `headroom_free(ptr, size, device,
//! stream)` (the signatures `torch.cuda.memory.CUDAPluggableAllocator` expects); both run on the
//! caller's stream, a block freed on a stream is reused by that stream's later allocations in
//! stream order, exactly as PyTorch's own allocator does. PyTorch's Python API sets no other
//! hook of a pluggable allocator, so `Tensor.record_stream`, `torch.cuda.empty_cache()`,
//! `set_per_process_memory_fraction` and the statistics do nothing or raise under it; the
//! functions below are their replacements (`headroom.cuda` wraps them):
//!
//! | C function | PyTorch's counterpart |
//! |---|---|
//! | `headroom_configure(conf)` | `PYTORCH_CUDA_ALLOC_CONF` (also `per_process_memory_fraction`) |
//! | `headroom_record_stream(ptr, device, stream)` | `Tensor.record_stream(stream)` |
//! | `headroom_empty_cache(device)` | `torch.cuda.empty_cache()` |
//! | `headroom_reset_peak_stats(device)` | `torch.cuda.reset_peak_memory_stats()` |
//! | `headroom_memory_stats_json(device)` | `torch.cuda.memory_stats()` (a JSON object) |
//! | `headroom_memory_summary(device, abbreviated)` | `torch.cuda.memory_summary()` |
//! | `headroom_record_history(device, enabled, max_entries)` | `torch.cuda.memory._record_memory_history()` |
//! | `headroom_snapshot(device, path)` | `torch.cuda.memory._dump_snapshot(path)` |
//!
//! Status codes: 0 is success, -1 a failure whose message `headroom_last_error` copies out.
//! Allocation failures (out of memory) return a null pointer; PyTorch does not check it, so the
//! message is also written to standard error at that moment — the only channel a C allocator
//! has while PyTorch holds the call. Strings returned are freed with `headroom_string_free`.
//!
//! This module sits on `global.rs`; it converts C arguments and errors and holds no state but
//! the last error message.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;

use headroom_caching_allocator::HistoryOptions;
use parking_lot::Mutex;

use crate::error::PluginError;
use crate::global::{self, DevicePlugin};

static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

fn fail(error: PluginError) -> c_int {
    *LAST_ERROR.lock() = Some(error.to_string());
    -1
}

fn status(result: Result<(), PluginError>) -> c_int {
    result.map_or_else(fail, |()| 0)
}

fn device(ordinal: c_int) -> Result<DevicePlugin<'static>, PluginError> {
    global::with_device(i64::from(ordinal))
}

/// # Safety
/// `text` is null or a NUL-terminated string.
unsafe fn utf8<'a>(text: *const c_char, name: &'static str) -> Result<&'a str, PluginError> {
    if text.is_null() {
        return Err(PluginError::BadString { name });
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| PluginError::BadString { name })
}

fn c_string(text: String) -> *mut c_char {
    // Interior NULs cannot occur in the JSON or the summary; replace them rather than fail.
    CString::new(text.replace('\0', " "))
        .expect("NULs were replaced")
        .into_raw()
}

/// Allocates `size` bytes on `device` for work on `stream` (PyTorch's `alloc_fn`). Returns null
/// for 0 bytes, and on failure — out of memory, a negative size, a bad device — with the message
/// in `headroom_last_error` and on standard error.
///
/// # Safety
/// `stream` is a `cudaStream_t` of `device` (null: the legacy default stream) that stays valid
/// for the rest of the process, as PyTorch's streams do.
#[no_mangle]
pub unsafe extern "C" fn headroom_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let result = u64::try_from(size)
        .map_err(|_| PluginError::NegativeSize { size: size as i64 })
        .and_then(|size| Ok((size, self::device(device)?)))
        .and_then(|(size, plugin)| {
            // SAFETY: the stream outlives the allocator by the caller's contract.
            unsafe { plugin.allocate(size, stream as usize) }
        });
    match result {
        Ok(address) => address as *mut c_void,
        Err(error) => {
            // PyTorch ignores a null result; this is the one moment the user can be told.
            eprintln!("headroom allocator: {error}");
            fail(error);
            std::ptr::null_mut()
        }
    }
}

/// Frees `ptr` (PyTorch's `free_fn`; `size` and `stream` are known from the allocation and
/// ignored). A pointer this allocator did not hand out is counted as an error
/// (`headroom_last_error`) and otherwise ignored.
#[no_mangle]
pub extern "C" fn headroom_free(
    ptr: *mut c_void,
    _size: isize,
    device: c_int,
    _stream: *mut c_void,
) {
    let result = self::device(device).and_then(|plugin| plugin.free(ptr as u64));
    if let Err(error) = result {
        fail(error);
    }
}

/// Marks the allocation at `ptr` as used by `stream` as well (`Tensor.record_stream`).
///
/// # Safety
/// As [`headroom_alloc`]: `stream` is a stream of `device` valid for the rest of the process.
#[no_mangle]
pub unsafe extern "C" fn headroom_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    status(self::device(device).and_then(|plugin| {
        // SAFETY: forwarded from the caller.
        unsafe { plugin.record_stream(ptr as u64, stream as usize) }
    }))
}

/// Sets the settings (`PYTORCH_CUDA_ALLOC_CONF`'s syntax) before the first allocation.
///
/// # Safety
/// `conf` is null (refused: `headroom_last_error` says so) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn headroom_configure(conf: *const c_char) -> c_int {
    // SAFETY: forwarded from the caller.
    status(unsafe { utf8(conf, "conf") }.and_then(global::configure))
}

/// Serves every device from host memory (`capacity` bytes at most; 0: no limit) instead of
/// CUDA, before the first allocation: the same policy without a GPU.
#[no_mangle]
pub extern "C" fn headroom_use_host_memory(capacity: u64) -> c_int {
    status(global::use_host_memory((capacity > 0).then_some(capacity)))
}

/// 1 once the allocator has been reached (settings frozen), else 0.
#[no_mangle]
pub extern "C" fn headroom_is_in_use() -> c_int {
    c_int::from(global::is_in_use())
}

/// Releases the cached blocks of `device` that no allocation uses (`torch.cuda.empty_cache()`).
#[no_mangle]
pub extern "C" fn headroom_empty_cache(device: c_int) -> c_int {
    status(self::device(device).and_then(|plugin| plugin.empty_cache()))
}

/// Resets the peaks of `device`'s statistics to their current values.
#[no_mangle]
pub extern "C" fn headroom_reset_peak_stats(device: c_int) -> c_int {
    status(self::device(device).map(|plugin| plugin.reset_peak_stats()))
}

/// `device`'s statistics as a JSON object of `torch.cuda.memory_stats()`'s flat keys; null on
/// failure. Free it with [`headroom_string_free`].
#[no_mangle]
pub extern "C" fn headroom_memory_stats_json(device: c_int) -> *mut c_char {
    match self::device(device) {
        Ok(plugin) => c_string(plugin.memory_stats_json()),
        Err(error) => {
            fail(error);
            std::ptr::null_mut()
        }
    }
}

/// `device`'s summary table (`torch.cuda.memory_summary()`); null on failure. Free it with
/// [`headroom_string_free`].
#[no_mangle]
pub extern "C" fn headroom_memory_summary(device: c_int, abbreviated: c_int) -> *mut c_char {
    match self::device(device) {
        Ok(plugin) => c_string(plugin.memory_summary(abbreviated != 0)),
        Err(error) => {
            fail(error);
            std::ptr::null_mut()
        }
    }
}

/// Starts (`enabled` ≠ 0, keeping at most `max_entries` events; 0: the default) or stops
/// recording `device`'s allocation history for snapshots.
#[no_mangle]
pub extern "C" fn headroom_record_history(
    device: c_int,
    enabled: c_int,
    max_entries: u64,
) -> c_int {
    let options = (enabled != 0).then(|| HistoryOptions {
        max_entries: if max_entries == 0 {
            HistoryOptions::default().max_entries
        } else {
            max_entries as usize
        },
        record_context: true,
    });
    status(self::device(device).map(|plugin| plugin.record_history(options)))
}

/// Writes `device`'s snapshot to `path` as a pickle that PyTorch's memory viewer opens.
///
/// # Safety
/// `path` is null (refused: `headroom_last_error` says so) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn headroom_snapshot(device: c_int, path: *const c_char) -> c_int {
    // SAFETY: forwarded from the caller.
    let path = match unsafe { utf8(path, "path") } {
        Ok(path) => path,
        Err(error) => return fail(error),
    };
    status(self::device(device).and_then(|plugin| plugin.write_snapshot(Path::new(path))))
}

/// Copies the last error message (UTF-8, NUL-terminated, cut to fit) into `buf` of `len` bytes
/// and returns the message's full length in bytes (0: no error so far).
///
/// # Safety
/// `buf` is null with `len` 0, or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn headroom_last_error(buf: *mut c_char, len: usize) -> usize {
    let last = LAST_ERROR.lock();
    let Some(message) = last.as_deref() else {
        return 0;
    };
    if !buf.is_null() && len > 0 {
        let n = message.len().min(len - 1);
        // SAFETY: `buf` has `len` writable bytes and `n + 1 <= len`; the source is `n` bytes of
        // the message.
        unsafe {
            std::ptr::copy_nonoverlapping(message.as_ptr().cast::<c_char>(), buf, n);
            *buf.add(n) = 0;
        }
    }
    message.len()
}

/// Frees a string returned by this library (null is a no-op).
///
/// # Safety
/// `text` is null or a string returned by `headroom_memory_stats_json` or
/// `headroom_memory_summary`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn headroom_string_free(text: *mut c_char) {
    if !text.is_null() {
        // SAFETY: the string came from `CString::into_raw` and is freed once.
        drop(unsafe { CString::from_raw(text) });
    }
}
