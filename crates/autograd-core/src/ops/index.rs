//! Indexing ops: gather, embedding (scatter-add backward), cat and split.
//!
//! Embedding is a gather along dim 0 with the index broadcast over the embedding dim (stride 0,
//! no copy); its backward scatter-adds the gradient rows into a zero weight gradient. `split`
//! is one node with several outputs whose backward writes the outputs' gradients into one
//! buffer, so it costs one gradient of the input, not one per piece — and no copy at all when the
//! pieces' gradients already are adjacent slices of one buffer.

use crate::autocast::{autocast_args, autocast_inputs};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::graph::record;
use crate::layout::{normalize_dim, Layout};
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_device, check_dtype, check_float, check_same, records};

impl Tensor {
    /// `out[i][j] = self[i][index[i][j]]` along `dim` (PyTorch's `gather`).
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        check_float("gather", self)?;
        check_device("gather", self, index)?;
        check_dtype("gather", index, DType::I64)?;
        let dim = normalize_dim("gather", dim, self.ndim())?;
        if index.ndim() != self.ndim() {
            return Err(TensorError::ShapeMismatch {
                op: "gather",
                lhs: self.shape().to_vec(),
                rhs: index.shape().to_vec(),
            });
        }
        let res = self.new_empty(index.shape(), self.dtype())?;
        self.backend()
            .gather(self.view(), dim, index.view(), res.view())?;
        if records(&[self]) {
            let saved_index = SavedTensor::save("gather", SaveRole::Input(1), index)?;
            let source = self.shape().to_vec();
            record("gather", &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let full = grad.new_zeros(&source, grad.dtype())?;
                let index = saved_index.unpack()?;
                grad.backend()
                    .scatter_add(full.view(), dim, index.view(), grad.view())?;
                Ok(vec![Some(full)])
            });
        }
        Ok(res)
    }

    /// Splits `dim` into consecutive pieces of the given sizes (views).
    pub fn split_with_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let dim = normalize_dim("split", dim, self.ndim())?;
        let total = sizes
            .iter()
            .try_fold(0usize, |acc, &size| acc.checked_add(size));
        if total != Some(self.shape()[dim]) {
            return Err(TensorError::InvalidArgument {
                op: "split",
                reason: format!(
                    "sizes {sizes:?} do not add up to dim {dim} of {:?}",
                    self.shape()
                ),
            });
        }
        let mut res = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &size in sizes {
            res.push(self.alias(self.layout().narrow("split", dim, start, size)?));
            start += size;
        }
        if records(&[self]) {
            let source = self.shape().to_vec();
            let sizes = sizes.to_vec();
            let outputs: Vec<&Tensor> = res.iter().collect();
            record("split", &[self], &outputs, move |grads| {
                if let Some(full) = adjacent_slices(grads, &source, dim, &sizes) {
                    return Ok(vec![Some(full)]);
                }
                let first = grads
                    .iter()
                    .flatten()
                    .next()
                    .expect("the engine skips nodes with no gradient");
                let full = first.new_empty(&source, first.dtype())?;
                let mut start = 0;
                for (grad, &size) in grads.iter().zip(&sizes) {
                    let target = full.alias(full.layout().narrow("split", dim, start, size)?);
                    match grad {
                        Some(grad) => full.backend().copy(grad.view(), target.view())?,
                        None => full.backend().fill(target.view(), 0.0)?,
                    }
                    start += size;
                }
                Ok(vec![Some(full)])
            });
        }
        Ok(res)
    }

    /// Splits `dim` into pieces of `size` (the last may be smaller).
    pub fn split(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let axis = normalize_dim("split", dim, self.ndim())?;
        let total = self.shape()[axis];
        if size == 0 {
            return Err(TensorError::InvalidArgument {
                op: "split",
                reason: "split size must be positive".into(),
            });
        }
        let sizes: Vec<usize> = (0..total)
            .step_by(size)
            .map(|start| size.min(total - start))
            .collect();
        self.split_with_sizes(&sizes, dim)
    }
}

