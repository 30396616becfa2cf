//! The memory a CUDA optimizer holds during a step, read from its backend's allocator: fused,
//! 8-bit and 4-bit nothing, single one parameter's temporary, bounded foreach at most its chunk,
//! unbounded foreach all parameters (PyTorch's foreach); state sizes exact, bf16 states 2 bytes an
//! element.
//! Each test opens a backend of its own, so other tests' tensors stay out of its counts. Each test
//! is marked `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

mod cuda_tensors;

use std::num::NonZeroUsize;
use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cuda::CudaBackend;
use headroom_optim::kernels::n_blocks;
use headroom_optim::{
    Adam, Adam4bit, Adam4bitConfig, Adam8bit, Adam8bitConfig, AdamConfig, Implementation,
    Optimizer, ParamGroup, Sgd, SgdConfig,
};
use headroom_testkit::gpu::cuda_or_skip;

use cuda_tensors::{random, tensor_of};

/// The device, as itself (for its allocator's counts) and as the `BackendRef` tensors take; or
/// `None` after the GPU gate's skip notice.
#[track_caller]
fn own_cuda() -> Option<(Arc<CudaBackend>, BackendRef)> {
    let cuda = cuda_or_skip(CudaBackend::new(0))?;
    Some((cuda.clone(), cuda))
}

/// AdamW over `params` (one group) with `implementation`.
fn adamw(params: Vec<Tensor>, implementation: Implementation) -> Adam {
    let group = ParamGroup::new(params, AdamConfig::adamw());
    Adam::new(vec![group], implementation).unwrap()
}

/// SGD with momentum 0.9 and learning rate 0.1 over `params` (one group) with `implementation`.
fn sgd_with_momentum(params: Vec<Tensor>, implementation: Implementation) -> Sgd {
    let config = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.1)
    };
    Sgd::new(vec![ParamGroup::new(params, config)], implementation).unwrap()
}

/// Bytes allocated and the peak above them during one step (after a first one that created the
/// state and the launch table).
fn step_memory(cuda: &CudaBackend, optimizer: &mut dyn Optimizer) -> (u64, u64) {
    optimizer.step().unwrap();
    cuda.synchronize().unwrap();
    let before = cuda.allocator().memory_allocated();
    cuda.allocator().reset_peak_stats();
    optimizer.step().unwrap();
    cuda.synchronize().unwrap();
    let peak = cuda.allocator().max_memory_allocated();
    assert_eq!(
        cuda.allocator().memory_allocated(),
        before,
        "a step keeps nothing"
    );
    (before, peak - before)
}

fn cuda_params(cuda: &BackendRef, shapes: &[&[usize]]) -> Vec<Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let t = Tensor::from_slice(cuda, &random(i as u64, n, 1.0), shape).unwrap();
            t.set_grad(Some(
                Tensor::from_slice(cuda, &random(i as u64 + 50, n, 1.0), shape).unwrap(),
            ))
            .unwrap();
            t
        })
        .collect()
}

