//! The CUDA backend against the CPU backend, primitive by primitive, on fresh random inputs with
//! poisoned outputs: unary and binary ops in f32, f64, f16 and bf16 (contiguous, broadcast and
//! transposed operands), fill, copies between every pair of dtypes, and linear layers through
//! cuBLASLt (bias and GELU forward, weight and bias gradients backward, and the fallbacks). Each
//! test prints a skip notice (and passes) on a machine without a CUDA device, and fails instead
//! where `HEADROOM_REQUIRE_GPU=1` is set (testkit's GPU gate).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use headroom_autograd_core::{
    Backend, BackendRef, BinaryOp, Buffer, DType, Layout, LinearEpilogue, LinearForward,
    LinearWeightGrad, UnaryOp, View,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::Xorshift;

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
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

/// The GPU and the CPU backend, or `None` after the GPU gate's skip notice.
fn backends() -> Option<(BackendRef, BackendRef)> {
    let cuda = cuda_or_skip(CudaBackend::new(0))?;
    Some((cuda as BackendRef, CpuBackend::new_ref()))
}

fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(values.len() * dtype.size_in_bytes());
    for &v in values {
        match dtype {
            DType::F32 => bytes.extend((v as f32).to_le_bytes()),
            DType::F64 => bytes.extend(v.to_le_bytes()),
            DType::F16 => bytes.extend(half::f16::from_f64(v).to_le_bytes()),
            DType::BF16 => bytes.extend(half::bf16::from_f64(v).to_le_bytes()),
            DType::I64 => bytes.extend((v as i64).to_le_bytes()),
            DType::I32 => bytes.extend((v as i32).to_le_bytes()),
            DType::U8 => bytes.push(v as u8),
            DType::Bool => bytes.push(u8::from(v != 0.0)),
        }
    }
    bytes
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks(dtype.size_in_bytes())
        .map(|c| match dtype {
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            DType::F16 => half::f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::BF16 => half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::U8 | DType::Bool => c[0] as f64,
        })
        .collect()
}

/// A buffer of `values` on `backend`.
fn upload(backend: &BackendRef, dtype: DType, values: &[f64]) -> Buffer {
    let bytes = encode(dtype, values);
    let buffer = Buffer::new(backend, bytes.len()).unwrap();
    backend.write_host(&buffer, 0, &bytes).unwrap();
    buffer
}

/// A buffer of `n` elements poisoned with NaN (or 0x5a bytes for integer types).
fn poisoned(backend: &BackendRef, dtype: DType, n: usize) -> Buffer {
    let bytes = if matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        encode(dtype, &vec![f64::NAN; n])
    } else {
        vec![0x5a; n * dtype.size_in_bytes()]
    };
    let buffer = Buffer::new(backend, bytes.len()).unwrap();
    backend.write_host(&buffer, 0, &bytes).unwrap();
    buffer
}

fn download(backend: &BackendRef, dtype: DType, buffer: &Buffer) -> Vec<f64> {
    let mut bytes = vec![0u8; buffer.len_bytes()];
    backend.read_host(buffer, 0, &mut bytes).unwrap();
    decode(dtype, &bytes)
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// ‖gpu − cpu‖ / ‖cpu‖ over all elements; NaN anywhere fails.
fn check(what: &str, dtype: DType, gpu: &[f64], cpu: &[f64]) {
    assert_eq!(gpu.len(), cpu.len());
    assert!(
        gpu.iter().all(|v| v.is_finite()),
        "{what} {dtype:?}: non-finite output (unwritten?)"
    );
    let diff: f64 = gpu
        .iter()
        .zip(cpu)
        .map(|(g, c)| (g - c) * (g - c))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = cpu.iter().map(|c| c * c).sum::<f64>().sqrt().max(1e-30);
    let error = diff / norm;
    assert!(
        error <= tolerance(dtype),
        "{what} {dtype:?}: relative error {error:e}"
    );
}

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

/// Inputs valid for every op: positive for log, sqrt and pow, negative ones for relu otherwise.
fn input(random: &mut Xorshift, op_needs_positive: bool, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            if op_needs_positive {
                random.next_f64_in(0.1, 3.0)
            } else {
                random.next_f64_in(-3.0, 3.0)
            }
        })
        .collect()
}

#[test]
fn unary_ops_match_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x9e37_79b9_7f4a_7c15);
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
                            View {
                                buffer: &x,
                                layout: in_layout,
                                dtype,
                            },
                            View {
                                buffer: &out,
                                layout: out_layout,
                                dtype,
                            },
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
fn binary_ops_with_broadcasting_match_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x2545_f491_4f6c_dd1d);
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
                        View {
                            buffer: &a_buffer,
                            layout: &full,
                            dtype,
                        },
                        View {
                            buffer: &b_buffer,
                            layout: &row_broadcast,
                            dtype,
                        },
                        View {
                            buffer: &out,
                            layout: &full,
                            dtype,
                        },
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
fn dense_runs_with_tails_and_offsets_match_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x6a09_e667_f3bc_c909);
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
fn fill_and_every_cast_match_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0xd1b5_4a32_d192_ed03);
    let n = 1000;
    let layout = Layout::contiguous(&[n]);
    for dtype in ALL {
        let mut results = Vec::new();
        for backend in [&gpu, &cpu] {
            let out = poisoned(backend, dtype, n);
            backend
                .fill(
                    View {
                        buffer: &out,
                        layout: &layout,
                        dtype,
                    },
                    7.0,
                )
                .unwrap();
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
            let mut results = Vec::new();
            for backend in [&gpu, &cpu] {
                let src = upload(backend, from, &values);
                let dst = poisoned(backend, to, n);
                backend
                    .copy(
                        View {
                            buffer: &src,
                            layout: &layout,
                            dtype: from,
                        },
                        View {
                            buffer: &dst,
                            layout: &layout,
                            dtype: to,
                        },
                    )
                    .unwrap();
                results.push(download(backend, to, &dst));
            }
            assert_eq!(results[0], results[1], "copy {from:?} -> {to:?}");
        }
    }
}

