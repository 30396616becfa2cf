//! The fp8 primitives: `quantize_float8` (codes, scales, amaxes and inverse scales bit for bit
//! against the CPU, every input dtype, both granularities, power-of-two and delayed scales,
//! premultipliers, strided inputs, tensors large enough for several grid-stride rounds a
//! thread, and a GELU applied as the input is read, against the unary op then the quantize) and
//! `matmul_float8` (cuBLASLt's fp8 GEMM against the CPU's f32 product of the same codes, every
//! operand layout, fp8 pairing and scale form — tensorwise, rowwise, mixed — and the sizes it
//! leaves to the core).

use headroom_autograd_core::{
    BackendRef, Buffer, DType, Float8Granularity, Float8Matmul, Float8Quantize, Layout, UnaryOp,
    View,
};

use headroom_ops_cuda::CudaBackend;
use headroom_testkit::inputs::Xorshift;

use super::{download, poisoned, seeded_backends, upload, view};

/// Bit-for-bit equality of two downloads, any NaN equal to any NaN.
fn same_bits(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// One quantize setting.
#[derive(Debug, Clone, Copy)]
struct Setting {
    input: DType,
    codes: DType,
    granularity: Float8Granularity,
    power_of_two: bool,
    premultiply: bool,
    delayed: bool,
    transposed: bool,
}

/// What a quantize wrote: codes (as bytes), scales, amaxes (none asked for a delayed,
/// transposed setting: the one-pass cast with a given scale) and the scales' reciprocals.
fn quantized(
    backend: &BackendRef,
    setting: Setting,
    values: &[f64],
    (rows, cols): (usize, usize),
    premultiply: &[f64],
    delayed: &[f64],
) -> [Vec<f64>; 4] {
    let x = upload(backend, setting.input, values);
    // Transposed: the same values stored `[cols, rows]` and read through a transposed view.
    let x_layout = if setting.transposed {
        Layout::contiguous(&[cols, rows])
            .permute("test", &[1, 0])
            .unwrap()
    } else {
        Layout::contiguous(&[rows, cols])
    };
    let groups = match setting.granularity {
        Float8Granularity::Tensorwise => 1,
        Float8Granularity::Rowwise => rows,
    };
    let codes = poisoned(backend, DType::U8, rows * cols);
    let (scale, amax, inverse) = (
        poisoned(backend, DType::F32, groups),
        poisoned(backend, DType::F32, groups),
        poisoned(backend, DType::F32, groups),
    );
    let wants_amax = !(setting.delayed && setting.transposed);
    let premultiply_buffer = upload(backend, DType::F32, premultiply);
    let delayed_buffer = upload(backend, DType::F32, &delayed[..groups]);
    let (codes_layout, group_layout) = (
        Layout::contiguous(&[rows, cols]),
        Layout::contiguous(&[groups]),
    );
    let premultiply_layout = Layout::contiguous(&[cols]);
    let fused = backend
        .quantize_float8(Float8Quantize {
            x: view(&x, &x_layout, setting.input),
            premultiply: setting
                .premultiply
                .then(|| view(&premultiply_buffer, &premultiply_layout, DType::F32)),
            activation: None,
            granularity: setting.granularity,
            power_of_two: setting.power_of_two,
            delayed_scale: setting
                .delayed
                .then(|| view(&delayed_buffer, &group_layout, DType::F32)),
            codes: view(&codes, &codes_layout, setting.codes),
            scale: view(&scale, &group_layout, DType::F32),
            amax: wants_amax.then(|| view(&amax, &group_layout, DType::F32)),
            inverse_scale: Some(view(&inverse, &group_layout, DType::F32)),
        })
        .unwrap();
    assert!(fused, "{setting:?}: the backend quantizes it itself");
    [
        download(backend, DType::U8, &codes),
        download(backend, DType::F32, &scale),
        match wants_amax {
            true => download(backend, DType::F32, &amax),
            false => Vec::new(),
        },
        download(backend, DType::F32, &inverse),
    ]
}

/// `setting`'s quantize of `values` (`[rows, cols]` as given: a transposed setting stores them
/// `[cols, rows]` and reads them through a transposed view) with `premultiply` and `delayed`, on
/// both backends: every part the same bits.
fn assert_quantized_alike(
    backends: [&BackendRef; 2],
    setting: Setting,
    (rows, cols): (usize, usize),
    (values, premultiply, delayed): (&[f64], &[f64], &[f64]),
) {
    let stored: Vec<f64> = if setting.transposed {
        (0..cols * rows)
            .map(|i| values[(i % rows) * cols + i / rows])
            .collect()
    } else {
        values.to_vec()
    };
    let [first, second] =
        backends.map(|b| quantized(b, setting, &stored, (rows, cols), premultiply, delayed));
    for (part, name) in ["codes", "scale", "amax", "inverse scale"]
        .iter()
        .enumerate()
    {
        assert!(
            same_bits(&first[part], &second[part]),
            "{setting:?}: {name} differ"
        );
    }
}

/// Every setting of the quantize (3 input dtypes × 2 code dtypes × 2 granularities × power of
/// two or not × premultiplied or not × delayed or current × transposed or not, at two shapes:
/// 384 cases) gives the CPU's codes, scales, amaxes and inverse scales bit for bit, over rows
/// that saturate, a zero row (the amax floor) and rows of tiny values.
#[test]
#[ignore = "needs a CUDA device"]
fn float8_quantize_matches_the_cpu_bit_for_bit() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x00f8_9a7e_0001_5eed) else {
        return;
    };
    let mut cases = 0;
    // 37 × 304: whole 16-byte vectors, the dense kernels (row-major, and column-major when
    // transposed); 37 × 300: the general ones for bf16 and f16.
    for (rows, cols) in [(37, 304), (37, 300)] {
        let mut values = vec![0.0; rows * cols];
        for row in 0..rows {
            // Row magnitudes from 2^-30 to 2^20; row 5 all zero.
            let magnitude = 2f64.powf(random.next_f64_in(-30.0, 20.0));
            for col in 0..cols {
                values[row * cols + col] = if row == 5 {
                    0.0
                } else {
                    magnitude * random.next_f64_in(-1.0, 1.0)
                };
            }
        }
        let premultiply: Vec<f64> = (0..cols)
            .map(|_| 2f64.powf(random.next_f64_in(-6.0, 6.0)))
            .collect();
        let delayed: Vec<f64> = (0..rows)
            .map(|_| 2f64.powf(random.next_f64_in(-8.0, 8.0)) * 1.37)
            .collect();
        for input in [DType::F32, DType::BF16, DType::F16] {
            // f16 holds neither 2^20 nor 2^-30: its rows are kept within its range.
            let values: Vec<f64> = if input == DType::F16 {
                values.iter().map(|v| v.clamp(-6.0e4, 6.0e4)).collect()
            } else {
                values.clone()
            };
            for codes in [DType::F8E4M3, DType::F8E5M2] {
                for granularity in [Float8Granularity::Tensorwise, Float8Granularity::Rowwise] {
                    for bits in 0..16u32 {
                        let setting = Setting {
                            input,
                            codes,
                            granularity,
                            power_of_two: bits & 1 != 0,
                            premultiply: bits & 2 != 0,
                            delayed: bits & 4 != 0,
                            transposed: bits & 8 != 0,
                        };
                        let shape = (rows, cols);
                        let operands = (&values[..], &premultiply[..], &delayed[..]);
                        assert_quantized_alike([&gpu, &cpu], setting, shape, operands);
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 384);
}

/// Tensors large enough that each thread of the dense kernels takes several grid-stride rounds
/// (more 16-byte vectors than the grid has threads, not a multiple of them):
/// codes, scales, amaxes and inverse scales bit for bit against the CPU, every input dtype,
/// row-major and column-major, current and delayed scales.
#[test]
#[ignore = "needs a CUDA device"]
fn float8_quantize_of_large_tensors_matches_the_cpu_bit_for_bit() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x00f8_9a7e_0002_5eed) else {
        return;
    };
    let (rows, cols) = (1031, 4096);
    let values: Vec<f64> = (0..rows * cols)
        .map(|_| random.next_f64_in(-3.0, 3.0) * 2f64.powf(random.next_f64_in(-4.0, 4.0)))
        .collect();
    let premultiply = vec![1.0; cols];
    let delayed = vec![37.5; rows];
    for input in [DType::F32, DType::BF16, DType::F16] {
        for codes in [DType::F8E4M3, DType::F8E5M2] {
            for (delayed_scale, transposed) in [(false, false), (false, true), (true, true)] {
                let setting = Setting {
                    input,
                    codes,
                    granularity: Float8Granularity::Tensorwise,
                    power_of_two: false,
                    premultiply: false,
                    delayed: delayed_scale,
                    transposed,
                };
                let operands = (&values[..], &premultiply[..], &delayed[..]);
                assert_quantized_alike([&gpu, &cpu], setting, (rows, cols), operands);
            }
        }
    }
}

/// A GELU linear's input quantized in one pass (`Float8Quantize::activation`: the dense kernels
/// apply GELU or tanh GELU as they read) gives the codes, scale and amax of the backend's own
/// unary op followed by the quantize, bit for bit, for every input dtype, with current and with
/// delayed scales (the one-read cast; and with the amax wanted too), at a size where every
/// thread takes several rounds. The 16-bit inputs take the amax from the pre-activation's
/// extremes: inputs whose largest GELU is big (the fast path), small (under `GELU_FAST_BOUND`:
/// the exact fallback), and holding a NaN, -inf or +inf. A strided input is declined (the core
/// then runs the unary op first).
#[test]
#[ignore = "needs a CUDA device"]
fn float8_quantize_of_a_gelu_equals_the_gelu_then_the_quantize() {
    let Some((gpu, _cpu, mut random)) = seeded_backends(0x00f8_9a7e_0003_5eed) else {
        return;
    };
    let (rows, cols) = (1031, 4096);
    let values: Vec<f64> = (0..rows * cols)
        .map(|_| random.next_f64_in(-6.0, 6.0))
        .collect();
    let small: Vec<f64> = (0..rows * cols)
        .map(|_| random.next_f64_in(-3.0, 0.25))
        .collect();
    let with = |at: usize, special: f64| {
        let mut values = small.clone();
        values[at] = special;
        values
    };
    let inputs = [
        ("large", values.clone()),
        ("small", small.clone()),
        ("nan", with(12_345, f64::NAN)),
        ("-inf", with(rows * cols - 1, f64::NEG_INFINITY)),
        ("+inf", with(0, f64::INFINITY)),
    ];
    let dense = Layout::contiguous(&[rows, cols]);
    let scalar = Layout::contiguous(&[1]);
    let quantize =
        |x: &Buffer, dtype: DType, activation, (delayed, wants_amax): (Option<&Buffer>, bool)| {
            let codes = poisoned(&gpu, DType::U8, rows * cols);
            let (scale, amax, inverse) = (
                poisoned(&gpu, DType::F32, 1),
                poisoned(&gpu, DType::F32, 1),
                poisoned(&gpu, DType::F32, 1),
            );
            let fused = gpu
                .quantize_float8(Float8Quantize {
                    x: view(x, &dense, dtype),
                    premultiply: None,
                    activation,
                    granularity: Float8Granularity::Tensorwise,
                    power_of_two: false,
                    delayed_scale: delayed.map(|d| view(d, &scalar, DType::F32)),
                    codes: view(&codes, &dense, DType::F8E4M3),
                    scale: view(&scale, &scalar, DType::F32),
                    amax: wants_amax.then(|| view(&amax, &scalar, DType::F32)),
                    inverse_scale: Some(view(&inverse, &scalar, DType::F32)),
                })
                .unwrap();
            assert!(
                fused,
                "{dtype:?} {activation:?}: dense row-major inputs are fused"
            );
            let mut res = vec![
                download(&gpu, DType::U8, &codes),
                download(&gpu, DType::F32, &scale),
                download(&gpu, DType::F32, &inverse),
            ];
            if wants_amax {
                res.push(download(&gpu, DType::F32, &amax));
            }
            res
        };
    let delayed = upload(&gpu, DType::F32, &[91.5]);
    for (name, values) in &inputs {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = upload(&gpu, dtype, values);
            for op in [UnaryOp::Gelu, UnaryOp::GeluTanh] {
                let activated = poisoned(&gpu, dtype, rows * cols);
                gpu.unary(op, view(&x, &dense, dtype), view(&activated, &dense, dtype))
                    .unwrap();
                for scaling in [
                    (None, true),
                    (Some(&delayed), false),
                    (Some(&delayed), true),
                ] {
                    let fused = quantize(&x, dtype, Some(op), scaling);
                    let unfused = quantize(&activated, dtype, None, scaling);
                    for (part, (a, b)) in fused.iter().zip(&unfused).enumerate() {
                        assert!(
                            same_bits(a, b),
                            "{name} {dtype:?} {op:?} delayed {} amax {}: part {part} differs",
                            scaling.0.is_some(),
                            scaling.1
                        );
                    }
                }
            }
        }
    }
    // A transposed view is declined, writing nothing.
    let x = upload(&gpu, DType::BF16, &inputs[0].1);
    let transposed = Layout::contiguous(&[cols, rows])
        .permute("test", &[1, 0])
        .unwrap();
    let (codes, scale) = (
        poisoned(&gpu, DType::U8, rows * cols),
        poisoned(&gpu, DType::F32, 1),
    );
    let fused = gpu
        .quantize_float8(Float8Quantize {
            x: view(&x, &transposed, DType::BF16),
            premultiply: None,
            activation: Some(UnaryOp::GeluTanh),
            granularity: Float8Granularity::Tensorwise,
            power_of_two: false,
            delayed_scale: None,
            codes: view(&codes, &dense, DType::F8E4M3),
            scale: view(&scale, &scalar, DType::F32),
            amax: None,
            inverse_scale: None,
        })
        .unwrap();
    assert!(!fused, "a strided input is declined");
}

