//! fp8 training's linear and its casts (issue 37), as torchao's float8 recipe computes them with
//! tensorwise current scaling: a tensor's scale is `max_finite / max(amax, 1e-12)` (in f64, then
//! rounded to f32), its codes `saturate(x · scale)` in an 8-bit float; a product of two scaled
//! tensors is their codes' product, accumulated in f32, times both scales' reciprocals
//! (`torch._scaled_mm`'s convention). The linear runs its forward with inputs and weights in
//! E4M3 and its backward with the output gradient in E5M2, and it saves its input as E4M3 codes
//! and a scale — one byte an element where `linear` keeps two or four — and the weight, which
//! backward casts again (same codes: the weight has not changed).
//!
//! Written with ops (casts, reductions, products), so it runs on every backend that casts the
//! 8-bit floats; the codes widen to f32 exactly, so a product here equals an fp8 GEMM that
//! accumulates in f32. A backend primitive with cuBLASLt's fp8 GEMMs is the fast path to come;
//! the values, the saved bytes and the graph stay these.

use crate::autocast::autocast_disabled;
use crate::dtype::DType;
use crate::engine::is_last_use;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::{needs_grad, record};
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::check_float;
use super::index::cat;

/// The smallest amax a scale is taken against (torchao's `EPS`): an all-zero tensor scales by
/// `max_finite · 1e12` rather than dividing by zero.
const AMAX_FLOOR: f64 = 1e-12;

/// A tensor in an 8-bit float with its tensorwise scale: it stands for `codes / scale`.
#[derive(Debug, Clone)]
pub struct Float8Tensor {
    /// The values times `scale`, rounded to nearest-even in an 8-bit float, saturated.
    pub codes: Tensor,
    /// The f32 scale, one element (shape `[]`).
    pub scale: Tensor,
}

impl Float8Tensor {
    /// The values again, `codes / scale` (computed as `codes · (1 / scale)` in f32), in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let (_grad, _autocast) = (no_grad(), autocast_disabled());
        let inverse = self.scale.reciprocal_f32()?;
        self.codes
            .to_dtype(DType::F32)?
            .mul(&inverse)?
            .to_dtype(dtype)
    }
}

impl Tensor {
    /// This tensor cast into the 8-bit float `dtype` (E4M3 or E5M2) with a tensorwise scale
    /// taken from its current amax, as torchao's `hp_tensor_to_float8_dynamic` with
    /// `ScalingGranularity.TENSORWISE` (no gradient flows through the cast).
    pub fn to_float8(&self, dtype: DType) -> Result<Float8Tensor> {
        check_float("to_float8", self)?;
        let Some(max_finite) = dtype.max_finite().filter(|_| dtype.is_float8()) else {
            return Err(TensorError::UnsupportedDtype {
                op: "to_float8",
                dtype,
            });
        };
        let (_grad, _autocast) = (no_grad(), autocast_disabled());
        let backend = self.backend();
        let flat = self.detach().contiguous()?.reshape(&[self.numel()])?;
        // amax = max(max(x), max(−x), floor), exact in x's dtype; the two extremes alone are
        // widened to f64, where torchao takes the scale.
        let floor = Tensor::full(backend, &[1], AMAX_FLOOR, DType::F64)?;
        let amax = if flat.numel() == 0 {
            floor
        } else {
            let high = flat.max_dim(0, true)?.0.to_dtype(DType::F64)?;
            let low = flat.neg()?.max_dim(0, true)?.0.to_dtype(DType::F64)?;
            cat(&[&high, &low, &floor], 0)?.max_dim(0, false)?.0
        };
        let scale = Tensor::full(backend, &[], max_finite, DType::F64)?
            .div(&amax.reshape(&[])?)?
            .to_dtype(DType::F32)?;
        let codes = self
            .detach()
            .to_dtype(DType::F32)?
            .mul(&scale)?
            .to_dtype(dtype)?;
        Ok(Float8Tensor { codes, scale })
    }

