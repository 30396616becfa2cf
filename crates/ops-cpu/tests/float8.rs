//! fp8 casts with a tensorwise scale and the fp8 linear on the CPU backend, against the recipe
//! computed here element by element in f64 (torchao's float8 training with tensorwise current
//! scaling: `scale = max / max(amax, 1e-12)` in f64 rounded to f32, codes `saturate(x · scale)`,
//! products of codes times both scales' f32 reciprocals).

use headroom_autograd_core::{BackendRef, DType, Tensor, TensorError};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::Xorshift;
use headroom_testkit::worst::nan_max;

/// torchao's scale for `values` in `max`'s format, as f32.
fn scale_of(values: &[f64], max: f64) -> f32 {
    let amax = values.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
    (max / amax) as f32
}

/// The codes (as their values) of `values` scaled by `scale` in `dtype`.
fn codes_of(values: &[f64], scale: f32, dtype: DType) -> Vec<f64> {
    values
        .iter()
        .map(|&v| {
            let scaled = f64::from(v as f32 * scale);
            match dtype {
                DType::F8E4M3 => float8::F8E4M3::from_f64(scaled).to_f64(),
                _ => float8::F8E5M2::from_f64(scaled).to_f64(),
            }
        })
        .collect()
}

/// `a [m, k] · b [k, n]` in f64 times both scales' f32 reciprocals.
fn product(a: &[f64], b: &[f64], (m, k, n): (usize, usize, usize), sa: f32, sb: f32) -> Vec<f64> {
    let alpha = f64::from((1.0 / sa) * (1.0 / sb));
    (0..m * n)
        .map(|ij| {
            let (i, j) = (ij / n, ij % n);
            alpha * (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum::<f64>()
        })
        .collect()
}

fn transpose(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows * cols)
        .map(|ji| x[(ji % rows) * cols + ji / rows])
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 2e-6 * scale,
            "{what}[{i}]: {g} against {w}"
        );
    }
    assert_eq!(got.len(), want.len(), "{what}");
}

/// A linear's input `[rows, k]`, weight `[n, k]`, bias `[n]` and output weights `[rows, n]`,
/// f32-representable, from `seed`.
fn linear_operands(seed: u64, rows: usize, k: usize, n: usize) -> [Vec<f64>; 4] {
    let mut random = Xorshift::from_state(seed);
    let mut draw = |count: usize, spread: f64| -> Vec<f64> {
        (0..count)
            .map(|_| f64::from(random.next_f64_in(-spread, spread) as f32))
            .collect()
    };
    [
        draw(rows * k, 3.0),
        draw(n * k, 0.5),
        draw(n, 1.0),
        draw(rows * n, 2.0),
    ]
}

#[test]
fn a_tensorwise_cast_scales_by_the_amax_and_dequantizes() {
    let cpu: BackendRef = CpuBackend::new_ref();
    let x = Tensor::from_f64s(&cpu, &[1.0, -2.0, 4.0, 0.5], &[2, 2], DType::BF16).unwrap();
    let e4m3 = x.to_float8(DType::F8E4M3).unwrap();
    assert_eq!(e4m3.scale.shape(), &[] as &[usize]);
    assert_eq!(e4m3.scale.to_vec_f64().unwrap(), [112.0]); // 448 / 4
    assert_eq!(e4m3.codes.dtype(), DType::F8E4M3);
    assert_eq!(
        e4m3.codes.to_vec_f64().unwrap(),
        [112.0, -224.0, 448.0, 56.0]
    );
    assert_eq!(
        e4m3.dequantize(DType::F32).unwrap().to_vec_f64().unwrap(),
        [1.0, -2.0, 4.0, 0.5]
    );
    let e5m2 = x.to_float8(DType::F8E5M2).unwrap();
    assert_eq!(e5m2.scale.to_vec_f64().unwrap(), [14336.0]); // 57344 / 4
                                                             // All zeros: the amax floor, no division by zero.
    let zeros = Tensor::zeros(&cpu, &[3], DType::F32).unwrap();
    let cast = zeros.to_float8(DType::F8E4M3).unwrap();
    assert_eq!(cast.scale.to_vec_f64().unwrap(), [f64::from(448e12f32)]);
    assert_eq!(cast.codes.to_vec_f64().unwrap(), [0.0; 3]);
    // Only the 8-bit floats are targets; only floats are sources.
    assert!(matches!(
        x.to_float8(DType::BF16),
        Err(TensorError::UnsupportedDtype { .. })
    ));
    let ints = Tensor::from_slice(&cpu, &[1i64, 2], &[2]).unwrap();
    assert!(ints.to_float8(DType::F8E4M3).is_err());
}