#[test]
fn every_byte_comes_from_the_caching_allocator() {
    let Some((gpu, _cpu)) = backends() else {
        return;
    };
    let before = gpu.memory_stats().allocated_bytes.all.current;
    let buffers: Vec<Buffer> = (1..=4)
        .map(|k| Buffer::new(&gpu, k * 1000).unwrap())
        .collect();
    let after = gpu.memory_stats().allocated_bytes.all.current;
    // 1000, 2000, 3000, 4000 bytes round to 1024, 2048, 3072, 4096.
    assert_eq!(after - before, 10_240);
    drop(buffers);
    assert_eq!(gpu.memory_stats().allocated_bytes.all.current, before);
    // A bad index is a typed error, checked on the device.
    let (index, values) = (
        upload(&gpu, DType::I64, &[7.0]),
        upload(&gpu, DType::F32, &[1.0; 4]),
    );
    let out = Buffer::new(&gpu, 4).unwrap();
    let error = gpu
        .gather(
            View {
                buffer: &values,
                layout: &Layout::contiguous(&[4]),
                dtype: DType::F32,
            },
            0,
            View {
                buffer: &index,
                layout: &Layout::contiguous(&[1]),
                dtype: DType::I64,
            },
            View {
                buffer: &out,
                layout: &Layout::contiguous(&[1]),
                dtype: DType::F32,
            },
        )
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("index 7 is out of bounds for size 4"),
        "{error}"
    );
    let _: Arc<dyn Backend> = gpu;
}

/// `gather(values [4], dim 0, [index])` into a one-element buffer.
fn gather_one(
    backend: &BackendRef,
    values: &Buffer,
    index: f64,
) -> headroom_autograd_core::Result<()> {
    let index = upload(backend, DType::I64, &[index]);
    let out = Buffer::new(backend, 4).unwrap();
    backend.gather(
        View {
            buffer: values,
            layout: &Layout::contiguous(&[4]),
            dtype: DType::F32,
        },
        0,
        View {
            buffer: &index,
            layout: &Layout::contiguous(&[1]),
            dtype: DType::I64,
        },
        View {
            buffer: &out,
            layout: &Layout::contiguous(&[1]),
            dtype: DType::F32,
        },
    )
}

/// Deferred index checks: no error (and no host synchronisation) at the call, the first bad value
/// at the next `synchronize` or `read_host`, once; switching back returns what is pending and
/// gives the slots back to the allocator.
#[test]
fn deferred_index_checks_report_at_the_next_synchronisation() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let values = upload(&gpu, DType::F32, &[1.0, 2.0, 3.0, 4.0]);
    let before = gpu.memory_stats().allocated_bytes.all.current;
    cuda.set_deferred_index_checks(true).unwrap();
    assert!(cuda.deferred_index_checks());
    gather_one(&gpu, &values, 7.0).unwrap();
    gather_one(&gpu, &values, 9.0).unwrap();
    let error = cuda.synchronize().unwrap_err().to_string();
    assert!(
        error.contains("gather") && error.contains("index 7 "),
        "{error}"
    );
    cuda.synchronize().unwrap();

    gather_one(&gpu, &values, -3.0).unwrap();
    let mut bytes = [0u8; 16];
    let error = gpu
        .read_host(&values, 0, &mut bytes)
        .unwrap_err()
        .to_string();
    assert!(error.contains("index -3 "), "{error}");
    gpu.read_host(&values, 0, &mut bytes).unwrap();
    assert_eq!(decode(DType::F32, &bytes), [1.0, 2.0, 3.0, 4.0]);

    gather_one(&gpu, &values, 4.0).unwrap();
    let error = cuda
        .set_deferred_index_checks(false)
        .unwrap_err()
        .to_string();
    assert!(error.contains("index 4 "), "{error}");
    assert!(!cuda.deferred_index_checks());
    assert_eq!(gpu.memory_stats().allocated_bytes.all.current, before);
    let error = gather_one(&gpu, &values, 5.0).unwrap_err().to_string();
    assert!(
        error.contains("index 5 is out of bounds for size 4"),
        "{error}"
    );
    cuda.synchronize().unwrap();
}

/// Runs `f` on both backends and checks the GPU's result against the CPU's.
fn compare(
    what: &str,
    dtype: DType,
    gpu: &BackendRef,
    cpu: &BackendRef,
    f: impl Fn(&BackendRef) -> Vec<f64>,
) {
    let (on_gpu, on_cpu) = (f(gpu), f(cpu));
    check(what, dtype, &on_gpu, &on_cpu);
}

