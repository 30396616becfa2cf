//! f32 fused attention at the shapes of the models we train (issue 35): GPT-2 small (batch 8 ×
//! 1024 tokens, 12 heads, causal), ViT-L/16 (batch 32 × 197 tokens, 16 heads), both at batch 1
//! as well (issue 36's captured steps), the Llama-3.2-1B
//! shape (batch 4 × 2048, 32 query and 8 key/value heads, causal) and a head dim of 128 (batch 1 ×
//! 4096, 32/8 heads, causal, Llama-3.1-8B's), heads strided out of one packed q/k/v projection
//! and outputs laid out `[batch, rows, heads, head_dim]`, as the models pass them.
//!
//! Per case: forward, backward and forward + backward, each run 5 times to warm up and timed 20
//! times with CUDA events; the median is reported with TFLOP/s by the convention of
//! `scripts/pytorch/attention_reference.py` (forward `4 · b · h · s² · d`, halved when causal;
//! backward 2.5× that). The kernel is the one the backend picks for f32 (`HEADROOM_ATTENTION_F32`
//! unset: the split-TF32 tensor-core kernels; `register-tiled`: the register-tiled ones), named in
//! each JSON line. Prints a skip notice without a CUDA device.
//!
//! `cargo bench -p headroom-ops-cuda --features cuda --bench attention_f32` (or the binary).

use std::sync::Arc;

use headroom_autograd_core::{
    AttentionBackward, AttentionForward, BackendRef, DType, Layout, Tensor, View,
};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::uniform_f32;

const WARMUP: usize = 5;
const TIMED: usize = 20;

/// One attention shape.
struct Shape {
    name: &'static str,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    head_dim: usize,
    causal: bool,
}

const SHAPES: [Shape; 6] = [
    Shape {
        name: "gpt2_b8x1024",
        batch: 8,
        heads: 12,
        kv_heads: 12,
        seq: 1024,
        head_dim: 64,
        causal: true,
    },
    Shape {
        name: "vit_l16_b32",
        batch: 32,
        heads: 16,
        kv_heads: 16,
        seq: 197,
        head_dim: 64,
        causal: false,
    },
    Shape {
        name: "gpt2_b1x1024",
        batch: 1,
        heads: 12,
        kv_heads: 12,
        seq: 1024,
        head_dim: 64,
        causal: true,
    },
    Shape {
        name: "vit_l16_b1",
        batch: 1,
        heads: 16,
        kv_heads: 16,
        seq: 197,
        head_dim: 64,
        causal: false,
    },
    Shape {
        name: "llama_1b_b4x2048",
        batch: 4,
        heads: 32,
        kv_heads: 8,
        seq: 2048,
        head_dim: 64,
        causal: true,
    },
    Shape {
        name: "llama_8b_b1x4096",
        batch: 1,
        heads: 32,
        kv_heads: 8,
        seq: 4096,
        head_dim: 128,
        causal: true,
    },
];

fn median_ms(cuda: &Arc<CudaBackend>, mut run: impl FnMut()) -> f64 {
    let stream = cuda.compute_stream();
    let (start, end) = (
        stream.record_timing_event().expect("event"),
        stream.record_timing_event().expect("event"),
    );
    for _ in 0..WARMUP {
        run();
    }
    let mut times: Vec<f64> = (0..TIMED)
        .map(|_| {
            start.record(&stream).expect("record");
            run();
            end.record(&stream).expect("record");
            end.synchronize().expect("synchronize");
            f64::from(start.elapsed_ms(&end).expect("elapsed"))
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[TIMED / 2]
}

fn tensor(gpu: &BackendRef, shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_slice(gpu, &uniform_f32(n, seed), shape).expect("upload")
}

fn measure(cuda: &Arc<CudaBackend>, kernel: &str, shape: &Shape) {
    let gpu: BackendRef = cuda.clone();
    let Shape {
        batch,
        heads,
        kv_heads,
        seq,
        head_dim: d,
        causal,
        ..
    } = *shape;
    let (width, kv_width) = (heads * d, kv_heads * d);
    let row = width + 2 * kv_width;
    let packed = tensor(&gpu, &[batch, seq, row], 41);
    let grads = Tensor::empty(&gpu, &[batch, seq, row], DType::F32).expect("alloc");
    let out = Tensor::empty(&gpu, &[batch, seq, width], DType::F32).expect("alloc");
    let dout = tensor(&gpu, &[batch, seq, width], 42);
    let lse = Tensor::empty(&gpu, &[batch, heads, seq], DType::F32).expect("alloc");
    let head_view = |n: usize, offset: usize| {
        Layout::from_parts(&[batch, n, seq, d], &[seq * row, d, row, 1], offset).unwrap()
    };
    let (ql, kl, vl) = (
        head_view(heads, 0),
        head_view(kv_heads, width),
        head_view(kv_heads, width + kv_width),
    );
    let merged = Layout::from_parts(&[batch, heads, seq, d], &[seq * width, d, width, 1], 0)
        .expect("layout");
    fn view<'a>(tensor: &'a Tensor, layout: &'a Layout) -> View<'a> {
        View {
            buffer: tensor.buffer(),
            layout,
            dtype: DType::F32,
        }
    }
    let forward = || AttentionForward {
        q: view(&packed, &ql),
        k: view(&packed, &kl),
        v: view(&packed, &vl),
        scale: 1.0 / (d as f64).sqrt(),
        causal,
        packed: None,
        dropout: None,
        out: view(&out, &merged),
        lse: View {
            buffer: lse.buffer(),
            layout: lse.layout(),
            dtype: DType::F32,
        },
    };
    let backward = || {
        gpu.attention_backward(AttentionBackward {
            forward: forward(),
            dout: view(&dout, &merged),
            dq: view(&grads, &ql),
            dk: view(&grads, &kl),
            dv: view(&grads, &vl),
        })
        .expect("attention backward")
    };
    let fwd = median_ms(cuda, || gpu.attention(forward()).expect("attention"));
    let bwd = median_ms(cuda, backward);
    let both = median_ms(cuda, || {
        gpu.attention(forward()).expect("attention");
        backward();
    });
    let causal_share = if causal { 0.5 } else { 1.0 };
    let forward_flops = 4.0 * (batch * heads * seq * seq * d) as f64 * causal_share;
    for (case, ms, flops) in [
        ("forward", fwd, forward_flops),
        ("backward", bwd, 2.5 * forward_flops),
        ("fwd_bwd", both, 3.5 * forward_flops),
    ] {
        println!(
            "{{\"shape\": \"{}\", \"case\": \"{case}\", \"kernel\": \"{kernel}\", \"ms\": {ms:.4}, \
             \"tflops\": {:.2}}}",
            shape.name,
            flops / ms / 1e9
        );
    }
}

fn main() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let kernel = match std::env::var("HEADROOM_ATTENTION_F32") {
        Ok(value) if value == "register-tiled" => "register-tiled",
        _ => "split-tf32",
    };
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for shape in SHAPES
        .iter()
        .filter(|s| only.is_empty() || only.iter().any(|o| o == s.name))
    {
        measure(&cuda, kernel, shape);
    }
}
