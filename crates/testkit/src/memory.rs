//! A backend's allocated bytes as a test reads them: the current figure and its peak, from the
//! backend's caching allocator (`Backend::allocator_view`), signed so that the difference of two
//! readings is a plain subtraction. It works on any backend and names no device crate.

use std::ops::Deref;

use headroom_autograd_core::Backend;

/// Bytes `backend`'s allocator has allocated now (`allocated_bytes.all.current`); `backend` is a
/// handle to one (a `BackendRef`, an `Arc<CpuBackend>`).
///
/// ```
/// use headroom_autograd_core::{DType, Tensor};
/// use headroom_testkit::memory::{allocated, peak};
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let before = allocated(&cpu);
/// let t = Tensor::zeros(&cpu, &[1000], DType::F32)?;
/// assert_eq!(allocated(&cpu) - before, 4096); // 4000 bytes, rounded to 512
/// drop(t);
/// assert_eq!((allocated(&cpu), peak(&cpu) - before), (before, 4096));
/// # Ok::<(), headroom_autograd_core::TensorError>(())
/// ```
pub fn allocated<B: Deref<Target: Backend>>(backend: &B) -> i64 {
    backend.memory_stats().allocated_bytes.all.current
}

/// The most bytes `backend`'s allocator has had allocated since its peak was last reset
/// (`allocated_bytes.all.peak`).
pub fn peak<B: Deref<Target: Backend>>(backend: &B) -> i64 {
    backend.memory_stats().allocated_bytes.all.peak
}
