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
//! The casts and products go through the backend's fp8 primitives (`quantize_float8`,
//! `matmul_float8`) where it has them; a backend without them gets tensorwise scaling composed
//! of reductions, casts and f32 products, the same values.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use crate::autocast::autocast_disabled;
use crate::backend::{Float8Granularity, Float8Matmul, Float8Quantize, View};
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::engine::is_last_use;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::{needs_grad, record};
use crate::layout::Layout;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::{Tensor, TensorImpl};

use super::check_float;
use super::index::cat;

/// The smallest amax a scale is taken against (torchao's `EPS`): an all-zero tensor scales by
/// `max_finite · 1e12` rather than dividing by zero.
const AMAX_FLOOR: f64 = 1e-12;

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

/// A tensor in an 8-bit float with its scales: it stands for `codes / scale`, the scale
/// broadcast along the last dim.
#[derive(Debug, Clone)]
pub struct Float8Tensor {
    /// The values times their scale, rounded to nearest-even in an 8-bit float, saturated.
    pub codes: Tensor,
    /// The f32 scales: shape `[]` (tensorwise), or the codes' shape less its last dim (rowwise).
    pub scale: Tensor,
}

impl Float8Tensor {
    /// The values again, `codes / scale` (computed as `codes · (1 / scale)` in f32), in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let (_grad, _autocast) = (no_grad(), autocast_disabled());
        let mut inverse = self.scale.reciprocal_f32()?;
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
        for tensor in [Some(weight), bias].into_iter().flatten() {
            if tensor.dtype() != self.dtype() {
                return Err(TensorError::DtypeMismatch {
                    op: "linear_float8",
                    lhs: self.dtype(),
                    rhs: tensor.dtype(),
                });
            }
        }
        float8_linear(self, weight, bias, self.dtype(), recipe)
    }

    /// `1 / self` in f32 (an f32 tensor's elementwise reciprocal, correctly rounded).
    fn reciprocal_f32(&self) -> Result<Tensor> {
        Tensor::full(self.backend(), &[], 1.0, DType::F32)?.div(self)
    }
}

/// Scales and codes of a 2-D `x` (`[rows, cols]`, any strides), each value first multiplied by
/// its column's `premultiply` (f32, `[]` or `[cols]`) if given: the backend's fused quantize, or
/// for tensorwise scales without a premultiplier or power-of-two rounding, reductions and casts.
/// The scale comes back as `[]` (tensorwise) or `[rows]`.
fn quantize(
    x: &Tensor,
    premultiply: Option<&Tensor>,
    dtype: DType,
    granularity: Float8Granularity,
    power_of_two: bool,
) -> Result<Float8Tensor> {
    const OP: &str = "to_float8";
    if !dtype.is_float8() {
        return Err(TensorError::UnsupportedDtype { op: OP, dtype });
    }
    let _autocast = autocast_disabled();
    let (rows, cols) = (x.shape()[0], x.shape()[1]);
    let backend = x.backend();
    let codes = Tensor::empty(backend, &[rows, cols], dtype)?;
    let scales = match granularity {
        Float8Granularity::Tensorwise => 1,
        Float8Granularity::Rowwise => rows,
    };
    let scale = Tensor::empty(backend, &[scales], DType::F32)?;
    let premultiply_layout = premultiply
        .map(|p| p.layout().expand(OP, &[cols]))
        .transpose()?;
    let fused = backend.quantize_float8(Float8Quantize {
        x: x.view(),
        premultiply: premultiply
            .zip(premultiply_layout.as_ref())
            .map(|(p, layout)| View { layout, ..p.view() }),
        granularity,
        power_of_two,
        codes: codes.view(),
        scale: scale.view(),
    })?;
    if fused {
        let scale = match granularity {
            Float8Granularity::Tensorwise => scale.reshape(&[])?,
            Float8Granularity::Rowwise => scale,
        };
        return Ok(Float8Tensor { codes, scale });
    }
    if granularity == Float8Granularity::Rowwise || premultiply.is_some() || power_of_two {
        return Err(TensorError::InvalidArgument {
            op: OP,
            reason: format!(
                "rowwise, premultiplied or power-of-two scales need the backend's fused fp8 \
                 quantize, which the {:?} backend does not have yet; use Float8Recipe::TENSORWISE \
                 there",
                x.device()
            ),
        });
    }
    composed_tensorwise(x, dtype)
}

