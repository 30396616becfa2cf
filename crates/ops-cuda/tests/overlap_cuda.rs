//! The soundness rules on the CUDA backend (issue 14): writes into views that reach an element
//! twice or partially overlap an input are typed errors before any kernel runs; views outside
//! their buffer and buffers of another device (a CUDA buffer handed to the CPU backend, a host
//! buffer to the CUDA one) are refused; disjoint interleaved views (a packed q/k/v projection and
//! its gradients, columns of one matrix) stay allowed and agree with the CPU. The small kernels
//! run here (elementwise in place, reductions, softmax, layer norm, attention) are also what
//! `compute-sanitizer --tool racecheck` checks on the GPU machine. A malformed
//! `HEADROOM_ALLOC_CONF` is a configuration error, not a missing device (a CPU test). The others
//! are marked `#[ignore = "needs a CUDA device"]` and run with `--include-ignored`.
#![cfg(feature = "cuda")]

use std::sync::{Mutex, MutexGuard, PoisonError};

use headroom_autograd_core::{
    layer_norm, scaled_dot_product_attention, BackendRef, DType, Layout, Tensor, TensorError, View,
};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::{CudaBackend, CudaError};
use headroom_testkit::gpu::backend_or_skip;

/// Held while a test reads or changes `HEADROOM_ALLOC_CONF` (opening a backend reads it).
fn environment() -> MutexGuard<'static, ()> {
    static ENV: Mutex<()> = Mutex::new(());
    ENV.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The device, opened while no test changes the environment it reads.
fn cuda() -> Option<BackendRef> {
    let _env = environment();
    backend_or_skip(CudaBackend::new(0))
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7 + seed * 13) % 23) as f32 - 11.0) / 8.0)
        .collect()
}

fn close(a: &[f32], b: &[f32], tolerance: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tolerance * (1.0 + y.abs()))
}

