//! Strided iteration over host memory: bounds-checked element pointers and a parallel walker.
//!
//! [`HostPtr`] reads and writes elements of one buffer by index, checking every index (or, in
//! hot loops, every run once) against the buffer's length, so a wrong layout is a panic, never
//! memory corruption (the backend's entry check already refused views outside their buffers, so
//! these checks are a second line). [`for_each_run`]
//! walks N operands of one shape: it merges dims that are contiguous in every operand, then
//! hands out runs along the innermost dim — in parallel with rayon once the work is large
//! enough. Nothing here knows about dtypes or ops.

use headroom_autograd_core::View;
use rayon::prelude::*;

/// Below this many elements a walk runs on the calling thread.
const PARALLEL_THRESHOLD: usize = 1 << 15;

/// Elements of one host buffer, addressed by element index.
#[derive(Debug)]
pub(crate) struct HostPtr<T> {
    base: *mut T,
    len: usize,
}

impl<T> Clone for HostPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for HostPtr<T> {}

// SAFETY: a `HostPtr` addresses host memory of a buffer that outlives the kernel using it (the
// kernel borrows the `View`), and that the backend claimed for the kernel before making it
// (`CpuBackend::operands`: outputs alone, inputs with no writer), so no thread outside the kernel
// touches it meanwhile. Inside the kernel, threads write disjoint elements: the same entry check
// refused outputs that reach an element twice, outputs that share memory with each other, and
// outputs that share memory with an input other than as the very same view; a walk hands each
// output element to exactly one run, and an input that is the output's own view is read by the
// run that writes it, before it writes it. Everything else is only read.
unsafe impl<T: Send> Send for HostPtr<T> {}
// SAFETY: as for `Send`: shared use only reads, or writes disjoint elements.
unsafe impl<T: Sync> Sync for HostPtr<T> {}

impl<T: Copy> HostPtr<T> {
    /// The elements of `view`'s buffer as `T`s (the view's dtype has `T`'s size).
    ///
    /// The backend checked the view first (`CpuBackend::operands`): its buffer is host memory of
    /// this backend's allocator.
    pub(crate) fn new(view: &View<'_>) -> HostPtr<T> {
        debug_assert_eq!(view.dtype.size_in_bytes(), std::mem::size_of::<T>());
        debug_assert!(view.buffer.len_bytes() == 0 || view.buffer.is_host_memory());
        debug_assert_eq!(
            view.buffer.address() as usize % std::mem::align_of::<T>(),
            0
        );
        HostPtr {
            base: view.buffer.address() as *mut T,
            len: view.buffer.len_bytes() / std::mem::size_of::<T>(),
        }
    }

    /// [`HostPtr::new`] of `view` with the index of the view's first element (its layout's
    /// offset), the two a kernel walking a dense view needs.
    pub(crate) fn with_offset(view: &View<'_>) -> (HostPtr<T>, usize) {
        (HostPtr::new(view), view.layout.offset())
    }

    /// The elements of a host slice (for scratch space that does not come from the allocator).
    pub(crate) fn from_slice(slice: &mut [T]) -> HostPtr<T> {
        HostPtr {
            base: slice.as_mut_ptr(),
            len: slice.len(),
        }
    }

    /// Number of elements addressable.
    pub(crate) fn len(self) -> usize {
        self.len
    }

    /// The raw address of element `index`, for libraries that take pointers (GEMM); the caller
    /// checks the extent it will touch against [`HostPtr::len`].
    pub(crate) fn raw(self, index: usize) -> *mut T {
        assert!(
            index <= self.len,
            "element {index} outside a buffer of {}",
            self.len
        );
        self.base.wrapping_add(index)
    }

    /// Element `index` of the buffer.
    #[inline]
    pub(crate) fn read(self, index: usize) -> T {
        assert!(
            index < self.len,
            "element {index} outside a buffer of {}",
            self.len
        );
        // SAFETY: `index` is inside the buffer (checked above), the buffer is a live, aligned
        // host allocation of at least `len` elements, and no other thread writes this element
        // during the kernel (see the `Send` impl).
        unsafe { self.base.add(index).read() }
    }

