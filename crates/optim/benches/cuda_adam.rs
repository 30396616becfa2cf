//! One optimizer step on 1e9 fp32 parameters in 160 tensors of 6.25 M on a CUDA device, the
//! setting of PyTorch's reference (`adam_step_1e9` in the project's anchors): Adam through the
//! `Optimizer` trait on CUDA tensors as single, foreach (bounded by the default 16 MiB chunk, and
//! by 8 and 4 MiB), foreach unbounded (PyTorch's memory), fused, 8-bit and 4-bit; then the
//! raw-buffer `CudaFusedAdam` and `CudaAdam8bit`. Prints one JSON line per implementation: median
//! step time of 5 (after a first step that creates the state), effective bandwidth (28 bytes per
//! parameter for fp32 Adam, 16 for 8-bit and 14 for 4-bit, as the reference counts: the
//! parameter read and written, the gradient read, each state read and written) and the bytes a
//! step allocates beyond what it started with. The 4-bit case's tensors are 6_249_984 elements
//! (whole blocks of 128, so every state is 4-bit; 6.25 M would keep f32 states). Prints a skip notice without a CUDA device.

use std::num::NonZeroUsize;
use std::time::Instant;

use headroom_autograd_core::{BackendRef, Tensor};
use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{CudaAdam8bit, CudaFusedAdam, DeviceAdam8bitParam, DeviceAdamParam};
use headroom_optim::kernels::n_blocks;
use headroom_optim::{
    Adam, Adam4bit, Adam4bitConfig, Adam8bit, Adam8bitConfig, AdamConfig, Implementation,
    Optimizer, ParamGroup,
};

const N_TENSORS: usize = 160;
const PER_TENSOR: usize = 6_250_000;
/// Elements a tensor of the 4-bit case: whole blocks of 128 (torchao's rule for 4-bit states).
const PER_TENSOR_4BIT: usize = 6_249_984;

fn random(seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..PER_TENSOR)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Median of 5 timed steps after a first one, the 5 times, and the bytes allocated during them
/// beyond the start.
fn time_steps(backend: &CudaBackend, step: &mut dyn FnMut(u64)) -> (f64, u64, Vec<f64>) {
    step(1);
    backend.synchronize().expect("device");
    backend.allocator().reset_peak_stats();
    let base = backend.allocator().memory_allocated();
    let mut times = Vec::new();
    for t in 2..7 {
        let start = Instant::now();
        step(t);
        backend.synchronize().expect("device");
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let extra = backend.allocator().max_memory_allocated() - base;
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], extra, times)
}

fn report(name: &str, bytes_per_param: f64, (ms, extra, times): (f64, u64, Vec<f64>)) {
    let n = (N_TENSORS * PER_TENSOR) as f64;
    let times: Vec<String> = times.iter().map(|t| format!("{t:.3}")).collect();
    println!(
        "{{\"case\": \"adam_step_1e9\", \"impl\": \"{name}\", \"ms\": {ms:.3}, \"GBps\": {:.1}, \
         \"step_extra_bytes\": {extra}, \"times_ms\": [{}]}}",
        bytes_per_param * n / (ms / 1e3) / 1e9,
        times.join(", ")
    );
}

