//! Grouped-query heads, packed variable-length sequences and dropout through fused attention on
//! the CPU: each against the composition it replaces (k and v repeated per group, `repeat_kv`;
//! each sequence run alone; the `[batch, heads, queries, keys]` weights materialised and
//! `dropout` drawn from a generator in the same state), forward and every gradient, and the typed
//! errors of bad arguments. Dropout also moves the generator's stream exactly as the composition
//! does; `p` 0 is plain attention and `p` 1 drops everything.

use headroom_autograd_core::{
    dropout, scaled_dot_product_attention, scaled_dot_product_attention_dropout,
    scaled_dot_product_attention_varlen, scaled_dot_product_attention_varlen_dropout, BackendRef,
    DType, Generator, PackedSequences, Result, Tensor, TensorError,
};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::Xorshift;
use headroom_testkit::worst::nan_max;

/// A leaf `[shape]` tensor of values in [-1, 1).
fn leaf(backend: &BackendRef, random: &mut Xorshift, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n).map(|_| random.next_f64_in(-1.0, 1.0)).collect();
    let t = Tensor::from_f64s(backend, &values, shape, dtype).unwrap();
    t.requires_grad_(true).unwrap();
    t
}

/// `[batch, kv_heads, seq, head_dim]` → each head repeated `n_rep` times (Hugging Face's
/// `repeat_kv`), the reference grouped-query attention replaces.
fn repeat_heads(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    let [batch, kv_heads, seq, head_dim] = *x.shape() else {
        unreachable!("4-D operands")
    };
    x.unsqueeze(2)?
        .expand(&[batch, kv_heads, n_rep, seq, head_dim])?
        .reshape(&[batch, kv_heads * n_rep, seq, head_dim])
}

/// The output and the gradients of q, k and v of `attend` under a fixed output gradient.
fn run(
    inputs: [&Tensor; 3],
    dout: &Tensor,
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> [Vec<f64>; 4] {
    for t in inputs {
        t.set_grad(None).unwrap();
    }
    let [q, k, v] = inputs;
    let out = attend(q, k, v).unwrap();
    out.mul(dout)
        .unwrap()
        .sum(&[], false)
        .unwrap()
        .backward()
        .unwrap();
    let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64().unwrap();
    [out.to_vec_f64().unwrap(), grad(q), grad(k), grad(v)]
}

/// Largest difference between `a` and `b` in units of `b`'s magnitude (relative to 1 at most).
fn max_relative(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, nan_max)
}

#[test]
fn grouped_query_attention_equals_repeated_key_value_heads() {
    let cpu = CpuBackend::new_ref();
    let mut random = Xorshift::from_state(0x9a7e_0001);
    // (heads, kv_heads, causal) in f64, f32 and bf16: forward bitwise (the same per-head sums),
    // gradients of q bitwise, of k and v within the dtype's rounding of a sum over the group
    // (the reference rounds each head's share to the dtype before summing; the fused op sums in
    // f64 and rounds once).
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        for (heads, kv_heads, causal) in [(4, 2, true), (6, 1, false), (3, 3, true)] {
            let q = leaf(&cpu, &mut random, &[2, heads, 9, 8], dtype);
            let k = leaf(&cpu, &mut random, &[2, kv_heads, 9, 8], dtype);
            let v = leaf(&cpu, &mut random, &[2, kv_heads, 9, 8], dtype);
            let dout = leaf(&cpu, &mut random, &[2, heads, 9, 8], dtype);
            let n_rep = heads / kv_heads;
            let fused = run([&q, &k, &v], &dout, |q, k, v| {
                scaled_dot_product_attention(q, k, v, causal, None)
            });
            let reference = run([&q, &k, &v], &dout, |q, k, v| {
                let (k, v) = (repeat_heads(k, n_rep)?, repeat_heads(v, n_rep)?);
                scaled_dot_product_attention(q, &k, &v, causal, None)
            });
            assert_eq!(
                fused[0], reference[0],
                "{dtype:?} h{heads} kv{kv_heads} out"
            );
            assert_eq!(fused[1], reference[1], "{dtype:?} h{heads} kv{kv_heads} dq");
            let tolerance = match dtype {
                DType::F64 => 1e-15,
                DType::F32 => 4.0 * f64::from(f32::EPSILON),
                _ => 4.0 / 128.0,
            };
            for (name, index) in [("dk", 2), ("dv", 3)] {
                let error = max_relative(&fused[index], &reference[index]);
                assert!(
                    error <= tolerance,
                    "{dtype:?} h{heads} kv{kv_heads} {name}: {error:e}"
                );
            }
        }
    }
}

