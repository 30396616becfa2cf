//! Snapshots and allocator traces in PyTorch's structure, and their files.
//!
//! [`Snapshot`] is what `torch.cuda.memory._snapshot()` returns: `segments` (each with its
//! `blocks`), `device_traces` (the recorded history, oldest first) and `allocator_settings`.
//! The model here is plain data; it is produced by the policy (`crate::allocator`) and by the
//! readers, and turned into files by:
//! - `pickle`: protocol-4 pickles that use only the opcodes PyTorch's memory viewer reads, and a
//!   reader for PyTorch's own snapshot pickles;
//! - `json`: the same structure as JSON (the newest viewer parses JSON first);
//! - `trace_file`: PyTorch allocator traces as TSV (optionally gzipped).
//!
//! [`Value`] is the dynamic value both file formats map to; the typed model streams into a
//! writer's `sink` and is read `from_value`, so neither format knows the other.

mod from_value;
mod json;
mod pickle;
mod sink;
mod trace_file;

use std::sync::Arc;

use crate::stats::PoolKind;

pub use json::{read_json, write_json};
pub use pickle::{pickle_opcodes, read_pickle, write_pickle, VIEWER_OPCODES};
pub use trace_file::{read_trace_tsv, trace_events_from_snapshot, TraceEvent};

/// A dynamic value of a pickle or JSON document.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Python `None`, JSON `null`.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer; the writers refuse nothing here since every `i64` is below 2^63.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A list.
    List(Vec<Value>),
    /// A tuple (a list in JSON).
    Tuple(Vec<Value>),
    /// A dict, in insertion order.
    Dict(Vec<(Value, Value)>),
}

/// One stack frame. Headroom records its context labels (`forward`, `encoder.3`, `mlp`) as frames
/// with `filename` "headroom:context", `line` 0 and the label as `name`; frames are listed
/// innermost first, as in PyTorch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Source file, or "headroom:context" for a context label.
    pub filename: String,
    /// Line number, 0 for a context label.
    pub line: i64,
    /// Function name, or the context label.
    pub name: String,
}

impl Frame {
    /// The frame that records context label `label`.
    pub fn context(label: impl Into<String>) -> Frame {
        Frame {
            filename: crate::history::CONTEXT_FILENAME.to_owned(),
            line: 0,
            name: label.into(),
        }
    }
}

/// A shared, immutable list of frames (innermost first).
pub type Frames = Arc<[Frame]>;

/// What a trace entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceAction {
    /// A client allocation (`size` is the requested size).
    Alloc,
    /// A client free; the block may still wait for other streams.
    FreeRequested,
    /// The block really became free.
    FreeCompleted,
    /// A free whose request and completion the viewer collapsed into one event.
    Free,
    /// A segment obtained from the storage.
    SegmentAlloc,
    /// A segment returned to the storage.
    SegmentFree,
    /// Pages mapped into an expandable segment.
    SegmentMap,
    /// Pages unmapped from an expandable segment.
    SegmentUnmap,
    /// A snapshot was taken (`size`: active bytes).
    Snapshot,
    /// An allocation failed (`addr` holds the free device bytes, stored as `device_free`).
    Oom,
}

impl TraceAction {
    /// PyTorch's name for the action.
    pub fn name(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::Free => "free",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Snapshot => "snapshot",
            TraceAction::Oom => "oom",
        }
    }

    /// The action with PyTorch's name `name`.
    pub fn from_name(name: &str) -> Option<TraceAction> {
        Some(match name {
            "alloc" => TraceAction::Alloc,
            "free_requested" => TraceAction::FreeRequested,
            "free_completed" => TraceAction::FreeCompleted,
            "free" => TraceAction::Free,
            "segment_alloc" => TraceAction::SegmentAlloc,
            "segment_free" => TraceAction::SegmentFree,
            "segment_map" => TraceAction::SegmentMap,
            "segment_unmap" => TraceAction::SegmentUnmap,
            "snapshot" => TraceAction::Snapshot,
            "oom" => TraceAction::Oom,
            _ => return None,
        })
    }
}

/// One entry of the recorded history (`device_traces[d][i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// The block or segment address; for [`TraceAction::Oom`], the free device bytes.
    pub addr: u64,
    /// Bytes (see [`TraceAction`] for which size each action records).
    pub size: u64,
    /// The stream.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// The context at the time, innermost first (empty when none was recorded).
    pub frames: Frames,
}

/// The state of a block in a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Handed out to a client.
    ActiveAllocated,
    /// Freed by the client, waiting for events on other streams.
    ActivePendingFree,
    /// Free.
    Inactive,
}

impl BlockState {
    /// PyTorch's name for the state.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }

    /// The state with PyTorch's name (also the docstring's "active_awaiting_free").
    pub fn from_name(name: &str) -> Option<BlockState> {
        Some(match name {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" | "active_awaiting_free" => BlockState::ActivePendingFree,
            "inactive" => BlockState::Inactive,
            _ => return None,
        })
    }
}

/// One block of a segment in a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockSnapshot {
    /// Start address.
    pub address: u64,
    /// Size in bytes (rounded).
    pub size: u64,
    /// Bytes the client asked for (for a free block, what its last client asked for, or 0).
    pub requested_size: u64,
    /// Allocated, pending free, or free.
    pub state: BlockState,
    /// The context of its allocation, innermost first.
    pub frames: Frames,
}

/// One segment in a snapshot; for expandable segments, one contiguous mapped range.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentSnapshot {
    /// Device index.
    pub device: i64,
    /// Start address.
    pub address: u64,
    /// Bytes in the segment (Σ block sizes).
    pub total_size: u64,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of allocated and pending-free blocks.
    pub active_size: u64,
    /// Bytes requested by the clients of active blocks.
    pub requested_size: u64,
    /// The stream the segment serves.
    pub stream: u64,
    /// Small or large pool.
    pub segment_type: PoolKind,
    /// Private pool id; (0, 0) for the default pools.
    pub segment_pool_id: (i64, i64),
    /// Whether this is (part of) an expandable segment.
    pub is_expandable: bool,
    /// The context at the segment's creation.
    pub frames: Frames,
    /// The blocks, in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// `torch.cuda.memory._snapshot()`'s structure.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    /// Segments, sorted by address.
    pub segments: Vec<SegmentSnapshot>,
    /// One history per device, oldest entry first.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The allocator's settings, as PyTorch names them.
    pub allocator_settings: Vec<(String, Value)>,
    /// Entries PyTorch keeps under `external_annotations`, carried through unchanged.
    pub external_annotations: Vec<Value>,
}
