//! What the CUDA backend checks besides the values: every byte it holds comes from the caching
//! allocator and goes back to it, and a bad index is a typed error, checked on the device, at
//! once or (deferred index checks) at the next synchronisation.

use std::sync::Arc;

use headroom_autograd_core::{Backend, BackendRef, Buffer, DType, Layout};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;

use crate::{backends, decode, upload, view};

#[test]
#[ignore = "needs a CUDA device"]
fn every_byte_comes_from_the_caching_allocator() {
    let Some((gpu, _cpu)) = backends() else {
        return;
    };
    let before = gpu.memory_stats().allocated_bytes.all.current;
    let buffers: Vec<Buffer> = (1..=4)
        .map(|k| Buffer::new(&gpu, k * 1000).unwrap())
        .collect();
    let after = gpu.memory_stats().allocated_bytes.all.current;
    // 1000, 2000, 3000, 4000 bytes round to 1024, 2048, 3072, 4096.
    assert_eq!(after - before, 10_240);
    drop(buffers);
    assert_eq!(gpu.memory_stats().allocated_bytes.all.current, before);
    // A bad index is a typed error, checked on the device.
    let values = upload(&gpu, DType::F32, &[1.0; 4]);
    let error = gather_one(&gpu, &values, 7.0).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("index 7 is out of bounds for size 4"),
        "{error}"
    );
    let _: Arc<dyn Backend> = gpu;
}

/// `gather(values [4], dim 0, [index])` into a one-element buffer.
fn gather_one(
    backend: &BackendRef,
    values: &Buffer,
    index: f64,
) -> headroom_autograd_core::Result<()> {
    let index = upload(backend, DType::I64, &[index]);
    let out = Buffer::new(backend, 4).unwrap();
    backend.gather(
        view(values, &Layout::contiguous(&[4]), DType::F32),
        0,
        view(&index, &Layout::contiguous(&[1]), DType::I64),
        view(&out, &Layout::contiguous(&[1]), DType::F32),
    )
}

/// Deferred index checks: no error (and no host synchronisation) at the call, the first bad value
/// at the next `synchronize` or `read_host`, once; switching back returns what is pending and
/// gives the slots back to the allocator.
#[test]
#[ignore = "needs a CUDA device"]
fn deferred_index_checks_report_at_the_next_synchronisation() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let gpu: BackendRef = cuda.clone();
    let values = upload(&gpu, DType::F32, &[1.0, 2.0, 3.0, 4.0]);
    let before = gpu.memory_stats().allocated_bytes.all.current;
    cuda.set_deferred_index_checks(true).unwrap();
    assert!(cuda.deferred_index_checks());
    gather_one(&gpu, &values, 7.0).unwrap();
    gather_one(&gpu, &values, 9.0).unwrap();
    let error = cuda.synchronize().unwrap_err().to_string();
    assert!(
        error.contains("gather") && error.contains("index 7 "),
        "{error}"
    );
    cuda.synchronize().unwrap();

    gather_one(&gpu, &values, -3.0).unwrap();
    let mut bytes = [0u8; 16];
    let error = gpu
        .read_host(&values, 0, &mut bytes)
        .unwrap_err()
        .to_string();
    assert!(error.contains("index -3 "), "{error}");
    gpu.read_host(&values, 0, &mut bytes).unwrap();
    assert_eq!(decode(DType::F32, &bytes), [1.0, 2.0, 3.0, 4.0]);

    gather_one(&gpu, &values, 4.0).unwrap();
    let error = cuda
        .set_deferred_index_checks(false)
        .unwrap_err()
        .to_string();
    assert!(error.contains("index 4 "), "{error}");
    assert!(!cuda.deferred_index_checks());
    assert_eq!(gpu.memory_stats().allocated_bytes.all.current, before);
    let error = gather_one(&gpu, &values, 5.0).unwrap_err().to_string();
    assert!(
        error.contains("index 5 is out of bounds for size 4"),
        "{error}"
    );
    cuda.synchronize().unwrap();
}