#[test]
fn packed_sequences_equal_each_sequence_alone() {
    let cpu = CpuBackend::new_ref();
    let mut random = Xorshift::from_state(0x9a7e_0002);
    let lengths = [5usize, 1, 0, 12, 7];
    let packed = PackedSequences::from_lengths(&cpu, &lengths).unwrap();
    assert_eq!(packed.cu_seqlens(), [0, 5, 6, 6, 18, 25]);
    assert_eq!(packed.total_tokens(), 25);
    assert_eq!(packed.max_len(), 12);
    assert_eq!(&packed.positions()[..8], [0, 1, 2, 3, 4, 0, 0, 1]);
    for causal in [true, false] {
        let (heads, kv_heads, d) = (4, 2, 6);
        let q = leaf(&cpu, &mut random, &[1, heads, 25, d], DType::F64);
        let k = leaf(&cpu, &mut random, &[1, kv_heads, 25, d], DType::F64);
        let v = leaf(&cpu, &mut random, &[1, kv_heads, 25, d], DType::F64);
        let dout = leaf(&cpu, &mut random, &[1, heads, 25, d], DType::F64);
        let together = run([&q, &k, &v], &dout, |q, k, v| {
            scaled_dot_product_attention_varlen(q, k, v, &packed, causal, None)
        });
        // Each sequence alone (row slices of the same leaves), results put back end to end.
        let alone = run([&q, &k, &v], &dout, |q, k, v| {
            let mut outs = Vec::new();
            for bounds in packed.cu_seqlens().windows(2) {
                let (first, len) = (bounds[0] as usize, (bounds[1] - bounds[0]) as usize);
                if len > 0 {
                    let rows = |t: &Tensor| t.narrow(2, first, len);
                    outs.push(scaled_dot_product_attention(
                        &rows(q)?,
                        &rows(k)?,
                        &rows(v)?,
                        causal,
                        None,
                    )?);
                }
            }
            headroom_autograd_core::cat(&outs.iter().collect::<Vec<_>>(), 2)
        });
        for (name, (a, b)) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(together.iter().zip(&alone))
        {
            // f64 sums over the same keys in the same order: equal to the last bits.
            let error = max_relative(a, b);
            assert!(error <= 1e-15, "causal={causal} {name}: {error:e}");
        }
    }
}

#[test]
fn bad_heads_and_boundaries_are_typed_errors() {
    let cpu = CpuBackend::new_ref();
    let mut random = Xorshift::from_state(0x9a7e_0003);
    let q = leaf(&cpu, &mut random, &[1, 3, 6, 4], DType::F32);
    let kv = leaf(&cpu, &mut random, &[1, 2, 6, 4], DType::F32);
    // 2 key/value heads do not divide 3 query heads: the error names both shapes.
    let err = scaled_dot_product_attention(&q, &kv, &kv, true, None).unwrap_err();
    assert!(
        matches!(&err, TensorError::ShapeMismatch { lhs, rhs, .. }
            if lhs == &[1, 3, 6, 4] && rhs == &[1, 2, 6, 4]),
        "{err:?}"
    );
    let invalid = |result: Result<PackedSequences>, fragment: &str| {
        let err = result.unwrap_err();
        assert!(
            matches!(&err, TensorError::InvalidArgument { reason, .. } if reason.contains(fragment)),
            "{err:?}"
        );
    };
    invalid(
        PackedSequences::new(&cpu, &[0, 4, 2, 6]),
        "must not decrease",
    );
    invalid(PackedSequences::new(&cpu, &[1, 6]), "start at 0");
    invalid(PackedSequences::new(&cpu, &[0]), "at least two entries");
    // Boundaries that end before the token count.
    let short = PackedSequences::new(&cpu, &[0, 2, 5]).unwrap();
    let q = leaf(&cpu, &mut random, &[1, 2, 6, 4], DType::F32);
    let err = scaled_dot_product_attention_varlen(&q, &kv, &kv, &short, true, None).unwrap_err();
    assert!(
        matches!(&err, TensorError::InvalidArgument { reason, .. } if reason.contains("[1, heads, 5, head_dim]")),
        "{err:?}"
    );
    // cu_seqlens of the wrong dtype.
    let as_i64 = Tensor::from_slice(&cpu, &[0i64, 6], &[2]).unwrap();
    assert!(matches!(
        PackedSequences::from_tensor(&as_i64),
        Err(TensorError::DtypeMismatch {
            lhs: DType::I32,
            rhs: DType::I64,
            ..
        })
    ));
    let as_i32 = Tensor::from_slice(&cpu, &[0i32, 2, 6], &[3]).unwrap();
    let packed = PackedSequences::from_tensor(&as_i32).unwrap();
    assert_eq!(packed.cu_seqlens(), [0, 2, 6]);
    // A batch of two rows cannot be packed.
    let two_rows = leaf(&cpu, &mut random, &[2, 2, 6, 4], DType::F32);
    let err =
        scaled_dot_product_attention_varlen(&two_rows, &two_rows, &two_rows, &packed, true, None)
            .unwrap_err();
    assert!(
        matches!(err, TensorError::InvalidArgument { .. }),
        "{err:?}"
    );
}

