//! Fused Adam on the GPU against the CPU's fused kernel: bit for bit, with gradient unscaling
//! and the found-inf skip. Prints a skip notice (and passes) without a CUDA device.
#![cfg(feature = "cuda")]

use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{CudaFusedAdam, DeviceAdamParam};
use headroom_optim::kernels::{adam_fused, AdamBuffers, AdamConfig, GradScaling};

fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn gpu_fused_adam_equals_the_cpu_bit_for_bit() {
    let backend = match CudaBackend::new(0) {
        Ok(backend) => backend,
        Err(err) => {
            println!("skipped: {err}");
            return;
        }
    };
    // Sizes cover a tail that is not a multiple of 4 and a chunk boundary (65,536 elements).
    let sizes = [37usize, 5000, 70_001];
    for cfg in [
        AdamConfig {
            weight_decay: 0.01,
            ..AdamConfig::adamw()
        },
        AdamConfig {
            weight_decay: 0.01,
            lr: 3e-3,
            ..AdamConfig::adam()
        },
    ] {
        let mut host: Vec<[Vec<f32>; 4]> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let i = i as u64;
                [
                    random(i + 1, n, 2.0),
                    random(i + 100, n, 1.0),
                    vec![0.0; n],
                    vec![0.0; n],
                ]
            })
            .collect();
        let grad_scale = 1024.0f32;
        let mut device = Vec::new();
        let mut params = Vec::new();
        for buffers in &host {
            let scaled: Vec<f32> = buffers[1].iter().map(|g| g * grad_scale).collect();
            let uploads: Vec<_> = [&buffers[0], &scaled, &buffers[2], &buffers[3]]
                .iter()
                .map(|values| backend.upload(&bytes(values)).unwrap())
                .collect();
            params.push(DeviceAdamParam {
                param: uploads[0].address(),
                grad: uploads[1].address(),
                exp_avg: uploads[2].address(),
                exp_avg_sq: uploads[3].address(),
                max_exp_avg_sq: None,
                len: buffers[0].len(),
            });
            device.push(uploads);
        }
        let scale = backend.upload(&bytes(&[grad_scale])).unwrap();
        let no_inf = backend.upload(&bytes(&[0.0])).unwrap();
        let inf = backend.upload(&bytes(&[1.0])).unwrap();
        // SAFETY: every address is a live allocation of `backend` holding `len` f32s, kept in
        // `device` until the end of the test.
        let adam = unsafe { CudaFusedAdam::new(backend.clone(), &params) }.unwrap();
        for step in 1..=3 {
            adam.step(&cfg, step, Some(scale.address()), Some(no_inf.address()))
                .unwrap();
            // An overflowed step changes nothing.
            adam.step(&cfg, step, Some(scale.address()), Some(inf.address()))
                .unwrap();
            for buffers in &mut host {
                let [p, g, m, v] = buffers;
                let bufs = AdamBuffers {
                    param: p,
                    grad: g,
                    exp_avg: m,
                    exp_avg_sq: v,
                    max_exp_avg_sq: None,
                };
                adam_fused(&cfg, step, bufs, GradScaling::default()).unwrap();
            }
        }
        for (buffers, uploads) in host.iter().zip(&device) {
            // Parameter, first and second moment (the device gradient holds scaled values).
            for index in [0, 2, 3] {
                let want = bytes(&buffers[index]);
                let mut got = vec![0u8; want.len()];
                // SAFETY: the allocation is live and holds that many bytes.
                unsafe { backend.download(uploads[index].address(), &mut got) }.unwrap();
                assert_eq!(got, want, "GPU and CPU differ in buffer {index} ({cfg:?})");
            }
        }
        drop(adam);
        for allocation in device.into_iter().flatten().chain([scale, no_inf, inf]) {
            backend.allocator().free(allocation).unwrap();
        }
    }
}
