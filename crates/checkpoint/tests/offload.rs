//! Offload on the CPU backend, in both builds (with and without the `cuda` feature): offloading
//! CPU tensors is a typed error that says what to do, never a silent fallback that keeps them on
//! the device, and the blocks an `OffloadBlocks` does not select train exactly as without it.

use std::sync::Arc;

use headroom_autograd_core::{DType, Generator, Tensor, TensorError};
use headroom_checkpoint::{
    offload, BlockSelection, CheckpointError, OffloadBlocks, OffloadOptions,
};
use headroom_nn::{BlockStack, NnError, VisionTransformer, VitConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::{check_technique, ModelSpec, OptimSpec, Tolerance, TrainCase};

mod block_runner;
use block_runner::WithRunner;
use headroom_testkit::memory::allocated;

#[test]
fn offloading_cpu_tensors_is_a_typed_error_that_says_what_to_do() {
    let cpu = CpuBackend::new_ref();
    let x = Tensor::ones(&cpu, &[64, 64], DType::F32).unwrap();
    let w = Tensor::ones(&cpu, &[64, 64], DType::F32).unwrap();
    w.requires_grad_(true).unwrap();
    let before = allocated(&cpu);
    let region_ran = std::sync::atomic::AtomicBool::new(false);
    let err = offload(
        |xs| {
            region_ran.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(vec![xs[0].linear(&xs[1], None)?.gelu()?])
        },
        &[x.clone(), w.clone()],
        &OffloadOptions::default(),
    )
    .unwrap_err();
    let CheckpointError::OffloadNeedsCuda { reason } = &err else {
        panic!("expected OffloadNeedsCuda, got {err}");
    };
    if cfg!(feature = "cuda") {
        assert!(reason.contains("Cpu"), "{reason}");
    } else {
        assert!(reason.contains("`cuda` feature"), "{reason}");
    }
    let message = err.to_string();
    assert!(
        message.contains("CudaBackend") && message.contains("checkpoint"),
        "{message}"
    );
    assert!(!region_ran.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(allocated(&cpu), before, "nothing was computed or kept");

    // The same through a model's block runner: the first selected block fails the forward.
    let generator = Arc::new(Generator::new(0));
    let mut vit = VisionTransformer::new(&cpu, VitConfig::tiny(), DType::F32, &generator).unwrap();
    vit.set_block_runner(Some(Arc::new(OffloadBlocks::new(BlockSelection::Indices(
        vec![1],
    )))));
    let images = Tensor::ones(&cpu, &[2, 3, 32, 32], DType::F32).unwrap();
    let err = vit.forward(&images).unwrap_err();
    let NnError::Tensor(TensorError::Hook { source, .. }) = &err else {
        panic!("expected the checkpoint error through nn, got {err}");
    };
    assert!(
        matches!(
            source.downcast_ref::<CheckpointError>(),
            Some(CheckpointError::OffloadNeedsCuda { .. })
        ),
        "{err}"
    );
}

#[test]
fn blocks_not_selected_train_exactly_as_without_offload() {
    let cpu = CpuBackend::new_ref();
    let case = TrainCase {
        name: "vit-tiny with dropout",
        model: ModelSpec::Vit(VitConfig {
            dropout: 0.1,
            attention_dropout: 0.1,
            ..VitConfig::tiny()
        }),
        dtype: DType::F32,
        batch: 2,
        steps: 3,
        optimizer: OptimSpec::adamw(1e-3, 1e-2),
        tolerance: Tolerance::Bitwise {
            why: "blocks that are not selected keep every saved tensor where it is",
        },
        seed: 5,
    };
    let blocks = OffloadBlocks::new(BlockSelection::Indices(vec![]));
    let report = check_technique(&cpu, &case, &mut WithRunner(Arc::new(blocks.clone()))).unwrap();
    assert_eq!(report.max_ulps, 0);
    assert_eq!(report.baseline_losses, report.technique_losses);
    let stats = blocks.options.pool.stats();
    assert_eq!(stats.offloaded_saves, 0);
    assert_eq!(stats.bytes_to_host, 0);
    if cfg!(feature = "cuda") {
        assert!(
            stats.kept_saves > 0,
            "every block ran as a group of the pool"
        );
    }
}
