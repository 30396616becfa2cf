//! Reductions on the GPU against the CPU: sum, mean, max and min (with indices, the first of
//! ties), softmax, masked fill and scale, and layer norm forward and backward.

use headroom_autograd_core::{DType, Layout, SoftmaxBackward};

use crate::{
    compare, download, input, poisoned, seeded_backends, upload, view, FLOATS, WITH_STATS_DTYPE,
};

#[test]
#[ignore = "needs a CUDA device"]
fn reductions_softmax_and_masks_match_the_cpu() {
    use headroom_autograd_core::{MaskedOp, ReduceOp};
    let Some((gpu, cpu, mut random)) = seeded_backends(0x1234_5678_9abc_def1) else {
        return;
    };
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
                                view(&x_buffer, &swapped, dtype),
                                n_reduced,
                                view(&out, &out_layout, dtype),
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
                        backend
                            .reduce(
                                op,
                                view(&x_buffer, &columns, dtype),
                                1,
                                view(&out, &out_layout, dtype),
                            )
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
                    backend
                        .reduce(
                            ReduceOp::Sum,
                            view(&x_buffer, &permuted, dtype),
                            n_reduced,
                            view(&out, &out_layout, dtype),
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
                        let dense = |buffer| view(buffer, &x_layout, dtype);
                        backend.softmax(dense(&xb), dim, log, dense(&y)).unwrap();
                        let args = SoftmaxBackward {
                            y: dense(&y),
                            dy: dense(&gb),
                            dim,
                            log,
                            dx: dense(&dx),
                        };
                        backend.softmax_backward(args).unwrap();
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
                        view(&xb, &x_layout, dtype),
                        view(&mb, &x_layout, DType::Bool),
                        view(&out, &x_layout, dtype),
                    )
                    .unwrap();
                download(backend, dtype, &out)
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn layer_norm_forward_and_backward_match_the_cpu() {
    use headroom_autograd_core::{LayerNormBackward, LayerNormForward};
    let Some((gpu, cpu, mut random)) = seeded_backends(0x0bad_cafe_f00d_d00d) else {
        return;
    };
    // Widths for the warp-per-row kernels (1, 4 and 8 vectors per lane) and for the block kernels
    // (300 bf16/f16 elements are no whole number of vectors; 2056 are too many for a warp).
    for (rows, width) in [(23, 300), (9, 1024), (5, 24), (3, 2056)] {
        let n = rows * width;
        let layout = Layout::contiguous(&[rows, width]);
        let row_layout = Layout::contiguous(&[rows]);
        let param_layout = Layout::contiguous(&[width]);
        for (dtype, stats) in WITH_STATS_DTYPE {
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
                let full = |buffer| view(buffer, &layout, dtype);
                let param = |buffer| view(buffer, &param_layout, dtype);
                let stat = |buffer| view(buffer, &row_layout, stats);
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

/// Max and min over the last dim with indices: first occurrence among ties, as on the CPU.
#[test]
#[ignore = "needs a CUDA device"]
fn max_and_min_with_indices_match_the_cpu() {
    use headroom_autograd_core::{ReduceOp, ReduceWithIndex};
    let Some((gpu, cpu, mut random)) = seeded_backends(0x7777_1234_abcd_0001) else {
        return;
    };
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
                let args = ReduceWithIndex {
                    op,
                    x: view(&xb, &x_layout, dtype),
                    values: view(&values, &out_layout, dtype),
                    indices: view(&indices, &out_layout, DType::I64),
                };
                backend.reduce_with_index(args).unwrap();
                let mut res = download(backend, dtype, &values);
                res.extend(download(backend, DType::I64, &indices));
                results.push(res);
            }
            assert_eq!(results[0], results[1], "{op:?} {dtype:?}");
        }
    }
}
