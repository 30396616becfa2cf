//! Allocator traces as flat event lists: TSV files (optionally gzipped) and the history inside a
//! snapshot, so that a replay reads both the same way.
//!
//! A TSV trace has a header naming its columns, among them `action`, `addr` and `size`
//! (`stream` is optional and defaults to 0; other columns are ignored, and the order is free),
//! then one event per line, oldest first, with PyTorch's action names. Input that starts with
//! the gzip magic is decompressed on the fly.
//!
//! It sits on the model's [`TraceAction`] and [`Snapshot`] and on flate2; it knows nothing of
//! the allocator that replays the events.

use std::io::{BufRead, BufReader, Read};

use flate2::read::MultiGzDecoder;

use super::{Snapshot, TraceAction};
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

/// Reads a TSV trace, gzipped or not (told apart by the gzip magic bytes).
///
/// Fails with [`AllocError::Format`] naming the line for a missing header column, a short line,
/// a field that is not an unsigned integer, or an unknown action, and with [`AllocError::Io`]
/// when reading or decompressing fails.
pub fn read_trace_tsv(reader: impl Read) -> Result<Vec<TraceEvent>, AllocError> {
    let mut reader = BufReader::with_capacity(1 << 16, reader);
    let gzipped = reader.fill_buf()?.starts_with(&[0x1f, 0x8b]);
    if gzipped {
        parse_tsv(BufReader::with_capacity(
            1 << 16,
            MultiGzDecoder::new(reader),
        ))
    } else {
        parse_tsv(reader)
    }
}

/// The events of device 0's history in `snapshot` (`device_traces[0]`), oldest first; empty when
/// the snapshot has no history.
///
/// PyTorch records one history per device and a replay serves one device, so other devices'
/// histories are left out; read `snapshot.device_traces[d]` directly for another device. Every
/// action is kept; for `oom`, `addr` holds the free device bytes as in [`super::TraceEntry`].
pub fn trace_events_from_snapshot(snapshot: &Snapshot) -> Vec<TraceEvent> {
    snapshot
        .device_traces
        .first()
        .map(|trace| {
            trace
                .iter()
                .map(|entry| TraceEvent {
                    action: entry.action,
                    addr: entry.addr,
                    size: entry.size,
                    stream: entry.stream,
                })
                .collect()
        })
        .unwrap_or_default()
}

fn format_error(line_number: usize, reason: String) -> AllocError {
    AllocError::Format {
        format: "trace",
        reason: format!("line {line_number}: {reason}"),
    }
}

/// Where the columns are.
struct Columns {
    action: usize,
    addr: usize,
    size: usize,
    stream: Option<usize>,
}

impl Columns {
    fn from_header(header: &str, line_number: usize) -> Result<Self, AllocError> {
        let names: Vec<&str> = header.split('\t').map(str::trim).collect();
        let find = |name: &str| names.iter().position(|column| *column == name);
        let require = |name: &str| {
            find(name).ok_or_else(|| {
                format_error(
                    line_number,
                    format!("the header has no `{name}` column (found {names:?})"),
                )
            })
        };
        Ok(Columns {
            action: require("action")?,
            addr: require("addr")?,
            size: require("size")?,
            stream: find("stream"),
        })
    }
}

fn parse_tsv(mut reader: impl BufRead) -> Result<Vec<TraceEvent>, AllocError> {
    let mut events = Vec::new();
    let mut columns = None;
    let mut line = String::new();
    let mut line_number = 0;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        line_number += 1;
        let text = line.trim_end_matches(['\n', '\r']);
        if text.trim().is_empty() {
            continue;
        }
        let Some(columns) = &columns else {
            columns = Some(Columns::from_header(text, line_number)?);
            continue;
        };
        let fields: Vec<&str> = text.split('\t').collect();
        let field = |idx: usize, name: &str| {
            fields.get(idx).copied().ok_or_else(|| {
                format_error(
                    line_number,
                    format!("no `{name}` field (column {})", idx + 1),
                )
            })
        };
        let number = |idx: usize, name: &str| {
            let raw = field(idx, name)?;
            raw.trim().parse::<u64>().map_err(|_| {
                format_error(
                    line_number,
                    format!("`{name}` is `{raw}`, not an unsigned integer"),
                )
            })
        };
        let action_name = field(columns.action, "action")?.trim();
        let action = TraceAction::from_name(action_name)
            .ok_or_else(|| format_error(line_number, format!("unknown action `{action_name}`")))?;
        let event = TraceEvent {
            action,
            addr: number(columns.addr, "addr")?,
            size: number(columns.size, "size")?,
            stream: match columns.stream {
                Some(idx) => number(idx, "stream")?,
                None => 0,
            },
        };
        events.push(event);
    }
    if columns.is_none() {
        return Err(format_error(line_number, "no header line".to_owned()));
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use flate2::write::GzEncoder;
    use flate2::Compression;

    use super::*;
    use crate::snapshot::{Frames, TraceEntry};

    const TEXT: &str = "size\taction\tstream\taddr\textra\n\
                        512\talloc\t7\t4096\tx\n\
                        \n\
                        512\tfree_completed\t7\t4096\tx\r\n";

    fn expected() -> Vec<TraceEvent> {
        vec![
            TraceEvent {
                action: TraceAction::Alloc,
                addr: 4096,
                size: 512,
                stream: 7,
            },
            TraceEvent {
                action: TraceAction::FreeCompleted,
                addr: 4096,
                size: 512,
                stream: 7,
            },
        ]
    }

    #[test]
    fn finds_columns_by_name_plain_or_gzipped() {
        assert_eq!(read_trace_tsv(TEXT.as_bytes()).expect("reads"), expected());
        let mut gz = GzEncoder::new(Vec::new(), Compression::fast());
        gz.write_all(TEXT.as_bytes()).expect("compresses");
        let bytes = gz.finish().expect("compresses");
        assert_eq!(read_trace_tsv(&bytes[..]).expect("reads"), expected());
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            (
                "action\taddr\tsize\nalloc\t1\t2\nmalloc\t1\t2\n",
                "line 3: unknown action `malloc`",
            ),
            ("action\taddr\tsize\nalloc\t1\n", "line 2: no `size` field"),
            (
                "action\taddr\tsize\nalloc\t-1\t2\n",
                "line 2: `addr` is `-1`",
            ),
            (
                "action\taddress\tsize\n",
                "line 1: the header has no `addr` column",
            ),
            ("", "no header line"),
        ];
        for (text, message) in cases {
            let err = read_trace_tsv(text.as_bytes()).expect_err(text).to_string();
            assert!(err.contains(message), "{err}");
        }
    }

    #[test]
    fn takes_device_zero_from_a_snapshot() {
        let entry = |action, addr| TraceEntry {
            action,
            addr,
            size: 512,
            stream: 7,
            time_us: 1,
            frames: Frames::from(Vec::new()),
        };
        let snapshot = Snapshot {
            device_traces: vec![
                vec![
                    entry(TraceAction::Alloc, 4096),
                    entry(TraceAction::FreeCompleted, 4096),
                ],
                vec![entry(TraceAction::Alloc, 1)],
            ],
            ..Snapshot::default()
        };
        assert_eq!(trace_events_from_snapshot(&snapshot), expected());
        assert!(trace_events_from_snapshot(&Snapshot::default()).is_empty());
    }
}