#[test]
fn reductions_softmax_and_masks_match_the_cpu() {
    use headroom_autograd_core::{MaskedOp, ReduceOp};
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x1234_5678_9abc_def1);
    let shape = [6, 7, 45];
    let n: usize = shape.iter().product();
    let x_layout = Layout::contiguous(&shape);
    // x read with its last two dims swapped: [6, 45, 7] over the same memory.
    let swapped = Layout::from_parts(&[6, 45, 7], &[7 * 45, 1, 45], 0).unwrap();
    for dtype in FLOATS {
        let x = input(&mut random, false, n);
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            for n_reduced in [1, 2] {
                compare(
                    &format!("reduce {op:?} {n_reduced}"),
                    dtype,
                    &gpu,
                    &cpu,
                    |backend| {
                        let x_buffer = upload(backend, dtype, &x);
                        let out_shape = &[6, 45, 7][..3 - n_reduced];
                        let out_layout = Layout::contiguous(out_shape);
                        let out = poisoned(backend, dtype, out_layout.numel());
                        backend
                            .reduce(
                                op,
                                View {
                                    buffer: &x_buffer,
                                    layout: &swapped,
                                    dtype,
                                },
                                n_reduced,
                                View {
                                    buffer: &out,
                                    layout: &out_layout,
                                    dtype,
                                },
                            )
                            .unwrap();
                        download(backend, dtype, &out)
                    },
                );
            }
        }
        // A bias gradient: the sum (and mean) over the rows of a [rows, 3] matrix, seen as
        // [3, rows] with strides (1, 3) (the column kernels), over a padded row stride, and over
        // few rows of many columns (a batch sum of a position embedding's gradient).
        for (cols, rs) in [(3, 3), (5, 7), (100, 100)] {
            let rows = (n - 1) / rs;
            let columns = Layout::from_parts(&[cols, rows], &[1, rs], 1).unwrap();
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                compare(
                    &format!("column {op:?} {cols}x{rows}"),
                    dtype,
                    &gpu,
                    &cpu,
                    |backend| {
                        let x_buffer = upload(backend, dtype, &x);
                        let out_layout = Layout::contiguous(&[cols]);
                        let out = poisoned(backend, dtype, cols);
                        let view = |buffer, layout| View {
                            buffer,
                            layout,
                            dtype,
                        };
                        backend
                            .reduce(op, view(&x_buffer, &columns), 1, view(&out, &out_layout))
                            .unwrap();
                        download(backend, dtype, &out)
                    },
                );
            }
        }
        // Batch sums of x [6, 7, 45] as the core hands them over (reduced dims last): over dim 0
        // ([7, 45, 6]: the kept dims merge into 315 columns) and over dims 0 and 1 ([45, 6, 7]:
        // the reduced dims merge into 42 rows 45 apart).
        for (shape, strides, n_reduced) in
            [([7, 45, 6], [45, 1, 315], 1), ([45, 6, 7], [1, 315, 45], 2)]
        {
            let permuted = Layout::from_parts(&shape, &strides, 0).unwrap();
            let kept = &shape[..3 - n_reduced];
            let out_layout = Layout::contiguous(kept);
            let outputs: usize = kept.iter().product();
            compare(
                &format!("batch sum over {n_reduced} dims"),
                dtype,
                &gpu,
                &cpu,
                |backend| {
                    let x_buffer = upload(backend, dtype, &x);
                    let out = poisoned(backend, dtype, outputs);
                    let view = |buffer, layout| View {
                        buffer,
                        layout,
                        dtype,
                    };
                    backend
                        .reduce(
                            ReduceOp::Sum,
                            view(&x_buffer, &permuted),
                            n_reduced,
                            view(&out, &out_layout),
                        )
                        .unwrap();
                    download(backend, dtype, &out)
                },
            );
        }
        let dy = input(&mut random, false, n);
        for dim in [2, 1] {
            for log in [false, true] {
                compare(
                    &format!("softmax dim {dim} log {log}"),
                    dtype,
                    &gpu,
                    &cpu,
                    |backend| {
                        let (xb, gb) = (upload(backend, dtype, &x), upload(backend, dtype, &dy));
                        let (y, dx) = (poisoned(backend, dtype, n), poisoned(backend, dtype, n));
                        let view = |buffer| View {
                            buffer,
                            layout: &x_layout,
                            dtype,
                        };
                        backend.softmax(view(&xb), dim, log, view(&y)).unwrap();
                        backend
                            .softmax_backward(view(&y), view(&gb), dim, log, view(&dx))
                            .unwrap();
                        let mut res = download(backend, dtype, &y);
                        res.extend(download(backend, dtype, &dx));
                        res
                    },
                );
            }
        }
        let mask: Vec<f64> = (0..n)
            .map(|_| (random.next_f64_in(0.0, 1.0) < 0.3) as u8 as f64)
            .collect();
        for op in [MaskedOp::Fill(-1e4), MaskedOp::Scale(1.25)] {
            compare(&format!("masked {op:?}"), dtype, &gpu, &cpu, |backend| {
                let (xb, mb) = (
                    upload(backend, dtype, &x),
                    upload(backend, DType::Bool, &mask),
                );
                let out = poisoned(backend, dtype, n);
                backend
                    .masked(
                        op,
                        View {
                            buffer: &xb,
                            layout: &x_layout,
                            dtype,
                        },
                        View {
                            buffer: &mb,
                            layout: &x_layout,
                            dtype: DType::Bool,
                        },
                        View {
                            buffer: &out,
                            layout: &x_layout,
                            dtype,
                        },
                    )
                    .unwrap();
                download(backend, dtype, &out)
            });
        }
    }
}