/// The composition fused dropout replaces: `dropout(softmax(q kᵀ / sqrt(d), hidden → -inf)) v`,
/// `hidden(i, j)` saying which keys query `i` does not see, the weights' dropout drawn from
/// `generator`.
fn materialised(
    [q, k, v]: [&Tensor; 3],
    hidden: impl Fn(usize, usize) -> bool,
    p: f64,
    generator: &Generator,
) -> Result<Tensor> {
    let (queries, keys, head_dim) = (q.shape()[2], k.shape()[2], q.shape()[3]);
    let n_rep = q.shape()[1] / k.shape()[1];
    let (k, v) = (repeat_heads(k, n_rep)?, repeat_heads(v, n_rep)?);
    let mask: Vec<f64> = (0..queries * keys)
        .map(|at| f64::from(u8::from(hidden(at / keys, at % keys))))
        .collect();
    let mask = Tensor::from_f64s(q.backend(), &mask, &[queries, keys], DType::Bool)?;
    let weights = q
        .matmul(&k.transpose(-1, -2)?)?
        .div_scalar((head_dim as f64).sqrt())?
        .masked_fill(&mask, f64::NEG_INFINITY)?
        .softmax(-1)?;
    dropout(&weights, p, true, generator)?.matmul(&v)
}

#[test]
fn fused_dropout_equals_dropout_on_the_materialised_weights() {
    let cpu = CpuBackend::new_ref();
    let mut random = Xorshift::from_state(0xd409_0001);
    // (heads, kv_heads, queries, keys, causal): rectangular, causal, grouped-query.
    let cases = [
        (2, 2, 7, 11, false),
        (4, 2, 9, 9, true),
        (3, 1, 16, 16, false),
    ];
    for (dtype, tolerance) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        for (heads, kv_heads, queries, keys, causal) in cases {
            for p in [0.1, 0.5] {
                let q = leaf(&cpu, &mut random, &[2, heads, queries, 8], dtype);
                let k = leaf(&cpu, &mut random, &[2, kv_heads, keys, 8], dtype);
                let v = leaf(&cpu, &mut random, &[2, kv_heads, keys, 8], dtype);
                let dout = leaf(&cpu, &mut random, &[2, heads, queries, 8], dtype);
                let (fused_stream, reference_stream) = (Generator::new(17), Generator::new(17));
                // Both streams start past earlier draws, as in a model.
                fused_stream.advance(1000);
                reference_stream.advance(1000);
                let fused = run([&q, &k, &v], &dout, |q, k, v| {
                    scaled_dot_product_attention_dropout(q, k, v, causal, None, p, &fused_stream)
                });
                let reference = run([&q, &k, &v], &dout, |q, k, v| {
                    materialised([q, k, v], |i, j| causal && j > i, p, &reference_stream)
                });
                let what = format!("{dtype:?} {heads}/{kv_heads} {queries}x{keys} {causal} {p}");
                for (name, (f, r)) in ["out", "dq", "dk", "dv"]
                    .iter()
                    .zip(fused.iter().zip(&reference))
                {
                    let error = max_relative(f, r);
                    assert!(error <= tolerance, "{what} {name}: {error:e}");
                }
                assert_eq!(fused_stream.state(), reference_stream.state(), "{what}");
                // Dropout did drop: the result is not plain attention's.
                let plain = run([&q, &k, &v], &dout, |q, k, v| {
                    scaled_dot_product_attention(q, k, v, causal, None)
                });
                assert!(max_relative(&fused[0], &plain[0]) > 1e-3, "{what}");
            }
        }
    }
}

