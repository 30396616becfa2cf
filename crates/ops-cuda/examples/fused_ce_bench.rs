//! The fused linear + cross-entropy (`linear_cross_entropy`) against the unfused
//! `cross_entropy_f32(linear(..))` on the Llama-3.2-1B head shape (8192 tokens × 2048 features ×
//! 128,256 classes, bf16), forward + backward: the Rust side of
//! `scripts/pytorch/fused_ce_reference.py`, which times PyTorch eager, Liger and Cut
//! Cross-Entropy at the same shape.
//!
//! `cargo run --release -p headroom-ops-cuda --features cuda --example fused_ce_bench [-- ITERS [TOKENS HIDDEN VOCAB]]`
//!
//! Prints one JSON object: per variant the median wall time of a forward + backward (device
//! synchronised around each) over ITERS runs (default 10, after one warm-up), the peak of
//! allocated bytes beyond the inputs and the weight, and that peak less the gradients of hidden
//! and weight (the target: ≤ 64 MiB + 8 B per token for the fused op); on stderr, one
//! fused step's device time by primitive (the op profile). Without a CUDA device it prints a skip
//! notice.

use std::time::Instant;

use headroom_autograd_core::{
    cross_entropy_f32, linear_cross_entropy, BackendRef, DType, LinearCrossEntropyOptions,
    Reduction, Result, Tensor,
};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::uniform_f32;
use headroom_testkit::memory::{allocated, peak};

/// A bf16 leaf of `shape` with values in `[-scale, scale)`.
fn leaf(gpu: &BackendRef, shape: &[usize], scale: f64, seed: u64) -> Result<Tensor> {
    let n = shape.iter().product();
    let values = Tensor::from_slice(gpu, &uniform_f32(n, seed), shape)?;
    let res = values.mul_scalar(scale)?.to_dtype(DType::BF16)?;
    res.requires_grad_(true)?;
    Ok(res)
}

/// Median milliseconds and peak bytes above the inputs of `step` (forward + backward).
fn measure(
    gpu: &BackendRef,
    iters: usize,
    params: &[&Tensor],
    step: &dyn Fn() -> Result<Tensor>,
) -> Result<(f64, i64)> {
    let mut times = Vec::with_capacity(iters);
    let mut peak_bytes = 0;
    for run in 0..=iters {
        for param in params {
            param.zero_grad(true)?;
        }
        gpu.synchronize()?;
        gpu.allocator_view().reset_peak_stats();
        let before = allocated(gpu);
        let start = Instant::now();
        step()?.backward()?;
        gpu.synchronize()?;
        if run > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        peak_bytes = peak_bytes.max(peak(gpu) - before);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], peak_bytes))
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: ITERS [TOKENS HIDDEN VOCAB]"))
        .collect();
    let iters = args.first().copied().unwrap_or(10);
    let (tokens, hidden_size, vocab) = match args[..] {
        [_, t, h, v] => (t, h, v),
        _ => (8192, 2048, 128_256),
    };
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return Ok(());
    };
    let gpu: BackendRef = cuda.clone();
    let hidden = leaf(&gpu, &[tokens, hidden_size], 1.0, 1)?;
    let weight = leaf(&gpu, &[vocab, hidden_size], 0.02, 2)?;
    let labels: Vec<i64> = (0..tokens as i64)
        .map(|i| (i * 7919) % vocab as i64)
        .collect();
    let labels = Tensor::from_slice(&gpu, &labels, &[tokens])?;
    let grads = ((tokens + vocab) * hidden_size * 2) as i64;
    let options = LinearCrossEntropyOptions::default();
    let params = [&hidden, &weight];
    let unfused = measure(&gpu, iters, &params, &|| {
        cross_entropy_f32(
            &hidden.linear(&weight, None)?,
            &labels,
            -100,
            Reduction::Mean,
        )
    })?;
    let fused = measure(&gpu, iters, &params, &|| {
        linear_cross_entropy(&hidden, &weight, None, &labels, &options)
    })?;
    // Where one fused step's device time goes, by primitive (the op profile's spans summed
    // by the primitive's name), on stderr.
    for param in params {
        param.zero_grad(true)?;
    }
    cuda.start_op_profile()?;
    linear_cross_entropy(&hidden, &weight, None, &labels, &options)?.backward()?;
    let mut by_primitive: Vec<(String, f64, usize)> = Vec::new();
    for timing in cuda.finish_op_profile()? {
        let name = timing.label.split(' ').next().unwrap_or("").to_owned();
        match by_primitive.iter_mut().find(|(known, ..)| *known == name) {
            Some((_, ms, count)) => {
                *ms += timing.ms;
                *count += 1;
            }
            None => by_primitive.push((name, timing.ms, 1)),
        }
    }
    for (name, ms, count) in &by_primitive {
        eprintln!("fused step profile: {name}: {ms:.3} ms over {count} calls");
    }
    let entry = |(ms, bytes): (f64, i64)| {
        format!(
            "{{\"median_ms\": {ms:.3}, \"peak_beyond_inputs_bytes\": {bytes}, \"peak_beyond_inputs_and_grads_bytes\": {}}}",
            bytes - grads
        )
    };
    println!(
        "{{\"shape\": {{\"tokens\": {tokens}, \"hidden\": {hidden_size}, \"vocab\": {vocab}, \"dtype\": \"bf16\"}}, \"iters\": {iters}, \"chunk_bytes\": {}, \"target_beyond_grads_bytes\": {}, \"headroom_unfused\": {}, \"headroom_fused\": {}}}",
        options.chunk_bytes,
        (64 << 20) + 8 * tokens,
        entry(unfused),
        entry(fused)
    );
    Ok(())
}
