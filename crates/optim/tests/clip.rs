//! Gradient clipping against PyTorch 2.11 (`testdata/clip_golden.safetensors`, made from the
//! gradients of `optim_golden.safetensors`): `clip_grad_norm_`'s total norm within 2e-7 relative
//! of both the CPU and the CUDA golden, the clipped gradients within 2 ulps, `clip_grad_value_`
//! exactly — on the CPU and, with the `cuda` feature and a device, on CUDA (which must also agree
//! with the CPU). Plus `error_if_nonfinite` (a typed error, gradients untouched), bf16 gradients
//! (within one bf16 rounding of the f32 result), many tensors of mixed dtypes in one call, and the
//! typed errors for what clipping cannot take.

use std::collections::HashMap;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{bf16, f16};
use headroom_optim::{clip_grad_norm_, clip_grad_value_, NormType, OptimError};
use headroom_testkit::golden::testdata;
use headroom_testkit::ulps::max_ulps;
use safetensors::SafeTensors;

const NAMES: [&str; 3] = ["a", "b", "c"];
/// The relative tolerance of the total norm: about 2 ulps (PyTorch's two devices reduce in other
/// orders).
const NORM_TOLERANCE: f64 = 2e-7;
/// The largest distance of a clipped gradient from PyTorch's, in ulps.
const GRAD_ULPS: u32 = 2;

/// Every f32 and f64 tensor of a safetensors file, by name, as f64 values (f32 exactly).
fn load(name: &str) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = testdata(name);
    let file = SafeTensors::deserialize(&bytes).expect(name);
    file.tensors()
        .into_iter()
        .map(|(key, view)| {
            let values = match view.dtype() {
                safetensors::Dtype::F64 => view
                    .data()
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                _ => view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())))
                    .collect(),
            };
            (key, (view.shape().to_vec(), values))
        })
        .collect()
}

struct Golden {
    optim: HashMap<String, (Vec<usize>, Vec<f64>)>,
    clip: HashMap<String, (Vec<usize>, Vec<f64>)>,
}

impl Golden {
    fn load() -> Golden {
        Golden {
            optim: load("optim_golden.safetensors"),
            clip: load("clip_golden.safetensors"),
        }
    }

    /// `key` of the clip golden as f32 values.
    fn f32s(&self, key: &str) -> Vec<f32> {
        self.clip[key].1.iter().map(|&v| v as f32).collect()
    }

    /// Three parameters holding the gradients of `step` (f32, or rounded to `dtype`).
    fn params(&self, backend: &BackendRef, step: usize, dtype: DType) -> Vec<Tensor> {
        NAMES
            .iter()
            .map(|n| {
                let (shape, values) = &self.optim[&format!("grad.{n}.{step}")];
                let values: Vec<f32> = values.iter().map(|&v| v as f32).collect();
                let param = Tensor::zeros(backend, shape, dtype).unwrap();
                let grad = Tensor::from_slice(backend, &values, shape).unwrap();
                param.set_grad(Some(grad.to_dtype(dtype).unwrap())).unwrap();
                param
            })
            .collect()
    }
}

