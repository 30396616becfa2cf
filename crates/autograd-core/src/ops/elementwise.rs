//! Elementwise ops with broadcasting: arithmetic, math functions, activations and dtype casts.
//!
//! Binary ops broadcast by expanding both operands to the result shape (stride 0, no copy)
//! before the backend's `binary` primitive; their backward sums each gradient back to its
//! operand's shape ([`Tensor::sum_to`]). Functions whose derivative is cheap from the output
//! (exp, tanh, sqrt, rsqrt, relu) save the output; the others save the input.

use crate::autocast::autocast_args;
use crate::backend::{BinaryOp, UnaryOp};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::graph::record;
use crate::layout::broadcast_shapes;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_float, check_same, records};

/// Which tensor a pointwise op's backward reads.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pointwise {
    /// The input (GELU, log: the derivative needs `x`).
    SavesInput,
    /// The output (exp, tanh, sqrt, rsqrt, relu: the derivative is cheap from `y`).
    SavesOutput,
}

impl Tensor {
    /// `op(self, other)` with broadcasting, without recording.
    pub(crate) fn binary_raw(
        &self,
        op: BinaryOp,
        other: &Tensor,
        name: &'static str,
    ) -> Result<Tensor> {
        check_same(name, self, other)?;
        check_float(name, self)?;
        let shape = broadcast_shapes(name, self.shape(), other.shape())?;
        let lhs = self.layout().expand(name, &shape)?;
        let rhs = other.layout().expand(name, &shape)?;
        let res = self.new_empty(&shape, self.dtype())?;
        let lhs = self.alias(lhs);
        let rhs = other.alias(rhs);
        self.backend()
            .binary(op, lhs.view(), rhs.view(), res.view())?;
        Ok(res)
    }

    /// `op(self)` without recording.
    pub(crate) fn unary_raw(&self, op: UnaryOp, name: &'static str) -> Result<Tensor> {
        check_float(name, self)?;
        let res = self.new_empty(self.shape(), self.dtype())?;
        self.backend().unary(op, self.view(), res.view())?;
        Ok(res)
    }

    /// `self += other` (other broadcast to self) with no recording and a version bump: the
    /// engine's gradient accumulation.
    pub(crate) fn add_assign_raw(&self, other: &Tensor) -> Result<()> {
        check_same("accumulate_grad", self, other)?;
        let rhs = other.layout().expand("accumulate_grad", self.shape())?;
        let rhs = other.alias(rhs);
        self.backend()
            .binary(BinaryOp::Add, self.view(), rhs.view(), self.view())?;
        self.buffer().bump_version();
        Ok(())
    }

