//! ViT-tiny and GPT-2-tiny on the GPU in float32 against PyTorch's float64 golden tensors
//! (`testdata/models_golden.safetensors`): logits, loss and the gradient of every parameter
//! within 1e-4 (`max |ours - theirs| / max |theirs|` per tensor). The whole stack runs on CUDA:
//! the engine, every op's kernels and cuBLAS. The run and the comparison are testkit's, shared
//! with nn's float64 test on the CPU. Marked `#[ignore = "needs a CUDA device"]`: it runs with
//! `--include-ignored`.
#![cfg(feature = "cuda")]

use headroom_autograd_core::{BackendRef, DType};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::golden::{self, GoldenModel};
use headroom_testkit::gpu::cuda_or_skip;
use safetensors::SafeTensors;

const TOLERANCE: f64 = 1e-4;

/// Runs `which` on the GPU in float32 and holds it to the golden file within [`TOLERANCE`].
fn check_on_cuda(which: GoldenModel) {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let gpu: BackendRef = cuda;
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
