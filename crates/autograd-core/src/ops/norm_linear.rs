//! A layer norm and the linear it feeds as one op that keeps only the norm's input.
//!
//! A pre-norm transformer block feeds each of its two layer norms straight into a linear (the
//! attention's q/k/v projection, the MLP's first layer). As two ops, the norm keeps its input
//! and the linear keeps the norm's output, both `[tokens, width]`, until backward.
//! [`layer_norm_linear`] keeps the input alone (with the norm's per-row mean and rstd, which the
//! norm keeps anyway) and runs the norm's forward again in backward, for the weight gradient:
//! one pass over the input, the same kernel, so the same bits. Values and gradients equal the
//! pair's bit for bit. Inside [`keep_intermediates`](crate::keep_intermediates) the op keeps the
//! norm's output as the pair does, and backward reads it.
//!
//! It sits on `ops/nn.rs`'s layer norm pieces and `linalg`'s linear pieces; it knows no model.

use crate::autocast::autocast_policy;
use crate::error::Result;
use crate::graph::record;
use crate::intermediates::are_intermediates_kept;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::linalg::{linear_product, weight_grads};
use super::nn::{layer_norm, layer_norm_forward, LayerNormRun, LayerNormSaves};
use super::records;

/// `layer_norm(input, normalized_shape, norm_weight, norm_bias, eps) @ weight^T + bias`, keeping
/// only the norm's input (and its per-row statistics) for backward, not the norm's output: the
/// norm runs again in backward for the linear's weight gradient. Values and gradients equal
/// `layer_norm(..)?.linear(weight, bias)` bit for bit, for `[rows, n]` fewer kept values.
///
/// Under autocast the op is the pair (the norm runs in f32 there and the linear on a cast copy
/// of its output, which the pair keeps).
///
/// Errors: those of [`layer_norm`] and [`Tensor::linear`] on the same operands, named
/// `layer_norm_linear`.
pub fn layer_norm_linear(
    input: &Tensor,
    normalized_shape: &[usize],
    norm_weight: Option<&Tensor>,
    norm_bias: Option<&Tensor>,
    eps: f64,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "layer_norm_linear";
    if autocast_policy().is_some() {
        return layer_norm(input, normalized_shape, norm_weight, norm_bias, eps)?
            .linear(weight, bias);
    }
    // [input, norm_weight?, norm_bias?, weight, bias?], and where each sits.
    let mut inputs = vec![input];
    inputs.extend(norm_weight);
    inputs.extend(norm_bias);
    let weight_at = inputs.len();
    inputs.push(weight);
    inputs.extend(bias);
    let norm = LayerNormRun::new(OP, input, normalized_shape, norm_weight, norm_bias, eps)?;
    // Saved before the product runs, as a linear's operands are: a recomputation that needs only
    // them (activation checkpointing's early stop) ends before the GEMM.
    let saves = if records(&inputs) {
        Some((
            LayerNormSaves::save(OP, &norm)?,
            match &norm.bias {
                Some(b) => Some(SavedTensor::save(OP, SaveRole::Input(2), b)?),
                None => None,
            },
            SavedTensor::save(OP, SaveRole::Input(3), weight)?,
            // Inside `keep_intermediates`, the norm's output is kept as the pair keeps it.
            (weight.requires_grad() && are_intermediates_kept())
                .then(|| SavedTensor::save(OP, SaveRole::Intermediate("normed"), &norm.out))
                .transpose()?,
        ))
    } else {
        None
    };
    let res = linear_product(OP, &norm.out, weight, bias)?;
    let mut out_shape = input.shape().to_vec();
    *out_shape.last_mut().expect("a norm's input has a dim") = weight.shape()[0];
    let res = res.reshape(&out_shape)?;
    let Some((norm_saves, saved_norm_bias, saved_weight, saved_normed)) = saves else {
        return Ok(res);
    };
    let norm_wants = [
        input.requires_grad(),
        norm_weight.is_some_and(Tensor::requires_grad),
        norm_bias.is_some_and(Tensor::requires_grad),
    ];
    let (weight_wants, has_bias) = (weight.requires_grad(), bias.is_some());
    let (input_shape, param_shape) = (input.shape().to_vec(), normalized_shape.to_vec());
    let (has_norm_weight, has_norm_bias) = (norm_weight.is_some(), norm_bias.is_some());
    let (rows, out_features, eps) = (norm.rows, weight.shape()[0], norm.eps);
    let n_inputs = inputs.len();
    drop(norm);
    record(OP, &inputs, &[&res], move |grads| {
        let grad = grads[0].as_ref().expect("one output");
        let grad_2d = grad.reshape(&[rows, out_features])?;
        let mut res: Vec<Option<Tensor>> = vec![None; n_inputs];
        let norm = norm_saves.unpack()?;
        if weight_wants || has_bias {
            let (grad_weight, grad_bias) = if weight_wants {
                // The norm's output kept, or again, for the weight gradient only, released
                // right after.
                let normed = match &saved_normed {
                    Some(saved) => saved.unpack()?,
                    None => {
                        let bias = saved_norm_bias
                            .as_ref()
                            .map(SavedTensor::unpack)
                            .transpose()?;
                        let [normed, _, _] =
                            layer_norm_forward(&norm.x, norm.weight.as_ref(), bias.as_ref(), eps)?;
                        normed
                    }
                };
                let (grad_weight, grad_bias) = weight_grads(&grad_2d, &normed, has_bias)?;
                (Some(grad_weight), grad_bias)
            } else {
                (None, Some(grad_2d.sum(&[0], false)?))
            };
            res[weight_at] = grad_weight;
            if has_bias {
                res[weight_at + 1] = grad_bias;
            }
        }
        if norm_wants.iter().any(|&wants| wants) {
            let grad_normed = grad_2d.matmul(&saved_weight.unpack()?)?;
            let [dx, dweight, dbias] =
                norm.grads(&grad_normed, norm_wants, &input_shape, &param_shape)?;
            res[0] = dx;
            if has_norm_weight {
                res[1] = dweight;
            }
            if has_norm_bias {
                res[1 + usize::from(has_norm_weight)] = dbias;
            }
        }
        Ok(res)
    });
    Ok(res)
}
