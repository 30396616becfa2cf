//! Memory overlap between the operands of a write, and the one check a backend runs at the
//! entry of every primitive.
//!
//! PyTorch's rules, decided from shapes and strides in O(ndim) host work per operand pair,
//! never per element:
//! - **Internal overlap.** An output that reaches one element through two indices (an
//!   expanded view, a stride of 0, some `as_strided` views) is refused: several threads (or GPU
//!   threads) would write one element. [`Layout::may_overlap_itself`] proves the absence of
//!   overlap for every layout the view ops make; the rare `as_strided` layout it cannot decide
//!   is refused too, where PyTorch lets it pass ("too hard").
//! - **Partial overlap.** An output that shares memory with an input is refused unless it is
//!   the very same view of an elementwise primitive (`x.add_(x)`), where element `i` is read
//!   before it is written, by the same thread. Anything else (`x.add_(&x.t())`) is a
//!   [`TensorError::Overlap`] telling the user to clone first: PyTorch's choice, and no hidden
//!   temporary, so `memory_allocated()` stays what the user asked for. Two views of one storage
//!   are disjoint when their byte ranges are, or when a modulus separates them: every stride of
//!   both is a multiple of it, or stays in a band of residues the other view never reaches (the
//!   `q`, `k` and `v` slices of one packed projection, the columns of a `cat`).
//!
//! [`check_operands`] applies both rules and also checks that each view lies inside its buffer
//! and that the buffer's memory came from the calling backend's allocator: `View`'s fields are
//! public, so this check, not the view's construction, is what a backend relies on.
//!
//! It sits on layouts, views and buffers; it knows no kernel and no device.

use headroom_caching_allocator::AllocatorId;

use crate::backend::View;
use crate::buffer::{Access, HostAccess};
use crate::error::{Result, TensorError};
use crate::layout::Layout;

/// How a primitive's outputs may share memory with its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aliasing {
    /// An output may be the very same view as an input (same offset, sizes and strides, and an
    /// element type of the same size): elementwise primitives read element `i` before they
    /// write it, on the same thread.
    SameView,
    /// Outputs share no memory with inputs (reductions, products, fused primitives).
    Disjoint,
}

/// How two views share memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// No byte is reached by both.
    Disjoint,
    /// The same elements in the same order (same buffer, offset, sizes and strides).
    Same,
    /// Some bytes may be reached by both, in another order or by another element.
    Partial,
}

impl Layout {
    /// Whether two indices of this layout may reach the same element: `false` is a proof (the
    /// strides, sorted, each step past everything the smaller ones reach), `true` means "yes, or
    /// too hard to tell" (a stride of 0 on a dim of two or more, or interleaved strides).
    pub fn may_overlap_itself(&self) -> bool {
        if self.numel() <= 1 || self.is_contiguous() {
            return false;
        }
        let mut dims: smallvec::SmallVec<[(usize, usize); 8]> = self
            .shape()
            .iter()
            .zip(self.strides())
            .filter(|(&size, _)| size > 1)
            .map(|(&size, &stride)| (stride, size))
            .collect();
        dims.sort_unstable();
        // The largest offset the smaller strides reach (it fits: a layout's reach does).
        let mut reach = 0usize;
        for (stride, size) in dims {
            if stride <= reach {
                return true;
            }
            reach += (size - 1) * stride;
        }
        false
    }
}

/// How `a` and `b` share memory (see [`Overlap`]). Views of different buffers, and empty views,
/// are disjoint.
pub fn overlap(a: &View<'_>, b: &View<'_>) -> Overlap {
    if !std::ptr::eq(a.buffer, b.buffer) || a.layout.numel() == 0 || b.layout.numel() == 0 {
        return Overlap::Disjoint;
    }
    let (a_size, b_size) = (a.dtype.size_in_bytes(), b.dtype.size_in_bytes());
    if a_size == b_size && same_elements(a.layout, b.layout) {
        return Overlap::Same;
    }
    let (a_range, b_range) = (byte_range(a), byte_range(b));
    if a_range.1 <= b_range.0 || b_range.1 <= a_range.0 {
        return Overlap::Disjoint;
    }
    if separated_by_a_modulus(a, b) {
        return Overlap::Disjoint;
    }
    Overlap::Partial
}

