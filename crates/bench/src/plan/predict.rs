//! What a plan predicts for a Llama-shaped model at `batch` rows of `seq` tokens: its GPU peak
//! (term by term, phase by phase), its host bytes and its step time on the H200.
//!
//! A plan is a recipe (bench-memory's case: where AdamW's state lives and how wide it is, inside
//! backward or after it) and, for the checkpointed recipes, how many blocks it recomputes (the
//! first `k` of the model's `L`; the others keep every activation). The GPU peak is the largest
//! of the phases the recipe goes through, each a sum of terms from the model's shapes, every
//! tensor rounded up to the caching allocator's 512-byte blocks:
//!
//! - **backward's start** (every recipe): weights, state, the activations kept — a kept block's
//!   bytes per token from nn's formula ([`LlamaConfig::block_activation_bytes_per_token`]), a
//!   recomputed block's input, the embedding's output (block 0's input), the input of the first
//!   kept block after a recomputed one, the last block's output where the final norm keeps it,
//!   the rotary tables — with what the head saves (the final norm's output and statistic, the
//!   loss's row statistics), the fused loss's tile of logits, the hidden states' gradient, the
//!   largest gradient (the head's) and the input tokens;
//! - **a block's recompute** (checkpointed recipes): the checkpoints still live, one block's
//!   activations and its backward's temporaries (two intermediate-wide gradients, the SwiGLU
//!   backward's, which is what the allocator counts on the tiny Llama); before backward's plain
//!   step, with the gradients written so far (every block's but the ones still to come);
//! - **backward's end** (the plain step): weights, state, every gradient and the embedding's
//!   backward (an f32 and a bf16 row a token).
//!
//! These terms add up to the allocator's peak within 0.5% on the tiny Llama on the CPU and within
//! 2% on the H200 (the tests), where the phases' order is what decides.
//!
//! The step time is a model fitted to ten bf16 steps measured on the H200 (Llama-3.2-1B and
//! Llama-3.1-8B at 2048 tokens a row, batch 1 to 8, f32 and 4-bit state, kept and checkpointed,
//! listed in the tests with their files): the forward and backward's FLOPs (6 per matmul
//! parameter and token, and causal attention's) at a rate that grows with the hidden size, a
//! share of them again for the recomputed blocks, and a per-parameter cost of the optimizer's
//! step by state (the 8-bit rule's from its kernel's measured rate, which no Llama step has
//! measured yet). It predicts those ten within 6%; a plan with its state in host memory adds the
//! host's step of the one measured offloaded run, and a streamed plan takes the longer of the
//! forward and backward and its state's trip over the link (55 GB/s each way; no streamed Llama
//! step measured yet). It is a model of this machine, not a law.
//!
//! A streamed plan's GPU peak counts, instead of the state, what the stream may hold: its budget
//! coming in and as much going back, and one bucket (the largest parameter's state) beyond each.
//!
//! It sits on nn's Llama configs and optim's quantisation constants; it knows no device.

use headroom_autograd_core::DType;
use headroom_nn::LlamaConfig;
use headroom_optim::kernels::{is_quantized_4bit, AO_BLOCK_SIZE, BNB_BLOCK_SIZE, MIN_8BIT_SIZE};

use crate::bench_memory::cases::{adam4bit_state_bytes, streamed_state_budget};

/// Where AdamW's state lives and how wide it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// f32 moments on the GPU (optim's `AdamStochastic`).
    F32,
    /// bitsandbytes' 8-bit block-wise state.
    Bits8,
    /// torchao's 4-bit block-wise state.
    Bits4,
    /// f32 moments and a bf16 copy in host memory (optim's `OffloadedAdam`).
    Host,
    /// torchao's 4-bit state in pinned host memory, streamed through the GPU bucket by bucket
    /// (optim's `StreamedOptimizer`).
    Bits4Streamed,
}

impl State {
    /// The state the GPU holds in its place on the CPU backend, where a streamed optimizer is
    /// its inner one.
    #[cfg(test)]
    pub(crate) fn on_the_cpu(self) -> State {
        match self {
            State::Bits4Streamed => State::Bits4,
            other => other,
        }
    }
}

/// One recipe: bench-memory's case of that name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recipe {
    pub(crate) case: &'static str,
    pub(crate) state: State,
    pub(crate) in_backward: bool,
    pub(crate) checkpointed: bool,
}