fn grad_f32(param: &Tensor) -> Vec<f32> {
    let grad = param.grad().unwrap();
    grad.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

fn norm_types() -> [(&'static str, NormType); 2] {
    [("l2", NormType::L2), ("inf", NormType::Inf)]
}

/// `clip_grad_norm_` on `backend` for every golden case: the norm against both devices' goldens,
/// the gradients against `device`'s. Returns every case's norm and gradients (for comparing
/// devices).
fn check_norm_goldens(backend: &BackendRef, device: &str) -> Vec<Vec<f32>> {
    let golden = Golden::load();
    let mut results = Vec::new();
    for step in [0, 3] {
        for (norm_name, norm_type) in norm_types() {
            for factor in ["clip", "noclip"] {
                let key = format!("step{step}.{norm_name}.{factor}");
                let max_norm = golden.clip[&format!("cpu.{key}.max_norm")].1[0];
                let params = golden.params(backend, step, DType::F32);
                let total = clip_grad_norm_(&params, max_norm, norm_type, false).unwrap();
                assert_eq!(total.device(), params[0].device(), "{key}");
                let total = total.to_vec::<f32>().unwrap()[0];
                for reference in ["cpu", "cuda"] {
                    let want = golden.clip[&format!("{reference}.{key}.total_norm")].1[0];
                    let err = (f64::from(total) - want).abs() / want;
                    println!("{device} {key}: norm {total} vs {reference}'s {want}: {err:.2e}");
                    assert!(
                        err <= NORM_TOLERANCE,
                        "{device} {key} vs {reference}: {err:e}"
                    );
                }
                let mut case = vec![total];
                for (name, param) in NAMES.iter().zip(&params) {
                    let ours = grad_f32(param);
                    let theirs = golden.f32s(&format!("{device}.{key}.grad.{name}"));
                    let ulps = max_ulps(&ours, &theirs);
                    println!("{device} {key} grad {name}: {ulps} ulps");
                    assert!(ulps <= GRAD_ULPS, "{device} {key} grad {name}: {ulps} ulps");
                    case.extend(ours);
                }
                results.push(case);
            }
        }
    }
    results
}

/// `clip_grad_value_(0.01)` on `backend`: exactly PyTorch's on both devices.
fn check_value_goldens(backend: &BackendRef, device: &str) {
    let golden = Golden::load();
    for step in [0, 3] {
        let params = golden.params(backend, step, DType::F32);
        clip_grad_value_(&params, 0.01).unwrap();
        for (name, param) in NAMES.iter().zip(&params) {
            let ours = grad_f32(param);
            for reference in ["cpu", "cuda"] {
                let theirs = golden.f32s(&format!("{reference}.step{step}.value0.01.grad.{name}"));
                assert_eq!(
                    max_ulps(&ours, &theirs),
                    0,
                    "{device} step {step} {name} vs {reference}"
                );
            }
        }
    }
}

/// An inf (and a NaN) gradient with `error_if_nonfinite`: a typed error, no gradient changed;
/// without it, PyTorch's result (a non-finite norm, the gradients scaled by its coefficient).
fn check_nonfinite(backend: &BackendRef) {
    for bad in [f32::INFINITY, f32::NAN] {
        for (_, norm_type) in norm_types() {
            let values = [0.5f32, -2.0, bad, 1.0];
            let param = Tensor::zeros(backend, &[4], DType::F32).unwrap();
            let other = Tensor::zeros(backend, &[2], DType::F32).unwrap();
            param
                .set_grad(Some(Tensor::from_slice(backend, &values, &[4]).unwrap()))
                .unwrap();
            other
                .set_grad(Some(
                    Tensor::from_slice(backend, &[3.0f32, 4.0], &[2]).unwrap(),
                ))
                .unwrap();
            let params = [param.clone(), other.clone()];
            let err = clip_grad_norm_(&params, 1.0, norm_type, true).unwrap_err();
            assert!(
                matches!(err, OptimError::NonFiniteNorm { total, .. } if !total.is_finite()),
                "{err}"
            );
            assert_eq!(max_ulps(&grad_f32(&param), &values), 0, "untouched");
            assert_eq!(grad_f32(&other), [3.0, 4.0], "untouched");
            let total = clip_grad_norm_(&params, 1.0, norm_type, false).unwrap();
            let total = total.to_vec::<f32>().unwrap()[0];
            assert!(!total.is_finite());
            // The coefficient is 0 (inf norm) or NaN: finite gradients become 0 or NaN.
            let scaled = grad_f32(&other);
            assert!(scaled.iter().all(|&v| v == 0.0 || v.is_nan()), "{scaled:?}");
        }
    }
}

/// bf16 gradients: the same total norm as the f32 run over the same (bf16) values, and each
/// clipped gradient within one bf16 rounding of that f32 run's.
fn check_bf16(backend: &BackendRef) {
    let golden = Golden::load();
    for (norm_name, norm_type) in norm_types() {
        let max_norm = golden.clip[&format!("cpu.step3.{norm_name}.clip.max_norm")].1[0];
        let low = golden.params(backend, 3, DType::BF16);
        // The f32 reference holds the bf16 values widened.
        let wide: Vec<Tensor> = low
            .iter()
            .map(|p| {
                let param = Tensor::zeros(backend, p.shape(), DType::F32).unwrap();
                let grad = p.grad().unwrap().to_dtype(DType::F32).unwrap();
                param.set_grad(Some(grad)).unwrap();
                param
            })
            .collect();
        let total_low = clip_grad_norm_(&low, max_norm, norm_type, false).unwrap();
        let total_wide = clip_grad_norm_(&wide, max_norm, norm_type, false).unwrap();
        assert_eq!(total_low.dtype(), DType::F32);
        assert_eq!(
            total_low.to_vec::<f32>().unwrap(),
            total_wide.to_vec::<f32>().unwrap(),
            "{norm_name}"
        );
        for (low, wide) in low.iter().zip(&wide) {
            let ours = low.grad().unwrap().to_vec::<bf16>().unwrap();
            let want = grad_f32(wide);
            for (o, w) in ours.iter().zip(&want) {
                // One rounding to nearest: the f32 value rounds to this bf16.
                assert_eq!(*o, bf16::from_f32(*w), "{norm_name}: {o} for {w}");
            }
        }
    }
}

#[test]
fn clip_grad_norm_matches_pytorch_on_the_cpu() {
    check_norm_goldens(&CpuBackend::new_ref(), "cpu");
}

#[test]
fn clip_grad_value_matches_pytorch_on_the_cpu() {
    check_value_goldens(&CpuBackend::new_ref(), "cpu");
}

#[test]
fn a_nonfinite_norm_is_a_typed_error_on_the_cpu() {
    check_nonfinite(&CpuBackend::new_ref());
}

#[test]
fn bf16_gradients_are_rounded_once_on_the_cpu() {
    check_bf16(&CpuBackend::new_ref());
}

/// What clipping cannot take gives typed errors; parameters without gradients give a zero norm.
#[test]
fn clipping_refuses_what_it_cannot_take() {
    let cpu = CpuBackend::new_ref();
    let params = [Tensor::zeros(&cpu, &[3], DType::F32).unwrap()];
    assert!(matches!(
        clip_grad_norm_(&[], 1.0, NormType::L2, false).unwrap_err(),
        OptimError::InvalidArgument { .. }
    ));
    let total = clip_grad_norm_(&params, 1.0, NormType::L2, false).unwrap();
    assert_eq!(total.to_vec::<f32>().unwrap(), [0.0]);
    for max_norm in [f64::NAN, f64::INFINITY] {
        assert!(matches!(
            clip_grad_norm_(&params, max_norm, NormType::L2, false).unwrap_err(),
            OptimError::InvalidArgument { .. }
        ));
    }
    for clip_value in [-1.0, f64::NAN] {
        assert!(matches!(
            clip_grad_value_(&params, clip_value).unwrap_err(),
            OptimError::InvalidArgument { .. }
        ));
    }
    let f64s = Tensor::zeros(&cpu, &[3], DType::F64).unwrap();
    f64s.set_grad(Some(Tensor::zeros(&cpu, &[3], DType::F64).unwrap()))
        .unwrap();
    assert!(matches!(
        clip_grad_norm_(&[f64s], 1.0, NormType::L2, false).unwrap_err(),
        OptimError::DType {
            got: DType::F64,
            ..
        }
    ));
}

/// `values` as a tensor of `dtype`, rounded on the host (to nearest-even).
fn rounded(backend: &BackendRef, values: &[f32], dtype: DType) -> Tensor {
    let shape = [values.len()];
    match dtype {
        DType::BF16 => {
            let values: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            Tensor::from_slice(backend, &values, &shape).unwrap()
        }
        DType::F16 => {
            let values: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            Tensor::from_slice(backend, &values, &shape).unwrap()
        }
        _ => Tensor::from_slice(backend, values, &shape).unwrap(),
    }
}

/// Many tensors of three dtypes and sizes around the blocks' bounds in one call, on `backend`:
/// the norm and the clipped gradients (as bytes).
fn many_tensors(backend: &BackendRef, norm_type: NormType) -> (f32, Vec<Vec<u8>>) {
    let sizes = [1usize, 3, 4, 37, 4095, 4096, 4097, 70_001, 0, 300 * 257];
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    let params: Vec<Tensor> = (0..60)
        .map(|i| {
            let n = sizes[i % sizes.len()];
            let dtype = dtypes[i % dtypes.len()];
            let values = headroom_testkit::inputs::uniform_f32(n, i as u64 + 1);
            let param = Tensor::zeros(backend, &[n], dtype).unwrap();
            param
                .set_grad(Some(rounded(backend, &values, dtype)))
                .unwrap();
            param
        })
        .collect();
    let total = clip_grad_norm_(&params, 0.5, norm_type, false).unwrap();
    let total = total.to_vec::<f32>().unwrap()[0];
    let grads = params
        .iter()
        .map(|p| {
            let grad = p.grad().unwrap().to_dtype(DType::F32).unwrap();
            grad.to_vec::<f32>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    (total, grads)
}

#[test]
fn many_tensors_of_mixed_dtypes_clip_in_one_call() {
    let cpu = CpuBackend::new_ref();
    for (name, norm_type) in norm_types() {
        let (total, grads) = many_tensors(&cpu, norm_type);
        assert!(total > 0.5, "{name}: {total}");
        assert_eq!(grads.len(), 60);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use headroom_ops_cuda::CudaBackend;
    use headroom_testkit::gpu::backend_or_skip;

    #[test]
    #[ignore = "needs a CUDA device"]
    fn clip_grad_norm_matches_pytorch_and_the_cpu_on_cuda() {
        let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
            return;
        };
        let on_cuda = check_norm_goldens(&cuda, "cuda");
        let on_cpu = check_norm_goldens(&CpuBackend::new_ref(), "cpu");
        for (gpu, host) in on_cuda.iter().zip(&on_cpu) {
            let ulps = max_ulps(gpu, host);
            assert!(ulps <= 1, "CUDA and CPU clips differ by {ulps} ulps");
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn clip_grad_value_matches_pytorch_on_cuda() {
        let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
            return;
        };
        check_value_goldens(&cuda, "cuda");
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_nonfinite_norm_is_a_typed_error_on_cuda() {
        let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
            return;
        };
        check_nonfinite(&cuda);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn bf16_gradients_are_rounded_once_on_cuda() {
        let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
            return;
        };
        check_bf16(&cuda);
    }

    /// 60 tensors of three dtypes in one call: the norm within an ulp of the CPU's, the clipped
    /// gradients within an ulp of the CPU's (of their dtype; equal where the norms are equal).
    #[test]
    #[ignore = "needs a CUDA device"]
    fn many_tensors_of_mixed_dtypes_agree_with_the_cpu() {
        let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
            return;
        };
        let cpu = CpuBackend::new_ref();
        for (name, norm_type) in norm_types() {
            let (gpu_total, gpu_grads) = many_tensors(&cuda, norm_type);
            let (cpu_total, cpu_grads) = many_tensors(&cpu, norm_type);
            let ulps = max_ulps(&[gpu_total], &[cpu_total]);
            println!("{name}: CUDA norm {gpu_total}, CPU {cpu_total} ({ulps} ulps)");
            assert!(ulps <= 1, "{name}");
            if ulps == 0 {
                assert!(
                    gpu_grads == cpu_grads,
                    "{name}: equal norms, other gradients"
                );
            }
        }
    }

    /// Gradients on two devices are refused before anything changes.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn mixed_devices_are_refused() {
        let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
            return;
        };
        let cpu = CpuBackend::new_ref();
        let on_cuda = Tensor::zeros(&cuda, &[2], DType::F32).unwrap();
        on_cuda
            .set_grad(Some(
                Tensor::from_slice(&cuda, &[3.0f32, 4.0], &[2]).unwrap(),
            ))
            .unwrap();
        let on_cpu = Tensor::zeros(&cpu, &[2], DType::F32).unwrap();
        on_cpu
            .set_grad(Some(
                Tensor::from_slice(&cpu, &[3.0f32, 4.0], &[2]).unwrap(),
            ))
            .unwrap();
        let err =
            clip_grad_norm_(&[on_cuda.clone(), on_cpu], 1.0, NormType::L2, false).unwrap_err();
        assert!(matches!(err, OptimError::MixedDevices { .. }), "{err}");
        assert_eq!(grad_f32(&on_cuda), [3.0, 4.0]);
    }
}
