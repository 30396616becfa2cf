//! CPU backend GEMM throughput: one f32 matrix product of 1024×1024 by 1024×1024 through
//! `Tensor::matmul` (allocation of the output included, as a user sees it). Criterion reports
//! the time and, from the declared 2·1024³ flops, the GFLOP/s.

use criterion::{Criterion, Throughput};
use headroom_autograd_core::{DType, Tensor};
use headroom_ops_cpu::CpuBackend;

fn gemm_1024(c: &mut Criterion) {
    let cpu = CpuBackend::new_ref();
    let n = 1024;
    let values: Vec<f32> = (0..n * n)
        .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
        .collect();
    let a = Tensor::from_slice(&cpu, &values, &[n, n]).unwrap();
    let b = Tensor::from_slice(&cpu, &values, &[n, n]).unwrap();
    assert_eq!(a.dtype(), DType::F32);
    let mut group = c.benchmark_group("cpu_gemm");
    // Criterion's "elements" per second are flops per second here.
    group.throughput(Throughput::Elements(2 * (n as u64).pow(3)));
    group.bench_function("cpu_gemm_f32_1024", |bench| {
        bench.iter(|| a.matmul(&b).unwrap())
    });
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    gemm_1024(&mut criterion);
    criterion.final_summary();
}
