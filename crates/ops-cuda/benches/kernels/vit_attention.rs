//! The ViT attention cases of the kernels bench: fused attention on ViT-L/16's batch-32 shape,
//! forward and backward, f32 and bf16, plain and with dropout 0.1 (PyTorch's side:
//! `scripts/pytorch/attention_dropout_reference.py`).

use headroom_autograd_core::{
    AttentionBackward, AttentionForward, DType, DropoutDraw, Layout, Tensor, View,
};
use headroom_ops_cuda::CudaStream;

use super::{Bench, Work, HEADS, HEAD_DIM, SEQ};

/// Fused attention on ViT-L/16's batch-32 shape, forward and backward, with q, k and v the heads of
/// one packed `[32, 197, 3 · 1024]` projection and outputs `[32, 197, 16, 64]`. FLOPs count the
/// products an unfused pass does: 2 in forward (q kᵀ, p v), 5 in backward (q kᵀ again, dv, dp,
/// dq, dk).
pub(crate) fn attention(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    let batch = HEADS / 16;
    let (heads, width) = (16, 16 * HEAD_DIM);
    let product = (2 * HEADS * SEQ * SEQ * HEAD_DIM) as u64;
    for dtype in [DType::F32, DType::BF16] {
        let size = dtype.size_in_bytes();
        let tag = if dtype == DType::F32 { "f32" } else { "bf16" };
        let packed = bench.tensor(&[batch, SEQ, 3 * width], dtype, 23);
        let grads = bench.empty(&[batch, SEQ, 3 * width], dtype);
        let out = bench.empty(&[batch, SEQ, width], dtype);
        let dout = bench.tensor(&[batch, SEQ, width], dtype, 24);
        let lse = bench.empty(&[batch, heads, SEQ], DType::F32);
        let head_strides = [SEQ * 3 * width, HEAD_DIM, 3 * width, 1];
        let shape = [batch, heads, SEQ, HEAD_DIM];
        let thirds: Vec<Layout> = (0..3)
            .map(|i| Layout::from_parts(&shape, &head_strides, i * width).unwrap())
            .collect();
        let merged = Layout::from_parts(&shape, &[SEQ * width, HEAD_DIM, width, 1], 0).unwrap();
        fn view<'a>(tensor: &'a Tensor, layout: &'a Layout, dtype: DType) -> View<'a> {
            View {
                buffer: tensor.buffer(),
                layout,
                dtype,
            }
        }
        let lse_view = View {
            buffer: lse.buffer(),
            layout: lse.layout(),
            dtype: DType::F32,
        };
        // Plain, and with dropout 0.1 (each keep bit derived from its index, in the forward and
        // again in the backward).
        for (suffix, dropout) in [
            ("", None),
            (
                "_dropout",
                Some(DropoutDraw {
                    p: 0.1,
                    seed: 5,
                    offset: 0,
                }),
            ),
        ] {
            let forward = || AttentionForward {
                q: view(&packed, &thirds[0], dtype),
                k: view(&packed, &thirds[1], dtype),
                v: view(&packed, &thirds[2], dtype),
                scale: 1.0 / (HEAD_DIM as f64).sqrt(),
                causal: false,
                packed: None,
                dropout,
                out: view(&out, &merged, dtype),
                lse: lse_view,
            };
            let io = (4 * HEADS * SEQ * HEAD_DIM * size) as u64;
            bench.case(
                "attention",
                &format!("{tag}{suffix}_forward_512x197x64"),
                Work {
                    bytes: io,
                    flops: 2 * product,
                },
                compute,
                || gpu.attention(forward()).expect("attention"),
            );
            bench.case(
                "attention",
                &format!("{tag}{suffix}_backward_512x197x64"),
                Work {
                    bytes: 2 * io,
                    flops: 5 * product,
                },
                compute,
                || {
                    gpu.attention_backward(AttentionBackward {
                        forward: forward(),
                        dout: view(&dout, &merged, dtype),
                        dq: view(&grads, &thirds[0], dtype),
                        dk: view(&grads, &thirds[1], dtype),
                        dv: view(&grads, &thirds[2], dtype),
                    })
                    .expect("attention backward")
                },
            );
        }
    }
}