#[test]
fn layer_norm_forward_and_backward_match_the_cpu() {
    use headroom_autograd_core::{LayerNormBackward, LayerNormForward};
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x0bad_cafe_f00d_d00d);
    // Widths for the warp-per-row kernels (1, 4 and 8 vectors per lane) and for the block kernels
    // (300 bf16/f16 elements are no whole number of vectors; 2056 are too many for a warp).
    for (rows, width) in [(23, 300), (9, 1024), (5, 24), (3, 2056)] {
        let n = rows * width;
        let layout = Layout::contiguous(&[rows, width]);
        let row_layout = Layout::contiguous(&[rows]);
        let param_layout = Layout::contiguous(&[width]);
        for (dtype, stats) in [
            (DType::F32, DType::F32),
            (DType::F64, DType::F64),
            (DType::F16, DType::F32),
            (DType::BF16, DType::F32),
        ] {
            let x = input(&mut random, false, n);
            let dy = input(&mut random, false, n);
            let w = input(&mut random, false, width);
            let b = input(&mut random, false, width);
            compare("layer_norm", dtype, &gpu, &cpu, |backend| {
                let (xb, gb) = (upload(backend, dtype, &x), upload(backend, dtype, &dy));
                let (wb, bb) = (upload(backend, dtype, &w), upload(backend, dtype, &b));
                let out = poisoned(backend, dtype, n);
                let (mean, rstd) = (
                    poisoned(backend, stats, rows),
                    poisoned(backend, stats, rows),
                );
                let (dx, dw, db) = (
                    poisoned(backend, dtype, n),
                    poisoned(backend, dtype, width),
                    poisoned(backend, dtype, width),
                );
                let full = |buffer| View {
                    buffer,
                    layout: &layout,
                    dtype,
                };
                let param = |buffer| View {
                    buffer,
                    layout: &param_layout,
                    dtype,
                };
                let stat = |buffer| View {
                    buffer,
                    layout: &row_layout,
                    dtype: stats,
                };
                backend
                    .layer_norm(LayerNormForward {
                        x: full(&xb),
                        weight: Some(param(&wb)),
                        bias: Some(param(&bb)),
                        eps: 1e-5,
                        out: full(&out),
                        mean: stat(&mean),
                        rstd: stat(&rstd),
                    })
                    .unwrap();
                backend
                    .layer_norm_backward(LayerNormBackward {
                        dy: full(&gb),
                        x: full(&xb),
                        mean: stat(&mean),
                        rstd: stat(&rstd),
                        weight: Some(param(&wb)),
                        dx: Some(full(&dx)),
                        dweight: Some(param(&dw)),
                        dbias: Some(param(&db)),
                    })
                    .unwrap();
                let mut res = download(backend, dtype, &out);
                for buffer in [&dx, &dw, &db] {
                    res.extend(download(backend, dtype, buffer));
                }
                res
            });
        }
    }
}

#[test]
fn batched_matmul_on_strided_operands_matches_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x5eed_5eed_5eed_5eed);
    let (batch, heads, m, k, n) = (3, 4, 33, 17, 29);
    for dtype in FLOATS {
        let a = input(&mut random, false, batch * heads * m * k);
        let b = input(&mut random, false, heads * k * n);
        let c0 = input(&mut random, false, batch * heads * m * n);
        compare("matmul", dtype, &gpu, &cpu, |backend| {
            let (ab, bb) = (upload(backend, dtype, &a), upload(backend, dtype, &b));
            // a: [batch, heads, m, k] contiguous; b: [heads, k, n] broadcast over batch and
            // read transposed from [heads, n, k] memory.
            let a_layout = Layout::contiguous(&[batch, heads, m, k]);
            let b_layout = Layout::from_parts(&[batch, heads, k, n], &[0, n * k, 1, k], 0).unwrap();
            let out_layout = Layout::contiguous(&[batch, heads, m, n]);
            let out = upload(backend, dtype, &c0);
            backend
                .matmul(
                    View {
                        buffer: &ab,
                        layout: &a_layout,
                        dtype,
                    },
                    View {
                        buffer: &bb,
                        layout: &b_layout,
                        dtype,
                    },
                    View {
                        buffer: &out,
                        layout: &out_layout,
                        dtype,
                    },
                    true,
                )
                .unwrap();
            let fresh = poisoned(backend, dtype, batch * heads * m * n);
            backend
                .matmul(
                    View {
                        buffer: &ab,
                        layout: &a_layout,
                        dtype,
                    },
                    View {
                        buffer: &bb,
                        layout: &b_layout,
                        dtype,
                    },
                    View {
                        buffer: &fresh,
                        layout: &out_layout,
                        dtype,
                    },
                    false,
                )
                .unwrap();
            let mut res = download(backend, dtype, &out);
            res.extend(download(backend, dtype, &fresh));
            res
        });
    }
    // The cuBLAS workspace is an allocation of the backend's own caching allocator.
    let allocated = gpu.memory_stats().allocated_bytes.all.current;
    assert!(allocated >= 32 << 20, "workspace not counted: {allocated}");
}