    /// Checks once that the run of `len` elements from `base` with `stride` lies inside the
    /// buffer, so the run's loop can use [`HostPtr::read_in_run`] / [`HostPtr::write_in_run`]
    /// without a check per element (the hot loops of elementwise kernels).
    #[inline]
    pub(crate) fn check_run(self, base: usize, stride: usize, len: usize) {
        assert!(
            len == 0
                || (len - 1)
                    .checked_mul(stride)
                    .and_then(|reach| reach.checked_add(base))
                    .is_some_and(|last| last < self.len),
            "a run of {len} elements from {base} with stride {stride} leaves a buffer of {}",
            self.len
        );
    }

    /// Element `base + i * stride` of a run checked by [`HostPtr::check_run`].
    ///
    /// # Safety
    /// `check_run(base, stride, len)` passed for this pointer and `i < len`.
    #[inline(always)]
    pub(crate) unsafe fn read_in_run(self, base: usize, stride: usize, i: usize) -> T {
        // SAFETY: the caller checked the run, so the index is inside the live, aligned buffer;
        // no other thread writes this element during the kernel (see the `Send` impl).
        unsafe { self.base.add(base + i * stride).read() }
    }

    /// Sets element `base + i * stride` of a run checked by [`HostPtr::check_run`].
    ///
    /// # Safety
    /// `check_run(base, stride, len)` passed for this pointer and `i < len`.
    #[inline(always)]
    pub(crate) unsafe fn write_in_run(self, base: usize, stride: usize, i: usize, value: T) {
        // SAFETY: as in `read_in_run`; this run is the only writer of this element.
        unsafe { self.base.add(base + i * stride).write(value) }
    }

    /// Sets element `index` of the buffer.
    #[inline]
    pub(crate) fn write(self, index: usize, value: T) {
        assert!(
            index < self.len,
            "element {index} outside a buffer of {}",
            self.len
        );
        // SAFETY: as in `read`; this run is the only writer of this element.
        unsafe { self.base.add(index).write(value) }
    }
}

/// One merged dim: its size and the stride of each operand.
#[derive(Clone, Copy)]
struct Dim<const N: usize> {
    size: usize,
    strides: [usize; N],
}

/// Merges dims that are contiguous in every operand and drops size-1 dims.
fn coalesce<const N: usize>(shape: &[usize], strides: [&[usize]; N]) -> Vec<Dim<N>> {
    let mut dims: Vec<Dim<N>> = Vec::with_capacity(shape.len());
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let cur = Dim {
            size,
            strides: std::array::from_fn(|k| strides[k][d]),
        };
        match dims.last_mut() {
            Some(prev) if (0..N).all(|k| prev.strides[k] == cur.strides[k] * cur.size) => {
                prev.size *= cur.size;
                prev.strides = cur.strides;
            }
            _ => dims.push(cur),
        }
    }
    dims
}

/// How a walk is cut into runs: the merged dims and the chunking of the innermost one.
struct Plan<const N: usize> {
    outer: Vec<Dim<N>>,
    inner: Dim<N>,
    offsets: [usize; N],
    chunk_len: usize,
    chunks_per_row: usize,
    n_tasks: usize,
}

impl<const N: usize> Plan<N> {
    /// `None` when there is nothing to walk.
    fn new(
        shape: &[usize],
        strides: [&[usize]; N],
        offsets: [usize; N],
        target_tasks: usize,
    ) -> Option<Plan<N>> {
        let numel: usize = shape.iter().product();
        if numel == 0 {
            return None;
        }
        let mut outer = coalesce(shape, strides);
        let inner = outer.pop().unwrap_or(Dim {
            size: 1,
            strides: [0; N],
        });
        let rows = numel / inner.size;
        let chunks_per_row = target_tasks
            .div_ceil(rows)
            .clamp(1, inner.size.div_ceil(1024).max(1));
        let chunk_len = inner.size.div_ceil(chunks_per_row);
        let chunks_per_row = inner.size.div_ceil(chunk_len);
        Some(Plan {
            outer,
            inner,
            offsets,
            chunk_len,
            chunks_per_row,
            n_tasks: rows * chunks_per_row,
        })
    }

