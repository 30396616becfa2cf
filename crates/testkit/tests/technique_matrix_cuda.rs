//! The technique matrix's GPU subset on a CUDA device: every driver × every way to keep saves,
//! offload included × every precision × both optimizers, on a tiny ViT and a tiny GPT-2
//! (`matrix/mod.rs` says what each is and why the bounds hold), 5 steps each against the plain
//! loop on the same device, one cell at a time (ZeRO-2's two ranks share the device). Marked
//! `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored` (testkit's gate).

use std::time::Instant;

use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::{backend_or_skip, exclusive_device};

mod matrix;
use matrix::{assert_within_bounds, cells, train, Saves, DRIVERS};

#[test]
#[ignore = "needs a CUDA device"]
fn every_technique_stacks_with_every_other_on_cuda_and_trains_like_the_plain_loop() {
    let _device = exclusive_device();
    let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
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
    assert_within_bounds(&cells, &trained, true, started);
}
