//! The typed snapshot model streamed into a [`Sink`], in exactly the structure that PyTorch's
//! `torch.cuda.memory._snapshot()` returns: every key PyTorch writes, in PyTorch's order.
//!
//! It sits on the model types of `super` and on [`Value`]. It knows no file format: the pickle
//! and JSON writers are sinks, so a snapshot with a million trace entries is written without
//! building a [`Value`] tree first. Unsigned fields are written as Python ints, so a value of
//! 2^63 or more is an error rather than a silent wrap. Reading is `from_value`'s.

use super::{Frame, Frames, SegmentSnapshot, Snapshot, TraceAction, TraceEntry, Value};
use crate::error::AllocError;

/// A scalar handed to a [`Sink`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Scalar<'v> {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'v str),
}

/// The kinds of container a [`Sink`] opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Container {
    List,
    Tuple,
    /// Items are a key then a value, each a full value.
    Dict,
}

/// A streaming writer of a value tree: scalars, and containers opened with their item count
/// and closed after their items. Strings borrow from the data for `'v`, so a sink may memoize
/// them.
pub(super) trait Sink<'v> {
    /// The format's name for errors ("pickle", "json").
    fn format(&self) -> &'static str;

    fn scalar(&mut self, scalar: Scalar<'v>) -> Result<(), AllocError>;

    /// Opens a container of `len` items (pairs, for a dict).
    fn begin(&mut self, container: Container, len: usize) -> Result<(), AllocError>;

    /// Closes the innermost container.
    fn end(&mut self) -> Result<(), AllocError>;

    /// A list of frame dicts; a format that can refer back to an earlier copy of the same
    /// [`Frames`] allocation may override this.
    fn frames(&mut self, frames: &'v Frames) -> Result<(), AllocError> {
        emit_frames(frames, self)
    }
}

/// Streams `value` into `sink`.
pub(super) fn emit_value<'v, S: Sink<'v> + ?Sized>(
    value: &'v Value,
    sink: &mut S,
) -> Result<(), AllocError> {
    match value {
        Value::None => sink.scalar(Scalar::None),
        Value::Bool(flag) => sink.scalar(Scalar::Bool(*flag)),
        Value::Int(int) => sink.scalar(Scalar::Int(*int)),
        Value::Float(float) => sink.scalar(Scalar::Float(*float)),
        Value::Str(text) => sink.scalar(Scalar::Str(text)),
        Value::List(items) | Value::Tuple(items) => {
            let container = if matches!(value, Value::List(_)) {
                Container::List
            } else {
                Container::Tuple
            };
            sink.begin(container, items.len())?;
            for item in items {
                emit_value(item, sink)?;
            }
            sink.end()
        }
        Value::Dict(pairs) => {
            sink.begin(Container::Dict, pairs.len())?;
            for (key, item) in pairs {
                emit_value(key, sink)?;
                emit_value(item, sink)?;
            }
            sink.end()
        }
    }
}

/// Streams the snapshot into `sink` as a dict with `segments`, `device_traces`,
/// `allocator_settings` and `external_annotations`.
///
/// The only error of its own is an unsigned field of 2^63 or more (a [`AllocError::Format`]
/// naming the field); everything else comes from the sink.
pub(super) fn emit_snapshot<'v, S: Sink<'v>>(
    snapshot: &'v Snapshot,
    sink: &mut S,
) -> Result<(), AllocError> {
    sink.begin(Container::Dict, 4)?;
    sink.scalar(Scalar::Str("segments"))?;
    sink.begin(Container::List, snapshot.segments.len())?;
    for (idx, segment) in snapshot.segments.iter().enumerate() {
        emit_segment(segment, idx, sink)?;
    }
    sink.end()?;
    sink.scalar(Scalar::Str("device_traces"))?;
    sink.begin(Container::List, snapshot.device_traces.len())?;
    for (device, trace) in snapshot.device_traces.iter().enumerate() {
        sink.begin(Container::List, trace.len())?;
        for (idx, entry) in trace.iter().enumerate() {
            emit_entry(entry, &|| format!("device_traces[{device}][{idx}]"), sink)?;
        }
        sink.end()?;
    }
    sink.end()?;
    sink.scalar(Scalar::Str("allocator_settings"))?;
    sink.begin(Container::Dict, snapshot.allocator_settings.len())?;
    for (name, value) in &snapshot.allocator_settings {
        sink.scalar(Scalar::Str(name))?;
        emit_value(value, sink)?;
    }
    sink.end()?;
    sink.scalar(Scalar::Str("external_annotations"))?;
    sink.begin(Container::List, snapshot.external_annotations.len())?;
    for value in &snapshot.external_annotations {
        emit_value(value, sink)?;
    }
    sink.end()?;
    sink.end()
}

/// Writes `name` and the scalar `value`.
fn emit_field<'v, S: Sink<'v> + ?Sized>(
    name: &'static str,
    value: Scalar<'v>,
    sink: &mut S,
) -> Result<(), AllocError> {
    sink.scalar(Scalar::Str(name))?;
    sink.scalar(value)
}

