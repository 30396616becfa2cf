//! `plan`: which bf16 AdamW recipe trains a Llama-shaped model at a sequence length and batch
//! within a GPU (and host) memory cap, from predicted peaks — no device is touched.
//!
//! A recipe is one of bench-memory's bf16-model cases ([`RECIPES`]): where AdamW's state lives
//! and how wide it is (f32 moments, 8-bit, 4-bit, or f32 moments in host memory stepped by the
//! host), whether the step runs inside backward, and whether every block is checkpointed. Its
//! GPU peak is predicted term by term from the model's shapes ([`predict`]):
//! - weights: 2 bytes a parameter (bf16, no master copy);
//! - state: per parameter tensor as optim keeps it — 8 bytes an element for f32 moments; 8-bit:
//!   2 bytes and two f32 scales per block of 256 from 4096 elements (else 8); 4-bit: 1 byte and
//!   two f32 scales per block of 128 for whole blocks from 4096 elements (else 8); none on the
//!   GPU when offloaded;
//! - activations: nn's per-token formula ([`LlamaConfig::block_activation_bytes_per_token`],
//!   exact against the allocator) times layers and tokens, plus the embedding's output; with
//!   checkpointing only each block's input;
//! - at the peak: inside backward, the largest single gradient (the head's, stepped alone) while
//!   every activation is still live; stepping after backward, every gradient at once;
//! - the fused loss's chunk of logits (64 MiB).
//!
//! Host bytes: the offloaded state (f32 moments and a bf16 copy, 10 bytes a parameter) and up to
//! [`headroom_optim::DEFAULT_BUCKETS_IN_FLIGHT`] pinned staging blocks of the largest gradient.
//! The recipes are ordered by their measured speed on the H200 (fastest first: activations kept
//! before recomputed, state on the GPU before the host, wider state before narrower), and the
//! plan is the first that fits. Step time is not predicted yet, and the plain-step recipes
//! with every activation kept (`adamw8bit_bf16`, `adamw4bit_bf16`) have no measured peak of
//! ours to hold their prediction to (the test holds the eight that do).
//!
//! `--find-max-model` walks the standard shapes (Llama-3.2-1B, 3B, Llama-3.1-8B, Qwen2.5-14B,
//! 32B, Llama-3.1-70B; not yet the widths and depths between them) and reports the largest
//! whose plan fits, from the same predictions: nothing is measured.
//!
//! It sits on nn's Llama configs and optim's quantisation constants; it knows no device.

use anyhow::{bail, Result};
use headroom_autograd_core::DType;
use headroom_nn::LlamaConfig;
use headroom_optim::kernels::{is_quantized_4bit, AO_BLOCK_SIZE, BNB_BLOCK_SIZE, MIN_8BIT_SIZE};

/// `plan`'s options.
#[derive(Debug, clap::Args)]
#[command(
    about = "Pick the fastest bf16 AdamW recipe whose predicted GPU (and host) peak fits",
    long_about = "Predicts, for a Llama-shaped model at a sequence length and batch, the GPU peak \
                  and host bytes of each bf16-model AdamW recipe (bench-memory's case names: \
                  state width and place, in backward or not, checkpointed or not) from the \
                  model's shapes, and picks the fastest that fits the caps. Nothing runs on a \
                  device; `bench-memory --cases <recipe>` measures one."
)]
pub(crate) struct Args {
    /// A Llama-shaped model: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-14b, qwen2.5-32b,
    /// llama-3.1-70b, llama-tiny.
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// Tokens a row.
    #[arg(long, default_value_t = 2048, value_parser = crate::at_least_one)]
    seq: usize,
    /// Rows a step.
    #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
    batch: usize,
    /// GPU memory the plan may use, MiB (default: an H200's 139 GiB).
    #[arg(long, value_name = "MIB", default_value_t = 139 * 1024)]
    memory_cap_mb: u64,
    /// Host memory the plan may use, MiB (default: no limit).
    #[arg(long, value_name = "MIB")]
    host_cap_mb: Option<u64>,
    /// Instead of one model: the plan of each standard shape (Llama-3.2-1B and 3B, Llama-3.1-8B,
    /// Qwen2.5-14B and 32B, Llama-3.1-70B) and the largest whose plan fits — predicted, not
    /// measured.
    #[arg(long, conflicts_with = "model")]
    find_max_model: bool,
}

/// The standard shapes `--find-max-model` walks, smallest first.
const STANDARD_SHAPES: [&str; 6] = LlamaConfig::STANDARD_NAMES;

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
}

/// One recipe: bench-memory's case of that name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recipe {
    pub(crate) case: &'static str,
    pub(crate) state: State,
    pub(crate) in_backward: bool,
    pub(crate) checkpointed: bool,
}

