//! The fused linear + cross-entropy (`linear_cross_entropy`) on CUDA: at a scaled-down
//! Llama-3.2-1B head against the CPU (the same bf16 values, an f32 reference), and at the full
//! head (8192 tokens × 2048 features × 128,256 classes, bf16) against the unfused loss on the
//! GPU, with the peak of allocated bytes held to the target: beyond the inputs, the
//! weight and their gradients, at most 64 MiB + 8 B per token. Marked
//! `#[ignore = "needs a CUDA device"]`: they run with `--include-ignored`.

#![cfg(feature = "cuda")]

use headroom_autograd_core::{
    cross_entropy_f32, linear_cross_entropy, BackendRef, DType, LinearCrossEntropyOptions,
    Reduction, Tensor,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::backend_or_skip;
use headroom_testkit::inputs::uniform_f32;
use headroom_testkit::loss_fixtures::{labels_every_ninth_ignored, IGNORE_INDEX};
use headroom_testkit::memory::{allocated, peak};
use headroom_testkit::worst::{abs_difference, nan_max};

/// The device as the `BackendRef` tensors take, or `None` after the GPU gate's skip notice.
#[track_caller]
fn cuda_backend() -> Option<BackendRef> {
    backend_or_skip(CudaBackend::new(0))
}

/// A leaf of `shape` and `dtype` on `backend` with values in `[-scale, scale)`, rounded to bf16
/// (so an f32 leaf holds exactly the bf16 leaf's values).
fn leaf(backend: &BackendRef, shape: &[usize], scale: f32, seed: u64, dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let values: Vec<f32> = uniform_f32(n, seed).iter().map(|v| v * scale).collect();
    let res = Tensor::from_slice(backend, &values, shape)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    res.requires_grad_(true).unwrap();
    res
}

/// `max |a − b| / max |b|`.
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let scale = b.iter().fold(1e-30f64, |m, v| nan_max(m, v.abs()));
    abs_difference(&a, &b) / scale
}

/// The loss and the gradients of hidden and weight after one forward + backward.
fn run(hidden: &Tensor, weight: &Tensor, loss: Tensor) -> (Tensor, Tensor, Tensor) {
    loss.backward().unwrap();
    let grads = (hidden.take_grad().unwrap(), weight.take_grad().unwrap());
    (loss, grads.0, grads.1)
}

