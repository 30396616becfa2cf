//! Hugging Face checkpoints of the Llama family: the `config.json` that transformers'
//! `LlamaConfig` (or `Qwen2Config`) reads back as the same model
//! ([`LlamaConfig::hugging_face_config_json`]), a checkpoint directory that
//! `LlamaForCausalLM.from_pretrained(dir)` loads ([`LlamaForCausalLM::save_hugging_face`]:
//! `config.json` and `model.safetensors`), and the loading of such a `model.safetensors`
//! ([`LlamaForCausalLM::load_hugging_face`]).
//!
//! The config is written as Meta's published `config.json` files are (`rope_theta` and
//! `rope_scaling` at the top level, `rope_type: "llama3"`), which every transformers release
//! since 4.43 reads, transformers 5 moving both into its `rope_parameters`. The JSON is written
//! by hand: every value is a number, a boolean or a fixed name. This file sits on the config,
//! the model's parameter walk and [`crate::weights`]; it knows nothing of a layer's inside.

use std::fmt::Write as _;
use std::path::Path;

use super::config::LlamaConfig;
use super::LlamaForCausalLM;
use crate::error::{NnError, Result};

/// The file name of a checkpoint directory's weights (Hugging Face's `SAFE_WEIGHTS_NAME`).
pub const HUGGING_FACE_WEIGHTS_FILE: &str = "model.safetensors";
/// The file name of a checkpoint directory's config (Hugging Face's `CONFIG_NAME`).
pub const HUGGING_FACE_CONFIG_FILE: &str = "config.json";

/// A JSON number of a finite `f64` with its decimal point (`32.0`, `1e-5`, `500000.0`): Rust's
/// `Debug` form, which Python's `json` reads back as the same float.
fn json_float(value: f64) -> String {
    format!("{value:?}")
}

impl LlamaConfig {
    /// Hugging Face's `config.json` of this config (checked by [`LlamaConfig::validate`]): a
    /// `LlamaForCausalLM` (`model_type: "llama"`, no biases: `attention_bias` and `mlp_bias`
    /// false), or under [`LlamaConfig::qkv_bias`] a `Qwen2ForCausalLM` (`model_type: "qwen2"`,
    /// no sliding window), whose head width must then be `hidden_size / num_attention_heads`
    /// (Qwen2 derives it; an [`NnError::InvalidConfig`] otherwise). Every shape field,
    /// `rms_norm_eps`, `rope_theta`, `rope_scaling` (Llama 3's, or `null`),
    /// `tie_word_embeddings`, `initializer_range`, `hidden_act: "silu"`, no attention dropout,
    /// `use_cache` false, and Llama 3's special token ids (128000, 128001) when the vocabulary
    /// has them. Keys are sorted, as `save_pretrained` writes them.
    pub fn hugging_face_config_json(&self) -> Result<String> {
        self.validate()?;
        let qwen2 = self.qkv_bias;
        if qwen2 && self.head_dim * self.num_attention_heads != self.hidden_size {
            return Err(NnError::InvalidConfig {
                reason: format!(
                    "Qwen2's config has no head_dim: it derives {} from hidden_size {} and {} \
                     heads, not this config's {}",
                    self.hidden_size / self.num_attention_heads,
                    self.hidden_size,
                    self.num_attention_heads,
                    self.head_dim
                ),
            });
        }
        let (architecture, model_type) = if qwen2 {
            ("Qwen2ForCausalLM", "qwen2")
        } else {
            ("LlamaForCausalLM", "llama")
        };
        let rope_scaling = match self.rope_scaling {
            None => "null".to_owned(),
            Some(scaling) => format!(
                "{{\"factor\": {}, \"high_freq_factor\": {}, \"low_freq_factor\": {}, \
                 \"original_max_position_embeddings\": {}, \"rope_type\": \"llama3\"}}",
                json_float(scaling.factor),
                json_float(scaling.high_freq_factor),
                json_float(scaling.low_freq_factor),
                scaling.original_max_position_embeddings
            ),
        };
        // Llama 3's `<|begin_of_text|>` and `<|end_of_text|>`; no ids a small vocabulary lacks.
        let token_id = |id: usize| {
            if id < self.vocab_size {
                id.to_string()
            } else {
                "null".to_owned()
            }
        };
        let mut fields: Vec<(&str, String)> = vec![
            ("architectures", format!("[\"{architecture}\"]")),
            ("attention_dropout", json_float(0.0)),
            ("bos_token_id", token_id(128_000)),
            ("eos_token_id", token_id(128_001)),
            ("head_dim", self.head_dim.to_string()),
            ("hidden_act", "\"silu\"".to_owned()),
            ("hidden_size", self.hidden_size.to_string()),
            ("initializer_range", json_float(self.initializer_range)),
            ("intermediate_size", self.intermediate_size.to_string()),
            (
                "max_position_embeddings",
                self.max_position_embeddings.to_string(),
            ),
            ("model_type", format!("\"{model_type}\"")),
            ("num_attention_heads", self.num_attention_heads.to_string()),
            ("num_hidden_layers", self.num_hidden_layers.to_string()),
            ("num_key_value_heads", self.num_key_value_heads.to_string()),
            ("rms_norm_eps", json_float(self.rms_norm_eps)),
            ("rope_scaling", rope_scaling),
            ("rope_theta", json_float(self.rope_theta)),
            ("tie_word_embeddings", self.tie_word_embeddings.to_string()),
            ("use_cache", "false".to_owned()),
            ("vocab_size", self.vocab_size.to_string()),
        ];
        if qwen2 {
            fields.push(("use_sliding_window", "false".to_owned()));
        } else {
            fields.extend([
                ("attention_bias", "false".to_owned()),
                ("mlp_bias", "false".to_owned()),
                ("pretraining_tp", "1".to_owned()),
            ]);
        }
        fields.sort_unstable_by_key(|(key, _)| *key);
        let mut res = String::from("{\n");
        for (index, (key, value)) in fields.iter().enumerate() {
            let comma = if index + 1 < fields.len() { "," } else { "" };
            // Writing to a String cannot fail.
            let _ = writeln!(res, "  \"{key}\": {value}{comma}");
        }
        res.push_str("}\n");
        Ok(res)
    }
}

