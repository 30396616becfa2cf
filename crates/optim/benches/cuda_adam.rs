//! One optimizer step on 1e9 fp32 parameters in 160 tensors of 6.25 M on a CUDA device, fused
//! Adam and 8-bit blockwise Adam: the setting of PyTorch's reference (`adam_step_1e9` in the
//! project's anchors). Prints one JSON line per implementation: median step time of 5, effective
//! bandwidth (28 bytes per parameter for fp32 Adam, 16 for 8-bit) and the extra memory the step
//! allocates. Prints a skip notice without a CUDA device.

use std::time::Instant;

use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{CudaAdam8bit, CudaFusedAdam, DeviceAdam8bitParam, DeviceAdamParam};
use headroom_optim::kernels::{n_blocks, Adam8bitConfig, AdamConfig};

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
    let run = |step: &mut dyn FnMut(u64)| -> (f64, u64, Vec<f64>) {
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
        times.sort_by(f64::total_cmp);
        (
            times[times.len() / 2],
            backend.allocator().max_memory_allocated() - base,
            times,
        )
    };
    let n = (N_TENSORS * PER_TENSOR) as f64;
    let (ms, extra, times) = run(&mut |t| adam.step(&cfg, t, None, None).expect("step"));
    println!(
        "{{\"case\": \"adam_step_1e9\", \"impl\": \"headroom_fused_cuda\", \"ms\": {ms:.3}, \"GBps\": {:.1}, \"step_extra_bytes\": {extra}, \"times_ms\": {times:?}}}",
        28.0 * n / (ms / 1e3) / 1e9
    );
    drop(adam);
    // 8-bit: the fp32 moments go back; u8 codes and per-block absmax take their place.
    for pair in allocations.chunks_mut(4) {
        for moment in pair[2..].iter_mut() {
            let replacement = backend.upload(&[]).expect("device memory");
            let old = std::mem::replace(moment, replacement);
            backend.allocator().free(old).expect("live");
        }
    }
    let code_zeros = vec![0u8; PER_TENSOR];
    let absmax_zeros = vec![0u8; n_blocks(PER_TENSOR) * 4];
    let mut params8 = Vec::new();
    let mut states = Vec::new();
    for pair in allocations.chunks(4) {
        let upload = |data: &[u8]| backend.upload(data).expect("device memory");
        let (s1, s2) = (upload(&code_zeros), upload(&code_zeros));
        let (a1, a2) = (upload(&absmax_zeros), upload(&absmax_zeros));
        params8.push(DeviceAdam8bitParam {
            param: pair[0].address(),
            grad: pair[1].address(),
            state1: s1.address(),
            state2: s2.address(),
            absmax1: a1.address(),
            absmax2: a2.address(),
            len: PER_TENSOR,
        });
        states.extend([s1, s2, a1, a2]);
    }
    // SAFETY: as above, for the parameter, gradient, code and absmax allocations.
    let adam8 = unsafe { CudaAdam8bit::new(backend.clone(), &params8) }.expect("kernel");
    let cfg8 = Adam8bitConfig {
        lr: 1e-4,
        ..Adam8bitConfig::adam()
    };
    let (ms, extra, times) = run(&mut |t| adam8.step(&cfg8, t, None, None).expect("step"));
    println!(
        "{{\"case\": \"adam_step_1e9\", \"impl\": \"headroom_adam8bit_cuda\", \"ms\": {ms:.3}, \"GBps\": {:.1}, \"step_extra_bytes\": {extra}, \"times_ms\": {times:?}}}",
        16.0 * n / (ms / 1e3) / 1e9
    );
    drop(adam8);
    for allocation in states {
        backend.allocator().free(allocation).expect("live");
    }
    for allocation in allocations {
        backend.allocator().free(allocation).expect("live");
    }
}
