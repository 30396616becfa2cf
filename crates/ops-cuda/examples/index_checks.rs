//! Out-of-range token ids on the GPU, checked two ways: immediately (the default: the embedding
//! lookup itself returns the typed error, at the cost of one host synchronisation per lookup) and
//! deferred (`set_deferred_index_checks(true)`: the lookup is queued like any kernel and the error
//! comes back from the next `synchronize` or host read, once). In both modes the bad id is skipped,
//! never read.
//!
//! `cargo run --release -p headroom-ops-cuda --features cuda --example index_checks`
//!
//! Without a CUDA device it prints a skip notice.

use headroom_autograd_core::{embedding, BackendRef, DType, Result, Tensor};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;

fn main() -> Result<()> {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return Ok(());
    };
    let gpu: BackendRef = cuda.clone();
    let table = Tensor::full(&gpu, &[8, 4], 1.0, DType::F32)?;
    let ids = |values: &[i64]| Tensor::from_slice(&gpu, values, &[values.len()]);

    // Immediate: the lookup itself fails.
    match embedding(&table, &ids(&[1, 9, 2])?) {
        Ok(_) => println!("immediate: no error (unexpected)"),
        Err(err) => println!("immediate: the lookup returned `{err}`"),
    }

    // Deferred: lookups queue without waiting; the first bad id surfaces at the next sync.
    cuda.set_deferred_index_checks(true)?;
    let good = embedding(&table, &ids(&[0, 3])?)?;
    let _bad = embedding(&table, &ids(&[5, 12])?)?;
    println!("deferred: both lookups queued without an error");
    match cuda.synchronize() {
        Ok(()) => println!("deferred: no error at synchronize (unexpected)"),
        Err(err) => println!("deferred: synchronize returned `{err}`"),
    }
    cuda.synchronize()?;
    println!(
        "deferred: reported once; the good lookup still reads {:?}",
        &good.to_vec::<f32>()?[..4]
    );
    cuda.set_deferred_index_checks(false)?;
    Ok(())
}