    /// `self @ weight^T + bias` in fp8 (see the module docs): the input and the weight cast to
    /// E4M3 with tensorwise scales, their product accumulated in f32 and returned in `self`'s
    /// dtype; backward casts the output gradient to E5M2 for both the input and the weight
    /// gradient, and takes the bias gradient from it unrounded. Saves the input as E4M3 codes and
    /// its scale (`SaveRole::Intermediate("input_float8")`, `("input_scale")`) and the weight.
    /// `self`, `weight` and `bias` are f32, bf16 or f16 of one dtype.
    ///
    /// ```
    /// use headroom_autograd_core::{DType, Tensor};
    /// use headroom_ops_cpu::CpuBackend;
    ///
    /// let cpu = CpuBackend::new_ref();
    /// let x = Tensor::from_f64s(&cpu, &[1.0, -2.0, 3.5, 0.5], &[2, 2], DType::F32)?;
    /// let w = Tensor::from_f64s(&cpu, &[0.5, 0.25, -1.0, 1.75], &[2, 2], DType::F32)?;
    /// w.requires_grad_(true)?;
    /// // Scales 448 / 3.5 = 128 and 448 / 1.75 = 256: every code and the product are exact.
    /// let y = x.linear_float8(&w, None)?;
    /// assert_eq!(y.to_vec_f64()?, [0.0, -4.5, 1.875, -2.625]);
    /// y.sum_all()?.backward()?;
    /// // dW = dYᵀ·X with dY (ones) in E5M2 at the scale 57344: within f32 rounding of [4.5, -1.5].
    /// let grad = w.grad().unwrap().to_vec_f64()?;
    /// for (got, want) in grad.iter().zip([4.5, -1.5, 4.5, -1.5]) {
    ///     assert!((got - want).abs() < 1e-6);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn linear_float8(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        for tensor in [Some(weight), bias].into_iter().flatten() {
            if tensor.dtype() != self.dtype() {
                return Err(TensorError::DtypeMismatch {
                    op: "linear_float8",
                    lhs: self.dtype(),
                    rhs: tensor.dtype(),
                });
            }
        }
        float8_linear(self, weight, bias, self.dtype())
    }

    /// `1 / self` in f32 (an f32 tensor's elementwise reciprocal, correctly rounded).
    fn reciprocal_f32(&self) -> Result<Tensor> {
        Tensor::full(self.backend(), &[], 1.0, DType::F32)?.div(self)
    }
}

