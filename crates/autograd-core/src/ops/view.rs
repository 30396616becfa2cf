//! View ops: reshape, permute, transpose, narrow, expand, (un)squeeze and contiguous.
//!
//! A view shares its storage (and version counter) with its source and only changes the
//! [`Layout`](crate::Layout); reshape copies only when the strides cannot express the new shape
//! (PyTorch's rule). Backward of a view is the inverse view of the gradient, except narrow
//! (scatter into zeros) and expand (sum back).

use crate::error::{Result, TensorError};
use crate::graph::record;
use crate::layout::{normalize_dim, Layout};
use crate::tensor::Tensor;

use super::records;

/// Resolves one `-1` in a requested shape.
fn infer_shape(op: &'static str, shape: &[isize], numel: usize) -> Result<Vec<usize>> {
    let known = shape
        .iter()
        .filter(|&&d| d >= 0)
        .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize));
    let n_inferred = shape.iter().filter(|&&d| d == -1).count();
    let bad = || TensorError::InvalidArgument {
        op,
        reason: format!("shape {shape:?} is invalid for {numel} elements"),
    };
    let Some(known) = known else {
        return Err(bad());
    };
    if n_inferred > 1 || shape.iter().any(|&d| d < -1) {
        return Err(bad());
    }
    let res: Vec<usize> = shape
        .iter()
        .map(|&d| {
            if d == -1 {
                numel.checked_div(known).unwrap_or(0)
            } else {
                d as usize
            }
        })
        .collect();
    if crate::layout::checked_numel(op, &res).ok() != Some(numel) {
        return Err(bad());
    }
    Ok(res)
}

impl Tensor {
    /// Records a view op whose backward is `backward(grad)`.
    fn record_view(
        &self,
        res: &Tensor,
        name: &'static str,
        backward: impl Fn(&Tensor) -> Result<Tensor> + Send + 'static,
    ) {
        if records(&[self]) {
            record(name, &[self], &[res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                Ok(vec![Some(backward(grad)?)])
            });
        }
    }

