//! Hugging Face GPT-2 checkpoints load whatever their flavour: `GPT2Model` names without the
//! `transformer.` prefix, the causal-mask buffers older files carry, and a stored tied
//! `lm_head.weight`.

use std::collections::HashMap;
use std::sync::Arc;

use headroom_autograd_core::{DType, Generator};
use headroom_nn::{save_weights, Gpt2Config, Gpt2LMHeadModel, Module, NnError};
use headroom_ops_cpu::CpuBackend;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// The source model's tensors renamed as a `GPT2Model` checkpoint, with buffers added.
fn hugging_face_file(source: &Gpt2LMHeadModel) -> Vec<u8> {
    let ours = save_weights(source).unwrap();
    let ours = SafeTensors::deserialize(&ours).unwrap();
    let mask = vec![0u8; 4 * 64 * 64];
    let mut entries: HashMap<String, TensorView<'_>> = HashMap::new();
    for (name, view) in ours.tensors() {
        let short = name.strip_prefix("transformer.").unwrap().to_owned();
        entries.insert(short, view.clone());
        if name == "transformer.wte.weight" {
            entries.insert("lm_head.weight".into(), view);
        }
    }
    for layer in 0..2 {
        let view = TensorView::new(Dtype::F32, vec![1, 1, 64, 64], &mask).unwrap();
        entries.insert(format!("h.{layer}.attn.bias"), view);
    }
    safetensors::serialize(entries, &None).unwrap()
}

#[test]
fn a_gpt2_model_checkpoint_with_buffers_loads_into_the_lm_head_model() {
    let cpu = CpuBackend::new_ref();
    let source = Gpt2LMHeadModel::new(
        &cpu,
        Gpt2Config::tiny(),
        DType::F32,
        &Arc::new(Generator::new(1)),
    )
    .unwrap();
    let target = Gpt2LMHeadModel::new(
        &cpu,
        Gpt2Config::tiny(),
        DType::F32,
        &Arc::new(Generator::new(2)),
    )
    .unwrap();
    let bytes = hugging_face_file(&source);
    target
        .load_hugging_face(&SafeTensors::deserialize(&bytes).unwrap())
        .unwrap();
    for ((name, want), (_, have)) in source
        .named_parameters()
        .iter()
        .zip(target.named_parameters())
    {
        assert_eq!(
            have.to_vec_f64().unwrap(),
            want.to_vec_f64().unwrap(),
            "{name}"
        );
    }
}

#[test]
fn a_checkpoint_missing_a_parameter_names_it() {
    let cpu = CpuBackend::new_ref();
    let model = Gpt2LMHeadModel::new(
        &cpu,
        Gpt2Config::tiny(),
        DType::F32,
        &Arc::new(Generator::new(1)),
    )
    .unwrap();
    let bytes = hugging_face_file(&model);
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut entries: HashMap<String, TensorView<'_>> = file.tensors().into_iter().collect();
    entries.remove("ln_f.bias");
    let bytes = safetensors::serialize(entries, &None).unwrap();
    let err = model
        .load_hugging_face(&SafeTensors::deserialize(&bytes).unwrap())
        .unwrap_err();
    assert!(
        matches!(&err, NnError::MissingParameter { name } if name == "transformer.ln_f.bias"),
        "{err}"
    );
}

/// Parameters of a GPT-2 config, `lm_head` tied: embeddings, per block two layer norms, the
/// q/k/v and output projections and the two MLP layers, and the final layer norm.
fn gpt2_parameters(config: Gpt2Config) -> usize {
    let (d, layers) = (config.n_embd, config.n_layer);
    (config.vocab_size + config.n_positions) * d + layers * (12 * d * d + 13 * d) + 2 * d
}

#[test]
fn the_named_gpt2_configs_have_hugging_faces_parameter_counts() {
    // `sum(p.numel() for p in GPT2LMHeadModel(AutoConfig.from_pretrained(name)).parameters())`.
    for (name, parameters) in [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
    ] {
        let config = Gpt2Config::named(name).unwrap();
        assert_eq!(gpt2_parameters(config), parameters, "{name}");
    }
    assert_eq!(Gpt2Config::named("gpt2-xl"), None);
    // The formula is the model's: the golden tiny model counts the same.
    let tiny = Gpt2LMHeadModel::new(
        &CpuBackend::new_ref(),
        Gpt2Config::tiny(),
        DType::F32,
        &Arc::new(Generator::new(0)),
    )
    .unwrap();
    let counted: usize = tiny.parameters().iter().map(|p| p.numel()).sum();
    assert_eq!(counted, gpt2_parameters(Gpt2Config::tiny()));
    let quiet = Gpt2Config::gpt2().without_dropout();
    assert_eq!(
        (quiet.embd_pdrop, quiet.attn_pdrop, quiet.resid_pdrop),
        (0.0, 0.0, 0.0)
    );
}