#[test]
fn packed_dropout_equals_dropout_on_the_block_diagonal_weights() {
    let cpu = CpuBackend::new_ref();
    let mut random = Xorshift::from_state(0xd409_0002);
    let lengths = [5, 0, 9, 3];
    let tokens: usize = lengths.iter().sum();
    let packed = PackedSequences::from_lengths(&cpu, &lengths).unwrap();
    let sequence: Vec<usize> = lengths
        .iter()
        .enumerate()
        .flat_map(|(n, &len)| std::iter::repeat_n(n, len))
        .collect();
    for causal in [false, true] {
        let q = leaf(&cpu, &mut random, &[1, 4, tokens, 8], DType::F64);
        let k = leaf(&cpu, &mut random, &[1, 2, tokens, 8], DType::F64);
        let v = leaf(&cpu, &mut random, &[1, 2, tokens, 8], DType::F64);
        let dout = leaf(&cpu, &mut random, &[1, 4, tokens, 8], DType::F64);
        let (fused_stream, reference_stream) = (Generator::new(5), Generator::new(5));
        let fused = run([&q, &k, &v], &dout, |q, k, v| {
            scaled_dot_product_attention_varlen_dropout(
                q,
                k,
                v,
                &packed,
                causal,
                None,
                0.3,
                &fused_stream,
            )
        });
        let reference = run([&q, &k, &v], &dout, |q, k, v| {
            let hidden = |i: usize, j: usize| sequence[i] != sequence[j] || (causal && j > i);
            materialised([q, k, v], hidden, 0.3, &reference_stream)
        });
        for (name, (f, r)) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(fused.iter().zip(&reference))
        {
            let error = max_relative(f, r);
            assert!(error <= 1e-12, "causal {causal} {name}: {error:e}");
        }
        assert_eq!(fused_stream.state(), reference_stream.state());
    }
}

#[test]
fn probability_zero_is_plain_attention_and_one_drops_everything() {
    let cpu = CpuBackend::new_ref();
    let mut random = Xorshift::from_state(0xd409_0003);
    let q = leaf(&cpu, &mut random, &[1, 2, 6, 4], DType::F32);
    let k = leaf(&cpu, &mut random, &[1, 2, 6, 4], DType::F32);
    let v = leaf(&cpu, &mut random, &[1, 2, 6, 4], DType::F32);
    let dout = leaf(&cpu, &mut random, &[1, 2, 6, 4], DType::F32);
    let stream = Generator::new(3);
    let none = run([&q, &k, &v], &dout, |q, k, v| {
        scaled_dot_product_attention_dropout(q, k, v, true, None, 0.0, &stream)
    });
    let plain = run([&q, &k, &v], &dout, |q, k, v| {
        scaled_dot_product_attention(q, k, v, true, None)
    });
    assert_eq!(none, plain, "p = 0 is plain attention, bit for bit");
    assert_eq!(stream.state().offset, 0, "and draws nothing");

    let all = run([&q, &k, &v], &dout, |q, k, v| {
        scaled_dot_product_attention_dropout(q, k, v, false, None, 1.0, &stream)
    });
    for (name, values) in ["out", "dq", "dk", "dv"].iter().zip(&all) {
        assert!(values.iter().all(|&x| x == 0.0), "p = 1: {name} is zero");
    }
    assert_eq!(stream.state().offset, 2 * 6 * 6);
}

#[test]
fn a_probability_outside_zero_to_one_is_a_typed_error() {
    let cpu = CpuBackend::new_ref();
    let q = Tensor::from_slice(&cpu, &[0.5f32; 16], &[1, 1, 4, 4]).unwrap();
    let stream = Generator::new(0);
    for p in [-0.1, 1.5, f64::NAN] {
        let error =
            scaled_dot_product_attention_dropout(&q, &q, &q, false, None, p, &stream).unwrap_err();
        assert!(
            matches!(error, TensorError::InvalidArgument { .. }),
            "{p}: {error}"
        );
    }
    assert_eq!(stream.state().offset, 0);
}