#[test]
fn gather_scatter_cross_entropy_and_dropout_match_the_cpu() {
    use headroom_autograd_core::{CrossEntropyArgs, Reduction};
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0xfeed_beef_dead_c0de);
    let (rows, classes) = (37, 53);
    let n = rows * classes;
    let table = Layout::contiguous(&[rows, classes]);
    let picks = Layout::contiguous(&[rows, 5]);
    let targets: Vec<f64> = (0..rows)
        .map(|r| {
            if r % 7 == 3 {
                -100.0
            } else {
                random.next_f64_in(0.0, classes as f64).floor()
            }
        })
        .collect();
    let positions: Vec<f64> = (0..rows * 5)
        .map(|_| random.next_f64_in(0.0, classes as f64).floor())
        .collect();
    for (dtype, stats) in [
        (DType::F32, DType::F32),
        (DType::F64, DType::F64),
        (DType::F16, DType::F32),
        (DType::BF16, DType::F32),
    ] {
        let x = input(&mut random, false, n);
        let src = input(&mut random, false, rows * 5);
        compare("gather + scatter_add", dtype, &gpu, &cpu, |backend| {
            let (xb, ib) = (
                upload(backend, dtype, &x),
                upload(backend, DType::I64, &positions),
            );
            let out = poisoned(backend, dtype, rows * 5);
            let index = View {
                buffer: &ib,
                layout: &picks,
                dtype: DType::I64,
            };
            backend
                .gather(
                    View {
                        buffer: &xb,
                        layout: &table,
                        dtype,
                    },
                    1,
                    index,
                    View {
                        buffer: &out,
                        layout: &picks,
                        dtype,
                    },
                )
                .unwrap();
            let (dst, sb) = (upload(backend, dtype, &x), upload(backend, dtype, &src));
            backend
                .scatter_add(
                    View {
                        buffer: &dst,
                        layout: &table,
                        dtype,
                    },
                    1,
                    index,
                    View {
                        buffer: &sb,
                        layout: &picks,
                        dtype,
                    },
                )
                .unwrap();
            let mut res = download(backend, dtype, &out);
            res.extend(download(backend, dtype, &dst));
            res
        });
        for reduction in [Reduction::Mean, Reduction::Sum] {
            compare(
                &format!("cross_entropy {reduction:?}"),
                dtype,
                &gpu,
                &cpu,
                |backend| {
                    let (xb, tb) = (
                        upload(backend, dtype, &x),
                        upload(backend, DType::I64, &targets),
                    );
                    let target_layout = Layout::contiguous(&[rows]);
                    let args = CrossEntropyArgs {
                        logits: View {
                            buffer: &xb,
                            layout: &table,
                            dtype,
                        },
                        target: View {
                            buffer: &tb,
                            layout: &target_layout,
                            dtype: DType::I64,
                        },
                        ignore_index: -100,
                        reduction,
                    };
                    let scalar = Layout::contiguous(&[]);
                    let (loss, lse) = (poisoned(backend, dtype, 1), poisoned(backend, stats, rows));
                    let lse_view = View {
                        buffer: &lse,
                        layout: &target_layout,
                        dtype: stats,
                    };
                    let loss_view = View {
                        buffer: &loss,
                        layout: &scalar,
                        dtype,
                    };
                    backend.cross_entropy(args, loss_view, lse_view).unwrap();
                    let (dloss, dlogits) =
                        (upload(backend, dtype, &[0.75]), poisoned(backend, dtype, n));
                    backend
                        .cross_entropy_backward(
                            args,
                            lse_view,
                            View {
                                buffer: &dloss,
                                layout: &scalar,
                                dtype,
                            },
                            View {
                                buffer: &dlogits,
                                layout: &table,
                                dtype,
                            },
                        )
                        .unwrap();
                    let mut res = download(backend, dtype, &loss);
                    res.extend(download(backend, stats, &lse));
                    res.extend(download(backend, dtype, &dlogits));
                    res
                },
            );
        }
        // Dropout: the same mask on both devices, bit for bit.
        let masks = std::cell::RefCell::new(Vec::new());
        compare("dropout", dtype, &gpu, &cpu, |backend| {
            let xb = upload(backend, dtype, &x);
            let (out, mask) = (
                poisoned(backend, dtype, n),
                poisoned(backend, DType::Bool, n),
            );
            backend
                .dropout(
                    View {
                        buffer: &xb,
                        layout: &table,
                        dtype,
                    },
                    0.3,
                    42,
                    1000,
                    View {
                        buffer: &out,
                        layout: &table,
                        dtype,
                    },
                    View {
                        buffer: &mask,
                        layout: &table,
                        dtype: DType::Bool,
                    },
                )
                .unwrap();
            masks
                .borrow_mut()
                .push(download(backend, DType::Bool, &mask));
            download(backend, dtype, &out)
        });
        let masks = masks.into_inner();
        assert_eq!(masks[0], masks[1], "dropout masks differ ({dtype:?})");
        let kept = masks[0].iter().filter(|&&m| m == 1.0).count() as f64 / n as f64;
        assert!((kept - 0.7).abs() < 0.05, "kept {kept}");
    }
}

/// Fused cross-entropy forward and backward of `[rows, classes]` logits with the loss (and its
/// gradient) in `loss_dtype`: the loss, the log-sum-exps and the logits' gradient, read back.
fn cross_entropy_run(
    backend: &BackendRef,
    (dtype, loss_dtype): (DType, DType),
    (rows, classes): (usize, usize),
    logits: &[f64],
    targets: &[f64],
) -> Vec<f64> {
    use headroom_autograd_core::{CrossEntropyArgs, Reduction};
    let table = Layout::contiguous(&[rows, classes]);
    let target_layout = Layout::contiguous(&[rows]);
    let scalar = Layout::contiguous(&[]);
    let (xb, tb) = (
        upload(backend, dtype, logits),
        upload(backend, DType::I64, targets),
    );
    let args = CrossEntropyArgs {
        logits: View {
            buffer: &xb,
            layout: &table,
            dtype,
        },
        target: View {
            buffer: &tb,
            layout: &target_layout,
            dtype: DType::I64,
        },
        ignore_index: -100,
        reduction: Reduction::Mean,
    };
    let stats = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let (loss, lse) = (
        poisoned(backend, loss_dtype, 1),
        poisoned(backend, stats, rows),
    );
    let lse_view = View {
        buffer: &lse,
        layout: &target_layout,
        dtype: stats,
    };
    let loss_view = View {
        buffer: &loss,
        layout: &scalar,
        dtype: loss_dtype,
    };
    backend.cross_entropy(args, loss_view, lse_view).unwrap();
    let dloss = upload(backend, loss_dtype, &[0.75]);
    let dlogits = poisoned(backend, dtype, rows * classes);
    backend
        .cross_entropy_backward(
            args,
            lse_view,
            View {
                buffer: &dloss,
                layout: &scalar,
                dtype: loss_dtype,
            },
            View {
                buffer: &dlogits,
                layout: &table,
                dtype,
            },
        )
        .unwrap();
    let mut res = download(backend, loss_dtype, &loss);
    res.extend(download(backend, stats, &lse));
    // The gradient of a mean over many classes is small: scaled up so it weighs in the norm as
    // much as the loss.
    res.extend(
        download(backend, dtype, &dlogits)
            .iter()
            .map(|g| g * (rows * classes) as f64),
    );
    res
}

