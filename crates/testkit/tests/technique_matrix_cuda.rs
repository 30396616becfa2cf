//! The technique matrix's GPU subset on a CUDA device: every driver × every way to keep saves,
//! offload included × every precision × both optimizers, on a tiny ViT and a tiny GPT-2
//! (`matrix/mod.rs` says what each is and why the bounds hold), 5 steps each against the plain
//! loop on the same device, one cell at a time (ZeRO-2's two ranks share the device). Marked
//! `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored` (testkit's gate).

use std::time::Instant;

use headroom_autograd_core::BackendRef;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device};

mod matrix;
use matrix::{cells, judge, train, Saves, DRIVERS, STEPS};

#[test]
#[ignore = "needs a CUDA device"]
fn every_technique_stacks_with_every_other_on_cuda_and_trains_like_the_plain_loop() {
    let _device = exclusive_device();
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let cuda: BackendRef = cuda;
    let started = Instant::now();
    let cells = cells(
        &[
            Saves::Keep,
            Saves::Checkpoint,
            Saves::Compress8bit,
            Saves::Offload,
        ],
        &DRIVERS,
    );
    assert_eq!(cells.len(), 2 * 3 * 2 * 12);
    let trained: Vec<_> = cells.iter().map(|&cell| train(cell, &cuda)).collect();
    let failures = judge(&cells, &trained, true);
    println!(
        "{} cells trained {STEPS} steps each on CUDA in {:.1} s",
        cells.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