/// The recipes a plan picks from: bench-memory's bf16-model AdamW cases.
pub(crate) const RECIPES: [Recipe; 12] = [
    recipe("adamw_inbwd_bf16", State::F32, true, false),
    recipe("adamw8bit_inbwd_bf16", State::Bits8, true, false),
    recipe("adamw4bit_inbwd_bf16", State::Bits4, true, false),
    recipe("adamw8bit_bf16", State::Bits8, false, false),
    recipe("adamw4bit_bf16", State::Bits4, false, false),
    recipe("adamw8bit_inbwd_bf16_ckpt", State::Bits8, true, true),
    recipe("adamw4bit_inbwd_bf16_ckpt", State::Bits4, true, true),
    recipe("adamw8bit_bf16_ckpt", State::Bits8, false, true),
    recipe("adamw4bit_bf16_ckpt", State::Bits4, false, true),
    recipe("adamw_offload_inbwd_bf16", State::Host, true, false),
    recipe(
        "adamw4bit_stream_inbwd_bf16",
        State::Bits4Streamed,
        true,
        false,
    ),
    recipe(
        "adamw4bit_stream_inbwd_bf16_ckpt",
        State::Bits4Streamed,
        true,
        true,
    ),
];

const fn recipe(case: &'static str, state: State, in_backward: bool, checkpointed: bool) -> Recipe {
    Recipe {
        case,
        state,
        in_backward,
        checkpointed,
    }
}

/// A recipe and the blocks it recomputes: the first `checkpointed` (0 for a recipe that keeps
/// every activation, 1 to the model's blocks for a checkpointed one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) recipe: Recipe,
    pub(crate) checkpointed: usize,
}

/// A plan's predicted peaks and step time, with the terms of the phase that sets the GPU peak.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Prediction {
    pub(crate) gpu_peak: u64,
    pub(crate) host_bytes: u64,
    pub(crate) step_ms: f64,
    /// The phase that sets the peak: "backward's start", "a block's recompute" or "backward's
    /// end".
    pub(crate) phase: &'static str,
    pub(crate) terms: Vec<(&'static str, u64)>,
}

/// The caching allocator's smallest block: a tensor's bytes round up to a multiple of it.
const BLOCK_ROUNDING: u64 = 512;

/// Bytes of the fused loss's chunk budget (autograd-core's default `chunk_bytes`).
const LOSS_CHUNK_BYTES: u64 = 64 << 20;

/// `bytes` as the allocator hands them out.
fn rounded(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK_ROUNDING) * BLOCK_ROUNDING
}

/// One decoder layer's parameter tensors' element counts, in the model's order.
pub(crate) fn layer_sizes(config: &LlamaConfig) -> Vec<usize> {
    let hidden = config.hidden_size;
    let q_width = config.num_attention_heads * config.head_dim;
    let kv_width = config.num_key_value_heads * config.head_dim;
    let mut sizes = vec![
        hidden,
        hidden * q_width,
        hidden * kv_width,
        hidden * kv_width,
    ];
    if config.qkv_bias {
        sizes.extend([q_width, kv_width, kv_width]);
    }
    sizes.extend([q_width * hidden, hidden]);
    sizes.extend([hidden * config.intermediate_size; 3]);
    sizes
}

/// Every parameter tensor's element count, in the model's order.
pub(crate) fn parameter_sizes(config: &LlamaConfig) -> Vec<usize> {
    let embedding = config.vocab_size * config.hidden_size;
    let mut sizes = vec![embedding];
    for _ in 0..config.num_hidden_layers {
        sizes.extend(layer_sizes(config));
    }
    sizes.push(config.hidden_size);
    if !config.tie_word_embeddings {
        sizes.push(embedding);
    }
    sizes
}

/// The bytes of each of AdamW's state tensors for a parameter of `n` elements kept as `state`
/// on the GPU: two f32 moments; 8-bit: two code arrays and two f32 scales per block of 256 from
/// 4096 elements; 4-bit: two arrays of packed codes and two f32 scales per block of 128 for whole
/// blocks from 4096 elements; none when offloaded or streamed.
fn state_tensors(state: State, n: usize) -> Vec<u64> {
    let n64 = n as u64;
    match state {
        State::Bits8 if n >= MIN_8BIT_SIZE => {
            let scales = 4 * n64.div_ceil(BNB_BLOCK_SIZE as u64);
            vec![n64, n64, scales, scales]
        }
        State::Bits4 if is_quantized_4bit(n) => {
            let scales = 4 * (n64 / AO_BLOCK_SIZE as u64);
            vec![n64 / 2, n64 / 2, scales, scales]
        }
        State::F32 | State::Bits8 | State::Bits4 => vec![4 * n64, 4 * n64],
        State::Host | State::Bits4Streamed => Vec::new(),
    }
}

/// Bytes of AdamW's state for a parameter of `n` elements kept as `state` (optim's count).
#[cfg(test)]
pub(crate) fn state_bytes(state: State, n: usize) -> u64 {
    state_tensors(state, n).iter().sum()
}

