//! Host memory of CPU tensors as slices, so the tensor layer can run the raw kernels in place.
//!
//! autograd-core exposes a CPU tensor's storage as a [`Buffer`](headroom_autograd_core::Buffer)
//! whose address is a host pointer (the CPU backend's allocator hands out host memory). This
//! module turns that address into a slice for the host side of the device strategy
//! (`device.rs` checked device, dtype and layout); the address ranges also serve the aliasing
//! check on any device. Scratch tensors come from the parameters' backend, so every temporary of
//! a step shows in `memory_allocated()`.

use headroom_autograd_core::{Device, Element, Tensor};

use crate::error::OptimError;

/// The start address and the byte range a contiguous tensor covers.
pub(crate) fn byte_range(tensor: &Tensor) -> std::ops::Range<u64> {
    let elem = tensor.dtype().size_in_bytes() as u64;
    let start = tensor.buffer().address() + tensor.layout().offset() as u64 * elem;
    start..start + tensor.numel() as u64 * elem
}

/// Checks that no two of `tensors` share memory, so mutable slices of them do not alias.
pub(crate) fn check_disjoint(op: &'static str, tensors: &[&Tensor]) -> Result<(), OptimError> {
    let mut ranges: Vec<_> = tensors
        .iter()
        .map(|t| byte_range(t))
        .filter(|r| !r.is_empty())
        .collect();
    ranges.sort_by_key(|r| r.start);
    if ranges.windows(2).any(|w| w[0].end > w[1].start) {
        return Err(OptimError::UnsupportedTensor {
            op,
            reason: "parameters, gradients and state must not share memory".into(),
        });
    }
    Ok(())
}

/// The elements of a CPU tensor of `T`.
///
/// # Safety
/// The tensor was checked by the step's device (`StepDevice::check`: host memory, contiguous)
/// and is of `T`; no mutable slice of the same memory is alive while the returned slice is, and
/// no other thread writes the tensor meanwhile (the step holds a read claim on its buffer,
/// `HostAccess`).
pub(crate) unsafe fn host_slice<T: Element>(tensor: &Tensor) -> &[T] {
    debug_assert!(tensor.device() == Device::Cpu && tensor.dtype() == T::DTYPE);
    let n = tensor.numel();
    if n == 0 {
        return &[];
    }
    debug_assert!(tensor.buffer().is_host_memory());
    let ptr = byte_range(tensor).start as *const T;
    // SAFETY: the buffer is host memory (checked by the device), live while the tensor is, and
    // holds the tensor's contiguous extent (every tensor's layout lies inside its buffer), aligned
    // for the dtype by the allocator's 512-byte rounding; the caller guarantees no writer.
    unsafe { std::slice::from_raw_parts(ptr, n) }
}

/// The elements of a CPU tensor of `T`, writable.
///
/// # Safety
/// As for [`host_slice`], and: the tensor's memory is not reachable through any other live
/// slice (checked with [`check_disjoint`] for the tensors of one call), and no other thread
/// reads or writes it meanwhile (the step holds a write claim on its buffer). The tensor handle
/// outlives the slice.
#[allow(clippy::mut_from_ref)]
pub(crate) unsafe fn host_slice_mut<T: Element>(tensor: &Tensor) -> &mut [T] {
    debug_assert!(tensor.device() == Device::Cpu && tensor.dtype() == T::DTYPE);
    let n = tensor.numel();
    if n == 0 {
        return &mut [];
    }
    debug_assert!(tensor.buffer().is_host_memory());
    let ptr = byte_range(tensor).start as *mut T;
    // SAFETY: as in `host_slice`; exclusivity is the caller's obligation.
    unsafe { std::slice::from_raw_parts_mut(ptr, n) }
}

/// A zero-filled state tensor like `param` (its shape and dtype, on its backend).
pub(crate) fn zeros_like(param: &Tensor) -> Result<Tensor, OptimError> {
    zeros_like_shape(param, param.shape())
}

/// A zero-filled state tensor of `shape` and `like`'s dtype on `like`'s backend.
pub(crate) fn zeros_like_shape(like: &Tensor, shape: &[usize]) -> Result<Tensor, OptimError> {
    Ok(Tensor::zeros(like.backend(), shape, like.dtype())?)
}

/// An uninitialised scratch tensor of `len` elements of `like`'s dtype on `like`'s backend.
pub(crate) fn scratch(like: &Tensor, len: usize) -> Result<Tensor, OptimError> {
    Ok(Tensor::empty(like.backend(), &[len], like.dtype())?)
}

/// The scratch of a host foreach step over `params`: `chunk` elements (`None`: as many as all
/// the parameters hold), at most their total; `None` when there are no parameters.
pub(crate) fn foreach_scratch<'a>(
    mut params: impl Iterator<Item = &'a Tensor>,
    chunk: Option<usize>,
) -> Result<Option<Tensor>, OptimError> {
    let Some(first) = params.next() else {
        return Ok(None);
    };
    let total = first.numel() + params.map(Tensor::numel).sum::<usize>();
    let len = chunk.map_or(total, |c| c.min(total));
    Ok(Some(scratch(first, len)?))
}
