//! Headroom's caching allocator inside PyTorch: a C ABI that
//! `torch.cuda.memory.CUDAPluggableAllocator` loads, so a PyTorch trainer allocates its CUDA
//! memory through Headroom's policy (expandable segments by default, PyTorch's classic policy
//! with `expandable_segments:False`) — and the statistics, summary and snapshot PyTorch cannot
//! ask a pluggable allocator for.
//!
//! ```python
//! import torch
//! alloc = torch.cuda.memory.CUDAPluggableAllocator(
//!     "libheadroom_torch_allocator.so", "headroom_alloc", "headroom_free")
//! torch.cuda.memory.change_current_allocator(alloc)  # before the first CUDA allocation
//! ```
//!
//! The Python package `headroom` (`python/`) does this in `headroom.cuda.use_allocator()` and
//! wraps the other functions. Three layers:
//! - [`Plugin`]: one caching allocator seen from outside — raw addresses and raw stream
//!   handles in and out, the live allocations kept by address;
//! - `global`: the process-wide state PyTorch's calls reach: settings chosen before the first
//!   allocation ([`configure`], [`use_host_memory`]), then one plugin per device
//!   ([`with_device`]);
//! - `abi`: the `extern "C"` functions (`headroom_alloc`, `headroom_free`,
//!   `headroom_record_stream`, `headroom_memory_stats_json`, `headroom_snapshot`, ...); the
//!   module's table maps each to the PyTorch call it replaces.
//!
//! What is safe across streams: an allocation is served from, and freed to, the pool of the
//! stream PyTorch was on when it allocated; work on that stream reuses it in stream order with
//! no synchronisation, as with PyTorch's allocator. PyTorch's `Tensor.record_stream` does
//! nothing under a pluggable allocator (its Python API sets no record-stream hook), so a
//! tensor used on a second stream must either be kept alive until that stream's work is done
//! (synchronise, or free it after an event the allocating stream waits for) or be marked with
//! `headroom_record_stream` (`headroom.cuda.record_stream(tensor, stream)`), after which its
//! block is reused only once that stream's work up to the free has completed.
//!
//! This crate sits on headroom-caching-allocator; it knows nothing about tensors, kernels or
//! Python, and links no PyTorch.
//!
//! # Crate features
//! - `cuda`: device memory (`CudaStorage`). Without it the allocator serves only host memory
//!   ([`use_host_memory`]), which is how CI drives the C ABI without a GPU. Adds capability
//!   only.
//!
//! # Example
//!
//! The C ABI as PyTorch calls it, served from host memory (no GPU needed):
//!
//! ```
//! use std::ffi::{c_void, CStr};
//! use headroom_torch_allocator::abi::{
//!     headroom_alloc, headroom_free, headroom_memory_stats_json, headroom_string_free,
//! };
//!
//! // Settings are taken before the first allocation and frozen by it.
//! headroom_torch_allocator::configure("expandable_segments:False")?;
//! headroom_torch_allocator::use_host_memory(None)?;
//!
//! let stream: *mut c_void = std::ptr::null_mut(); // PyTorch's default stream
//! // `torch.empty(250, device="cuda")`: 1000 bytes on device 0.
//! // SAFETY: host memory never dereferences the stream handle.
//! let block = unsafe { headroom_alloc(1000, 0, stream) };
//! assert!(!block.is_null());
//!
//! let json = headroom_memory_stats_json(0);
//! // SAFETY: a string this library returned, read before it is freed below.
//! let stats: serde_json::Value = serde_json::from_str(unsafe { CStr::from_ptr(json) }.to_str()?)?;
//! // SAFETY: returned by `headroom_memory_stats_json` and freed once.
//! unsafe { headroom_string_free(json) };
//! assert_eq!(stats["requested_bytes.all.current"], 1000);
//! assert_eq!(stats["allocated_bytes.all.current"], 1024); // rounded to 512, as PyTorch does
//! assert_eq!(stats["reserved_bytes.all.current"], 2 << 20); // one small-pool segment
//!
//! headroom_free(block, 1000, 0, stream);
//! assert_eq!(headroom_torch_allocator::with_device(0)?.live_allocations(), 0);
//! assert!(headroom_torch_allocator::configure("expandable_segments:True").is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod abi;
mod error;
mod global;
mod plugin;

pub use error::PluginError;
pub use global::{
    configure, is_in_use, plugin_defaults, settings, use_host_memory, with_device, DevicePlugin,
    MAX_DEVICES,
};
pub use plugin::{Plugin, StreamSource};

/// The last error message recorded by a C function (`headroom_last_error`), if any.
pub fn last_error() -> Option<String> {
    // SAFETY: a null buffer of length 0 only asks for the length.
    let len = unsafe { abi::headroom_last_error(std::ptr::null_mut(), 0) };
    if len == 0 {
        return None;
    }
    let mut buf = vec![0u8; len + 1];
    // SAFETY: `buf` has `len + 1` writable bytes.
    let len = unsafe { abi::headroom_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(len.min(buf.len() - 1));
    Some(String::from_utf8_lossy(&buf).into_owned())
}
