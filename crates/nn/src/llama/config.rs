//! The hyperparameters of the Llama family ([`LlamaConfig`], Hugging Face's `LlamaConfig` and
//! `Qwen2Config` fields), the published shapes, their validation and their parameter count.
//!
//! A config is plain data: [`LlamaConfig::validate`] turns every shape the model cannot be built
//! with into a typed [`NnError::InvalidConfig`], and [`LlamaConfig::num_parameters`] counts the
//! parameters from the shapes alone, so an 8B config is checked without allocating it. This
//! module knows no tensor.

use crate::error::{NnError, Result};

/// Llama 3's frequency scaling of the rotary embedding (Hugging Face's `rope_type: "llama3"`,
/// `_compute_llama3_parameters`): wavelengths shorter than `original / high_freq_factor` are
/// kept, those longer than `original / low_freq_factor` are stretched by `factor`, and those in
/// between are interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// How much the low frequencies are stretched (8 for Llama 3.1, 32 for Llama 3.2).
    pub factor: f64,
    /// Wavelengths over `original_max_position_embeddings / low_freq_factor` are scaled.
    pub low_freq_factor: f64,
    /// Wavelengths under `original_max_position_embeddings / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was first trained at (8192 for Llama 3).
    pub original_max_position_embeddings: usize,
}

impl Llama3RopeScaling {
    /// Meta's Llama 3 scaling with `factor`: low-frequency factor 1, high-frequency factor 4,
    /// original context 8192 (Llama 3.1 uses factor 8, Llama 3.2 factor 32).
    pub fn llama_3(factor: f64) -> Llama3RopeScaling {
        Llama3RopeScaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }
}

/// The hyperparameters of a Llama-family model (Hugging Face's `LlamaConfig`; Qwen2 is the same
/// model with q/k/v biases).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the token vectors.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP's inner layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads per layer; divides `hidden_size`.
    pub num_attention_heads: usize,
    /// Key/value heads per layer (grouped-query attention); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Width of one head (even: the rotary embedding rotates pairs).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Base of the rotary embedding's wavelengths.
    pub rope_theta: f64,
    /// Llama 3's frequency scaling, if any (`None`: Hugging Face's default rotary embedding).
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// The longest context the model is meant for (recorded, not enforced, as in Hugging Face).
    pub max_position_embeddings: usize,
    /// Whether `lm_head` shares the token embedding's weight (then it is not a parameter of its
    /// own and weight files omit `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections, none on `o_proj` (Qwen2's layout). Llama has none.
    /// Hugging Face's Llama `attention_bias = True`, which also biases `o_proj`, is not built.
    pub qkv_bias: bool,
    /// Standard deviation of the normal initialisation of every weight matrix and embedding.
    pub initializer_range: f64,
}

