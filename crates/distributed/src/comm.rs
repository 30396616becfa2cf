//! The [`Communicator`] trait: the five collectives data parallelism needs, over tensors, with
//! the bytes of each counted.
//!
//! Semantics are NCCL's: every rank of a group calls the same collectives in the same order with
//! the same sizes; buffers are contiguous tensors of one dtype on the rank's device; a
//! reduce-scatter's input holds `world_size` equal chunks, rank `r` receiving the reduction of
//! chunk `r`; an all-gather's output holds every rank's input, by rank. A collective returns once
//! this rank's result is ordered after its inputs on the device (at once on the CPU; on CUDA, in
//! the compute stream's order), so the caller may free or reuse the buffers afterwards as it
//! would any tensor.
//!
//! This module knows no transport: the in-process group (`crate::in_process`) and NCCL
//! (`crate::nccl`) implement it.

use headroom_autograd_core::{DType, Tensor};

use crate::error::DistributedError;

/// How a reduction combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The largest element.
    Max,
}

/// Which collective a count is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's tensor.
    AllReduce,
    /// Rank `r` ends with the reduction of every rank's chunk `r`.
    ReduceScatter,
    /// Every rank ends with every rank's tensor, by rank.
    AllGather,
    /// Every rank ends with the root's tensor.
    Broadcast,
    /// Nothing moves; every rank waits for all.
    Barrier,
}

/// Calls and bytes of one collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectiveCount {
    /// Times it was called.
    pub calls: u64,
    /// The bytes of its full buffer, summed over calls: an all-reduce's or a broadcast's tensor,
    /// a reduce-scatter's input, an all-gather's output (so a reduce-scatter and an all-gather of
    /// the same buffer count alike, as NCCL's tests count `size`).
    pub bytes: u64,
}

/// What one rank's communicator has done: calls and bytes per collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// All-reduces.
    pub all_reduce: CollectiveCount,
    /// Reduce-scatters.
    pub reduce_scatter: CollectiveCount,
    /// All-gathers.
    pub all_gather: CollectiveCount,
    /// Broadcasts.
    pub broadcast: CollectiveCount,
    /// Barriers (no bytes).
    pub barrier: CollectiveCount,
}

impl CommStats {
    /// Adds one call of `collective` over a full buffer of `bytes`.
    pub fn record(&mut self, collective: Collective, bytes: u64) {
        let count = match collective {
            Collective::AllReduce => &mut self.all_reduce,
            Collective::ReduceScatter => &mut self.reduce_scatter,
            Collective::AllGather => &mut self.all_gather,
            Collective::Broadcast => &mut self.broadcast,
            Collective::Barrier => &mut self.barrier,
        };
        count.calls += 1;
        count.bytes += bytes;
    }

    /// The bytes each rank sends over the wire with ring algorithms in a group of `world_size`:
    /// `(n − 1)/n` of the buffer for a reduce-scatter and an all-gather, twice that for an
    /// all-reduce (which is a reduce-scatter then an all-gather), the buffer for a broadcast.
    /// Rounded down to whole bytes per collective kind.
    pub fn ring_bytes_sent(&self, world_size: usize) -> u64 {
        let n = world_size as u64;
        if n <= 1 {
            return 0;
        }
        let part = |bytes: u64| bytes / n * (n - 1) + bytes % n * (n - 1) / n;
        2 * part(self.all_reduce.bytes)
            + part(self.reduce_scatter.bytes)
            + part(self.all_gather.bytes)
            + self.broadcast.bytes
    }

    /// What was counted since `earlier` (a snapshot of the same communicator).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let diff = |now: CollectiveCount, then: CollectiveCount| CollectiveCount {
            calls: now.calls - then.calls,
            bytes: now.bytes - then.bytes,
        };
        CommStats {
            all_reduce: diff(self.all_reduce, earlier.all_reduce),
            reduce_scatter: diff(self.reduce_scatter, earlier.reduce_scatter),
            all_gather: diff(self.all_gather, earlier.all_gather),
            broadcast: diff(self.broadcast, earlier.broadcast),
            barrier: diff(self.barrier, earlier.barrier),
        }
    }
}