#[test]
#[ignore = "needs a CUDA device"]
fn scaled_down_llama_head_on_cuda_matches_the_cpu_within_bf16_rounding() {
    let Some(gpu) = cuda_backend() else { return };
    let cpu = CpuBackend::new_ref();
    let (tokens, features, vocab) = (300, 128, 4001); // 1/27, 1/16 and 1/32 of the real head
    let options = LinearCrossEntropyOptions {
        label_smoothing: 0.1,
        z_loss: 1e-4,
        chunk_bytes: 1 << 20, // 42 rows, then 341 classes: chunks that divide neither
        ..LinearCrossEntropyOptions::default()
    };
    let fused_on = |backend: &BackendRef, dtype: DType| {
        let hidden = leaf(backend, &[tokens, features], 1.0, 1, dtype);
        let weight = leaf(backend, &[vocab, features], 0.1, 2, dtype);
        let labels = labels_every_ninth_ignored(backend, tokens, vocab).unwrap();
        let loss = linear_cross_entropy(&hidden, &weight, None, &labels, &options).unwrap();
        run(&hidden, &weight, loss)
    };
    let on_cuda = fused_on(&gpu, DType::BF16);
    let on_cpu = fused_on(&cpu, DType::BF16);
    let reference = fused_on(&cpu, DType::F32); // the same bf16 values, computed in f32
    let errors = [
        relative(&on_cuda.0, &reference.0),
        relative(&on_cuda.1, &reference.1),
        relative(&on_cuda.2, &reference.2),
    ];
    let cpu_errors = [
        relative(&on_cpu.0, &reference.0),
        relative(&on_cpu.1, &reference.1),
        relative(&on_cpu.2, &reference.2),
    ];
    println!("bf16 vs f32 (loss, dhidden, dweight): CUDA {errors:?}, CPU {cpu_errors:?}");
    // The loss within 1e-3 and each gradient within a few bf16 roundings (2^-8 each) of its
    // largest element: the logits and their gradient are rounded to bf16 on the way.
    assert!(errors[0] <= 1e-3, "{errors:?}");
    assert!(errors[1] <= 2e-2 && errors[2] <= 2e-2, "{errors:?}");
    // And CUDA as close as the CPU's bf16 run, give or take one bf16 rounding.
    for (ours, cpus) in errors.iter().zip(&cpu_errors) {
        assert!(
            *ours <= cpus + 2f64.powi(-8),
            "{errors:?} vs CPU {cpu_errors:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn full_llama_head_on_cuda_holds_one_chunk_and_matches_the_unfused_loss() {
    let Some(gpu) = cuda_backend() else { return };
    let (tokens, features, vocab) = (8192, 2048, 128_256);
    let hidden = leaf(&gpu, &[tokens, features], 1.0, 3, DType::BF16);
    let weight = leaf(&gpu, &[vocab, features], 0.02, 4, DType::BF16);
    let labels = labels_every_ninth_ignored(&gpu, tokens, vocab).unwrap();
    let options = LinearCrossEntropyOptions::default();
    gpu.synchronize().unwrap();
    gpu.allocator_view().reset_peak_stats();
    let before = allocated(&gpu);
    let fused = run(
        &hidden,
        &weight,
        linear_cross_entropy(&hidden, &weight, None, &labels, &options).unwrap(),
    );
    gpu.synchronize().unwrap();
    let grads = ((tokens + vocab) * features * 2) as i64;
    let fused_peak = peak(&gpu) - before - grads;
    gpu.allocator_view().reset_peak_stats();
    let before = allocated(&gpu);
    let logits = hidden.linear(&weight, None).unwrap();
    let unfused_loss = cross_entropy_f32(&logits, &labels, IGNORE_INDEX, Reduction::Mean).unwrap();
    drop(logits);
    let unfused = run(&hidden, &weight, unfused_loss);
    gpu.synchronize().unwrap();
    let unfused_peak = peak(&gpu) - before - grads;
    let errors = [
        relative(&fused.0, &unfused.0),
        relative(&fused.1, &unfused.1),
        relative(&fused.2, &unfused.2),
    ];
    // The bound, counting cuBLAS's 32 MiB workspace, which this run's first product
    // takes from the caching allocator (the op's chunks leave it room), and whole blocks.
    let target = (64 << 20) + 8 * tokens as i64;
    println!(
        "full head, bf16: beyond inputs and gradients fused {fused_peak} B (target {target} B), \
         unfused {unfused_peak} B; fused vs unfused (loss, dhidden, dweight) {errors:?}"
    );
    assert!(fused_peak <= target, "{fused_peak} > {target}");
    assert!(errors[0] <= 1e-5, "{errors:?}");
    assert!(
        errors[1] <= 2f64.powi(-7) && errors[2] <= 2f64.powi(-7),
        "{errors:?}"
    );
}

/// The tile kernels on raw addresses (`cross_entropy_tile_at`, `cross_entropy_tile_backward_at`:
/// how the `headroom` wheel runs them on torch's memory), over three tiles of a 37 × 300 logit
/// matrix — 128-wide tiles in 16-byte packs, and a 44-wide one that takes the paired path in
/// bf16 — against the whole rows' log-sum-exp, target logits and gradient computed here in f64:
/// f32 logits within 1e-6 relative, bf16 gradients within one bf16 rounding.
#[test]
#[ignore = "needs a CUDA device"]
fn foreign_tiles_fold_to_the_whole_rows_statistics_and_gradient() {
    let Some(backend) = headroom_testkit::gpu::cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    // Tiles of a few hundred classes (one warp a row), and a tile of 16,384 classes beside one
    // of 3,616 (one block a row for the first: a wide tile of few rows).
    fold_tiles(&backend, 37, 300, &[(0, 128), (128, 128), (256, 44)]);
    fold_tiles(&backend, 37, 20_000, &[(0, 16_384), (16_384, 3_616)]);
}

/// Folds `rows` rows of `classes` logits given as the dense tiles `tiles` (first class, width)
/// and checks each row's log-sum-exp, target logit and gradient against f64.
fn fold_tiles(backend: &CudaBackend, rows: usize, classes: usize, tiles: &[(usize, usize)]) {
    use headroom_ops_cuda::{ForeignLogitTile, ForeignTileGradient, ForeignTileStats};
    let logits: Vec<f32> = uniform_f32(rows * classes, 11)
        .iter()
        .map(|v| half::bf16::from_f32(v * 6.0).to_f32())
        .collect();
    let labels: Vec<i64> = (0..rows)
        .map(|r| {
            if r % 9 == 4 {
                IGNORE_INDEX
            } else {
                ((r * 37) % classes) as i64
            }
        })
        .collect();
    let scales: Vec<f32> = (0..rows)
        .map(|r| {
            if labels[r] == IGNORE_INDEX {
                0.0
            } else {
                0.5 + r as f32 / 64.0
            }
        })
        .collect();
    // The f64 reference: each row's log-sum-exp and g · (softmax − onehot).
    let lse: Vec<f64> = (0..rows)
        .map(|r| {
            let row = &logits[r * classes..(r + 1) * classes];
            let most = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            most + row
                .iter()
                .map(|&v| (v as f64 - most).exp())
                .sum::<f64>()
                .ln()
        })
        .collect();
    let want_grad = |r: usize, c: usize| {
        let p = (logits[r * classes + c] as f64 - lse[r]).exp();
        scales[r] as f64 * (p - f64::from(u8::from(labels[r] == c as i64)))
    };
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let read_f32 = |address: u64, n: usize| {
        let mut out = vec![0u8; 4 * n];
        // SAFETY: `address` is a live allocation of at least `n` f32 made below.
        unsafe { backend.download(address, &mut out) }.unwrap();
        out.chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect::<Vec<f32>>()
    };
    let labels_bytes: Vec<u8> = labels.iter().flat_map(|x| x.to_le_bytes()).collect();
    let labels_dev = backend.upload(&labels_bytes).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let size = if dtype == DType::F32 { 4 } else { 2 };
        // Each tile dense on its own: [rows, width].
        let tile_bytes = |start: usize, width: usize| -> Vec<u8> {
            (0..rows)
                .flat_map(|r| logits[r * classes + start..r * classes + start + width].to_vec())
                .flat_map(|v| match dtype {
                    DType::F32 => v.to_le_bytes().to_vec(),
                    _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                })
                .collect()
        };
        let device_tiles: Vec<_> = tiles
            .iter()
            .map(|&(start, width)| backend.upload(&tile_bytes(start, width)).unwrap())
            .collect();
        let row_max = backend
            .upload(&f32_bytes(&vec![f32::NEG_INFINITY; rows]))
            .unwrap();
        let row_sum = backend.upload(&f32_bytes(&vec![0.0; rows])).unwrap();
        let target = backend.upload(&f32_bytes(&vec![0.0; rows])).unwrap();
        let foreign = |i: usize| ForeignLogitTile {
            dtype,
            logits: device_tiles[i].address(),
            rows,
            width: tiles[i].1,
            class_start: tiles[i].0,
            labels: labels_dev.address(),
            label_stride: 1,
            ignore_index: IGNORE_INDEX,
        };
        let stats = ForeignTileStats {
            row_max: row_max.address(),
            row_sum: row_sum.address(),
            target_logit: target.address(),
        };
        for i in 0..tiles.len() {
            // SAFETY: live allocations of this backend of the described sizes, kept until the
            // downloads below (which follow the launches in stream order).
            unsafe { backend.cross_entropy_tile_at(&foreign(i), &stats) }.unwrap();
        }
        let (m, s, t) = (
            read_f32(row_max.address(), rows),
            read_f32(row_sum.address(), rows),
            read_f32(target.address(), rows),
        );
        let got_lse: Vec<f32> = (0..rows).map(|r| m[r] + s[r].ln()).collect();
        for r in 0..rows {
            assert!(
                (got_lse[r] as f64 - lse[r]).abs() <= 1e-6 * lse[r].abs().max(1.0),
                "{dtype:?} row {r}: {} vs {}",
                got_lse[r],
                lse[r]
            );
            if labels[r] != IGNORE_INDEX {
                assert_eq!(
                    t[r],
                    logits[r * classes + labels[r] as usize],
                    "{dtype:?} row {r}"
                );
            }
        }
        let lse_dev = backend.upload(&f32_bytes(&got_lse)).unwrap();
        let scale_dev = backend.upload(&f32_bytes(&scales)).unwrap();
        let gradient = ForeignTileGradient {
            lse: lse_dev.address(),
            scale: scale_dev.address(),
        };
        for (i, &(start, width)) in tiles.iter().enumerate() {
            // SAFETY: as above.
            unsafe { backend.cross_entropy_tile_backward_at(&foreign(i), &gradient) }.unwrap();
            let mut out = vec![0u8; rows * width * size];
            // SAFETY: the tile's live allocation of `rows × width` elements.
            unsafe { backend.download(device_tiles[i].address(), &mut out) }.unwrap();
            for r in 0..rows {
                for c in 0..width {
                    let at = (r * width + c) * size;
                    let got = match dtype {
                        DType::F32 => f32::from_le_bytes(out[at..at + 4].try_into().unwrap()),
                        _ => half::bf16::from_le_bytes([out[at], out[at + 1]]).to_f32(),
                    } as f64;
                    let want = want_grad(r, start + c);
                    let bound = if dtype == DType::F32 {
                        1e-6
                    } else {
                        2f64.powi(-8)
                    };
                    assert!(
                        (got - want).abs() <= bound * want.abs() + 1e-7,
                        "{dtype:?} [{r}, {}]: {got} vs {want}",
                        start + c
                    );
                }
            }
        }
    }
}
