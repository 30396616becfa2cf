//! The NCCL communicator on two GPUs of one host, one rank per GPU (feature `nccl`):
//! each collective's values, and ZeRO-2 against one GPU training on the same global batch,
//! bitwise (a sum of two values is the same in any order, and `1/2` is exact, as on the CPU).
//!
//! It needs two GPUs. Each test is marked `#[ignore = "needs a CUDA device"]` and runs with
//! `--include-ignored`; with fewer GPUs (or without libnccl) it skips through testkit's gate, and
//! fails instead under `HEADROOM_REQUIRE_GPU=1`. So the one-GPU suite leaves this binary out by
//! name (`scripts/gpu-measure.sh`), and `scripts/gpu-data-parallel.sh` runs it on two.
#![cfg(feature = "nccl")]

mod zero2;

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_distributed::{
    nccl_unique_id, visible_gpus, Communicator, NcclComm, ReduceOp, UniqueId,
};
use headroom_ops_cuda::CudaBackend;
use headroom_optim::{Adam, AdamConfig, Implementation, Optimizer, ParamGroup};
use headroom_testkit::gpu::{cuda_or_skip, gpus_or_skip};
use headroom_testkit::inputs::Xorshift;
use headroom_testkit::ModelSpec;
use zero2::zero2_in_backward;

const SPEC: ModelSpec = ModelSpec::Mlp {
    width: 61,
    hidden: 200,
};
const STEPS: usize = 20;
const PER_RANK: usize = 8;
/// Ranks of the group, one per GPU.
const RANKS: usize = 2;

fn adam() -> AdamConfig {
    AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw()
    }
}

/// The first [`RANKS`] GPUs and a group id, or `None` after the gate's skip notice (no GPU,
/// fewer than [`RANKS`], or no libnccl).
fn gpus() -> Option<(Vec<Arc<CudaBackend>>, UniqueId)> {
    let visible = cuda_or_skip(visible_gpus())?;
    if !gpus_or_skip(RANKS, visible) {
        return None;
    }
    let gpus = (0..RANKS)
        .map(|ordinal| cuda_or_skip(CudaBackend::new(ordinal)))
        .collect::<Option<Vec<_>>>()?;
    let id = cuda_or_skip(nccl_unique_id())?;
    Some((gpus, id))
}

/// `f` on every rank, each on its own thread with its GPU and communicator.
fn on_ranks<T: Send>(
    gpus: &[Arc<CudaBackend>],
    id: UniqueId,
    f: impl Fn(Arc<dyn Communicator>, BackendRef) -> T + Sync,
) -> Vec<T> {
    let n = gpus.len();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, backend) = (&f, gpus[rank].clone());
                scope.spawn(move || {
                    let comm = NcclComm::new(rank, rank, n, &id).unwrap();
                    f(Arc::new(comm), backend)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
#[ignore = "needs a CUDA device"]
fn collectives_on_the_gpus() {
    let Some((gpus, id)) = gpus() else { return };
    let n = gpus.len();
    let results = on_ranks(&gpus, id, |comm, gpu| {
        let r = comm.rank() as f64;
        let t =
            |values: &[f64]| Tensor::from_f64s(&gpu, values, &[values.len()], DType::F32).unwrap();
        let sum = t(&[r, 10.0 * r]);
        comm.all_reduce(&sum, ReduceOp::Sum).unwrap();
        let scattered = t(&[0.0, 0.0]);
        comm.reduce_scatter(
            &t(&[r, r + 1.0, r + 2.0, r + 3.0][..2 * n]),
            &scattered,
            ReduceOp::Sum,
        )
        .unwrap();
        let gathered = t(&vec![0.0; 2 * n]);
        comm.all_gather(&t(&[r, -r]), &gathered).unwrap();
        let broadcast = t(&[r; 2]);
        comm.broadcast(&broadcast, n - 1).unwrap();
        comm.barrier().unwrap();
        [sum, scattered, gathered, broadcast].map(|t| t.to_vec::<f32>().unwrap())
    });
    // Rank r contributes [r, 10 r], [r, r + 1, r + 2, r + 3] (two chunks), [r, -r], [r, r].
    let top = (n - 1) as f32;
    let (sum, chunks) = ([1.0, 10.0], [[1.0, 3.0], [5.0, 7.0]]);
    let gathered: Vec<f32> = (0..n).flat_map(|r| [r as f32, -(r as f32)]).collect();
    for (rank, [got_sum, scattered, got_gathered, broadcast]) in results.iter().enumerate() {
        assert_eq!(*got_sum, sum);
        assert_eq!(*scattered, chunks[rank]);
        assert_eq!(*got_gathered, gathered);
        assert_eq!(*broadcast, [top, top]);
    }
}

fn batch(backend: &BackendRef, step: usize) -> headroom_testkit::Batch {
    let mut random = Xorshift::new(1000 + step as u64);
    SPEC.batch(backend, DType::F32, 2 * PER_RANK, &mut random)
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn zero2_on_the_gpus_trains_to_one_gpu_bitwise() {
    let Some((gpus, id)) = gpus() else { return };
    let n = gpus.len();
    let ranks = on_ranks(&gpus, id, |comm, gpu| {
        let model = SPEC.build(&gpu, DType::F32, 7).unwrap();
        let params = model.module().parameters();
        let rank = comm.rank();
        let in_backward = zero2_in_backward(params.clone(), adam(), comm, 64 << 10);
        for step in 0..STEPS {
            let part = batch(&gpu, step).narrow(rank * PER_RANK, PER_RANK).unwrap();
            let loss = model
                .loss(&model.forward(&part.input).unwrap(), &part)
                .unwrap();
            in_backward.backward(&loss).unwrap();
        }
        params
            .iter()
            .map(|p| p.to_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    });
    let gpu: BackendRef = gpus[0].clone();
    let model = SPEC.build(&gpu, DType::F32, 7).unwrap();
    let params = model.module().parameters();
    let mut adam = Adam::new(
        vec![ParamGroup::new(params.clone(), adam())],
        Implementation::Fused,
    )
    .unwrap();
    for step in 0..STEPS {
        let global = batch(&gpu, step);
        for rank in 0..n {
            let part = global.narrow(rank * PER_RANK, PER_RANK).unwrap();
            // Each rank's loss is the mean over its half: the global mean is half their sum.
            let loss = model
                .loss(&model.forward(&part.input).unwrap(), &part)
                .unwrap()
                .mul_scalar(0.5)
                .unwrap();
            loss.backward().unwrap();
        }
        adam.step().unwrap();
        adam.zero_grad(true).unwrap();
    }
    let expected: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    for (rank, trained) in ranks.iter().enumerate() {
        for (index, (ours, theirs)) in trained.iter().zip(&expected).enumerate() {
            let first = ours
                .iter()
                .zip(theirs)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                first.is_none(),
                "rank {rank}, parameter {index}, element {first:?}"
            );
        }
    }
}