/// One rank's end of a group of `world_size` ranks, with NCCL's collectives. Object-safe: the
/// sharded optimizer holds an `Arc<dyn Communicator>`.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank, in `0..world_size`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// Replaces `tensor` on every rank by the reduction of all ranks' `tensor`.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), DistributedError>;
    /// Writes into `output` the reduction over ranks of chunk `rank` of `input`, which holds
    /// `world_size` chunks of `output`'s size.
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<(), DistributedError>;
    /// Writes into `output` (`world_size` chunks of `input`'s size) every rank's `input`, by rank.
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<(), DistributedError>;
    /// Replaces `tensor` on every rank by rank `root`'s.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), DistributedError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), DistributedError>;
    /// What this rank has done so far.
    fn stats(&self) -> CommStats;
}

/// The two buffers of a reduce-scatter or all-gather: `big` holds `world_size` chunks of
/// `small`'s size, and this rank's chunk is chunk `rank`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunks<'a> {
    pub(crate) big: &'a Tensor,
    pub(crate) small: &'a Tensor,
    pub(crate) world_size: usize,
    pub(crate) rank: usize,
}

/// Checks the buffers of a collective as every communicator must: contiguous, one float dtype,
/// and for reduce-scatter and all-gather (`chunks`; `None` for the others) `big` holding
/// `world_size` times the elements of `small`, the two either disjoint or in NCCL's in-place
/// layout (`small` is exactly this rank's chunk of `big`): NCCL defines no other overlap, and
/// the in-process communicator refuses the same so that CPU tests see what NCCL would do.
/// Returns the buffers' dtype.
pub(crate) fn check_buffers(
    op: &'static str,
    tensors: &[&Tensor],
    chunks: Option<Chunks<'_>>,
) -> Result<DType, DistributedError> {
    let dtype = tensors[0].dtype();
    for tensor in tensors {
        if !tensor.is_contiguous() {
            return Err(DistributedError::InvalidArgument {
                op,
                reason: format!(
                    "a buffer of shape {:?} is not contiguous; collectives read and write dense \
                     memory (call .contiguous() first)",
                    tensor.shape()
                ),
            });
        }
        if tensor.dtype() != dtype
            || !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
        {
            return Err(DistributedError::InvalidArgument {
                op,
                reason: format!(
                    "buffers of {:?} and {dtype:?}; a collective takes one float dtype (f32, f64, \
                     f16, bf16)",
                    tensor.dtype()
                ),
            });
        }
    }
    if let Some(Chunks {
        big,
        small,
        world_size,
        rank,
    }) = chunks
    {
        if big.numel() != small.numel() * world_size {
            return Err(DistributedError::InvalidArgument {
                op,
                reason: format!(
                    "{} elements are not {world_size} chunks of {}",
                    big.numel(),
                    small.numel()
                ),
            });
        }
        let (big_bytes, small_bytes) = (byte_range(big), byte_range(small));
        let overlap = big_bytes.start < small_bytes.end && small_bytes.start < big_bytes.end;
        let chunk_bytes = small_bytes.end - small_bytes.start;
        let in_place = small_bytes.start == big_bytes.start + rank as u64 * chunk_bytes;
        if overlap && !in_place {
            return Err(DistributedError::InvalidArgument {
                op,
                reason: format!(
                    "the input and output overlap other than in place (rank {rank}'s chunk of \
                     the larger buffer is exactly the smaller one); use disjoint buffers or \
                     that layout"
                ),
            });
        }
    }
    Ok(dtype)
}

/// The device (or host) bytes `tensor` spans: contiguous, so its elements are one range.
fn byte_range(tensor: &Tensor) -> std::ops::Range<u64> {
    let elem = tensor.dtype().size_in_bytes() as u64;
    let start = tensor.buffer().address() + tensor.layout().offset() as u64 * elem;
    start..start + tensor.numel() as u64 * elem
}
