//! Element-wise primitives on the GPU against the CPU: every unary and binary op in f32, f64,
//! f16 and bf16 on contiguous, broadcast and transposed operands; the dense path (vector
//! kernels, the driver's memset and copy) against the strided one, with tails and unaligned
//! starts, writing nothing outside the view; fill and copies between every pair of dtypes, and
//! casts into and out of the 8-bit floats to the bit.

use headroom_autograd_core::{
    BackendRef, BinaryOp, Buffer, DType, Float8Recipe, Layout, Tensor, UnaryOp, View,
};

use crate::{check, download, input, poisoned, seeded_backends, upload, view, FLOATS};
use headroom_testkit::worst::{abs_difference, nan_max};

const ALL: [DType; 8] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::U8,
    DType::Bool,
];

const ROWS: usize = 37;

const COLS: usize = 129;

fn unary_ops() -> Vec<UnaryOp> {
    vec![
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Tanh,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::AddScalar(0.75),
        UnaryOp::MulScalar(-1.5),
        UnaryOp::DivScalar(3.0),
        UnaryOp::PowScalar(1.7),
    ]
}

fn binary_ops() -> Vec<BinaryOp> {
    vec![
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::ReluBackward,
        BinaryOp::GeluBackward,
        BinaryOp::GeluTanhBackward,
        BinaryOp::TanhBackward,
        BinaryOp::SqrtBackward,
        BinaryOp::RsqrtBackward,
    ]
}

