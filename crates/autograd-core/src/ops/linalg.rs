//! Matrix products: matmul (batched, broadcasting), linear and patch embedding.
//!
//! The backend's `matmul` takes strided operands, so transposes in backward are free views.
//! `matmul` of an N-d tensor by a matrix folds the batch into the rows (one GEMM, and a weight
//! gradient without a per-batch temporary), as PyTorch does. `linear` and `linear_gelu` are one
//! `Backend::linear` call forward (bias, and GELU, in the GEMM's epilogue where the backend has
//! one) and one `Backend::linear_weight_grad` call for the weight and bias gradients backward.
//! Patch embedding (a convolution with stride = kernel) is a reshape/permute to patches followed
//! by `linear`.

use crate::autocast::{
    autocast_args, autocast_inputs, autocast_policy, autocast_target, float8_linear as float8_plan,
    float8_rebuilds_outputs, CastPolicy,
};
use crate::backend::{BinaryOp, LinearEpilogue, LinearForward, LinearWeightGrad, UnaryOp};
use crate::dtype::DType;
use crate::engine::is_last_use;
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::record;
use crate::intermediates::are_intermediates_kept;
use crate::layout::broadcast_shapes;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::elementwise::Pointwise;
use super::float8::float8_linear;
use super::{check_float, check_same, records};

