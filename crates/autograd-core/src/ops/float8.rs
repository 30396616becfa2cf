//! fp8 training's linear and its casts (issue 37), as torchao's float8 recipes compute them. A
//! tensor's scale is `max_finite / max(amax, 1e-12)` (in f64, then rounded to f32; rounded down to
//! a power of two when the recipe asks), taken over the whole tensor (tensorwise) or over each
//! row (rowwise); its codes are `saturate(x · scale)` in an 8-bit float. A product of two scaled
//! tensors is their codes' product, accumulated in f32, times both scales' reciprocals
//! (`torch._scaled_mm`'s convention).
//!
//! The linear ([`Float8Recipe`]) runs its forward with inputs and weights in E4M3 and its
//! backward with the output gradient in the recipe's gradient dtype, and saves its input once,
//! as 8-bit codes and their scales — one byte an element where `linear` keeps two or four — and
//! the weight, which backward casts again (same codes: the weight has not changed). Rowwise
//! scales are per token for the input and per output feature for the weight, the layout the
//! forward GEMM contracts; backward never re-quantizes the saved input along the other axis.
//! Instead it folds the input's row scales into the output gradient before quantizing that per
//! output feature (`dW = Σ_t (dY[t, o] / s_x[t]) · codes_x[t, i]`), and the weight's row scales
//! into the output gradient before quantizing that per token (`dX = Σ_o (dY[t, o] / s_w[o]) ·
//! codes_w[o, i]`); with power-of-two scales the folds are exact.
//!
//! A listed linear behind GELU (`gelu_linear`, `gelu_tanh_linear` under autocast) runs as one fp8
//! op that saves the pre-activation alone: backward recomputes the activation and, from it, the
//! same codes for the weight gradient.
//!
//! Delayed scaling ([`Float8History`], tensorwise) takes each cast's scale from the amaxes of
//! the same tensor's earlier casts, so a kernel can cast in one read and record the amax as it
//! goes; backward casts the weight again with the forward's scale.
//!
//! The casts and products go through the backend's fp8 primitives (`quantize_float8`,
//! `matmul_float8`) where it has them; a backend without them gets tensorwise scaling composed
//! of reductions, casts and f32 products, the same values.

use std::sync::Arc;

use crate::autocast::autocast_disabled;
use crate::backend::{Float8Granularity, Float8Matmul, View};
use crate::dtype::DType;
use crate::engine::is_last_use;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::{needs_grad, record};
use crate::rebuild::{register_rebuild, Rebuild};
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::check_float;
use super::float8_cast::{
    quantize, quantize_with, quantized_input, Float8History, Float8Role, Scaling,
};
use super::linalg::ActivationLinear;

/// How a linear runs in fp8: which elements share a scale, how scales round, and the 8-bit
/// float of the output gradient (the input and the weight are always E4M3).
///
/// ```
/// use headroom_autograd_core::{DType, Float8Granularity, Float8Recipe};
///
/// assert_eq!(Float8Recipe::TENSORWISE.grad_dtype, DType::F8E5M2);
/// assert_eq!(Float8Recipe::ROWWISE.granularity, Float8Granularity::Rowwise);
/// assert!(Float8Recipe::ROWWISE.power_of_two_scales);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Float8Recipe {
    /// One scale a tensor, or one a row (a token of the input, an output feature of the weight).
    pub granularity: Float8Granularity,
    /// The output gradient's 8-bit float: E5M2 (range) or E4M3 (precision).
    pub grad_dtype: DType,
    /// Scales rounded down to powers of two.
    pub power_of_two_scales: bool,
}

impl Float8Recipe {
    /// torchao's default (`tensorwise`): one scale a tensor, E5M2 gradients, scales as computed.
    pub const TENSORWISE: Float8Recipe = Float8Recipe {
        granularity: Float8Granularity::Tensorwise,
        grad_dtype: DType::F8E5M2,
        power_of_two_scales: false,
    };
    /// As torchao's `rowwise` recipe: one scale a row, E4M3 gradients, power-of-two scales.
    pub const ROWWISE: Float8Recipe = Float8Recipe {
        granularity: Float8Granularity::Rowwise,
        grad_dtype: DType::F8E4M3,
        power_of_two_scales: true,
    };
}

