//! The typed snapshot model from the [`Value`] a reader produced, in exactly the structure that
//! PyTorch's `torch.cuda.memory._snapshot()` returns.
//!
//! It sits on the model types of `super` and on [`Value`]. It knows no file format. It accepts
//! PyTorch's own snapshots, ignoring keys it does not model (`compile_context`,
//! `user_metadata`, `forward_frames`, ...) and giving missing optional keys the defaults listed
//! on [`snapshot_from_value`]; reading a negative value into an unsigned field is an error.
//! Writing is `sink`'s.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use super::{
    BlockSnapshot, BlockState, Frame, Frames, SegmentSnapshot, Snapshot, TraceAction, TraceEntry,
    Value,
};
use crate::error::AllocError;
use crate::stats::PoolKind;

/// The snapshot a [`Value`] holds, as PyTorch or [`emit_snapshot`](super::sink::emit_snapshot)
/// wrote it.
///
/// Required: the top-level `segments`; per segment `address`, `total_size` and `blocks`; per
/// block `size` and `state`; per trace entry `action`, `addr` (`device_free` for `oom`) and
/// `size`; per frame `filename`, `line` and `name`. Defaults for the rest: no traces, settings
/// or annotations; segment `device` 0, `stream` 0, `segment_type` "large", `segment_pool_id`
/// (0, 0), `is_expandable` false; the segment's `allocated_size`, `active_size` and
/// `requested_size` summed from its blocks; a block's `address` from the segment's address and
/// the sizes before it, its `requested_size` equal to its `size`; trace `stream` and `time_us`
/// 0; `frames` empty. Identical frame lists share one [`Frames`].
pub(super) fn snapshot_from_value(
    value: Value,
    format: &'static str,
) -> Result<Snapshot, AllocError> {
    let mut reader = Reader {
        frames: HashSet::new(),
    };
    reader.snapshot(value).map_err(|err| err.into_alloc(format))
}

/// A value's kind, for messages.
pub(super) fn value_kind(value: &Value) -> &'static str {
    match value {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::Int(_) => "int",
        Value::Float(_) => "float",
        Value::Str(_) => "str",
        Value::List(_) => "list",
        Value::Tuple(_) => "tuple",
        Value::Dict(_) => "dict",
    }
}

/// What went wrong, and where: `path` is like `segments[3].blocks[0].size`.
#[derive(Debug)]
struct ConvError {
    path: Vec<String>,
    reason: String,
}

impl ConvError {
    fn new(reason: impl Into<String>) -> Self {
        ConvError {
            path: Vec::new(),
            reason: reason.into(),
        }
    }

    /// The same error, inside `part` (pushed innermost first, so the path is built in reverse).
    fn within(mut self, part: impl fmt::Display) -> Self {
        self.path.push(part.to_string());
        self
    }

    fn into_alloc(self, format: &'static str) -> AllocError {
        let path: Vec<&str> = self.path.iter().rev().map(String::as_str).collect();
        let reason = if path.is_empty() {
            self.reason
        } else {
            format!("{}: {}", path.join("."), self.reason)
        };
        AllocError::Format { format, reason }
    }
}

type Conv<T> = Result<T, ConvError>;

/// Reading state: the frame lists seen so far, so that equal lists share one allocation.
struct Reader {
    frames: HashSet<Frames>,
}

