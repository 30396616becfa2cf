//! Memory accounting against PyTorch: the `allocated` figures of the memory-analysis seed's two
//! examples (`testdata/golden_memory_seed.json`, PyTorch 2.11 on an H200), reproduced byte for
//! byte by the CPU backend's caching allocator.
//!
//! Rows compared, and why:
//! - `seed_two_linear`: every row (`linear1`, `linear2`, `inputs 1024x1024`, and forward+loss /
//!   backward of both iterations). No cuBLAS workspace appears in these figures — each equals
//!   the live tensors' sizes rounded to 512 B — so they are compared unchanged. They cover the
//!   saved activation kept by forward (`h`, 4 MiB), the output freed as soon as `.sum()` no
//!   longer needs it, the activation released by backward, and gradients accumulated in place.
//! - `seed_linear_adamw`: `model`, `inputs`, `iter0 forward`, `iter0 loss`, `iter0 backward`.
//!   PyTorch's first matrix product allocates a 32 MiB cuBLAS workspace through the caching
//!   allocator (the jump at `iter0 forward`), and backward, which runs on autograd's device
//!   thread with its own cuBLAS handle, a second one: `iter0 backward` is the live tensors plus
//!   exactly 2 × 32 MiB. Our GEMM needs no workspace, so those rows are compared minus 32 MiB
//!   (forward, loss) and 64 MiB (backward). `optimizer created` and every later row hold AdamW
//!   state: they belong to the optimizer's tests (crates/optim).

use std::sync::Arc;

use headroom_autograd_core::{DType, Generator, Tensor};
use headroom_nn::Linear;
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::memory::allocated;

/// PyTorch's cuBLAS workspace (`CUBLAS_WORKSPACE_CONFIG` default on Hopper: 32 MiB).
const CUBLAS_WORKSPACE: i64 = 32 << 20;

fn golden_rows(key: &str) -> Vec<(String, i64)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/golden_memory_seed.json"
    );
    let text = std::fs::read_to_string(path).expect("testdata/golden_memory_seed.json");
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json[key]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row["step"].as_str().unwrap().to_owned(),
                row["allocated"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn two_linears_with_accumulation_allocate_what_pytorch_allocates() {
    let cpu = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(0));
    let mut measured = Vec::new();
    let linear1 = Linear::new(&cpu, 1024, 1024, false, DType::F32, &generator).unwrap();
    measured.push(("linear1".to_owned(), allocated(&cpu)));
    let linear2 = Linear::new(&cpu, 1024, 1, false, DType::F32, &generator).unwrap();
    measured.push(("linear2".to_owned(), allocated(&cpu)));
    let x = Tensor::ones(&cpu, &[1024, 1024], DType::F32).unwrap();
    measured.push(("inputs 1024x1024".to_owned(), allocated(&cpu)));
    // As in Python, the new loss is computed before the old one is released.
    let mut loss = None;
    for iter in 0..2 {
        let hidden = linear1.forward(&x).unwrap();
        loss = Some(linear2.forward(&hidden).unwrap().sum_all().unwrap());
        drop(hidden);
        measured.push((format!("iter{iter} forward+loss"), allocated(&cpu)));
        loss.as_ref().unwrap().backward().unwrap();
        measured.push((format!("iter{iter} backward"), allocated(&cpu)));
    }
    assert_eq!(measured, golden_rows("seed_two_linear"));
    drop((loss, x, linear1, linear2));
    assert_eq!(allocated(&cpu), 0);
}

#[test]
fn linear_forward_loss_and_backward_allocate_what_pytorch_allocates_without_cublas() {
    let cpu = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(0));
    let golden = golden_rows("seed_linear_adamw");
    let workspace = |step: &str| match step {
        "iter0 forward" | "iter0 loss" => CUBLAS_WORKSPACE,
        "iter0 backward" => 2 * CUBLAS_WORKSPACE,
        _ => 0,
    };
    let expected: Vec<(String, i64)> = golden
        .iter()
        .filter(|(step, _)| {
            [
                "model",
                "inputs",
                "iter0 forward",
                "iter0 loss",
                "iter0 backward",
            ]
            .contains(&step.as_str())
        })
        .map(|(step, bytes)| (step.clone(), bytes - workspace(step)))
        .collect();
    assert_eq!(expected.len(), 5);

    let mut measured = Vec::new();
    let model = Linear::new(&cpu, 1024, 1024, false, DType::F32, &generator).unwrap();
    measured.push(("model".to_owned(), allocated(&cpu)));
    let x = Tensor::ones(&cpu, &[1024], DType::F32).unwrap();
    measured.push(("inputs".to_owned(), allocated(&cpu)));
    let outputs = model.forward(&x).unwrap();
    measured.push(("iter0 forward".to_owned(), allocated(&cpu)));
    let loss = outputs.sum_all().unwrap();
    measured.push(("iter0 loss".to_owned(), allocated(&cpu)));
    loss.backward().unwrap();
    measured.push(("iter0 backward".to_owned(), allocated(&cpu)));
    assert_eq!(measured, expected);
    assert_eq!(
        model.weight.grad().unwrap().shape(),
        [1024, 1024],
        "backward produced the weight's gradient"
    );
}

