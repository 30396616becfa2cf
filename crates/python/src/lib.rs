//! The native half of the `headroom` Python package (`headroom._native`): the allocator's C ABI
//! linked into the extension itself, so PyTorch's `CUDAPluggableAllocator` loads this very file
//! and Python reads the same allocator's statistics; and the fused and 8-bit Adam steps over raw
//! device pointers that `headroom.optim` hands over.
//!
//! Modules: `allocator.rs` wraps headroom-torch-allocator's process-wide state (settings,
//! statistics, summaries, snapshots, `record_stream`); `optim.rs` holds one
//! headroom-optim raw-buffer optimizer per Python optimizer (fused Adam, 8-bit Adam, and — also
//! stepping CPU tensors on the host — Adam on bf16 parameters with stochastic rounding, 4-bit
//! Adam and SGD; Adafactor in `adafactor.rs`) and steps it on the pointers of torch's tensors; `activations.rs` runs headroom-checkpoint's 8-bit codec on the memory of
//! saved activations (CUDA or CPU); `loss.rs` runs headroom-ops-cuda's cross-entropy
//! tiles on the logits `headroom.torch.linear_cross_entropy` computes a tile at a time; `device.rs` holds the shared backends and the rule that a
//! launch comes from torch's current stream only when it is the legacy default stream, where
//! headroom-ops-cuda launches. Python-side checks (every tensor's device, dtype, size and
//! contiguity against its parameter, every step) are in `python/headroom/optim.py`; this side
//! checks what it can see (null pointers, lengths, the stream, that a stream given to
//! `record_stream` is one of PyTorch's own) and turns every error into a Python exception with
//! the crate's message. Reading the allocator's statistics never freezes its settings.
//!
//! This crate sits on the top layer: headroom-torch-allocator, headroom-optim and
//! headroom-checkpoint (feature `cuda`) and headroom-ops-cuda; it knows nothing of PyTorch's C++ and links no libtorch.

mod activations;
mod adafactor;
mod allocator;
mod device;
mod loss;
mod optim;

use pyo3::prelude::*;

/// The extension module `headroom._native`.
#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    allocator::register(m)?;
    optim::register(m)?;
    activations::register(m)?;
    loss::register(m)?;
    Ok(())
}
