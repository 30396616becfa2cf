//! `bench-memory` on the tiny Llama on the CPU: exact parameter, gradient and state bytes, and
//! the last block's saves adding up, byte for byte, to what the block keeps and to nn's formula
//! of a block's activation bytes per token, in f32 and in bf16 with every block checkpointed;
//! and the Llama names, sequence lengths and their errors on the command line.

use headroom_autograd_core::{DType, LinearCrossEntropyOptions};
use headroom_nn::LlamaConfig;
use serde_json::Value;

use super::block_saves::Storage;
use super::cases::Case;
use super::execute;
use super::models::{Arch, Model};
use super::tests::{args, parse};
use crate::cli_tests::assert_rejected;

/// The command line of one measured step of `cases` on the tiny Llama on the CPU (batch 2 × 16
/// tokens, one warm-up), its JSON written to `json`.
fn tiny_llama_run<'a>(cases: &'a str, json: &'a std::path::Path) -> Vec<&'a str> {
    vec![
        "--device",
        "cpu",
        "--model",
        "llama-tiny",
        "--seq",
        "16",
        "--batch",
        "2",
        "--cases",
        cases,
        "--warmup",
        "1",
        "--steps",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]
}

#[test]
fn bench_memory_on_the_tiny_llama_names_every_byte_a_block_keeps() {
    let path =
        std::env::temp_dir().join(format!("headroom-llama-bench-{}.json", std::process::id()));
    let (batch, seq) = (2u64, 16u64);
    let words = tiny_llama_run("fwd_bwd,adam_fused,fwd_bwd_bf16_ckpt", &path);
    let mut options = parse(&args(&words)).unwrap();
    options.progress = false;
    let results = execute(&options).unwrap();
    let config = LlamaConfig::tiny();
    let n_params = config.num_parameters() as u64;
    // Embedding 128·64, per layer q 64·64, k and v 64·32, o 64·64, MLP 3·64·128 and two norms
    // of 64; final norm 64 and the untied head 128·64.
    assert_eq!(
        n_params,
        8_192 + 2 * (4_096 + 2 * 2_048 + 4_096 + 24_576 + 128) + 64 + 8_192
    );
    let document: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let cases = document["cases"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    for ((result, json), (case, dtype, state_bytes)) in results.iter().zip(cases).zip([
        // In report order (`Case::ALL`).
        (Case::AdamFused, DType::F32, 8 * n_params),
        (Case::FwdBwd, DType::F32, 0),
        (Case::FwdBwdBf16Ckpt, DType::BF16, 0),
    ]) {
        let name = case.name();
        let b = dtype.size_in_bytes() as u64;
        assert_eq!((result.case, result.model), (case, "llama-tiny"));
        assert_eq!(json["model"], "llama-tiny", "{name}");
        assert_eq!(result.param_bytes, b * n_params, "{name}");
        assert_eq!(result.grad_bytes, b * n_params, "{name}");
        assert_eq!(result.state_bytes, state_bytes, "{name}");
        assert_eq!(
            result.at_peak.total(),
            json["traced_step"]["peak_allocated_bytes"]
        );

        // The last block (1 of 2) kept exactly what nn's formula says for its 32 tokens, and
        // every byte of it is a named save's new storage or the output (the next input).
        let saves = result.block_saves.as_ref().unwrap();
        let per_token = config.block_activation_bytes_per_token(dtype);
        assert_eq!(saves.block, 1, "{name}");
        assert_eq!(saves.tokens, Some(batch * seq), "{name}");
        assert_eq!(saves.kept_bytes, per_token * batch * seq, "{name}");
        assert_eq!(saves.formula_bytes(), Some(saves.kept_bytes), "{name}");
        assert_eq!(saves.unexplained_bytes, 0, "{name}");
        assert_eq!(saves.output_bytes, 64 * b * batch * seq, "{name}");
        // One new storage per nonzero term but the output, each the term's bytes.
        let terms = config.block_activation_terms(dtype);
        let mut expected: Vec<u64> = terms[..terms.len() - 1]
            .iter()
            .filter(|(_, bytes)| *bytes > 0)
            .map(|(_, bytes)| bytes * batch * seq)
            .collect();
        let mut new: Vec<u64> = saves
            .saves
            .iter()
            .filter(|save| save.storage == Storage::New)
            .map(|save| save.storage_bytes)
            .collect();
        expected.sort_unstable();
        new.sort_unstable();
        assert_eq!(new, expected, "{name}");
        // The seven matrices and two norm weights are saved as parameters. From outside the
        // block: the rotary tables, four times (cos and sin, for q and k), and the block's
        // input, which the first fused norm saves (in every dtype: it upcasts in registers).
        let count = |storage: Storage| saves.saves.iter().filter(|s| s.storage == storage).count();
        assert_eq!(count(Storage::Parameter), 7 + 2, "{name}");
        assert_eq!(count(Storage::Outside), 4 + 1, "{name}");
        let json_saves = &json["block_saves"];
        assert_eq!(json_saves["kept_bytes"], saves.kept_bytes, "{name}");
        assert_eq!(json_saves["unexplained_bytes"], 0, "{name}");
        assert_eq!(
            json_saves["saves"].as_array().unwrap().len(),
            saves.saves.len()
        );
        assert_eq!(json_saves["saves"][0]["op"], saves.saves[0].op, "{name}");
    }
}

#[test]
fn llama_names_and_sequence_lengths_are_checked() {
    // The published shapes default to 2048 tokens a row, the tiny ones to their 64.
    for (name, seq, layers) in [
        ("llama-3.2-1b", 2048, 16),
        ("llama-3.2-3b", 2048, 28),
        ("llama-3.1-8b", 2048, 32),
        ("llama-tiny", 64, 2),
        ("qwen2-tiny", 64, 2),
    ] {
        let model = Model::named(name).unwrap();
        assert!(
            matches!(model.arch, Arch::Language { seq: s, .. } if s == seq),
            "{name}"
        );
        assert_eq!(model.n_blocks(), layers, "{name}");
    }
    let deeper = parse(&args(&["--model", "llama-tiny", "--layers", "5"]))
        .unwrap()
        .model
        .unwrap();
    assert_eq!((deeper.n_blocks(), deeper.layers), (5, Some(5)));
    let eight_b = parse(&args(&["--model", "llama-3.1-8b", "--seq", "4096"]))
        .unwrap()
        .model
        .unwrap();
    assert!(matches!(eight_b.arch, Arch::Language { seq: 4096, .. }));
    assert_rejected(
        parse,
        &[
            (
                &["--model", "llama-tiny", "--seq", "65"][..],
                "--seq 65: llama-tiny takes 2 to 64 tokens a row",
            ),
            (
                &["--model", "llama-3.2-1b", "--seq", "1"],
                "--seq 1: llama-3.2-1b takes 2 to 131072 tokens a row",
            ),
            (
                &["--model", "llama-2-7b"],
                "invalid value 'llama-2-7b' for '--model <MODEL>'",
            ),
            (
                &["--model", "vit_tiny", "--unfused-loss"],
                "--unfused-loss is for language models",
            ),
            (
                &["--model", "gpt2", "--layers", "3"],
                "--layers is for the Llama family",
            ),
            (&["--model", "llama-tiny", "--layers", "0"], "--layers 0"),
            (&["--layers", "3"], "--layers needs --model"),
            (
                &[
                    "--model",
                    "llama-tiny",
                    "--checkpoint-blocks",
                    "3",
                    "--cases",
                    "adam_ckpt",
                ],
                "--checkpoint-blocks 3: llama-tiny has 2 blocks",
            ),
            (
                &[
                    "--model",
                    "llama-tiny",
                    "--checkpoint-blocks",
                    "1",
                    "--cases",
                    "adam_fused",
                ],
                "adam_fused checkpoints no block",
            ),
        ],
    );
}

/// The logits line on the tiny Llama (batch 2 × 16 tokens: 32 rows of 128 classes), f32 and
/// bf16, stepped after backward and in it. Unfused, exactly the logits and their gradient,
/// `2 · rows · vocab · b`, with the I64 targets (8 bytes a row), the loss's f32 statistic (4 a
/// row) and an 8-byte scalar. Fused (the default), one tile of every row (the budget's 64 MiB
/// holds them all): the logits in the dtype (in bf16 with the backward's f32 accumulator of the
/// rows' hidden gradient), with at most the op's 64 bytes a row of per-row vectors beside; never more than the unfused figure in f32, and
/// within the op's bound, `chunk_bytes + 8 · rows`. The JSON carries the same figure.
#[test]
fn the_logits_line_is_two_unfused_logits_or_one_fused_chunk() {
    let path = std::env::temp_dir().join(format!("headroom-logits-{}.json", std::process::id()));
    let config = LlamaConfig::tiny();
    let (rows, vocab, hidden) = (32u64, config.vocab_size as u64, config.hidden_size as u64);
    let chunk_bytes = LinearCrossEntropyOptions::default().chunk_bytes as u64;
    for unfused in [false, true] {
        let mut words = tiny_llama_run("fwd_bwd,adam_inbwd,fwd_bwd_bf16", &path);
        if unfused {
            words.push("--unfused-loss");
        }
        let mut options = parse(&args(&words)).unwrap();
        options.progress = false;
        let results = execute(&options).unwrap();
        let document: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(results.len(), 3);
        for (r, json) in results.iter().zip(document["cases"].as_array().unwrap()) {
            let name = format!("{} unfused {unfused}", r.case.name());
            let logits = r.logits_bytes.unwrap();
            assert_eq!(json["logits_bytes"], logits, "{name}");
            let b = r.case.param_dtype().size_in_bytes() as u64;
            if unfused {
                assert_eq!(logits, 2 * rows * vocab * b + 12 * rows + 8, "{name}");
            } else {
                // One tile of logits in the parameters' dtype (the tiny vocabulary is one tile
                // of every row), in bf16 beside the backward's f32 accumulator of the rows'
                // hidden gradient, and up to 64 B a row of per-row vectors.
                let accumulator = if b < 4 { rows * hidden * 4 } else { 0 };
                let chunk = rows * vocab * b + accumulator;
                assert!(
                    (chunk..=chunk + 64 * rows).contains(&logits),
                    "{name}: {logits}"
                );
                assert!(logits <= chunk_bytes + 8 * rows, "{name}");
                if b == 4 {
                    assert!(logits < 2 * rows * vocab * b, "{name}: {logits}");
                }
            }
        }
    }
}
