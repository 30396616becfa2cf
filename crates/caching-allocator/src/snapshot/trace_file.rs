//! TSV traces (being written).

use std::io::Read;

use super::TraceAction;
use crate::error::AllocError;

/// One event of an allocator trace file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEvent {
    /// What happened.
    pub action: TraceAction,
    /// Block or segment address.
    pub addr: u64,
    /// Bytes (requested size for `alloc`).
    pub size: u64,
    /// Stream.
    pub stream: u64,
}

/// Reads a TSV trace (gzipped or not).
pub fn read_trace_tsv(reader: impl Read) -> Result<Vec<TraceEvent>, AllocError> {
    let _ = reader;
    unimplemented!()
}