impl Tensor {
    /// Matrix product with PyTorch's rules: 1-D operands are promoted, batch dims broadcast.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        if let Some([lhs, rhs]) = autocast_args("matmul", [self, other])? {
            return lhs.matmul(&rhs);
        }
        check_same("matmul", self, other)?;
        check_float("matmul", self)?;
        if self.ndim() == 0 || other.ndim() == 0 {
            return Err(TensorError::InvalidArgument {
                op: "matmul",
                reason: format!(
                    "both operands need a dim, got {:?} and {:?}",
                    self.shape(),
                    other.shape()
                ),
            });
        }
        if self.ndim() == 1 {
            return self.unsqueeze(0)?.matmul(other)?.squeeze_dim(-2);
        }
        if other.ndim() == 1 {
            return self.matmul(&other.unsqueeze(1)?)?.squeeze_dim(-1);
        }
        if self.ndim() >= 3 && other.ndim() == 2 {
            let k = self.shape()[self.ndim() - 1];
            let folded = self.reshape_inferred(&[-1, k as isize])?.matmul(other)?;
            let mut shape = self.shape().to_vec();
            *shape.last_mut().expect("ndim >= 3") = other.shape()[1];
            return folded.reshape(&shape);
        }
        self.batched_matmul(other)
    }

    /// Batched product of two operands with at least two dims each.
    fn batched_matmul(&self, other: &Tensor) -> Result<Tensor> {
        let (lhs_nd, rhs_nd) = (self.ndim(), other.ndim());
        let (m, k) = (self.shape()[lhs_nd - 2], self.shape()[lhs_nd - 1]);
        let (k2, n) = (other.shape()[rhs_nd - 2], other.shape()[rhs_nd - 1]);
        if k != k2 {
            return Err(TensorError::ShapeMismatch {
                op: "matmul",
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            });
        }
        let batch = broadcast_shapes(
            "matmul",
            &self.shape()[..lhs_nd - 2],
            &other.shape()[..rhs_nd - 2],
        )?;
        let lhs_shape: Vec<usize> = batch.iter().copied().chain([m, k]).collect();
        let rhs_shape: Vec<usize> = batch.iter().copied().chain([k, n]).collect();
        let out_shape: Vec<usize> = batch.iter().copied().chain([m, n]).collect();
        let lhs = self.alias(self.layout().expand("matmul", &lhs_shape)?);
        let rhs = other.alias(other.layout().expand("matmul", &rhs_shape)?);
        let res = self.new_empty(&out_shape, self.dtype())?;
        self.backend()
            .matmul(lhs.view(), rhs.view(), res.view(), false)?;
        if records(&[self, other]) {
            let saved_lhs = if other.requires_grad() {
                Some(SavedTensor::save("matmul", SaveRole::Input(0), self)?)
            } else {
                None
            };
            let saved_rhs = if self.requires_grad() {
                Some(SavedTensor::save("matmul", SaveRole::Input(1), other)?)
            } else {
                None
            };
            let (lhs_shape, rhs_shape) = (self.shape().to_vec(), other.shape().to_vec());
            record("matmul", &[self, other], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let grad_lhs = match &saved_rhs {
                    Some(rhs) => Some(
                        grad.matmul(&rhs.unpack()?.transpose(-1, -2)?)?
                            .sum_to(&lhs_shape)?,
                    ),
                    None => None,
                };
                let grad_rhs = match &saved_lhs {
                    Some(lhs) => Some(
                        lhs.unpack()?
                            .transpose(-1, -2)?
                            .matmul(grad)?
                            .sum_to(&rhs_shape)?,
                    ),
                    None => None,
                };
                Ok(vec![grad_lhs, grad_rhs])
            });
        }
        Ok(res)
    }

    /// `self @ weight^T + bias` over the last dim (`torch.nn.functional.linear`).
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if let Some(res) = self.linear_in_float8(weight, bias, None)? {
            return Ok(res);
        }
        if let Some(cast) = autocast_inputs("linear", &[Some(self), Some(weight), bias])? {
            let (input, weight, bias) = linear_operands(cast);
            return input.linear(&weight, bias.as_ref());
        }
        let inputs = self.linear_inputs(weight, bias);
        let saves = inputs.as_deref().map(LinearSaves::save).transpose()?;
        let (res, _) = self.linear_forward("linear", weight, bias, false)?;
        if let (Some(inputs), Some(saves)) = (inputs, saves) {
            record_linear(&inputs, saves, &res);
        }
        Ok(res)
    }

    /// `gelu(self @ weight^T + bias)` with the exact GELU (`torch.nn.GELU()`), the product, bias
    /// and activation in one backend call. Values and gradients equal
    /// `self.linear(weight, bias)?.gelu()`, and so do the saved tensors (input, weight and the
    /// pre-activation) and the graph: a `linear` node and a `gelu` node, so backward frees the
    /// activation's gradient and the pre-activation before the weight-gradient products run,
    /// exactly as the unfused pair does.
    pub fn linear_gelu(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if let Some(cast) = autocast_inputs("linear_gelu", &[Some(self), Some(weight), bias])? {
            let (input, weight, bias) = linear_operands(cast);
            return input.linear_gelu(&weight, bias.as_ref());
        }
        let inputs = self.linear_inputs(weight, bias);
        let saves = inputs.as_deref().map(LinearSaves::save).transpose()?;
        let (res, pre_activation) = self.linear_forward("linear_gelu", weight, bias, true)?;
        let pre_activation = pre_activation.expect("asked for");
        if let (Some(inputs), Some(saves)) = (inputs, saves) {
            record_linear(&inputs, saves, &pre_activation);
            pre_activation.record_pointwise(
                "gelu",
                BinaryOp::GeluBackward,
                &res,
                Pointwise::SavesInput,
            )?;
        }
        Ok(res)
    }

    /// `gelu(self) @ weight^T + bias`: the exact GELU, then a linear (torchvision's MLP from its
    /// pre-activation on), whose backward needs only `self`. Values and gradients equal
    /// `self.gelu()?.linear(weight, bias)` bit for bit, but the activation is not kept: the pair
    /// saves the pre-activation for GELU's backward and the activation for the weight gradient,
    /// this one op saves the pre-activation alone and computes the activation again (the same
    /// kernel) when backward needs it, so a block's MLP keeps `4 · width` fewer values a token
    /// for one pointwise pass in backward. Under autocast the activation runs in `self`'s dtype,
    /// as the pair's would: when the linear would cast `self`, the op is the pair.
    pub fn gelu_linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.activation_linear(ActivationLinear::GELU, weight, bias)
    }

    /// [`gelu_linear`](Tensor::gelu_linear) with GELU's tanh approximation (GPT-2's `gelu_new`
    /// before `c_proj`): equal to `self.gelu_tanh()?.linear(weight, bias)`, keeping only `self`.
    pub fn gelu_tanh_linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.activation_linear(ActivationLinear::GELU_TANH, weight, bias)
    }

    /// `activation(self) @ weight^T + bias`, saving `self` (and the weight) only.
    fn activation_linear(
        &self,
        activation: ActivationLinear,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        // In fp8, the activation and the product are one op that keeps `self` alone, as here.
        if let Some(res) = self.linear_in_float8(weight, bias, Some(activation))? {
            return Ok(res);
        }
        if let Some(policy) = autocast_policy() {
            // `None`: the linear's rule may change `self`'s dtype.
            let target = match policy.cast_policy("linear", self.device()) {
                CastPolicy::Keep => Some(self.dtype()),
                CastPolicy::LowerPrecision => Some(policy.lower_precision()),
                CastPolicy::Float32 => Some(DType::F32),
                CastPolicy::Promote => None,
            };
            let keeps_dtype = !self.dtype().is_float()
                || self.dtype() == DType::F64
                || target == Some(self.dtype());
            if !keeps_dtype {
                let activated = match activation.op {
                    UnaryOp::GeluTanh => self.gelu_tanh()?,
                    _ => self.gelu()?,
                };
                return activated.linear(weight, bias);
            }
            if let Some(cast) = autocast_inputs("linear", &[Some(self), Some(weight), bias])? {
                let (input, weight, bias) = linear_operands(cast);
                return input.activation_linear(activation, &weight, bias.as_ref());
            }
        }
        let inputs = self.linear_inputs(weight, bias);
        // Saved before anything runs, like a linear's operands: a recomputation that needs only
        // them stops before the activation and the product.
        let saved_pre_activation = match &inputs {
            Some(_) => Some(SavedTensor::save(
                activation.name,
                SaveRole::Input(0),
                self,
            )?),
            None => None,
        };
        let saved_weight = match &inputs {
            Some(_) if self.requires_grad() => Some(SavedTensor::save(
                activation.name,
                SaveRole::Input(1),
                weight,
            )?),
            _ => None,
        };
        let activated = self.unary_raw(activation.op, activation.name)?;
        // Inside `keep_intermediates`, the activation is kept as the pair keeps it.
        let saved_activated =
            (inputs.is_some() && weight.requires_grad() && are_intermediates_kept())
                .then(|| {
                    SavedTensor::save(
                        activation.name,
                        SaveRole::Intermediate("activation"),
                        &activated,
                    )
                })
                .transpose()?;
        let (res, _) = activated.linear_forward(activation.name, weight, bias, false)?;
        drop(activated);
        let (Some(inputs), Some(saved_pre_activation)) = (inputs, saved_pre_activation) else {
            return Ok(res);
        };
        let mut saved_pre_activation = Some(saved_pre_activation);
        let input_shape = self.shape().to_vec();
        let (out_features, in_features) = (weight.shape()[0], weight.shape()[1]);
        let rows = self.numel() / in_features.max(1);
        let has_bias = inputs.len() == 3;
        let weight_needs_grad = weight.requires_grad();
        record(activation.name, &inputs, &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let grad_2d = grad.reshape(&[rows, out_features])?;
            let pre_activation = saved_pre_activation
                .as_ref()
                .expect("kept until its last use")
                .unpack()?;
            let (grad_weight, grad_bias) = if weight_needs_grad {
                // The activation kept, or again, for the weight gradient only, released right
                // after.
                let activated = match &saved_activated {
                    Some(saved) => saved.unpack()?,
                    None => pre_activation.unary_raw(activation.op, activation.name)?,
                }
                .reshape(&[rows, in_features])?;
                let (grad_weight, grad_bias) = weight_grads(&grad_2d, &activated, has_bias)?;
                (Some(grad_weight), grad_bias)
            } else if has_bias {
                (None, Some(grad_2d.sum(&[0], false)?))
            } else {
                (None, None)
            };
            let grad_input = match &saved_weight {
                Some(weight) => {
                    // The activation's gradient, written over the product that made it.
                    let grad_activated = grad_2d.matmul(&weight.unpack()?)?;
                    let pre_activation = pre_activation.reshape(&[rows, in_features])?;
                    grad_activated.backend().binary(
                        activation.grad_op,
                        grad_activated.view(),
                        pre_activation.view(),
                        grad_activated.view(),
                    )?;
                    Some(grad_activated.reshape(&input_shape)?)
                }
                None => None,
            };
            drop(pre_activation);
            if is_last_use() {
                saved_pre_activation = None;
            }
            let mut res = vec![grad_input, grad_weight];
            if has_bias {
                res.push(grad_bias);
            }
            Ok(res)
        });
        Ok(res)
    }

    /// The linear (behind `activation`, if given) in fp8 when the autocast policy lists `weight`:
    /// quantized from the tensors as they come (no half copy of the input or the weight), its
    /// output in the dtype autocast gives a linear; `None` when it is not listed.
    fn linear_in_float8(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        activation: Option<ActivationLinear>,
    ) -> Result<Option<Tensor>> {
        let Some(scales) = float8_plan(weight) else {
            return Ok(None);
        };
        let output = match autocast_target("linear", &[Some(self), Some(weight), bias]) {
            Some(target) if self.dtype() != DType::F64 => target,
            _ => self.dtype(),
        };
        let rebuilds = float8_rebuilds_outputs();
        float8_linear(self, weight, bias, output, &scales, activation, rebuilds).map(Some)
    }

    /// The operands of a linear when it records, else `None`.
    fn linear_inputs<'a>(
        &'a self,
        weight: &'a Tensor,
        bias: Option<&'a Tensor>,
    ) -> Option<Vec<&'a Tensor>> {
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        records(&inputs).then_some(inputs)
    }

    /// Checks the operands and runs [`Backend::linear`](crate::Backend::linear): the result
    /// and, with `gelu`, the pre-activation, both shaped like `self` with `out` features last.
    fn linear_forward(
        &self,
        op: &'static str,
        weight: &Tensor,
        bias: Option<&Tensor>,
        gelu: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        check_same(op, self, weight)?;
        check_float(op, self)?;
        let in_features = *self.shape().last().unwrap_or(&0);
        if self.ndim() == 0 || weight.ndim() != 2 || weight.shape()[1] != in_features {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: self.shape().to_vec(),
                rhs: weight.shape().to_vec(),
            });
        }
        let out_features = weight.shape()[0];
        if let Some(bias) = bias {
            check_same(op, self, bias)?;
            if bias.shape() != [out_features] {
                return Err(TensorError::ShapeMismatch {
                    op,
                    lhs: weight.shape().to_vec(),
                    rhs: bias.shape().to_vec(),
                });
            }
        }
        let rows = self.numel() / in_features.max(1);
        let input_2d = {
            let _guard = no_grad();
            self.reshape(&[rows, in_features])?
        };
        // The pre-activation first: the unfused pair allocates the linear's output first.
        let pre_activation = if gelu {
            Some(self.new_empty(&[rows, out_features], self.dtype())?)
        } else {
            None
        };
        let res = self.new_empty(&[rows, out_features], self.dtype())?;
        let epilogue = match &pre_activation {
            Some(pre_activation) => LinearEpilogue::Gelu {
                pre_activation: pre_activation.view(),
            },
            None => LinearEpilogue::None,
        };
        self.backend().linear(LinearForward {
            input: input_2d.view(),
            weight: weight.view(),
            bias: bias.map(Tensor::view),
            epilogue,
            out: res.view(),
        })?;
        let mut out_shape = self.shape().to_vec();
        *out_shape.last_mut().expect("ndim >= 1") = out_features;
        Ok((
            res.into_shape(&out_shape),
            pre_activation.map(|pre_activation| pre_activation.into_shape(&out_shape)),
        ))
    }
}