    /// Sums a broadcast gradient back to `shape` (the inverse of broadcasting).
    pub fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let lead =
            self.ndim()
                .checked_sub(shape.len())
                .ok_or_else(|| TensorError::ShapeMismatch {
                    op: "sum_to",
                    lhs: self.shape().to_vec(),
                    rhs: shape.to_vec(),
                })?;
        // Leading dims of size 1 need no sum: the reshape below drops them (as PyTorch's
        // `sum_to` does), where a sum would launch a reduction over one element a row.
        let mut dims: Vec<isize> = (0..lead)
            .filter(|&d| self.shape()[d] != 1)
            .map(|d| d as isize)
            .collect();
        for (i, &size) in shape.iter().enumerate() {
            if size == 1 && self.shape()[lead + i] != 1 {
                dims.push((lead + i) as isize);
            }
        }
        let summed = if dims.is_empty() {
            self.clone()
        } else {
            self.sum(&dims, true)?
        };
        let summed = if lead > 0 {
            summed.reshape(&summed.shape()[lead..])?
        } else {
            summed
        };
        summed.reshape(shape)
    }

    /// `self + other`.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([lhs, rhs]) = autocast_args("add", [self, other])? {
            return lhs.add(&rhs);
        }
        let res = self.binary_raw(BinaryOp::Add, other, "add")?;
        if records(&[self, other]) {
            let (lhs_shape, rhs_shape) = (self.shape().to_vec(), other.shape().to_vec());
            record("add", &[self, other], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                Ok(vec![
                    Some(grad.sum_to(&lhs_shape)?),
                    Some(grad.sum_to(&rhs_shape)?),
                ])
            });
        }
        Ok(res)
    }

    /// `self - other`.
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([lhs, rhs]) = autocast_args("sub", [self, other])? {
            return lhs.sub(&rhs);
        }
        let res = self.binary_raw(BinaryOp::Sub, other, "sub")?;
        if records(&[self, other]) {
            let (lhs_shape, rhs_shape) = (self.shape().to_vec(), other.shape().to_vec());
            record("sub", &[self, other], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                Ok(vec![
                    Some(grad.sum_to(&lhs_shape)?),
                    Some(grad.neg()?.sum_to(&rhs_shape)?),
                ])
            });
        }
        Ok(res)
    }

    /// `self * other`.
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([lhs, rhs]) = autocast_args("mul", [self, other])? {
            return lhs.mul(&rhs);
        }
        let res = self.binary_raw(BinaryOp::Mul, other, "mul")?;
        if records(&[self, other]) {
            let saved_lhs = if other.requires_grad() {
                Some(SavedTensor::save("mul", SaveRole::Input(0), self)?)
            } else {
                None
            };
            let saved_rhs = if self.requires_grad() {
                Some(SavedTensor::save("mul", SaveRole::Input(1), other)?)
            } else {
                None
            };
            let (lhs_shape, rhs_shape) = (self.shape().to_vec(), other.shape().to_vec());
            record("mul", &[self, other], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let grad_lhs = match &saved_rhs {
                    Some(rhs) => Some(grad.mul(&rhs.unpack()?)?.sum_to(&lhs_shape)?),
                    None => None,
                };
                let grad_rhs = match &saved_lhs {
                    Some(lhs) => Some(grad.mul(&lhs.unpack()?)?.sum_to(&rhs_shape)?),
                    None => None,
                };
                Ok(vec![grad_lhs, grad_rhs])
            });
        }
        Ok(res)
    }

    /// `self / other`.
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([lhs, rhs]) = autocast_args("div", [self, other])? {
            return lhs.div(&rhs);
        }
        let res = self.binary_raw(BinaryOp::Div, other, "div")?;
        if records(&[self, other]) {
            let saved_lhs = if other.requires_grad() {
                Some(SavedTensor::save("div", SaveRole::Input(0), self)?)
            } else {
                None
            };
            let saved_rhs = SavedTensor::save("div", SaveRole::Input(1), other)?;
            let (lhs_shape, rhs_shape) = (self.shape().to_vec(), other.shape().to_vec());
            record("div", &[self, other], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let rhs = saved_rhs.unpack()?;
                let grad_over_rhs = grad.div(&rhs)?;
                let grad_rhs = match &saved_lhs {
                    Some(lhs) => Some(
                        grad_over_rhs
                            .mul(&lhs.unpack()?)?
                            .div(&rhs)?
                            .neg()?
                            .sum_to(&rhs_shape)?,
                    ),
                    None => None,
                };
                Ok(vec![Some(grad_over_rhs.sum_to(&lhs_shape)?), grad_rhs])
            });
        }
        Ok(res)
    }

    /// `self ^ other` elementwise.
    pub fn pow(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([lhs, rhs]) = autocast_args("pow", [self, other])? {
            return lhs.pow(&rhs);
        }
        let res = self.binary_raw(BinaryOp::Pow, other, "pow")?;
        if records(&[self, other]) {
            let saved_lhs = SavedTensor::save("pow", SaveRole::Input(0), self)?;
            let saved_rhs = SavedTensor::save("pow", SaveRole::Input(1), other)?;
            let saved_out = if other.requires_grad() {
                Some(SavedTensor::save(
                    "pow",
                    SaveRole::Output(0),
                    &res.detach(),
                )?)
            } else {
                None
            };
            let (lhs_shape, rhs_shape) = (self.shape().to_vec(), other.shape().to_vec());
            record("pow", &[self, other], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let (lhs, rhs) = (saved_lhs.unpack()?, saved_rhs.unpack()?);
                let grad_lhs = grad
                    .mul(&rhs)?
                    .mul(&lhs.pow(&rhs.add_scalar(-1.0)?)?)?
                    .sum_to(&lhs_shape)?;
                let grad_rhs = match &saved_out {
                    Some(out) => Some(
                        grad.mul(&out.unpack()?)?
                            .mul(&lhs.log()?)?
                            .sum_to(&rhs_shape)?,
                    ),
                    None => None,
                };
                Ok(vec![Some(grad_lhs), grad_rhs])
            });
        }
        Ok(res)
    }

    /// A unary op whose backward is `binary(grad_op, grad, saved)` with `saved` the input or the
    /// output.
    fn unary_with_backward(
        &self,
        op: UnaryOp,
        name: &'static str,
        grad_op: BinaryOp,
        save_output: bool,
    ) -> Result<Tensor> {
        if let Some([input]) = autocast_args(name, [self])? {
            return input.unary_with_backward(op, name, grad_op, save_output);
        }
        let res = self.unary_raw(op, name)?;
        if records(&[self]) {
            let saved = if save_output {
                Pointwise::SavesOutput
            } else {
                Pointwise::SavesInput
            };
            self.record_pointwise(name, grad_op, &res, saved)?;
        }
        Ok(res)
    }

    /// Records `res = f(self)` for a pointwise `f` whose backward is `binary(grad_op, grad,
    /// saved)`, with `saved` the input or the output.
    pub(crate) fn record_pointwise(
        &self,
        name: &'static str,
        grad_op: BinaryOp,
        res: &Tensor,
        saves: Pointwise,
    ) -> Result<()> {
        let saved = match saves {
            Pointwise::SavesInput => SavedTensor::save(name, SaveRole::Input(0), self)?,
            Pointwise::SavesOutput => SavedTensor::save(name, SaveRole::Output(0), res)?,
        };
        record(name, &[self], &[res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let saved = saved.unpack()?;
            // The incoming gradient is dead after this node: when nothing else holds it, the
            // input's gradient is written over it (GELU's backward at ViT-L/16 batch 32 then
            // needs no second 103 MB buffer).
            if grad.is_exclusive_dense()
                && grad.shape() == saved.shape()
                && grad.dtype() == saved.dtype()
            {
                grad.backend()
                    .binary(grad_op, grad.view(), saved.view(), grad.view())?;
                return Ok(vec![Some(grad.clone())]);
            }
            Ok(vec![Some(grad.binary_raw(grad_op, &saved, name)?)])
        });
        Ok(())
    }

    /// `e^self`.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_with_backward(UnaryOp::Exp, "exp", BinaryOp::Mul, true)
    }

    /// Natural logarithm.
    pub fn log(&self) -> Result<Tensor> {
        self.unary_with_backward(UnaryOp::Log, "log", BinaryOp::Div, false)
    }

    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_with_backward(UnaryOp::Sqrt, "sqrt", BinaryOp::SqrtBackward, true)
    }

    /// `1 / sqrt(self)`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary_with_backward(UnaryOp::Rsqrt, "rsqrt", BinaryOp::RsqrtBackward, true)
    }

    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary_with_backward(UnaryOp::Tanh, "tanh", BinaryOp::TanhBackward, true)
    }

    /// `max(self, 0)`.
    pub fn relu(&self) -> Result<Tensor> {
        self.unary_with_backward(UnaryOp::Relu, "relu", BinaryOp::ReluBackward, true)
    }

    /// GELU with the exact normal CDF.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary_with_backward(UnaryOp::Gelu, "gelu", BinaryOp::GeluBackward, false)
    }

    /// GELU with the tanh approximation (GPT-2's `gelu_new`).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        self.unary_with_backward(
            UnaryOp::GeluTanh,
            "gelu_tanh",
            BinaryOp::GeluTanhBackward,
            false,
        )
    }

    /// A unary op whose gradient is the output gradient through another unary op.
    fn unary_linear(
        &self,
        op: UnaryOp,
        name: &'static str,
        grad_op: Option<UnaryOp>,
    ) -> Result<Tensor> {
        let res = self.unary_raw(op, name)?;
        if records(&[self]) {
            record(name, &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                Ok(vec![Some(match grad_op {
                    Some(grad_op) => grad.unary_raw(grad_op, name)?,
                    None => grad.clone(),
                })])
            });
        }
        Ok(res)
    }

    /// `-self`.
    pub fn neg(&self) -> Result<Tensor> {
        self.unary_linear(UnaryOp::Neg, "neg", Some(UnaryOp::Neg))
    }

    /// `self + c`.
    pub fn add_scalar(&self, value: f64) -> Result<Tensor> {
        self.unary_linear(UnaryOp::AddScalar(value), "add_scalar", None)
    }

    /// `self * c`.
    pub fn mul_scalar(&self, value: f64) -> Result<Tensor> {
        self.unary_linear(
            UnaryOp::MulScalar(value),
            "mul_scalar",
            Some(UnaryOp::MulScalar(value)),
        )
    }

    /// `self / c`.
    pub fn div_scalar(&self, value: f64) -> Result<Tensor> {
        self.unary_linear(
            UnaryOp::DivScalar(value),
            "div_scalar",
            Some(UnaryOp::DivScalar(value)),
        )
    }

    /// `self ^ c`.
    pub fn pow_scalar(&self, exponent: f64) -> Result<Tensor> {
        if let Some([input]) = autocast_args("pow_scalar", [self])? {
            return input.pow_scalar(exponent);
        }
        let res = self.unary_raw(UnaryOp::PowScalar(exponent), "pow_scalar")?;
        if records(&[self]) {
            let saved = SavedTensor::save("pow_scalar", SaveRole::Input(0), self)?;
            record("pow_scalar", &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let slope = saved
                    .unpack()?
                    .unary_raw(UnaryOp::PowScalar(exponent - 1.0), "pow_scalar")?;
                let slope = slope.unary_raw(UnaryOp::MulScalar(exponent), "pow_scalar")?;
                Ok(vec![Some(grad.mul(&slope)?)])
            });
        }
        Ok(res)
    }

    /// This tensor converted to `dtype` (a new tensor; the same handle when the dtype matches).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let res = self.new_empty(self.shape(), dtype)?;
        self.backend().copy(self.view(), res.view())?;
        if dtype.is_float() && records(&[self]) {
            let source = self.dtype();
            record("to_dtype", &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                Ok(vec![Some(grad.to_dtype(source)?)])
            });
        }
        Ok(res)
    }

    /// A dense copy converted to `dtype`, without recording (always a new storage).
    pub(crate) fn to_dtype_contiguous_copy(&self, dtype: DType) -> Result<Tensor> {
        let res = self.new_empty(self.shape(), dtype)?;
        self.backend().copy(self.view(), res.view())?;
        Ok(res)
    }
}
