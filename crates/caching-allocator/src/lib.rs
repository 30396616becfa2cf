//! A caching device-memory allocator with the semantics of PyTorch's CUDA caching allocator,
//! its statistics, history and snapshots — and less fragmentation.
//!
//! The allocator is *policy × storage*. The policy ([`CachingAllocator`]) rounds requests, keeps
//! freed blocks in per-stream pools, splits and merges them, defers frees behind stream events,
//! grows expandable segments page by page and keeps every statistic of
//! `torch.cuda.memory_stats()`. The storage ([`Storage`]) only hands out segments and maps pages:
//! [`HostStorage`] (real host memory), [`SimulatedStorage`] (addresses only, for trace replay and
//! tests) and, behind the `cuda` feature, `CudaStorage` (the CUDA driver API through cudarc) and
//! `PinnedHostStorage` (page-locked host memory, PyTorch's `CachingHostAllocator` with this
//! policy).
//!
//! CUDA graph capture routes a stream's requests to a private pool
//! ([`CachingAllocator::begin_allocate_to_pool`]), whose memory stays reserved for the graph until
//! the pool is released, as PyTorch's graph pools do.
//!
//! [`replay_trace`] runs a recorded PyTorch trace through any policy, starting from its
//! baseline: the blocks that were live before the recording began ([`RecordedTrace`]), so a
//! what-if's peaks count the parameters a snapshot holds but its history never allocates.
//! [`replay_trace_at_recorded_addresses`] also places segments where the recording's device
//! did, so PyTorch's own policies ([`AllocatorConfig::pytorch_defaults`],
//! [`AllocatorConfig::pytorch_expandable`]) replay its runs to the byte.
//!
//! This crate sits at the bottom of Headroom: it knows nothing about tensors, autograd or
//! kernels, and it can be used alone in any trainer that owns its buffers.
//!
//! ```
//! use headroom_caching_allocator::{AllocatorConfig, CachingAllocator, HostStorage, StreamId};
//!
//! let allocator = CachingAllocator::new(HostStorage::new(), AllocatorConfig::default());
//! let block = allocator.allocate(1000, StreamId::DEFAULT)?;
//! assert_eq!(block.size(), 1024); // rounded to 512 bytes
//! assert_eq!(allocator.memory_allocated(), 1024);
//! allocator.free(block)?;
//! assert_eq!(allocator.memory_reserved(), 2 << 20); // the small-pool segment stays cached
//! allocator.empty_cache()?;
//! assert_eq!(allocator.memory_reserved(), 0);
//! # Ok::<(), headroom_caching_allocator::AllocError>(())
//! ```
//!
//! # Crate features
//! - `cuda`: adds `CudaStorage` (device memory) and `PinnedHostStorage` (page-locked host memory
//!   for asynchronous copies). Adds capability only; the policy and its numbers do not change.

mod allocator;
mod config;
mod error;
mod free_index;
mod history;
mod replay;
mod report;
mod snapshot;
mod stats;
mod storage;
mod view;

pub use allocator::{
    Allocation, AllocatorId, CachingAllocator, ContextGuard, PrivatePoolId, PrivatePoolUsage,
    PRIVATE_POOL_STREAM_BASE,
};
pub use config::{
    AllocatorConfig, AllocatorConfigBuilder, ALLOC_CONF_ENV, NO_CACHING_ENV, ROUNDUP_INTERVALS,
};
pub use error::{AllocError, OutOfMemoryReport, PrivatePoolMisuse};
pub use history::HistoryOptions;
pub use replay::{
    replay_trace, replay_trace_at_recorded_addresses, LiveBlock, RecordedTrace, ReplayReport,
    BASELINE_LABEL,
};
pub use report::{format_size, memory_summary};
pub use snapshot::{
    pickle_opcodes, read_json, read_pickle, read_trace_tsv, trace_events_from_snapshot, write_json,
    write_pickle, BlockSnapshot, BlockState, Frame, Frames, SegmentSnapshot, Snapshot, TraceAction,
    TraceEntry, TraceEvent, Value, VIEWER_OPCODES,
};
pub use stats::{FragmentationStats, MemoryStats, PoolKind, Stat, StatArray};
pub use storage::{
    EventControl, EventId, HostStorage, MappingUnits, MemoryInfo, SegmentPlacement,
    SimulatedStorage, Storage, StorageError, StreamId,
};
pub use view::AllocatorView;

#[cfg(feature = "cuda")]
pub use storage::{
    cuda_library_present, CudaStorage, CudaStorageOptions, PinnedHostOptions, PinnedHostStorage,
};
