//! Misuse of headroom-nn: weight files with a tensor missing, extra or of another shape, garbage
//! or missing files, inputs of another shape, ViT and GPT-2 configurations that do not divide,
//! token ids out of the vocabulary, past the positions or not integers, labels of another shape.

use std::sync::Arc;

use headroom_autograd_core::{DType, Generator, Tensor, TensorError};
use headroom_nn::{
    load_file, save_file, Gpt2Config, Gpt2LMHeadModel, Linear, NnError, VisionTransformer,
    VitConfig,
};
use headroom_ops_cpu::CpuBackend;

use crate::{expect_err, temp_path, Case, Outcome};
use headroom_testkit::misuse_cases;

/// Saves `saved` to a file and loads it into `into`, removing the file.
fn load_through_file(saved: &Linear, into: &Linear, name: &str) -> Result<(), NnError> {
    let path = temp_path(name);
    save_file(saved, &path)?;
    let res = load_file(into, &path, "");
    let _ = std::fs::remove_file(&path);
    res
}

fn linear(in_features: usize, out_features: usize, bias: bool) -> Result<Linear, NnError> {
    let cpu = CpuBackend::new_ref();
    Linear::new(
        &cpu,
        in_features,
        out_features,
        bias,
        DType::F32,
        &Generator::new(0),
    )
}

fn tiny_gpt2() -> Result<Gpt2LMHeadModel, NnError> {
    let cpu = CpuBackend::new_ref();
    Gpt2LMHeadModel::new(
        &cpu,
        Gpt2Config::tiny(),
        DType::F32,
        &Arc::new(Generator::new(0)),
    )
}

/// A ViT of `config` on a CPU backend of its own.
fn vit(config: VitConfig) -> Result<VisionTransformer, NnError> {
    let cpu = CpuBackend::new_ref();
    VisionTransformer::new(&cpu, config, DType::F32, &Arc::new(Generator::new(0)))
}

pub(crate) fn cases() -> Vec<Case> {
    fn token_ids_refused(ids: &[i64], shape: &[usize]) -> Outcome {
        let model = tiny_gpt2()?;
        let cpu = model.transformer.wte.weight.backend().clone();
        let ids = Tensor::from_slice(&cpu, ids, shape)?;
        expect_err!(
            model.forward(&ids),
            NnError::Tensor(TensorError::InvalidArgument { op: "gather", .. }),
            naming "out of bounds"
        )
    }
    /// A ViT of `config` refused as an invalid configuration.
    fn vit_config_refused(config: VitConfig) -> Outcome {
        expect_err!(vit(config), NnError::InvalidConfig { .. })
    }
    misuse_cases![
        loading_weights_without_a_bias_is_missing_parameter_naming_it => {
            expect_err!(
                load_through_file(&linear(4, 2, false)?, &linear(4, 2, true)?, "nobias"),
                NnError::MissingParameter { name } if name == "bias",
                naming "bias"
            )
        },
        loading_a_weight_of_another_shape_is_parameter_shape => {
            expect_err!(
                load_through_file(&linear(4, 2, true)?, &linear(4, 3, true)?, "shape"),
                NnError::ParameterShape { name, expected, found }
                    if name == "weight" && expected == &[3, 4] && found == &[2, 4]
            )
        },
        loading_weights_with_an_extra_tensor_is_unexpected_parameter => {
            expect_err!(
                load_through_file(&linear(4, 2, true)?, &linear(4, 2, false)?, "extra"),
                NnError::UnexpectedParameter { name } if name == "bias"
            )
        },
        loading_a_file_of_garbage_is_a_safetensors_error => {
            let path = temp_path("garbage.safetensors");
            std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage")?;
            let res = load_file(&linear(4, 2, true)?, &path, "");
            let _ = std::fs::remove_file(&path);
            expect_err!(res, NnError::Safetensors(_))
        },
        loading_a_missing_file_is_io_naming_the_path => {
            let path = temp_path("does_not_exist.safetensors");
            expect_err!(
                load_file(&linear(4, 2, true)?, &path, ""),
                NnError::Io { .. },
                naming "does_not_exist"
            )
        },
        linear_on_an_input_of_another_width_is_shape_mismatch => {
            let layer = linear(4, 2, true)?;
            let x = Tensor::ones(layer.weight.backend(), &[3, 5], DType::F32)?;
            expect_err!(
                layer.forward(&x),
                NnError::Tensor(TensorError::ShapeMismatch { .. })
            )
        },
        vit_on_images_of_another_size_is_invalid_input => {
            let vit = vit(VitConfig::tiny())?;
            let cpu = vit.class_token.backend();
            let images = Tensor::zeros(cpu, &[1, 3, 48, 48], DType::F32)?;
            expect_err!(
                vit.forward(&images),
                NnError::InvalidInput { module: "VisionTransformer", .. },
                naming "[1, 3, 48, 48]"
            )
        },
        vit_whose_heads_do_not_divide_the_width_is_invalid_config =>
            vit_config_refused(VitConfig { num_heads: 5, ..VitConfig::tiny() }),
        vit_whose_patch_does_not_divide_the_image_is_invalid_config =>
            vit_config_refused(VitConfig { patch_size: 7, ..VitConfig::tiny() }),
        gpt2_with_a_token_id_at_the_vocabulary_size_is_invalid_argument =>
            token_ids_refused(&[1, 128], &[1, 2]),
        gpt2_with_a_negative_token_id_is_invalid_argument => token_ids_refused(&[1, -1], &[1, 2]),
        gpt2_longer_than_its_positions_is_invalid_input => {
            let model = tiny_gpt2()?;
            let ids = Tensor::from_slice(
                model.transformer.wte.weight.backend(),
                &[1i64; 65],
                &[1, 65],
            )?;
            expect_err!(
                model.forward(&ids),
                NnError::InvalidInput { module: "Gpt2Model", .. },
                naming "64 positions"
            )
        },
        gpt2_on_float_token_ids_is_dtype_mismatch => {
            let model = tiny_gpt2()?;
            let ids =
                Tensor::ones(model.transformer.wte.weight.backend(), &[1, 2], DType::F32)?;
            expect_err!(
                model.forward(&ids),
                NnError::Tensor(TensorError::DtypeMismatch {
                    op: "embedding",
                    lhs: DType::I64,
                    rhs: DType::F32
                })
            )
        },
        gpt2_whose_heads_do_not_divide_the_width_is_invalid_config => {
            let cpu = CpuBackend::new_ref();
            expect_err!(
                Gpt2LMHeadModel::new(
                    &cpu,
                    Gpt2Config {
                        n_head: 0,
                        ..Gpt2Config::tiny()
                    },
                    DType::F32,
                    &Arc::new(Generator::new(0)),
                ),
                NnError::InvalidConfig { .. }
            )
        },
        gpt2_loss_of_labels_of_another_shape_is_invalid_input => {
            let model = tiny_gpt2()?;
            let cpu = model.transformer.wte.weight.backend().clone();
            let logits = Tensor::zeros(&cpu, &[1, 4, 128], DType::F32)?;
            let labels = Tensor::from_slice(&cpu, &[1i64, 2, 3], &[1, 3])?;
            expect_err!(
                model.loss(&logits, &labels),
                NnError::InvalidInput {
                    module: "Gpt2LMHeadModel",
                    ..
                }
            )
        },
    ]
}
