//! One fused Adam step on 1e9 fp32 parameters in 160 tensors of 6.25 M on a CUDA device: the
//! setting of PyTorch's reference (`adam_step_1e9` in the project's anchors). Prints one JSON
//! line per measurement: median step time of 5, effective bandwidth at 28 bytes per parameter,
//! and the extra memory the step allocates. Prints a skip notice without a CUDA device.

use std::time::Instant;

use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{CudaFusedAdam, DeviceAdamParam};
use headroom_optim::kernels::AdamConfig;

const N_TENSORS: usize = 160;
const PER_TENSOR: usize = 6_250_000;

fn main() {
    let backend = match CudaBackend::new(0) {
        Ok(backend) => backend,
        Err(err) => {
            println!("skipped: {err}");
            return;
        }
    };
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let random: Vec<u8> = (0..PER_TENSOR)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5).to_le_bytes()
        })
        .collect();
    let zeros = vec![0u8; PER_TENSOR * 4];
    let mut allocations = Vec::new();
    let mut params = Vec::new();
    for _ in 0..N_TENSORS {
        let upload = |data: &[u8]| backend.upload(data).expect("device memory");
        let (p, g, m, v) = (
            upload(&random),
            upload(&random),
            upload(&zeros),
            upload(&zeros),
        );
        params.push(DeviceAdamParam {
            param: p.address(),
            grad: g.address(),
            exp_avg: m.address(),
            exp_avg_sq: v.address(),
            max_exp_avg_sq: None,
            len: PER_TENSOR,
        });
        allocations.extend([p, g, m, v]);
    }
    // SAFETY: every address is a live allocation of `backend` with PER_TENSOR f32s, kept in
    // `allocations` until the end.
    let adam = unsafe { CudaFusedAdam::new(backend.clone(), &params) }.expect("kernel");
    let cfg = AdamConfig {
        lr: 1e-4,
        ..AdamConfig::adam()
    };
    adam.step(&cfg, 1, None, None).expect("step");
    backend.synchronize().expect("device");
    backend.allocator().reset_peak_stats();
    let base = backend.allocator().memory_allocated();
    let mut times = Vec::new();
    for step in 2..7 {
        let start = Instant::now();
        adam.step(&cfg, step, None, None).expect("step");
        backend.synchronize().expect("device");
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    let extra = backend.allocator().max_memory_allocated() - base;
    let n = (N_TENSORS * PER_TENSOR) as f64;
    println!(
        "{{\"case\": \"adam_step_1e9\", \"impl\": \"headroom_fused_cuda\", \"ms\": {ms:.3}, \"GBps\": {:.1}, \"step_extra_bytes\": {extra}, \"times_ms\": {times:?}}}",
        28.0 * n / (ms / 1e3) / 1e9
    );
    drop(adam);
    for allocation in allocations {
        backend.allocator().free(allocation).expect("live");
    }
}
