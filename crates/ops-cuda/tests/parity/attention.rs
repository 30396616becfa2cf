//! Fused attention (scaled dot-product, with and without the causal mask, grouped-query heads,
//! packed variable-length sequences and dropout replayed from its draw) forward and backward on
//! the GPU against the CPU.

use headroom_autograd_core::{
    AttentionBackward, AttentionForward, BackendRef, DType, DropoutDraw, Layout, PackedBounds,
    TensorError, View,
};
use headroom_testkit::inputs::Xorshift;

use crate::{backends, check, download, input, poisoned, upload, FLOATS};

/// One attention problem: sizes, mask and (packed) sequence boundaries.
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    head_dim: usize,
    causal: bool,
    cu_seqlens: Option<Vec<i32>>,
    /// Dropout's probability, or `None`.
    dropout: Option<f64>,
}

/// `case` with dropout of probability `p`.
fn dropping(p: f64, case: Case) -> Case {
    Case {
        dropout: Some(p),
        ..case
    }
}

/// A case with as many key/value heads as query heads and no packing.
fn dense(batch: usize, heads: usize, rows: (usize, usize), head_dim: usize, causal: bool) -> Case {
    Case {
        batch,
        heads,
        kv_heads: heads,
        queries: rows.0,
        keys: rows.1,
        head_dim,
        causal,
        cu_seqlens: None,
        dropout: None,
    }
}

/// A packed batch of sequences of `lengths` with `heads` query and `kv_heads` key/value heads.
fn packed(heads: usize, kv_heads: usize, lengths: &[usize], head_dim: usize, causal: bool) -> Case {
    let mut cu_seqlens = vec![0i32];
    for &len in lengths {
        cu_seqlens.push(cu_seqlens.last().unwrap() + len as i32);
    }
    let tokens = *cu_seqlens.last().unwrap() as usize;
    Case {
        batch: 1,
        heads,
        kv_heads,
        queries: tokens,
        keys: tokens,
        head_dim,
        causal,
        cu_seqlens: Some(cu_seqlens),
        dropout: None,
    }
}

/// Runs `case` forward and backward in every float dtype on both backends and compares the
/// output, log-sum-exp and the three gradients.
fn compare(case: &Case, dtypes: &[DType], random: &mut Xorshift) {
    let Some((gpu, cpu)) = backends() else { return };
    let (batch, heads, kv_heads, head_dim) = (case.batch, case.heads, case.kv_heads, case.head_dim);
    let (queries, keys, causal) = (case.queries, case.keys, case.causal);
    // k and v (and q when there are as many queries) are head views of one packed [batch, keys,
    // (heads + 2 kv_heads) · head_dim] projection; outputs and gradients are [batch, rows, heads,
    // head_dim] viewed as [b, h, rows, d].
    let (width, kv_width) = (heads * head_dim, kv_heads * head_dim);
    let row = width + 2 * kv_width;
    let head_view = |n_heads: usize, offset: usize| {
        Layout::from_parts(
            &[batch, n_heads, keys, head_dim],
            &[keys * row, head_dim, row, 1],
            offset,
        )
        .unwrap()
    };
    let rows_layout = |n_heads: usize, rows: usize| {
        let w = n_heads * head_dim;
        Layout::from_parts(
            &[batch, n_heads, rows, head_dim],
            &[rows * w, head_dim, w, 1],
            0,
        )
        .unwrap()
    };
    let packed_q = queries == keys;
    let ql = if packed_q {
        head_view(heads, 0)
    } else {
        rows_layout(heads, queries)
    };
    let (kl, vl) = (
        head_view(kv_heads, width),
        head_view(kv_heads, width + kv_width),
    );
    let (out_layout, key_layout) = (rows_layout(heads, queries), rows_layout(kv_heads, keys));
    let lse_layout = Layout::contiguous(&[batch, heads, queries]);
    let (n, n_keys) = (batch * queries * width, batch * keys * kv_width);
    let host_bounds = case.cu_seqlens.clone().unwrap_or_default();
    let bounds_layout = Layout::contiguous(&[host_bounds.len()]);
    let bounds: Vec<f64> = host_bounds.iter().map(|&b| f64::from(b)).collect();
    for &dtype in dtypes {
        let stats = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let projection = input(random, false, batch * keys * row);
        let separate_q = input(random, false, n);
        let dout = input(random, false, n);
        let run = |backend: &BackendRef| -> Vec<Vec<f64>> {
            let projection = upload(backend, dtype, &projection);
            let separate_q = upload(backend, dtype, &separate_q);
            let dout = upload(backend, dtype, &dout);
            let cu_seqlens = upload(backend, DType::I32, &bounds);
            let out = poisoned(backend, dtype, n);
            let lse = poisoned(backend, stats, batch * heads * queries);
            let grads = [n, n_keys, n_keys].map(|len| poisoned(backend, dtype, len));
            let view = |buffer, layout| View {
                buffer,
                layout,
                dtype,
            };
            let forward = AttentionForward {
                q: view(if packed_q { &projection } else { &separate_q }, &ql),
                k: view(&projection, &kl),
                v: view(&projection, &vl),
                scale: 1.0 / (head_dim as f64).sqrt(),
                causal,
                packed: case.cu_seqlens.as_ref().map(|host| PackedBounds {
                    cu_seqlens: View {
                        buffer: &cu_seqlens,
                        layout: &bounds_layout,
                        dtype: DType::I32,
                    },
                    host,
                }),
                dropout: case.dropout.map(|p| DropoutDraw {
                    p,
                    seed: 0x0d40_5eed,
                    offset: 12_345,
                }),
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
                "attention {name} b{batch} h{heads} kv{kv_heads} q{queries} k{keys} d{head_dim} \
                 causal={causal} cu_seqlens={:?} dropout={:?}",
                case.cu_seqlens, case.dropout
            );
            check(&what, dtype, g, c);
        }
    }
}

