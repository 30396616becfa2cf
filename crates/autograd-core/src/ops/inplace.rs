//! In-place ops (`add_`, `sub_`, `mul_`, `div_`, `copy_`, `fill_`) and `out=` forms.
//!
//! Every write bumps the storage's version counter, so a tensor saved for backward before the
//! write fails to unpack with an error naming the op that saved it. With grad mode on, an
//! in-place op on a non-leaf records a node and becomes the tensor's new `grad_fn` (the old one
//! feeds it); on a leaf that requires grad, or on a view of a tensor in the graph, it is an
//! error. `out=` forms write into a caller's tensor and refuse inputs that need grad, as PyTorch
//! does.

use crate::backend::BinaryOp;
use crate::error::{Result, TensorError};
use crate::graph::record;
use crate::layout::broadcast_shapes;
use crate::overlap::{check_overlaps, Aliasing};
use crate::random::{Distribution, Generator, RandomDraw};
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_float, check_same, records};

impl Tensor {
    /// Checks that `self` may be written in place by `op` given the inputs that feed it.
    fn check_inplace(&self, op: &'static str, inputs: &[&Tensor]) -> Result<bool> {
        let recording = records(inputs);
        if recording && self.requires_grad() && self.is_leaf() {
            return Err(TensorError::Autograd {
                op,
                reason: "a leaf that requires grad is used in an in-place operation".into(),
            });
        }
        if recording && self.is_view() {
            return Err(TensorError::Autograd {
                op,
                reason:
                    "in-place writes into a view are not differentiable here; write into a copy"
                        .into(),
            });
        }
        Ok(recording)
    }

