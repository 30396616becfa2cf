//! Fused attention (scaled dot-product, with and without the causal mask) forward and backward
//! on the GPU against the CPU.

use headroom_autograd_core::{BackendRef, DType, Layout, View};

use crate::{check, download, input, poisoned, seeded_backends, upload, FLOATS};

#[test]
#[ignore = "needs a CUDA device"]
fn fused_attention_forward_and_backward_match_the_cpu() {
    use headroom_autograd_core::{AttentionBackward, AttentionForward};
    let Some((gpu, cpu, mut random)) = seeded_backends(0x5eed_a77e_0000_0001) else {
        return;
    };
    // (batch, heads, queries, keys, head_dim, causal): every threads-per-row variant of the f32
    // kernels and padded head dim of the f16/bf16 tensor-core kernels, a head dim that needs
    // predication (80), sequences that leave partial tiles (ViT's 197, 65, a single query), more
    // keys than queries, and a head dim (12) that sends f16/bf16 to the cuBLAS path. (One key
    // alone would make dQ zero up to rounding: nothing to compare relatively.)
    let cases = [
        (2, 3, 37, 37, 16, false),
        (1, 2, 45, 45, 32, true),
        (2, 2, 70, 70, 64, false),
        (1, 3, 33, 33, 80, true),
        (1, 1, 9, 9, 128, false),
        (2, 2, 197, 197, 64, false),
        (1, 2, 197, 197, 64, true),
        (1, 2, 65, 65, 96, true),
        (2, 1, 1, 9, 32, false),
        (1, 2, 70, 130, 64, false),
        (1, 2, 19, 19, 12, true),
    ];
    for (batch, heads, queries, keys, head_dim, causal) in cases {
        let width = heads * head_dim;
        // k and v are head views of one packed [batch, keys, 3, heads, head_dim] projection, and q
        // too when there are as many queries; outputs and gradients are [batch, rows, heads,
        // head_dim] viewed as [b, h, rows, d].
        let packed_n = batch * keys * 3 * width;
        let (n, n_keys) = (batch * queries * width, batch * keys * width);
        let head_view = |part: usize| {
            Layout::from_parts(
                &[batch, heads, keys, head_dim],
                &[keys * 3 * width, head_dim, 3 * width, 1],
                part * width,
            )
            .unwrap()
        };
        let rows_layout = |rows: usize| {
            Layout::from_parts(
                &[batch, heads, rows, head_dim],
                &[rows * width, head_dim, width, 1],
                0,
            )
            .unwrap()
        };
        let packed_q = queries == keys;
        let (ql, kl, vl) = (
            if packed_q {
                head_view(0)
            } else {
                rows_layout(queries)
            },
            head_view(1),
            head_view(2),
        );
        let (out_layout, key_layout) = (rows_layout(queries), rows_layout(keys));
        let lse_layout = Layout::contiguous(&[batch, heads, queries]);
        for dtype in FLOATS {
            let stats = if dtype == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let packed = input(&mut random, false, packed_n);
            let separate_q = input(&mut random, false, n);
            let dout = input(&mut random, false, n);
            let run = |backend: &BackendRef| -> Vec<Vec<f64>> {
                let packed = upload(backend, dtype, &packed);
                let separate_q = upload(backend, dtype, &separate_q);
                let dout = upload(backend, dtype, &dout);
                let out = poisoned(backend, dtype, n);
                let lse = poisoned(backend, stats, batch * heads * queries);
                let grads = [n, n_keys, n_keys].map(|len| poisoned(backend, dtype, len));
                let view = |buffer, layout| View {
                    buffer,
                    layout,
                    dtype,
                };
                let forward = AttentionForward {
                    q: view(if packed_q { &packed } else { &separate_q }, &ql),
                    k: view(&packed, &kl),
                    v: view(&packed, &vl),
                    scale: 1.0 / (head_dim as f64).sqrt(),
                    causal,
                    out: view(&out, &out_layout),
                    lse: View {
                        buffer: &lse,
                        layout: &lse_layout,
                        dtype: stats,
                    },
                };
                backend.attention(forward).unwrap();
                backend
                    .attention_backward(AttentionBackward {
                        forward,
                        dout: view(&dout, &out_layout),
                        dq: view(&grads[0], &out_layout),
                        dk: view(&grads[1], &key_layout),
                        dv: view(&grads[2], &key_layout),
                    })
                    .unwrap();
                let mut res = vec![
                    download(backend, dtype, &out),
                    download(backend, stats, &lse),
                ];
                res.extend(grads.iter().map(|g| download(backend, dtype, g)));
                res
            };
            let (on_gpu, on_cpu) = (run(&gpu), run(&cpu));
            for (name, (g, c)) in ["out", "lse", "dq", "dk", "dv"]
                .iter()
                .zip(on_gpu.iter().zip(&on_cpu))
            {
                let what = format!(
                    "attention {name} b{batch} h{heads} q{queries} k{keys} d{head_dim} causal={causal}"
                );
                check(&what, dtype, g, c);
            }
        }
    }
}
