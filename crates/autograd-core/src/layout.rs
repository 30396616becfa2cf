//! Shapes, strides and offsets: how a tensor's elements sit in its storage.
//!
//! A [`Layout`] is pure arithmetic over element indices: broadcasting, views (permute, narrow,
//! expand, view with PyTorch's stride rules) and contiguity. It sits on nothing and knows
//! nothing about storage, dtypes or the graph; every view op of the crate is a `Layout` change
//! over a shared storage.

use smallvec::SmallVec;

use crate::error::{Result, TensorError};

/// Dimension sizes or strides; most tensors have at most six dims.
pub type Dims = SmallVec<[usize; 6]>;

/// Where the elements of a tensor are: element `(i0, i1, ...)` is at
/// `offset + i0 * strides[0] + i1 * strides[1] + ...` elements into the storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Dims,
    strides: Dims,
    offset: usize,
}

impl Layout {
    /// A row-major (C-contiguous) layout of `shape` starting at element 0.
    ///
    /// # Panics
    /// If the element count of `shape` overflows `usize` (in every build profile). Shapes from
    /// user input go through [`Layout::try_contiguous`], which returns the error instead.
    pub fn contiguous(shape: &[usize]) -> Layout {
        match Layout::try_contiguous(shape) {
            Ok(layout) => layout,
            Err(err) => panic!("Layout::contiguous: {err}"),
        }
    }