/// The activation of [`Tensor::gelu_linear`] and its kin: the op's name, the activation and its
/// backward (`grad_op(grad, pre_activation)`).
#[derive(Debug, Clone, Copy)]
pub(super) struct ActivationLinear {
    pub(super) name: &'static str,
    pub(super) op: UnaryOp,
    pub(super) grad_op: BinaryOp,
}

impl ActivationLinear {
    const GELU: ActivationLinear = ActivationLinear {
        name: "gelu_linear",
        op: UnaryOp::Gelu,
        grad_op: BinaryOp::GeluBackward,
    };
    const GELU_TANH: ActivationLinear = ActivationLinear {
        name: "gelu_tanh_linear",
        op: UnaryOp::GeluTanh,
        grad_op: BinaryOp::GeluTanhBackward,
    };
}

/// The (input, weight, optional bias) of a linear op as autocast returned them.
pub(super) fn linear_operands(cast: Vec<Option<Tensor>>) -> (Tensor, Tensor, Option<Tensor>) {
    let mut cast = cast.into_iter();
    let mut next = || cast.next().flatten();
    let input = next().expect("the input was given");
    let weight = next().expect("the weight was given");
    (input, weight, next())
}

/// What a linear's backward keeps: the input (for the weight gradient) and the weight (for the
/// input gradient). They are saved before the product runs, so a recomputation that needs only
/// them (activation checkpointing's early stop) ends before the GEMM.
struct LinearSaves {
    input: Option<SavedTensor>,
    weight: Option<SavedTensor>,
}

