//! The crate's one error type.
//!
//! Every fallible call of this crate returns [`AllocError`]. Out-of-memory carries a full
//! [`OutOfMemoryReport`] so that a caller can print PyTorch's message or read the figures; a
//! refused private-pool call carries a [`PrivatePoolMisuse`] that says what to do instead.

use crate::allocator::PrivatePoolId;
use crate::storage::{StorageError, StreamId};

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// No memory for the request, after freeing the cache and retrying.
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemoryReport>),
    /// `free` or `record_stream` named an address this allocator did not hand out (or already
    /// took back).
    #[error("address {address:#x} is not a live allocation of this allocator")]
    UnknownAddress {
        /// The address given.
        address: u64,
    },
    /// An allocator setting is malformed or out of range.
    #[error("invalid allocator setting `{key}`: {reason}")]
    InvalidConfig {
        /// The option's name (`max_split_size_mb`, ...).
        key: String,
        /// What is wrong with its value.
        reason: String,
    },
    /// A private-pool call that the pools' state does not allow; the message says what to do.
    #[error("private pool {pool}: {misuse}")]
    PrivatePool {
        /// The pool the call named (for a virtual stream passed as a device stream, its pool).
        pool: PrivatePoolId,
        /// What was wrong.
        misuse: PrivatePoolMisuse,
    },
    /// The storage failed in a way that is not out-of-memory.
    #[error("storage error: {0}")]
    Storage(#[from] StorageError),
    /// A snapshot or trace file could not be read or written.
    #[error("{format} error: {reason}")]
    Format {
        /// "pickle", "json", "trace", ...
        format: &'static str,
        /// What was wrong, with the position where known.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Why a private-pool call was refused ([`AllocError::PrivatePool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PrivatePoolMisuse {
    /// The pool is not live: never created by this allocator, or already released.
    #[error(
        "not a live pool of this allocator (never created here, or already released): create one \
         with `create_private_pool`"
    )]
    NotLive,
    /// Another routing is in force; only one at a time is.
    #[error(
        "allocations of stream {} are already routed to private pool {pool}: call \
         `end_allocate_to_pool` first",
        .stream.0
    )]
    RoutingActive {
        /// The stream routed now.
        stream: StreamId,
        /// The pool it is routed to.
        pool: PrivatePoolId,
    },
    /// The call needs the routing to end (a capture may be under way).
    #[error(
        "allocations are being routed to it: end the capture and call `end_allocate_to_pool` \
         first"
    )]
    BeingRouted,
    /// The pool serves another stream: a pool's blocks are used on one stream.
    #[error("it serves stream {}: create another private pool for this stream", .0.0)]
    OtherStream(StreamId),
    /// A pool's virtual stream ([`PrivatePoolId::stream`]) was passed as a device stream.
    #[error(
        "its virtual stream is not a device stream: allocate on the stream routed to it \
         (`begin_allocate_to_pool`)"
    )]
    VirtualStream,
}

/// Everything known when an allocation fails; its `Display` is the error message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemoryReport {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Bytes the allocator tried to obtain from the storage (the segment it would have created).
    pub attempted: u64,
    /// Total device memory.
    pub capacity: u64,
    /// Device memory still free.
    pub free: u64,
    /// The limit set by `per_process_memory_fraction`, if any.
    pub allowed: Option<u64>,
    /// Bytes allocated by this allocator.
    pub allocated: u64,
    /// Bytes reserved by this allocator but not allocated.
    pub reserved_unallocated: u64,
    /// The largest free cached block (any pool, any stream).
    pub largest_free_block: u64,
    /// Whether turning on expandable segments would likely have helped: they are off and the
    /// reserved-but-unallocated memory alone would have covered the request.
    pub suggest_expandable_segments: bool,
    /// The storage's name ("cuda", "host", "simulated").
    pub storage: &'static str,
}