/// Tensorwise scale and codes from reductions and casts (a backend without the fused quantize):
/// amax = max(max(x), max(−x), floor), exact in x's dtype, the two extremes alone widened to
/// f64, where torchao takes the scale.
fn composed_tensorwise(x: &Tensor, dtype: DType) -> Result<Float8Tensor> {
    let max_finite = dtype.max_finite().expect("an 8-bit float");
    let backend = x.backend();
    let flat = x.contiguous()?.reshape(&[x.numel()])?;
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
    let codes = x.to_dtype(DType::F32)?.mul(&scale)?.to_dtype(dtype)?;
    Ok(Float8Tensor { codes, scale })
}

/// `a · b` of 2-D codes (`[m, k]`, `[k, n]`, any strides), times `a_inverse` (f32, `[]` or
/// `[m]`) along rows and `b_inverse` (`[]` or `[n]`) along columns, returned in `dtype`: the
/// backend's fp8 product, or the codes widened to f32 (exactly), multiplied with f32
/// accumulation, times the scales' f32 product.
fn scaled_product(
    a: &Tensor,
    a_inverse: &Tensor,
    b: &Tensor,
    b_inverse: &Tensor,
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
    product.mul(&alpha)?.to_dtype(dtype)
}

thread_local! {
    /// The input the last fp8 linear on this thread quantized, and its codes, so the linears that
    /// read one tensor (a block's q, k and v projections) quantize it once and save one copy.
    /// Weak on every side: it keeps neither an input nor codes alive, so codes nobody saved are
    /// freed as always, and an entry whose input was dropped can never match (a live weak
    /// reference keeps its allocation from being reused by another tensor). The codes come back
    /// as views of the saved storages, contiguous as quantize wrote them.
    static LAST_INPUT: RefCell<Option<QuantizedInput>> = const { RefCell::new(None) };
}

struct QuantizedInput {
    input: Weak<TensorImpl>,
    version: u64,
    recipe: Float8Recipe,
    /// The storages of the codes and the scales (saved tensors hold their own handles on them).
    codes: Weak<Buffer>,
    scale: Weak<Buffer>,
    scale_shape: Vec<usize>,
}

/// `input` as `[rows, in]` E4M3 codes with `recipe`'s scales: the last linear's codes when it
/// quantized this very tensor, unchanged since (its version), with this recipe and the codes are
/// still alive; else quantized now and remembered.
fn quantized_input(
    input: &Tensor,
    shape: [usize; 2],
    recipe: Float8Recipe,
) -> Result<Float8Tensor> {
    let hit = LAST_INPUT.with(|last| {
        let last = last.borrow();
        let entry = last.as_ref().filter(|entry| {
            entry.input.as_ptr() == Arc::as_ptr(&input.inner)
                && entry.version == input.version()
                && entry.recipe == recipe
        })?;
        let codes = entry.codes.upgrade()?;
        let scale = entry.scale.upgrade()?;
        Some((codes, scale, entry.scale_shape.clone()))
    });
    if let Some((codes, scale, scale_shape)) = hit {
        return Ok(Float8Tensor {
            codes: Tensor::from_parts(codes, Layout::contiguous(&shape), DType::F8E4M3, true),
            scale: Tensor::from_parts(scale, Layout::contiguous(&scale_shape), DType::F32, true),
        });
    }
    let flat = input.detach().reshape(&shape)?;
    let res = quantize(
        &flat,
        None,
        DType::F8E4M3,
        recipe.granularity,
        recipe.power_of_two_scales,
    )?;
    let entry = QuantizedInput {
        input: Arc::downgrade(&input.inner),
        version: input.version(),
        recipe,
        codes: Arc::downgrade(res.codes.buffer()),
        scale: Arc::downgrade(res.scale.buffer()),
        scale_shape: res.scale.shape().to_vec(),
    };
    // The entry replaced holds only weak references: dropping it frees no tensor.
    LAST_INPUT.with(|last| last.replace(Some(entry)));
    Ok(res)
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
        &folded.scale.reciprocal_f32()?,
        codes,
        &one,
        dtype,
    )
}