#[test]
fn the_fp8_linear_and_its_gradients_follow_the_recipe() {
    let cpu: BackendRef = CpuBackend::new_ref();
    let (rows, k, n) = (6, 16, 8);
    let [xs, ws, bs, rs] = linear_operands(0xf8f8_1234_5678_9abc, rows, k, n);
    let leaf = |values: &[f64], shape: &[usize]| {
        let t = Tensor::from_f64s(&cpu, values, shape, DType::F32).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let (x, w, b) = (leaf(&xs, &[2, 3, k]), leaf(&ws, &[n, k]), leaf(&bs, &[n]));
    let y = x.linear_float8(&w, Some(&b)).unwrap();
    assert_eq!(y.shape(), &[2, 3, n]);

    // Forward: E4M3 codes of x and w, their product, the bias.
    let (sx, sw) = (scale_of(&xs, 448.0), scale_of(&ws, 448.0));
    let (qx, qw) = (
        codes_of(&xs, sx, DType::F8E4M3),
        codes_of(&ws, sw, DType::F8E4M3),
    );
    let mut want = product(&qx, &transpose(&qw, n, k), (rows, k, n), sx, sw);
    for (i, v) in want.iter_mut().enumerate() {
        *v += bs[i % n];
    }
    assert_close(&y.to_vec_f64().unwrap(), &want, "y");

    // Backward of sum(y · r): dY = r in E5M2 for both products, the bias gradient from r itself.
    let r = Tensor::from_f64s(&cpu, &rs, &[2, 3, n], DType::F32).unwrap();
    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let sg = scale_of(&rs, 57344.0);
    let qg = codes_of(&rs, sg, DType::F8E5M2);
    let dx = product(&qg, &qw, (rows, n, k), sg, sw);
    let dw = product(&transpose(&qg, rows, n), &qx, (n, rows, k), sg, sx);
    let db: Vec<f64> = (0..n)
        .map(|j| (0..rows).map(|i| rs[i * n + j]).sum())
        .collect();
    assert_close(&x.grad().unwrap().to_vec_f64().unwrap(), &dx, "dx");
    assert_close(&w.grad().unwrap().to_vec_f64().unwrap(), &dw, "dw");
    assert_close(&b.grad().unwrap().to_vec_f64().unwrap(), &db, "db");

    // bf16 in, bf16 out; mixed dtypes and wrong shapes are typed errors.
    let xb = x.detach().to_dtype(DType::BF16).unwrap();
    let wb = w.detach().to_dtype(DType::BF16).unwrap();
    assert_eq!(xb.linear_float8(&wb, None).unwrap().dtype(), DType::BF16);
    assert!(matches!(
        xb.linear_float8(&w, None),
        Err(TensorError::DtypeMismatch { .. })
    ));
    assert!(matches!(
        x.linear_float8(&w.t().unwrap(), None),
        Err(TensorError::InvalidArgument { .. })
    ));
}

/// torchao's scale from an amax, rounded down to a power of two when asked (the rowwise recipe).
fn scale_from_amax(amax: f64, max: f64, power_of_two: bool) -> f32 {
    let scale = (max / amax.max(1e-12)) as f32;
    if power_of_two {
        2f32.powi(f64::from(scale).log2().floor() as i32)
    } else {
        scale
    }
}

fn rows_of(values: &[f64], cols: usize) -> impl Iterator<Item = &[f64]> {
    values.chunks(cols)
}

/// Per-row scales and codes of a row-major `[rows, cols]` matrix, each value first multiplied by
/// its column's `premultiply` in f32 (the fold of another operand's scales).
fn rowwise(
    values: &[f64],
    cols: usize,
    premultiply: Option<&[f32]>,
    dtype: DType,
) -> (Vec<f32>, Vec<f64>) {
    let max = dtype.max_finite().unwrap();
    let (mut scales, mut codes) = (Vec::new(), Vec::new());
    for row in rows_of(values, cols) {
        let row: Vec<f64> = match premultiply {
            Some(factors) => row
                .iter()
                .zip(factors)
                .map(|(&v, &f)| f64::from(v as f32 * f))
                .collect(),
            None => row.to_vec(),
        };
        let amax = row.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let scale = scale_from_amax(amax, max, true);
        scales.push(scale);
        codes.extend(codes_of(&row, scale, dtype));
    }
    (scales, codes)
}

/// `a [m, k] · b [k, n]` in f64, element `[i, j]` times `f32(row[i] · col[j])`.
fn scaled_product(
    a: &[f64],
    b: &[f64],
    (m, k, n): (usize, usize, usize),
    row: &[f32],
    col: &[f32],
) -> Vec<f64> {
    (0..m * n)
        .map(|ij| {
            let (i, j) = (ij / n, ij % n);
            let sum: f64 = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
            sum * f64::from(row[i] * col[j])
        })
        .collect()
}

fn reciprocals(scales: &[f32]) -> Vec<f32> {
    scales.iter().map(|s| 1.0 / s).collect()
}

/// Rowwise casts: each row's scale is `2^floor(log2(max / amax))` (or the exact quotient), the
/// scales take the tensor's shape less its last dim, a strided input reads in place, a NaN
/// poisons only its own row's scale (every scale under tensorwise), and a 0-dim tensor is an
/// error.
#[test]
fn a_rowwise_cast_scales_each_row_by_its_own_amax() {
    let cpu: BackendRef = CpuBackend::new_ref();
    let (rows, cols) = (6, 10);
    let mut random = Xorshift::from_state(0x0123_4567_89ab_cdef);
    // Rows spanning 2^-12 to 2^12, one all zero.
    let values: Vec<f64> = (0..rows * cols)
        .map(|i| {
            let spread = if i / cols == 3 {
                0.0
            } else {
                2f64.powi(5 * (i / cols) as i32 - 12)
            };
            f64::from(random.next_f64_in(-spread, spread) as f32)
        })
        .collect();
    let x = Tensor::from_f64s(&cpu, &values, &[2, 3, cols], DType::F32).unwrap();
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let cast = x.to_float8_rowwise(dtype, true).unwrap();
        assert_eq!(cast.scale.shape(), &[2, 3]);
        assert_eq!(cast.codes.shape(), &[2, 3, cols]);
        let (scales, codes) = rowwise(&values, cols, None, dtype);
        let got: Vec<f32> = cast.scale.to_vec::<f32>().unwrap();
        assert_eq!(got, scales, "{dtype:?} scales");
        assert!(got.iter().all(|s| s.log2().fract() == 0.0));
        assert_eq!(cast.codes.to_vec_f64().unwrap(), codes, "{dtype:?} codes");
        // Exact quotients without the rounding.
        let exact = x.to_float8_rowwise(dtype, false).unwrap();
        for (row, got) in rows_of(&values, cols).zip(exact.scale.to_vec::<f32>().unwrap()) {
            let amax = row.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert_eq!(
                got,
                scale_from_amax(amax, dtype.max_finite().unwrap(), false)
            );
        }
    }
    // A transposed view quantizes its own rows (the columns of the storage).
    let m = Tensor::from_f64s(&cpu, &values, &[rows, cols], DType::F32).unwrap();
    let by_column = m
        .t()
        .unwrap()
        .to_float8_rowwise(DType::F8E4M3, true)
        .unwrap();
    let (scales, codes) = rowwise(&transpose(&values, rows, cols), rows, None, DType::F8E4M3);
    assert_eq!(by_column.scale.to_vec::<f32>().unwrap(), scales);
    assert_eq!(by_column.codes.to_vec_f64().unwrap(), codes);
    // NaN: its row's scale only; every scale under tensorwise.
    let mut poisoned = values.clone();
    poisoned[2 * cols + 1] = f64::NAN;
    let p = Tensor::from_f64s(&cpu, &poisoned, &[rows, cols], DType::F32).unwrap();
    let scales = p.to_float8_rowwise(DType::F8E4M3, true).unwrap().scale;
    let nan: Vec<bool> = scales
        .to_vec_f64()
        .unwrap()
        .iter()
        .map(|s| s.is_nan())
        .collect();
    assert_eq!(nan, [false, false, true, false, false, false]);
    assert!(p
        .to_float8(DType::F8E4M3)
        .unwrap()
        .scale
        .item()
        .unwrap()
        .is_nan());
    let scalar = Tensor::scalar(&cpu, 2.0, DType::F32).unwrap();
    assert!(matches!(
        scalar.to_float8_rowwise(DType::F8E4M3, true),
        Err(TensorError::InvalidArgument { .. })
    ));
}