impl Reader {
    fn snapshot(&mut self, value: Value) -> Conv<Snapshot> {
        let mut res = Snapshot::default();
        let mut segments = None;
        for (name, value) in fields(value)? {
            match name.as_str() {
                "segments" => {
                    let list = list(value).map_err(|err| err.within("segments"))?;
                    let mut parsed = Vec::with_capacity(list.len());
                    for (idx, segment) in list.into_iter().enumerate() {
                        parsed.push(
                            self.segment(segment)
                                .map_err(|err| err.within(format!("segments[{idx}]")))?,
                        );
                    }
                    segments = Some(parsed);
                }
                "device_traces" => {
                    let traces = list(value).map_err(|err| err.within("device_traces"))?;
                    res.device_traces = Vec::with_capacity(traces.len());
                    for (device, trace) in traces.into_iter().enumerate() {
                        let entries = list(trace)
                            .map_err(|err| err.within(format!("device_traces[{device}]")))?;
                        let mut parsed = Vec::with_capacity(entries.len());
                        for (idx, entry) in entries.into_iter().enumerate() {
                            let entry = self.entry(entry).map_err(|err| {
                                err.within(format!("device_traces[{device}][{idx}]"))
                            })?;
                            parsed.extend(entry);
                        }
                        res.device_traces.push(parsed);
                    }
                }
                "allocator_settings" => {
                    res.allocator_settings = dict(value)
                        .and_then(|pairs| {
                            pairs
                                .into_iter()
                                .map(|(name, value)| match name {
                                    Value::Str(name) => Ok((name, value)),
                                    other => Err(ConvError::new(format!(
                                        "a key is a {}, expected str",
                                        value_kind(&other)
                                    ))),
                                })
                                .collect()
                        })
                        .map_err(|err| err.within("allocator_settings"))?;
                }
                "external_annotations" => {
                    res.external_annotations =
                        list(value).map_err(|err| err.within("external_annotations"))?;
                }
                _ => {}
            }
        }
        res.segments = segments.ok_or_else(|| ConvError::new("missing key `segments`"))?;
        Ok(res)
    }

    fn segment(&mut self, value: Value) -> Conv<SegmentSnapshot> {
        let mut device = 0;
        let mut address = None;
        let mut total_size = None;
        let mut allocated_size = None;
        let mut active_size = None;
        let mut requested_size = None;
        let mut stream = 0;
        let mut segment_type = PoolKind::Large;
        let mut segment_pool_id = (0, 0);
        let mut is_expandable = false;
        let mut frames = None;
        let mut blocks = None;
        for (name, value) in fields(value)? {
            let at = |err: ConvError| err.within(&name);
            match name.as_str() {
                "device" => device = int(value).map_err(at)?,
                "address" => address = Some(unsigned(value).map_err(at)?),
                "total_size" => total_size = Some(unsigned(value).map_err(at)?),
                "allocated_size" => allocated_size = Some(unsigned(value).map_err(at)?),
                "active_size" => active_size = Some(unsigned(value).map_err(at)?),
                "requested_size" => requested_size = Some(unsigned(value).map_err(at)?),
                "stream" => stream = unsigned(value).map_err(at)?,
                "segment_type" => segment_type = pool_kind(value).map_err(at)?,
                "segment_pool_id" => segment_pool_id = pool_id(value).map_err(at)?,
                "is_expandable" => is_expandable = boolean(value).map_err(at)?,
                "frames" => frames = Some(self.frames(value).map_err(at)?),
                "blocks" => blocks = Some(list(value).map_err(at)?),
                _ => {}
            }
        }
        let address = address.ok_or_else(|| ConvError::new("missing key `address`"))?;
        let total_size = total_size.ok_or_else(|| ConvError::new("missing key `total_size`"))?;
        let raw_blocks = blocks.ok_or_else(|| ConvError::new("missing key `blocks`"))?;
        let mut blocks = Vec::with_capacity(raw_blocks.len());
        let mut next_address = Some(address);
        for (idx, block) in raw_blocks.into_iter().enumerate() {
            let block = self
                .block(block, next_address)
                .map_err(|err| err.within(format!("blocks[{idx}]")))?;
            next_address = block.address.checked_add(block.size);
            blocks.push(block);
        }
        let sum = |keep: fn(&BlockSnapshot) -> bool, size: fn(&BlockSnapshot) -> u64| {
            blocks
                .iter()
                .filter(|block| keep(block))
                .map(size)
                .fold(0u64, u64::saturating_add)
        };
        let allocated_size = allocated_size.unwrap_or_else(|| {
            sum(
                |block| block.state == BlockState::ActiveAllocated,
                |block| block.size,
            )
        });
        let active_size = active_size.unwrap_or_else(|| {
            sum(
                |block| block.state != BlockState::Inactive,
                |block| block.size,
            )
        });
        let requested_size = requested_size.unwrap_or_else(|| {
            sum(
                |block| block.state != BlockState::Inactive,
                |block| block.requested_size,
            )
        });
        Ok(SegmentSnapshot {
            device,
            address,
            total_size,
            allocated_size,
            active_size,
            requested_size,
            stream,
            segment_type,
            segment_pool_id,
            is_expandable,
            frames: match frames {
                Some(frames) => frames,
                None => self.share(Vec::new()),
            },
            blocks,
        })
    }

