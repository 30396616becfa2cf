//! A GradScaler's overflow check and unscale on CUDA (`non_finite_check_and_unscale_`, one launch
//! per dtype over every gradient) against the host's portable form, bit for bit. Marked
//! `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

mod cuda_tensors;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_optim::non_finite_check_and_unscale_;

use cuda_tensors::{random, raw_bytes, shared_cuda_and_cpu, tensor_of};

/// `(found_inf, unscaled gradients as bytes)` of one `non_finite_check_and_unscale_` call on
/// `backend` over `grads` (values, dtype; each gradient a view from element 1 of a buffer one
/// longer when `offset`, so its address is off every vector width), the flag starting at
/// `found_before`.
fn checked(
    backend: &BackendRef,
    grads: &[(Vec<f32>, DType)],
    offset: bool,
    found_before: f32,
    inv_scale: Option<f32>,
) -> (f32, Vec<Vec<u8>>) {
    let tensors: Vec<Tensor> = grads
        .iter()
        .map(|(values, dtype)| {
            if !offset {
                return tensor_of(backend, values, &[values.len()], *dtype);
            }
            let padded: Vec<f32> = std::iter::once(0.0).chain(values.iter().copied()).collect();
            tensor_of(backend, &padded, &[padded.len()], *dtype)
                .narrow(0, 1, values.len())
                .unwrap()
        })
        .collect();
    let found_inf = Tensor::from_slice(backend, &[found_before], &[1]).unwrap();
    let inv_scale = inv_scale.map(|s| Tensor::from_slice(backend, &[s], &[1]).unwrap());
    non_finite_check_and_unscale_(&tensors, &found_inf, inv_scale.as_ref()).unwrap();
    let found = found_inf.to_vec::<f32>().unwrap()[0];
    (found, tensors.iter().map(raw_bytes).collect())
}

/// The overflow check on CUDA (one launch per dtype over every gradient) against the host's
/// portable form: the same flag for clean gradients, a NaN or infinity first, in the middle or
/// last (in a block past the first of a large gradient, in tails off every vector width, in
/// views off the vector alignment, in one dtype of a mixed call), an accumulated flag kept, and
/// the unscaled gradients equal to the bit.
#[test]
#[ignore = "needs a CUDA device"]
fn the_overflow_check_and_unscale_on_cuda_equals_the_host() {
    let Some((cuda, cpu)) = shared_cuda_and_cpu() else {
        return;
    };
    let lens = [37, 200_003, 300 * 257, 1, 0, 5000];
    let grads_of = |dtype: DType| -> Vec<(Vec<f32>, DType)> {
        lens.iter()
            .enumerate()
            .map(|(idx, &n)| (random(idx as u64 + 7, n, 6e4), dtype))
            .collect()
    };
    let mixed: Vec<(Vec<f32>, DType)> = [DType::F32, DType::BF16, DType::F16]
        .iter()
        .flat_map(|&dtype| grads_of(dtype))
        .collect();
    let inv_scale = (1.0f64 / 65536.0) as f32;
    for (name, grads) in [
        ("f32", grads_of(DType::F32)),
        ("bf16", grads_of(DType::BF16)),
        ("f16", grads_of(DType::F16)),
        ("mixed", mixed),
    ] {
        for offset in [false, true] {
            for scale in [None, Some(inv_scale)] {
                let at = format!("{name} offset {offset} scale {scale:?}");
                let on_cuda = checked(&cuda, &grads, offset, 0.0, scale);
                let on_cpu = checked(&cpu, &grads, offset, 0.0, scale);
                assert_eq!(on_cuda.0, 0.0, "{at}: clean gradients");
                assert_eq!(on_cuda, on_cpu, "{at}");
                assert_eq!(checked(&cuda, &grads, offset, 1.0, scale).0, 1.0, "{at}");
                let last = grads.len() - 1;
                let big = grads.iter().position(|(v, _)| v.len() == 200_003).unwrap();
                for (tensor, elem, value) in [
                    (0, 0, f32::NAN),
                    (big, 150_001, f32::INFINITY),
                    (last, grads[last].0.len() - 1, f32::NEG_INFINITY),
                ] {
                    let mut poisoned = grads.clone();
                    poisoned[tensor].0[elem] = value;
                    let (found, _) = checked(&cuda, &poisoned, offset, 0.0, scale);
                    assert_eq!(found, 1.0, "{at}: {value} at {elem} of gradient {tensor}");
                }
            }
        }
    }
}