/// The pieces' gradients as one dense tensor of the split input's shape `source`, without a copy,
/// when they already are its slices: views of one buffer at exactly the places `split` cut along
/// `dim` (attention's gradients for a packed q/k/v projection are, see `ops/attention.rs`).
fn adjacent_slices(
    grads: &[Option<Tensor>],
    source: &[usize],
    dim: usize,
    sizes: &[usize],
) -> Option<Tensor> {
    let first = grads.first()?.as_ref()?;
    let dense = Layout::contiguous(source);
    let full = Layout::from_parts(source, dense.strides(), first.layout().offset()).ok()?;
    let mut start = 0;
    for (grad, &size) in grads.iter().zip(sizes) {
        let grad = grad.as_ref()?;
        let same_buffer = std::sync::Arc::ptr_eq(grad.buffer(), first.buffer());
        if !same_buffer
            || grad.dtype() != first.dtype()
            || *grad.layout() != full.narrow("split", dim, start, size).ok()?
        {
            return None;
        }
        start += size;
    }
    Some(Tensor::from_parts(
        std::sync::Arc::clone(first.buffer()),
        full,
        first.dtype(),
        false,
    ))
}

/// Rows of `weight` `[num, dim]` picked by `indices` (I64, any shape): `[..indices, dim]`.
pub fn embedding(weight: &Tensor, indices: &Tensor) -> Result<Tensor> {
    if let Some([weight]) = autocast_args("embedding", [weight])? {
        return embedding(&weight, indices);
    }
    check_float("embedding", weight)?;
    check_device("embedding", weight, indices)?;
    check_dtype("embedding", indices, DType::I64)?;
    if weight.ndim() != 2 {
        return Err(TensorError::InvalidArgument {
            op: "embedding",
            reason: format!("weight must be 2-D, got {:?}", weight.shape()),
        });
    }
    let (n, dim) = (indices.numel(), weight.shape()[1]);
    let flat = if indices.is_contiguous() {
        indices.clone()
    } else {
        indices.to_dtype_contiguous_copy(DType::I64)?
    };
    let index = flat.alias(Layout::from_parts(
        &[n, dim],
        &[1, 0],
        flat.layout().offset(),
    )?);
    let res = weight.new_empty(&[n, dim], weight.dtype())?;
    weight
        .backend()
        .gather(weight.view(), 0, index.view(), res.view())?;
    let mut shape = indices.shape().to_vec();
    shape.push(dim);
    let res = res.into_shape(&shape);
    if records(&[weight]) {
        let saved_index = SavedTensor::save("embedding", SaveRole::Input(1), &index)?;
        let source = weight.shape().to_vec();
        record("embedding", &[weight], &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let grad = grad.reshape(&[n, dim])?;
            let full = grad.new_zeros(&source, grad.dtype())?;
            let index = saved_index.unpack()?;
            grad.backend()
                .scatter_add(full.view(), 0, index.view(), grad.view())?;
            Ok(vec![Some(full)])
        });
    }
    Ok(res)
}

/// Joins tensors along `dim`; all other dims must agree.
pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
    let given: Vec<Option<&Tensor>> = tensors.iter().copied().map(Some).collect();
    if let Some(cast) = autocast_inputs("cat", &given)? {
        let cast: Vec<Tensor> = cast.into_iter().flatten().collect();
        return cat(&cast.iter().collect::<Vec<_>>(), dim);
    }
    let first = tensors
        .first()
        .ok_or_else(|| TensorError::InvalidArgument {
            op: "cat",
            reason: "needs at least one tensor".into(),
        })?;
    let dim = normalize_dim("cat", dim, first.ndim())?;
    let mut shape = first.shape().to_vec();
    shape[dim] = 0;
    for tensor in tensors {
        check_same("cat", first, tensor)?;
        let same_rest = tensor.ndim() == first.ndim()
            && (0..first.ndim()).all(|d| d == dim || tensor.shape()[d] == first.shape()[d]);
        if !same_rest {
            return Err(TensorError::ShapeMismatch {
                op: "cat",
                lhs: first.shape().to_vec(),
                rhs: tensor.shape().to_vec(),
            });
        }
        shape[dim] = shape[dim].checked_add(tensor.shape()[dim]).ok_or_else(|| {
            TensorError::SizeOverflow {
                op: "cat",
                reason: format!("the sizes of dim {dim} add up to more than usize holds"),
            }
        })?;
    }
    let res = first.new_empty(&shape, first.dtype())?;
    let mut start = 0;
    let mut sizes = Vec::with_capacity(tensors.len());
    for tensor in tensors {
        let size = tensor.shape()[dim];
        let target = res.alias(res.layout().narrow("cat", dim, start, size)?);
        first.backend().copy(tensor.view(), target.view())?;
        sizes.push(size);
        start += size;
    }
    if records(tensors) {
        record("cat", tensors, &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let mut start = 0;
            let mut res = Vec::with_capacity(sizes.len());
            for &size in &sizes {
                res.push(Some(grad.narrow(dim as isize, start, size)?));
                start += size;
            }
            Ok(res)
        });
    }
    Ok(res)
}
