//! The crate's one error type.
//!
//! Every fallible call of this crate returns [`AllocError`]. Out-of-memory carries a full
//! [`OutOfMemoryReport`] so that a caller can print PyTorch's message or read the figures.

use crate::storage::StorageError;

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
