//! Indexing, losses and dropout on the GPU against the CPU: gather and scatter-add, fused
//! cross-entropy forward and backward (rows as wide as GPT-2's vocabulary, f32 losses of f16 and
//! bf16 logits), the tiles of a chunked cross-entropy, dropout, and random fills (parameter
//! initialisation).

use headroom_autograd_core::{
    BackendRef, CrossEntropyArgs, CrossEntropyBackward, CrossEntropyForward, CrossEntropyTile,
    CrossEntropyTileBackward, DType, Distribution, DropoutDraw, Layout, LogitTile, RandomDraw,
    Reduction,
};
use headroom_testkit::inputs::Xorshift;

use crate::{compare, download, input, poisoned, seeded_backends, upload, view, WITH_STATS_DTYPE};

/// Random fills (what `nn::parameter` initialises with) give the CPU's values on the GPU: every
/// element of a million-element fill and of a strided view (a transposed, offset window), for
/// each float dtype, uniform and normal, compared bit for bit. The one exception is an f64
/// tensor of normal draws: its values keep every bit of CUDA's `log` and `cos` (within 1 and 2
/// ulp of the host's libm), about 0.4% of them differing from the host's in their last bits, so
/// they are compared to a few units in the last place of the draw's scale.
#[test]
#[ignore = "needs a CUDA device"]
fn random_fills_match_the_cpu_bit_for_bit() {
    let Some((gpu, cpu, _)) = seeded_backends(0x5eed) else {
        return;
    };
    let n = 1_000_003;
    let dense = Layout::contiguous(&[n]);
    // A [300, 200] transpose of rows 2.. of a [210, 300] block, inside the n-element buffer.
    let strided = Layout::from_parts(&[300, 200], &[1, 300], 600).unwrap();
    let distributions = [
        Distribution::Uniform {
            low: -0.1,
            high: 0.3,
        },
        Distribution::Normal {
            mean: 0.5,
            std: 0.02,
        },
    ];
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (k, distribution) in distributions.into_iter().enumerate() {
            let draw = RandomDraw {
                distribution,
                seed: 7 + k as u64,
                offset: 1 << 33,
            };
            let fill = |backend: &BackendRef, layout: &Layout| {
                let out = poisoned(backend, dtype, n);
                backend.random(view(&out, layout, dtype), draw).unwrap();
                download(backend, dtype, &out)
            };
            for (name, layout) in [("dense", &dense), ("strided", &strided)] {
                let (on_gpu, on_cpu) = (fill(&gpu, layout), fill(&cpu, layout));
                let tolerance = match (dtype, distribution) {
                    (DType::F64, Distribution::Normal { mean, std }) => {
                        (mean.abs() + 8.0 * std) * 2f64.powi(-48)
                    }
                    _ => 0.0,
                };
                let differing = on_gpu
                    .iter()
                    .zip(&on_cpu)
                    .filter(|(g, c)| {
                        g.to_bits() != c.to_bits() && ((*g - *c).abs() > tolerance || g.is_nan())
                    })
                    .count();
                assert_eq!(differing, 0, "{dtype:?} {distribution:?} {name}");
                let written = on_cpu.iter().filter(|v| !v.is_nan()).count();
                assert_eq!(
                    written,
                    layout.numel(),
                    "{dtype:?} {name}: every element once"
                );
            }
            // Element i is the draw's value i rounded to the dtype (to nearest: within half a
            // unit in the last place, exactly so for f32 and f64).
            let on_gpu = fill(&gpu, &dense);
            let half_ulp = match dtype {
                DType::BF16 => 2f64.powi(-8),
                DType::F16 => 2f64.powi(-11),
                _ => 0.0,
            };
            for i in [0, 1, n / 2, n - 1] {
                let want = draw.value(i as u64);
                let want = if dtype == DType::F32 {
                    want as f32 as f64
                } else {
                    want
                };
                let error = (on_gpu[i] - want).abs();
                assert!(
                    error <= want.abs() * half_ulp,
                    "{dtype:?} element {i}: {error}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gather_scatter_cross_entropy_and_dropout_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0xfeed_beef_dead_c0de) else {
        return;
    };
    let (rows, classes) = (37, 53);
    let n = rows * classes;
    let table = Layout::contiguous(&[rows, classes]);
    let picks = Layout::contiguous(&[rows, 5]);
    let targets = targets(&mut random, rows, classes, 7);
    let positions: Vec<f64> = (0..rows * 5)
        .map(|_| random.next_f64_in(0.0, classes as f64).floor())
        .collect();
    for (dtype, _) in WITH_STATS_DTYPE {
        let x = input(&mut random, false, n);
        let src = input(&mut random, false, rows * 5);
        compare("gather + scatter_add", dtype, &gpu, &cpu, |backend| {
            let (xb, ib) = (
                upload(backend, dtype, &x),
                upload(backend, DType::I64, &positions),
            );
            let out = poisoned(backend, dtype, rows * 5);
            let index = view(&ib, &picks, DType::I64);
            let (gathered, into) = (view(&xb, &table, dtype), view(&out, &picks, dtype));
            backend.gather(gathered, 1, index, into).unwrap();
            let (dst, sb) = (upload(backend, dtype, &x), upload(backend, dtype, &src));
            let (into, added) = (view(&dst, &table, dtype), view(&sb, &picks, dtype));
            backend.scatter_add(into, 1, index, added).unwrap();
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
                    let shape = (rows, classes);
                    cross_entropy_run(backend, (dtype, dtype), reduction, shape, &x, &targets)
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
/// gradient) in `loss_dtype`, combined by `reduction`: the loss, the log-sum-exps and the logits'
/// gradient (scaled by the logits' count, so that the small gradient of a mean over many
/// classes weighs in the norm as much as the loss), read back.
fn cross_entropy_run(
    backend: &BackendRef,
    (dtype, loss_dtype): (DType, DType),
    reduction: Reduction,
    (rows, classes): (usize, usize),
    logits: &[f64],
    targets: &[f64],
) -> Vec<f64> {
    let table = Layout::contiguous(&[rows, classes]);
    let target_layout = Layout::contiguous(&[rows]);
    let scalar = Layout::contiguous(&[]);
    let (xb, tb) = (
        upload(backend, dtype, logits),
        upload(backend, DType::I64, targets),
    );
    let input = CrossEntropyArgs {
        logits: view(&xb, &table, dtype),
        target: view(&tb, &target_layout, DType::I64),
        ignore_index: -100,
        reduction,
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
    let forward = CrossEntropyForward {
        input,
        loss: loss_view,
        lse: lse_view,
    };
    backend.cross_entropy(forward).unwrap();
    let dloss = upload(backend, loss_dtype, &[0.75]);
    let dlogits = poisoned(backend, dtype, rows * classes);
    let backward = CrossEntropyBackward {
        input,
        lse: lse_view,
        dloss: view(&dloss, &scalar, loss_dtype),
        dlogits: view(&dlogits, &table, dtype),
    };
    backend.cross_entropy_backward(backward).unwrap();
    let mut res = download(backend, loss_dtype, &loss);
    res.extend(download(backend, stats, &lse));
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
        let targets = targets(&mut random, rows, classes, 5);
        let logits: Vec<f64> = (0..rows * classes)
            .map(|_| random.next_f64_in(-8.0, 8.0))
            .collect();
        for dtypes in WITH_STATS_DTYPE {
            let what = format!("cross_entropy {rows}×{classes}, loss {:?}", dtypes.1);
            compare(&what, dtypes.0, &gpu, &cpu, |backend| {
                let shape = (rows, classes);
                cross_entropy_run(backend, dtypes, Reduction::Mean, shape, &logits, &targets)
            });
        }
    }
}

/// The tiles of a chunked cross-entropy (`linear_cross_entropy`'s primitives): 37 rows of 53
/// classes folded in tiles of 16 classes (the last one 5 wide), with ignored rows, label
/// smoothing's logit sums, and each tile's logits then overwritten by their gradient.
#[test]
#[ignore = "needs a CUDA device"]
fn cross_entropy_tiles_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x7115_c0de_0ce1_1a55) else {
        return;
    };
    let (rows, classes, width) = (37, 53, 16);
    let targets = targets(&mut random, rows, classes, 6);
    let factor: Vec<f64> = targets
        .iter()
        .map(|&t| if t < 0.0 { 0.0 } else { 0.5 })
        .collect();
    let scale: Vec<f64> = factor.iter().map(|f| f * 1.25).collect();
    for (dtype, stats) in WITH_STATS_DTYPE {
        let logits = input(&mut random, false, rows * classes);
        compare("cross_entropy tiles", dtype, &gpu, &cpu, |backend| {
            let per_row = Layout::contiguous(&[rows]);
            let target = upload(backend, DType::I64, &targets);
            let target = view(&target, &per_row, DType::I64);
            let stat = |values: &[f64]| upload(backend, stats, values);
            let (row_max, row_sum) = (stat(&[f64::NEG_INFINITY; 37]), stat(&[0.0; 37]));
            let (target_logit, logit_sum) = (stat(&[0.0; 37]), stat(&[0.0; 37]));
            let (scale, factor) = (stat(&scale), stat(&factor));
            let mut res = Vec::new();
            let tiles: Vec<_> = (0..classes)
                .step_by(width)
                .map(|start| {
                    let n = width.min(classes - start);
                    let values: Vec<f64> = (0..rows)
                        .flat_map(|r| logits[r * classes + start..r * classes + start + n].to_vec())
                        .collect();
                    (
                        start,
                        Layout::contiguous(&[rows, n]),
                        upload(backend, dtype, &values),
                    )
                })
                .collect();
            let logit_tiles: Vec<LogitTile> = tiles
                .iter()
                .map(|(start, layout, tile)| LogitTile {
                    logits: view(tile, layout, dtype),
                    class_start: *start,
                    target,
                    ignore_index: -100,
                })
                .collect();
            for &tile in &logit_tiles {
                let args = CrossEntropyTile {
                    tile,
                    row_max: view(&row_max, &per_row, stats),
                    row_sum: view(&row_sum, &per_row, stats),
                    target_logit: view(&target_logit, &per_row, stats),
                    logit_sum: Some(view(&logit_sum, &per_row, stats)),
                };
                backend.cross_entropy_tile(args).unwrap();
            }
            let (max, sum) = (
                download(backend, stats, &row_max),
                download(backend, stats, &row_sum),
            );
            let lse: Vec<f64> = max.iter().zip(&sum).map(|(m, s)| m + s.ln()).collect();
            let lse_buffer = stat(&lse);
            for (&tile, (_, _, buffer)) in logit_tiles.iter().zip(&tiles) {
                let args = CrossEntropyTileBackward {
                    tile,
                    classes,
                    smoothing: 0.1,
                    lse: view(&lse_buffer, &per_row, stats),
                    scale: view(&scale, &per_row, stats),
                    factor: view(&factor, &per_row, stats),
                };
                backend.cross_entropy_tile_backward(args).unwrap();
                res.extend(download(backend, dtype, buffer).iter().map(|g| g * 10.0));
            }
            res.extend(lse);
            res.extend(download(backend, stats, &target_logit));
            res.extend(download(backend, stats, &logit_sum));
            res
        });
    }
}

/// Random classes for `rows` rows, every `every`-th from the fourth ignored (-100).
fn targets(random: &mut Xorshift, rows: usize, classes: usize, every: usize) -> Vec<f64> {
    (0..rows)
        .map(|r| {
            if r % every == 3 {
                -100.0
            } else {
                random.next_f64_in(0.0, classes as f64).floor()
            }
        })
        .collect()
}
