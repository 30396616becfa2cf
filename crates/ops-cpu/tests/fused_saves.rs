//! Fused ops against the ops they fuse: `linear_gelu` against `linear` then `gelu`, and the ops
//! that feed a linear from a cheap op (`gelu_linear`, `gelu_tanh_linear`, `layer_norm_linear`)
//! against the pair written apart: the same bits for values and every gradient, and exactly the
//! bytes the pair keeps for backward less the intermediate they recompute (the same bytes
//! inside `keep_intermediates`), on the CPU allocator.

use headroom_autograd_core::{keep_intermediates, layer_norm, layer_norm_linear, DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::memory::allocated;

/// `n` values in [-1.5, 1.5) in a pattern set by `seed`.
fn patterned(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 1009) as f64 / 1009.0 - 0.5) * 3.0)
        .collect()
}

/// Backward of `out`'s sum weighted by a fixed pattern; `out`'s values and the gradients of
/// `leaves`, as [`raw_bits`].
fn weighted_backward_bits(out: &Tensor, leaves: [&Tensor; 3]) -> Vec<Vec<u64>> {
    let weights = Tensor::from_f64s(
        out.backend(),
        &patterned(out.numel(), 4),
        out.shape(),
        out.dtype(),
    )
    .unwrap();
    out.mul(&weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut res = vec![raw_bits(&out.detach())];
    res.extend(leaves.map(|leaf| raw_bits(&leaf.grad().unwrap())));
    res
}

/// A tensor's values as the bits of their f64 widening.
fn raw_bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Forward values, the three gradients and the peak memory of `x.linear(w, b).gelu()` (or the
/// fused `linear_gelu`) on a fresh backend, as raw bits.
fn linear_gelu_run(fused: bool, dtype: DType) -> (Vec<Vec<u64>>, i64) {
    let cpu = CpuBackend::new_ref();
    let make = |n: usize, seed: usize, shape: &[usize]| {
        let t = Tensor::from_f64s(&cpu, &patterned(n, seed), shape, dtype).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let (x, w, b) = (
        make(2 * 5 * 8, 1, &[2, 5, 8]),
        make(12 * 8, 2, &[12, 8]),
        make(12, 3, &[12]),
    );
    let out = if fused {
        x.linear_gelu(&w, Some(&b)).unwrap()
    } else {
        x.linear(&w, Some(&b)).unwrap().gelu().unwrap()
    };
    let res = weighted_backward_bits(&out, [&x, &w, &b]);
    (res, cpu.memory_stats().allocated_bytes.all.peak)
}

#[test]
fn fused_linear_gelu_equals_linear_then_gelu_to_the_bit() {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let (fused, fused_peak) = linear_gelu_run(true, dtype);
        let (unfused, unfused_peak) = linear_gelu_run(false, dtype);
        for (what, (lhs, rhs)) in ["output", "dx", "dw", "db"]
            .iter()
            .zip(fused.iter().zip(&unfused))
        {
            assert_eq!(lhs, rhs, "{what} {dtype:?}");
        }
        assert_eq!(fused_peak, unfused_peak, "{dtype:?}");
    }
}

/// Forward values, the three gradients and the bytes held between forward and backward of
/// `h.gelu().linear(w, b)` (or the one op `gelu_linear`; the tanh GELU with `tanh`) on a fresh
/// backend, as raw bits.
fn gelu_linear_run(fused: bool, tanh: bool, dtype: DType) -> (Vec<Vec<u64>>, i64) {
    let cpu = CpuBackend::new_ref();
    let make = |n: usize, seed: usize, shape: &[usize]| {
        let t = Tensor::from_f64s(&cpu, &patterned(n, seed), shape, dtype).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let (h, w, b) = (
        make(2 * 8 * 16, 1, &[2, 8, 16]),
        make(8 * 16, 2, &[8, 16]),
        make(8, 3, &[8]),
    );
    // A pre-activation that is not a leaf, as an MLP's is.
    let pre_activation = h.mul_scalar(1.5).unwrap();
    let before = allocated(&cpu);
    let out = match (fused, tanh) {
        (true, false) => pre_activation.gelu_linear(&w, Some(&b)).unwrap(),
        (true, true) => pre_activation.gelu_tanh_linear(&w, Some(&b)).unwrap(),
        (false, false) => pre_activation.gelu().unwrap().linear(&w, Some(&b)).unwrap(),
        (false, true) => pre_activation
            .gelu_tanh()
            .unwrap()
            .linear(&w, Some(&b))
            .unwrap(),
    };
    let held = allocated(&cpu) - before;
    drop(pre_activation);
    let res = weighted_backward_bits(&out, [&h, &w, &b]);
    (res, held)
}

#[test]
fn gelu_linear_equals_gelu_then_linear_to_the_bit_and_keeps_no_activation() {
    for tanh in [false, true] {
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            let (fused, fused_held) = gelu_linear_run(true, tanh, dtype);
            let (pair, pair_held) = gelu_linear_run(false, tanh, dtype);
            for (what, (lhs, rhs)) in ["output", "dh", "dw", "db"]
                .iter()
                .zip(fused.iter().zip(&pair))
            {
                assert_eq!(lhs, rhs, "{what} {dtype:?} tanh {tanh}");
            }
            // The pair keeps the activation (2 × 8 × 16 values, whole 512-byte blocks of the
            // allocator in every dtype) for the weight gradient.
            let activation = (2 * 8 * 16 * dtype.size_in_bytes()) as i64;
            assert_eq!(pair_held - fused_held, activation, "{dtype:?} tanh {tanh}");
            // Told to keep it, the op keeps what the pair keeps, for the same bits.
            let _keep = keep_intermediates();
            assert_eq!(gelu_linear_run(true, tanh, dtype), (pair, pair_held));
        }
    }
}

/// Forward values, the five gradients and the bytes held between forward and backward of
/// `layer_norm(x, ..).linear(w, b)` (or the one op `layer_norm_linear`) on a fresh backend.
fn layer_norm_linear_run(fused: bool, dtype: DType) -> (Vec<Vec<u64>>, i64) {
    let cpu = CpuBackend::new_ref();
    let make = |n: usize, seed: usize, shape: &[usize]| {
        let t = Tensor::from_f64s(&cpu, &patterned(n, seed), shape, dtype).unwrap();
        t.requires_grad_(true).unwrap();
        t
    };
    let (x, gamma, beta, w, b) = (
        make(2 * 8 * 32, 1, &[2, 8, 32]),
        make(32, 5, &[32]),
        make(32, 6, &[32]),
        make(16 * 32, 2, &[16, 32]),
        make(16, 3, &[16]),
    );
    let input = x.mul_scalar(1.5).unwrap();
    let before = allocated(&cpu);
    let out = if fused {
        layer_norm_linear(&input, &[32], Some(&gamma), Some(&beta), 1e-5, &w, Some(&b)).unwrap()
    } else {
        layer_norm(&input, &[32], Some(&gamma), Some(&beta), 1e-5)
            .unwrap()
            .linear(&w, Some(&b))
            .unwrap()
    };
    let held = allocated(&cpu) - before;
    drop(input);
    let mut res = weighted_backward_bits(&out, [&x, &w, &b]);
    res.extend([&gamma, &beta].map(|leaf| raw_bits(&leaf.grad().unwrap())));
    (res, held)
}

#[test]
fn layer_norm_linear_equals_the_pair_to_the_bit_and_keeps_no_norm_output() {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let (fused, fused_held) = layer_norm_linear_run(true, dtype);
        let (pair, pair_held) = layer_norm_linear_run(false, dtype);
        for (what, (lhs, rhs)) in ["output", "dx", "dw", "db", "dgamma", "dbeta"]
            .iter()
            .zip(fused.iter().zip(&pair))
        {
            assert_eq!(lhs, rhs, "{what} {dtype:?}");
        }
        // The pair keeps the norm's output (2 × 8 × 32 values) for the weight gradient.
        let normed = (2 * 8 * 32 * dtype.size_in_bytes()) as i64;
        assert_eq!(pair_held - fused_held, normed, "{dtype:?}");
        // Told to keep it, the op keeps what the pair keeps, for the same bits.
        let _keep = keep_intermediates();
        assert_eq!(layer_norm_linear_run(true, dtype), (pair, pair_held));
    }
}
