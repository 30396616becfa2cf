//! What the planner reads from a device while it measures a step: allocated bytes and their
//! peak, and a clock.
//!
//! A [`StepProbe`] is a [`MemoryGauge`] (the caching allocator's allocated bytes, and the peak
//! since the last reading, which starts a new one — read through the backend's allocator view) and a [`StepClock`] (points in the device's
//! timeline and the milliseconds between two). On the CPU the clock is the host's
//! ([`HostClock`]): CPU kernels finish before they return. On a GPU, behind the `cuda` feature, it
//! records timing events on the compute stream ([`CudaClock`]), so a block's time is the device's
//! time for the work queued between two marks, not the host's time to queue it. Memory needs no
//! device wait: the allocator counts bytes on the host, in stream order.
//!
//! This module sits on autograd-core's backend trait (its allocator view) and, with `cuda`, on
//! ops-cuda's streams and events; it knows nothing about blocks, candidates or plans.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use headroom_autograd_core::BackendRef;

use crate::error::CheckpointError;

/// Allocated bytes and their peak, read while a step runs.
pub trait MemoryGauge: Send + Sync + fmt::Debug {
    /// Bytes allocated now.
    fn allocated(&self) -> u64;
    /// The most bytes allocated since the previous call (or since the gauge was made), and a new
    /// peak started from the bytes allocated now.
    fn take_peak(&self) -> u64;
}

/// A [`MemoryGauge`] over a backend's caching allocator (`Backend::allocator_view`): the same
/// on every device. Reading the peak resets the allocator's peak statistics, so measure before,
/// not during, a measurement of your own.
#[derive(Debug)]
pub struct AllocatorGauge {
    backend: BackendRef,
}

impl AllocatorGauge {
    /// The gauge of `backend`'s allocator.
    pub fn new(backend: BackendRef) -> AllocatorGauge {
        AllocatorGauge { backend }
    }
}

impl MemoryGauge for AllocatorGauge {
    fn allocated(&self) -> u64 {
        self.backend.allocator_view().memory_allocated()
    }

    fn take_peak(&self) -> u64 {
        let allocator = self.backend.allocator_view();
        let peak = allocator.max_memory_allocated();
        allocator.reset_peak_stats();
        peak
    }
}

/// A point in a device's timeline, from [`StepClock::now`].
#[derive(Debug)]
pub struct TimePoint(Point);

impl TimePoint {
    /// A point `ms` milliseconds after an origin of the clock's choosing, for a clock of your own
    /// (a simulated one, a profiler's timestamps).
    pub fn from_ms(ms: f64) -> TimePoint {
        TimePoint(Point::Ms(ms))
    }

    /// The milliseconds of a point made by [`TimePoint::from_ms`].
    pub fn as_ms(&self) -> Option<f64> {
        match self.0 {
            Point::Ms(ms) => Some(ms),
            _ => None,
        }
    }
}

#[derive(Debug)]
enum Point {
    Host(Instant),
    Ms(f64),
    #[cfg(feature = "cuda")]
    Device(headroom_ops_cuda::CudaEvent),
}

/// Where the time of a block's forward and backward is read.
pub trait StepClock: Send + Sync + fmt::Debug {
    /// The point the device has reached once the work queued so far has run.
    fn now(&self) -> Result<TimePoint, CheckpointError>;
    /// Milliseconds from `from` to `to` (waits for the device to reach `to`).
    fn elapsed_ms(&self, from: &TimePoint, to: &TimePoint) -> Result<f64, CheckpointError>;
}

/// The host's clock: right for a backend whose kernels finish before they return (the CPU's).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostClock;

impl StepClock for HostClock {
    fn now(&self) -> Result<TimePoint, CheckpointError> {
        Ok(TimePoint(Point::Host(Instant::now())))
    }

    fn elapsed_ms(&self, from: &TimePoint, to: &TimePoint) -> Result<f64, CheckpointError> {
        match (&from.0, &to.0) {
            (Point::Host(from), Point::Host(to)) => {
                Ok(to.saturating_duration_since(*from).as_secs_f64() * 1e3)
            }
            _ => Err(mixed_clocks()),
        }
    }
}

/// The CUDA compute stream's clock: each point is a timing event recorded on the stream, so the
/// time between two points is the device's time for the work queued between them.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct CudaClock {
    stream: headroom_ops_cuda::CudaStream,
}

#[cfg(feature = "cuda")]
impl CudaClock {
    /// The clock of `backend`'s compute stream.
    pub fn new(backend: &Arc<headroom_ops_cuda::CudaBackend>) -> CudaClock {
        CudaClock {
            stream: backend.compute_stream(),
        }
    }
}

#[cfg(feature = "cuda")]
impl StepClock for CudaClock {
    fn now(&self) -> Result<TimePoint, CheckpointError> {
        Ok(TimePoint(Point::Device(self.stream.record_timing_event()?)))
    }

    fn elapsed_ms(&self, from: &TimePoint, to: &TimePoint) -> Result<f64, CheckpointError> {
        match (&from.0, &to.0) {
            (Point::Device(from), Point::Device(to)) => {
                to.synchronize()?;
                Ok(f64::from(from.elapsed_ms(to)?))
            }
            _ => Err(mixed_clocks()),
        }
    }
}

fn mixed_clocks() -> CheckpointError {
    CheckpointError::InvalidArgument {
        op: "StepClock::elapsed_ms",
        reason: "the two points come from another clock than this one".into(),
    }
}

/// What the planner reads while it measures a step: memory and time.
#[derive(Debug, Clone)]
pub struct StepProbe {
    /// Allocated bytes and their peak.
    pub memory: Arc<dyn MemoryGauge>,
    /// Points in time.
    pub clock: Arc<dyn StepClock>,
}

impl StepProbe {
    /// A probe of a backend whose kernels finish before they return (the CPU's): its
    /// allocator's bytes (`StepProbe::host(cpu.clone())`) and the host's clock.
    pub fn host(backend: BackendRef) -> StepProbe {
        StepProbe {
            memory: Arc::new(AllocatorGauge::new(backend)),
            clock: Arc::new(HostClock),
        }
    }

    /// A probe of a CUDA backend: its allocator's bytes and its compute stream's events.
    #[cfg(feature = "cuda")]
    pub fn cuda(backend: &Arc<headroom_ops_cuda::CudaBackend>) -> StepProbe {
        StepProbe {
            memory: Arc::new(AllocatorGauge::new(backend.clone())),
            clock: Arc::new(CudaClock::new(backend)),
        }
    }
}