impl LinearSaves {
    /// Saves what the backward of the linear over `inputs` (input, weight, bias if any) needs.
    fn save(inputs: &[&Tensor]) -> Result<LinearSaves> {
        let (input, weight) = (inputs[0], inputs[1]);
        Ok(LinearSaves {
            input: if weight.requires_grad() {
                Some(SavedTensor::save("linear", SaveRole::Input(0), input)?)
            } else {
                None
            },
            weight: if input.requires_grad() {
                Some(SavedTensor::save("linear", SaveRole::Input(1), weight)?)
            } else {
                None
            },
        })
    }
}

/// `input @ weight^T + bias` over the last dim with nothing recorded (errors name `op`): the
/// product of a fused op that records its own node.
pub(super) fn linear_product(
    op: &'static str,
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    Ok(input.linear_forward(op, weight, bias, false)?.0)
}

/// A linear's weight gradient `grad_2d^T @ input_2d` (`[out, in]`) and, with `has_bias`, its bias
/// gradient (the column sums of `grad_2d`), in one
/// [`Backend::linear_weight_grad`](crate::Backend::linear_weight_grad) call.
pub(super) fn weight_grads(
    grad_2d: &Tensor,
    input_2d: &Tensor,
    has_bias: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (out_features, in_features) = (grad_2d.shape()[1], input_2d.shape()[1]);
    let dtype = grad_2d.dtype();
    let grad_weight = grad_2d.new_empty(&[out_features, in_features], dtype)?;
    let grad_bias = if has_bias {
        Some(grad_2d.new_empty(&[out_features], dtype)?)
    } else {
        None
    };
    grad_2d.backend().linear_weight_grad(LinearWeightGrad {
        grad_out: grad_2d.view(),
        input: input_2d.view(),
        grad_weight: grad_weight.view(),
        grad_bias: grad_bias.as_ref().map(Tensor::view),
    })?;
    Ok((grad_weight, grad_bias))
}

