//! What the CUDA optimizer tests share: seeded random values, tensors of f32, bf16 or f16 made
//! from them (rounded on the host, to nearest-even), and a tensor's elements as little-endian
//! bytes, so runs on two devices compare bit for bit.

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_optim::kernels::{bf16, f16};
use headroom_testkit::inputs::Xorshift;

/// `n` values uniform in `[-scale/2, scale/2)` from testkit's xorshift stream of `seed`.
pub(crate) fn random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut stream = Xorshift::new(seed);
    (0..n)
        .map(|_| stream.next_signed_f32() * 0.5 * scale)
        .collect()
}

/// A tensor's elements as little-endian bytes.
#[allow(dead_code, reason = "the memory tests compare no bytes")]
pub(crate) fn raw_bytes(tensor: &Tensor) -> Vec<u8> {
    match tensor.dtype() {
        DType::U8 => tensor.to_vec::<u8>().unwrap(),
        DType::BF16 => tensor
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => tensor
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        _ => bytes(&tensor.to_vec::<f32>().unwrap()),
    }
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

/// `values` as little-endian bytes.
fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}