    /// A block; `default_address` is where it starts if the block does not say.
    fn block(&mut self, value: Value, default_address: Option<u64>) -> Conv<BlockSnapshot> {
        let [address, size, requested_size, state, frames] = keyed(
            value,
            ["address", "size", "requested_size", "state", "frames"],
        )?;
        let size = required(size, "size", unsigned)?;
        let address = optional(address, "address", unsigned)?
            .or(default_address)
            .ok_or_else(|| ConvError::new("missing key `address`"))?;
        Ok(BlockSnapshot {
            address,
            size,
            requested_size: optional(requested_size, "requested_size", unsigned)?.unwrap_or(size),
            state: required(state, "state", block_state)?,
            frames: match optional(frames, "frames", |frames| self.frames(frames))? {
                Some(frames) => frames,
                None => self.share(Vec::new()),
            },
        })
    }

    /// A trace entry, or `None` for an action this model does not know (a newer PyTorch's
    /// `annotate`, say): such entries are skipped, so newer snapshots still load.
    fn entry(&mut self, value: Value) -> Conv<Option<TraceEntry>> {
        let mut action = None;
        let mut addr = None;
        let mut device_free = None;
        let mut size = None;
        let mut stream = 0;
        let mut time_us = 0;
        let mut frames = None;
        for (name, value) in fields(value)? {
            let at = |err: ConvError| err.within(&name);
            match name.as_str() {
                "action" => {
                    let text = string(value).map_err(at)?;
                    match TraceAction::from_name(&text) {
                        Some(parsed) => action = Some(parsed),
                        None => return Ok(None),
                    }
                }
                "addr" => addr = Some(unsigned(value).map_err(at)?),
                "device_free" => device_free = Some(unsigned(value).map_err(at)?),
                "size" => size = Some(unsigned(value).map_err(at)?),
                "stream" => stream = unsigned(value).map_err(at)?,
                "time_us" => time_us = int(value).map_err(at)?,
                "frames" => frames = Some(self.frames(value).map_err(at)?),
                _ => {}
            }
        }
        let action = action.ok_or_else(|| ConvError::new("missing key `action`"))?;
        let addr = if action == TraceAction::Oom {
            device_free.or(addr)
        } else {
            addr.or(device_free)
        };
        Ok(Some(TraceEntry {
            action,
            addr: addr.ok_or_else(|| ConvError::new("missing key `addr`"))?,
            size: size.ok_or_else(|| ConvError::new("missing key `size`"))?,
            stream,
            time_us,
            frames: match frames {
                Some(frames) => frames,
                None => self.share(Vec::new()),
            },
        }))
    }

    fn frames(&mut self, value: Value) -> Conv<Frames> {
        let items = list(value)?;
        let mut frames = Vec::with_capacity(items.len());
        for (idx, item) in items.into_iter().enumerate() {
            frames.push(frame(item).map_err(|err| err.within(format!("[{idx}]")))?);
        }
        Ok(self.share(frames))
    }

    /// The shared allocation of a frame list equal to `frames`.
    fn share(&mut self, frames: Vec<Frame>) -> Frames {
        if let Some(shared) = self.frames.get(frames.as_slice()) {
            return Arc::clone(shared);
        }
        let shared: Frames = Arc::from(frames);
        self.frames.insert(Arc::clone(&shared));
        shared
    }
}

