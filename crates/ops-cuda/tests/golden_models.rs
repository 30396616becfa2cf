//! ViT-tiny and GPT-2-tiny on the GPU in float32 against PyTorch's float64 golden tensors
//! (`testdata/models_golden.safetensors`): logits, loss and the gradient of every parameter
//! within 1e-4 (`max |ours - theirs| / max |theirs|` per tensor). The whole stack runs on CUDA:
//! the engine, every op's kernels and cuBLAS. Prints a skip notice without a CUDA device.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use headroom_autograd_core::{cross_entropy, BackendRef, DType, Generator, Reduction, Tensor};
use headroom_nn::{
    load_weights, read_tensor, Gpt2Config, Gpt2LMHeadModel, Module, VisionTransformer, VitConfig,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use safetensors::SafeTensors;

const TOLERANCE: f64 = 1e-4;

fn golden_bytes() -> Vec<u8> {
    let built = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/models_golden.safetensors"
    );
    std::fs::read(built)
        .or_else(|_| std::fs::read("testdata/models_golden.safetensors"))
        .expect("testdata/models_golden.safetensors")
}

fn relative_error(ours: &Tensor, theirs: &Tensor, what: &str) -> f64 {
    // PyTorch's golden loss is stored as [1]; ours is a scalar: compare element counts.
    assert_eq!(
        ours.numel(),
        theirs.numel(),
        "{what}: {:?} vs {:?}",
        ours.shape(),
        theirs.shape()
    );
    let (ours, theirs) = (ours.to_vec_f64().unwrap(), theirs.to_vec_f64().unwrap());
    assert!(
        ours.iter().all(|v| v.is_finite()),
        "{what}: non-finite values"
    );
    let scale = theirs.iter().fold(0.0f64, |acc, v| acc.max(v.abs()));
    let diff = ours
        .iter()
        .zip(&theirs)
        .fold(0.0f64, |acc, (a, b)| acc.max((a - b).abs()));
    diff / scale
}

/// Compares logits, loss and every gradient with the golden file; returns the worst error.
fn check(
    golden: &SafeTensors<'_>,
    model: &dyn Module,
    prefix: &str,
    logits: &Tensor,
    loss: &Tensor,
) -> f64 {
    let cpu = CpuBackend::new_ref();
    let reference = |name: &str| read_tensor(&cpu, golden, &format!("{prefix}.{name}")).unwrap();
    let mut worst = relative_error(logits, &reference("logits"), "logits");
    worst = worst.max(relative_error(loss, &reference("loss"), "loss"));
    for (name, param) in model.named_parameters() {
        let grad = param
            .grad()
            .unwrap_or_else(|| panic!("{name} has no gradient"));
        let err = relative_error(&grad, &reference(&format!("grad.{name}")), &name);
        assert!(err <= TOLERANCE, "{prefix} gradient of {name}: {err:e}");
        worst = worst.max(err);
    }
    println!("{prefix} on CUDA in f32: worst relative error {worst:.2e}");
    assert!(worst <= TOLERANCE, "{prefix}: {worst:e}");
    worst
}

fn cuda() -> Option<BackendRef> {
    match CudaBackend::new(0) {
        Ok(backend) => Some(backend as BackendRef),
        Err(err) => {
            println!("skipped: {err}");
            None
        }
    }
}

#[test]
fn vit_tiny_gradients_on_cuda_match_torchvision() {
    let Some(gpu) = cuda() else { return };
    let bytes = golden_bytes();
    let golden = SafeTensors::deserialize(&bytes).unwrap();
    let generator = Arc::new(Generator::new(0));
    let model = VisionTransformer::new(&gpu, VitConfig::tiny(), DType::F32, &generator).unwrap();
    load_weights(&model, &golden, "vit.param.").unwrap();
    let input = read_tensor(&gpu, &golden, "vit.input")
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let labels = read_tensor(&gpu, &golden, "vit.labels").unwrap();
    let logits = model.forward(&input).unwrap();
    let loss = cross_entropy(&logits, &labels, -100, Reduction::Mean).unwrap();
    loss.backward().unwrap();
    check(&golden, &model, "vit", &logits, &loss);
}

#[test]
fn gpt2_tiny_gradients_on_cuda_match_hugging_face() {
    let Some(gpu) = cuda() else { return };
    let bytes = golden_bytes();
    let golden = SafeTensors::deserialize(&bytes).unwrap();
    let generator = Arc::new(Generator::new(0));
    let model = Gpt2LMHeadModel::new(&gpu, Gpt2Config::tiny(), DType::F32, &generator).unwrap();
    load_weights(&model, &golden, "gpt2.param.").unwrap();
    let input_ids = read_tensor(&gpu, &golden, "gpt2.input_ids").unwrap();
    let logits = model.forward(&input_ids).unwrap();
    let loss = model.loss(&logits, &input_ids).unwrap();
    loss.backward().unwrap();
    check(&golden, &model, "gpt2", &logits, &loss);
}
