//! Offload on the CUDA backend: training with offloaded blocks gives the plain loop's parameters
//! bit for bit (ViT-tiny with dropout, whatever the prefetch and copy overlap; GPT-2-tiny within
//! what its atomic embedding gradient lets two plain runs differ by), the first blocks
//! recomputed and the next offloaded ([`SplitBlocks`]) bit for bit too, a region's gradients equal the plain ones with exactly the expected saves offloaded, the pinned
//! pool's bytes do not change after the first step, an offloaded step never makes the host wait
//! for the device, and a tensor written in place after its save still fails backward with
//! autograd's version error. Each test is marked `#[ignore = "needs a CUDA
//! device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use headroom_autograd_core::{BackendRef, DType, Generator, Tensor, TensorError};
use headroom_checkpoint::{
    offload, BlockSelection, CheckpointBlocks, OffloadBlocks, OffloadOptions, OffloadPool,
    SplitBlocks,
};
use headroom_nn::{BlockStack, Gpt2Config, Module, VisionTransformer, VitConfig};
use headroom_ops_cuda::{CudaBackend, KernelArg};
use headroom_testkit::gpu::{cuda_or_skip, exclusive_device, SPIN_NS_PTX};
use headroom_testkit::inputs::uniform_f32;
use headroom_testkit::{check_technique, ModelSpec, OptimSpec, Tolerance, TrainCase};

mod block_runner;
use block_runner::WithRunner;

/// The device, as itself (for its allocator's counts) and as the `BackendRef` tensors take; or
/// `None` after the GPU gate's skip notice.
#[track_caller]
fn own_cuda() -> Option<(Arc<CudaBackend>, BackendRef)> {
    let cuda = cuda_or_skip(CudaBackend::new(0))?;
    Some((cuda.clone(), cuda))
}

/// Queues testkit's `spin_ns` for `duration` on the compute stream.
fn spin(cuda: &CudaBackend, duration: Duration) {
    let kernel = cuda
        .load_kernel("offload_test_spin", SPIN_NS_PTX, "spin_ns")
        .unwrap();
    // SAFETY: `spin_ns` takes one u64 and touches no memory.
    unsafe {
        cuda.launch_kernel(
            &kernel,
            1,
            1,
            0,
            &[KernelArg::U64(duration.as_nanos() as u64)],
        )
        .unwrap();
    }
}