/// Records the linear node `inputs` (input, weight, bias if any) → `res`. Backward: the input
/// gradient is one product, the weight and bias gradients one
/// [`Backend::linear_weight_grad`](crate::Backend::linear_weight_grad) call.
fn record_linear(inputs: &[&Tensor], saves: LinearSaves, res: &Tensor) {
    let (input, weight) = (inputs[0], inputs[1]);
    let has_bias = inputs.len() == 3;
    let LinearSaves {
        input: mut saved_input,
        weight: saved_weight,
    } = saves;
    let input_shape = input.shape().to_vec();
    let (out_features, in_features) = (weight.shape()[0], weight.shape()[1]);
    let rows = input.numel() / in_features.max(1);
    record("linear", inputs, &[res], move |grads| {
        let grad = grads[0].as_ref().expect("one output");
        let grad_2d = grad.reshape(&[rows, out_features])?;
        // The weight and bias gradients first: on the graph's last use the saved input is then
        // released before the input gradient is allocated (for an MLP's second layer at ViT-L/16
        // batch 32, a [batch · seq, 4 · width] buffer less at the start of backward, its peak).
        let (grad_weight, grad_bias) = match &saved_input {
            Some(input) => {
                let input_2d = input.unpack()?.reshape(&[rows, in_features])?;
                let (grad_weight, grad_bias) = weight_grads(&grad_2d, &input_2d, has_bias)?;
                (Some(grad_weight), grad_bias)
            }
            None if has_bias => (None, Some(grad_2d.sum(&[0], false)?)),
            None => (None, None),
        };
        if is_last_use() {
            saved_input = None;
        }
        let grad_input = match &saved_weight {
            Some(weight) => Some(grad_2d.matmul(&weight.unpack()?)?.reshape(&input_shape)?),
            None => None,
        };
        let mut res = vec![grad_input, grad_weight];
        if has_bias {
            res.push(grad_bias);
        }
        Ok(res)
    });
}