fn frame(value: Value) -> Conv<Frame> {
    let [filename, line, name] = keyed(value, ["filename", "line", "name"])?;
    Ok(Frame {
        filename: required(filename, "filename", string)?,
        line: required(line, "line", int)?,
        name: required(name, "name", string)?,
    })
}

/// The values of a dict's `keys` (the last of a key given twice), `None` where a key is missing;
/// other keys are ignored.
fn keyed<const N: usize>(value: Value, keys: [&str; N]) -> Conv<[Option<Value>; N]> {
    let mut values = [const { None }; N];
    for (name, value) in fields(value)? {
        if let Some(idx) = keys.iter().position(|key| *key == name) {
            values[idx] = Some(value);
        }
    }
    Ok(values)
}

/// The value of `key` converted, or `None` where it is missing.
fn optional<T>(
    value: Option<Value>,
    key: &str,
    convert: impl FnOnce(Value) -> Conv<T>,
) -> Conv<Option<T>> {
    value
        .map(|value| convert(value).map_err(|err| err.within(key)))
        .transpose()
}

/// The value of `key`, which must be there, converted.
fn required<T>(value: Option<Value>, key: &str, convert: impl FnOnce(Value) -> Conv<T>) -> Conv<T> {
    optional(value, key, convert)?.ok_or_else(|| ConvError::new(format!("missing key `{key}`")))
}

fn expected(what: &str, value: &Value) -> ConvError {
    ConvError::new(format!("expected {what}, found {}", value_kind(value)))
}