    /// The same elements under `shape`; a view when strides allow it, else a copy.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let signed: Vec<isize> = shape
            .iter()
            .map(|&d| isize::try_from(d).unwrap_or(-2))
            .collect();
        self.reshape_inferred(&signed)
    }

    /// Like [`Tensor::reshape`], with at most one `-1` dim inferred.
    pub fn reshape_inferred(&self, shape: &[isize]) -> Result<Tensor> {
        let shape = infer_shape("reshape", shape, self.numel())?;
        match self.layout().view(&shape) {
            Some(layout) => {
                let res = self.alias(layout);
                let source = self.shape().to_vec();
                self.record_view(&res, "reshape", move |grad| grad.reshape(&source));
                Ok(res)
            }
            None => self.contiguous()?.reshape(&shape),
        }
    }

    /// The same elements under `shape` without copying; an error when the strides cannot
    /// express it.
    pub fn view_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if crate::layout::checked_numel("view", shape)? != self.numel() {
            return Err(TensorError::ShapeMismatch {
                op: "view",
                lhs: self.shape().to_vec(),
                rhs: shape.to_vec(),
            });
        }
        let layout = self
            .layout()
            .view(shape)
            .ok_or_else(|| TensorError::InvalidArgument {
                op: "view",
                reason: format!(
                "shape {shape:?} is not compatible with size {:?} and strides {:?}; use reshape",
                self.shape(),
                self.strides()
            ),
            })?;
        let res = self.alias(layout);
        let source = self.shape().to_vec();
        self.record_view(&res, "view", move |grad| grad.reshape(&source));
        Ok(res)
    }

    /// Reorders dims: dim `i` of the result is dim `dims[i]` of `self`.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let res = self.alias(self.layout().permute("permute", dims)?);
        let mut inverse = vec![0; dims.len()];
        for (i, &d) in dims.iter().enumerate() {
            inverse[d] = i;
        }
        self.record_view(&res, "permute", move |grad| grad.permute(&inverse));
        Ok(res)
    }

    /// Swaps two dims (negative dims count from the end).
    pub fn transpose(&self, dim0: isize, dim1: isize) -> Result<Tensor> {
        let dim0 = normalize_dim("transpose", dim0, self.ndim())?;
        let dim1 = normalize_dim("transpose", dim1, self.ndim())?;
        let mut dims: Vec<usize> = (0..self.ndim()).collect();
        dims.swap(dim0, dim1);
        self.permute(&dims)
    }

    /// The transpose of a 2-D tensor.
    pub fn t(&self) -> Result<Tensor> {
        if self.ndim() != 2 {
            return Err(TensorError::InvalidArgument {
                op: "t",
                reason: format!("expects a 2-D tensor, got shape {:?}", self.shape()),
            });
        }
        self.transpose(0, 1)
    }

    /// Elements `start..start + len` of `dim` (a view).
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let dim = normalize_dim("narrow", dim, self.ndim())?;
        let res = self.alias(self.layout().narrow("narrow", dim, start, len)?);
        let source = self.shape().to_vec();
        self.record_view(&res, "narrow", move |grad| {
            let full = grad.new_zeros(&source, grad.dtype())?;
            let target = full.alias(full.layout().narrow("narrow", dim, start, len)?);
            grad.backend().copy(grad.view(), target.view())?;
            Ok(full)
        });
        Ok(res)
    }

    /// Broadcasts to `shape` without copying.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let res = self.alias(self.layout().expand("expand", shape)?);
        let source = self.shape().to_vec();
        self.record_view(&res, "expand", move |grad| grad.sum_to(&source));
        Ok(res)
    }

    /// Inserts a size-1 dim at `dim`.
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let dim = normalize_dim("unsqueeze", dim, self.ndim() + 1)?;
        let mut shape = self.shape().to_vec();
        shape.insert(dim, 1);
        self.reshape(&shape)
    }

    /// Removes dim `dim`, which must have size 1.
    pub fn squeeze_dim(&self, dim: isize) -> Result<Tensor> {
        let dim = normalize_dim("squeeze", dim, self.ndim())?;
        if self.shape()[dim] != 1 {
            return Err(TensorError::InvalidArgument {
                op: "squeeze",
                reason: format!("dim {dim} of shape {:?} is not 1", self.shape()),
            });
        }
        let mut shape = self.shape().to_vec();
        shape.remove(dim);
        self.reshape(&shape)
    }

    /// Merges dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        let start = normalize_dim("flatten", start, self.ndim())?;
        let end = normalize_dim("flatten", end, self.ndim())?;
        if start > end {
            return Err(TensorError::InvalidArgument {
                op: "flatten",
                reason: format!("start dim {start} comes after end dim {end}"),
            });
        }
        let shape = self.shape();
        let mut res: Vec<usize> = shape[..start].to_vec();
        res.push(shape[start..=end].iter().product());
        res.extend_from_slice(&shape[end + 1..]);
        self.reshape(&res)
    }

    /// This tensor if it is contiguous, else a contiguous copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let res = self.new_empty(self.shape(), self.dtype())?;
        self.backend().copy(self.view(), res.view())?;
        self.record_view(&res, "contiguous", |grad| Ok(grad.clone()));
        Ok(res)
    }

    /// This tensor in a buffer of exactly its elements: itself when it already owns a dense
    /// buffer, else a contiguous copy. Unlike [`Tensor::contiguous`], a small view of a large
    /// buffer is copied out even when its layout is contiguous (one row of a batch, say), so that
    /// what keeps it — an op saving it for backward — no longer keeps the whole buffer.
    pub fn compact(&self) -> Result<Tensor> {
        let owns_buffer = self.is_contiguous()
            && self.layout().offset() == 0
            && self.numel() * self.dtype().size_in_bytes() == self.buffer().len_bytes();
        if owns_buffer {
            return Ok(self.clone());
        }
        let res = self.new_empty(self.shape(), self.dtype())?;
        self.backend().copy(self.view(), res.view())?;
        self.record_view(&res, "compact", |grad| Ok(grad.clone()));
        Ok(res)
    }

    /// A view with an explicit layout over the same storage; for backends and tests. A layout
    /// whose arithmetic overflows is a [`TensorError::SizeOverflow`], one that reaches past the
    /// storage an invalid argument. The view may reach an element twice (reading it is fine;
    /// writing into it is a [`TensorError::Overlap`]).
    pub fn as_strided(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Tensor> {
        let layout = Layout::from_parts(shape, strides, offset)?;
        let end = layout
            .storage_extent()
            .checked_mul(self.dtype().size_in_bytes());
        if end.is_none_or(|end| end > self.buffer().len_bytes()) {
            return Err(TensorError::InvalidArgument {
                op: "as_strided",
                reason: format!(
                    "shape {shape:?}, strides {strides:?}, offset {offset} leave the storage of \
                     {} bytes",
                    self.buffer().len_bytes()
                ),
            });
        }
        if records(&[self]) {
            return Err(TensorError::Autograd {
                op: "as_strided",
                reason: "as_strided is not differentiable here; detach first".into(),
            });
        }
        Ok(self.alias(layout))
    }
}
