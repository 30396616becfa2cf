//! The tiny Llama and Qwen2 against Hugging Face transformers' float64 run (logits, loss, every
//! parameter's gradient; testkit's `llama_golden`, shared with ops-cuda's GPU test), on the CPU
//! in float64 and in float32.
//!
//! Errors are `max |ours - theirs| / max |theirs|` per tensor. In float64 the bound is issue 30's
//! 1e-6 (measured: logits 2.8e-7 and 2.9e-7, worst gradient 4.4e-7 and 7.4e-7 for Llama and
//! Qwen2): what remains is Hugging Face's own float32 rounding, for its float64 model rounds to
//! float32 in its RMSNorm (`.to(torch.float32)`), its rotary tables, eager attention's softmax
//! and the loss (`logits.float()`); ours rounds only the rotary tables and the loss. In float32
//! every op rounds: measured on the CPU, logits 8.7e-7 and 1.09e-6, the loss exact, worst
//! gradient 2.1e-6 (Llama's tied embedding, a sum over every token) and 1.5e-6 (Qwen2's v bias),
//! so the float32 bound is 4e-6, about 34 float32 ulps of the largest entry: issue 30 asks 1e-6
//! there, which float32 accumulation does not reach. Hugging Face's own models in float32, from
//! the same parameters and batch, miss it too: logits 8.3e-7 and 1.0e-6, worst gradient 1.46e-6
//! (Llama's layer-1 k_proj) and 1.88e-6 (Qwen2's layer-0 v bias) on the CPU
//! (`scripts/golden/llama_tiny_f32_floor.py`, `results/2026-12-02-22e1815/`). Run with
//! `--nocapture` to see the errors.

use headroom_autograd_core::DType;
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::llama_golden::{run_llama_golden, LlamaGolden};

/// Runs `which` in `dtype` on the CPU and holds every error to the dtype's bound (see the
/// file's docs).
fn check(which: LlamaGolden, dtype: DType) {
    let tolerance = if dtype == DType::F64 { 1e-6 } else { 4e-6 };
    let errors = run_llama_golden(&CpuBackend::new_ref(), which, dtype).unwrap();
    println!("{which:?} on the CPU in {dtype:?}: {errors:?} (relative)");
    assert!(
        errors.worst() <= tolerance,
        "{which:?} in {dtype:?}: {errors:?}"
    );
}

#[test]
fn llama_tiny_matches_hugging_face_in_float64() {
    check(LlamaGolden::LlamaTiny, DType::F64);
}

#[test]
fn qwen2_tiny_matches_hugging_face_in_float64() {
    check(LlamaGolden::Qwen2Tiny, DType::F64);
}

#[test]
fn llama_tiny_matches_hugging_face_in_float32() {
    check(LlamaGolden::LlamaTiny, DType::F32);
}

#[test]
fn qwen2_tiny_matches_hugging_face_in_float32() {
    check(LlamaGolden::Qwen2Tiny, DType::F32);
}