    /// A row-major layout of `shape`, or [`TensorError::SizeOverflow`] when its element count
    /// overflows `usize`.
    pub fn try_contiguous(shape: &[usize]) -> Result<Layout> {
        Layout {
            shape: shape.into(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
        .checked("contiguous")
    }

    /// A layout from its parts: one stride per dim, sizes whose product fits in `usize`, and a
    /// reach `offset + Σ (size - 1) · stride` that fits too. Whether it fits a particular
    /// storage is checked where it meets one (`Tensor::as_strided`, a backend's operand check).
    pub fn from_parts(shape: &[usize], strides: &[usize], offset: usize) -> Result<Layout> {
        if shape.len() != strides.len() {
            return Err(TensorError::InvalidArgument {
                op: "as_strided",
                reason: format!(
                    "{} strides for a shape of {} dims ({shape:?}, {strides:?})",
                    strides.len(),
                    shape.len()
                ),
            });
        }
        Layout {
            shape: shape.into(),
            strides: strides.into(),
            offset,
        }
        .checked("as_strided")
    }

    /// This layout if its arithmetic fits in `usize`: the product of its sizes (a size of 0
    /// counted as 1, so every partial product a kernel forms fits as well) and its last
    /// element's index as if no dim were empty. Every constructor goes through here, so the
    /// rest of the crate, and the backends, compute sizes and extents without overflow checks.
    fn checked(self, op: &'static str) -> Result<Layout> {
        let sizes_fit = self
            .shape
            .iter()
            .try_fold(1usize, |acc, &size| acc.checked_mul(size.max(1)))
            .is_some();
        let reach_fits = self
            .shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |last, (&size, &stride)| {
                size.saturating_sub(1)
                    .checked_mul(stride)
                    .and_then(|reach| last.checked_add(reach))
            })
            .and_then(|last| last.checked_add(1))
            .is_some();
        if sizes_fit && reach_fits {
            return Ok(self);
        }
        Err(TensorError::SizeOverflow {
            op,
            reason: format!(
                "shape {:?} with strides {:?} and offset {} addresses more elements than usize \
                 holds",
                self.shape, self.strides, self.offset
            ),
        })
    }

    /// Dimension sizes.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of element zero, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dims.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are row-major with no gaps (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&size, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if size != 1 && stride != expected {
                return false;
            }
            expected = expected.saturating_mul(size);
        }
        true
    }

    /// One past the largest element index this layout touches (0 when empty).
    pub fn storage_extent(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        // The constructors checked that this sum fits.
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&size, &stride)| (size - 1) * stride)
                .sum::<usize>()
            + 1
    }

    /// Reorders dims: dim `i` of the result is dim `dims[i]` of `self`.
    pub fn permute(&self, op: &'static str, dims: &[usize]) -> Result<Layout> {
        let ndim = self.ndim();
        let mut seen = vec![false; ndim];
        if dims.len() != ndim
            || dims
                .iter()
                .any(|&d| d >= ndim || std::mem::replace(&mut seen[d], true))
        {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "{dims:?} is not a permutation of the {ndim} dims of {:?}",
                    self.shape
                ),
            });
        }
        Ok(Layout {
            shape: dims.iter().map(|&d| self.shape[d]).collect(),
            strides: dims.iter().map(|&d| self.strides[d]).collect(),
            offset: self.offset,
        })
    }

    /// Elements `start..start + len` of dim `dim`.
    pub fn narrow(&self, op: &'static str, dim: usize, start: usize, len: usize) -> Result<Layout> {
        if dim >= self.ndim()
            || start
                .checked_add(len)
                .is_none_or(|end| end > self.shape[dim])
        {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "{len} elements from {start} of dim {dim} are outside shape {:?}",
                    self.shape
                ),
            });
        }
        let mut res = self.clone();
        res.shape[dim] = len;
        if len > 0 {
            res.offset += start * self.strides[dim];
        }
        Ok(res)
    }

    /// Broadcasts to `shape` (new leading dims and size-1 dims get stride 0).
    pub fn expand(&self, op: &'static str, shape: &[usize]) -> Result<Layout> {
        let mismatch = || TensorError::ShapeMismatch {
            op,
            lhs: self.shape.to_vec(),
            rhs: shape.to_vec(),
        };
        if shape.len() < self.ndim() {
            return Err(mismatch());
        }
        let lead = shape.len() - self.ndim();
        let mut strides = Dims::from_elem(0, shape.len());
        for (i, &size) in shape.iter().enumerate().skip(lead) {
            let own = self.shape[i - lead];
            if own == size {
                strides[i] = if size == 1 { 0 } else { self.strides[i - lead] };
            } else if own == 1 {
                strides[i] = 0;
            } else {
                return Err(mismatch());
            }
        }
        Layout {
            shape: shape.into(),
            strides,
            offset: self.offset,
        }
        .checked(op)
    }

    /// The same elements under `shape` without copying, if strides allow it (PyTorch's
    /// `computeStride` rule); `None` when a copy is needed or `shape` holds another number of
    /// elements.
    pub fn view(&self, shape: &[usize]) -> Option<Layout> {
        if checked_numel("view", shape).ok()? != self.numel() {
            return None;
        }
        if self.numel() == 0 || self.ndim() == 0 {
            return Layout {
                shape: shape.into(),
                strides: contiguous_strides(shape),
                offset: self.offset,
            }
            .checked("view")
            .ok();
        }
        let mut new_strides = Dims::from_elem(0, shape.len());
        let mut view_d = shape.len() as isize - 1;
        let mut chunk_base_stride = *self.strides.last()?;
        let mut tensor_numel = 1;
        let mut view_numel = 1;
        for tensor_d in (0..self.ndim()).rev() {
            tensor_numel *= self.shape[tensor_d];
            let chunk_ends = tensor_d == 0
                || (self.shape[tensor_d - 1] != 1
                    && self.strides[tensor_d - 1] != tensor_numel * chunk_base_stride);
            if chunk_ends {
                while view_d >= 0 && (view_numel < tensor_numel || shape[view_d as usize] == 1) {
                    new_strides[view_d as usize] = view_numel * chunk_base_stride;
                    view_numel *= shape[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if tensor_d > 0 {
                    chunk_base_stride = self.strides[tensor_d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != -1 {
            return None;
        }
        Layout {
            shape: shape.into(),
            strides: new_strides,
            offset: self.offset,
        }
        .checked("view")
        .ok()
    }
}

/// Row-major strides of `shape` (saturating at `usize::MAX` for a shape whose element count
/// overflows, which no [`Layout`] can have).
pub fn contiguous_strides(shape: &[usize]) -> Dims {
    let mut strides = Dims::from_elem(1, shape.len());
    let mut acc = 1usize;
    for (stride, &size) in strides.iter_mut().zip(shape).rev() {
        *stride = acc;
        acc = acc.saturating_mul(size.max(1));
    }
    strides
}

/// The element count of `shape`, or [`TensorError::SizeOverflow`] naming `op` when the product
/// of its sizes (a size of 0 counted as 1) overflows `usize`.
pub fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    let fits = shape
        .iter()
        .try_fold(1usize, |acc, &size| acc.checked_mul(size.max(1)));
    match fits {
        Some(_) => Ok(shape.iter().product()),
        None => Err(TensorError::SizeOverflow {
            op,
            reason: format!("shape {shape:?} has more elements than usize holds"),
        }),
    }
}

/// The shape two operands broadcast to (NumPy rules).
pub fn broadcast_shapes(op: &'static str, lhs: &[usize], rhs: &[usize]) -> Result<Dims> {
    let ndim = lhs.len().max(rhs.len());
    let mut res = Dims::from_elem(1, ndim);
    for i in 0..ndim {
        let a = if i + lhs.len() >= ndim {
            lhs[i + lhs.len() - ndim]
        } else {
            1
        };
        let b = if i + rhs.len() >= ndim {
            rhs[i + rhs.len() - ndim]
        } else {
            1
        };
        res[i] = if a == b || b == 1 {
            a
        } else if a == 1 {
            b
        } else {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: lhs.to_vec(),
                rhs: rhs.to_vec(),
            });
        };
    }
    Ok(res)
}

/// Turns a possibly negative dim into an index below `ndim`.
pub fn normalize_dim(op: &'static str, dim: isize, ndim: usize) -> Result<usize> {
    let res = if dim < 0 { dim + ndim as isize } else { dim };
    if res < 0 || res as usize >= ndim {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!("dim {dim} is out of range for a tensor with {ndim} dims"),
        });
    }
    Ok(res as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_view(
        shape: &[usize],
        strides: &[usize],
        new_shape: &[usize],
        expect: Option<&[usize]>,
    ) {
        let layout = Layout::from_parts(shape, strides, 0).unwrap();
        let res = layout.view(new_shape);
        assert_eq!(
            res.as_ref().map(|l| l.strides()),
            expect,
            "{shape:?}/{strides:?} -> {new_shape:?}"
        );
    }

    #[test]
    fn view_follows_pytorch_stride_rules() {
        check_view(&[2, 3, 4], &[12, 4, 1], &[6, 4], Some(&[4, 1]));
        check_view(&[2, 3, 4], &[12, 4, 1], &[2, 12], Some(&[12, 1]));
        check_view(&[2, 3, 4], &[12, 4, 1], &[24], Some(&[1]));
        check_view(&[3, 2], &[1, 3], &[6], None);
        check_view(&[3, 2], &[1, 3], &[3, 2, 1], Some(&[1, 3, 3]));
        // A permuted [4, 2, 3] -> [2, 3, 4]: the last two dims stay mergeable.
        check_view(&[4, 2, 3], &[1, 12, 4], &[4, 6], Some(&[1, 4]));
        check_view(&[4, 2, 3], &[1, 12, 4], &[24], None);
    }

    #[test]
    fn broadcasting_and_expand() {
        assert_eq!(
            broadcast_shapes("add", &[3, 1], &[4]).unwrap().as_slice(),
            &[3, 4]
        );
        assert!(matches!(
            broadcast_shapes("add", &[3, 2], &[4]),
            Err(TensorError::ShapeMismatch { op: "add", .. })
        ));
        let layout = Layout::contiguous(&[3, 1])
            .expand("expand", &[2, 3, 4])
            .unwrap();
        assert_eq!(layout.strides(), &[0, 1, 0]);
        assert!(!layout.is_contiguous());
        assert_eq!(layout.storage_extent(), 3);
    }
}