/// How one linear runs in fp8: scales from each tensor's current amax under a recipe, or
/// delayed scales from an amax history of its own.
#[derive(Debug, Clone)]
pub enum Float8Linear {
    /// Each cast scales by the tensor's own amax, as the recipe says.
    Current(Float8Recipe),
    /// Each cast scales by the largest amax of the last casts of the same tensor of this linear
    /// (its input, its weight, its output gradient), [`Float8Recipe::TENSORWISE`]'s formats.
    Delayed(Arc<Float8History>),
}

impl Float8Linear {
    /// The formats and granularity (tensorwise for delayed scaling).
    pub fn recipe(&self) -> Float8Recipe {
        match self {
            Float8Linear::Current(recipe) => *recipe,
            Float8Linear::Delayed(_) => Float8Recipe::TENSORWISE,
        }
    }
}

/// A tensor in an 8-bit float with its scales: it stands for `codes / scale`, the scale
/// broadcast along the last dim.
#[derive(Debug, Clone)]
pub struct Float8Tensor {
    /// The values times their scale, rounded to nearest-even in an 8-bit float, saturated.
    pub codes: Tensor,
    /// The f32 scales: shape `[]` (tensorwise), or the codes' shape less its last dim (rowwise).
    pub scale: Tensor,
    /// The scales' reciprocals `1 / scale` (f32, correctly rounded), shaped as `scale`: what a
    /// product of codes multiplies by, written by the quantize itself.
    pub inverse_scale: Tensor,
}