/// What each implementation promises during a step on CUDA: fused and 8-bit nothing, single one
/// parameter's temporary, bounded foreach at most its chunk, unbounded foreach all parameters
/// (PyTorch's foreach). State sizes are exact.
#[test]
#[ignore = "needs a CUDA device"]
fn each_implementation_holds_the_memory_it_promises() {
    // A backend of its own: other tests' tensors stay out of its allocator's counts.
    let Some((cuda, backend)) = own_cuda() else {
        return;
    };
    // 4 Mi + 1 Mi + 1000 elements.
    let shapes: [&[usize]; 3] = [&[2048, 2048], &[1024, 1024], &[1000]];
    let largest = 2048 * 2048 * 4;
    let total = (2048 * 2048 + 1024 * 1024 + 1024) * 4; // the 4000-byte tensor takes 4096
    let cases: [(Implementation, u64); 6] = [
        (Implementation::Fused, 0),
        (Implementation::Single, largest),
        (Implementation::FOREACH, 16 << 20),
        (
            Implementation::Foreach {
                chunk: NonZeroUsize::new(1 << 16).unwrap(),
            },
            1 << 18,
        ),
        (Implementation::ForeachUnbounded, total),
        (
            Implementation::Foreach {
                chunk: NonZeroUsize::new(1 << 30).unwrap(),
            },
            total,
        ),
    ];
    for (implementation, extra) in cases {
        let params = cuda_params(&backend, &shapes);
        let mut adam = adamw(params.clone(), implementation);
        let (_, peak) = step_memory(&cuda, &mut adam);
        println!("Adam {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "{implementation:?}");
        for (idx, param) in params.iter().enumerate() {
            for (name, state) in adam.param_state(0, idx) {
                assert_eq!(state.shape(), param.shape(), "{name}");
                assert_eq!(state.dtype(), DType::F32, "{name}");
                assert_eq!(state.device(), param.device(), "{name}");
            }
        }
        let mut sgd = sgd_with_momentum(params, implementation);
        let (_, peak) = step_memory(&cuda, &mut sgd);
        println!("SGD {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "{implementation:?}");
    }
    // 8-bit: u8 codes and one f32 scale per 256 elements; f32 states under 4096 elements.
    let params = cuda_params(&backend, &[&[300, 257], &[1000]]);
    let mut adam8 = Adam8bit::new(
        vec![ParamGroup::new(params.clone(), Adam8bitConfig::adam())],
        Implementation::Fused,
    )
    .unwrap();
    let (_, peak) = step_memory(&cuda, &mut adam8);
    assert_eq!(peak, 0);
    let state: Vec<_> = adam8.param_state(0, 0);
    let n = 300 * 257;
    let expect = [
        ("state1", DType::U8, n),
        ("state2", DType::U8, n),
        ("absmax1", DType::F32, n_blocks(n)),
        ("absmax2", DType::F32, n_blocks(n)),
    ];
    for ((name, tensor), (want_name, dtype, numel)) in state.iter().zip(expect) {
        assert_eq!(
            (*name, tensor.dtype(), tensor.numel()),
            (want_name, dtype, numel)
        );
        let bytes = (numel * dtype.size_in_bytes()) as u64;
        assert_eq!(tensor.buffer().allocated_bytes(), bytes.div_ceil(512) * 512);
    }
    let small: Vec<_> = adam8.param_state(0, 1);
    assert_eq!(small.len(), 2);
    for (_, tensor) in small {
        assert_eq!((tensor.dtype(), tensor.numel()), (DType::F32, 1000));
    }
    // 4-bit: two codes a byte and one f32 scale per 128 elements; f32 states otherwise.
    let params = cuda_params(&backend, &[&[300, 128], &[1000]]);
    let mut adam4 = Adam4bit::new(
        vec![ParamGroup::new(params, Adam4bitConfig::adamw())],
        Implementation::Fused,
    )
    .unwrap();
    let (_, peak) = step_memory(&cuda, &mut adam4);
    assert_eq!(peak, 0);
    let n = 300 * 128;
    let expect = [
        ("state1", DType::U8, n / 2),
        ("state2", DType::U8, n / 2),
        ("absmax1", DType::F32, n / 128),
        ("absmax2", DType::F32, n / 128),
    ];
    for ((name, tensor), (want_name, dtype, numel)) in adam4.param_state(0, 0).iter().zip(expect) {
        assert_eq!(
            (*name, tensor.dtype(), tensor.numel()),
            (want_name, dtype, numel)
        );
    }
    let small: Vec<_> = adam4.param_state(0, 1);
    assert_eq!(small.len(), 2);
}

/// The bf16 fused step on CUDA: states of 2 bytes per element (exact bytes), nothing else during
/// a step; bounded foreach holds its chunk of bf16 temporaries.
#[test]
#[ignore = "needs a CUDA device"]
fn bf16_fused_steps_hold_only_their_states() {
    let Some((cuda, backend)) = own_cuda() else {
        return;
    };
    let shapes: [&[usize]; 2] = [&[2048, 2048], &[1000]];
    let n_elems: u64 = 2048 * 2048 + 1000;
    // 2-byte states, each buffer rounded up to 512 bytes.
    let state_bytes = 2048 * 2048 * 2 + 2048;
    let params: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let t = tensor_of(&backend, &random(i as u64, n, 1.0), shape, DType::BF16);
            t.set_grad(Some(tensor_of(
                &backend,
                &random(i as u64 + 50, n, 1.0),
                shape,
                DType::BF16,
            )))
            .unwrap();
            t
        })
        .collect();
    let cases: [(Implementation, u64); 2] = [
        (Implementation::Fused, 0),
        (Implementation::FOREACH, n_elems.min(1 << 22) * 2),
    ];
    for (implementation, extra) in cases {
        let before = cuda.allocator().memory_allocated();
        let mut adam = adamw(params.clone(), implementation);
        let (with_state, peak) = step_memory(&cuda, &mut adam);
        println!("bf16 Adam {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "Adam {implementation:?}");
        let states: u64 = (0..params.len())
            .flat_map(|idx| adam.param_state(0, idx))
            .map(|(name, state)| {
                assert_eq!(state.dtype(), DType::BF16, "{name}");
                state.buffer().allocated_bytes()
            })
            .sum();
        assert_eq!(states, 2 * state_bytes);
        assert!(with_state - before >= states);
        drop(adam);
        let mut sgd = sgd_with_momentum(params.clone(), implementation);
        let (_, peak) = step_memory(&cuda, &mut sgd);
        println!("bf16 SGD {implementation:?}: {peak} bytes during a step");
        assert_eq!(peak, extra, "SGD {implementation:?}");
        let buffer = &sgd.param_state(0, 0)[0].1;
        assert_eq!(buffer.dtype(), DType::BF16);
        assert_eq!(buffer.buffer().allocated_bytes(), 2048 * 2048 * 2);
    }
}