/// Codes of `values` in `dtype`, stored as given (`[rows, cols]` dense), on `backend`.
fn codes(backend: &BackendRef, dtype: DType, values: &[f64]) -> Buffer {
    upload(backend, dtype, values)
}

/// `matmul_float8` of `a` (`[m, k]`, stored `[k, m]` and transposed when `a_transposed`) and `b`
/// (`[k, n]`, stored `[n, k]` and transposed when `b_transposed`), with inverse scales `scales`
/// (one value a side, broadcast by stride 0, or one a row of `a` and a column of `b`) and `bias`
/// (in `out`'s dtype) if given, into `out`: whether the backend ran it itself, and the product.
#[allow(clippy::too_many_arguments)]
fn product(
    backend: &BackendRef,
    (m, k, n): (usize, usize, usize),
    (a_dtype, b_dtype, out): (DType, DType, DType),
    a_stored: &[f64],
    a_transposed: bool,
    b_stored: &[f64],
    b_transposed: bool,
    bias: Option<&[f64]>,
    (a_scales, b_scales): (&[f64], &[f64]),
) -> (bool, Vec<f64>) {
    let a = codes(backend, a_dtype, a_stored);
    let b = codes(backend, b_dtype, b_stored);
    let layout = |transposed: bool, rows: usize, cols: usize| {
        if transposed {
            Layout::contiguous(&[cols, rows])
                .permute("test", &[1, 0])
                .unwrap()
        } else {
            Layout::contiguous(&[rows, cols])
        }
    };
    let (a_layout, b_layout) = (layout(a_transposed, m, k), layout(b_transposed, k, n));
    let (a_scale, b_scale) = (
        upload(backend, DType::F32, a_scales),
        upload(backend, DType::F32, b_scales),
    );
    let scale_layout = |values: &[f64], len: usize| {
        let stride = usize::from(values.len() != 1);
        Layout::from_parts(&[len], &[stride], 0).unwrap()
    };
    let (a_scale_layout, b_scale_layout) = (scale_layout(a_scales, m), scale_layout(b_scales, n));
    let result = poisoned(backend, out, m * n);
    let out_layout = Layout::contiguous(&[m, n]);
    let bias_buffer = bias.map(|values| upload(backend, out, values));
    let bias_layout = Layout::contiguous(&[n]);
    let fused = backend
        .matmul_float8(Float8Matmul {
            a: view(&a, &a_layout, a_dtype),
            b: view(&b, &b_layout, b_dtype),
            a_inverse_scale: View {
                buffer: &a_scale,
                layout: &a_scale_layout,
                dtype: DType::F32,
            },
            b_inverse_scale: View {
                buffer: &b_scale,
                layout: &b_scale_layout,
                dtype: DType::F32,
            },
            bias: bias_buffer
                .as_ref()
                .map(|buffer| view(buffer, &bias_layout, out)),
            out: view(&result, &out_layout, out),
        })
        .unwrap();
    (fused, download(backend, out, &result))
}