impl Float8Tensor {
    /// The values again, `codes / scale` (computed as `codes · (1 / scale)` in f32), in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let (_grad, _autocast) = (no_grad(), autocast_disabled());
        let mut inverse = self.inverse_scale.clone();
        if inverse.ndim() > 0 {
            inverse = inverse.unsqueeze(-1)?;
        }
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
        self.quantized(dtype, Float8Granularity::Tensorwise, false)
    }

    /// This tensor cast into the 8-bit float `dtype` with one scale per row of its last dim
    /// (torchao's `AXISWISE` along dim -1), rounded down to a power of two when asked; the
    /// scales have the tensor's shape less its last dim. Needs a backend with the fused fp8
    /// quantize (the CPU backend).
    pub fn to_float8_rowwise(&self, dtype: DType, power_of_two: bool) -> Result<Float8Tensor> {
        if self.ndim() == 0 {
            return Err(TensorError::InvalidArgument {
                op: "to_float8",
                reason: "a 0-dim tensor has no rows; use to_float8 (tensorwise)".to_string(),
            });
        }
        self.quantized(dtype, Float8Granularity::Rowwise, power_of_two)
    }

    /// [`Tensor::to_float8`] or [`Tensor::to_float8_rowwise`] of any shape, through a
    /// `[rows, last dim]` view.
    fn quantized(
        &self,
        dtype: DType,
        granularity: Float8Granularity,
        power_of_two: bool,
    ) -> Result<Float8Tensor> {
        check_float("to_float8", self)?;
        let _grad = no_grad();
        let cols = self.shape().last().copied().unwrap_or(1);
        let rows = self.numel() / cols.max(1);
        let flat = self.detach().reshape(&[rows, cols])?;
        let res = quantize(&flat, None, dtype, granularity, power_of_two)?;
        let scale_shape = match granularity {
            Float8Granularity::Tensorwise => &[][..],
            Float8Granularity::Rowwise => &self.shape()[..self.ndim() - 1],
        };
        Ok(Float8Tensor {
            codes: res.codes.reshape(self.shape())?,
            scale: res.scale.reshape(scale_shape)?,
            inverse_scale: res.inverse_scale.reshape(scale_shape)?,
        })
    }

    /// `self @ weight^T + bias` in fp8 with [`Float8Recipe::TENSORWISE`] (see
    /// [`Tensor::linear_float8_with`]).
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
        self.linear_float8_with(weight, bias, Float8Recipe::TENSORWISE)
    }

    /// `self @ weight^T + bias` in fp8 (see the module docs): the input and the weight cast to
    /// E4M3 with `recipe`'s scales, their product accumulated in f32 and returned in `self`'s
    /// dtype; backward casts the output gradient to `recipe.grad_dtype` for the input and the
    /// weight gradients, and takes the bias gradient from it unrounded. Saves the input as codes
    /// and scales (`SaveRole::Intermediate("input_float8")`, `("input_scale")`) and the weight.
    /// `self`, `weight` and `bias` are f32, bf16 or f16 of one dtype.
    ///
    /// ```
    /// use headroom_autograd_core::{DType, Float8Recipe, Tensor};
    /// use headroom_ops_cpu::CpuBackend;
    ///
    /// let cpu = CpuBackend::new_ref();
    /// // Rows of very different sizes, every value an E4M3 code at its row's power-of-two scale.
    /// let small = 2f64.powi(-9);
    /// let values = [384.0, -96.0, small, 1.5 * small];
    /// let x = Tensor::from_f64s(&cpu, &values, &[2, 2], DType::F32)?;
    /// let w = Tensor::from_f64s(&cpu, &[1.0, 0.0, 0.0, 1.0], &[2, 2], DType::F32)?;
    /// let rowwise = x.linear_float8_with(&w, None, Float8Recipe::ROWWISE)?;
    /// assert_eq!(rowwise.to_vec_f64()?, values); // one scale a row keeps both rows exact
    /// let tensorwise = x.linear_float8(&w, None)?;
    /// assert_ne!(tensorwise.to_vec_f64()?[2], small); // one scale for both rounds the small row
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn linear_float8_with(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        recipe: Float8Recipe,
    ) -> Result<Tensor> {
        self.check_operand_dtypes(weight, bias)?;
        float8_linear(
            self,
            weight,
            bias,
            self.dtype(),
            &Float8Linear::Current(recipe),
            None,
            false,
        )
    }

    /// `self @ weight^T + bias` in fp8 with delayed tensorwise scales from `history` (see
    /// [`Float8History`]); otherwise as [`Tensor::linear_float8`].
    pub fn linear_float8_delayed(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        history: &Arc<Float8History>,
    ) -> Result<Tensor> {
        self.check_operand_dtypes(weight, bias)?;
        let scales = Float8Linear::Delayed(Arc::clone(history));
        float8_linear(self, weight, bias, self.dtype(), &scales, None, false)
    }

    /// The public fp8 linears take operands of one dtype (autocast's path mixes them).
    fn check_operand_dtypes(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<()> {
        for tensor in [Some(weight), bias].into_iter().flatten() {
            if tensor.dtype() != self.dtype() {
                return Err(TensorError::DtypeMismatch {
                    op: "linear_float8",
                    lhs: self.dtype(),
                    rhs: tensor.dtype(),
                });
            }
        }
        Ok(())
    }
}

/// `a · b` of 2-D codes (`[m, k]`, `[k, n]`, any strides), times `a_inverse` (f32, `[]` or
/// `[m]`) along rows and `b_inverse` (`[]` or `[n]`) along columns, plus `bias` (`[n]` in
/// `dtype`) if any, returned in `dtype`: the backend's fp8 product, or the codes widened to f32
/// (exactly), multiplied with f32 accumulation, times the scales' f32 product, plus the bias in
/// f32, rounded once.
fn scaled_product(
    a: &Tensor,
    a_inverse: &Tensor,
    b: &Tensor,
    b_inverse: &Tensor,
    bias: Option<&Tensor>,
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "matmul_float8";
    let (m, n) = (a.shape()[0], b.shape()[1]);
    if matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        let out = Tensor::empty(a.backend(), &[m, n], dtype)?;
        let (a_layout, b_layout) = (
            a_inverse.layout().expand(OP, &[m])?,
            b_inverse.layout().expand(OP, &[n])?,
        );
        let fused = a.backend().matmul_float8(Float8Matmul {
            a: a.view(),
            b: b.view(),
            a_inverse_scale: View {
                layout: &a_layout,
                ..a_inverse.view()
            },
            b_inverse_scale: View {
                layout: &b_layout,
                ..b_inverse.view()
            },
            bias: bias.map(Tensor::view),
            out: out.view(),
        })?;
        if fused {
            return Ok(out);
        }
    }
    let product = a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)?;
    let alpha = match (a_inverse.ndim(), b_inverse.ndim()) {
        (0, 0) => a_inverse.mul(b_inverse)?,
        _ => a_inverse
            .reshape(&[a_inverse.numel(), 1])?
            .mul(&b_inverse.reshape(&[1, b_inverse.numel()])?)?,
    };
    let scaled = product.mul(&alpha)?;
    match bias {
        Some(bias) => scaled.add(&bias.to_dtype(DType::F32)?)?.to_dtype(dtype),
        None => scaled.to_dtype(dtype),
    }
}