impl LlamaConfig {
    /// The golden tiny Llama: vocab 128, width 64, MLP 128, 2 layers, 4 query heads sharing 2
    /// key/value heads of 16, untied head, and Llama 3.1's rotary scaling (theta 500000,
    /// factor 8, low 1, high 4, original 8192), under which the 8 frequencies of a head of 16
    /// fall in all three bands: 4 kept, 1 interpolated, 3 stretched.
    pub fn tiny() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 128,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: Some(Llama3RopeScaling::llama_3(8.0)),
            max_position_embeddings: 64,
            tie_word_embeddings: false,
            qkv_bias: false,
            initializer_range: 0.02,
        }
    }

    /// The golden tiny Qwen2: the tiny Llama's shapes with q/k/v biases, a tied head, Qwen2's
    /// rotary base (1e6, unscaled) and RMSNorm epsilon (1e-6).
    pub fn qwen2_tiny() -> LlamaConfig {
        LlamaConfig {
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            tie_word_embeddings: true,
            qkv_bias: true,
            ..LlamaConfig::tiny()
        }
    }

    /// Llama-3.2-1B's shape (1,235,814,400 parameters): Hugging Face's `config.json` of
    /// `meta-llama/Llama-3.2-1B` (width 2048, MLP 8192, 16 layers, 32 heads, 8 key/value heads,
    /// head 64, tied, rotary scaling factor 32).
    pub fn llama_3_2_1b() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 128_256,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_hidden_layers: 16,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: Some(Llama3RopeScaling::llama_3(32.0)),
            max_position_embeddings: 131_072,
            tie_word_embeddings: true,
            qkv_bias: false,
            initializer_range: 0.02,
        }
    }

    /// Llama-3.2-3B's shape (3,212,749,824 parameters): width 3072, MLP 8192, 28 layers, 24
    /// heads of 128, 8 key/value heads, tied, rotary scaling factor 32.
    pub fn llama_3_2_3b() -> LlamaConfig {
        LlamaConfig {
            hidden_size: 3072,
            num_hidden_layers: 28,
            num_attention_heads: 24,
            head_dim: 128,
            ..LlamaConfig::llama_3_2_1b()
        }
    }

    /// Llama-3.1-8B's shape (8,030,261,248 parameters): width 4096, MLP 14336, 32 layers, 32
    /// heads of 128, 8 key/value heads, untied head, rotary scaling factor 8.
    pub fn llama_3_1_8b() -> LlamaConfig {
        LlamaConfig {
            hidden_size: 4096,
            intermediate_size: 14_336,
            num_hidden_layers: 32,
            head_dim: 128,
            rope_scaling: Some(Llama3RopeScaling::llama_3(8.0)),
            tie_word_embeddings: false,
            ..LlamaConfig::llama_3_2_1b()
        }
    }

    /// Qwen2.5-14B's shape (14,770,033,664 parameters): width 5120, MLP 13824, 48 layers, 40
    /// heads of 128, 8 key/value heads, q/k/v biases, a 152,064-token vocabulary, untied head.
    pub fn qwen2_5_14b() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 152_064,
            hidden_size: 5120,
            intermediate_size: 13_824,
            num_hidden_layers: 48,
            num_attention_heads: 40,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 131_072,
            tie_word_embeddings: false,
            qkv_bias: true,
            initializer_range: 0.02,
        }
    }

    /// Qwen2.5-32B's shape (32,763,876,352 parameters): Qwen2.5-14B's with MLP 27648 and 64
    /// layers.
    pub fn qwen2_5_32b() -> LlamaConfig {
        LlamaConfig {
            intermediate_size: 27_648,
            num_hidden_layers: 64,
            ..LlamaConfig::qwen2_5_14b()
        }
    }

    /// Llama-3.1-70B's shape (70,553,706,496 parameters): width 8192, MLP 28672, 80 layers, 64
    /// heads of 128, 8 key/value heads, untied head, rotary scaling factor 8.
    pub fn llama_3_1_70b() -> LlamaConfig {
        LlamaConfig {
            hidden_size: 8192,
            intermediate_size: 28_672,
            num_hidden_layers: 80,
            num_attention_heads: 64,
            ..LlamaConfig::llama_3_1_8b()
        }
    }

    /// The full-size shapes [`LlamaConfig::named`] knows, smallest first.
    pub const STANDARD_NAMES: [&'static str; 6] = [
        "llama-3.2-1b",
        "llama-3.2-3b",
        "llama-3.1-8b",
        "qwen2.5-14b",
        "qwen2.5-32b",
        "llama-3.1-70b",
    ];

    /// The config of a name: `llama-tiny`, `qwen2-tiny`, `llama-3.2-1b`, `llama-3.2-3b`,
    /// `llama-3.1-8b`, `qwen2.5-14b`, `qwen2.5-32b` or `llama-3.1-70b`.
    pub fn named(name: &str) -> Option<LlamaConfig> {
        match name {
            "llama-tiny" => Some(LlamaConfig::tiny()),
            "qwen2-tiny" => Some(LlamaConfig::qwen2_tiny()),
            "llama-3.2-1b" => Some(LlamaConfig::llama_3_2_1b()),
            "llama-3.2-3b" => Some(LlamaConfig::llama_3_2_3b()),
            "llama-3.1-8b" => Some(LlamaConfig::llama_3_1_8b()),
            "qwen2.5-14b" => Some(LlamaConfig::qwen2_5_14b()),
            "qwen2.5-32b" => Some(LlamaConfig::qwen2_5_32b()),
            "llama-3.1-70b" => Some(LlamaConfig::llama_3_1_70b()),
            _ => None,
        }
    }

    /// Query heads per key/value head (Hugging Face's `num_key_value_groups`).
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads.max(1)
    }

    /// `Ok` when a model can be built from this config, else an [`NnError::InvalidConfig`]
    /// saying what is wrong: a zero size, heads that do not divide the width, key/value heads
    /// that do not divide the heads, an odd head width, a non-positive epsilon or rotary base,
    /// or a rotary scaling whose bands are empty or inverted.
    pub fn validate(&self) -> Result<()> {
        let invalid = |reason: String| Err(NnError::InvalidConfig { reason });
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, size)| *size == 0) {
            return invalid(format!("{name} is 0"));
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return invalid(format!(
                "{} attention heads do not divide a hidden size of {}",
                self.num_attention_heads, self.hidden_size
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return invalid(format!(
                "{} key/value heads do not divide {} attention heads",
                self.num_key_value_heads, self.num_attention_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return invalid(format!(
                "head_dim {} is odd; the rotary embedding rotates pairs",
                self.head_dim
            ));
        }
        for (name, value) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
            ("initializer_range", self.initializer_range),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return invalid(format!("{name} is {value}; it must be positive"));
            }
        }
        if let Some(scaling) = self.rope_scaling {
            let Llama3RopeScaling {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } = scaling;
            if !(factor.is_finite() && factor >= 1.0) {
                return invalid(format!("rope scaling factor {factor} is below 1"));
            }
            if !(low_freq_factor > 0.0 && high_freq_factor.is_finite())
                || low_freq_factor >= high_freq_factor
            {
                return invalid(format!(
                    "rope scaling needs 0 < low_freq_factor < high_freq_factor, got \
                     {low_freq_factor} and {high_freq_factor}"
                ));
            }
            if original_max_position_embeddings == 0 {
                return invalid("rope scaling's original_max_position_embeddings is 0".into());
            }
        }
        Ok(())
    }

    /// The number of scalar parameters of the model this config builds, computed from the
    /// shapes (nothing is allocated): the embedding, per layer the four projections (with their
    /// biases under `qkv_bias`), the three MLP matrices and two norms, the final norm, and
    /// `lm_head` unless tied.
    pub fn num_parameters(&self) -> usize {
        let hidden = self.hidden_size;
        let q_width = self.num_attention_heads * self.head_dim;
        let kv_width = self.num_key_value_heads * self.head_dim;
        let bias = if self.qkv_bias {
            q_width + 2 * kv_width
        } else {
            0
        };
        let attention = hidden * (q_width + 2 * kv_width) + bias + q_width * hidden;
        let mlp = 3 * hidden * self.intermediate_size;
        let layer = attention + mlp + 2 * hidden;
        let embedding = self.vocab_size * hidden;
        let head = if self.tie_word_embeddings {
            0
        } else {
            embedding
        };
        embedding + self.num_hidden_layers * layer + hidden + head
    }
}
