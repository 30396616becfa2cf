//! The in-process group's collectives against their definitions: values, the fixed reduction
//! order, the counted bytes, and the errors where NCCL would hang.

use std::sync::Arc;
use std::time::Duration;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_distributed::{
    CollectiveCount, CommStats, Communicator, DistributedError, InProcessGroup, ReduceOp,
};
use headroom_ops_cpu::CpuBackend;

fn tensor(backend: &BackendRef, values: &[f32]) -> Tensor {
    Tensor::from_slice(backend, values, &[values.len()]).unwrap()
}

#[test]
fn each_collective_gives_its_definition() {
    let results = InProcessGroup::run_on_threads(InProcessGroup::ranks(3).unwrap(), |comm| {
        let cpu = &CpuBackend::new_ref();
        let r = comm.rank() as f32;
        // all_reduce: sum and max of [r, 10 r].
        let sum = tensor(cpu, &[r, 10.0 * r]);
        comm.all_reduce(&sum, ReduceOp::Sum).unwrap();
        let max = tensor(cpu, &[r, -r]);
        comm.all_reduce(&max, ReduceOp::Max).unwrap();
        // reduce_scatter: rank r's input is [r; 6]; each receives two sums of 0+1+2.
        let input = tensor(cpu, &[r, r + 1.0, r, r + 1.0, r, r + 1.0]);
        let scattered = Tensor::zeros(cpu, &[2], DType::F32).unwrap();
        comm.reduce_scatter(&input, &scattered, ReduceOp::Sum)
            .unwrap();
        // all_gather: every rank's [r, -r], by rank.
        let gathered = Tensor::zeros(cpu, &[6], DType::F32).unwrap();
        comm.all_gather(&tensor(cpu, &[r, -r]), &gathered).unwrap();
        // broadcast from rank 2.
        let broadcast = tensor(cpu, &[r; 2]);
        comm.broadcast(&broadcast, 2).unwrap();
        comm.barrier().unwrap();
        (
            [sum, max, scattered, gathered, broadcast].map(|t| t.to_vec::<f32>().unwrap()),
            comm.stats(),
        )
    });
    for ([sum, max, scattered, gathered, broadcast], stats) in results {
        assert_eq!(sum, [3.0, 30.0]);
        assert_eq!(max, [2.0, 0.0]);
        assert_eq!(scattered, [3.0, 6.0]);
        assert_eq!(gathered, [0.0, -0.0, 1.0, -1.0, 2.0, -2.0]);
        assert_eq!(broadcast, [2.0, 2.0]);
        let count = |calls, bytes| CollectiveCount { calls, bytes };
        assert_eq!(
            stats,
            CommStats {
                all_reduce: count(2, 16),
                reduce_scatter: count(1, 24),
                all_gather: count(1, 24),
                broadcast: count(1, 8),
                barrier: count(1, 0),
            }
        );
        // Ring bytes per rank: (2/3) × (2 × 16 + 24 + 24) + 8.
        assert_eq!(stats.ring_bytes_sent(3), 2 * 10 + 16 + 16 + 8);
    }
}

#[test]
fn reductions_sum_in_rank_order_on_every_rank() {
    // (1 + 1e8) − 1e8 is 0 in f32, 1 + (1e8 − 1e8) is 1: the order shows.
    let values = [1.0f32, 1e8, -1e8];
    let results = InProcessGroup::run_on_threads(InProcessGroup::ranks(3).unwrap(), |comm| {
        let cpu = &CpuBackend::new_ref();
        let t = tensor(cpu, &[values[comm.rank()]]);
        comm.all_reduce(&t, ReduceOp::Sum).unwrap();
        t.to_vec::<f32>().unwrap()[0]
    });
    assert_eq!(results, [0.0; 3]);
    assert_eq!((values[0] + values[1]) + values[2], 0.0);
    assert_eq!(values[0] + (values[1] + values[2]), 1.0);
    // bf16 sums in f32 and rounds once: 256 + 1 + 1 is 258, exactly a bf16.
    let results = InProcessGroup::run_on_threads(InProcessGroup::ranks(3).unwrap(), |comm| {
        let cpu = &CpuBackend::new_ref();
        let value = [256.0, 1.0, 1.0][comm.rank()];
        let t = Tensor::from_f64s(cpu, &[value], &[1], DType::BF16).unwrap();
        comm.all_reduce(&t, ReduceOp::Sum).unwrap();
        t.to_vec_f64().unwrap()[0]
    });
    assert_eq!(results, [258.0; 3]);
}