/// A rowwise backward product: `grad` (`[rows, cols]`, any strides) times `fold` (the saved
/// operand's inverse scales, one a column), quantized with one scale a row, times `codes` (the
/// saved operand's codes, `[cols, n]`, whose scales are now in the gradient).
fn folded_product(
    grad: &Tensor,
    fold: &Tensor,
    codes: &Tensor,
    recipe: Float8Recipe,
    dtype: DType,
) -> Result<Tensor> {
    let folded = quantize(
        grad,
        Some(fold),
        recipe.grad_dtype,
        Float8Granularity::Rowwise,
        recipe.power_of_two_scales,
    )?;
    let one = Tensor::full(grad.backend(), &[], 1.0, DType::F32)?;
    scaled_product(
        &folded.codes,
        &folded.inverse_scale,
        codes,
        &one,
        None,
        dtype,
    )
}

/// What an fp8 linear keeps of its input for backward.
enum SavedInput {
    /// The input's codes and the reciprocals of their scales (shared with the output's rebuild
    /// recipe, if any).
    Codes(Arc<SavedTensor>, Arc<SavedTensor>),
    /// The pre-activation (and, under delayed scaling, the scale its activation was cast with).
    PreActivation(Box<(SavedTensor, Option<SavedTensor>)>),
}

/// How an fp8 linear casts its weight: with the recipe's scales, or (`given`, tensorwise) the
/// scale an earlier cast of the same weight took, in one read and to the same codes.
#[derive(Debug, Clone, Copy)]
struct WeightCast {
    granularity: Float8Granularity,
    power_of_two: bool,
}

impl WeightCast {
    fn cast(self, weight: &Tensor, given: Option<&Tensor>) -> Result<Float8Tensor> {
        let scaling = Scaling {
            granularity: self.granularity,
            power_of_two: self.power_of_two,
            premultiply: None,
            delayed: given,
            activation: None,
        };
        Ok(quantize_with(&weight.detach(), DType::F8E4M3, scaling, false)?.0)
    }
}

/// An fp8 linear's output made again (`crate::rebuild`): the product of the input codes the
/// linear keeps for its weight gradient and of its weight cast again with the forward's scale —
/// the same codes, the same GEMM, the same bytes.
struct Float8Output {
    /// The linear's own saves of its input codes and their inverse scales (whatever hooks made
    /// of them: under checkpointing they hold no bytes and unpack by recomputing).
    input_codes: Arc<SavedTensor>,
    input_inverse: Arc<SavedTensor>,
    weight: SavedTensor,
    /// The weight's forward scale, `[1]` (tensorwise only).
    weight_scale: Tensor,
    bias: Option<SavedTensor>,
    cast: WeightCast,
    output: DType,
}

impl Rebuild for Float8Output {
    fn rebuild(&self) -> Result<Tensor> {
        let weight = self
            .cast
            .cast(&self.weight.unpack()?, Some(&self.weight_scale))?;
        let bias = match &self.bias {
            Some(bias) => Some(bias.unpack()?.to_dtype(self.output)?),
            None => None,
        };
        scaled_product(
            &self.input_codes.unpack()?,
            &self.input_inverse.unpack()?,
            &weight.codes.t()?,
            &weight.inverse_scale,
            bias.as_ref(),
            self.output,
        )
    }
}

