//! A step that fails leaves no trace in the optimizer: on the CPU, a single-tensor Adam step
//! whose scratch allocation runs out of memory (a host storage with a fixed capacity) keeps every
//! parameter's step count, so the step taken again once memory is back, and the steps after it,
//! equal a run that never failed, bit for bit. (An eager step run again after a refused CUDA
//! graph capture relies on the same.)

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_caching_allocator::{AllocatorConfig, CachingAllocator, HostStorage};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
use headroom_testkit::inputs::uniform_f32;

/// Elements of the parameter: 12 MB of f32, a segment of its own in the large pool.
const N: usize = 3_000_000;
/// Room for five such segments (parameter, gradient, two moments, the step's scratch).
const CAPACITY: u64 = 5 * (12 << 20) + (4 << 20);

fn backend(capacity: Option<u64>) -> BackendRef {
    let storage = match capacity {
        Some(bytes) => HostStorage::with_capacity(bytes),
        None => HostStorage::new(),
    };
    Arc::new(CpuBackend::new(CachingAllocator::new(
        storage,
        AllocatorConfig::pytorch_defaults(),
    )))
}

/// Three steps on `backend`; with `fail_second`, memory is filled before the second step, which
/// must fail, and freed before it is taken again. The parameter after each step.
fn three_steps(backend: &BackendRef, fail_second: bool) -> Vec<Vec<f32>> {
    let p = Tensor::from_slice(backend, &uniform_f32(N, 1), &[N]).unwrap();
    p.requires_grad_(true).unwrap();
    let mut adam = Adam::new(
        vec![ParamGroup::new(vec![p.clone()], AdamConfig::adamw())],
        Implementation::Single,
    )
    .unwrap();
    let mut values = Vec::new();
    for step in 0..3u64 {
        let grad = Tensor::from_slice(backend, &uniform_f32(N, 10 + step), &[N]).unwrap();
        p.set_grad(Some(grad)).unwrap();
        if step == 1 && fail_second {
            // The scratch block cached by the first step goes to this tensor, and no segment is
            // left for the step's own.
            let ballast = Tensor::zeros(backend, &[N], DType::F32).unwrap();
            let error = adam.step().expect_err("no memory for the scratch");
            assert!(error.to_string().contains("out of memory"), "{error}");
            drop(ballast);
        }
        adam.step().unwrap();
        values.push(p.to_vec::<f32>().unwrap());
    }
    values
}

#[test]
fn a_step_that_runs_out_of_memory_changes_nothing() {
    let clean = three_steps(&backend(None), false);
    let failed = three_steps(&backend(Some(CAPACITY)), true);
    for (step, (a, b)) in clean.iter().zip(&failed).enumerate() {
        assert!(a == b, "the parameter differs after step {}", step + 1);
    }
    // The steps moved the parameter (the comparison is not of three equal vectors).
    assert_ne!(clean[1], clean[2]);
}
