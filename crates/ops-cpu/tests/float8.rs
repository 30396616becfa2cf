//! fp8 casts with a tensorwise scale and the fp8 linear on the CPU backend, against the recipe
//! computed here element by element in f64 (torchao's float8 training with tensorwise current
//! scaling: `scale = max / max(amax, 1e-12)` in f64 rounded to f32, codes `saturate(x · scale)`,
//! products of codes times both scales' f32 reciprocals).

use headroom_autograd_core::{BackendRef, DType, Tensor, TensorError};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::inputs::Xorshift;

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
    let mut random = Xorshift::from_state(0xf8f8_1234_5678_9abc);
    let mut draw = |count: usize, spread: f64| -> Vec<f64> {
        (0..count)
            .map(|_| f64::from(random.next_f64_in(-spread, spread) as f32))
            .collect()
    };
    let (xs, ws, bs, rs) = (
        draw(rows * k, 3.0),
        draw(n * k, 0.5),
        draw(n, 1.0),
        draw(rows * n, 2.0),
    );
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