#[test]
#[ignore = "needs a CUDA device"]
fn unary_ops_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x9e37_79b9_7f4a_7c15) else {
        return;
    };
    let layout = Layout::contiguous(&[ROWS, COLS]);
    // The input read transposed: a [COLS, ROWS] view of the same buffer.
    let transposed = Layout::from_parts(&[COLS, ROWS], &[1, COLS], 0).unwrap();
    let out_t = Layout::contiguous(&[COLS, ROWS]);
    for dtype in FLOATS {
        for op in unary_ops() {
            let positive = matches!(
                op,
                UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::PowScalar(_)
            );
            let values = input(&mut random, positive, ROWS * COLS);
            for (in_layout, out_layout) in [(&layout, &layout), (&transposed, &out_t)] {
                let mut results = Vec::new();
                for backend in [&gpu, &cpu] {
                    let x = upload(backend, dtype, &values);
                    let out = poisoned(backend, dtype, ROWS * COLS);
                    backend
                        .unary(
                            op,
                            view(&x, in_layout, dtype),
                            view(&out, out_layout, dtype),
                        )
                        .unwrap();
                    results.push(download(backend, dtype, &out));
                }
                check(&format!("{op:?}"), dtype, &results[0], &results[1]);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn binary_ops_with_broadcasting_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x2545_f491_4f6c_dd1d) else {
        return;
    };
    let full = Layout::contiguous(&[ROWS, COLS]);
    // b is one row broadcast over all rows (stride 0).
    let row_broadcast = Layout::from_parts(&[ROWS, COLS], &[0, 1], 0).unwrap();
    for dtype in FLOATS {
        for op in binary_ops() {
            let positive = matches!(
                op,
                BinaryOp::Pow | BinaryOp::SqrtBackward | BinaryOp::RsqrtBackward | BinaryOp::Div
            );
            let a = input(&mut random, positive, ROWS * COLS);
            let b = input(&mut random, positive, COLS);
            let mut results = Vec::new();
            for backend in [&gpu, &cpu] {
                let a_buffer = upload(backend, dtype, &a);
                let b_buffer = upload(backend, dtype, &b);
                let out = poisoned(backend, dtype, ROWS * COLS);
                backend
                    .binary(
                        op,
                        view(&a_buffer, &full, dtype),
                        view(&b_buffer, &row_broadcast, dtype),
                        view(&out, &full, dtype),
                    )
                    .unwrap();
                results.push(download(backend, dtype, &out));
            }
            check(&format!("{op:?}"), dtype, &results[0], &results[1]);
        }
    }
}

/// One op of [`dense_runs_with_tails_and_offsets_match_the_cpu`] on `backend`: `x` and `y` read
/// and `out` written through `layout`.
fn run_dense_case(
    backend: &BackendRef,
    case: usize,
    dtype: DType,
    layout: &Layout,
    (x, y, out): (&Buffer, &Buffer, &Buffer),
) {
    let view = |buffer| View {
        buffer,
        layout,
        dtype,
    };
    match case {
        0 => backend.unary(UnaryOp::Gelu, view(x), view(out)),
        1 => backend.binary(BinaryOp::Mul, view(x), view(y), view(out)),
        2 => backend.fill(view(out), 3.0),
        _ => backend.copy(view(x), view(out)),
    }
    .unwrap();
}

/// Contiguous runs take the dense path (16-byte vector kernels, the driver's memset and copy) when
/// their start is aligned and the strided kernels when not; lengths that are no multiple of the
/// vector width end in a tail. Every case matches the CPU, and no element outside the view is
/// written.
#[test]
#[ignore = "needs a CUDA device"]
fn dense_runs_with_tails_and_offsets_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x6a09_e667_f3bc_c909) else {
        return;
    };
    let n = 1003;
    let total = n + 9;
    for dtype in FLOATS {
        for offset in [0, 1, 8] {
            let layout = Layout::from_parts(&[n], &[1], offset).unwrap();
            let x = input(&mut random, false, total);
            let y = input(&mut random, false, total);
            for case in 0..4 {
                let mut results = Vec::new();
                for backend in [&gpu, &cpu] {
                    let (xb, yb) = (upload(backend, dtype, &x), upload(backend, dtype, &y));
                    let out = poisoned(backend, dtype, total);
                    run_dense_case(backend, case, dtype, &layout, (&xb, &yb, &out));
                    results.push(download(backend, dtype, &out));
                }
                let what = format!("dense case {case} at offset {offset}");
                let inside = offset..offset + n;
                check(
                    &what,
                    dtype,
                    &results[0][inside.clone()],
                    &results[1][inside],
                );
                let outside = (0..total).filter(|i| *i < offset || *i >= offset + n);
                for i in outside {
                    assert!(
                        results[0][i].is_nan(),
                        "{what} {dtype:?}: wrote element {i}"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fill_and_every_cast_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0xd1b5_4a32_d192_ed03) else {
        return;
    };
    let n = 1000;
    let layout = Layout::contiguous(&[n]);
    for dtype in ALL {
        let mut results = Vec::new();
        for backend in [&gpu, &cpu] {
            let out = poisoned(backend, dtype, n);
            backend.fill(view(&out, &layout, dtype), 7.0).unwrap();
            results.push(download(backend, dtype, &out));
        }
        assert_eq!(results[0], results[1], "fill {dtype:?}");
        assert!(results[0]
            .iter()
            .all(|&v| v == if dtype == DType::Bool { 1.0 } else { 7.0 }));
    }
    // Whole numbers in 0..100 (and 0/1 for bool) survive every cast exactly.
    for from in ALL {
        let values: Vec<f64> = (0..n)
            .map(|_| {
                let v = random.next_f64_in(0.0, 100.0).floor();
                if from == DType::Bool {
                    (v as u64 % 2) as f64
                } else {
                    v
                }
            })
            .collect();
        for to in ALL {
            let results = [&gpu, &cpu].map(|b| copied(b, &values, from, from, to));
            assert_eq!(results[0], results[1], "copy {from:?} -> {to:?}");
        }
    }
}

/// `values` uploaded as `stored`, read as `from` and copied into a poisoned buffer of `to` on
/// `backend`: what the copy wrote.
fn copied(backend: &BackendRef, values: &[f64], stored: DType, from: DType, to: DType) -> Vec<f64> {
    let layout = Layout::contiguous(&[values.len()]);
    let src = upload(backend, stored, values);
    let dst = poisoned(backend, to, values.len());
    backend
        .copy(view(&src, &layout, from), view(&dst, &layout, to))
        .unwrap();
    download(backend, to, &dst)
}

/// Casts into E4M3 and E5M2 (nearest-even, saturating, NaN and -0 kept) from f32, f64, bf16 and
/// f16 give the CPU's codes, over values from the formats' subnormals past their largest finite
/// value; every code casts out to those dtypes as on the CPU; fill writes the same code.
#[test]
#[ignore = "needs a CUDA device"]
fn float8_casts_match_the_cpu_bit_for_bit() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x5eed_f8f8_0123_4567) else {
        return;
    };
    let same = |a: &[f64], b: &[f64]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    };
    let mut values: Vec<f64> = (0..4000)
        .map(|_| {
            let magnitude = 2f64.powf(random.next_f64_in(-20.0, 18.0));
            if random.next_f64_in(0.0, 1.0) < 0.5 {
                -magnitude
            } else {
                magnitude
            }
        })
        .collect();
    values.extend([
        0.0,
        -0.0,
        f64::NAN,
        1e30,
        -1e30,
        448.0,
        464.0,
        57344.0,
        61440.0,
    ]);
    let n = values.len();
    let layout = Layout::contiguous(&[n]);
    let wide = [DType::F32, DType::F64, DType::BF16, DType::F16];
    for to in [DType::F8E4M3, DType::F8E5M2] {
        for from in wide {
            let results = [&gpu, &cpu].map(|b| copied(b, &values, from, from, to));
            assert!(same(&results[0], &results[1]), "copy {from:?} -> {to:?}");
        }
        // Every code out to the wide dtypes.
        let codes: Vec<f64> = (0..=u8::MAX)
            .map(|bits| match to {
                DType::F8E4M3 => float8::F8E4M3::from_bits(bits).to_f64(),
                _ => float8::F8E5M2::from_bits(bits).to_f64(),
            })
            .collect();
        let code_bytes: Vec<f64> = (0..256).map(f64::from).collect();
        for dest in wide {
            let results = [&gpu, &cpu].map(|b| copied(b, &code_bytes, DType::U8, to, dest));
            assert!(same(&results[0], &results[1]), "copy {to:?} -> {dest:?}");
            if dest == DType::F64 {
                assert!(same(&results[0], &codes), "{to:?} codes widen exactly");
            }
        }
        let mut results = Vec::new();
        for backend in [&gpu, &cpu] {
            let out = poisoned(backend, to, n);
            backend.fill(view(&out, &layout, to), -3.3).unwrap();
            results.push(download(backend, to, &out));
        }
        assert!(same(&results[0], &results[1]), "fill {to:?}");
    }
}