/// The patch embedding of an image that needs no gradient keeps the image, not a patch copy of
/// it: between forward and backward it holds only its output, and its gradients equal those of
/// the same embedding over an image that needs one (whose patch copy must be kept).
#[test]
fn the_patch_embedding_keeps_the_image_not_a_patch_copy() {
    let cpu = CpuBackend::new_ref();
    let values: Vec<f64> = (0..2 * 3 * 32 * 32)
        .map(|i| ((i * 7919) % 1000) as f64 / 500.0 - 1.0)
        .collect();
    let embedding = |image_needs_grad: bool| {
        let weight = Tensor::from_f64s(
            &cpu,
            &(0..64 * 3 * 8 * 8)
                .map(|i| ((i * 104729) % 997) as f64 / 4985.0 - 0.1)
                .collect::<Vec<_>>(),
            &[64, 3, 8, 8],
            DType::F32,
        )
        .unwrap();
        let bias = Tensor::zeros(&cpu, &[64], DType::F32).unwrap();
        weight.requires_grad_(true).unwrap();
        bias.requires_grad_(true).unwrap();
        let image = Tensor::from_f64s(&cpu, &values, &[2, 3, 32, 32], DType::F32).unwrap();
        image.requires_grad_(image_needs_grad).unwrap();
        let before = allocated(&cpu);
        let out = headroom_nn::PatchEmbedding {
            weight: weight.clone(),
            bias: bias.clone(),
        }
        .forward(&image)
        .unwrap();
        let held = allocated(&cpu) - before;
        out.mul(&out)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let grads = [&weight, &bias].map(|t| t.grad().unwrap().to_vec::<f32>().unwrap());
        (held, grads)
    };
    let (held_copy, grads_copy) = embedding(true);
    let (held_image, grads_image) = embedding(false);
    // Output [2, 64, 4, 4] f32 = 4 KiB; the patch copy [32, 192] f32 = 24 KiB.
    assert_eq!(held_image, 2 * 64 * 4 * 4 * 4);
    assert_eq!(held_copy, held_image + 32 * 192 * 4);
    assert_eq!(grads_image, grads_copy);
}

/// GPT-2's attention dropout (`attn_pdrop`) in training keeps nothing more than no dropout: the
/// mask runs inside the fused attention and is drawn again in backward, so the forward holds the
/// same bytes as with `attn_pdrop = 0` (the eager path held each layer's `[batch, heads, seq,
/// seq]` probabilities and their Bool mask), and two steps from one generator state give the
/// same loss and gradients.
#[test]
fn attention_dropout_keeps_no_mask_and_no_probabilities() {
    let cpu = CpuBackend::new_ref();
    let (batch, seq) = (2, 32);
    let tokens: Vec<i64> = (0..batch * seq).map(|i| (i * 37 % 128) as i64).collect();
    let ids = Tensor::from_slice(&cpu, &tokens, &[batch, seq]).unwrap();
    let run = |attn_pdrop: f64| {
        let generator = Arc::new(Generator::new(11));
        let config = headroom_nn::Gpt2Config {
            attn_pdrop,
            ..headroom_nn::Gpt2Config::tiny()
        };
        let model =
            headroom_nn::Gpt2LMHeadModel::new(&cpu, config, DType::F32, &generator).unwrap();
        let before = allocated(&cpu);
        let logits = model.forward(&ids).unwrap();
        let loss = model.loss(&logits, &ids).unwrap();
        drop(logits);
        let held = allocated(&cpu) - before;
        loss.backward().unwrap();
        let grads: Vec<Vec<f32>> = headroom_nn::Module::parameters(&model)
            .iter()
            .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
            .collect();
        (held, loss.to_vec::<f32>().unwrap(), grads)
    };
    let (held_plain, loss_plain, _) = run(0.0);
    let (held_dropout, loss_dropout, grads_dropout) = run(0.5);
    assert_eq!(held_dropout, held_plain);
    assert_ne!(loss_dropout, loss_plain, "dropout changes the loss");
    let (_, loss_again, grads_again) = run(0.5);
    assert_eq!((loss_again, grads_again), (loss_dropout, grads_dropout));
}