/// The recipes, fastest first (their measured order on the H200 at Llama-3.1-8B).
pub(crate) const RECIPES: [Recipe; 9] = [
    recipe("adamw_inbwd_bf16", State::F32, true, false),
    recipe("adamw8bit_inbwd_bf16", State::Bits8, true, false),
    recipe("adamw4bit_inbwd_bf16", State::Bits4, true, false),
    recipe("adamw8bit_bf16", State::Bits8, false, false),
    recipe("adamw4bit_bf16", State::Bits4, false, false),
    recipe("adamw8bit_inbwd_bf16_ckpt", State::Bits8, true, true),
    recipe("adamw4bit_inbwd_bf16_ckpt", State::Bits4, true, true),
    recipe("adamw4bit_bf16_ckpt", State::Bits4, false, true),
    recipe("adamw_offload_inbwd_bf16", State::Host, true, false),
];

const fn recipe(case: &'static str, state: State, in_backward: bool, checkpointed: bool) -> Recipe {
    Recipe {
        case,
        state,
        in_backward,
        checkpointed,
    }
}

/// Bytes of the fused loss's chunk of logits (autograd-core's default `chunk_bytes`).
const LOSS_CHUNK_BYTES: u64 = 64 << 20;

/// A recipe's predicted peaks, with the GPU peak's terms.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Prediction {
    pub(crate) gpu_peak: u64,
    pub(crate) host_bytes: u64,
    pub(crate) terms: Vec<(&'static str, u64)>,
}

/// Every parameter tensor's element count, in the model's order.
fn parameter_sizes(config: &LlamaConfig) -> Vec<usize> {
    let hidden = config.hidden_size;
    let q_width = config.num_attention_heads * config.head_dim;
    let kv_width = config.num_key_value_heads * config.head_dim;
    let mut sizes = vec![config.vocab_size * hidden];
    for _ in 0..config.num_hidden_layers {
        sizes.extend([
            hidden,
            hidden * q_width,
            hidden * kv_width,
            hidden * kv_width,
        ]);
        if config.qkv_bias {
            sizes.extend([q_width, kv_width, kv_width]);
        }
        sizes.extend([q_width * hidden, hidden]);
        sizes.extend([hidden * config.intermediate_size; 3]);
    }
    sizes.push(hidden);
    if !config.tie_word_embeddings {
        sizes.push(config.vocab_size * hidden);
    }
    sizes
}

/// Bytes of AdamW's state for a parameter of `n` elements kept as `state` on the GPU.
fn state_bytes(state: State, n: usize) -> u64 {
    let n = n as u64;
    match state {
        State::F32 => 8 * n,
        State::Bits8 if n as usize >= MIN_8BIT_SIZE => {
            2 * n + 8 * n.div_ceil(BNB_BLOCK_SIZE as u64)
        }
        State::Bits4 if is_quantized_4bit(n as usize) => n + 8 * (n / AO_BLOCK_SIZE as u64),
        State::Bits8 | State::Bits4 => 8 * n,
        State::Host => 0,
    }
}

/// The predicted peaks of `recipe` for `config` at `batch` rows of `seq` tokens.
pub(crate) fn predict(
    config: &LlamaConfig,
    seq: usize,
    batch: usize,
    recipe: Recipe,
) -> Prediction {
    let sizes = parameter_sizes(config);
    let params: u64 = sizes.iter().map(|&n| 2 * n as u64).sum();
    let state: u64 = sizes.iter().map(|&n| state_bytes(recipe.state, n)).sum();
    let tokens = (seq * batch) as u64;
    let hidden_row = 2 * config.hidden_size as u64;
    let layers = config.num_hidden_layers as u64;
    let activations = if recipe.checkpointed {
        layers * tokens * hidden_row
    } else {
        layers * tokens * config.block_activation_bytes_per_token(DType::BF16)
    } + tokens * hidden_row;
    let largest_grad = sizes.iter().map(|&n| 2 * n as u64).max().unwrap_or(0);
    let mut terms = vec![("weights", params), ("optimizer state", state)];
    if recipe.in_backward {
        // Backward's start: every activation live, the head's gradient stepped alone.
        terms.extend([
            ("activations", activations),
            ("largest gradient", largest_grad),
        ]);
    } else if recipe.checkpointed {
        // Backward's end: every gradient, the checkpoints freed as their blocks were done.
        terms.push(("gradients", params));
    } else {
        // Backward's start or end, whichever holds more.
        terms.push((
            "activations or gradients",
            activations.max(params) + largest_grad,
        ));
    }
    terms.push(("loss chunk", LOSS_CHUNK_BYTES));
    let host_bytes = match recipe.state {
        State::Host => {
            let n: u64 = sizes.iter().map(|&n| n as u64).sum();
            10 * n + headroom_optim::DEFAULT_BUCKETS_IN_FLIGHT as u64 * largest_grad
        }
        _ => 0,
    };
    Prediction {
        gpu_peak: terms.iter().map(|(_, bytes)| bytes).sum(),
        host_bytes,
        terms,
    }
}

