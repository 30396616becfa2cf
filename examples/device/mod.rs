//! The device the optimizer examples run on, and the figures of its caching allocator.
//!
//! The CPU by default. `--cuda` asks for the GPU (the example built with `--features cuda`),
//! `--cpu` insists on the CPU; with neither, the GPU is used when the build has CUDA and a device
//! answers. Allocated and peak bytes come from the backend's allocator through the `Backend`
//! trait, the same on both; only resetting the peak needs the concrete backend.

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
    reset_peak: Box<dyn Fn()>,
    synchronize: Box<dyn Fn() -> Result<()>>,
    record_history: Box<dyn Fn(bool)>,
    snapshot: Box<dyn Fn() -> Snapshot>,
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
        self.backend.memory_stats().allocated_bytes.all.current as u64
    }

    /// The most bytes allocated since the last [`Device::reset_peak`].
    pub(crate) fn peak(&self) -> u64 {
        self.backend.memory_stats().allocated_bytes.all.peak as u64
    }

    /// Starts a new peak from the bytes allocated now.
    pub(crate) fn reset_peak(&self) {
        (self.reset_peak)();
    }

    /// Starts (or stops) recording the allocator's history, for [`Device::snapshot`].
    #[allow(dead_code, reason = "only the snapshot examples record")]
    pub(crate) fn record_history(&self, on: bool) {
        (self.record_history)(on);
    }

    /// The allocator's snapshot: segments and the recorded history (PyTorch's format).
    #[allow(dead_code, reason = "only the snapshot examples record")]
    pub(crate) fn snapshot(&self) -> Snapshot {
        (self.snapshot)()
    }

    /// Waits until the device has run everything queued (nothing to wait for on the CPU).
    #[allow(dead_code, reason = "only the timed examples wait")]
    pub(crate) fn synchronize(&self) -> Result<()> {
        (self.synchronize)()
    }
}

fn cpu() -> Device {
    let cpu = Arc::new(CpuBackend::default());
    let (owner, recorder, snapshotter) = (cpu.clone(), cpu.clone(), cpu.clone());
    Device {
        backend: cpu,
        name: "cpu",
        reset_peak: Box::new(move || owner.allocator().reset_peak_stats()),
        synchronize: Box::new(|| Ok(())),
        record_history: Box::new(move |on| {
            recorder
                .allocator()
                .record_history(on.then(HistoryOptions::default))
        }),
        snapshot: Box::new(move || snapshotter.allocator().snapshot()),
    }
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Device> {
    let cuda = headroom::ops_cuda::CudaBackend::new(0)?;
    let (owner, waiter, recorder, snapshotter) =
        (cuda.clone(), cuda.clone(), cuda.clone(), cuda.clone());
    Ok(Device {
        backend: cuda,
        name: "cuda:0",
        reset_peak: Box::new(move || owner.allocator().reset_peak_stats()),
        synchronize: Box::new(move || Ok(waiter.synchronize()?)),
        record_history: Box::new(move |on| {
            recorder
                .allocator()
                .record_history(on.then(HistoryOptions::default))
        }),
        snapshot: Box::new(move || snapshotter.allocator().snapshot()),
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Device> {
    bail!("this build has no CUDA: run the example with --features cuda")
}