/// [`Tensor::linear_float8`] of operands in any float dtypes (each quantized from its own), the
/// output in `output`: what `Tensor::linear` runs for a linear an autocast policy lists in fp8,
/// on the tensors as they come (no half-precision copy of the input or of the weight) with the
/// output in the dtype autocast would give the linear. Gradients come back in each operand's
/// dtype.
pub(super) fn float8_linear(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    output: DType,
) -> Result<Tensor> {
    const OP: &str = "linear_float8";
    for tensor in [Some(input), Some(weight), bias].into_iter().flatten() {
        check_float(OP, tensor)?;
        if tensor.device() != input.device() {
            return Err(TensorError::DeviceMismatch {
                op: OP,
                lhs: input.device(),
                rhs: tensor.device(),
            });
        }
    }
    let in_features = *input.shape().last().unwrap_or(&0);
    let out_features = weight.shape().first().copied().unwrap_or(0);
    let bias_fits = bias.is_none_or(|b| b.shape() == [out_features]);
    if input.ndim() == 0 || weight.shape() != [out_features, in_features] || !bias_fits {
        return Err(TensorError::InvalidArgument {
            op: OP,
            reason: format!(
                "input {:?}, weight {:?} and bias {:?} are not [.., in], [out, in] and [out]",
                input.shape(),
                weight.shape(),
                bias.map(|b| b.shape().to_vec())
            ),
        });
    }
    let dtype = input.dtype();
    let bias_dtype = bias.map(Tensor::dtype);
    let rows = input.numel() / in_features.max(1);
    let mut out_shape = input.shape().to_vec();
    *out_shape.last_mut().expect("ndim > 0") = out_features;
    let inputs: Vec<&Tensor> = [Some(input), Some(weight), bias]
        .into_iter()
        .flatten()
        .collect();
    // Its products are f32 whatever autocast says (an fp8 GEMM accumulates in f32).
    let _autocast = autocast_disabled();
    let (res, input_float8) = {
        let _grad = no_grad();
        let input_float8 = input
            .reshape(&[rows, in_features])?
            .to_float8(DType::F8E4M3)?;
        let weight_float8 = weight.to_float8(DType::F8E4M3)?;
        let mut res = scaled_product(&input_float8, &weight_float8, true, output)?;
        if let Some(bias) = bias {
            res = res.add(&bias.to_dtype(output)?)?;
        }
        (res.reshape(&out_shape)?, input_float8)
    };
    if needs_grad(&inputs) {
        let saved_codes = SavedTensor::save(
            OP,
            SaveRole::Intermediate("input_float8"),
            &input_float8.codes,
        )?;
        let saved_scale = SavedTensor::save(
            OP,
            SaveRole::Intermediate("input_scale"),
            &input_float8.scale,
        )?;
        let saved_weight = SavedTensor::save(OP, SaveRole::Input(1), weight)?;
        let (input_shape, has_bias) = (input.shape().to_vec(), bias.is_some());
        let mut saved_input = Some((saved_codes, saved_scale));
        record(OP, &inputs, &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let grad_2d = grad.reshape(&[rows, out_features])?;
            let grad_float8 = grad_2d.to_float8(DType::F8E5M2)?;
            let weight = saved_weight.unpack()?;
            let grad_bias = match bias_dtype {
                Some(bias_dtype) => Some(grad_2d.sum(&[0], false)?.to_dtype(bias_dtype)?),
                None => None,
            };
            // dW = dYᵀ · X, then the saved input is released on the graph's last use.
            let grad_weight = match &saved_input {
                Some((codes, scale)) => {
                    let input = Float8Tensor {
                        codes: codes.unpack()?,
                        scale: scale.unpack()?,
                    };
                    let grad_t = Float8Tensor {
                        codes: grad_float8.codes.t()?,
                        scale: grad_float8.scale.clone(),
                    };
                    Some(scaled_product(&grad_t, &input, false, weight.dtype())?)
                }
                None => None,
            };
            if is_last_use() {
                saved_input = None;
            }
            // dX = dY · W, the weight cast again.
            let weight_float8 = weight.to_float8(DType::F8E4M3)?;
            let grad_input = scaled_product(&grad_float8, &weight_float8, false, dtype)?
                .reshape(&input_shape)?;
            let mut res = vec![Some(grad_input), grad_weight];
            if has_bias {
                res.push(grad_bias);
            }
            Ok(res)
        });
    }
    Ok(res)
}

/// `a · b` (`a · bᵀ` with `transpose_b`) of two scaled 8-bit tensors of two dims: the codes
/// widened to f32 (exactly), multiplied with f32 accumulation, times `1 / a.scale · 1 / b.scale`
/// (each reciprocal rounded to f32, then their product), returned in `dtype`.
fn scaled_product(
    a: &Float8Tensor,
    b: &Float8Tensor,
    transpose_b: bool,
    dtype: DType,
) -> Result<Tensor> {
    let b_codes = if transpose_b {
        b.codes.t()?
    } else {
        b.codes.clone()
    };
    let product = a
        .codes
        .to_dtype(DType::F32)?
        .matmul(&b_codes.to_dtype(DType::F32)?)?;
    let alpha = a.scale.reciprocal_f32()?.mul(&b.scale.reciprocal_f32()?)?;
    product.mul(&alpha)?.to_dtype(dtype)
}
