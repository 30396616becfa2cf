//! The device the optimizer examples run on, and the figures of its caching allocator.
//!
//! The CPU by default. `--cuda` asks for the GPU (the example built with `--features cuda`),
//! `--cpu` insists on the CPU; with neither, the GPU is used when the build has CUDA and a device
//! answers. Everything asked of the allocator (bytes, peaks, history, snapshots) and the wait go
//! through the `Backend` trait (`allocator_view`, `synchronize`), the same on both.

use std::sync::Arc;

use anyhow::{bail, Result};
use headroom::autograd_core::BackendRef;
use headroom::caching_allocator::{HistoryOptions, Snapshot};
use headroom::ops_cpu::CpuBackend;

/// A backend and what the examples ask of its allocator.
pub(crate) struct Device {
    /// Where tensors are created.
    pub(crate) backend: BackendRef,
    /// `cpu` or `cuda:0`.
    pub(crate) name: &'static str,
}

impl Device {
    /// The device the command line asks for (see the module's documentation).
    pub(crate) fn from_args() -> Result<Device> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let wants = |flag: &str| args.iter().any(|a| a == flag);
        match (wants("--cpu"), wants("--cuda")) {
            (true, true) => bail!("--cpu and --cuda exclude each other"),
            (true, false) => Ok(cpu()),
            (false, true) => cuda(),
            (false, false) => Ok(cuda().unwrap_or_else(|_| cpu())),
        }
    }

    /// Whether this is the GPU.
    pub(crate) fn is_cuda(&self) -> bool {
        self.name != "cpu"
    }

    /// Bytes allocated now.
    #[allow(dead_code, reason = "the combined example reads only peaks")]
    pub(crate) fn allocated(&self) -> u64 {
        self.backend.allocator_view().memory_allocated()
    }

    /// The most bytes allocated since the last [`Device::reset_peak`].
    pub(crate) fn peak(&self) -> u64 {
        self.backend.allocator_view().max_memory_allocated()
    }

    /// Starts a new peak from the bytes allocated now.
    pub(crate) fn reset_peak(&self) {
        self.backend.allocator_view().reset_peak_stats();
    }

    /// Starts (or stops) recording the allocator's history, for [`Device::snapshot`].
    #[allow(dead_code, reason = "only the snapshot examples record")]
    pub(crate) fn record_history(&self, on: bool) {
        let options = on.then(HistoryOptions::default);
        self.backend.allocator_view().record_history(options);
    }

    /// The allocator's snapshot: segments and the recorded history (PyTorch's format).
    #[allow(dead_code, reason = "only the snapshot examples record")]
    pub(crate) fn snapshot(&self) -> Snapshot {
        self.backend.allocator_view().snapshot()
    }

    /// Waits until the device has run everything queued (nothing to wait for on the CPU).
    #[allow(dead_code, reason = "only the timed examples wait")]
    pub(crate) fn synchronize(&self) -> Result<()> {
        Ok(self.backend.synchronize()?)
    }
}

fn cpu() -> Device {
    Device {
        backend: Arc::new(CpuBackend::default()),
        name: "cpu",
    }
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Device> {
    Ok(Device {
        backend: headroom::ops_cuda::CudaBackend::new(0)?,
        name: "cuda:0",
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Device> {
    bail!("this build has no CUDA: run the example with --features cuda")
}