/// Writes `name` and the unsigned `value` as an int, refusing values of 2^63 or more.
fn emit_uint<'v, S: Sink<'v> + ?Sized>(
    name: &'static str,
    value: u64,
    at: &dyn Fn() -> String,
    sink: &mut S,
) -> Result<(), AllocError> {
    let Ok(int) = i64::try_from(value) else {
        return Err(AllocError::Format {
            format: sink.format(),
            reason: format!(
                "{}.{name}: {value} is 2^63 or more; snapshot integers must fit a signed 64-bit int",
                at()
            ),
        });
    };
    emit_field(name, Scalar::Int(int), sink)
}

fn emit_segment<'v, S: Sink<'v>>(
    segment: &'v SegmentSnapshot,
    segment_idx: usize,
    sink: &mut S,
) -> Result<(), AllocError> {
    let at = || format!("segments[{segment_idx}]");
    sink.begin(Container::Dict, 12)?;
    emit_field("device", Scalar::Int(segment.device), sink)?;
    emit_uint("address", segment.address, &at, sink)?;
    emit_uint("total_size", segment.total_size, &at, sink)?;
    emit_uint("allocated_size", segment.allocated_size, &at, sink)?;
    emit_uint("active_size", segment.active_size, &at, sink)?;
    emit_uint("requested_size", segment.requested_size, &at, sink)?;
    emit_uint("stream", segment.stream, &at, sink)?;
    emit_field(
        "segment_type",
        Scalar::Str(segment.segment_type.name()),
        sink,
    )?;
    sink.scalar(Scalar::Str("segment_pool_id"))?;
    sink.begin(Container::Tuple, 2)?;
    sink.scalar(Scalar::Int(segment.segment_pool_id.0))?;
    sink.scalar(Scalar::Int(segment.segment_pool_id.1))?;
    sink.end()?;
    emit_field("is_expandable", Scalar::Bool(segment.is_expandable), sink)?;
    sink.scalar(Scalar::Str("frames"))?;
    sink.frames(&segment.frames)?;
    sink.scalar(Scalar::Str("blocks"))?;
    sink.begin(Container::List, segment.blocks.len())?;
    for (block_idx, block) in segment.blocks.iter().enumerate() {
        let at = || format!("segments[{segment_idx}].blocks[{block_idx}]");
        sink.begin(Container::Dict, 5)?;
        emit_uint("address", block.address, &at, sink)?;
        emit_uint("size", block.size, &at, sink)?;
        emit_uint("requested_size", block.requested_size, &at, sink)?;
        emit_field("state", Scalar::Str(block.state.name()), sink)?;
        sink.scalar(Scalar::Str("frames"))?;
        sink.frames(&block.frames)?;
        sink.end()?;
    }
    sink.end()?;
    sink.end()
}

fn emit_entry<'v, S: Sink<'v>>(
    entry: &'v TraceEntry,
    at: &dyn Fn() -> String,
    sink: &mut S,
) -> Result<(), AllocError> {
    let addr_key = if entry.action == TraceAction::Oom {
        "device_free"
    } else {
        "addr"
    };
    sink.begin(Container::Dict, 6)?;
    emit_field("action", Scalar::Str(entry.action.name()), sink)?;
    emit_uint(addr_key, entry.addr, at, sink)?;
    emit_uint("size", entry.size, at, sink)?;
    emit_uint("stream", entry.stream, at, sink)?;
    emit_field("time_us", Scalar::Int(entry.time_us), sink)?;
    sink.scalar(Scalar::Str("frames"))?;
    sink.frames(&entry.frames)?;
    sink.end()
}

/// A frame list as a list of `{filename, line, name}` dicts.
pub(super) fn emit_frames<'v, S: Sink<'v> + ?Sized>(
    frames: &'v [Frame],
    sink: &mut S,
) -> Result<(), AllocError> {
    sink.begin(Container::List, frames.len())?;
    for frame in frames {
        emit_frame(frame, sink)?;
    }
    sink.end()
}

/// One frame as a `{filename, line, name}` dict.
pub(super) fn emit_frame<'v, S: Sink<'v> + ?Sized>(
    frame: &'v Frame,
    sink: &mut S,
) -> Result<(), AllocError> {
    sink.begin(Container::Dict, 3)?;
    emit_field("filename", Scalar::Str(&frame.filename), sink)?;
    emit_field("line", Scalar::Int(frame.line), sink)?;
    emit_field("name", Scalar::Str(&frame.name), sink)?;
    sink.end()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::pickle::write_pickle;
    use super::*;

    #[test]
    fn refuses_unsigned_values_beyond_i64() {
        let snapshot = Snapshot {
            device_traces: vec![vec![TraceEntry {
                action: TraceAction::Oom,
                addr: 1 << 63,
                size: 0,
                stream: 0,
                time_us: 0,
                frames: Arc::from([]),
            }]],
            ..Snapshot::default()
        };
        let err = write_pickle(&snapshot, Vec::new())
            .expect_err("too big")
            .to_string();
        assert!(err.contains("device_traces[0][0].device_free"), "{err}");
    }
}