/// [`Tensor::linear_float8_with`] of operands in any float dtypes (each quantized from its own),
/// the output in `output`: what `Tensor::linear` runs for a linear an autocast policy lists in
/// fp8, on the tensors as they come (no half-precision copy of the input or of the weight) with
/// the output in the dtype autocast would give the linear. Gradients come back in each operand's
/// dtype.
pub(super) fn float8_linear(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    output: DType,
    recipe: Float8Recipe,
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
    if !recipe.grad_dtype.is_float8() {
        return Err(TensorError::UnsupportedDtype {
            op: OP,
            dtype: recipe.grad_dtype,
        });
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
    let Float8Recipe {
        granularity,
        grad_dtype,
        power_of_two_scales: power_of_two,
    } = recipe;
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
    let quantize_weight = move |weight: &Tensor| {
        quantize(
            &weight.detach(),
            None,
            DType::F8E4M3,
            granularity,
            power_of_two,
        )
    };
    let (res, input_float8) = {
        let _grad = no_grad();
        let input_float8 = quantized_input(input, [rows, in_features], recipe)?;
        let weight_float8 = quantize_weight(weight)?;
        let mut res = scaled_product(
            &input_float8.codes,
            &input_float8.scale.reciprocal_f32()?,
            &weight_float8.codes.t()?,
            &weight_float8.scale.reciprocal_f32()?,
            output,
        )?;
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
            let weight = saved_weight.unpack()?;
            let grad_bias = match bias_dtype {
                Some(bias_dtype) => Some(grad_2d.sum(&[0], false)?.to_dtype(bias_dtype)?),
                None => None,
            };
            // The weight cast again (same codes: it has not changed since the forward).
            let weight_float8 = quantize_weight(&weight)?;
            let weight_inverse = weight_float8.scale.reciprocal_f32()?;
            // Tensorwise: the output gradient quantized once, for both products.
            let grad_tensorwise = match granularity {
                Float8Granularity::Tensorwise => {
                    let grad = quantize(&grad_2d, None, grad_dtype, granularity, power_of_two)?;
                    let inverse = grad.scale.reciprocal_f32()?;
                    Some((grad.codes, inverse))
                }
                Float8Granularity::Rowwise => None,
            };
            // dW = dYᵀ · X, then the saved input is released on the graph's last use.
            let grad_weight = match &saved_input {
                Some((codes, scale)) => {
                    let (codes, scale) = (codes.unpack()?, scale.unpack()?);
                    let input_inverse = scale.reciprocal_f32()?;
                    Some(match &grad_tensorwise {
                        Some((grad_codes, grad_inverse)) => scaled_product(
                            &grad_codes.t()?,
                            grad_inverse,
                            &codes,
                            &input_inverse,
                            weight.dtype(),
                        )?,
                        // dYᵀ with the input's row scales folded in, one scale per output
                        // feature, times the input's codes as saved.
                        None => folded_product(
                            &grad_2d.t()?,
                            &input_inverse,
                            &codes,
                            recipe,
                            weight.dtype(),
                        )?,
                    })
                }
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
                    &weight_inverse,
                    dtype,
                )?,
                // dY with the weight's row scales folded in, one scale per token.
                None => folded_product(
                    &grad_2d,
                    &weight_inverse,
                    &weight_float8.codes,
                    recipe,
                    dtype,
                )?,
            }
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