/// The model's FLOPs a token, forward and backward: 6 per matmul parameter (a tied head's
/// weights are the embedding's, an untied embedding is a lookup) and causal attention's two
/// matmuls over half the positions, forward and backward.
fn flops_per_token(config: &LlamaConfig, seq: usize) -> f64 {
    let parameters = config.num_parameters() as f64;
    let lookup = if config.tie_word_embeddings {
        0.0
    } else {
        (config.vocab_size * config.hidden_size) as f64
    };
    let q_width = (config.num_attention_heads * config.head_dim) as f64;
    let attention = 6.0 * config.num_hidden_layers as f64 * seq as f64 * q_width;
    6.0 * (parameters - lookup) + attention
}

/// The H200's calibration of the step-time model (see the module's documentation): the
/// effective bf16 rate in TFLOP/s for a large hidden size, the hidden size at which it is half
/// that, the share of a step's FLOPs a recomputed block costs again, and the per-parameter step
/// costs in ms per 1e9 parameters.
mod h200 {
    pub(super) const TFLOPS: f64 = 733.4;
    pub(super) const HALF_RATE_HIDDEN: f64 = 1278.6;
    pub(super) const RECOMPUTE_SHARE: f64 = 0.275;
    /// Every recipe: the gradients' and weights' own per-parameter work.
    pub(super) const COMMON_MS: f64 = 3.80;
    /// Fused AdamW with f32 moments on bf16 parameters, stochastic rounding.
    pub(super) const F32_STATE_MS: f64 = 8.06;
    /// 8-bit AdamW: its kernel's 5.5 ms per 1e9 (results/2026-12-02-29eea64/cuda_adam.jsonl).
    pub(super) const BITS8_STATE_MS: f64 = 5.5;
    /// 4-bit AdamW (fitted; its kernel measures 8.5-9.0).
    pub(super) const BITS4_STATE_MS: f64 = 8.83;
    /// The host's AdamW over pinned state, 16 cores (Llama-3.2-1B at batch 1, 857.1 ms:
    /// results/2026-12-02-799f58a/llama1b_b1.json).
    pub(super) const HOST_STATE_MS: f64 = 661.0;
    /// Host-to-device bandwidth of pinned copies, GB/s, each way (the link is full duplex).
    pub(super) const LINK_GBPS: f64 = 55.0;
}

/// The step time the H200 model predicts for `plan`.
fn step_ms(config: &LlamaConfig, seq: usize, batch: usize, plan: Plan) -> f64 {
    let hidden = config.hidden_size as f64;
    let rate = h200::TFLOPS * 1e12 * hidden / (hidden + h200::HALF_RATE_HIDDEN);
    let tokens = (seq * batch) as f64;
    let forward_backward = tokens * flops_per_token(config, seq) / rate * 1e3;
    let recompute_share = plan.checkpointed as f64 / config.num_hidden_layers as f64;
    let recompute = forward_backward * h200::RECOMPUTE_SHARE * recompute_share;
    let per_billion = h200::COMMON_MS
        + match plan.recipe.state {
            State::F32 => h200::F32_STATE_MS,
            State::Bits8 => h200::BITS8_STATE_MS,
            State::Bits4 | State::Bits4Streamed => h200::BITS4_STATE_MS,
            State::Host => h200::HOST_STATE_MS,
        };
    // A streamed state crosses the link once each way a step, behind the forward and backward
    // (an estimate: no streamed Llama step has been measured yet).
    let compute = match plan.recipe.state {
        State::Bits4Streamed => {
            let link_ms = streamed_bytes(&parameter_sizes(config)) as f64 / h200::LINK_GBPS * 1e-6;
            (forward_backward + recompute).max(link_ms)
        }
        _ => forward_backward + recompute,
    };
    compute + config.num_parameters() as f64 * per_billion * 1e-9
}

/// Bytes of the 4-bit state of parameters of `sizes` elements, as a streamed optimizer keeps it
/// in host memory.
fn streamed_bytes(sizes: &[usize]) -> u64 {
    sizes.iter().map(|&n| adam4bit_state_bytes(n)).sum()
}

