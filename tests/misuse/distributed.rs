//! Misuse of headroom-distributed on the in-process group (one thread and CPU backend per rank):
//! group sizes, collectives over buffers that overlap or do not divide, roots out of range, ranks
//! that disagree or never arrive, sharded optimizers and shard layouts out of range, rendezvous
//! files that are missing, short or unwritable.

use std::sync::Arc;
use std::time::Duration;

use headroom_autograd_core::{DType, Tensor};
use headroom_distributed::{
    Communicator, DistributedError, FileRendezvous, InProcessComm, InProcessGroup, ReduceOp,
    ShardClipping, ShardConfig, ShardLayout, ShardedOptimizer, UniqueId,
};
use headroom_hooks::{ClipMode, Clipping, InBackwardConfig};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{AdafactorConfig, AdamConfig, SgdConfig};
use headroom_optim::{Implementation, NormType, ParamGroup};

use crate::{expect_eq, expect_err, f32s, param, temp_path, Case, Outcome};
use headroom_testkit::misuse_cases;

/// The one rank of a group of one.
fn solo() -> Result<InProcessComm, DistributedError> {
    Ok(InProcessGroup::ranks(1)?.remove(0))
}

/// `Ok` when `result` is [`DistributedError::InvalidArgument`] from `op`.
fn invalid_argument<T>(result: Result<T, DistributedError>, op: &str) -> Outcome {
    let outcome: Outcome =
        expect_err!(result, DistributedError::InvalidArgument { op: got, .. } if *got == op);
    outcome.map_err(|err| format!("expecting InvalidArgument from {op}: {err}").into())
}

/// A sharded optimizer of `config` over one parameter of four elements, on a group of one, in
/// buckets of 1 MiB.
fn sharded<R: headroom_optim::UpdateRule>(
    config: R,
    clipping: Option<ShardClipping>,
) -> Result<ShardedOptimizer, DistributedError> {
    let p = param(&CpuBackend::new_ref(), &[1.0; 4])?;
    ShardedOptimizer::new(
        vec![ParamGroup::new(vec![p], config)],
        Implementation::Fused,
        Arc::new(solo()?),
        ShardConfig {
            bucket_bytes: 1 << 20,
            clipping,
        },
    )
}

/// The shard layout of one parameter of four elements over `world_size` ranks, seen from `rank`.
fn shard_layout_refused(rank: usize, world_size: usize) -> Outcome {
    let p = param(&CpuBackend::new_ref(), &[1.0; 4])?;
    invalid_argument(ShardLayout::new(&[p], rank, world_size), "ShardLayout::new")
}

