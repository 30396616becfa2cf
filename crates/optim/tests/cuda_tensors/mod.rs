//! What the CUDA optimizer tests share: the shared CUDA backend with the CPU one, seeded random values, tensors of f32, bf16 or f16 made
//! from them (rounded on the host, to nearest-even), and a tensor's elements as little-endian
//! bytes, so runs on two devices compare bit for bit.

use headroom_autograd_core::{BackendRef, DType, Element, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_optim::kernels::{bf16, f16, GradScaling};
use headroom_optim::{DeviceGradScaling, Optimizer, Scaling, StepParams};
use headroom_testkit::gpu::shared_or_skip;

/// The CUDA backend the test binary's tests share (testkit's `shared_or_skip`) and the CPU
/// backend, or `None` after the GPU gate's skip notice.
#[track_caller]
#[allow(dead_code, reason = "the memory tests open backends of their own")]
pub(crate) fn shared_cuda_and_cpu() -> Option<(BackendRef, BackendRef)> {
    let cuda = shared_or_skip(|| CudaBackend::new(0))?;
    Some((cuda, CpuBackend::new_ref()))
}

/// `n` values uniform in `[-scale/2, scale/2)` from testkit's xorshift stream of `seed`.
pub(crate) fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    headroom_testkit::inputs::centered_f32(n, scale, seed)
}

/// A tensor's elements as little-endian bytes.
#[allow(dead_code, reason = "the memory tests compare no bytes")]
pub(crate) fn raw_bytes(tensor: &Tensor) -> Vec<u8> {
    match tensor.dtype() {
        DType::U8 => tensor.to_vec::<u8>().unwrap(),
        DType::BF16 => le_bytes(tensor, bf16::to_le_bytes),
        DType::F16 => le_bytes(tensor, f16::to_le_bytes),
        _ => le_bytes(tensor, f32::to_le_bytes),
    }
}

/// `tensor`'s elements read as `T`, each as its little-endian bytes.
fn le_bytes<T: Element, const N: usize>(tensor: &Tensor, to_le: fn(T) -> [u8; N]) -> Vec<u8> {
    tensor
        .to_vec::<T>()
        .unwrap()
        .into_iter()
        .flat_map(to_le)
        .collect()
}

/// `values` as a tensor of `dtype` (rounded on the host, to nearest-even).
pub(crate) fn tensor_of(
    backend: &BackendRef,
    values: &[f32],
    shape: &[usize],
    dtype: DType,
) -> Tensor {
    match dtype {
        DType::BF16 => {
            let values: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            Tensor::from_slice(backend, &values, shape).unwrap()
        }
        DType::F16 => {
            let values: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            Tensor::from_slice(backend, &values, shape).unwrap()
        }
        _ => Tensor::from_slice(backend, values, shape).unwrap(),
    }
}

/// One step of `optimizer` under a GradScaler of scale 1024 whose found-inf flag is `overflow`:
/// host values (`Scaling::Host`) when `backend` is `cpu`, one-element device tensors
/// (`Scaling::Device`, skipped and counted on the device) otherwise.
#[allow(dead_code, reason = "only the GradScaler tests step under a scale")]
pub(crate) fn scaled_step(
    optimizer: &mut dyn Optimizer,
    backend: &BackendRef,
    cpu: &BackendRef,
    overflow: bool,
) {
    let flag = if overflow { 1.0f32 } else { 0.0 };
    if std::sync::Arc::ptr_eq(backend, cpu) {
        let scaling = GradScaling {
            grad_scale: Some(1024.0),
            found_inf: Some(flag),
        };
        optimizer
            .step_with(StepParams::All, Scaling::Host(scaling))
            .unwrap();
    } else {
        device_scaled_step(optimizer, backend, overflow);
    }
}

/// One step of `optimizer` under a GradScaler of scale 1024 whose found-inf flag is `overflow`,
/// both one-element tensors on `backend` (`Scaling::Device`: skipped and counted where they live).
#[allow(dead_code, reason = "only the GradScaler tests step under a scale")]
pub(crate) fn device_scaled_step(
    optimizer: &mut dyn Optimizer,
    backend: &BackendRef,
    overflow: bool,
) {
    let flag = if overflow { 1.0f32 } else { 0.0 };
    let scaling = DeviceGradScaling {
        grad_scale: Some(Tensor::from_slice(backend, &[1024.0f32], &[1]).unwrap()),
        found_inf: Some(Tensor::from_slice(backend, &[flag], &[1]).unwrap()),
    };
    optimizer
        .step_with(StepParams::All, Scaling::Device(&scaling))
        .unwrap();
}