/// The predicted peaks and step time of `plan` for `config` at `batch` rows of `seq` tokens.
pub(crate) fn predict(config: &LlamaConfig, seq: usize, batch: usize, plan: Plan) -> Prediction {
    let sizes = parameter_sizes(config);
    let state = plan.recipe.state;
    let weights: u64 = sizes.iter().map(|&n| rounded(2 * n as u64)).sum();
    let optimizer: u64 = sizes
        .iter()
        .flat_map(|&n| state_tensors(state, n))
        .map(rounded)
        .sum();
    let layer_grads: u64 = layer_sizes(config)
        .iter()
        .map(|&n| rounded(2 * n as u64))
        .sum();
    let largest_grad = sizes
        .iter()
        .map(|&n| rounded(2 * n as u64))
        .max()
        .unwrap_or(0);

    let b = DType::BF16.size_in_bytes() as u64;
    let tokens = (seq * batch) as u64;
    let (layers, k) = (config.num_hidden_layers as u64, plan.checkpointed as u64);
    let hidden = config.hidden_size as u64;
    let row = b * hidden;
    let block = tokens * config.block_activation_bytes_per_token(DType::BF16);
    let rotary = 2 * seq as u64 * config.head_dim as u64 * b;
    let input = 8 * tokens;
    // A kept block saves its input as the previous block's output (in nn's formula); the
    // embedding's output, a recomputed block's input and the final norm's input after a
    // recomputed last block are rows of their own.
    let kept = match k {
        0 => layers * block + tokens * row,
        k if k < layers => (layers - k) * block + (k + 1) * tokens * row,
        _ => (layers + 1) * tokens * row,
    } + rotary;
    let vocab = config.vocab_size as u64;
    // One tile of every row's logits with the f32 hidden-gradient accumulator and 16 bytes of
    // row statistics, or past the budget the budget and 8 bytes a row (autograd-core's tiling).
    let loss = match tokens * (b * vocab + 4 * hidden + 16) {
        whole if whole <= LOSS_CHUNK_BYTES => whole + 8,
        _ => LOSS_CHUNK_BYTES + 8 * tokens,
    };
    // A streamed state on the GPU: at most the budget coming in and as much going back, and a
    // bucket beyond each (the largest parameter's state).
    let optimizer = match state {
        State::Bits4Streamed => {
            let budget = streamed_state_budget(sizes.iter().copied());
            let largest = sizes
                .iter()
                .map(|&n| {
                    state_tensors(State::Bits4, n)
                        .into_iter()
                        .map(rounded)
                        .sum::<u64>()
                })
                .max()
                .unwrap_or(0);
            2 * (budget + largest)
        }
        _ => optimizer,
    };
    let mut phases: Vec<(&'static str, Vec<(&'static str, u64)>)> = vec![(
        "backward's start",
        vec![
            ("weights", weights),
            ("optimizer state", optimizer),
            ("activations kept", kept),
            // The final norm's output and row statistic, and the fused loss's f32 row statistics.
            ("head's saves", tokens * (row + 4 + 12)),
            ("loss chunk", loss),
            ("hidden-state gradient", tokens * row),
            ("largest gradient", largest_grad),
            ("input", input),
        ],
    )];
    if k > 0 {
        // At the block's peak, beyond its recomputed saves: two intermediate-wide gradients
        // (the SwiGLU backward's), as the allocator counts them on the tiny Llama.
        let block_backward = tokens * 2 * b * config.intermediate_size as u64;
        // Inside backward no gradient piles up, and the first recompute (block k - 1) has every
        // checkpoint live; after it, block 0's recompute has every gradient but its own.
        let (checkpoints, gradients) = if plan.recipe.in_backward {
            (k, 0)
        } else {
            (1, weights - layer_grads)
        };
        phases.push((
            "a block's recompute",
            vec![
                ("weights", weights),
                ("optimizer state", optimizer),
                ("gradients", gradients),
                ("checkpoints", checkpoints * tokens * row + rotary),
                ("recomputed block", block),
                ("block backward", block_backward),
                ("input", input),
            ],
        ));
    }
    if !plan.recipe.in_backward {
        phases.push((
            "backward's end",
            vec![
                ("weights", weights),
                ("optimizer state", optimizer),
                ("gradients", weights),
                ("embedding backward", tokens * (4 + b) * hidden),
                ("input", input),
            ],
        ));
    }
    let total = |terms: &[(&str, u64)]| terms.iter().map(|(_, bytes)| bytes).sum::<u64>();
    let (phase, terms) = phases
        .into_iter()
        .max_by_key(|(_, terms)| total(terms))
        .expect("backward's start is always a phase");
    let host_bytes = match state {
        State::Host => {
            let n: u64 = sizes.iter().map(|&n| n as u64).sum();
            10 * n + headroom_optim::DEFAULT_BUCKETS_IN_FLIGHT as u64 * largest_grad
        }
        State::Bits4Streamed => streamed_bytes(&sizes),
        _ => 0,
    };
    Prediction {
        gpu_peak: total(&terms),
        host_bytes,
        step_ms: step_ms(config, seq, batch, plan),
        phase,
        terms,
    }
}