/// Rows as wide as GPT-2's vocabulary (the kernels accumulate f32 logits in f32, as PyTorch's
/// log-softmax does), and the f32 loss of f16 and bf16 logits (`cross_entropy_f32`: f32 loss and
/// loss gradient, the logits' gradient in their dtype).
#[test]
fn cross_entropy_of_wide_rows_and_upcast_losses_match_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x0ddc_1a55_e5e5_c0de);
    for (rows, classes) in [(6, 50257), (37, 53)] {
        let targets: Vec<f64> = (0..rows)
            .map(|r| {
                if r % 5 == 3 {
                    -100.0
                } else {
                    random.next_f64_in(0.0, classes as f64).floor()
                }
            })
            .collect();
        let logits: Vec<f64> = (0..rows * classes)
            .map(|_| random.next_f64_in(-8.0, 8.0))
            .collect();
        for dtypes in [
            (DType::F32, DType::F32),
            (DType::F64, DType::F64),
            (DType::BF16, DType::F32),
            (DType::F16, DType::F32),
        ] {
            let what = format!("cross_entropy {rows}×{classes}, loss {:?}", dtypes.1);
            compare(&what, dtypes.0, &gpu, &cpu, |backend| {
                cross_entropy_run(backend, dtypes, (rows, classes), &logits, &targets)
            });
        }
    }
}

/// Operands whose rows or columns overlap (`expand`, stride 0) cannot be described to cuBLAS by
/// a leading dimension and are copied dense first; among them the `k = 1` product of a ViT
/// head's weight gradient at batch 1 (`[1000, 1]` of a broadcast scalar, times one row of a
/// larger tensor), which read past its buffer and computed garbage before.
#[test]
fn matmul_with_broadcast_operands_matches_the_cpu() {
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x0dd_ba11);
    // (what, m, k, n, a's strides and elements, b's strides and elements)
    type Operand = ([usize; 2], usize);
    let cases: [(&str, usize, usize, usize, Operand, Operand); 5] = [
        (
            "b fully broadcast",
            19,
            23,
            31,
            ([23, 1], 19 * 23),
            ([0, 0], 1),
        ),
        (
            "b fully broadcast, k = 1",
            19,
            1,
            31,
            ([1, 1], 19),
            ([0, 0], 1),
        ),
        (
            "b's rows expanded",
            19,
            23,
            31,
            ([23, 1], 19 * 23),
            ([0, 1], 31),
        ),
        (
            "a's columns expanded",
            19,
            23,
            31,
            ([1, 0], 19),
            ([31, 1], 23 * 31),
        ),
        // A head's weight gradient at batch 1: a broadcast column times one row of a larger
        // tensor (row stride 201,728), k = 1.
        (
            "a broadcast, k = 1, b one row",
            1000,
            1,
            64,
            ([0, 0], 1),
            ([4096, 1], 64),
        ),
    ];
    for (what, m, k, n, (a_strides, a_len), (b_strides, b_len)) in cases {
        for dtype in FLOATS {
            let a = input(&mut random, false, a_len);
            let b = input(&mut random, false, b_len);
            compare(what, dtype, &gpu, &cpu, |backend| {
                let (ab, bb) = (upload(backend, dtype, &a), upload(backend, dtype, &b));
                let out = poisoned(backend, dtype, m * n);
                backend
                    .matmul(
                        View {
                            buffer: &ab,
                            layout: &Layout::from_parts(&[m, k], &a_strides, 0).unwrap(),
                            dtype,
                        },
                        View {
                            buffer: &bb,
                            layout: &Layout::from_parts(&[k, n], &b_strides, 0).unwrap(),
                            dtype,
                        },
                        View {
                            buffer: &out,
                            layout: &Layout::contiguous(&[m, n]),
                            dtype,
                        },
                        false,
                    )
                    .unwrap();
                download(backend, dtype, &out)
            });
        }
    }
}

/// Max and min over the last dim with indices: first occurrence among ties, as on the CPU.
#[test]
fn max_and_min_with_indices_match_the_cpu() {
    use headroom_autograd_core::ReduceOp;
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x7777_1234_abcd_0001);
    let (rows, lane) = (57, 33);
    // Whole numbers 0..5: many ties.
    let x: Vec<f64> = (0..rows * lane)
        .map(|_| random.next_f64_in(0.0, 5.0).floor())
        .collect();
    // Read transposed: the reduced dim is strided.
    let x_layout = Layout::from_parts(&[rows, lane], &[1, rows], 0).unwrap();
    let out_layout = Layout::contiguous(&[rows]);
    for dtype in FLOATS {
        for op in [ReduceOp::Max, ReduceOp::Min] {
            let mut results = Vec::new();
            for backend in [&gpu, &cpu] {
                let xb = upload(backend, dtype, &x);
                let (values, indices) = (
                    poisoned(backend, dtype, rows),
                    poisoned(backend, DType::I64, rows),
                );
                backend
                    .reduce_with_index(
                        op,
                        View {
                            buffer: &xb,
                            layout: &x_layout,
                            dtype,
                        },
                        View {
                            buffer: &values,
                            layout: &out_layout,
                            dtype,
                        },
                        View {
                            buffer: &indices,
                            layout: &out_layout,
                            dtype: DType::I64,
                        },
                    )
                    .unwrap();
                let mut res = download(backend, dtype, &values);
                res.extend(download(backend, DType::I64, &indices));
                results.push(res);
            }
            assert_eq!(results[0], results[1], "{op:?} {dtype:?}");
        }
    }
}

