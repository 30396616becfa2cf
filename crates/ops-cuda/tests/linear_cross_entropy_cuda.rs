//! The fused linear + cross-entropy (`linear_cross_entropy`) on CUDA: at a scaled-down
//! Llama-3.2-1B head against the CPU (the same bf16 values, an f32 reference), and at the full
//! head (8192 tokens × 2048 features × 128,256 classes, bf16) against the unfused loss on the
//! GPU, with the peak of allocated bytes held to the target: beyond the inputs, the
//! weight and their gradients, at most 64 MiB + 8 B per token. Marked
//! `#[ignore = "needs a CUDA device"]`: they run with `--include-ignored`.

#![cfg(feature = "cuda")]

use headroom_autograd_core::{
    cross_entropy_f32, linear_cross_entropy, BackendRef, DType, LinearCrossEntropyOptions,
    Reduction, Tensor,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::backend_or_skip;
use headroom_testkit::inputs::uniform_f32;
use headroom_testkit::loss_fixtures::{labels_every_ninth_ignored, IGNORE_INDEX};
use headroom_testkit::memory::{allocated, peak};

/// The device as the `BackendRef` tensors take, or `None` after the GPU gate's skip notice.
#[track_caller]
fn cuda_backend() -> Option<BackendRef> {
    backend_or_skip(CudaBackend::new(0))
}

/// A leaf of `shape` and `dtype` on `backend` with values in `[-scale, scale)`, rounded to bf16
/// (so an f32 leaf holds exactly the bf16 leaf's values).
fn leaf(backend: &BackendRef, shape: &[usize], scale: f32, seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let values: Vec<f32> = uniform_f32(n, seed).iter().map(|v| v * scale).collect();
    let res = Tensor::from_slice(backend, &values, shape)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    res.requires_grad_(true).unwrap();
    res
}

/// `max |a − b| / max |b|`.
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// The loss and the gradients of hidden and weight after one forward + backward.
fn run(hidden: &Tensor, weight: &Tensor, loss: Tensor) -> (Tensor, Tensor, Tensor) {
    loss.backward().unwrap();
    let grads = (hidden.take_grad().unwrap(), weight.take_grad().unwrap());
    (loss, grads.0, grads.1)
}

#[test]
#[ignore = "needs a CUDA device"]
fn scaled_down_llama_head_on_cuda_matches_the_cpu_within_bf16_rounding() {
    let Some(gpu) = cuda_backend() else { return };
    let cpu = CpuBackend::new_ref();
    let (tokens, features, vocab) = (300, 128, 4001); // 1/27, 1/16 and 1/32 of the real head
    let options = LinearCrossEntropyOptions {
        label_smoothing: 0.1,
        z_loss: 1e-4,
        chunk_bytes: 1 << 20, // 42 rows, then 341 classes: chunks that divide neither
        ..LinearCrossEntropyOptions::default()
    };
    let fused_on = |backend: &BackendRef, dtype: DType| {
        let hidden = leaf(backend, &[tokens, features], 1.0, 1, dtype);
        let weight = leaf(backend, &[vocab, features], 0.1, 2, dtype);
        let labels = labels_every_ninth_ignored(backend, tokens, vocab).unwrap();
        let loss = linear_cross_entropy(&hidden, &weight, None, &labels, &options).unwrap();
        run(&hidden, &weight, loss)
    };
    let on_cuda = fused_on(&gpu, DType::BF16);
    let on_cpu = fused_on(&cpu, DType::BF16);
    let reference = fused_on(&cpu, DType::F32); // the same bf16 values, computed in f32
    let errors = [
        relative(&on_cuda.0, &reference.0),
        relative(&on_cuda.1, &reference.1),
        relative(&on_cuda.2, &reference.2),
    ];
    let cpu_errors = [
        relative(&on_cpu.0, &reference.0),
        relative(&on_cpu.1, &reference.1),
        relative(&on_cpu.2, &reference.2),
    ];
    println!("bf16 vs f32 (loss, dhidden, dweight): CUDA {errors:?}, CPU {cpu_errors:?}");
    // The loss within 1e-3 and each gradient within a few bf16 roundings (2^-8 each) of its
    // largest element: the logits and their gradient are rounded to bf16 on the way.
    assert!(errors[0] <= 1e-3, "{errors:?}");
    assert!(errors[1] <= 2e-2 && errors[2] <= 2e-2, "{errors:?}");
    // And CUDA as close as the CPU's bf16 run, give or take one bf16 rounding.
    for (ours, cpus) in errors.iter().zip(&cpu_errors) {
        assert!(
            *ours <= cpus + 2f64.powi(-8),
            "{errors:?} vs CPU {cpu_errors:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn full_llama_head_on_cuda_holds_one_chunk_and_matches_the_unfused_loss() {
    let Some(gpu) = cuda_backend() else { return };
    let (tokens, features, vocab) = (8192, 2048, 128_256);
    let hidden = leaf(&gpu, &[tokens, features], 1.0, 3, DType::BF16);
    let weight = leaf(&gpu, &[vocab, features], 0.02, 4, DType::BF16);
    let labels = labels_every_ninth_ignored(&gpu, tokens, vocab).unwrap();
    let options = LinearCrossEntropyOptions::default();
    gpu.synchronize().unwrap();
    gpu.allocator_view().reset_peak_stats();
    let before = allocated(&gpu);
    let fused = run(
        &hidden,
        &weight,
        linear_cross_entropy(&hidden, &weight, None, &labels, &options).unwrap(),
    );
    gpu.synchronize().unwrap();
    let grads = ((tokens + vocab) * features * 2) as i64;
    let fused_peak = peak(&gpu) - before - grads;
    gpu.allocator_view().reset_peak_stats();
    let before = allocated(&gpu);
    let logits = hidden.linear(&weight, None).unwrap();
    let unfused_loss = cross_entropy_f32(&logits, &labels, IGNORE_INDEX, Reduction::Mean).unwrap();
    drop(logits);
    let unfused = run(&hidden, &weight, unfused_loss);
    gpu.synchronize().unwrap();
    let unfused_peak = peak(&gpu) - before - grads;
    let errors = [
        relative(&fused.0, &unfused.0),
        relative(&fused.1, &unfused.1),
        relative(&fused.2, &unfused.2),
    ];
    // The bound, counting cuBLAS's 32 MiB workspace, which this run's first product
    // takes from the caching allocator (the op's chunks leave it room), and whole blocks.
    let target = (64 << 20) + 8 * tokens as i64;
    println!(
        "full head, bf16: beyond inputs and gradients fused {fused_peak} B (target {target} B), \
         unfused {unfused_peak} B; fused vs unfused (loss, dhidden, dweight) {errors:?}"
    );
    assert!(fused_peak <= target, "{fused_peak} > {target}");
    assert!(errors[0] <= 1e-5, "{errors:?}");
    assert!(
        errors[1] <= 2f64.powi(-7) && errors[2] <= 2f64.powi(-7),
        "{errors:?}"
    );
}