/// The first (fastest) recipe whose predicted peaks fit `cap` (and `host_cap`).
fn choose(
    config: &LlamaConfig,
    seq: usize,
    batch: usize,
    cap: u64,
    host_cap: Option<u64>,
) -> Option<(Recipe, Prediction)> {
    RECIPES.into_iter().find_map(|recipe| {
        let prediction = predict(config, seq, batch, recipe);
        let fits =
            prediction.gpu_peak <= cap && host_cap.is_none_or(|c| prediction.host_bytes <= c);
        fits.then_some((recipe, prediction))
    })
}

/// `--find-max-model`: each standard shape's plan, and the largest that has one.
fn find_max_model(args: &Args) -> Result<()> {
    let (cap, host_cap) = (
        args.memory_cap_mb << 20,
        args.host_cap_mb.map(|mb| mb << 20),
    );
    println!(
        "predicted plans at {} rows of {} tokens, GPU cap {} MiB{} (bf16 weights, AdamW)\n",
        args.batch,
        args.seq,
        args.memory_cap_mb,
        args.host_cap_mb
            .map_or(String::new(), |mb| format!(", host cap {mb} MiB"))
    );
    println!(
        "{:<16} {:>16}  {:<28} {:>16} {:>16}",
        "model", "parameters", "plan", "GPU peak (B)", "host (B)"
    );
    let mut largest = None;
    for name in STANDARD_SHAPES {
        let config = LlamaConfig::named(name).expect("a standard shape has a config");
        let n = config.num_parameters();
        match choose(&config, args.seq, args.batch, cap, host_cap) {
            Some((recipe, prediction)) => {
                println!(
                    "{name:<16} {n:>16}  {:<28} {:>16} {:>16}",
                    recipe.case, prediction.gpu_peak, prediction.host_bytes
                );
                largest = Some((name, n));
            }
            None => println!("{name:<16} {n:>16}  {:<28}", "none fits"),
        }
    }
    match largest {
        Some((name, n)) => {
            println!(
                "\nlargest that fits (predicted): {name}, {n} parameters. Measure it with `cargo \
                 xtask bench-memory --model {name} --seq {} --batch {} --cases <its plan>`.",
                args.seq, args.batch
            );
            Ok(())
        }
        None => bail!(
            "no standard shape fits {} MiB at batch {}: lower --batch or --seq",
            args.memory_cap_mb,
            args.batch
        ),
    }
}