/// Checks a primitive's operands before a backend touches them (see the module docs): every
/// view lies inside its buffer, whose memory `owner` (the backend's allocator) handed out; no
/// output reaches an element twice; outputs share no memory with each other, nor with an input
/// except as `aliasing` allows. O(ndim) per operand and per pair of operands that share a buffer.
pub fn check_operands(
    owner: AllocatorId,
    op: &'static str,
    writes: &[View<'_>],
    reads: &[View<'_>],
    aliasing: Aliasing,
) -> Result<()> {
    for view in writes.iter().chain(reads) {
        check_view(owner, op, view)?;
    }
    check_overlaps(op, writes, reads, aliasing)
}

/// The overlap half of [`check_operands`], for the core's in-place ops (which name the user's op
/// in the error before the backend sees the call).
pub(crate) fn check_overlaps(
    op: &'static str,
    writes: &[View<'_>],
    reads: &[View<'_>],
    aliasing: Aliasing,
) -> Result<()> {
    for (i, out) in writes.iter().enumerate() {
        if out.layout.may_overlap_itself() {
            return Err(TensorError::Overlap {
                op,
                reason: format!(
                    "the output of shape {:?} and strides {:?} reaches some elements more than \
                     once (an expanded or stride-0 view cannot be written)",
                    out.layout.shape(),
                    out.layout.strides()
                ),
            });
        }
        for (j, input) in reads.iter().enumerate() {
            match overlap(out, input) {
                Overlap::Disjoint => {}
                Overlap::Same if aliasing == Aliasing::SameView => {}
                _ => {
                    return Err(TensorError::Overlap {
                        op,
                        reason: format!(
                            "output {i} ({:?}, strides {:?}) and input {j} ({:?}, strides {:?}) \
                             share memory without being the same view",
                            out.layout.shape(),
                            out.layout.strides(),
                            input.layout.shape(),
                            input.layout.strides()
                        ),
                    })
                }
            }
        }
        for (k, other) in writes.iter().enumerate().skip(i + 1) {
            if overlap(out, other) != Overlap::Disjoint {
                return Err(TensorError::Overlap {
                    op,
                    reason: format!("outputs {i} and {k} share memory"),
                });
            }
        }
    }
    Ok(())
}

/// Claims the buffers of a primitive's operands for a host computation: outputs for writing,
/// inputs for reading (see [`HostAccess`]).
pub fn claim_operands<'a>(
    op: &'static str,
    writes: &[View<'a>],
    reads: &[View<'a>],
) -> Result<HostAccess<'a>> {
    let writes = writes.iter().map(|view| (view.buffer, Access::Write));
    let reads = reads.iter().map(|view| (view.buffer, Access::Read));
    HostAccess::claim(op, writes.chain(reads))
}

/// Fails unless `view` lies inside its buffer and the buffer's memory came from `owner`.
fn check_view(owner: AllocatorId, op: &'static str, view: &View<'_>) -> Result<()> {
    if view.layout.numel() == 0 {
        // An empty view reaches no memory.
        return Ok(());
    }
    let end = view
        .layout
        .storage_extent()
        .checked_mul(view.dtype.size_in_bytes());
    if end.is_none_or(|end| end > view.buffer.len_bytes()) {
        return Err(outside(op, view));
    }
    view.buffer.check_owner(op, owner)
}

fn outside(op: &'static str, view: &View<'_>) -> TensorError {
    TensorError::InvalidArgument {
        op,
        reason: format!(
            "a {:?} view of shape {:?}, strides {:?} and offset {} reaches past the {} bytes of \
             its buffer",
            view.dtype,
            view.layout.shape(),
            view.layout.strides(),
            view.layout.offset(),
            view.buffer.len_bytes()
        ),
    }
}

/// Same offset, sizes, and strides wherever a dim has more than one element.
fn same_elements(a: &Layout, b: &Layout) -> bool {
    a.offset() == b.offset()
        && a.shape() == b.shape()
        && a.shape()
            .iter()
            .zip(a.strides().iter().zip(b.strides()))
            .all(|(&size, (sa, sb))| size <= 1 || sa == sb)
}

/// The bytes `[first, end)` a non-empty view spans within its buffer.
fn byte_range(view: &View<'_>) -> (usize, usize) {
    let size = view.dtype.size_in_bytes();
    (
        view.layout.offset().saturating_mul(size),
        view.layout.storage_extent().saturating_mul(size),
    )
}

/// Whether some modulus `m` (a stride of either view, in bytes) keeps the views apart: every
/// byte of a view is `offset + coarse + fine` with `coarse` a multiple of `m` (dims whose
/// stride is) and `fine` below `m` without wrapping (the other dims, and the element's own
/// bytes); when the two bands `[offset mod m, + fine]` do not meet, neither do the views.
fn separated_by_a_modulus(a: &View<'_>, b: &View<'_>) -> bool {
    byte_strides(a).chain(byte_strides(b)).any(|(m, _)| {
        m > 1
            && match (band(a, m), band(b, m)) {
                (Some((a_lo, a_hi)), Some((b_lo, b_hi))) => a_hi < b_lo || b_hi < a_lo,
                _ => false,
            }
    })
}

/// The `(stride in bytes, size)` of the dims of `view` with more than one element.
fn byte_strides<'v>(view: &'v View<'_>) -> impl Iterator<Item = (usize, usize)> + 'v {
    let size = view.dtype.size_in_bytes();
    view.layout
        .shape()
        .iter()
        .zip(view.layout.strides())
        .filter(|(&n, _)| n > 1)
        .map(move |(&n, &stride)| (stride.saturating_mul(size), n))
}

/// The residues modulo `m` that `view`'s bytes take, as `[lo, hi]` without wrapping, if they
/// stay in one band.
fn band(view: &View<'_>, m: usize) -> Option<(usize, usize)> {
    let element = view.dtype.size_in_bytes();
    let fine = byte_strides(view)
        .filter(|(stride, _)| stride % m != 0)
        .fold(element - 1, |acc, (stride, n)| {
            acc.saturating_add((n - 1).saturating_mul(stride))
        });
    let lo = view.layout.offset().saturating_mul(element) % m;
    let hi = lo.saturating_add(fine);
    (hi < m).then_some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        Layout::from_parts(shape, strides, offset).unwrap()
    }

    #[test]
    fn internal_overlap_from_strides() {
        assert!(!layout(&[4, 3], &[3, 1], 0).may_overlap_itself());
        assert!(
            !layout(&[3, 4], &[1, 3], 0).may_overlap_itself(),
            "transposed"
        );
        assert!(
            !layout(&[2, 3], &[10, 2], 5).may_overlap_itself(),
            "strided, gaps"
        );
        assert!(
            !layout(&[1, 5], &[0, 1], 0).may_overlap_itself(),
            "size-1 stride 0"
        );
        assert!(!layout(&[0, 5], &[0, 0], 0).may_overlap_itself(), "empty");
        assert!(
            layout(&[64, 16], &[0, 1], 0).may_overlap_itself(),
            "expanded"
        );
        assert!(
            layout(&[4, 4], &[1, 1], 0).may_overlap_itself(),
            "as_strided diagonal"
        );
        assert!(
            layout(&[3, 2], &[2, 3], 0).may_overlap_itself(),
            "interleaved: too hard"
        );
        assert!(
            layout(&[2, 3], &[2, 1], 0).may_overlap_itself(),
            "rows overlap by one"
        );
        assert!(
            !layout(&[2, 3], &[3, 1], 0).may_overlap_itself(),
            "rows just touch"
        );
    }
}