fn main() {
    let Some(cuda) = headroom_testkit::gpu::cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let backend: BackendRef = cuda.clone();
    // Eight random patterns, shared out among the tensors (the values do not change the
    // timing; generating 2e9 of them would take longer than the bench).
    let patterns: Vec<Vec<f32>> = (0..8).map(random).collect();
    let params: Vec<Tensor> = (0..N_TENSORS)
        .map(|i| {
            let upload = |values: &[f32]| {
                Tensor::from_slice(&backend, values, &[PER_TENSOR]).expect("memory")
            };
            let p = upload(&patterns[i % 8]);
            p.set_grad(Some(upload(&patterns[(i + 3) % 8])))
                .expect("grad");
            p
        })
        .collect();
    let cfg = AdamConfig {
        lr: 1e-4,
        ..AdamConfig::adam()
    };
    // `OPTIM_BENCH_ONLY=word` runs the cases whose name holds `word` (for a profiler).
    let only = std::env::var("OPTIM_BENCH_ONLY").unwrap_or_default();
    let wanted = |name: &str| name.contains(only.as_str());
    for (name, implementation) in [
        ("headroom_fused_cuda", Implementation::Fused),
        ("headroom_foreach_cuda", Implementation::FOREACH),
        (
            "headroom_foreach_chunk2Mi_cuda",
            Implementation::Foreach {
                chunk: NonZeroUsize::new(1 << 21).unwrap(),
            },
        ),
        (
            "headroom_foreach_chunk1Mi_cuda",
            Implementation::Foreach {
                chunk: NonZeroUsize::new(1 << 20).unwrap(),
            },
        ),
        (
            "headroom_foreach_unbounded_cuda",
            Implementation::ForeachUnbounded,
        ),
        ("headroom_single_cuda", Implementation::Single),
    ] {
        if !wanted(name) {
            continue;
        }
        let mut adam = Adam::new(
            vec![ParamGroup::new(params.clone(), cfg.clone())],
            implementation,
        )
        .expect("optimizer");
        report(
            name,
            28.0,
            time_steps(&cuda, &mut |_| adam.step().expect("step")),
        );
    }
    let cfg8 = Adam8bitConfig {
        lr: 1e-4,
        ..Adam8bitConfig::adam()
    };
    if wanted("headroom_adam8bit_cuda") {
        let mut adam8 = Adam8bit::new(
            vec![ParamGroup::new(params.clone(), cfg8.clone())],
            Implementation::Fused,
        )
        .expect("optimizer");
        report(
            "headroom_adam8bit_cuda",
            16.0,
            time_steps(&cuda, &mut |_| adam8.step().expect("step")),
        );
        drop(adam8);
    }
    if wanted("headroom_adam4bit_cuda") {
        // torchao quantises only whole blocks of 128: 6.25 M is not, so the 4-bit case has tensors
        // of its own, 6_249_984 elements (48_828 blocks; 1e9 less 2_560 in all).
        let params4: Vec<Tensor> = (0..N_TENSORS)
            .map(|i| {
                let upload = |values: &[f32]| {
                    Tensor::from_slice(&backend, &values[..PER_TENSOR_4BIT], &[PER_TENSOR_4BIT])
                        .expect("memory")
                };
                let p = upload(&patterns[i % 8]);
                p.set_grad(Some(upload(&patterns[(i + 3) % 8])))
                    .expect("grad");
                p
            })
            .collect();
        let cfg4 = Adam4bitConfig {
            lr: 1e-4,
            ..Adam4bitConfig::adam()
        };
        let mut adam4 = Adam4bit::new(vec![ParamGroup::new(params4, cfg4)], Implementation::Fused)
            .expect("optimizer");
        report(
            "headroom_adam4bit_cuda",
            14.0,
            time_steps(&cuda, &mut |_| adam4.step().expect("step")),
        );
        drop(adam4);
    }

    // The raw-buffer layer over the same parameters and gradients, with state tensors of its
    // own (kept in `state` while it runs).
    let (raw_fused, raw_adam8bit) = ("headroom_raw_fused_cuda", "headroom_raw_adam8bit_cuda");
    if !wanted(raw_fused) && !wanted(raw_adam8bit) {
        return;
    }
    let address = |t: &Tensor| t.buffer().address();
    let mut state = Vec::new();
    let mut raw = Vec::new();
    let mut raw8 = Vec::new();
    for p in &params {
        let zeros = |shape: &[usize], dtype| Tensor::zeros(&backend, shape, dtype).expect("memory");
        let f32 = headroom_autograd_core::DType::F32;
        let u8 = headroom_autograd_core::DType::U8;
        let (m, v) = (zeros(&[PER_TENSOR], f32), zeros(&[PER_TENSOR], f32));
        let (c1, c2) = (zeros(&[PER_TENSOR], u8), zeros(&[PER_TENSOR], u8));
        let blocks = n_blocks(PER_TENSOR);
        let (a1, a2) = (zeros(&[blocks], f32), zeros(&[blocks], f32));
        let grad = p.grad().expect("grad");
        raw.push(DeviceAdamParam {
            param: address(p),
            grad: address(&grad),
            exp_avg: address(&m),
            exp_avg_sq: address(&v),
            max_exp_avg_sq: None,
            len: PER_TENSOR,
        });
        raw8.push(DeviceAdam8bitParam {
            param: address(p),
            grad: address(&grad),
            state1: address(&c1),
            state2: address(&c2),
            absmax1: address(&a1),
            absmax2: address(&a2),
            len: PER_TENSOR,
        });
        state.extend([m, v, c1, c2, a1, a2]);
    }
    if wanted(raw_fused) {
        // SAFETY: every address is a live tensor of `cuda` (parameters, their gradients and the
        // tensors in `state`), alive until the end of main.
        let mut fused = unsafe { CudaFusedAdam::new(cuda.clone(), &raw) }.expect("kernel");
        report(
            raw_fused,
            28.0,
            time_steps(&cuda, &mut |t| fused.step(&cfg, t, None).expect("step")),
        );
    }
    if wanted(raw_adam8bit) {
        // SAFETY: as above.
        let mut eight = unsafe { CudaAdam8bit::new(cuda.clone(), &raw8) }.expect("kernel");
        report(
            raw_adam8bit,
            16.0,
            time_steps(&cuda, &mut |t| eight.step(&cfg8, t, None).expect("step")),
        );
    }
    drop(state);
}
