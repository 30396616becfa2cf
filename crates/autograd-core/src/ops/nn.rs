//! Neural-network ops with fused kernels: softmax, log-softmax, layer norm, cross-entropy and
//! dropout.
//!
//! Each is one backend primitive forward and one backward, because composing them from
//! elementwise ops and reductions would cost extra memory passes and extra saved tensors:
//! softmax saves only its output, layer norm saves the input plus a mean and an rstd per row,
//! cross-entropy saves one log-sum-exp per row, dropout saves a one-byte mask.

use crate::autocast::{autocast_args, autocast_inputs};
use crate::backend::{
    CrossEntropyArgs, CrossEntropyBackward, CrossEntropyForward, DropoutDraw, LayerNormBackward,
    LayerNormForward, MaskedOp, Reduction, SoftmaxBackward,
};
use crate::dtype::{stats_dtype, DType};
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::record;
use crate::layout::normalize_dim;
use crate::random::Generator;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::{check_dtype, check_float, check_same, records};

impl Tensor {
    fn softmax_impl(&self, dim: isize, log: bool) -> Result<Tensor> {
        let name = if log { "log_softmax" } else { "softmax" };
        if let Some([input]) = autocast_args(name, [self])? {
            return input.softmax_impl(dim, log);
        }
        check_float(name, self)?;
        let dim = normalize_dim(name, dim, self.ndim())?;
        let res = self.new_empty(self.shape(), self.dtype())?;
        self.backend().softmax(self.view(), dim, log, res.view())?;
        if records(&[self]) {
            let saved = SavedTensor::save(name, SaveRole::Output(0), &res)?;
            record(name, &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let output = saved.unpack()?;
                let dx = grad.new_empty(grad.shape(), grad.dtype())?;
                grad.backend().softmax_backward(SoftmaxBackward {
                    y: output.view(),
                    dy: grad.view(),
                    dim,
                    log,
                    dx: dx.view(),
                })?;
                Ok(vec![Some(dx)])
            });
        }
        Ok(res)
    }

    /// Softmax along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }

    /// `mask ? value : self`, with `mask` (Bool or U8) broadcast to this tensor's shape.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        if let Some([input]) = autocast_args("masked_fill", [self])? {
            return input.masked_fill(mask, value);
        }
        check_float("masked_fill", self)?;
        if !matches!(mask.dtype(), DType::Bool | DType::U8) {
            return Err(TensorError::UnsupportedDtype {
                op: "masked_fill",
                dtype: mask.dtype(),
            });
        }
        let mask = mask.alias(mask.layout().expand("masked_fill", self.shape())?);
        let res = self.new_empty(self.shape(), self.dtype())?;
        self.backend()
            .masked(MaskedOp::Fill(value), self.view(), mask.view(), res.view())?;
        if records(&[self]) {
            let saved_mask = SavedTensor::save("masked_fill", SaveRole::Input(1), &mask)?;
            record("masked_fill", &[self], &[&res], move |grads| {
                let grad = grads[0].as_ref().expect("one output");
                let mask = saved_mask.unpack()?;
                let dx = grad.new_empty(grad.shape(), grad.dtype())?;
                grad.backend()
                    .masked(MaskedOp::Fill(0.0), grad.view(), mask.view(), dx.view())?;
                Ok(vec![Some(dx)])
            });
        }
        Ok(res)
    }
}

/// Layer normalisation over the trailing `normalized_shape` dims, with optional affine
/// parameters of that shape (`torch.nn.functional.layer_norm`).
pub fn layer_norm(
    input: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    if let Some(cast) = autocast_inputs("layer_norm", &[Some(input), weight, bias])? {
        let mut cast = cast.into_iter();
        let input = cast.next().flatten().expect("the input was given");
        let (weight, bias) = (cast.next().flatten(), cast.next().flatten());
        return layer_norm(
            &input,
            normalized_shape,
            weight.as_ref(),
            bias.as_ref(),
            eps,
        );
    }
    let norm = LayerNormRun::new("layer_norm", input, normalized_shape, weight, bias, eps)?;
    let res = norm.out.clone().into_shape(input.shape());
    let mut inputs = vec![input];
    inputs.extend(weight);
    inputs.extend(bias);
    if records(&inputs) {
        let saves = LayerNormSaves::save("layer_norm", &norm)?;
        let wants = [
            input.requires_grad(),
            weight.is_some_and(Tensor::requires_grad),
            bias.is_some_and(Tensor::requires_grad),
        ];
        let (input_shape, param_shape) = (input.shape().to_vec(), normalized_shape.to_vec());
        let (has_weight, has_bias) = (weight.is_some(), bias.is_some());
        let (rows, n) = (norm.rows, norm.n);
        record("layer_norm", &inputs, &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let dy = grad.contiguous()?.reshape(&[rows, n])?;
            let [dx, dweight, dbias] =
                saves
                    .unpack()?
                    .grads(&dy, wants, &input_shape, &param_shape)?;
            let mut res = vec![dx];
            if has_weight {
                res.push(dweight);
            }
            if has_bias {
                res.push(dbias);
            }
            Ok(res)
        });
    }
    Ok(res)
}

