//! The CUDA backend against the CPU backend, primitive by primitive, on fresh random inputs with
//! poisoned outputs: unary and binary ops in f32, f64, f16 and bf16 (contiguous, broadcast and
//! transposed operands), fill, copies between every pair of dtypes, and linear layers through
//! cuBLASLt (bias and GELU forward, weight and bias gradients backward, and the fallbacks), the
//! fused Llama ops (RMSNorm, SwiGLU, rotary embedding) and the fp8 quantize and GEMM. Each
//! test is marked `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`, and
//! fails without a device where `HEADROOM_REQUIRE_GPU=1` is set (testkit's GPU gate).
//!
//! One module per family of primitives; this file holds what they share: the two backends, the
//! inputs, poisoned outputs and the comparison against the CPU within each dtype's tolerance.
#![cfg(feature = "cuda")]

mod attention;
mod device_checks;
mod elementwise;
mod float8_ops;
mod indexing_and_losses;
mod linear;
mod llama_ops;
mod matmul;
mod reductions;

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, Buffer, DType, Layout, View};
use headroom_ops_cpu::CpuBackend;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::Xorshift;

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// The GPU and the CPU backend, or `None` after the GPU gate's skip notice.
fn backends() -> Option<(BackendRef, BackendRef)> {
    let cuda = cuda_or_skip(CudaBackend::new(0))?;
    Some((cuda as BackendRef, CpuBackend::new_ref()))
}

/// A CUDA backend of the test's own, opened afresh so that what the test sets or counts on it
/// (TF32, the fallback count, the BLAS state) reaches no other test: as itself and as a
/// `BackendRef`, with the CPU backend and a generator seeded with `seed`; or `None` after the GPU
/// gate's skip notice.
fn own_backends(seed: u64) -> Option<(Arc<CudaBackend>, BackendRef, BackendRef, Xorshift)> {
    let cuda = cuda_or_skip(CudaBackend::new(0))?;
    let gpu: BackendRef = cuda.clone();
    Some((cuda, gpu, CpuBackend::new_ref(), Xorshift::from_state(seed)))
}

/// Each float dtype with the dtype of its per-row statistics (f32 for the 16-bit ones).
const WITH_STATS_DTYPE: [(DType, DType); 4] = [
    (DType::F32, DType::F32),
    (DType::F64, DType::F64),
    (DType::F16, DType::F32),
    (DType::BF16, DType::F32),
];

/// [`backends`] and a generator seeded with `seed` for the test's inputs.
fn seeded_backends(seed: u64) -> Option<(BackendRef, BackendRef, Xorshift)> {
    let (gpu, cpu) = backends()?;
    Some((gpu, cpu, Xorshift::from_state(seed)))
}

fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(values.len() * dtype.size_in_bytes());
    for &v in values {
        match dtype {
            DType::F32 => bytes.extend((v as f32).to_le_bytes()),
            DType::F64 => bytes.extend(v.to_le_bytes()),
            DType::F16 => bytes.extend(half::f16::from_f64(v).to_le_bytes()),
            DType::BF16 => bytes.extend(half::bf16::from_f64(v).to_le_bytes()),
            DType::I64 => bytes.extend((v as i64).to_le_bytes()),
            DType::I32 => bytes.extend((v as i32).to_le_bytes()),
            DType::U8 => bytes.push(v as u8),
            DType::Bool => bytes.push(u8::from(v != 0.0)),
            DType::F8E4M3 => bytes.push(float8::F8E4M3::from_f64(v).to_bits()),
            DType::F8E5M2 => bytes.push(float8::F8E5M2::from_f64(v).to_bits()),
        }
    }
    bytes
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks(dtype.size_in_bytes())
        .map(|c| match dtype {
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            DType::F16 => half::f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::BF16 => half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::U8 | DType::Bool => c[0] as f64,
            DType::F8E4M3 => float8::F8E4M3::from_bits(c[0]).to_f64(),
            DType::F8E5M2 => float8::F8E5M2::from_bits(c[0]).to_f64(),
        })
        .collect()
}

/// A buffer of `values` on `backend`.
fn upload(backend: &BackendRef, dtype: DType, values: &[f64]) -> Buffer {
    let bytes = encode(dtype, values);
    let buffer = Buffer::new(backend, bytes.len()).unwrap();
    backend.write_host(&buffer, 0, &bytes).unwrap();
    buffer
}

/// A buffer of `n` elements poisoned with NaN (or 0x5a bytes for integer types).
fn poisoned(backend: &BackendRef, dtype: DType, n: usize) -> Buffer {
    let bytes = if matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        encode(dtype, &vec![f64::NAN; n])
    } else {
        vec![0x5a; n * dtype.size_in_bytes()]
    };
    let buffer = Buffer::new(backend, bytes.len()).unwrap();
    backend.write_host(&buffer, 0, &bytes).unwrap();
    buffer
}

/// `buffer`'s elements of `dtype` where `layout` puts them.
fn view<'a>(buffer: &'a Buffer, layout: &'a Layout, dtype: DType) -> View<'a> {
    View {
        buffer,
        layout,
        dtype,
    }
}

fn download(backend: &BackendRef, dtype: DType, buffer: &Buffer) -> Vec<f64> {
    let mut bytes = vec![0u8; buffer.len_bytes()];
    backend.read_host(buffer, 0, &mut bytes).unwrap();
    decode(dtype, &bytes)
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// ‖gpu − cpu‖ / ‖cpu‖ over all elements; NaN anywhere fails.
fn check(what: &str, dtype: DType, gpu: &[f64], cpu: &[f64]) {
    assert_eq!(gpu.len(), cpu.len());
    assert!(
        gpu.iter().all(|v| v.is_finite()),
        "{what} {dtype:?}: non-finite output (unwritten?)"
    );
    let diff: f64 = gpu
        .iter()
        .zip(cpu)
        .map(|(g, c)| (g - c) * (g - c))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = cpu.iter().map(|c| c * c).sum::<f64>().sqrt().max(1e-30);
    let error = diff / norm;
    assert!(
        error <= tolerance(dtype),
        "{what} {dtype:?}: relative error {error:e}"
    );
}

/// Inputs valid for every op: positive for log, sqrt and pow, negative ones for relu otherwise.
fn input(random: &mut Xorshift, op_needs_positive: bool, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            if op_needs_positive {
                random.next_f64_in(0.1, 3.0)
            } else {
                random.next_f64_in(-3.0, 3.0)
            }
        })
        .collect()
}

/// Runs `f` on both backends and checks the GPU's result against the CPU's.
fn compare(
    what: &str,
    dtype: DType,
    gpu: &BackendRef,
    cpu: &BackendRef,
    f: impl Fn(&BackendRef) -> Vec<f64>,
) {
    let (on_gpu, on_cpu) = (f(gpu), f(cpu));
    check(what, dtype, &on_gpu, &on_cpu);
}