/// Runs `plan`: every recipe's prediction, and the first (fastest) that fits.
pub(crate) fn run(args: Args) -> Result<()> {
    if args.find_max_model {
        return find_max_model(&args);
    }
    let Some(config) = LlamaConfig::named(&args.model) else {
        bail!(
            "--model {}: not a Llama-shaped model ({}, llama-tiny)",
            args.model,
            STANDARD_SHAPES.join(", ")
        );
    };
    let cap = args.memory_cap_mb << 20;
    let host_cap = args.host_cap_mb.map(|mb| mb << 20);
    println!(
        "{}, {} rows of {} tokens, bf16 weights without a master copy, AdamW; GPU cap {} MiB{}",
        args.model,
        args.batch,
        args.seq,
        args.memory_cap_mb,
        host_cap.map_or(String::new(), |_| format!(
            ", host cap {} MiB",
            args.host_cap_mb.unwrap_or(0)
        ))
    );
    println!(
        "\n{:<28} {:>16} {:>16}  fits",
        "recipe (fastest first)", "GPU peak (B)", "host (B)"
    );
    let mut chosen = None;
    for recipe in RECIPES {
        let prediction = predict(&config, args.seq, args.batch, recipe);
        let fits =
            prediction.gpu_peak <= cap && host_cap.is_none_or(|c| prediction.host_bytes <= c);
        println!(
            "{:<28} {:>16} {:>16}  {}",
            recipe.case,
            prediction.gpu_peak,
            prediction.host_bytes,
            if fits { "yes" } else { "no" }
        );
        if fits && chosen.is_none() {
            chosen = Some((recipe, prediction));
        }
    }
    match chosen {
        Some((recipe, prediction)) => {
            let terms: Vec<String> = prediction
                .terms
                .iter()
                .map(|(name, bytes)| format!("{name} {bytes}"))
                .collect();
            println!(
                "\nplan: {} (predicted GPU peak {} B: {}). Measure it with `cargo xtask \
                 bench-memory --model {} --seq {} --batch {} --cases {}`.",
                recipe.case,
                prediction.gpu_peak,
                terms.join(", "),
                args.model,
                args.seq,
                args.batch,
                recipe.case
            );
            Ok(())
        }
        None => bail!(
            "no recipe fits {} MiB at batch {}: lower --batch or --seq, or raise --memory-cap-mb",
            args.memory_cap_mb,
            args.batch
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Peaks bench-memory measured on the H200 (`peak_allocated_bytes`): the model, batch,
    /// recipe and bytes, with the file each comes from.
    const MEASURED: [(&str, usize, &str, u64); 8] = [
        // results/2026-12-02-3040c90/llama8b_adamw4bit_inbwd_bf16.json
        ("llama-3.1-8b", 1, "adamw4bit_inbwd_bf16", 34_924_668_928),
        // results/2026-12-02-532f72f/llama8b_adamw4bit_inbwd_bf16_b4.json
        ("llama-3.1-8b", 4, "adamw4bit_inbwd_bf16", 62_485_268_480),
        // results/2026-12-02-532f72f/llama8b_adamw4bit_inbwd_bf16_b8.json
        ("llama-3.1-8b", 8, "adamw4bit_inbwd_bf16", 99_231_483_904),
        // results/2026-12-02-ea5bc51/llama8b_adamw_inbwd_bf16.json
        ("llama-3.1-8b", 1, "adamw_inbwd_bf16", 90_634_556_416),
        // results/2026-12-02-3040c90/llama8b_adamw4bit_inbwd_bf16_ckpt.json
        (
            "llama-3.1-8b",
            1,
            "adamw4bit_inbwd_bf16_ckpt",
            26_325_821_440,
        ),
        // results/2026-12-02-3040c90/llama8b_adamw4bit_bf16_ckpt.json
        ("llama-3.1-8b", 1, "adamw4bit_bf16_ckpt", 40_703_727_616),
        // results/2026-12-02-96d77e3/llama1b_offload.json
        ("llama-3.2-1b", 1, "adamw_inbwd_bf16", 15_495_021_568),
        ("llama-3.2-1b", 1, "adamw_offload_inbwd_bf16", 5_608_502_272),
    ];

    /// Every measured peak is predicted within 2% (the bound for plans).
    #[test]
    fn predicted_peaks_are_within_two_percent_of_the_measured_ones() {
        for (model, batch, case, measured) in MEASURED {
            let config = LlamaConfig::named(model).unwrap();
            let recipe = RECIPES.iter().find(|r| r.case == case).unwrap();
            let predicted = predict(&config, 2048, batch, *recipe).gpu_peak;
            let error = predicted as f64 / measured as f64 - 1.0;
            assert!(
                error.abs() <= 0.02,
                "{model} {case} batch {batch}: predicted {predicted}, measured {measured} \
                 ({:+.2}%)",
                100.0 * error
            );
        }
    }

    /// Under an H200's 139 GiB at 2048 tokens, the largest standard shape with a plan is
    /// Qwen2.5-32B (4-bit states inside backward, every activation kept); Llama-3.1-70B has none
    /// (its bf16 weights alone are 141 GB).
    #[test]
    fn the_largest_standard_shape_under_an_h200_is_qwen2_5_32b() {
        let cap = 139u64 << 30;
        let plan = |name| choose(&LlamaConfig::named(name).unwrap(), 2048, 1, cap, None);
        let (recipe, prediction) = plan("qwen2.5-32b").expect("32B has a plan");
        assert_eq!(recipe.case, "adamw4bit_inbwd_bf16");
        assert!(prediction.gpu_peak <= cap);
        assert!(plan("llama-3.1-70b").is_none());
    }

    /// The state terms are optim's: Llama-3.1-8B's 4-bit state is the 8,532,152,576 bytes
    /// bench-memory counted, its f32 moments 64,242,089,984.
    #[test]
    fn state_bytes_are_the_optimizers() {
        let config = LlamaConfig::llama_3_1_8b();
        let state = |state| -> u64 {
            parameter_sizes(&config)
                .iter()
                .map(|&n| state_bytes(state, n))
                .sum()
        };
        assert_eq!(state(State::Bits4), 8_532_152_576);
        assert_eq!(state(State::F32), 64_242_089_984);
        assert_eq!(
            parameter_sizes(&config).iter().sum::<usize>(),
            config.num_parameters()
        );
    }
}
