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
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.into(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A layout from its parts (the caller guarantees it stays inside its storage).
    pub fn from_parts(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        debug_assert_eq!(shape.len(), strides.len());
        Layout {
            shape: shape.into(),
            strides: strides.into(),
            offset,
        }
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
            expected *= size;
        }
        true
    }

    /// One past the largest element index this layout touches (0 when empty).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
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
        if dim >= self.ndim() || start + len > self.shape[dim] {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!(
                    "range {start}..{} of dim {dim} is outside shape {:?}",
                    start + len,
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
        Ok(Layout {
            shape: shape.into(),
            strides,
            offset: self.offset,
        })
    }

    /// The same elements under `shape` without copying, if strides allow it (PyTorch's
    /// `computeStride` rule); `None` when a copy is needed.
    pub fn view(&self, shape: &[usize]) -> Option<Layout> {
        debug_assert_eq!(shape.iter().product::<usize>(), self.numel());
        if self.numel() == 0 || self.ndim() == 0 {
            return Some(Layout {
                shape: shape.into(),
                strides: contiguous_strides(shape),
                offset: self.offset,
            });
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
        Some(Layout {
            shape: shape.into(),
            strides: new_strides,
            offset: self.offset,
        })
    }
}

/// Row-major strides of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Dims {
    let mut strides = Dims::from_elem(1, shape.len());
    let mut acc = 1;
    for (stride, &size) in strides.iter_mut().zip(shape).rev() {
        *stride = acc;
        acc *= size.max(1);
    }
    strides
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
        let layout = Layout::from_parts(shape, strides, 0);
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
