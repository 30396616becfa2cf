//! Double-buffered data loading through pinned memory: while the GPU computes on batch `i`, the
//! host fills a pinned staging buffer with batch `i + 1` and a side stream copies it into a tensor
//! allocated from that stream's pool; the compute stream waits only for that copy's event.
//!
//! `cargo run --release -p headroom-ops-cuda --features cuda --example pinned_loading`
//!
//! Prints each batch's sum of squares (checked against the host's) and the pinned allocator's
//! figures; without a CUDA device it prints a skip notice.

use headroom_autograd_core::{BackendRef, DType, Result, Tensor};
use headroom_ops_cuda::{CudaBackend, CudaStream, PinnedBuffer};
use headroom_testkit::gpu::cuda_or_skip;

const BATCH_FLOATS: usize = 4 << 20;
const BATCHES: usize = 6;

fn main() -> Result<()> {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return Ok(());
    };
    let compute = cuda.compute_stream();
    let loader = cuda.new_stream()?;
    // Two staging buffers: the host fills one while the other is being copied.
    let mut staging: Vec<PinnedBuffer> = (0..2)
        .map(|_| cuda.pinned_host(BATCH_FLOATS * 4))
        .collect::<Result<_>>()?;

    let mut expected = Vec::new();
    let mut next = Some(load(&cuda, &loader, 0, &mut staging[0], &mut expected)?);
    for i in 0..BATCHES {
        let Some(batch) = next.take() else { break };
        // Kernels on the compute stream start once this batch's copy is done.
        compute.wait_event(&loader.record_event()?)?;
        // Queue the next batch before the compute work, so its copy overlaps the kernels.
        if i + 1 < BATCHES {
            let buffer = &mut staging[(i + 1) % 2];
            next = Some(load(&cuda, &loader, i + 1, buffer, &mut expected)?);
        }
        let sum_of_squares = batch.mul(&batch)?.sum_all()?.to_vec::<f32>()?[0];
        let want = expected[i];
        println!(
            "batch {i}: sum of squares {sum_of_squares:.1} (host: {want:.1}, relative error {:.1e})",
            (f64::from(sum_of_squares) - want).abs() / want
        );
    }
    drop(staging);
    let stats = cuda.pinned_allocator().memory_stats();
    println!(
        "pinned: {} allocations, {} B reserved at peak (two {} B staging blocks)",
        stats.allocation.all.allocated,
        stats.reserved_bytes.all.peak,
        BATCH_FLOATS * 4
    );
    Ok(())
}

/// Fills `staging` with batch `i` on the host (after the copy that last read it) and queues its
/// copy into a new device tensor on `loader`; records the batch's expected sum of squares.
fn load(
    cuda: &std::sync::Arc<CudaBackend>,
    loader: &CudaStream,
    i: usize,
    staging: &mut PinnedBuffer,
    expected: &mut Vec<f64>,
) -> Result<Tensor> {
    let host = staging.as_mut_slice::<f32>()?;
    for (j, v) in host.iter_mut().enumerate() {
        *v = ((i * 31 + j) % 1000) as f32 / 1000.0;
    }
    expected.push(host.iter().map(|v| f64::from(v * v)).sum::<f64>());
    let gpu: BackendRef = cuda.clone();
    // From the loader's pool, so the copy need not wait for kernels queued on the compute stream.
    let batch =
        cuda.allocate_on_stream(loader, || Tensor::empty(&gpu, &[BATCH_FLOATS], DType::F32))??;
    cuda.copy_to_tensor_async(staging, 0, &batch, loader)?;
    Ok(batch)
}