/// The fp8 linear on the GPU (the fp8 quantize and cuBLASLt's fp8 GEMMs, the backward's
/// operands through the transpose kernel), under the tensorwise and the rowwise recipe (outer-
/// vector scales): its output and the three gradients within 2^-9 of the CPU's largest, from
/// the same codes. Hopper's fp8 tensor cores keep about 14 bits in their
/// partial sums (see `float8_matmul_matches_the_cpu`), and these random-signed sums cancel to a
/// few times less than their terms: measured 2^-10.7 for the output on the H200.
#[test]
#[ignore = "needs a CUDA device"]
fn the_fp8_linear_matches_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x0f8f_8e4d_3e5d_2cab) else {
        return;
    };
    let (rows, k, n) = (64, 128, 96);
    let mut draw =
        |count: usize| -> Vec<f64> { (0..count).map(|_| random.next_f64_in(-2.0, 2.0)).collect() };
    let (xs, ws, bs, rs) = (draw(rows * k), draw(n * k), draw(n), draw(rows * n));
    let run = |backend: &BackendRef, recipe: Float8Recipe| -> Vec<Vec<f64>> {
        let leaf = |values: &[f64], shape: &[usize]| {
            let t = Tensor::from_f64s(backend, values, shape, DType::F32).unwrap();
            t.requires_grad_(true).unwrap();
            t
        };
        let (x, w, b) = (leaf(&xs, &[rows, k]), leaf(&ws, &[n, k]), leaf(&bs, &[n]));
        let y = x.linear_float8_with(&w, Some(&b), recipe).unwrap();
        let r = Tensor::from_f64s(backend, &rs, &[rows, n], DType::F32).unwrap();
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        [y, x.grad().unwrap(), w.grad().unwrap(), b.grad().unwrap()]
            .iter()
            .map(|t| t.to_vec_f64().unwrap())
            .collect()
    };
    for recipe in [Float8Recipe::TENSORWISE, Float8Recipe::ROWWISE] {
        let (on_gpu, on_cpu) = (run(&gpu, recipe), run(&cpu, recipe));
        for (name, (g, c)) in ["y", "dx", "dw", "db"]
            .iter()
            .zip(on_gpu.iter().zip(&on_cpu))
        {
            let scale = c.iter().fold(1e-30f64, |m, v| nan_max(m, v.abs()));
            let worst = abs_difference(g, c);
            assert!(
                worst <= 2f64.powi(-9) * scale,
                "{recipe:?} {name}: {worst} against {scale}"
            );
        }
    }
}