/// A layer norm's checked operands, flattened to `[rows, n]` and `[n]`, and its forward: the
/// output `[rows, n]` and the per-row mean and rstd.
pub(super) struct LayerNormRun {
    pub(super) dense: Tensor,
    pub(super) weight: Option<Tensor>,
    pub(super) bias: Option<Tensor>,
    pub(super) eps: f64,
    pub(super) out: Tensor,
    pub(super) mean: Tensor,
    pub(super) rstd: Tensor,
    pub(super) rows: usize,
    pub(super) n: usize,
}

impl LayerNormRun {
    /// Checks the operands (errors name `op`) and runs the forward.
    pub(super) fn new(
        op: &'static str,
        input: &Tensor,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<LayerNormRun> {
        check_float(op, input)?;
        let ndim = input.ndim();
        if normalized_shape.is_empty()
            || normalized_shape.len() > ndim
            || input.shape()[ndim - normalized_shape.len()..] != *normalized_shape
        {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: input.shape().to_vec(),
                rhs: normalized_shape.to_vec(),
            });
        }
        for param in weight.iter().chain(bias.iter()) {
            check_same(op, input, param)?;
            if param.shape() != normalized_shape {
                return Err(TensorError::ShapeMismatch {
                    op,
                    lhs: normalized_shape.to_vec(),
                    rhs: param.shape().to_vec(),
                });
            }
        }
        let n: usize = normalized_shape.iter().product();
        let rows = input.numel() / n.max(1);
        let dense = {
            let _guard = no_grad();
            input.contiguous()?.reshape(&[rows, n])?
        };
        let flatten = |param: Option<&Tensor>| -> Result<Option<Tensor>> {
            let _guard = no_grad();
            param.map(|p| p.contiguous()?.reshape(&[n])).transpose()
        };
        let (weight, bias) = (flatten(weight)?, flatten(bias)?);
        let [out, mean, rstd] = layer_norm_forward(&dense, weight.as_ref(), bias.as_ref(), eps)?;
        Ok(LayerNormRun {
            dense,
            weight,
            bias,
            eps,
            out,
            mean,
            rstd,
            rows,
            n,
        })
    }
}