#[test]
fn fused_attention_forward_and_backward_match_the_cpu() {
    use headroom_autograd_core::{AttentionBackward, AttentionForward};
    let Some((gpu, cpu)) = backends() else { return };
    let mut random = Xorshift::from_state(0x5eed_a77e_0000_0001);
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

#[test]
fn tf32_is_an_explicit_opt_in_within_1e_3() {
    let Some((_, cpu)) = backends() else { return };
    // A backend of its own, so the setting does not reach the other tests.
    let cuda = CudaBackend::new(0).unwrap();
    let gpu: BackendRef = cuda.clone();
    let mut random = Xorshift::from_state(0x7f32_7f32_7f32_7f32);
    let (m, k, n) = (96, 512, 80);
    let a = input(&mut random, false, m * k);
    let b = input(&mut random, false, k * n);
    let product = |backend: &BackendRef| {
        let (ab, bb) = (
            upload(backend, DType::F32, &a),
            upload(backend, DType::F32, &b),
        );
        let out = poisoned(backend, DType::F32, m * n);
        let (la, lb, lo) = (
            Layout::contiguous(&[m, k]),
            Layout::contiguous(&[k, n]),
            Layout::contiguous(&[m, n]),
        );
        let view = |buffer, layout| View {
            buffer,
            layout,
            dtype: DType::F32,
        };
        backend
            .matmul(view(&ab, &la), view(&bb, &lb), view(&out, &lo), false)
            .unwrap();
        download(backend, DType::F32, &out)
    };
    let relative = |x: &[f64], y: &[f64]| {
        let diff: f64 = x.iter().zip(y).map(|(p, q)| (p - q) * (p - q)).sum();
        let norm: f64 = y.iter().map(|q| q * q).sum();
        (diff / norm).sqrt()
    };
    let reference = product(&cpu);
    assert!(!cuda.allow_tf32(), "TF32 is off by default");
    let exact = relative(&product(&gpu), &reference);
    cuda.set_allow_tf32(true);
    let tf32 = relative(&product(&gpu), &reference);
    cuda.set_allow_tf32(false);
    assert!(exact <= 1e-5, "f32 product: relative error {exact:e}");
    assert!(tf32 <= 1e-3, "TF32 product: relative error {tf32:e}");
    assert!(
        tf32 > 10.0 * exact,
        "TF32 was not used: {tf32:e} vs f32 {exact:e}"
    );
}

/// A linear layer's operands: input `[rows, in]`, weight `[out, in]`, bias `[out]` and output
/// gradient `[rows, out]`.
struct LinearData {
    dims: (usize, usize, usize),
    x: Vec<f64>,
    w: Vec<f64>,
    b: Vec<f64>,
    g: Vec<f64>,
}

impl LinearData {
    fn new(random: &mut Xorshift, (rows, in_f, out_f): (usize, usize, usize)) -> LinearData {
        LinearData {
            dims: (rows, in_f, out_f),
            x: input(random, false, rows * in_f),
            w: input(random, false, out_f * in_f),
            b: input(random, false, out_f),
            g: input(random, false, rows * out_f),
        }
    }
}

/// How a linear case is laid out.
#[derive(Debug, Clone, Copy)]
struct LinearCase {
    bias: bool,
    gelu: bool,
    /// The weight read transposed from `[in, out]` memory.
    weight_transposed: bool,
    /// Elements before the bias and the bias gradient in their buffers (1: not 16-byte aligned).
    bias_offset: usize,
}

/// Output (and pre-activation), dW, dB and dX of one case, each as (name, values).
fn linear_case(
    backend: &BackendRef,
    dtype: DType,
    data: &LinearData,
    case: LinearCase,
) -> Vec<(&'static str, Vec<f64>)> {
    let (rows, in_f, out_f) = data.dims;
    let view = |buffer, layout| View {
        buffer,
        layout,
        dtype,
    };
    let x = upload(backend, dtype, &data.x);
    let x_layout = Layout::contiguous(&[rows, in_f]);
    let (w, w_layout) = if case.weight_transposed {
        let mut stored = vec![0.0; in_f * out_f];
        for o in 0..out_f {
            for i in 0..in_f {
                stored[i * out_f + o] = data.w[o * in_f + i];
            }
        }
        let layout = Layout::from_parts(&[out_f, in_f], &[1, out_f], 0).unwrap();
        (upload(backend, dtype, &stored), layout)
    } else {
        (
            upload(backend, dtype, &data.w),
            Layout::contiguous(&[out_f, in_f]),
        )
    };
    let padded: Vec<f64> = std::iter::repeat_n(0.0, case.bias_offset)
        .chain(data.b.iter().copied())
        .collect();
    let b = upload(backend, dtype, &padded);
    let bias_layout = Layout::from_parts(&[out_f], &[1], case.bias_offset).unwrap();
    let out_layout = Layout::contiguous(&[rows, out_f]);
    let (out, pre) = (
        poisoned(backend, dtype, rows * out_f),
        poisoned(backend, dtype, rows * out_f),
    );
    let epilogue = if case.gelu {
        LinearEpilogue::Gelu {
            pre_activation: view(&pre, &out_layout),
        }
    } else {
        LinearEpilogue::None
    };
    backend
        .linear(LinearForward {
            input: view(&x, &x_layout),
            weight: view(&w, &w_layout),
            bias: case.bias.then(|| view(&b, &bias_layout)),
            epilogue,
            out: view(&out, &out_layout),
        })
        .unwrap();
    let g = upload(backend, dtype, &data.g);
    let w_grad_layout = Layout::contiguous(&[out_f, in_f]);
    let (dw, db) = (
        poisoned(backend, dtype, out_f * in_f),
        poisoned(backend, dtype, out_f + case.bias_offset),
    );
    backend
        .linear_weight_grad(LinearWeightGrad {
            grad_out: view(&g, &out_layout),
            input: view(&x, &x_layout),
            grad_weight: view(&dw, &w_grad_layout),
            grad_bias: case.bias.then(|| view(&db, &bias_layout)),
        })
        .unwrap();
    let dx = poisoned(backend, dtype, rows * in_f);
    backend
        .matmul(
            view(&g, &out_layout),
            view(&w, &w_layout),
            view(&dx, &x_layout),
            false,
        )
        .unwrap();
    let mut res = vec![
        ("out", download(backend, dtype, &out)),
        ("dw", download(backend, dtype, &dw)),
        ("dx", download(backend, dtype, &dx)),
    ];
    if case.gelu {
        res.push(("pre_activation", download(backend, dtype, &pre)));
    }
    if case.bias {
        res.push((
            "db",
            download(backend, dtype, &db)[case.bias_offset..].to_vec(),
        ));
    }
    res
}

fn check_linear(
    cuda: &Arc<CudaBackend>,
    cpu: &BackendRef,
    dtype: DType,
    data: &LinearData,
    case: LinearCase,
) {
    let gpu: BackendRef = cuda.clone();
    let (on_gpu, on_cpu) = (
        linear_case(&gpu, dtype, data, case),
        linear_case(cpu, dtype, data, case),
    );
    for ((what, gpu_values), (_, cpu_values)) in on_gpu.iter().zip(&on_cpu) {
        let what = format!("linear {:?} {case:?} {what}", data.dims);
        check(&what, dtype, gpu_values, cpu_values);
    }
}

#[test]
fn linear_with_bias_and_gelu_epilogues_matches_the_cpu() {
    let Some((_, cpu)) = backends() else { return };
    // A backend of its own, so its fallback count is this test's.
    let cuda = CudaBackend::new(0).unwrap();
    let mut random = Xorshift::from_state(0x11ea_11ea_11ea_11ea);
    let case = |bias, gelu, weight_transposed| LinearCase {
        bias,
        gelu,
        weight_transposed,
        bias_offset: 0,
    };
    // ViT-L/16's MLP ([6304, 1024] x [4096, 1024]) scaled down: 2 images of 197 tokens.
    let vit = LinearData::new(&mut random, (197 * 2, 64, 256));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (bias, gelu) in [(true, false), (false, false), (true, true), (false, true)] {
            check_linear(&cuda, &cpu, dtype, &vit, case(bias, gelu, false));
        }
        check_linear(&cuda, &cpu, dtype, &vit, case(true, true, true));
    }
    assert_eq!(
        cuda.linear_fallbacks(),
        0,
        "aligned f32/f16/bf16 linears all run through cuBLASLt"
    );
    // Odd sizes: cuBLASLt or the fallback, the same values either way.
    let odd = LinearData::new(&mut random, (37, 33, 29));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        check_linear(&cuda, &cpu, dtype, &odd, case(true, true, false));
        check_linear(&cuda, &cpu, dtype, &odd, case(true, false, true));
    }
    println!(
        "odd sizes: {} of 12 calls composed",
        cuda.linear_fallbacks()
    );
    // A bias (and bias gradient) 4 bytes past 16-byte alignment, and f64: always composed, one
    // fallback forward and one backward.
    for dtype in [DType::F32, DType::F64] {
        let before = cuda.linear_fallbacks();
        let misaligned = LinearCase {
            bias_offset: usize::from(dtype == DType::F32),
            ..case(true, true, false)
        };
        check_linear(&cuda, &cpu, dtype, &vit, misaligned);
        assert_eq!(cuda.linear_fallbacks() - before, 2, "{dtype:?}");
    }
}