/// [`compare`] of each of `cases` in every float dtype, on inputs drawn from a generator seeded
/// with `seed`.
fn compare_each(seed: u64, cases: &[Case]) {
    let mut random = Xorshift::from_state(seed);
    for case in cases {
        compare(case, &FLOATS, &mut random);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_attention_forward_and_backward_match_the_cpu() {
    // (batch, heads, (queries, keys), head_dim, causal): every threads-per-row variant of the f32
    // kernels and padded head dim of the f16/bf16 tensor-core kernels, a head dim that needs
    // predication (80), sequences that leave partial tiles (ViT's 197, 65, a single query), more
    // keys than queries, a head dim (12) that sends f16/bf16 to the cuBLAS path, and grids of a
    // few hundred blocks (sequences of 512 rows or more: `streamed_64_row_tiles_match_the_cpu`). (One key alone would make dQ zero up to
    // rounding: nothing to compare relatively.)
    let cases = [
        dense(2, 3, (37, 37), 16, false),
        dense(1, 2, (45, 45), 32, true),
        dense(2, 2, (70, 70), 64, false),
        dense(1, 3, (33, 33), 80, true),
        dense(1, 1, (9, 9), 128, false),
        dense(2, 2, (197, 197), 64, false),
        dense(1, 2, (197, 197), 64, true),
        dense(1, 2, (65, 65), 96, true),
        dense(2, 1, (1, 9), 32, false),
        dense(1, 2, (70, 130), 64, false),
        dense(1, 2, (19, 19), 12, true),
        dense(8, 12, (300, 300), 64, false),
        dense(8, 12, (280, 280), 32, true),
    ];
    compare_each(0x5eed_a77e_0000_0001, &cases);
}

#[test]
#[ignore = "needs a CUDA device"]
fn streamed_64_row_tiles_match_the_cpu() {
    // Sequences of 512 rows or more, where the f32 tensor-core kernels stream 64-row tiles
    // instead of 32: a partial last tile, causal, and more keys than queries. A test of its own,
    // small enough for compute-sanitizer's racecheck to finish in a minute.
    let cases = [
        dense(1, 2, (530, 530), 128, true),
        dense(1, 1, (520, 600), 80, false),
    ];
    compare_each(0x5eed_a77e_0000_0005, &cases);
}

#[test]
#[ignore = "needs a CUDA device"]
fn grouped_query_attention_matches_the_cpu() {
    // Groups of 4 and 2 (and 8 query heads on one key/value head) on every path: the
    // register-tiled f32/f64 kernels, the tensor-core f16/bf16 kernels (head dims 64 and 128,
    // partial tiles) and the cuBLAS path (head dim 12).
    let mut cases = Vec::new();
    for (heads, kv_heads, rows, head_dim, causal) in [
        (8, 2, (70, 70), 64, true),
        (4, 2, (45, 45), 32, false),
        (8, 1, (65, 65), 128, true),
        (6, 3, (19, 19), 12, true),
        (4, 2, (33, 70), 64, false),
    ] {
        cases.push(Case {
            kv_heads,
            ..dense(2, heads, rows, head_dim, causal)
        });
    }
    compare_each(0x5eed_a77e_0000_0002, &cases);
}

#[test]
#[ignore = "needs a CUDA device"]
fn packed_sequences_match_the_cpu() {
    // Boundaries inside tiles of every path (32-row register tiles, 64-row tensor-core tiles),
    // on tile edges, a one-token and an empty sequence, causal and not, with grouped heads.
    let cases = [
        packed(4, 2, &[37, 64, 1, 90, 0, 29], 64, true),
        packed(2, 2, &[70, 33, 65], 32, false),
        packed(4, 1, &[128, 64, 3], 128, true),
        packed(3, 3, &[19, 40, 7], 12, true),
        packed(2, 1, &[5, 200, 31], 80, false),
    ];
    compare_each(0x5eed_a77e_0000_0003, &cases);
}

#[test]
#[ignore = "needs a CUDA device"]
fn grouped_query_attention_matches_the_cpu_at_the_llama_target_shape() {
    let mut random = Xorshift::from_state(0x5eed_a77e_0000_0004);
    // The target: batch 4, 32 query heads, 8 key/value heads, 2048 tokens, head dim 64,
    // causal; and the same tokens packed as 4 sequences of uneven lengths. (The CPU reference
    // takes a while: about 4 · 32 · 2048² / 2 score rows.)
    let target = Case {
        kv_heads: 8,
        ..dense(4, 32, (2048, 2048), 64, true)
    };
    compare(&target, &[DType::F32, DType::BF16, DType::F16], &mut random);
    let packed_target = packed(32, 8, &[1000, 3000, 77, 4115], 64, true);
    compare(&packed_target, &[DType::BF16], &mut random);
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropout_matches_the_cpu_mask_and_gradients() {
    // Every kernel family built with dropout: the bf16 tensor-core kernels (head dims 64 and 128,
    // and 80 padded to 128) and the register-tiled f32 and f64 ones (f32 at column counts 8 and
    // 16, f64 at 16), causal and not, more keys than queries, grouped heads and packed sequences;
    // each probability's keep bit comes from its index, so one element masked differently on the
    // GPU shows as an error of its whole weight. (f16 has no dropout build: the next test.)
    let cases = [
        dropping(0.1, dense(2, 3, (70, 70), 64, false)),
        dropping(0.5, dense(1, 2, (197, 197), 64, true)),
        dropping(0.3, dense(1, 2, (33, 45), 80, false)),
        dropping(
            0.2,
            Case {
                kv_heads: 2,
                ..dense(2, 8, (70, 70), 128, true)
            },
        ),
        dropping(0.1, packed(4, 2, &[37, 64, 1, 90, 0, 29], 64, true)),
    ];
    let mut random = Xorshift::from_state(0x5eed_a77e_0000_0006);
    for case in &cases {
        compare(case, &[DType::F64, DType::F32, DType::BF16], &mut random);
    }
    // A head dim that pads to 64 in the register-tiled kernels.
    compare(
        &dropping(0.25, dense(1, 2, (40, 40), 10, true)),
        &[DType::F64, DType::F32],
        &mut random,
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropout_where_the_16_bit_kernels_cannot_run_is_a_typed_error() {
    let Some((gpu, _)) = backends() else { return };
    // Head dim 12 in bf16 goes to the cuBLAS path, which has no dropout; f16 has no dropout build.
    for (dtype, head_dim) in [(DType::BF16, 12), (DType::F16, 64)] {
        let (batch, heads, rows) = (1, 2, 19);
        let layout = Layout::contiguous(&[batch, heads, rows, head_dim]);
        let lse_layout = Layout::contiguous(&[batch, heads, rows]);
        let n = batch * heads * rows * head_dim;
        let operand = poisoned(&gpu, dtype, n);
        let out = poisoned(&gpu, dtype, n);
        let lse = poisoned(&gpu, DType::F32, batch * heads * rows);
        let view = |buffer| View {
            buffer,
            layout: &layout,
            dtype,
        };
        let error = gpu
            .attention(AttentionForward {
                q: view(&operand),
                k: view(&operand),
                v: view(&operand),
                scale: 0.3,
                causal: true,
                packed: None,
                dropout: Some(DropoutDraw {
                    p: 0.1,
                    seed: 1,
                    offset: 0,
                }),
                out: view(&out),
                lse: View {
                    buffer: &lse,
                    layout: &lse_layout,
                    dtype: DType::F32,
                },
            })
            .unwrap_err();
        assert!(
            matches!(&error, TensorError::InvalidArgument { reason, .. } if reason.contains("head dim")),
            "{dtype:?}: {error}"
        );
    }
}
