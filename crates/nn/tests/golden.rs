//! ViT-tiny and GPT-2-tiny in float64 against PyTorch: logits, loss and the gradient of every
//! parameter, from `testdata/models_golden.safetensors` (provenance in `testdata/README.md`).
//!
//! Errors are measured per tensor as `max |ours - theirs| / max |theirs|` (an elementwise ratio
//! is meaningless for entries that are zero up to rounding). ViT must agree to 1e-10; GPT-2 to
//! 1e-5, because Hugging Face computes its loss from logits upcast to float32, so its loss and
//! every gradient carry float32 rounding. Run with `--nocapture` to see the measured errors.
//! The run and the comparison are testkit's `golden` module, shared with ops-cuda's float32 test
//! on the GPU.

use std::sync::Arc;

use headroom_autograd_core::{DType, Generator};
use headroom_nn::{load_weights, Module, NnError, VisionTransformer, VitConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::golden::{self, GoldenModel};
use safetensors::SafeTensors;

/// The golden file's parameter names under `prefix`, in file order (sorted by name).
fn golden_names(golden: &SafeTensors<'_>, prefix: &str) -> Vec<String> {
    let mut res: Vec<String> = golden
        .names()
        .into_iter()
        .filter_map(|name| name.strip_prefix(prefix).map(str::to_owned))
        .collect();
    res.sort();
    res
}

#[test]
fn vit_tiny_matches_torchvision_in_float64() {
    let bytes = golden::models_golden();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let cpu = CpuBackend::new_ref();
    let model = GoldenModel::VitTiny.build(&cpu, DType::F64).unwrap();

    // torchvision's named_parameters() order: own parameters, then children in order.
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut expected = vec![
        "class_token".to_owned(),
        "conv_proj.weight".into(),
        "conv_proj.bias".into(),
        "encoder.pos_embedding".into(),
    ];
    for layer in 0..2 {
        for leaf in [
            "ln_1.weight",
            "ln_1.bias",
            "self_attention.in_proj_weight",
            "self_attention.in_proj_bias",
            "self_attention.out_proj.weight",
            "self_attention.out_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.0.weight",
            "mlp.0.bias",
            "mlp.3.weight",
            "mlp.3.bias",
        ] {
            expected.push(format!("encoder.layers.encoder_layer_{layer}.{leaf}"));
        }
    }
    expected.extend(
        [
            "encoder.ln.weight",
            "encoder.ln.bias",
            "heads.head.weight",
            "heads.head.bias",
        ]
        .map(String::from),
    );
    assert_eq!(names, expected);
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, golden_names(&file, "vit.param."));

    let run = golden::forward_backward(&cpu, &file, GoldenModel::VitTiny, model).unwrap();
    golden::check(&file, &run, 1e-10);
}

#[test]
fn gpt2_tiny_matches_hugging_face_in_float64() {
    let bytes = golden::models_golden();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let cpu = CpuBackend::new_ref();
    let model = GoldenModel::Gpt2Tiny.build(&cpu, DType::F64).unwrap();

    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names[..4],
        [
            "transformer.wte.weight",
            "transformer.wpe.weight",
            "transformer.h.0.ln_1.weight",
            "transformer.h.0.ln_1.bias"
        ]
    );
    assert_eq!(
        names[names.len() - 2..],
        ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    );
    assert!(
        !names.iter().any(|n| n.starts_with("lm_head")),
        "lm_head is tied, listed once"
    );
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, golden_names(&file, "gpt2.param."));

    let run = golden::forward_backward(&cpu, &file, GoldenModel::Gpt2Tiny, model).unwrap();
    assert_eq!(
        run.loss.dtype(),
        DType::F32,
        "Hugging Face's loss is computed in float32"
    );
    let errors = golden::check(&file, &run, 1e-5);
    // The forward pass itself is all float64, so the logits agree far tighter than 1e-5.
    assert!(errors.logits <= 1e-12, "gpt2 logits: {:e}", errors.logits);
}

#[test]
fn loading_weights_names_the_missing_extra_or_mis_shaped_parameter() {
    let bytes = golden::models_golden();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let cpu = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(0));

    // One layer more than the file has: the first parameter of the extra layer is missing.
    let deeper = VitConfig {
        num_layers: 3,
        ..VitConfig::tiny()
    };
    let model = VisionTransformer::new(&cpu, deeper, DType::F64, &generator).unwrap();
    let err = load_weights(&model, &file, "vit.param.").unwrap_err();
    assert!(
        matches!(&err, NnError::MissingParameter { name } if name == "encoder.layers.encoder_layer_2.ln_1.weight"),
        "{err}"
    );

    // One layer fewer: the file's second layer is unexpected.
    let shallower = VitConfig {
        num_layers: 1,
        ..VitConfig::tiny()
    };
    let model = VisionTransformer::new(&cpu, shallower, DType::F64, &generator).unwrap();
    let err = load_weights(&model, &file, "vit.param.").unwrap_err();
    assert!(
        matches!(&err, NnError::UnexpectedParameter { name } if name == "encoder.layers.encoder_layer_1.ln_1.bias"),
        "{err}"
    );

    // Ten more classes: the head's weight has the wrong shape, and nothing was written.
    let wider = VitConfig {
        num_classes: 20,
        ..VitConfig::tiny()
    };
    let model = VisionTransformer::new(&cpu, wider, DType::F64, &generator).unwrap();
    let before = model.class_token.to_vec_f64().unwrap();
    let err = load_weights(&model, &file, "vit.param.").unwrap_err();
    assert!(
        matches!(&err, NnError::ParameterShape { name, expected, found }
            if name == "heads.head.weight" && expected == &[20, 64] && found == &[10, 64]),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "parameter `heads.head.weight` has shape [20, 64] in the module but [10, 64] in the weights"
    );
    assert_eq!(model.class_token.to_vec_f64().unwrap(), before);
}