#[test]
fn the_cublaslt_workspace_is_an_allocation_of_the_caching_allocator() {
    let Some((_, cpu)) = backends() else { return };
    // A fresh backend: its first product creates the BLAS state.
    let cuda = CudaBackend::new(0).unwrap();
    let gpu: BackendRef = cuda.clone();
    let mut random = Xorshift::from_state(0x3a3a_3a3a_3a3a_3a3a);
    // Every buffer a multiple of the allocator's 512-byte rounding.
    let (rows, in_f, out_f) = (128, 64, 256);
    let data = LinearData::new(&mut random, (rows, in_f, out_f));
    let dtype = DType::F32;
    let view = |buffer, layout| View {
        buffer,
        layout,
        dtype,
    };
    let (x, w, b, g) = (
        upload(&gpu, dtype, &data.x),
        upload(&gpu, dtype, &data.w),
        upload(&gpu, dtype, &data.b),
        upload(&gpu, dtype, &data.g),
    );
    let (out, dw, db) = (
        poisoned(&gpu, dtype, rows * out_f),
        poisoned(&gpu, dtype, out_f * in_f),
        poisoned(&gpu, dtype, out_f),
    );
    let (x_layout, w_layout, b_layout, out_layout) = (
        Layout::contiguous(&[rows, in_f]),
        Layout::contiguous(&[out_f, in_f]),
        Layout::contiguous(&[out_f]),
        Layout::contiguous(&[rows, out_f]),
    );
    let before = gpu.memory_stats().allocated_bytes.all.current;
    gpu.linear(LinearForward {
        input: view(&x, &x_layout),
        weight: view(&w, &w_layout),
        bias: Some(view(&b, &b_layout)),
        epilogue: LinearEpilogue::None,
        out: view(&out, &out_layout),
    })
    .unwrap();
    gpu.linear_weight_grad(LinearWeightGrad {
        grad_out: view(&g, &out_layout),
        input: view(&x, &x_layout),
        grad_weight: view(&dw, &w_layout),
        grad_bias: Some(view(&db, &b_layout)),
    })
    .unwrap();
    let after = gpu.memory_stats().allocated_bytes.all.current;
    // Exactly the 32 MiB workspace cuBLAS and cuBLASLt share, nothing else left behind.
    assert_eq!(after - before, 32 << 20);
    assert_eq!(cuda.linear_fallbacks(), 0);
    let reference = linear_case(
        &cpu,
        dtype,
        &data,
        LinearCase {
            bias: true,
            gelu: false,
            weight_transposed: false,
            bias_offset: 0,
        },
    );
    check(
        "linear out",
        dtype,
        &download(&gpu, dtype, &out),
        &reference[0].1,
    );
    check(
        "linear dw",
        dtype,
        &download(&gpu, dtype, &dw),
        &reference[1].1,
    );
    check(
        "linear db",
        dtype,
        &download(&gpu, dtype, &db),
        &reference[3].1,
    );
}