/// Everything offloaded that the rules allow (`min_bytes` 0: the tiny models' tensors are small).
fn every_save(prefetch_blocks: usize, release_after_blocks: usize) -> OffloadOptions {
    OffloadOptions {
        min_bytes: 0,
        prefetch_blocks,
        release_after_blocks,
        pool: OffloadPool::new(),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn offloaded_training_on_the_gpu_equals_plain_training_bit_for_bit() {
    let _device = exclusive_device();
    let Some((_, cuda)) = own_cuda() else { return };
    let mut gpt2 = Gpt2Config::tiny();
    gpt2.embd_pdrop = 0.1;
    gpt2.attn_pdrop = 0.1;
    gpt2.resid_pdrop = 0.1;
    let models = [
        (
            "vit-tiny with dropout on CUDA",
            ModelSpec::Vit(VitConfig {
                dropout: 0.1,
                attention_dropout: 0.1,
                ..VitConfig::tiny()
            }),
            Tolerance::Bitwise {
                why: "offload moves bytes and gives them back unchanged, and the ViT's CUDA \
                      kernels are deterministic",
            },
            OptimSpec::adamw(1e-3, 1e-2),
        ),
        (
            "gpt2-tiny with dropout on CUDA",
            ModelSpec::Gpt2 {
                config: gpt2,
                seq: 16,
            },
            Tolerance::Relative {
                max: 1e-5,
                why: "the token embedding's gradient is a scatter-add with atomics on CUDA, so \
                      its additions come in another order from run to run (on the H200, after 4 \
                      steps: one ulp of wte in one run; 10 parameters up to 4.4e-8 relative in \
                      another). SGD keeps such a difference proportional; Adam's normalisation \
                      turns it into a whole step wherever a gradient is near zero (seen: 1.1e-4 \
                      relative on an attention bias after 4 AdamW steps), so GPT-2 trains with \
                      SGD here. Offload itself moves bytes unchanged (the ViT, without atomics, \
                      is bitwise with AdamW)",
            },
            OptimSpec::sgd_momentum(1e-2, 0.9),
        ),
    ];
    // Copies back from the host (given back at each block's end, no prefetch or one block
    // ahead), and storages used where they are (given back late, often still lent to their copy
    // when backward needs them); every other block.
    let settings = [
        (BlockSelection::All, every_save(0, 0)),
        (BlockSelection::All, every_save(1, 0)),
        (BlockSelection::All, every_save(2, 64)),
        (BlockSelection::Every(2), every_save(1, 1)),
    ];
    for (name, model, tolerance, optimizer) in models {
        for (selection, options) in &settings {
            let case = TrainCase {
                name,
                model,
                dtype: DType::F32,
                batch: 4,
                steps: 4,
                optimizer: optimizer.clone(),
                tolerance,
                seed: 3,
            };
            let blocks = OffloadBlocks {
                selection: selection.clone(),
                options: options.clone(),
            };
            let report = check_technique(&cuda, &case, &mut WithRunner(Arc::new(blocks)))
                .unwrap_or_else(|err| panic!("{name} {selection:?}: {err}"));
            if matches!(model, ModelSpec::Vit(_)) {
                assert_eq!(report.max_ulps, 0, "{name} {selection:?}");
                assert_eq!(report.baseline_losses, report.technique_losses);
            }
            let stats = options.pool.stats();
            assert!(
                stats.offloaded_saves > 0 && stats.bytes_to_host > 0,
                "{stats:?}"
            );
            if options.release_after_blocks == 0 {
                assert_eq!(
                    stats.bytes_to_device, stats.bytes_to_host,
                    "every storage given back at its block's end comes back from the host"
                );
            }
            assert_eq!(stats.bytes_in_flight, 0, "{stats:?}");
            assert_eq!(stats.pinned_in_use, 0, "{stats:?}");
        }
    }
}

/// bench-memory's `adam_offload_ckpt` on a small scale: the first blocks recomputed, the next
/// offloaded one block ahead of backward, the last kept ([`SplitBlocks`] over a checkpointing and
/// an offloading runner): training equals plain training bit for bit.
#[test]
#[ignore = "needs a CUDA device"]
fn recomputed_then_offloaded_blocks_train_as_plain_training_bit_for_bit() {
    let _device = exclusive_device();
    let Some((_, cuda)) = own_cuda() else { return };
    let case = TrainCase {
        name: "vit (4 blocks): 1 recomputed, 2 offloaded, 1 kept",
        model: ModelSpec::Vit(VitConfig {
            num_layers: 4,
            ..VitConfig::tiny()
        }),
        dtype: DType::F32,
        batch: 4,
        steps: 4,
        optimizer: OptimSpec::adamw(1e-3, 1e-2),
        tolerance: Tolerance::Bitwise {
            why: "recomputation runs the same kernels again and offload moves bytes unchanged",
        },
        seed: 5,
    };
    let pool = OffloadPool::new();
    let runner = SplitBlocks {
        split: 1,
        first: Arc::new(CheckpointBlocks {
            selection: BlockSelection::First(1),
            options: Default::default(),
        }),
        rest: Arc::new(OffloadBlocks {
            selection: BlockSelection::Indices(vec![1, 2]),
            options: OffloadOptions {
                min_bytes: 0,
                prefetch_blocks: 1,
                release_after_blocks: 0,
                pool: pool.clone(),
            },
        }),
    };
    let report = check_technique(&cuda, &case, &mut WithRunner(Arc::new(runner))).unwrap();
    assert_eq!(report.max_ulps, 0);
    assert_eq!(report.baseline_losses, report.technique_losses);
    let stats = pool.stats();
    assert!(
        stats.offloaded_saves > 0 && stats.bytes_to_host > 0,
        "{stats:?}"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_regions_gradients_equal_the_plain_ones_with_exactly_its_activations_offloaded() {
    let _device = exclusive_device();
    let Some((_, backend)) = own_cuda() else {
        return;
    };
    let (rows, width, hidden) = (256, 1024, 4096);
    let tensor = |shape: &[usize], seed: u64| {
        let n = shape.iter().product();
        Tensor::from_slice(&backend, &uniform_f32(n, seed), shape).unwrap()
    };
    let x = tensor(&[rows, width], 1);
    let w1 = tensor(&[hidden, width], 2);
    let w2 = tensor(&[width, hidden], 3);
    for w in [&w1, &w2] {
        w.requires_grad_(true).unwrap();
    }
    let mlp = |xs: &[Tensor]| -> Result<Vec<Tensor>, TensorError> {
        Ok(vec![xs[0]
            .linear(&xs[1], None)?
            .gelu()?
            .linear(&xs[2], None)?])
    };
    let grads = || -> Vec<Vec<f32>> {
        [&w1, &w2]
            .iter()
            .map(|w| w.take_grad().unwrap().to_vec::<f32>().unwrap())
            .collect()
    };
    let inputs = [x.clone(), w1.clone(), w2.clone()];
    mlp(&inputs).unwrap()[0]
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let plain = grads();

    let options = OffloadOptions::default();
    let out = offload(mlp, &inputs, &options).unwrap();
    let after_forward = options.pool.stats();
    out[0].sum_all().unwrap().backward().unwrap();
    assert_eq!(
        grads(),
        plain,
        "offloaded gradients equal the plain ones bit for bit"
    );

    // x (a leaf without grad), the first product (GELU's input) and GELU's output go to the
    // host; the second weight (a parameter) stays. The first linear saves no weight: its input
    // needs no gradient.
    let f32_bytes = |n: usize| (n * 4) as u64;
    let activations = f32_bytes(rows * width) + 2 * f32_bytes(rows * hidden);
    assert_eq!(after_forward.offloaded_saves, 3, "{after_forward:?}");
    assert_eq!(after_forward.kept_saves, 1, "{after_forward:?}");
    assert_eq!(after_forward.bytes_to_host, activations);
    let stats = options.pool.stats();
    assert_eq!(
        stats.bytes_to_device + stats.bytes_used_in_place,
        activations,
        "each storage came back once, or stayed: {stats:?}"
    );
    assert_eq!(stats.pinned_in_use, 0);
    assert_eq!(stats.bytes_in_flight, 0);
}

/// One forward and backward of `vit` on `images` (no optimizer: the pool is what is watched).
fn forward_backward(vit: &VisionTransformer, images: &Tensor) {
    vit.forward(images)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
}

fn gradients(vit: &VisionTransformer) -> Vec<Vec<f32>> {
    vit.parameters()
        .iter()
        .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
        .collect()
}

fn vit_mini(backend: &BackendRef, options: &OffloadOptions) -> (VisionTransformer, Tensor) {
    let generator = Arc::new(Generator::new(0));
    let mut vit =
        VisionTransformer::new(backend, VitConfig::mini(), DType::F32, &generator).unwrap();
    vit.set_block_runner(Some(Arc::new(OffloadBlocks {
        selection: BlockSelection::All,
        options: options.clone(),
    })));
    let size = VitConfig::mini().image_size;
    let shape = [8, 3, size, size];
    let images =
        Tensor::from_slice(backend, &uniform_f32(shape.iter().product(), 7), &shape).unwrap();
    (vit, images)
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_pinned_pool_is_allocated_by_the_first_step_and_reused_byte_for_byte() {
    let _device = exclusive_device();
    let Some((cuda, backend)) = own_cuda() else {
        return;
    };
    let options = every_save(2, 1);
    let (vit, images) = vit_mini(&backend, &options);
    forward_backward(&vit, &images);
    let first = options.pool.stats();
    let pinned_reserved = |cuda: &CudaBackend| {
        let stats = cuda.pinned_allocator().memory_stats();
        (stats.reserved_bytes.all.current, stats.num_device_alloc)
    };
    let reserved = pinned_reserved(&cuda);
    assert!(
        first.pinned_allocations > 0 && first.bytes_to_host > 0,
        "{first:?}"
    );
    assert_eq!(first.pinned_in_use, 0, "every range is free after backward");
    for step in 2..=4 {
        vit.zero_grad(true).unwrap();
        forward_backward(&vit, &images);
        let stats = options.pool.stats();
        assert_eq!(
            stats.pinned_allocations, first.pinned_allocations,
            "step {step}"
        );
        assert_eq!(stats.pinned_bytes, first.pinned_bytes, "step {step}");
        assert_eq!(stats.pinned_in_use, 0, "step {step}");
        assert_eq!(
            stats.bytes_to_host,
            first.bytes_to_host * step,
            "the same storages every step"
        );
        assert_eq!(pinned_reserved(&cuda), reserved, "step {step}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_offloaded_step_never_makes_the_host_wait_for_the_device() {
    let _device = exclusive_device();
    let Some((cuda, backend)) = own_cuda() else {
        return;
    };
    // Given back at each block's end with no prefetch: every storage makes the round trip, and
    // the compute stream waits for every copy.
    let options = every_save(0, 0);
    let (vit, images) = vit_mini(&backend, &options);
    forward_backward(&vit, &images);
    cuda.synchronize().unwrap();
    let plain = gradients(&vit);
    vit.zero_grad(true).unwrap();
    let syncs = |cuda: &CudaBackend| {
        (
            cuda.allocator().memory_stats().num_sync_all_streams,
            cuda.pinned_allocator().memory_stats().num_sync_all_streams,
        )
    };
    let syncs_before = syncs(&cuda);
    let copied_before = options.pool.stats();

    // The compute stream is busy for two seconds: had the step waited for the device anywhere
    // (a host read, an event or stream synchronisation, a copy the host waits for), it would
    // return after the spin, since every copy and kernel of the step is ordered after it.
    spin(&cuda, Duration::from_secs(2));
    let marker = cuda.compute_stream().record_event().unwrap();
    forward_backward(&vit, &images);
    assert!(
        !marker.query().unwrap(),
        "forward and backward returned only after the device had finished the spin"
    );
    assert_eq!(syncs(&cuda), syncs_before);

    cuda.synchronize().unwrap();
    let stats = options.pool.stats();
    let copied = stats.bytes_to_host - copied_before.bytes_to_host;
    assert!(copied > 0);
    assert_eq!(
        stats.bytes_to_device - copied_before.bytes_to_device,
        copied
    );
    let grads: Vec<Vec<f32>> = vit
        .parameters()
        .iter()
        .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
        .collect();
    assert_eq!(
        grads, plain,
        "the same gradients as the step before, bit for bit"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_tensor_written_in_place_after_its_save_fails_backward_with_the_version_error() {
    let _device = exclusive_device();
    let Some((_, backend)) = own_cuda() else {
        return;
    };
    let x = Tensor::from_slice(&backend, &uniform_f32(512 * 512, 1), &[512, 512]).unwrap();
    let w = Tensor::from_slice(&backend, &uniform_f32(512 * 512, 2), &[512, 512]).unwrap();
    w.requires_grad_(true).unwrap();
    let options = every_save(1, 0);
    let out = offload(
        |xs| Ok(vec![xs[0].linear(&xs[1], None)?]),
        &[x.clone(), w.clone()],
        &options,
    )
    .unwrap();
    assert_eq!(
        options.pool.stats().offloaded_saves,
        1,
        "x went to the host"
    );
    x.fill_(0.5).unwrap();
    let err = out[0].sum_all().unwrap().backward().unwrap_err();
    assert!(
        matches!(err, TensorError::ModifiedInPlace { op: "linear", .. }),
        "{err}"
    );
}