/// `dW = dYᵀ · X` of codes, in the weight's memory order: a weight that is the transpose of a
/// row-major `[in, out]` parameter (GPT-2's `Conv1D` passes `weight.t()`) gets `(Xᵀ · dY)ᵀ`, a
/// transposed view of a dense `[in, out]` product, so the gradient reaches the parameter with
/// no transposing copy.
fn weight_product(
    grad: (&Tensor, &Tensor),
    input: (&Tensor, &Tensor),
    weight: &Tensor,
) -> Result<Tensor> {
    let ((grad_codes, grad_inverse), (codes, inverse)) = (grad, input);
    let strides = weight.strides();
    let out_features = weight.shape()[0];
    if weight.ndim() == 2 && out_features > 1 && strides == [1, out_features] {
        let transposed = scaled_product(
            &codes.t()?,
            inverse,
            grad_codes,
            grad_inverse,
            None,
            weight.dtype(),
        )?;
        return transposed.t();
    }
    scaled_product(
        &grad_codes.t()?,
        grad_inverse,
        codes,
        inverse,
        None,
        weight.dtype(),
    )
}

/// [`Tensor::linear_float8_with`] of operands in any float dtypes (each quantized from its own),
/// the output in `output`: what `Tensor::linear` runs for a linear an autocast policy lists in
/// fp8, on the tensors as they come (no half-precision copy of the input or of the weight) with
/// the output in the dtype autocast would give the linear. Gradients come back in each operand's
/// dtype. Behind an `activation` (`gelu_linear`), the op saves the pre-activation alone and
/// recomputes the activation, and from it the same codes, in backward. With `rebuild_output`
/// (tensorwise, no activation), a later op that saves the output keeps a recipe instead
/// ([`Float8Output`]).
pub(super) fn float8_linear(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    output: DType,
    scales: &Float8Linear,
    activation: Option<ActivationLinear>,
    rebuild_output: bool,
) -> Result<Tensor> {
    let op = activation.map_or("linear_float8", |activation| activation.name);
    let recipe = scales.recipe();
    let history = match scales {
        Float8Linear::Current(_) => None,
        Float8Linear::Delayed(history) => Some(Arc::clone(history)),
    };
    for tensor in [Some(input), Some(weight), bias].into_iter().flatten() {
        check_float(op, tensor)?;
        if tensor.device() != input.device() {
            return Err(TensorError::DeviceMismatch {
                op,
                lhs: input.device(),
                rhs: tensor.device(),
            });
        }
    }
    if !recipe.grad_dtype.is_float8() {
        return Err(TensorError::UnsupportedDtype {
            op,
            dtype: recipe.grad_dtype,
        });
    }
    let in_features = *input.shape().last().unwrap_or(&0);
    let out_features = weight.shape().first().copied().unwrap_or(0);
    let bias_fits = bias.is_none_or(|b| b.shape() == [out_features]);
    if input.ndim() == 0 || weight.shape() != [out_features, in_features] || !bias_fits {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "input {:?}, weight {:?} and bias {:?} are not [.., in], [out, in] and [out]",
                input.shape(),
                weight.shape(),
                bias.map(|b| b.shape().to_vec())
            ),
        });
    }
    let Float8Recipe {
        granularity,
        grad_dtype,
        power_of_two_scales: power_of_two,
    } = recipe;
    let tensorwise = granularity == Float8Granularity::Tensorwise;
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
    let weight_cast = WeightCast {
        granularity,
        power_of_two,
    };
    // The input's codes, their inverse scales and (delayed scaling) their scale; the weight's.
    let (res, (input_codes, input_inverse, input_scale), weight_float8) = {
        let _grad = no_grad();
        let (input_float8, weight_float8) = match &history {
            // Current scales: a GELU linear's input cast from the pre-activation in one pass
            // (the backend applies the activation as it reads, or the core first).
            None => {
                let (codes, inverse) = match activation {
                    Some(activation) => {
                        let input_2d = input.detach().reshape(&[rows, in_features])?;
                        let scaling = Scaling {
                            granularity,
                            power_of_two,
                            premultiply: None,
                            delayed: None,
                            activation: Some(activation.op),
                        };
                        let res = quantize_with(&input_2d, DType::F8E4M3, scaling, false)?.0;
                        (res.codes, res.inverse_scale)
                    }
                    None => quantized_input(input, [rows, in_features], recipe)?,
                };
                ((codes, inverse, None), weight_cast.cast(weight, None)?)
            }
            // Delayed scales: the activation of `input`, for this product only, or `input`.
            Some(history) => {
                let source = match activation {
                    Some(activation) => input.detach().unary_raw(activation.op, activation.name)?,
                    None => input.detach(),
                };
                let input_2d = source.reshape(&[rows, in_features])?;
                let input = history.cast(Float8Role::Input, &input_2d, DType::F8E4M3)?;
                (
                    (input.codes, input.inverse_scale, Some(input.scale)),
                    history.cast(Float8Role::Weight, &weight.detach(), DType::F8E4M3)?,
                )
            }
        };
        // The bias in the output's dtype, added inside the product (one rounding).
        let bias_in_output = bias.map(|bias| bias.to_dtype(output)).transpose()?;
        let res = scaled_product(
            &input_float8.0,
            &input_float8.1,
            &weight_float8.codes.t()?,
            &weight_float8.inverse_scale,
            bias_in_output.as_ref(),
            output,
        )?;
        (res.reshape(&out_shape)?, input_float8, weight_float8)
    };
    // Backward casts the weight again with the forward's scale (tensorwise: one read, the same
    // codes, and under delayed scaling no second amax in its history).
    let weight_scale = match tensorwise {
        true => Some(weight_float8.scale.reshape(&[1])?),
        false => None,
    };
    drop(weight_float8);
    if needs_grad(&inputs) {
        let saved = match activation {
            None => SavedInput::Codes(
                Arc::new(SavedTensor::save(
                    op,
                    SaveRole::Intermediate("input_float8"),
                    &input_codes,
                )?),
                Arc::new(SavedTensor::save(
                    op,
                    SaveRole::Intermediate("input_inverse_scale"),
                    &input_inverse,
                )?),
            ),
            Some(_) => SavedInput::PreActivation(Box::new((
                SavedTensor::save(op, SaveRole::Input(0), input)?,
                input_scale
                    .as_ref()
                    .map(|scale| {
                        SavedTensor::save(op, SaveRole::Intermediate("input_scale"), scale)
                    })
                    .transpose()?,
            ))),
        };
        let saved_weight = SavedTensor::save(op, SaveRole::Input(1), weight)?;
        // Registered whatever hooks are installed: they see `SaveSite::rebuildable` and decide
        // for themselves what the output's saves become. Held by the backward until it runs
        // (and by each save of the output); it shares this op's saves of the codes, so it holds
        // no bytes a hook dropped, and the codes live no longer than this op's backward or the
        // output's saves.
        let rebuild = match (rebuild_output, &saved, &weight_scale) {
            (true, SavedInput::Codes(codes, inverse), Some(weight_scale)) => {
                // Aliases of parameters (no bytes of their own), outside the save count.
                let alias = |tensor: &Tensor| SavedTensor::alias(op, tensor);
                let recipe = Float8Output {
                    input_codes: Arc::clone(codes),
                    input_inverse: Arc::clone(inverse),
                    weight: alias(weight),
                    weight_scale: weight_scale.clone(),
                    bias: bias.map(alias),
                    cast: weight_cast,
                    output,
                };
                Some(register_rebuild(&res, Box::new(recipe)))
            }
            _ => None,
        };
        drop((input_codes, input_inverse, input_scale));
        let (input_shape, has_bias) = (input.shape().to_vec(), bias.is_some());
        let mut saved_input = Some(saved);
        record(op, &inputs, &[&res], move |grads| {
            let _rebuild = &rebuild;
            let grad = grads[0].as_ref().expect("one output");
            let grad_2d = grad.reshape(&[rows, out_features])?;
            let weight = saved_weight.unpack()?;
            let grad_bias = match bias_dtype {
                Some(bias_dtype) => Some(grad_2d.sum(&[0], false)?.to_dtype(bias_dtype)?),
                None => None,
            };
            // The weight cast again (same codes: it has not changed since the forward).
            let weight_float8 = weight_cast.cast(&weight, weight_scale.as_ref())?;
            // Tensorwise: the output gradient quantized once, for both products.
            let grad_tensorwise = match granularity {
                Float8Granularity::Tensorwise => {
                    let grad = match &history {
                        None => quantize(&grad_2d, None, grad_dtype, granularity, power_of_two)?,
                        Some(history) => {
                            history.cast(Float8Role::OutputGrad, &grad_2d, grad_dtype)?
                        }
                    };
                    Some((grad.codes, grad.inverse_scale))
                }
                Float8Granularity::Rowwise => None,
            };
            // The input's codes and their inverse scales, as saved or again from the
            // pre-activation (the same codes: the same values, cast with the same scale), and
            // the pre-activation.
            let (input_codes, pre_activation) = match &saved_input {
                Some(SavedInput::Codes(codes, inverse)) => {
                    (Some((codes.unpack()?, inverse.unpack()?)), None)
                }
                Some(SavedInput::PreActivation(saves)) => {
                    let (pre, delayed) = &**saves;
                    let activation = activation.expect("saved for an activation");
                    let pre = pre.unpack()?;
                    let pre_2d = pre.detach().reshape(&[rows, in_features])?;
                    let delayed = delayed.as_ref().map(SavedTensor::unpack).transpose()?;
                    let delayed = delayed.map(|scale| scale.reshape(&[1])).transpose()?;
                    // As the forward cast it: current scales in one pass, delayed ones from
                    // the activation (the forward's history casts take no activation).
                    let (source, activation) = match &delayed {
                        None => (pre_2d, Some(activation.op)),
                        Some(_) => (pre_2d.unary_raw(activation.op, activation.name)?, None),
                    };
                    let scaling = Scaling {
                        granularity,
                        power_of_two,
                        premultiply: None,
                        delayed: delayed.as_ref(),
                        activation,
                    };
                    let codes = quantize_with(&source, DType::F8E4M3, scaling, false)?.0;
                    (Some((codes.codes, codes.inverse_scale)), Some(pre))
                }
                None => (None, None),
            };
            // dW = dYᵀ · X, then the saved input is released on the graph's last use.
            let grad_weight = match input_codes {
                Some((codes, input_inverse)) => Some(match &grad_tensorwise {
                    Some((grad_codes, grad_inverse)) => weight_product(
                        (grad_codes, grad_inverse),
                        (&codes, &input_inverse),
                        &weight,
                    )?,
                    // dYᵀ with the input's row scales folded in, one scale per output feature,
                    // times the input's codes as saved.
                    None => folded_product(
                        &grad_2d.t()?,
                        &input_inverse,
                        &codes,
                        recipe,
                        weight.dtype(),
                    )?,
                }),
                None => None,
            };
            if is_last_use() {
                saved_input = None;
            }
            // dX = dY · W.
            let grad_input = match &grad_tensorwise {
                Some((grad_codes, grad_inverse)) => scaled_product(
                    grad_codes,
                    grad_inverse,
                    &weight_float8.codes,
                    &weight_float8.inverse_scale,
                    None,
                    dtype,
                )?,
                // dY with the weight's row scales folded in, one scale per token.
                None => folded_product(
                    &grad_2d,
                    &weight_float8.inverse_scale,
                    &weight_float8.codes,
                    recipe,
                    dtype,
                )?,
            };
            // Through the activation, written over the product that made it.
            if let (Some(activation), Some(pre)) = (activation, &pre_activation) {
                let pre = pre.reshape(&[rows, in_features])?;
                grad_input.backend().binary(
                    activation.grad_op,
                    grad_input.view(),
                    pre.view(),
                    grad_input.view(),
                )?;
            }
            let grad_input = grad_input.reshape(&input_shape)?;
            let mut res = vec![Some(grad_input), grad_weight];
            if has_bias {
                res.push(grad_bias);
            }
            Ok(res)
        });
    }
    Ok(res)
}