/// cuBLASLt's fp8 GEMM against the CPU's f32 product of the same codes, for every pairing of
/// E4M3 and E5M2 operands, both layouts of each operand (the backward's operands are not
/// k-contiguous and go through the transpose kernel), f32 and bf16 outputs, and tensorwise,
/// rowwise and mixed scales (cuBLASLt's scalar and outer-vector scale modes, or where it has no
/// outer-vector algorithm the product with unit scales and the scales after it): each output
/// within 2^-10 of its terms' magnitudes (Hopper's fp8 tensor cores add a block of k at
/// reduced precision before cuBLASLt promotes to f32; fp8's own rounding is 2^-4), and a bf16
/// output within one more unit in its last place. Sizes that are not multiples of 16 are left
/// to the core (`Ok(false)`).
#[test]
#[ignore = "needs a CUDA device"]
fn float8_matmul_matches_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x00f8_3a70_0002_5eed) else {
        return;
    };
    let dims = (64, 96, 48);
    let (m, k, n) = dims;
    let mut draw = |count: usize| -> Vec<f64> {
        (0..count)
            .map(|_| random.next_f64_in(-1.0, 1.0) * 2f64.powf(random.next_f64_in(-4.0, 6.0)))
            .collect()
    };
    let (a_values, b_values, bias_values) = (draw(m * k), draw(k * n), draw(n));
    // Rowwise inverse scales, one a row of `a` and a column of `b`, 2^-3 to 2^3.
    let mut spread = Xorshift::from_state(0x5ca1_e5f8);
    let mut positive = |count: usize| -> Vec<f64> {
        (0..count)
            .map(|_| 2f64.powf(spread.next_f64_in(-3.0, 3.0)))
            .collect()
    };
    let (a_rows, b_columns) = (positive(m), positive(n));
    let scalings: [(&[f64], &[f64]); 4] = [
        (&[0.37], &[1.9]),
        (&a_rows, &b_columns),
        (&a_rows, &[1.9]),
        (&[0.37], &b_columns),
    ];
    let transpose = |values: &[f64], rows: usize, cols: usize| -> Vec<f64> {
        (0..rows * cols)
            .map(|i| values[(i % rows) * cols + i / rows])
            .collect()
    };
    let pairs = [
        (DType::F8E4M3, DType::F8E4M3),
        (DType::F8E5M2, DType::F8E4M3),
        (DType::F8E4M3, DType::F8E5M2),
    ];
    for (a_dtype, b_dtype) in pairs {
        for out in [DType::F32, DType::BF16] {
            for ((a_transposed, b_transposed), scales) in
                [(false, true), (false, false), (true, true), (true, false)]
                    .into_iter()
                    .flat_map(|layouts| scalings.iter().map(move |scales| (layouts, *scales)))
            {
                let a = if a_transposed {
                    transpose(&a_values, m, k)
                } else {
                    a_values.clone()
                };
                let b = if b_transposed {
                    transpose(&b_values, k, n)
                } else {
                    b_values.clone()
                };
                let types = (a_dtype, b_dtype, out);
                // A bias (in the epilogue for bf16, added after for f32) with half the layouts.
                let bias = (a_transposed == b_transposed).then_some(bias_values.as_slice());
                let run = |backend| {
                    product(
                        backend,
                        dims,
                        types,
                        &a,
                        a_transposed,
                        &b,
                        b_transposed,
                        bias,
                        scales,
                    )
                };
                let ((gpu_fused, on_gpu), (_, on_cpu)) = (run(&gpu), run(&cpu));
                let what = format!(
                    "{types:?} a_t={a_transposed} b_t={b_transposed} scales {}×{}",
                    scales.0.len(),
                    scales.1.len()
                );
                let scale_of = |values: &[f64], i: usize| values[i.min(values.len() - 1)];
                assert!(gpu_fused, "{what}: ran on cuBLASLt");
                // Each output within 2^-10 of the sum of its terms' magnitudes (Hopper's fp8
                // tensor cores keep about 14 bits in their partial sums, DeepSeek-V3 §3.3.2;
                // measured on the H200: 2^-11.6 at worst of the first pairing), plus one unit in
                // the last place of a bf16 output (both sides round).
                let ulp = if out == DType::F32 {
                    0.0
                } else {
                    2f64.powi(-7)
                };
                let code = |dtype: DType, v: f64| match dtype {
                    DType::F8E4M3 => float8::F8E4M3::from_f64(v).to_f64(),
                    _ => float8::F8E5M2::from_f64(v).to_f64(),
                };
                for i in 0..m {
                    for j in 0..n {
                        let terms: f64 = (0..k)
                            .map(|l| {
                                (code(a_dtype, a_values[i * k + l])
                                    * code(b_dtype, b_values[l * n + j]))
                                .abs()
                            })
                            .sum();
                        let (g, c) = (on_gpu[i * n + j], on_cpu[i * n + j]);
                        let scaled = scale_of(scales.0, i) * scale_of(scales.1, j);
                        let bound = 2f64.powi(-10) * scaled * terms + ulp * c.abs();
                        assert!(
                            (g - c).abs() <= bound,
                            "{what}: [{i}, {j}] {g} against {c} (bound {bound:e})"
                        );
                    }
                }
            }
        }
    }
    // Where cuBLASLt declined outer-vector scales the product ran with unit scales and the
    // scales after it (the bounds above hold either way); the log says which.
    let cuda = gpu
        .clone()
        .into_any()
        .downcast::<CudaBackend>()
        .expect("the CUDA backend");
    println!(
        "rowwise products scaled after a unit-scaled product: {} (of 72 with a vector of scales)",
        cuda.float8_scales_after_products()
    );
    // 20 rows: not a multiple of 16, left to the core.
    let a = draw(20 * k);
    let (fused, _) = product(
        &gpu,
        (20, k, n),
        (DType::F8E4M3, DType::F8E4M3, DType::F32),
        &a,
        false,
        &b_values,
        false,
        None,
        (&[0.37], &[1.9]),
    );
    assert!(!fused, "20 rows are left to the core");
}
