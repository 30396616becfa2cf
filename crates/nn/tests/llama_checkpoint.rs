//! Hugging Face checkpoint directories of the Llama family on the CPU: what
//! `LlamaForCausalLM::save_hugging_face` writes (`config.json` and `model.safetensors`, the
//! directory transformers' `from_pretrained` reads in `scripts/pytorch/llama_loss_parity.py`)
//! loads back through `load_hugging_face` bit for bit, and the config holds every field
//! transformers needs to build the same model: the shapes, `head_dim`, no biases, the tied head,
//! Llama 3's rotary scaling as Meta's Llama-3.2-1B `config.json` has it.

use std::path::PathBuf;

use headroom_autograd_core::{DType, Generator};
use headroom_nn::{
    LlamaConfig, LlamaForCausalLM, Module, NnError, HUGGING_FACE_CONFIG_FILE,
    HUGGING_FACE_WEIGHTS_FILE,
};
use headroom_ops_cpu::CpuBackend;
use safetensors::SafeTensors;
use serde_json::{json, Value};

/// A fresh directory of this test process under the system's temporary directory.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "headroom-llama-checkpoint-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn config_json(config: &LlamaConfig) -> Value {
    serde_json::from_str(&config.hugging_face_config_json().unwrap()).unwrap()
}

/// Saves a model of `config` from one seed into a directory, loads the directory's weights into
/// a model from another seed, and checks every parameter came back bit for bit; returns the
/// file's tensor names and the parsed `config.json`.
fn round_trip(config: LlamaConfig, name: &str) -> (Vec<String>, Value) {
    let cpu = CpuBackend::new_ref();
    let source = LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(1)).unwrap();
    let target = LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(2)).unwrap();
    let dir = scratch_dir(name);
    source.save_hugging_face(&dir).unwrap();
    let bytes = std::fs::read(dir.join(HUGGING_FACE_WEIGHTS_FILE)).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    target.load_hugging_face(&file).unwrap();
    let (want, have) = (source.named_parameters(), target.named_parameters());
    assert_eq!(want.len(), have.len());
    for ((name, want), (_, have)) in want.iter().zip(&have) {
        let bits = |values: Vec<f64>| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(have.to_vec_f64().unwrap()),
            bits(want.to_vec_f64().unwrap()),
            "{name}"
        );
    }
    let mut names: Vec<String> = file.names().into_iter().cloned().collect();
    names.sort_unstable();
    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.join(HUGGING_FACE_CONFIG_FILE)).unwrap())
            .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    (names, config)
}

#[test]
fn a_tiny_llama_directory_loads_back_exactly_with_hugging_faces_names() {
    let config = LlamaConfig::tiny();
    let (names, json) = round_trip(config, "tiny");
    let cpu = CpuBackend::new_ref();
    let model = LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(0)).unwrap();
    let mut expected = model.parameter_names();
    expected.sort_unstable();
    assert_eq!(names, expected);
    // 2 layers of 9 tensors, embedding, final norm, the untied head.
    assert_eq!(names.len(), 21);
    assert!(names.contains(&"lm_head.weight".to_owned()));
    assert_eq!(json, config_json(&config));
    assert_eq!(json["tie_word_embeddings"], false);
}

#[test]
fn a_tied_llama_directory_stores_no_head_and_loads_back_exactly() {
    let config = LlamaConfig {
        tie_word_embeddings: true,
        ..LlamaConfig::tiny()
    };
    let (names, json) = round_trip(config, "tied");
    assert_eq!(names.len(), 20);
    assert!(!names.contains(&"lm_head.weight".to_owned()));
    assert_eq!(json["tie_word_embeddings"], true);
}