#[test]
fn ranks_that_disagree_get_a_typed_error() {
    let results = InProcessGroup::run_on_threads(InProcessGroup::ranks(2).unwrap(), |comm| {
        let cpu = &CpuBackend::new_ref();
        let n = 2 + comm.rank();
        let t = Tensor::zeros(cpu, &[n], DType::F32).unwrap();
        comm.all_reduce(&t, ReduceOp::Sum).unwrap_err()
    });
    for err in results {
        match &err {
            DistributedError::Mismatch {
                call: 0,
                rank: 1,
                expected,
                got,
            } => {
                assert_eq!(expected, "all_reduce(Sum, F32 × 2)");
                assert_eq!(got, "all_reduce(Sum, F32 × 3)");
            }
            other => panic!("not a mismatch: {other}"),
        }
    }
}

#[test]
fn a_missing_rank_times_out_instead_of_hanging() {
    let mut ranks = InProcessGroup::ranks_with_timeout(2, Duration::from_millis(200)).unwrap();
    let _absent = ranks.pop();
    let comm = Arc::new(ranks.remove(0));
    let err = comm.barrier().unwrap_err();
    assert!(
        matches!(
            err,
            DistributedError::Timeout {
                rank: 0,
                call: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn bad_buffers_are_refused() {
    let mut ranks = InProcessGroup::ranks(1).unwrap();
    let comm = ranks.remove(0);
    let cpu = CpuBackend::new_ref();
    let square = Tensor::zeros(&cpu, &[2, 3], DType::F32).unwrap();
    let strided = square.transpose(0, 1).unwrap();
    let err = comm.all_reduce(&strided, ReduceOp::Sum).unwrap_err();
    assert!(err.to_string().contains("not contiguous"), "{err}");
    let ints = Tensor::zeros(&cpu, &[2], DType::I64).unwrap();
    let err = comm.all_reduce(&ints, ReduceOp::Sum).unwrap_err();
    assert!(err.to_string().contains("float dtype"), "{err}");
    let out = Tensor::zeros(&cpu, &[4], DType::F32).unwrap();
    let err = comm
        .all_gather(&square.reshape(&[6]).unwrap(), &out)
        .unwrap_err();
    assert!(err.to_string().contains("chunks"), "{err}");
}

/// Reduce-scatter and all-gather take disjoint buffers or NCCL's in-place layout (the smaller
/// buffer is exactly this rank's chunk of the larger); any other overlap is a typed error, as
/// NCCL leaves it undefined. Before the check the in-process group copied its way through any
/// overlap, so CPU tests could not see what NCCL would corrupt.
#[test]
fn overlapping_buffers_are_refused_unless_in_place() {
    let ranks = InProcessGroup::ranks(2).unwrap();
    let outcomes = InProcessGroup::run_on_threads(ranks, |comm| {
        let cpu = &CpuBackend::new_ref();
        let rank = comm.rank();
        let big = tensor(cpu, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        // In place: rank r's chunk of `big` (elements 4r..4r+4).
        let own = big.narrow(0, 4 * rank, 4).unwrap();
        // Overlapping, shifted by one element from the rank's chunk.
        let shifted = big.narrow(0, if rank == 0 { 1 } else { 3 }, 4).unwrap();
        let bad_scatter = comm
            .reduce_scatter(&big, &shifted, ReduceOp::Sum)
            .unwrap_err();
        let bad_gather = comm.all_gather(&shifted, &big).unwrap_err();
        comm.reduce_scatter(&big, &own, ReduceOp::Sum).unwrap();
        let scattered = own.to_vec::<f32>().unwrap();
        let gathered = tensor(cpu, &[0.0; 8]);
        let mine = gathered.narrow(0, 4 * rank, 4).unwrap();
        mine.copy_(&tensor(cpu, &[10.0 * (rank + 1) as f32; 4]))
            .unwrap();
        comm.all_gather(&mine, &gathered).unwrap();
        (
            bad_scatter,
            bad_gather,
            scattered,
            gathered.to_vec::<f32>().unwrap(),
        )
    });
    for (rank, (bad_scatter, bad_gather, scattered, gathered)) in outcomes.into_iter().enumerate() {
        for err in [bad_scatter, bad_gather] {
            assert!(
                matches!(err, DistributedError::InvalidArgument { .. })
                    && err.to_string().contains("overlap"),
                "rank {rank}: {err}"
            );
        }
        // Both ranks hold 1..8: the sum of chunk r is twice it.
        let chunk: Vec<f32> = (0..4).map(|i| 2.0 * (4 * rank + i + 1) as f32).collect();
        assert_eq!(scattered, chunk, "rank {rank}");
        assert_eq!(gathered, [10.0, 10.0, 10.0, 10.0, 20.0, 20.0, 20.0, 20.0]);
    }
}
