//! Fused attention on the ViT-L/16 batch-32 shape: `Backend::attention` and
//! `Backend::attention_backward` in bf16 (or f16, f32 with an argument), with q, k and v strided
//! head views of one packed `[batch, seq, 3·heads·head_dim]` projection and outputs laid out
//! `[batch, seq, heads, head_dim]`, as a transformer block calls them.
//!
//! `cargo run --release -p headroom-ops-cuda --features cuda --example attention_vit [-- ITERS [f16|f32]]`
//!
//! Prints the median device time of one forward and one backward (CUDA events around each call)
//! over ITERS calls (default 20), their TFLOP/s (4·S²·D per (batch, head) pair forward, 2.5 times
//! that backward) and the figure for 24 layers; without a CUDA device it prints a skip notice.

use headroom_autograd_core::{
    AttentionBackward, AttentionForward, BackendRef, DType, Layout, Result, Tensor, View,
};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::uniform_f32;

const BATCH: usize = 32;
const SEQ: usize = 197;
const HEADS: usize = 16;
const HEAD_DIM: usize = 64;
const LAYERS: usize = 24;

fn tensor(gpu: &BackendRef, n: usize, dtype: DType, seed: u64) -> Result<Tensor> {
    let values = Tensor::from_slice(gpu, &uniform_f32(n, seed), &[n])?;
    let res = Tensor::empty(gpu, &[n], dtype)?;
    gpu.copy(values.view(), res.view())?;
    Ok(res)
}

fn view<'a>(tensor: &'a Tensor, layout: &'a Layout, dtype: DType) -> View<'a> {
    View {
        buffer: tensor.buffer(),
        layout,
        dtype,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<()> {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return Ok(());
    };
    let gpu: BackendRef = cuda.clone();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters = args
        .iter()
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(20)
        .max(1);
    let dtype = match args.iter().find(|a| a.parse::<usize>().is_err()) {
        Some(a) if a == "f16" => DType::F16,
        Some(a) if a == "f32" => DType::F32,
        _ => DType::BF16,
    };
    let stats = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let width = HEADS * HEAD_DIM;
    let n = BATCH * SEQ * width;
    let packed = tensor(&gpu, 3 * n, dtype, 1)?;
    let dout = tensor(&gpu, n, dtype, 2)?;
    let out = Tensor::empty(&gpu, &[n], dtype)?;
    let lse = Tensor::empty(&gpu, &[BATCH * HEADS * SEQ], stats)?;
    let grads = [
        Tensor::empty(&gpu, &[n], dtype)?,
        Tensor::empty(&gpu, &[n], dtype)?,
        Tensor::empty(&gpu, &[n], dtype)?,
    ];
    let head = |part: usize| {
        Layout::from_parts(
            &[BATCH, HEADS, SEQ, HEAD_DIM],
            &[SEQ * 3 * width, HEAD_DIM, 3 * width, 1],
            part * width,
        )
        .unwrap()
    };
    let (ql, kl, vl) = (head(0), head(1), head(2));
    let rows = Layout::from_parts(
        &[BATCH, HEADS, SEQ, HEAD_DIM],
        &[SEQ * width, HEAD_DIM, width, 1],
        0,
    )
    .unwrap();
    let lse_layout = Layout::contiguous(&[BATCH, HEADS, SEQ]);
    let forward = AttentionForward {
        q: view(&packed, &ql, dtype),
        k: view(&packed, &kl, dtype),
        v: view(&packed, &vl, dtype),
        scale: 1.0 / (HEAD_DIM as f64).sqrt(),
        causal: false,
        packed: None,
        dropout: None,
        out: view(&out, &rows, dtype),
        lse: View {
            buffer: lse.buffer(),
            layout: &lse_layout,
            dtype: stats,
        },
    };
    let backward = AttentionBackward {
        forward,
        dout: view(&dout, &rows, dtype),
        dq: view(&grads[0], &rows, dtype),
        dk: view(&grads[1], &rows, dtype),
        dv: view(&grads[2], &rows, dtype),
    };
    let stream = cuda.compute_stream();
    let (start, middle, end) = (
        stream.record_timing_event()?,
        stream.record_timing_event()?,
        stream.record_timing_event()?,
    );
    let (mut forward_ms, mut backward_ms) = (Vec::new(), Vec::new());
    // One untimed call first: module load and the driver's PTX compilation.
    for i in 0..=iters {
        start.record(&stream)?;
        gpu.attention(forward)?;
        middle.record(&stream)?;
        gpu.attention_backward(backward)?;
        end.record(&stream)?;
        end.synchronize()?;
        if i > 0 {
            forward_ms.push(f64::from(start.elapsed_ms(&middle)?));
            backward_ms.push(f64::from(middle.elapsed_ms(&end)?));
        }
    }
    let (fwd, bwd) = (median(forward_ms), median(backward_ms));
    let flops = (4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM) as f64;
    println!(
        "attention {dtype:?} [{BATCH}, {HEADS}, {SEQ}, {HEAD_DIM}] over {iters} calls: \
         forward {fwd:.3} ms ({:.0} TFLOP/s), backward {bwd:.3} ms ({:.0} TFLOP/s); \
         {LAYERS} layers: {:.2} ms",
        flops / fwd / 1e9,
        2.5 * flops / bwd / 1e9,
        LAYERS as f64 * (fwd + bwd)
    );
    Ok(())
}