/// The rowwise linear: per-token input scales and per-feature weight scales forward; backward
/// folds the weight's scales into the output gradient before quantizing it per token (dX) and the
/// input's scales into it before quantizing it per feature (dW), times the codes saved in the
/// forward; all E4M3, power-of-two scales. Against the recipe in f64, and closer to the exact
/// f64 linear than tensorwise when rows differ in size.
#[test]
fn the_rowwise_fp8_linear_folds_the_saved_scales_into_the_gradient() {
    let cpu: BackendRef = CpuBackend::new_ref();
    let (rows, k, n) = (6, 16, 8);
    let mut random = Xorshift::from_state(0x5eed_f8f8_0000_0042);
    // Token rows and gradient rows of sizes from 2^-12 to 2^13.
    let mut draw = |count: usize, cols: usize, base: f64| -> Vec<f64> {
        (0..count)
            .map(|i| {
                let spread = base * 2f64.powi(5 * (i / cols) as i32 - 12);
                f64::from(random.next_f64_in(-spread, spread) as f32)
            })
            .collect()
    };
    let (xs, ws, rs) = (
        draw(rows * k, k, 1.0),
        draw(n * k, k * 4, 0.5),
        draw(rows * n, n, 2.0),
    );
    let leaf = |values: &[f64], shape: &[usize]| {
        let t = Tensor::from_f64s(&cpu, values, shape, DType::F32).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let (x, w) = (leaf(&xs, &[rows, k]), leaf(&ws, &[n, k]));
    let recipe = headroom_autograd_core::Float8Recipe::ROWWISE;
    let y = x.linear_float8_with(&w, None, recipe).unwrap();
    let r = Tensor::from_f64s(&cpu, &rs, &[rows, n], DType::F32).unwrap();
    y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();

    let e4m3 = DType::F8E4M3;
    let ((sx, qx), (sw, qw)) = (rowwise(&xs, k, None, e4m3), rowwise(&ws, k, None, e4m3));
    let (ix, iw) = (reciprocals(&sx), reciprocals(&sw));
    let want_y = scaled_product(&qx, &transpose(&qw, n, k), (rows, k, n), &ix, &iw);
    assert_close(&y.to_vec_f64().unwrap(), &want_y, "y");
    let ones = vec![1.0f32; k];
    let (s1, q1) = rowwise(&rs, n, Some(&iw), e4m3);
    let want_dx = scaled_product(&q1, &qw, (rows, n, k), &reciprocals(&s1), &ones);
    let (s2, q2) = rowwise(&transpose(&rs, rows, n), rows, Some(&ix), e4m3);
    let want_dw = scaled_product(&q2, &qx, (n, rows, k), &reciprocals(&s2), &ones);
    let (dx, dw) = (
        x.grad().unwrap().to_vec_f64().unwrap(),
        w.grad().unwrap().to_vec_f64().unwrap(),
    );
    assert_close(&dx, &want_dx, "dx");
    assert_close(&dw, &want_dw, "dw");

    // Against the exact linear: every output row within fp8's relative error of its own size,
    // where tensorwise scaling loses the small rows.
    let exact_y = product(&xs, &transpose(&ws, n, k), (rows, k, n), 1.0, 1.0);
    let exact_dx = product(&rs, &ws, (rows, n, k), 1.0, 1.0);
    let worst_row_error = |got: &[f64], want: &[f64], cols: usize| {
        rows_of(got, cols)
            .zip(rows_of(want, cols))
            .map(|(g, w)| {
                let size = w.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
                g.iter()
                    .zip(w)
                    .fold(0.0f64, |m, (a, b)| nan_max(m, (a - b).abs() / size))
            })
            .fold(0.0, nan_max)
    };
    let (rowwise_y, rowwise_dx) = (
        worst_row_error(&y.to_vec_f64().unwrap(), &exact_y, n),
        worst_row_error(&dx, &exact_dx, k),
    );
    assert!(
        rowwise_y < 0.15 && rowwise_dx < 0.15,
        "{rowwise_y} {rowwise_dx}"
    );
    let (xt, wt) = (x.detach(), w.detach());
    let tensorwise_y = worst_row_error(
        &xt.linear_float8(&wt, None).unwrap().to_vec_f64().unwrap(),
        &exact_y,
        n,
    );
    assert!(
        tensorwise_y > 4.0 * rowwise_y,
        "{tensorwise_y} against {rowwise_y}"
    );
}

/// Linears that read one tensor (a block's q, k and v projections) quantize it once and save one
/// copy of its codes: the second and third keep only their outputs (and their weights' scales);
/// a changed input (in place)
/// or another recipe quantizes again; once nothing saves the codes they are freed as always.
#[test]
fn linears_reading_one_input_share_its_codes() {
    let cpu = std::sync::Arc::new(CpuBackend::default());
    let backend: BackendRef = cpu.clone();
    let allocated = || cpu.allocator().memory_allocated();
    let (rows, k, n) = (64, 32, 16);
    let values = |count: usize, step: f64| {
        (0..count)
            .map(|i| (i as f64 * step).sin())
            .collect::<Vec<_>>()
    };
    let x = Tensor::from_f64s(&backend, &values(rows * k, 0.37), &[rows, k], DType::F32).unwrap();
    let weights: Vec<Tensor> = (0..3)
        .map(|i| {
            let w = Tensor::from_f64s(
                &backend,
                &values(n * k, 0.1 + i as f64),
                &[n, k],
                DType::F32,
            )
            .unwrap();
            w.requires_grad_(true).unwrap();
            w
        })
        .collect();
    let output_bytes = (rows * n * 4) as u64;
    let codes_bytes = (rows * k) as u64;
    let before = allocated();
    let first = x.linear_float8(&weights[0], None).unwrap();
    let after_first = allocated() - before;
    assert!(after_first >= output_bytes + codes_bytes, "{after_first}");
    let second = x.linear_float8(&weights[1], None).unwrap();
    let third = x.linear_float8(&weights[2], None).unwrap();
    // Each keeps its output and its weight's scale, for backward's one-read cast of the weight
    // (4 bytes, a 512-byte block).
    assert_eq!(allocated() - before, after_first + 2 * (output_bytes + 512));
    // The shared codes give each product what its own would.
    let alone = x
        .detach()
        .contiguous()
        .unwrap()
        .linear_float8(&weights[1], None)
        .unwrap();
    assert_eq!(second.to_vec_f64().unwrap(), alone.to_vec_f64().unwrap());
    drop(alone);
    // Another recipe, or the input changed in place, quantizes again.
    let mark = allocated();
    let rowwise = x
        .linear_float8_with(
            &weights[0],
            None,
            headroom_autograd_core::Float8Recipe::ROWWISE,
        )
        .unwrap();
    assert!(allocated() - mark >= output_bytes + codes_bytes);
    drop(rowwise);
    x.add_(&x.detach().contiguous().unwrap()).unwrap();
    let mark = allocated();
    let doubled = x.linear_float8(&weights[0], None).unwrap();
    assert!(allocated() - mark >= output_bytes + codes_bytes);
    assert_eq!(
        doubled.to_vec_f64().unwrap(),
        first.mul_scalar(2.0).unwrap().to_vec_f64().unwrap()
    );
    // Backward through all three, then nothing is left of them.
    for y in [&first, &second, &third] {
        y.sum_all().unwrap().backward().unwrap();
    }
    drop((first, second, third, doubled));
    for w in &weights {
        assert!(w.grad().is_some());
        w.set_grad(None).unwrap();
    }
    assert_eq!(allocated(), before);
}

/// Delayed scaling over four steps against the recipe in f64: each cast scales by
/// `max / max(history)` of its role's earlier amaxes (its own amax at the first cast), records
/// its amax (f32, newest first, the last `len` kept); backward casts the weight with the
/// forward's scale and the output gradient by its own history; a tensor that outgrew its history
/// saturates; a history of 0 is an error.
#[test]
fn delayed_scaling_scales_by_the_amax_history() {
    use headroom_autograd_core::{Float8History, Float8Role};
    let cpu: BackendRef = CpuBackend::new_ref();
    let (rows, k, n) = (4, 8, 6);
    let history = Float8History::new(2).unwrap();
    assert!(history.is_empty());
    let mut random = Xorshift::from_state(0xde1a_7ed0_0000_0001);
    let mut draw = |count: usize, spread: f64| -> Vec<f64> {
        (0..count)
            .map(|_| f64::from(random.next_f64_in(-spread, spread) as f32))
            .collect()
    };
    let amax = |values: &[f64]| values.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let ws = draw(n * k, 0.5);
    let w = Tensor::from_f64s(&cpu, &ws, &[n, k], DType::F32).unwrap();
    w.requires_grad_(true).unwrap();
    let (mut input_amaxes, mut grad_amaxes) = (Vec::<f64>::new(), Vec::<f64>::new());
    // Inputs and gradients growing 4x at step 2 (they saturate there), shrinking after.
    for (step, (x_spread, g_spread)) in [(1.0, 1.0), (2.0, 0.5), (8.0, 4.0), (0.5, 0.25)]
        .into_iter()
        .enumerate()
    {
        let (xs, rs) = (draw(rows * k, x_spread), draw(rows * n, g_spread));
        let x = Tensor::from_f64s(&cpu, &xs, &[rows, k], DType::F32).unwrap();
        x.requires_grad_(true).unwrap();
        let y = x.linear_float8_delayed(&w, None, &history).unwrap();
        let r = Tensor::from_f64s(&cpu, &rs, &[rows, n], DType::F32).unwrap();
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();

        // A role's scale: from its history's largest amax, or its own amax at the first cast.
        let scale = |history: &[f64], own: f64, max: f64| {
            let amax = history
                .iter()
                .copied()
                .fold(if history.is_empty() { own } else { 0.0 }, f64::max);
            scale_from_amax(amax, max, false)
        };
        let sx = scale(&input_amaxes, amax(&xs), 448.0);
        let sw = scale_from_amax(amax(&ws), 448.0, false); // the weight's amax never changes
        let sg = scale(&grad_amaxes, amax(&rs), 57344.0);
        let (qx, qw, qg) = (
            codes_of(&xs, sx, DType::F8E4M3),
            codes_of(&ws, sw, DType::F8E4M3),
            codes_of(&rs, sg, DType::F8E5M2),
        );
        let want_y = product(&qx, &transpose(&qw, n, k), (rows, k, n), sx, sw);
        assert_close(
            &y.to_vec_f64().unwrap(),
            &want_y,
            &format!("y at step {step}"),
        );
        let want_dx = product(&qg, &qw, (rows, n, k), sg, sw);
        assert_close(&x.grad().unwrap().to_vec_f64().unwrap(), &want_dx, "dx");
        if step == 2 {
            // Saturated: the largest input code is E4M3's largest.
            assert_eq!(qx.iter().fold(0.0f64, |m, v| m.max(v.abs())), 448.0);
        }
        input_amaxes.insert(0, f64::from(amax(&xs) as f32));
        grad_amaxes.insert(0, f64::from(amax(&rs) as f32));
        input_amaxes.truncate(2);
        grad_amaxes.truncate(2);
        assert_eq!(history.amaxes(Float8Role::Input).unwrap(), input_amaxes);
        assert_eq!(history.amaxes(Float8Role::OutputGrad).unwrap(), grad_amaxes);
        // Backward's second cast of the weight records nothing.
        let weights = history.amaxes(Float8Role::Weight).unwrap();
        assert_eq!(weights.len(), (step + 1).min(2));
        assert!(weights.iter().all(|&a| a == f64::from(amax(&ws) as f32)));
        w.set_grad(None).unwrap();
    }
    assert!(matches!(
        Float8History::new(0),
        Err(TensorError::InvalidArgument { .. })
    ));
}

/// The composed path (a backend without the fp8 primitives, as CUDA's is today: reductions,
/// casts and f32 products) gives the fused primitives' values bit for bit: tensorwise linears
/// forward and backward, current and delayed, and shared input codes; rowwise scaling there is a
/// typed error naming the backend's missing quantize.
#[test]
fn the_composed_fp8_path_equals_the_fused_one() {
    use headroom_autograd_core::{Float8History, Float8Recipe};
    use headroom_testkit::counting::HostReadCounter;
    let cpu: BackendRef = CpuBackend::new_ref();
    let composing: BackendRef = HostReadCounter::hiding_float8(CpuBackend::new_ref());
    let (rows, k, n) = (24, 40, 16);
    let [xs, ws, bs, rs] = linear_operands(0xc0c0_f8f8_0000_0003, rows, k, n);
    let run = |backend: &BackendRef| -> Vec<Vec<f64>> {
        let leaf = |values: &[f64], shape: &[usize], dtype| {
            let t = Tensor::from_f64s(backend, values, shape, dtype).unwrap();
            t.requires_grad_(true).unwrap();
            t
        };
        let mut outs = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            let (x, w, b) = (
                leaf(&xs, &[rows, k], dtype),
                leaf(&ws, &[n, k], dtype),
                leaf(&bs, &[n], dtype),
            );
            let r = Tensor::from_f64s(backend, &rs, &[rows, n], dtype).unwrap();
            let history = Float8History::new(3).unwrap();
            for step in 0..3 {
                let xs_step = x.mul_scalar(1.0 + step as f64).unwrap();
                let (y1, y2) = if step == 0 {
                    // Two linears of one input: shared codes.
                    (
                        x.linear_float8(&w, Some(&b)).unwrap(),
                        x.linear_float8(&w, None).unwrap(),
                    )
                } else {
                    (
                        xs_step
                            .linear_float8_delayed(&w, Some(&b), &history)
                            .unwrap(),
                        xs_step.linear_float8_delayed(&w, None, &history).unwrap(),
                    )
                };
                y1.add(&y2)
                    .unwrap()
                    .mul(&r)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                outs.push(y1.to_vec_f64().unwrap());
                for t in [&x, &w, &b] {
                    outs.push(t.take_grad().unwrap().to_vec_f64().unwrap());
                }
            }
        }
        outs
    };
    let (fused, composed) = (run(&cpu), run(&composing));
    assert_eq!(fused.len(), composed.len());
    for (i, (f, c)) in fused.iter().zip(&composed).enumerate() {
        assert_eq!(f, c, "output {i}");
    }
    let x = Tensor::from_f64s(&composing, &xs, &[rows, k], DType::F32).unwrap();
    let w = Tensor::from_f64s(&composing, &ws, &[n, k], DType::F32).unwrap();
    let err = x
        .linear_float8_with(&w, None, Float8Recipe::ROWWISE)
        .unwrap_err();
    assert!(format!("{err}").contains("fused fp8"), "{err}");
}
