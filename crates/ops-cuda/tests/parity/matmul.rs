//! Matrix products through cuBLAS against the CPU: batched products of strided operands (with the
//! workspace counted by the caching allocator), operands that overlap (`expand`, stride 0) copied
//! dense first, and TF32 as an explicit opt-in within 1e-3.

use headroom_autograd_core::{BackendRef, DType, Layout, View};

use crate::{compare, download, input, poisoned, upload, view, FLOATS};
use crate::{own_backends, seeded_backends};

#[test]
#[ignore = "needs a CUDA device"]
fn batched_matmul_on_strided_operands_matches_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x5eed_5eed_5eed_5eed) else {
        return;
    };
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
            let (lhs, rhs) = (view(&ab, &a_layout, dtype), view(&bb, &b_layout, dtype));
            let out = upload(backend, dtype, &c0);
            backend
                .matmul(lhs, rhs, view(&out, &out_layout, dtype), true)
                .unwrap();
            let fresh = poisoned(backend, dtype, batch * heads * m * n);
            backend
                .matmul(lhs, rhs, view(&fresh, &out_layout, dtype), false)
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

/// Operands whose rows or columns overlap (`expand`, stride 0) cannot be described to cuBLAS by
/// a leading dimension and are copied dense first; among them the `k = 1` product of a ViT
/// head's weight gradient at batch 1 (`[1000, 1]` of a broadcast scalar, times one row of a
/// larger tensor), which read past its buffer and computed garbage before.
#[test]
#[ignore = "needs a CUDA device"]
fn matmul_with_broadcast_operands_matches_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0x0dd_ba11) else {
        return;
    };
    // (what, [m, k, n], a's strides, b's strides); each operand holds the elements its layout
    // reaches.
    let cases = [
        ("b fully broadcast", [19, 23, 31], [23, 1], [0, 0]),
        ("b fully broadcast, k = 1", [19, 1, 31], [1, 1], [0, 0]),
        ("b's rows expanded", [19, 23, 31], [23, 1], [0, 1]),
        ("a's columns expanded", [19, 23, 31], [1, 0], [31, 1]),
        // A head's weight gradient at batch 1: a broadcast column times one row of a larger
        // tensor (row stride 201,728), k = 1.
        (
            "a broadcast, k = 1, b one row",
            [1000, 1, 64],
            [0, 0],
            [4096, 1],
        ),
    ];
    for (what, [m, k, n], a_strides, b_strides) in cases {
        let a_layout = Layout::from_parts(&[m, k], &a_strides, 0).unwrap();
        let b_layout = Layout::from_parts(&[k, n], &b_strides, 0).unwrap();
        for dtype in FLOATS {
            let a = input(&mut random, false, a_layout.storage_extent());
            let b = input(&mut random, false, b_layout.storage_extent());
            compare(what, dtype, &gpu, &cpu, |backend| {
                let (ab, bb) = (upload(backend, dtype, &a), upload(backend, dtype, &b));
                let out = poisoned(backend, dtype, m * n);
                backend
                    .matmul(
                        view(&ab, &a_layout, dtype),
                        view(&bb, &b_layout, dtype),
                        view(&out, &Layout::contiguous(&[m, n]), dtype),
                        false,
                    )
                    .unwrap();
                download(backend, dtype, &out)
            });
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn tf32_is_an_explicit_opt_in_within_1e_3() {
    // A backend of its own, so the setting does not reach the other tests.
    let Some((cuda, gpu, cpu, mut random)) = own_backends(0x7f32_7f32_7f32_7f32) else {
        return;
    };
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

/// f16 and bf16 products written unrounded into an f32 `out` (and accumulated into it in f32):
/// the GPU's f32 accumulation against the CPU's, within f32 rounding (the comparison's f32
/// bound), far tighter than the inputs' own precision.
#[test]
#[ignore = "needs a CUDA device"]
fn half_products_into_f32_match_the_cpu() {
    let Some((gpu, cpu, mut random)) = seeded_backends(0xf32a_cc00_5eed_0001) else {
        return;
    };
    let (m, k, n) = (45, 130, 37);
    for dtype in [DType::F16, DType::BF16] {
        let a = input(&mut random, false, m * k);
        let b = input(&mut random, false, k * n);
        let c0 = input(&mut random, false, m * n);
        compare("matmul into f32", DType::F32, &gpu, &cpu, |backend| {
            let (ab, bb) = (upload(backend, dtype, &a), upload(backend, dtype, &b));
            let a_layout = Layout::contiguous(&[m, k]);
            // b read transposed from [n, k] memory, as a linear's weight is.
            let b_layout = Layout::from_parts(&[k, n], &[1, k], 0).unwrap();
            let out_layout = Layout::contiguous(&[m, n]);
            let (lhs, rhs) = (view(&ab, &a_layout, dtype), view(&bb, &b_layout, dtype));
            let out = upload(backend, DType::F32, &c0);
            let out_view = view(&out, &out_layout, DType::F32);
            backend.matmul(lhs, rhs, out_view, true).unwrap();
            let fresh = poisoned(backend, DType::F32, m * n);
            let fresh_view = view(&fresh, &out_layout, DType::F32);
            backend.matmul(lhs, rhs, fresh_view, false).unwrap();
            let mut res = download(backend, DType::F32, &out);
            res.extend(download(backend, DType::F32, &fresh));
            res
        });
    }
}
