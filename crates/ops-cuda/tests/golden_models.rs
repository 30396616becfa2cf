//! The golden models on the GPU in float32 against float64 references: ViT-tiny and GPT-2-tiny
//! against PyTorch's (`testdata/models_golden.safetensors`) within 1e-4, the tiny Llama and Qwen2
//! against Hugging Face's (`testdata/llama_golden.safetensors`) within 4e-6 (nn's float32 bound on
//! the CPU, where it is measured; issue 30 asks 1e-6): logits,
//! loss and the gradient of every parameter (`max |ours - theirs| / max |theirs|` per tensor).
//! The whole stack runs on CUDA: the engine, every op's kernels and cuBLAS. The runs and the
//! comparisons are testkit's, shared with nn's CPU tests. Marked `#[ignore = "needs a CUDA
//! device"]`: they run with `--include-ignored`.
#![cfg(feature = "cuda")]

use headroom_autograd_core::{BackendRef, DType};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::golden::{self, GoldenModel};
use headroom_testkit::gpu::backend_or_skip;
use headroom_testkit::llama_golden::{run_llama_golden, LlamaGolden};
use safetensors::SafeTensors;

const TOLERANCE: f64 = 1e-4;

/// The device as the `BackendRef` tensors take, or `None` after the GPU gate's skip notice.
#[track_caller]
fn cuda_backend() -> Option<BackendRef> {
    backend_or_skip(CudaBackend::new(0))
}

/// Runs `which` on the GPU in float32 and holds it to the golden file within [`TOLERANCE`].
fn check_on_cuda(which: GoldenModel) {
    let Some(gpu) = cuda_backend() else { return };
    let bytes = golden::models_golden();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let model = which.build(&gpu, DType::F32).unwrap();
    let run = golden::forward_backward(&gpu, &file, which, model).unwrap();
    golden::check(&file, &run, TOLERANCE);
}

#[test]
#[ignore = "needs a CUDA device"]
fn vit_tiny_gradients_on_cuda_match_torchvision() {
    check_on_cuda(GoldenModel::VitTiny);
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpt2_tiny_gradients_on_cuda_match_hugging_face() {
    check_on_cuda(GoldenModel::Gpt2Tiny);
}

/// The tiny Llama or Qwen2 on the GPU in float32 against Hugging Face's float64 run (testkit's
/// `llama_golden`), within nn's float32 bound on the CPU (4e-6) for every tensor.
fn check_llama_on_cuda(which: LlamaGolden) {
    let Some(gpu) = cuda_backend() else { return };
    let errors = run_llama_golden(&gpu, which, DType::F32).unwrap();
    println!("{which:?} on CUDA in float32: {errors:?} (relative)");
    assert!(errors.worst() <= 4e-6, "{which:?}: {errors:?}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn llama_tiny_gradients_on_cuda_match_hugging_face() {
    check_llama_on_cuda(LlamaGolden::LlamaTiny);
}

#[test]
#[ignore = "needs a CUDA device"]
fn qwen2_tiny_gradients_on_cuda_match_hugging_face() {
    check_llama_on_cuda(LlamaGolden::Qwen2Tiny);
}
