//! What one Llama decoder layer keeps for backward, per token: the formula of its activation
//! bytes, term by term ([`LlamaConfig::block_activation_terms`]), for the layer as `block.rs`,
//! `rope.rs` and autograd-core's ops write it today.
//!
//! A layer's activation bytes are what its forward allocates and leaves allocated: the tensors
//! its ops save for backward (counted once per storage: q, k and v's linears share their input)
//! and its output, which the next layer's first norm saves (so a stack of `n` layers keeps `n`
//! times the figure). Every term is per token (`batch × seq` tokens): the rotary tables the
//! rotations save are `[seq, head_dim]`, made once per forward outside the layers, and are not
//! counted. `tests/llama_activations.rs` checks the sum against the allocator's requested bytes
//! around one layer's forward, exactly, in f32, bf16, f16 and f64. When an op changes what it
//! saves, that test names the difference and the terms here change with it. This module knows no
//! tensor: sizes only.

use headroom_autograd_core::DType;

use super::config::LlamaConfig;

impl LlamaConfig {
    /// The bytes one decoder layer of a model in `dtype` (parameters and activations alike, no
    /// autocast) keeps for backward per token, by what keeps them, in forward order. With `b`
    /// the dtype's size and `c` that of the dtype RMSNorm's rstd and attention's log-sum-exp are
    /// kept in (f32 for f16 and bf16, the dtype itself otherwise), `h` the hidden size, `i` the
    /// MLP's, `H` the query heads, `K` the key/value heads, `d` the head width:
    ///
    /// | term | bytes per token | saved by |
    /// |---|---|---|
    /// | `input_layernorm.rstd` | `c` | the fused `rms_norm` (its input is the layer's input: the previous layer's output) |
    /// | `input_layernorm.output` | `h·b` | the q, k and v projections (one storage) |
    /// | `self_attn.q_rotated` | `H·d·b` | attention (the fused rotation's output; the projection it rotated is freed) |
    /// | `self_attn.k_rotated` | `K·d·b` | attention (grouped-query heads read in place: no `repeat_kv` copy) |
    /// | `self_attn.v` | `K·d·b` | attention (the v projection's output) |
    /// | `self_attn.output` | `H·d·b` | attention and `o_proj` (one storage) |
    /// | `self_attn.lse` | `H·c` | attention (one log-sum-exp per query and head) |
    /// | `post_attention_layernorm.input` | `h·b` | the fused `rms_norm` (the residual sum) |
    /// | `post_attention_layernorm.rstd` | `c` | the fused `rms_norm` |
    /// | `post_attention_layernorm.output` | `h·b` | the gate and up projections (one storage) |
    /// | `mlp.gate` | `i·b` | the fused `swiglu` (which recomputes `silu(gate)` in backward) |
    /// | `mlp.up` | `i·b` | the fused `swiglu` |
    /// | `mlp.gated` | `i·b` | `down_proj` |
    /// | `output` | `h·b` | the next layer's first norm (or the final norm) |
    ///
    /// The rotations save only the rotary tables (outside the layer), so q and k before their
    /// rotation are freed, as are `o_proj`'s and `down_proj`'s outputs once added. The bias of
    /// a Qwen2 projection changes nothing here (a bias's backward needs no saved tensor).
    pub fn block_activation_terms(&self, dtype: DType) -> Vec<(&'static str, u64)> {
        let b = dtype.size_in_bytes() as u64;
        let c = b.max(4);
        let h = self.hidden_size as u64;
        let i = self.intermediate_size as u64;
        let heads = self.num_attention_heads as u64;
        let q_width = heads * self.head_dim as u64;
        let kv_width = self.num_key_value_heads as u64 * self.head_dim as u64;
        vec![
            ("input_layernorm.rstd", c),
            ("input_layernorm.output", h * b),
            ("self_attn.q_rotated", q_width * b),
            ("self_attn.k_rotated", kv_width * b),
            ("self_attn.v", kv_width * b),
            ("self_attn.output", q_width * b),
            ("self_attn.lse", heads * c),
            ("post_attention_layernorm.input", h * b),
            ("post_attention_layernorm.rstd", c),
            ("post_attention_layernorm.output", h * b),
            ("mlp.gate", i * b),
            ("mlp.up", i * b),
            ("mlp.gated", i * b),
            ("output", h * b),
        ]
    }

    /// The sum of [`LlamaConfig::block_activation_terms`]: the bytes one decoder layer keeps
    /// for backward per token (Llama-3.2-1B: 151,688 in f32, 75,912 in bf16).
    pub fn block_activation_bytes_per_token(&self, dtype: DType) -> u64 {
        self.block_activation_terms(dtype)
            .iter()
            .map(|(_, bytes)| bytes)
            .sum()
    }
}