    fn binary_inplace(&self, op: BinaryOp, name: &'static str, other: &Tensor) -> Result<&Tensor> {
        check_same(name, self, other)?;
        check_float(name, self)?;
        let shape = broadcast_shapes(name, self.shape(), other.shape())?;
        if shape.as_slice() != self.shape() {
            return Err(TensorError::ShapeMismatch {
                op: name,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            });
        }
        let rhs = other.alias(other.layout().expand(name, self.shape())?);
        check_overlaps(
            name,
            &[self.view()],
            &[self.view(), rhs.view()],
            Aliasing::SameView,
        )?;
        let recording = self.check_inplace(name, &[self, other])?;
        // What backward needs from before the write.
        let saved = if recording {
            let old_self = match op {
                BinaryOp::Mul | BinaryOp::Div if other.requires_grad() => Some(SavedTensor::save(
                    name,
                    SaveRole::Intermediate("old_self"),
                    &self.to_dtype_contiguous_copy(self.dtype())?,
                )?),
                _ => None,
            };
            let other_saved = match op {
                BinaryOp::Mul | BinaryOp::Div => {
                    Some(SavedTensor::save(name, SaveRole::Input(1), other)?)
                }
                _ => None,
            };
            Some((old_self, other_saved))
        } else {
            None
        };
        self.backend()
            .binary(op, self.view(), rhs.view(), self.view())?;
        self.buffer().bump_version();
        if let Some((old_self, other_saved)) = saved {
            let (self_shape, other_shape) = (self.shape().to_vec(), other.shape().to_vec());
            record(name, &[self, other], &[self], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let (grad_self, grad_other) = match op {
                    BinaryOp::Add => (grad.clone(), Some(grad.sum_to(&other_shape)?)),
                    BinaryOp::Sub => (grad.clone(), Some(grad.neg()?.sum_to(&other_shape)?)),
                    BinaryOp::Mul => {
                        let other = other_saved.as_ref().expect("saved for mul_").unpack()?;
                        let grad_other = match &old_self {
                            Some(old) => Some(grad.mul(&old.unpack()?)?.sum_to(&other_shape)?),
                            None => None,
                        };
                        (grad.mul(&other)?, grad_other)
                    }
                    _ => {
                        let other = other_saved.as_ref().expect("saved for div_").unpack()?;
                        let grad_self = grad.div(&other)?;
                        let grad_other = match &old_self {
                            Some(old) => Some(
                                grad_self
                                    .mul(&old.unpack()?)?
                                    .div(&other)?
                                    .neg()?
                                    .sum_to(&other_shape)?,
                            ),
                            None => None,
                        };
                        (grad_self, grad_other)
                    }
                };
                Ok(vec![Some(grad_self.sum_to(&self_shape)?), grad_other])
            });
        }
        Ok(self)
    }

    /// `self += other` in place.
    pub fn add_(&self, other: &Tensor) -> Result<&Tensor> {
        self.binary_inplace(BinaryOp::Add, "add_", other)
    }

    /// `self -= other` in place.
    pub fn sub_(&self, other: &Tensor) -> Result<&Tensor> {
        self.binary_inplace(BinaryOp::Sub, "sub_", other)
    }

    /// `self *= other` in place.
    pub fn mul_(&self, other: &Tensor) -> Result<&Tensor> {
        self.binary_inplace(BinaryOp::Mul, "mul_", other)
    }

    /// `self /= other` in place.
    pub fn div_(&self, other: &Tensor) -> Result<&Tensor> {
        self.binary_inplace(BinaryOp::Div, "div_", other)
    }

    /// Copies `src` (broadcast, converted to this dtype) into this tensor.
    pub fn copy_(&self, src: &Tensor) -> Result<&Tensor> {
        super::check_device("copy_", self, src)?;
        let spread = src.alias(src.layout().expand("copy_", self.shape())?);
        check_overlaps(
            "copy_",
            &[self.view()],
            &[spread.view()],
            Aliasing::SameView,
        )?;
        let recording = self.check_inplace("copy_", &[self, src])? && self.dtype().is_float();
        self.backend().copy(spread.view(), self.view())?;
        self.buffer().bump_version();
        if recording {
            let (src_shape, src_dtype) = (src.shape().to_vec(), src.dtype());
            record("copy_", &[self, src], &[self], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                Ok(vec![
                    None,
                    Some(grad.sum_to(&src_shape)?.to_dtype(src_dtype)?),
                ])
            });
        }
        Ok(self)
    }

    /// Sets every element to `value`.
    pub fn fill_(&self, value: f64) -> Result<&Tensor> {
        check_overlaps("fill_", &[self.view()], &[], Aliasing::SameView)?;
        let recording = self.check_inplace("fill_", &[self])?;
        self.backend().fill(self.view(), value)?;
        self.buffer().bump_version();
        if recording {
            record("fill_", &[self], &[self], |_| Ok(vec![None]));
        }
        Ok(self)
    }

    /// Fills the tensor with draws from `distribution`, advancing `generator` by
    /// [`Distribution::counters_per_element`] counters an element: element `i` (row-major) is
    /// [`RandomDraw::value`]`(i)` of the generator's next draw, rounded to the dtype (PyTorch's
    /// `uniform_` and `normal_`, with this crate's counter-based numbers). The values are drawn
    /// where the tensor lives.
    ///
    /// ```
    /// use headroom_autograd_core::{DType, Distribution, Generator, RandomDraw, Tensor};
    /// use headroom_ops_cpu::CpuBackend;
    ///
    /// let cpu = CpuBackend::new_ref();
    /// let generator = Generator::new(7);
    /// let weight = Tensor::zeros(&cpu, &[4, 3], DType::F32)?;
    /// let normal = Distribution::Normal { mean: 0.0, std: 0.02 };
    /// weight.random_(normal, &generator)?;
    /// // Two uniforms an element: the generator moved past all twelve elements' draws.
    /// assert_eq!(generator.state().offset, 24);
    /// // Element i is the draw's value i, rounded to f32.
    /// let draw = RandomDraw { distribution: normal, seed: 7, offset: 0 };
    /// assert_eq!(weight.to_vec_f64()?[5], draw.value(5) as f32 as f64);
    /// # Ok::<(), headroom_autograd_core::TensorError>(())
    /// ```
    pub fn random_(&self, distribution: Distribution, generator: &Generator) -> Result<&Tensor> {
        check_float("random_", self)?;
        check_overlaps("random_", &[self.view()], &[], Aliasing::SameView)?;
        let recording = self.check_inplace("random_", &[self])?;
        let count = distribution.counters_per_element() * self.numel() as u64;
        let (seed, offset) = generator.advance(count);
        let draw = RandomDraw {
            distribution,
            seed,
            offset,
        };
        self.backend().random(self.view(), draw)?;
        self.buffer().bump_version();
        if recording {
            record("random_", &[self], &[self], |_| Ok(vec![None]));
        }
        Ok(self)
    }

    /// `out = op(self, other)` into an existing tensor of the broadcast shape.
    fn binary_out(
        &self,
        op: BinaryOp,
        name: &'static str,
        other: &Tensor,
        out: &Tensor,
    ) -> Result<()> {
        check_same(name, self, other)?;
        check_same(name, self, out)?;
        check_float(name, self)?;
        if records(&[self, other]) {
            return Err(TensorError::Autograd {
                op: name,
                reason: "functions with out= arguments do not support automatic differentiation"
                    .into(),
            });
        }
        let shape = broadcast_shapes(name, self.shape(), other.shape())?;
        if shape.as_slice() != out.shape() {
            return Err(TensorError::ShapeMismatch {
                op: name,
                lhs: shape.to_vec(),
                rhs: out.shape().to_vec(),
            });
        }
        let lhs = self.alias(self.layout().expand(name, &shape)?);
        let rhs = other.alias(other.layout().expand(name, &shape)?);
        check_overlaps(
            name,
            &[out.view()],
            &[lhs.view(), rhs.view()],
            Aliasing::SameView,
        )?;
        self.backend()
            .binary(op, lhs.view(), rhs.view(), out.view())?;
        out.buffer().bump_version();
        Ok(())
    }

    /// `out = self + other` (PyTorch's `torch.add(a, b, out=out)`).
    pub fn add_out(&self, other: &Tensor, out: &Tensor) -> Result<()> {
        self.binary_out(BinaryOp::Add, "add_out", other, out)
    }

    /// `out = self - other`.
    pub fn sub_out(&self, other: &Tensor, out: &Tensor) -> Result<()> {
        self.binary_out(BinaryOp::Sub, "sub_out", other, out)
    }

    /// `out = self * other`.
    pub fn mul_out(&self, other: &Tensor, out: &Tensor) -> Result<()> {
        self.binary_out(BinaryOp::Mul, "mul_out", other, out)
    }

    /// `out = self / other`.
    pub fn div_out(&self, other: &Tensor, out: &Tensor) -> Result<()> {
        self.binary_out(BinaryOp::Div, "div_out", other, out)
    }
}
