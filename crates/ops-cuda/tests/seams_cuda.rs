//! autograd-core's technique seams on the CUDA backend: max and min propagate NaN as on the CPU
//! (the non-finite check relies on it), the non-finite check over many tensors of every float
//! dtype, and autocast casting a linear layer's operands as explicit casts would. Each test
//! is marked `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use headroom_autograd_core::{
    autocast, autocast_stats, found_non_finite, AutocastPolicy, BackendRef, CastPolicy, DType,
    Device, ReduceOp, Tensor,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::backend_or_skip;

#[test]
#[ignore = "needs a CUDA device"]
fn max_and_min_propagate_nan_as_on_the_cpu() {
    let Some(gpu) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let cpu = CpuBackend::new_ref();
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        // Rows of 700 with a NaN at the start, the middle and the end of different rows, an
        // infinity in another, and a clean row.
        let mut values: Vec<f64> = (0..5 * 700).map(|i| ((i * 13) as f64).sin()).collect();
        values[0] = f64::NAN;
        values[700 + 350] = f64::NAN;
        values[2 * 700 + 699] = f64::NAN;
        values[3 * 700 + 10] = f64::NEG_INFINITY;
        for op in [ReduceOp::Max, ReduceOp::Min] {
            let on = |backend: &BackendRef| {
                let x = Tensor::from_f64s(backend, &values, &[5, 700], dtype).unwrap();
                let rows = Tensor::zeros(backend, &[5], dtype).unwrap();
                backend.reduce(op, x.view(), 1, rows.view()).unwrap();
                let whole = Tensor::zeros(backend, &[], dtype).unwrap();
                backend.reduce(op, x.view(), 2, whole.view()).unwrap();
                let mut res = rows.to_vec_f64().unwrap();
                res.extend(whole.to_vec_f64().unwrap());
                res
            };
            let (on_gpu, on_cpu) = (on(&gpu), on(&cpu));
            let same = on_gpu
                .iter()
                .zip(&on_cpu)
                .all(|(x, y)| (x.is_nan() && y.is_nan()) || x == y);
            assert!(same, "{dtype:?} {op:?}: {on_gpu:?} vs {on_cpu:?}");
            assert!(on_gpu[..3].iter().chain(&on_gpu[5..]).all(|v| v.is_nan()));
            assert!(!on_gpu[4].is_nan());
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_non_finite_check_finds_every_kind_of_overflow_on_the_gpu() {
    let Some(gpu) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    let tensors: Vec<Tensor> = (0..1000)
        .map(|i| {
            let n = 1 + (i * 997) % 5000;
            let values: Vec<f64> = (0..n).map(|j| ((i + j) as f64).cos() * 100.0).collect();
            Tensor::from_f64s(&gpu, &values, &[n], dtypes[i % 3]).unwrap()
        })
        .collect();
    let all: Vec<&Tensor> = tensors.iter().collect();
    let clear = found_non_finite(&all, &tensors[0]).unwrap();
    assert_eq!(clear.to_vec::<f32>().unwrap(), [0.0]);
    for (idx, value) in [
        (3, f64::INFINITY),
        (400, f64::NEG_INFINITY),
        (999, f64::NAN),
    ] {
        let bad = &tensors[idx];
        let saved = bad.to_vec_f64().unwrap();
        let mut poisoned = saved.clone();
        poisoned[bad.numel() - 1] = value;
        bad.copy_(&Tensor::from_f64s(&gpu, &poisoned, bad.shape(), DType::F64).unwrap())
            .unwrap();
        let found = found_non_finite(&all, bad).unwrap();
        assert_eq!(
            found.to_vec::<f32>().unwrap(),
            [1.0],
            "{value} in tensor {idx}"
        );
        bad.copy_(&Tensor::from_f64s(&gpu, &saved, bad.shape(), DType::F64).unwrap())
            .unwrap();
    }
}

#[derive(Debug)]
struct LinearInBf16;

impl AutocastPolicy for LinearInBf16 {
    fn lower_precision(&self) -> DType {
        DType::BF16
    }

    fn cast_policy(&self, op: &'static str, device: Device) -> CastPolicy {
        match (op, device) {
            ("linear", Device::Cuda(_)) => CastPolicy::LowerPrecision,
            _ => CastPolicy::Keep,
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn autocast_runs_a_linear_in_bf16_like_explicit_casts() {
    let Some(gpu) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let values: Vec<f64> = (0..64 * 96).map(|i| ((i * 7) as f64).sin()).collect();
    let x = Tensor::from_f64s(&gpu, &values[..32 * 96], &[32, 96], DType::F32).unwrap();
    let w = Tensor::from_f64s(&gpu, &values[..64 * 96], &[64, 96], DType::F32).unwrap();
    w.requires_grad_(true).unwrap();
    let explicit = x
        .to_dtype(DType::BF16)
        .unwrap()
        .linear(&w.to_dtype(DType::BF16).unwrap(), None)
        .unwrap();
    let _scope = autocast(Arc::new(LinearInBf16));
    let cast = x.linear(&w, None).unwrap();
    assert_eq!(cast.dtype(), DType::BF16);
    assert_eq!(
        cast.to_vec::<half::bf16>().unwrap(),
        explicit.to_vec::<half::bf16>().unwrap()
    );
    assert_eq!(autocast_stats().cached_tensors, 1);
    cast.to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
}