/// Converters that take the contents of the named [`Value`] variants and refuse any other value,
/// saying what they expected.
macro_rules! variant_converters {
    ($($(#[$doc:meta])* $name:ident -> $ty:ty = $($variant:ident)|+, $what:literal;)*) => {$(
        $(#[$doc])*
        fn $name(value: Value) -> Conv<$ty> {
            match value {
                $(Value::$variant(inner))|+ => Ok(inner),
                other => Err(expected($what, &other)),
            }
        }
    )*};
}

variant_converters! {
    dict -> Vec<(Value, Value)> = Dict, "a dict";
    /// A list or a tuple.
    list -> Vec<Value> = List | Tuple, "a list";
    int -> i64 = Int, "an int";
    boolean -> bool = Bool, "a bool";
    string -> String = Str, "a str";
}

/// The string-keyed entries of a dict; entries with other keys are ignored like unknown keys.
fn fields(value: Value) -> Conv<impl Iterator<Item = (String, Value)>> {
    Ok(dict(value)?
        .into_iter()
        .filter_map(|(name, value)| match name {
            Value::Str(name) => Some((name, value)),
            _ => None,
        }))
}

fn unsigned(value: Value) -> Conv<u64> {
    let int = int(value)?;
    u64::try_from(int)
        .map_err(|_| ConvError::new(format!("expected a non-negative int, found {int}")))
}

fn block_state(value: Value) -> Conv<BlockState> {
    let text = string(value)?;
    BlockState::from_name(&text)
        .ok_or_else(|| ConvError::new(format!("unknown block state `{text}`")))
}

fn pool_kind(value: Value) -> Conv<PoolKind> {
    let text = string(value)?;
    match text.as_str() {
        "small" => Ok(PoolKind::Small),
        "large" => Ok(PoolKind::Large),
        _ => Err(ConvError::new(format!(
            "unknown segment type `{text}`, expected \"small\" or \"large\""
        ))),
    }
}

fn pool_id(value: Value) -> Conv<(i64, i64)> {
    let items = list(value)?;
    let n_items = items.len();
    let mut items = items.into_iter();
    match (items.next(), items.next(), items.next()) {
        (Some(first), Some(second), None) => Ok((int(first)?, int(second)?)),
        _ => Err(ConvError::new(format!(
            "expected a pair, found {n_items} items"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::pickle::{read_pickle, write_pickle};
    use super::*;

    fn key(name: &str) -> Value {
        Value::Str(name.to_owned())
    }

    fn frames(names: &[&str]) -> Frames {
        names.iter().copied().map(Frame::context).collect()
    }

    #[test]
    fn defaults_fill_what_older_snapshots_lack() {
        let block = |size: i64, state: &str| {
            Value::Dict(vec![
                (key("size"), Value::Int(size)),
                (key("state"), key(state)),
            ])
        };
        let value = Value::Dict(vec![(
            key("segments"),
            Value::List(vec![Value::Dict(vec![
                (key("address"), Value::Int(4096)),
                (key("total_size"), Value::Int(3072)),
                (key("unknown"), Value::None),
                (
                    key("blocks"),
                    Value::List(vec![
                        block(1024, "active_allocated"),
                        block(512, "active_awaiting_free"),
                        block(1536, "inactive"),
                    ]),
                ),
            ])]),
        )]);
        let snapshot = snapshot_from_value(value, "pickle").expect("reads");
        let segment = &snapshot.segments[0];
        let addresses: Vec<u64> = segment.blocks.iter().map(|block| block.address).collect();
        assert_eq!(addresses, [4096, 5120, 5632]);
        assert_eq!(
            (
                segment.allocated_size,
                segment.active_size,
                segment.requested_size
            ),
            (1024, 1536, 1536)
        );
        assert_eq!(segment.blocks[1].state, BlockState::ActivePendingFree);
        assert_eq!(segment.segment_type, PoolKind::Large);
        assert!(snapshot.device_traces.is_empty());
    }

    #[test]
    fn errors_name_the_path() {
        let value = Value::Dict(vec![
            (key("segments"), Value::List(Vec::new())),
            (
                key("device_traces"),
                Value::List(vec![Value::List(vec![Value::Dict(vec![
                    (key("action"), key("alloc")),
                    (key("addr"), Value::Int(-5)),
                    (key("size"), Value::Int(1)),
                ])])]),
            ),
        ]);
        let err = snapshot_from_value(value, "json")
            .expect_err("negative addr")
            .to_string();
        assert_eq!(
            err,
            "json error: device_traces[0][0].addr: expected a non-negative int, found -5"
        );
    }

    #[test]
    fn equal_frame_lists_share_one_allocation() {
        let entry = |name: &str| TraceEntry {
            action: TraceAction::Alloc,
            addr: 0,
            size: 512,
            stream: 0,
            time_us: 0,
            frames: frames(&[name, "forward"]),
        };
        let snapshot = Snapshot {
            device_traces: vec![vec![entry("mlp"), entry("mlp"), entry("attn")]],
            ..Snapshot::default()
        };
        let mut bytes = Vec::new();
        write_pickle(&snapshot, &mut bytes).expect("writes");
        let back = read_pickle(&bytes[..]).expect("reads");
        assert_eq!(back, snapshot);
        let trace = &back.device_traces[0];
        assert!(Arc::ptr_eq(&trace[0].frames, &trace[1].frames));
        assert!(!Arc::ptr_eq(&trace[0].frames, &trace[2].frames));
    }

    /// Trace entries with actions this model does not know (newer PyTorch versions add some)
    /// are skipped, and the rest of the snapshot still loads.
    #[test]
    fn unknown_trace_actions_are_skipped() {
        let entry = |action: &str| {
            Value::Dict(vec![
                (key("action"), Value::Str(action.to_owned())),
                (key("addr"), Value::Int(4096)),
                (key("size"), Value::Int(512)),
                (key("stream"), Value::Int(0)),
            ])
        };
        let value = Value::Dict(vec![
            (key("segments"), Value::List(Vec::new())),
            (
                key("device_traces"),
                Value::List(vec![Value::List(vec![
                    entry("alloc"),
                    entry("annotate"),
                    entry("free_completed"),
                ])]),
            ),
        ]);
        let snapshot = snapshot_from_value(value, "pickle").expect("loads");
        let actions: Vec<TraceAction> = snapshot.device_traces[0]
            .iter()
            .map(|entry| entry.action)
            .collect();
        assert_eq!(actions, [TraceAction::Alloc, TraceAction::FreeCompleted]);
    }
}