/// Every key of Meta's `config.json` of `meta-llama/Llama-3.2-1B` that shapes the model, with
/// its value (floats as floats), and the keys a random-init parity run adds or changes.
#[test]
fn the_1b_config_json_is_meta_llama_3_2_1b_s() {
    let json = config_json(&LlamaConfig::llama_3_2_1b());
    let expected = json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3"
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": true,
        "use_cache": false,
        "vocab_size": 128256
    });
    assert_eq!(json, expected);
    // transformers warns on a rotary factor that is not a float: these parse as floats.
    for key in ["factor", "high_freq_factor", "low_freq_factor"] {
        assert!(json["rope_scaling"][key].is_f64(), "{key}");
    }
    assert!(json["rope_theta"].is_f64());
    // Llama-3.1-8B: untied, factor 8, width 4096.
    let json = config_json(&LlamaConfig::llama_3_1_8b());
    assert_eq!(json["tie_word_embeddings"], false);
    assert_eq!(json["rope_scaling"]["factor"], 8.0);
    assert_eq!(
        (&json["hidden_size"], &json["head_dim"]),
        (&json!(4096), &json!(128))
    );
}

#[test]
fn the_tiny_configs_json_keeps_each_field_and_omits_missing_token_ids() {
    let tiny = LlamaConfig::tiny();
    let json = config_json(&tiny);
    for (key, value) in [
        ("vocab_size", tiny.vocab_size),
        ("hidden_size", tiny.hidden_size),
        ("intermediate_size", tiny.intermediate_size),
        ("num_hidden_layers", tiny.num_hidden_layers),
        ("num_attention_heads", tiny.num_attention_heads),
        ("num_key_value_heads", tiny.num_key_value_heads),
        ("head_dim", tiny.head_dim),
        ("max_position_embeddings", tiny.max_position_embeddings),
    ] {
        assert_eq!(json[key], json!(value), "{key}");
    }
    assert_eq!(json["rms_norm_eps"], tiny.rms_norm_eps);
    assert_eq!(json["rope_theta"], tiny.rope_theta);
    assert_eq!(json["rope_scaling"]["factor"], 8.0);
    assert_eq!(json["bos_token_id"], Value::Null);
    assert_eq!(json["eos_token_id"], Value::Null);
}

#[test]
fn qwen2_configs_are_written_as_qwen2_and_refuse_a_head_width_it_cannot_hold() {
    let json = config_json(&LlamaConfig::qwen2_tiny());
    assert_eq!(json["model_type"], "qwen2");
    assert_eq!(json["architectures"], json!(["Qwen2ForCausalLM"]));
    assert_eq!(json["rope_scaling"], Value::Null);
    assert_eq!(json["rope_theta"], 1e6);
    assert_eq!(json["use_sliding_window"], false);
    assert_eq!(json["tie_word_embeddings"], true);
    assert!(json.get("attention_bias").is_none());
    let wide_heads = LlamaConfig {
        head_dim: 32,
        ..LlamaConfig::qwen2_tiny()
    };
    let err = wide_heads.hugging_face_config_json().unwrap_err();
    assert!(
        matches!(&err, NnError::InvalidConfig { reason } if reason.contains("head_dim")),
        "{err}"
    );
    let invalid = LlamaConfig {
        num_key_value_heads: 3,
        ..LlamaConfig::tiny()
    };
    assert!(matches!(
        invalid.hugging_face_config_json(),
        Err(NnError::InvalidConfig { .. })
    ));
}

#[test]
fn a_directory_that_cannot_be_created_is_an_io_error_naming_it() {
    let cpu = CpuBackend::new_ref();
    let model =
        LlamaForCausalLM::new(&cpu, LlamaConfig::tiny(), DType::F32, &Generator::new(0)).unwrap();
    let file = scratch_dir("file");
    std::fs::write(&file, b"not a directory").unwrap();
    let err = model.save_hugging_face(&file.join("inside")).unwrap_err();
    assert!(
        matches!(&err, NnError::Io { path, .. } if path.ends_with("inside")),
        "{err}"
    );
    std::fs::remove_file(&file).unwrap();
}