    /// The bases, inner strides and length of run `task_idx`.
    fn task(&self, task_idx: usize) -> ([usize; N], [usize; N], usize) {
        let (mut row, chunk) = (
            task_idx / self.chunks_per_row,
            task_idx % self.chunks_per_row,
        );
        let mut bases = self.offsets;
        for dim in self.outer.iter().rev() {
            let i = row % dim.size;
            row /= dim.size;
            for (base, stride) in bases.iter_mut().zip(dim.strides) {
                *base += i * stride;
            }
        }
        let start = chunk * self.chunk_len;
        for (base, stride) in bases.iter_mut().zip(self.inner.strides) {
            *base += start * stride;
        }
        (
            bases,
            self.inner.strides,
            self.chunk_len.min(self.inner.size - start),
        )
    }
}

/// Calls `run(bases, inner_strides, len)` for runs that together cover every element of
/// `shape` once: element `i` of a run is at `bases[k] + i * inner_strides[k]` in operand `k`.
/// Runs go to rayon's pool when the walk is large.
pub(crate) fn for_each_run<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    offsets: [usize; N],
    run: impl Fn([usize; N], [usize; N], usize) + Sync + Send,
) {
    for_each_run_weighted(shape, strides, offsets, 1, run);
}

/// Like [`for_each_run`] for walks whose every element costs `work_per_element` elements of
/// work (a softmax lane, a reduced row): the walk goes parallel once the total work is large,
/// however few elements it has.
pub(crate) fn for_each_run_weighted<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    offsets: [usize; N],
    work_per_element: usize,
    run: impl Fn([usize; N], [usize; N], usize) + Sync + Send,
) {
    let numel: usize = shape.iter().product();
    let parallel = numel.saturating_mul(work_per_element.max(1)) >= PARALLEL_THRESHOLD
        && numel > 1
        && rayon::current_num_threads() > 1;
    let target_tasks = if parallel {
        4 * rayon::current_num_threads()
    } else {
        1
    };
    let Some(plan) = Plan::new(shape, strides, offsets, target_tasks) else {
        return;
    };
    let task = |task_idx: usize| {
        let (bases, inner, len) = plan.task(task_idx);
        run(bases, inner, len);
    };
    if parallel {
        (0..plan.n_tasks).into_par_iter().for_each(task);
    } else {
        (0..plan.n_tasks).for_each(task);
    }
}

/// Like [`for_each_run`], always on the calling thread and in row-major order.
pub(crate) fn for_each_run_serial<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    offsets: [usize; N],
    mut run: impl FnMut([usize; N], [usize; N], usize),
) {
    let Some(plan) = Plan::new(shape, strides, offsets, 1) else {
        return;
    };
    for task_idx in 0..plan.n_tasks {
        let (bases, inner, len) = plan.task(task_idx);
        run(bases, inner, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn visited(shape: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
        let seen = Mutex::new(Vec::new());
        for_each_run(shape, [strides], [offset], |bases, inner, len| {
            let mut seen = seen.lock().unwrap();
            seen.extend((0..len).map(|i| bases[0] + i * inner[0]));
        });
        let mut seen = seen.into_inner().unwrap();
        seen.sort_unstable();
        seen
    }

    #[test]
    fn runs_cover_every_element_once() {
        assert_eq!(visited(&[2, 3], &[3, 1], 0), (0..6).collect::<Vec<_>>());
        assert_eq!(visited(&[3, 2], &[1, 3], 1), (1..7).collect::<Vec<_>>());
        assert_eq!(visited(&[2, 1, 2], &[10, 7, 1], 0), vec![0, 1, 10, 11]);
        assert_eq!(visited(&[], &[], 4), vec![4]);
        assert_eq!(visited(&[300, 300], &[300, 1], 0).len(), 90_000);
        assert_eq!(visited(&[2, 3], &[0, 1], 0), vec![0, 0, 1, 1, 2, 2]);
    }
}
