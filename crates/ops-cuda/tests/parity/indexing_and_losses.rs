//! Indexing, losses and dropout on the GPU against the CPU: gather and scatter-add, fused
//! cross-entropy forward and backward (rows as wide as GPT-2's vocabulary, f32 losses of f16 and
//! bf16 logits) and dropout.

use headroom_autograd_core::{BackendRef, DType, DropoutDraw, Layout};

use crate::{compare, download, input, poisoned, seeded_backends, upload, view, WITH_STATS_DTYPE};

#[test]
#[ignore = "needs a CUDA device"]
fn gather_scatter_cross_entropy_and_dropout_match_the_cpu() {
    use headroom_autograd_core::{CrossEntropyArgs, Reduction};
    let Some((gpu, cpu, mut random)) = seeded_backends(0xfeed_beef_dead_c0de) else {
        return;
    };
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
    for (dtype, stats) in WITH_STATS_DTYPE {
        let x = input(&mut random, false, n);
        let src = input(&mut random, false, rows * 5);
        compare("gather + scatter_add", dtype, &gpu, &cpu, |backend| {
            let (xb, ib) = (
                upload(backend, dtype, &x),
                upload(backend, DType::I64, &positions),
            );
            let out = poisoned(backend, dtype, rows * 5);
            let index = view(&ib, &picks, DType::I64);
            backend
                .gather(
                    view(&xb, &table, dtype),
                    1,
                    index,
                    view(&out, &picks, dtype),
                )
                .unwrap();
            let (dst, sb) = (upload(backend, dtype, &x), upload(backend, dtype, &src));
            backend
                .scatter_add(
                    view(&dst, &table, dtype),
                    1,
                    index,
                    view(&sb, &picks, dtype),
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
                        logits: view(&xb, &table, dtype),
                        target: view(&tb, &target_layout, DType::I64),
                        ignore_index: -100,
                        reduction,
                    };
                    let scalar = Layout::contiguous(&[]);
                    let (loss, lse) = (poisoned(backend, dtype, 1), poisoned(backend, stats, rows));
                    let lse_view = view(&lse, &target_layout, stats);
                    let loss_view = view(&loss, &scalar, dtype);
                    backend.cross_entropy(args, loss_view, lse_view).unwrap();
                    let (dloss, dlogits) =
                        (upload(backend, dtype, &[0.75]), poisoned(backend, dtype, n));
                    backend
                        .cross_entropy_backward(
                            args,
                            lse_view,
                            view(&dloss, &scalar, dtype),
                            view(&dlogits, &table, dtype),
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
                    view(&xb, &table, dtype),
                    DropoutDraw {
                        p: 0.3,
                        seed: 42,
                        offset: 1000,
                    },
                    view(&out, &table, dtype),
                    view(&mask, &table, DType::Bool),
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
        logits: view(&xb, &table, dtype),
        target: view(&tb, &target_layout, DType::I64),
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
    let lse_view = view(&lse, &target_layout, stats);
    let loss_view = view(&loss, &scalar, loss_dtype);
    backend.cross_entropy(args, loss_view, lse_view).unwrap();
    let dloss = upload(backend, loss_dtype, &[0.75]);
    let dlogits = poisoned(backend, dtype, rows * classes);
    backend
        .cross_entropy_backward(
            args,
            lse_view,
            view(&dloss, &scalar, loss_dtype),
            view(&dlogits, &table, dtype),
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
#[ignore = "needs a CUDA device"]
fn cross_entropy_of_wide_rows_and_upcast_losses_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x0ddc_1a55_e5e5_c0de) else {
        return;
    };
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
        for dtypes in WITH_STATS_DTYPE {
            let what = format!("cross_entropy {rows}×{classes}, loss {:?}", dtypes.1);
            compare(&what, dtypes.0, &gpu, &cpu, |backend| {
                cross_entropy_run(backend, dtypes, (rows, classes), &logits, &targets)
            });
        }
    }
}