pub(crate) fn cases() -> Vec<Case> {
    fn all_ok(outcomes: Vec<Outcome>) -> Outcome {
        let failures: Vec<String> = outcomes
            .into_iter()
            .enumerate()
            .filter_map(|(rank, outcome)| outcome.err().map(|err| format!("rank {rank}: {err}")))
            .collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(failures.join("; ").into())
        }
    }
    misuse_cases![
        group_of_0_ranks_is_invalid_argument => {
            expect_err!(
                InProcessGroup::ranks(0),
                DistributedError::InvalidArgument { .. }
            )
        },
        reduce_scatter_into_another_ranks_chunk_is_invalid_argument => {
            // Each rank's output is the chunk of its input that belongs to the other rank:
            // it overlaps the input other than in NCCL's in-place layout.
            all_ok(InProcessGroup::run_on_threads(
                InProcessGroup::ranks(2)?,
                |comm| {
                    let cpu = &CpuBackend::new_ref();
                    let input = Tensor::ones(cpu, &[4], DType::F32)?;
                    let other = 1 - comm.rank();
                    let output = input.narrow(0, 2 * other, 2)?;
                    expect_err!(
                        comm.reduce_scatter(&input, &output, ReduceOp::Sum),
                        DistributedError::InvalidArgument { op: "reduce_scatter", .. },
                        naming "overlap"
                    )
                },
            ))
        },
        reduce_scatter_in_nccls_in_place_layout_sums_each_chunk => {
            all_ok(InProcessGroup::run_on_threads(
                InProcessGroup::ranks(2)?,
                |comm| {
                    let cpu = &CpuBackend::new_ref();
                    let r = comm.rank() as f32;
                    let input = f32s(cpu, &[r, r + 1.0, 10.0 * r, 10.0 * r + 1.0], &[4])?;
                    let output = input.narrow(0, 2 * comm.rank(), 2)?;
                    comm.reduce_scatter(&input, &output, ReduceOp::Sum)?;
                    let expected = [vec![1.0, 3.0], vec![10.0, 12.0]][comm.rank()].clone();
                    expect_eq(output.to_vec::<f32>()?, expected)
                },
            ))
        },
        all_gather_from_a_partly_overlapping_input_is_invalid_argument => {
            let whole = Tensor::zeros(&CpuBackend::new_ref(), &[4], DType::F32)?;
            let (input, output) = (whole.narrow(0, 1, 3)?, whole.narrow(0, 0, 3)?);
            invalid_argument(solo()?.all_gather(&input, &output), "all_gather")
        },
        reduce_scatter_of_sizes_that_do_not_divide_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let input = Tensor::zeros(&cpu, &[3], DType::F32)?;
            let output = Tensor::zeros(&cpu, &[2], DType::F32)?;
            invalid_argument(
                solo()?.reduce_scatter(&input, &output, ReduceOp::Sum),
                "reduce_scatter",
            )
        },
        broadcast_from_a_root_out_of_range_is_invalid_argument => {
            let comm = solo()?;
            let cpu = CpuBackend::new_ref();
            let t = Tensor::zeros(&cpu, &[2], DType::F32)?;
            expect_err!(
                comm.broadcast(&t, 1),
                DistributedError::InvalidArgument { op: "broadcast", .. },
                naming "root 1"
            )
        },
        all_reduce_of_an_integer_tensor_is_invalid_argument => {
            let t = Tensor::from_slice(&CpuBackend::new_ref(), &[1i64, 2], &[2])?;
            invalid_argument(solo()?.all_reduce(&t, ReduceOp::Sum), "all_reduce")
        },
        all_reduce_of_a_non_contiguous_tensor_is_invalid_argument => {
            let t = Tensor::zeros(&CpuBackend::new_ref(), &[2, 3], DType::F32)?.t()?;
            invalid_argument(solo()?.all_reduce(&t, ReduceOp::Sum), "all_reduce")
        },
        ranks_reducing_different_sizes_is_mismatch => {
            let outcomes = InProcessGroup::run_on_threads(InProcessGroup::ranks(2)?, |comm| {
                let cpu = &CpuBackend::new_ref();
                let t = Tensor::zeros(cpu, &[2 + comm.rank()], DType::F32)?;
                expect_err!(
                    comm.all_reduce(&t, ReduceOp::Sum),
                    DistributedError::Mismatch { rank: 1, .. }
                )
            });
            all_ok(outcomes)
        },
        a_rank_that_never_arrives_is_timeout => {
            let mut ranks = InProcessGroup::ranks_with_timeout(2, Duration::from_millis(50))?;
            let absent = ranks.pop();
            let res = expect_err!(
                ranks[0].barrier(),
                DistributedError::Timeout {
                    rank: 0,
                    call: 0,
                    ..
                }
            );
            drop(absent);
            res
        },
        sharded_adafactor_is_invalid_argument =>
            invalid_argument(sharded(AdafactorConfig::new(), None), "ShardedOptimizer::new"),
        sharded_clipping_to_a_negative_norm_is_invalid_argument => {
            let clipping = ShardClipping {
                max_norm: -1.0,
                norm: NormType::L2,
            };
            invalid_argument(
                sharded(AdamConfig::adamw(), Some(clipping)),
                "ShardedOptimizer::new",
            )
        },
        sharded_optimizer_into_in_backward_with_clipping_is_invalid_argument => {
            let sharded = sharded(SgdConfig::new(0.1), None)?;
            expect_err!(
                sharded.into_in_backward(InBackwardConfig {
                    clipping: Some(Clipping {
                        max_norm: 1.0,
                        norm: NormType::L2,
                        mode: ClipMode::Exact
                    }),
                    ..InBackwardConfig::default()
                }),
                DistributedError::InvalidArgument { .. }
            )
        },
        group_of_usize_max_ranks_is_invalid_argument =>
            invalid_argument(InProcessGroup::ranks(usize::MAX), "InProcessGroup::ranks"),
        rendezvous_never_published_is_io_after_the_wait => {
            let rendezvous = FileRendezvous::new(&temp_path("never_published"));
            expect_err!(
                rendezvous.wait(Duration::from_millis(30)),
                DistributedError::Io {
                    what: "waiting for",
                    ..
                }
            )
        },
        rendezvous_file_of_5_bytes_is_io_naming_its_length => {
            let path = temp_path("short_rendezvous");
            std::fs::write(&path, b"hello")?;
            let res = FileRendezvous::new(&path).wait(Duration::from_millis(30));
            let _ = std::fs::remove_file(&path);
            expect_err!(res, DistributedError::Io { what: "reading", .. }, naming "5 bytes")
        },
        rendezvous_published_into_a_missing_directory_is_io => {
            let path = temp_path("no_such_dir").join("id");
            expect_err!(
                FileRendezvous::new(&path).publish(&UniqueId::from_bytes(b"id")),
                DistributedError::Io {
                    what: "writing",
                    ..
                }
            )
        },
        shard_layout_over_0_ranks_is_invalid_argument => shard_layout_refused(0, 0),
        shard_layout_of_a_rank_outside_the_group_is_invalid_argument => shard_layout_refused(2, 2),
    ]
}