/// `[out, mean, rstd]` of the layer norm of `dense` (`[rows, n]`) with flat parameters: one
/// [`Backend::layer_norm`](crate::Backend::layer_norm) call, whose output is the same bits
/// every time it runs on the same operands.
pub(super) fn layer_norm_forward(
    dense: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<[Tensor; 3]> {
    let rows = dense.shape()[0];
    let stats = stats_dtype(dense.dtype());
    let out = dense.new_empty(dense.shape(), dense.dtype())?;
    let mean = dense.new_empty(&[rows], stats)?;
    let rstd = dense.new_empty(&[rows], stats)?;
    dense.backend().layer_norm(LayerNormForward {
        x: dense.view(),
        weight: weight.map(Tensor::view),
        bias: bias.map(Tensor::view),
        eps,
        out: out.view(),
        mean: mean.view(),
        rstd: rstd.view(),
    })?;
    Ok([out, mean, rstd])
}

/// What a layer norm's backward keeps: the dense input, the per-row mean and rstd, the flat
/// weight.
pub(super) struct LayerNormSaves {
    x: SavedTensor,
    mean: SavedTensor,
    rstd: SavedTensor,
    weight: Option<SavedTensor>,
}

impl LayerNormSaves {
    /// Saves them from `norm`, as `op`'s.
    pub(super) fn save(op: &'static str, norm: &LayerNormRun) -> Result<LayerNormSaves> {
        Ok(LayerNormSaves {
            x: SavedTensor::save(op, SaveRole::Input(0), &norm.dense)?,
            mean: SavedTensor::save(op, SaveRole::Intermediate("mean"), &norm.mean)?,
            rstd: SavedTensor::save(op, SaveRole::Intermediate("rstd"), &norm.rstd)?,
            weight: match &norm.weight {
                Some(w) => Some(SavedTensor::save(op, SaveRole::Input(1), w)?),
                None => None,
            },
        })
    }

    /// What was saved, unpacked: each saved tensor is unpacked once a backward (a checkpoint's
    /// recomputation rebuilds what is unpacked twice).
    pub(super) fn unpack(&self) -> Result<LayerNormSaved> {
        Ok(LayerNormSaved {
            x: self.x.unpack()?,
            mean: self.mean.unpack()?,
            rstd: self.rstd.unpack()?,
            weight: self.weight.as_ref().map(SavedTensor::unpack).transpose()?,
        })
    }
}

/// A layer norm's saves, unpacked.
pub(super) struct LayerNormSaved {
    /// The dense input, `[rows, n]`.
    pub(super) x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    /// The flat weight.
    pub(super) weight: Option<Tensor>,
}

impl LayerNormSaved {
    /// `[dx, dweight, dbias]` from the output gradient `dy` (`[rows, n]`), each where `wants`
    /// asks and the parameter exists, shaped `input_shape` and `param_shape`.
    pub(super) fn grads(
        &self,
        dy: &Tensor,
        wants: [bool; 3],
        input_shape: &[usize],
        param_shape: &[usize],
    ) -> Result<[Option<Tensor>; 3]> {
        let x = &self.x;
        let (rows, n) = (x.shape()[0], x.shape()[1]);
        let dx = if wants[0] {
            Some(x.new_empty(&[rows, n], x.dtype())?)
        } else {
            None
        };
        let dweight = if wants[1] {
            Some(x.new_empty(&[n], x.dtype())?)
        } else {
            None
        };
        let dbias = if wants[2] {
            Some(x.new_empty(&[n], x.dtype())?)
        } else {
            None
        };
        x.backend().layer_norm_backward(LayerNormBackward {
            dy: dy.view(),
            x: x.view(),
            mean: self.mean.view(),
            rstd: self.rstd.view(),
            weight: self.weight.as_ref().map(Tensor::view),
            dx: dx.as_ref().map(Tensor::view),
            dweight: dweight.as_ref().map(Tensor::view),
            dbias: dbias.as_ref().map(Tensor::view),
        })?;
        Ok([
            dx.map(|dx| dx.into_shape(input_shape)),
            dweight.map(|dw| dw.into_shape(param_shape)),
            dbias.map(|db| db.into_shape(param_shape)),
        ])
    }
}

/// Cross-entropy of `logits` `[rows, classes]` against class indices `target` `[rows]` (I64):
/// log-softmax and negative log-likelihood fused, samples whose target is `ignore_index` skipped.
pub fn cross_entropy(
    logits: &Tensor,
    target: &Tensor,
    ignore_index: i64,
    reduction: Reduction,
) -> Result<Tensor> {
    if let Some([logits]) = autocast_args("cross_entropy", [logits])? {
        return cross_entropy(&logits, target, ignore_index, reduction);
    }
    check_float("cross_entropy", logits)?;
    fused_cross_entropy(logits, target, ignore_index, reduction, logits.dtype())
}

/// `cross_entropy(&logits.to_dtype(F32)?, ..)` — the loss of logits upcast to f32, as Hugging
/// Face's causal-LM loss takes it — without the f32 copy of the logits: f16 and bf16 logits are
/// read as they are (the kernels compute in f32 either way, so the upcast is exact), the loss is
/// f32, and the logits' gradient is written once in their dtype (the rounding the cast's
/// backward applies). Other dtypes are upcast (or cast) to f32 first.
pub fn cross_entropy_f32(
    logits: &Tensor,
    target: &Tensor,
    ignore_index: i64,
    reduction: Reduction,
) -> Result<Tensor> {
    if let Some([logits]) = autocast_args("cross_entropy", [logits])? {
        return cross_entropy_f32(&logits, target, ignore_index, reduction);
    }
    check_float("cross_entropy", logits)?;
    match logits.dtype() {
        DType::F16 | DType::BF16 => {
            fused_cross_entropy(logits, target, ignore_index, reduction, DType::F32)
        }
        DType::F32 => cross_entropy(logits, target, ignore_index, reduction),
        _ => cross_entropy(
            &logits.to_dtype(DType::F32)?,
            target,
            ignore_index,
            reduction,
        ),
    }
}

/// The fused cross-entropy with its loss in `loss_dtype` (the logits' dtype, or f32 for f16 and
/// bf16 logits).
fn fused_cross_entropy(
    logits: &Tensor,
    target: &Tensor,
    ignore_index: i64,
    reduction: Reduction,
    loss_dtype: DType,
) -> Result<Tensor> {
    check_dtype("cross_entropy", target, DType::I64)?;
    if logits.ndim() != 2 || target.shape() != [logits.shape()[0]] {
        return Err(TensorError::ShapeMismatch {
            op: "cross_entropy",
            lhs: logits.shape().to_vec(),
            rhs: target.shape().to_vec(),
        });
    }
    let (dense, target) = {
        let _guard = no_grad();
        (logits.contiguous()?, target.contiguous()?)
    };
    let rows = logits.shape()[0];
    let loss = logits.new_empty(&[], loss_dtype)?;
    let lse = logits.new_empty(&[rows], stats_dtype(logits.dtype()))?;
    let input = CrossEntropyArgs {
        logits: dense.view(),
        target: target.view(),
        ignore_index,
        reduction,
    };
    logits.backend().cross_entropy(CrossEntropyForward {
        input,
        loss: loss.view(),
        lse: lse.view(),
    })?;
    if records(&[logits]) {
        let saved_logits = SavedTensor::save("cross_entropy", SaveRole::Input(0), &dense)?;
        let saved_target = SavedTensor::save("cross_entropy", SaveRole::Input(1), &target)?;
        let saved_lse = SavedTensor::save("cross_entropy", SaveRole::Intermediate("lse"), &lse)?;
        record("cross_entropy", &[logits], &[&loss], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let (logits, target, lse) = (
                saved_logits.unpack()?,
                saved_target.unpack()?,
                saved_lse.unpack()?,
            );
            let dlogits = logits.new_empty(logits.shape(), logits.dtype())?;
            let input = CrossEntropyArgs {
                logits: logits.view(),
                target: target.view(),
                ignore_index,
                reduction,
            };
            logits
                .backend()
                .cross_entropy_backward(CrossEntropyBackward {
                    input,
                    lse: lse.view(),
                    dloss: grad.view(),
                    dlogits: dlogits.view(),
                })?;
            Ok(vec![Some(dlogits)])
        });
    }
    Ok(loss)
}