/// Writes `bytes` to `path`, naming the path in the error.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|source| NnError::Io {
        path: path.display().to_string(),
        source,
    })
}

impl LlamaForCausalLM {
    /// Writes this model as a Hugging Face checkpoint directory `dir` (created if missing):
    /// `config.json` ([`LlamaConfig::hugging_face_config_json`]) and `model.safetensors`, every
    /// parameter under its Hugging Face name in its own dtype ([`save_weights`](crate::save_weights);
    /// a tied head is not stored, as Hugging Face's own files do). transformers'
    /// `LlamaForCausalLM.from_pretrained(dir)` builds the same model from it, and
    /// [`LlamaForCausalLM::load_hugging_face`] reads the weights back.
    pub fn save_hugging_face(&self, dir: &Path) -> Result<()> {
        let config = self.config.hugging_face_config_json()?;
        std::fs::create_dir_all(dir).map_err(|source| NnError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        write_file(&dir.join(HUGGING_FACE_CONFIG_FILE), config.as_bytes())?;
        let weights = crate::weights::save_weights(self)?;
        write_file(&dir.join(HUGGING_FACE_WEIGHTS_FILE), &weights)
    }

    /// Loads a Hugging Face checkpoint of this model (`model.safetensors` of a
    /// `LlamaForCausalLM` or `Qwen2ForCausalLM`): the names as they are, a stored
    /// `lm_head.weight` skipped when the head is tied (some files carry it anyway), and the
    /// `rotary_emb.inv_freq` buffers of older files skipped. Every parameter must be present
    /// with its shape (see [`load_weights`](crate::load_weights)).
    pub fn load_hugging_face(&self, tensors: &safetensors::SafeTensors<'_>) -> Result<()> {
        let tied = self.lm_head.is_none();
        crate::weights::load_weights_renamed(self, tensors, &|name| {
            let skipped =
                name.ends_with(".rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
            (!skipped).then(|| name.to_owned())
        })
    }
}