#[test]
fn a_malformed_alloc_conf_is_a_configuration_error() {
    let _env = environment();
    let saved = std::env::var_os("HEADROOM_ALLOC_CONF");
    std::env::set_var("HEADROOM_ALLOC_CONF", "expandable_segments:Maybe");
    let res = CudaBackend::new(0);
    match saved {
        Some(value) => std::env::set_var("HEADROOM_ALLOC_CONF", value),
        None => std::env::remove_var("HEADROOM_ALLOC_CONF"),
    }
    let err = res.expect_err("a malformed HEADROOM_ALLOC_CONF");
    assert!(matches!(err, CudaError::Config { .. }), "{err}");
    assert!(err.to_string().contains("expandable_segments"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn overlapping_writes_are_refused_before_any_kernel_runs() {
    let Some(gpu) = cuda() else { return };
    let base = Tensor::zeros(&gpu, &[4096], DType::F32).unwrap();
    let expanded = base.expand(&[64, 4096]).unwrap();
    assert!(matches!(
        expanded.fill_(1.0),
        Err(TensorError::Overlap { .. })
    ));
    assert!(matches!(
        gpu.fill(expanded.view(), 1.0),
        Err(TensorError::Overlap { op: "fill", .. })
    ));
    let n = 256;
    let x = Tensor::from_slice(&gpu, &values(n * n, 1), &[n, n]).unwrap();
    let before = x.to_vec::<f32>().unwrap();
    assert!(matches!(
        x.add_(&x.t().unwrap()),
        Err(TensorError::Overlap { op: "add_", .. })
    ));
    let transposed = x.t().unwrap();
    assert!(matches!(
        gpu.binary(
            headroom_autograd_core::BinaryOp::Add,
            x.view(),
            transposed.view(),
            x.view()
        ),
        Err(TensorError::Overlap { op: "binary", .. })
    ));
    assert_eq!(x.to_vec::<f32>().unwrap(), before, "nothing written");
    // The same view in and out runs (one thread per element reads, then writes).
    x.add_(&x).unwrap();
    let doubled: Vec<f32> = before.iter().map(|v| 2.0 * v).collect();
    assert_eq!(x.to_vec::<f32>().unwrap(), doubled);
    // Disjoint columns of one matrix: the odd ones copied over the even ones.
    let even = x.as_strided(&[n, n / 2], &[n, 2], 0).unwrap();
    let odd = x.as_strided(&[n, n / 2], &[n, 2], 1).unwrap();
    even.copy_(&odd).unwrap();
    let after = x.to_vec::<f32>().unwrap();
    assert!((0..n * n).step_by(2).all(|i| after[i] == after[i + 1]));
}

#[test]
#[ignore = "needs a CUDA device"]
fn buffers_of_another_device_and_views_past_their_buffer_are_refused() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::new_ref();
    let on_gpu = Tensor::ones(&gpu, &[1024], DType::F32).unwrap();
    let on_cpu = Tensor::zeros(&cpu, &[1024], DType::F32).unwrap();
    // The CPU backend would have read the device address as host memory.
    let err = cpu.copy(on_gpu.view(), on_cpu.view()).unwrap_err();
    assert!(err.to_string().contains("another backend"), "{err}");
    let mut host = [0u8; 16];
    assert!(cpu.read_host(on_gpu.buffer(), 0, &mut host).is_err());
    assert!(cpu.fill(on_gpu.view(), 2.0).is_err());
    // And the CUDA backend a host address as device memory.
    assert!(gpu.copy(on_cpu.view(), on_gpu.view()).is_err());
    assert!(gpu.write_host(on_cpu.buffer(), 0, &host).is_err());
    assert!(on_cpu.copy_(&on_gpu).is_err(), "ops check devices first");
    // A hand-built view one element past the end.
    let long = Layout::contiguous(&[1025]);
    let past = View {
        layout: &long,
        ..on_gpu.view()
    };
    assert!(matches!(
        gpu.fill(past, 3.0),
        Err(TensorError::InvalidArgument { op: "fill", .. })
    ));
    assert!(on_gpu.to_vec::<f32>().unwrap().iter().all(|&v| v == 1.0));
    assert!(on_cpu.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    // Another CUDA backend's buffer: another allocator.
    let other = {
        let _env = environment();
        CudaBackend::new(0).unwrap() as BackendRef
    };
    let theirs = Tensor::zeros(&other, &[1024], DType::F32).unwrap();
    assert!(gpu.copy(theirs.view(), on_gpu.view()).is_err());
}

/// Reductions, softmax, layer norm and attention (forward and backward, with the packed q/k/v
/// gradients written as three interleaved views of one buffer) on small shapes, against the
/// CPU: the shared-memory kernels racecheck looks at, and the interleaved outputs the overlap
/// check must accept.
#[test]
#[ignore = "needs a CUDA device"]
fn shared_memory_kernels_and_interleaved_outputs_agree_with_the_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::new_ref();
    let (batch, seq, heads, head_dim) = (2, 33, 4, 16);
    let width = heads * head_dim;
    let run = |backend: &BackendRef| -> Vec<Vec<f32>> {
        let x = Tensor::from_slice(
            backend,
            &values(batch * seq * width, 2),
            &[batch, seq, width],
        )
        .unwrap();
        let qkv_values = values(batch * seq * 3 * width, 3);
        let qkv = Tensor::from_slice(backend, &qkv_values, &[batch, seq, 3 * width]).unwrap();
        qkv.requires_grad_(true).unwrap();
        let w = Tensor::from_slice(backend, &values(width, 4), &[width]).unwrap();
        let b = Tensor::from_slice(backend, &values(width, 5), &[width]).unwrap();
        w.requires_grad_(true).unwrap();
        let heads_of = |i: usize| {
            qkv.narrow(2, i * width, width)
                .and_then(|t| t.reshape(&[batch, seq, heads, head_dim]))
                .and_then(|t| t.transpose(1, 2))
                .unwrap()
        };
        let attended =
            scaled_dot_product_attention(&heads_of(0), &heads_of(1), &heads_of(2), true, None)
                .unwrap();
        let normed = layer_norm(&x, &[width], Some(&w), Some(&b), 1e-5).unwrap();
        let probs = normed.softmax(-1).unwrap();
        let loss = attended
            .sum_all()
            .unwrap()
            .add(&probs.mul(&probs).unwrap().sum_all().unwrap())
            .unwrap();
        loss.backward().unwrap();
        let row_sums = normed.sum(&[-1], false).unwrap();
        vec![
            attended.to_vec::<f32>().unwrap(),
            probs.to_vec::<f32>().unwrap(),
            row_sums.to_vec::<f32>().unwrap(),
            qkv.grad().unwrap().to_vec::<f32>().unwrap(),
            w.grad().unwrap().to_vec::<f32>().unwrap(),
        ]
    };
    let (on_gpu, on_cpu) = (run(&gpu), run(&cpu));
    for (idx, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
        assert!(close(g, c, 1e-3), "output {idx} differs from the CPU's");
    }
}
