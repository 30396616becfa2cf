//! Reductions over dims: sum, mean and max (with indices).
//!
//! The reduced dims are permuted to the end (a free view) so the backend reduces trailing dims
//! only. Sum's backward is a free expand of the gradient; mean's divides it once; max scatters
//! the gradient to the saved indices.

use crate::autocast::autocast_args;
use crate::backend::{ReduceOp, ReduceWithIndex};
use crate::dtype::DType;
use crate::error::Result;
use crate::graph::record;
use crate::layout::normalize_dim;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_float, records};

impl Tensor {
    /// Normalised, sorted, deduplicated dims (all dims when `dims` is empty).
    fn reduce_dims(&self, op: &'static str, dims: &[isize]) -> Result<Vec<usize>> {
        let mut res = if dims.is_empty() {
            (0..self.ndim()).collect()
        } else {
            dims.iter()
                .map(|&d| normalize_dim(op, d, self.ndim()))
                .collect::<Result<Vec<_>>>()?
        };
        res.sort_unstable();
        res.dedup();
        Ok(res)
    }

    /// Reduces `dims` with no recording; the result has the kept dims only.
    fn reduce_raw(&self, op: ReduceOp, name: &'static str, dims: &[usize]) -> Result<Tensor> {
        check_float(name, self)?;
        let kept: Vec<usize> = (0..self.ndim()).filter(|d| !dims.contains(d)).collect();
        let order: Vec<usize> = kept.iter().chain(dims).copied().collect();
        let permuted = self.alias(self.layout().permute(name, &order)?);
        let out_shape: Vec<usize> = kept.iter().map(|&d| self.shape()[d]).collect();
        let res = self.new_empty(&out_shape, self.dtype())?;
        self.backend()
            .reduce(op, permuted.view(), dims.len(), res.view())?;
        Ok(res)
    }

    fn reduce_shape(&self, dims: &[usize], keepdim: bool) -> Vec<usize> {
        (0..self.ndim())
            .filter_map(|d| match (dims.contains(&d), keepdim) {
                (true, true) => Some(1),
                (true, false) => None,
                (false, _) => Some(self.shape()[d]),
            })
            .collect()
    }

    /// Sum over `dims` (all dims when empty).
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if let Some([input]) = autocast_args("sum", [self])? {
            return input.sum(dims, keepdim);
        }
        let dims = self.reduce_dims("sum", dims)?;
        let res = self.reduce_raw(ReduceOp::Sum, "sum", &dims)?;
        let res = res.into_shape(&self.reduce_shape(&dims, keepdim));
        if records(&[self]) {
            let source = self.shape().to_vec();
            let keep_shape = self.reduce_shape(&dims, true);
            record("sum", &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                Ok(vec![Some(grad.reshape(&keep_shape)?.expand(&source)?)])
            });
        }
        Ok(res)
    }

    /// Mean over `dims` (all dims when empty).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if let Some([input]) = autocast_args("mean", [self])? {
            return input.mean(dims, keepdim);
        }
        let dims = self.reduce_dims("mean", dims)?;
        let res = self.reduce_raw(ReduceOp::Mean, "mean", &dims)?;
        let res = res.into_shape(&self.reduce_shape(&dims, keepdim));
        if records(&[self]) {
            let source = self.shape().to_vec();
            let keep_shape = self.reduce_shape(&dims, true);
            let count: usize = dims.iter().map(|&d| self.shape()[d]).product();
            record("mean", &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let spread = grad.reshape(&keep_shape)?.expand(&source)?;
                Ok(vec![Some(spread.div_scalar(count as f64)?)])
            });
        }
        Ok(res)
    }

    /// Sum of all elements (0-dim).
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }

    /// Mean of all elements (0-dim).
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }

    /// Largest element along `dim` and its index (I64, first occurrence).
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        if let Some([input]) = autocast_args("max", [self])? {
            return input.max_dim(dim, keepdim);
        }
        check_float("max", self)?;
        let dim = normalize_dim("max", dim, self.ndim())?;
        let order: Vec<usize> = (0..self.ndim())
            .filter(|&d| d != dim)
            .chain([dim])
            .collect();
        let permuted = self.alias(self.layout().permute("max", &order)?);
        let out_shape: Vec<usize> = order[..order.len() - 1]
            .iter()
            .map(|&d| self.shape()[d])
            .collect();
        let values = self.new_empty(&out_shape, self.dtype())?;
        let indices = self.new_empty(&out_shape, DType::I64)?;
        self.backend().reduce_with_index(ReduceWithIndex {
            op: ReduceOp::Max,
            x: permuted.view(),
            values: values.view(),
            indices: indices.view(),
        })?;
        let shape = self.reduce_shape(&[dim], keepdim);
        let values = values.into_shape(&shape);
        let indices = indices.into_shape(&shape);
        if records(&[self]) {
            let saved_indices = SavedTensor::save("max", SaveRole::Output(1), &indices)?;
            let source = self.shape().to_vec();
            let keep_shape = self.reduce_shape(&[dim], true);
            record("max", &[self], &[&values], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let full = grad.new_zeros(&source, grad.dtype())?;
                let index = saved_indices.unpack()?.reshape(&keep_shape)?;
                let grad = grad.reshape(&keep_shape)?;
                grad.backend()
                    .scatter_add(full.view(), dim, index.view(), grad.view())?;
                Ok(vec![Some(full)])
            });
        }
        Ok((values, indices))
    }
}