/// Dropout: in training, zeroes each element with probability `p` (drawn from `generator`) and
/// scales the rest by `1 / (1 - p)`; otherwise returns `input` unchanged.
pub fn dropout(input: &Tensor, p: f64, training: bool, generator: &Generator) -> Result<Tensor> {
    if let Some([input]) = autocast_args("dropout", [input])? {
        return dropout(&input, p, training, generator);
    }
    check_float("dropout", input)?;
    if !(0.0..=1.0).contains(&p) {
        return Err(TensorError::InvalidArgument {
            op: "dropout",
            reason: format!("probability {p} is outside [0, 1]"),
        });
    }
    if !training || p == 0.0 {
        return Ok(input.clone());
    }
    let (seed, offset) = generator.advance(input.numel() as u64);
    let res = input.new_empty(input.shape(), input.dtype())?;
    let mask = input.new_empty(input.shape(), DType::Bool)?;
    let draw = DropoutDraw { p, seed, offset };
    input
        .backend()
        .dropout(input.view(), draw, res.view(), mask.view())?;
    if records(&[input]) {
        let saved_mask = SavedTensor::save("dropout", SaveRole::Intermediate("mask"), &mask)?;
        let scale = draw.scale();
        record("dropout", &[input], &[&res], move |grads| {
            let grad = grads[0].as_ref().expect("one output");
            let mask = saved_mask.unpack()?;
            let dx = grad.new_empty(grad.shape(), grad.dtype())?;
            grad.backend()
                .masked(MaskedOp::Scale(scale), grad.view(), mask.view(), dx.view())?;
            Ok(vec![Some(dx)])
        });
    }
    Ok(res)
}
