//! Checkpointed training on the CUDA backend: ViT-tiny with dropout, every block or every other
//! block with the selective policy, gives the plain loop's parameters bit for bit (the ViT's CUDA
//! kernels are deterministic: fixed fold orders, no atomics). Marked `#[ignore = "needs a
//! CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use headroom_autograd_core::DType;
use headroom_checkpoint::{BlockSelection, CheckpointBlocks, CheckpointOptions, SaveMatmuls};
use headroom_nn::VitConfig;
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::backend_or_skip;
use headroom_testkit::{check_technique, ModelSpec, OptimSpec, Tolerance, TrainCase};

mod block_runner;
use block_runner::WithRunner;

#[test]
#[ignore = "needs a CUDA device"]
fn checkpointed_vit_training_on_the_gpu_equals_plain_training_bit_for_bit() {
    let Some(cuda) = backend_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let case = TrainCase {
        name: "vit-tiny with dropout on CUDA",
        model: ModelSpec::Vit(VitConfig {
            dropout: 0.1,
            attention_dropout: 0.1,
            ..VitConfig::tiny()
        }),
        dtype: DType::F32,
        batch: 4,
        steps: 5,
        optimizer: OptimSpec::adamw(1e-3, 1e-2),
        tolerance: Tolerance::Bitwise {
            why:
                "the recompute replays the forward's kernels and random draws, and the ViT's CUDA \
                  kernels are deterministic",
        },
        seed: 3,
    };
    let selective = CheckpointBlocks {
        selection: BlockSelection::Every(2),
        options: CheckpointOptions {
            policy: Arc::new(SaveMatmuls),
            ..CheckpointOptions::default()
        },
    };
    for blocks in [CheckpointBlocks::all(), selective] {
        let report = check_technique(&cuda, &case, &mut WithRunner(Arc::new(blocks))).unwrap();
        assert_eq!(report.max_ulps, 0);
    }
}