/// A convolution whose stride equals its kernel (ViT's patch embedding): `input` is
/// `[batch, channels, height, width]`, `weight` `[out, channels, patch, patch]`; the result is
/// `[batch, out, height / patch, width / patch]`, as `conv2d` returns it.
pub fn patch_embedding(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    patch: usize,
) -> Result<Tensor> {
    if let Some(cast) = autocast_inputs("patch_embedding", &[Some(input), Some(weight), bias])? {
        let (input, weight, bias) = linear_operands(cast);
        return patch_embedding(&input, &weight, bias.as_ref(), patch);
    }
    let [batch, channels, height, width] = *input.shape() else {
        return Err(TensorError::InvalidArgument {
            op: "patch_embedding",
            reason: format!(
                "input must be [batch, channels, height, width], got {:?}",
                input.shape()
            ),
        });
    };
    let [out, weight_channels, kh, kw] = *weight.shape() else {
        return Err(TensorError::InvalidArgument {
            op: "patch_embedding",
            reason: format!(
                "weight must be [out, channels, patch, patch], got {:?}",
                weight.shape()
            ),
        });
    };
    if weight_channels != channels
        || kh != patch
        || kw != patch
        || patch == 0
        || height % patch != 0
        || width % patch != 0
    {
        return Err(TensorError::ShapeMismatch {
            op: "patch_embedding",
            lhs: input.shape().to_vec(),
            rhs: weight.shape().to_vec(),
        });
    }
    let (rows, cols) = (height / patch, width / patch);
    let patches_of = move |image: &Tensor| {
        image
            .reshape(&[batch, channels, rows, patch, cols, patch])?
            .permute(&[0, 2, 4, 1, 3, 5])?
            .reshape(&[batch * rows * cols, channels * patch * patch])
    };
    let flat_weight = weight.reshape(&[out, channels * patch * patch])?;
    let product = if input.requires_grad() {
        patches_of(input)?.linear(&flat_weight, bias)?
    } else {
        patch_product_saving_the_image(input, &flat_weight, bias, patches_of)?
    };
    product
        .reshape(&[batch, rows, cols, out])?
        .permute(&[0, 3, 1, 2])
}

/// The patch product `patches_of(image) @ weight^T + bias` for an image that needs no gradient.
/// The linear it stands for would save the patch copy of the image, as large as the image and
/// alive from the start of the forward to the end of backward; this saves the image itself
/// (which its caller holds anyway) and builds the copy again, for the weight gradient only,
/// when backward reaches it. Values and gradients are the linear's.
fn patch_product_saving_the_image(
    image: &Tensor,
    flat_weight: &Tensor,
    bias: Option<&Tensor>,
    patches_of: impl Fn(&Tensor) -> Result<Tensor> + Send + 'static,
) -> Result<Tensor> {
    let mut inputs = vec![flat_weight];
    inputs.extend(bias);
    if !records(&inputs) {
        return patches_of(image)?.linear(flat_weight, bias);
    }
    let mut saved_image = Some(SavedTensor::save(
        "patch_embedding",
        SaveRole::Input(0),
        image,
    )?);
    let res = {
        let _no_grad = no_grad();
        patches_of(image)?.linear(flat_weight, bias)?
    };
    let out_features = flat_weight.shape()[0];
    let rows = res.numel() / out_features.max(1);
    let has_bias = bias.is_some();
    record("patch_embedding", &inputs, &[&res], move |grads| {
        let grad = grads[0].as_ref().expect("one output");
        let grad_2d = grad.reshape(&[rows, out_features])?;
        let image = saved_image
            .as_ref()
            .ok_or(TensorError::GraphFreed {
                op: "patch_embedding",
            })?
            .unpack()?;
        let patches = {
            let _no_grad = no_grad();
            patches_of(&image)?
        };
        drop(image);
        if is_last_use() {
            saved_image = None;
        }
        let (grad_weight, grad_bias) = weight_grads(&grad_2d, &patches, has_bias)?;
        let mut res = vec![Some(grad_weight)];
        if has_bias {
            res.push(grad_bias);
        }
        Ok(res)
    });
    Ok(res)
}
