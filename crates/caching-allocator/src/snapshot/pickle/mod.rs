//! Pickle files: a protocol-4 writer that uses only the opcodes PyTorch's memory viewer reads, and
//! a reader for the plain-data pickles Python writes at protocols 2–5.
//!
//! It sits on [`Value`] alone; the snapshot's structure belongs to `sink` and `from_value`, so
//! nothing here knows about segments or traces. It must not know Python classes either: opcodes
//! that would import or call Python code on load (`GLOBAL`, `STACK_GLOBAL`, `REDUCE`, `NEWOBJ`,
//! `BUILD`, ...) are refused with a typed error naming the opcode and its offset, never
//! interpreted.
//!
//! This module holds the entry points, the viewer's opcode list and the nesting limit both
//! directions share. Its submodules are one concept each: `op` (Python's opcodes, their names
//! and argument layouts), `instr` (walking an opcode stream into checked instructions),
//! `writer` (the protocol-4 writer) and `reader` (the unpickler). The reader walks with `instr`,
//! which reads the table in `op`; the writer needs only the opcodes; nothing calls back up
//! that chain.

mod instr;
/// Python's pickle opcodes (`Lib/pickle.py`).
mod op;
mod reader;
mod writer;

use std::io::{Read, Write};

use self::instr::Ops;
use self::reader::Unpickler;
use self::writer::write_with;
use super::{from_value, sink};
use super::{Snapshot, Value};
use crate::error::AllocError;

/// The opcodes PyTorch's memory viewer (`MemoryViz.js`) can unpickle; [`write_pickle`] uses no
/// others.
pub const VIEWER_OPCODES: &[u8] = &[
    op::PROTO,
    op::FRAME,
    op::STOP,
    op::MARK,
    op::EMPTY_DICT,
    op::EMPTY_LIST,
    op::EMPTY_TUPLE,
    op::DICT,
    op::LIST,
    op::TUPLE,
    op::TUPLE1,
    op::TUPLE2,
    op::TUPLE3,
    op::SETITEM,
    op::SETITEMS,
    op::APPEND,
    op::APPENDS,
    op::BININT,
    op::BININT1,
    op::BININT2,
    op::LONG1,
    op::BINFLOAT,
    op::SHORT_BINUNICODE,
    op::BINUNICODE,
    op::NONE,
    op::NEWTRUE,
    op::NEWFALSE,
    op::MEMOIZE,
    op::BINPUT,
    op::LONG_BINPUT,
    op::BINGET,
    op::LONG_BINGET,
];

/// The deepest nesting of lists, tuples and dicts the reader and writer accept.
pub(super) const MAX_DEPTH: usize = 512;

/// Writes a snapshot as a protocol-4 pickle in PyTorch's structure, using only
/// [`VIEWER_OPCODES`].
///
/// Fails with [`AllocError::Format`] when an unsigned field is 2^63 or more (a pickle integer the
/// viewer reads has at most 8 bytes, signed), and with [`AllocError::Io`] when writing fails.
pub fn write_pickle(snapshot: &Snapshot, writer: impl Write) -> Result<(), AllocError> {
    write_with(writer, |pickler| sink::emit_snapshot(snapshot, pickler))
}

/// Reads a snapshot pickle: PyTorch's own (`torch.cuda.memory._dump_snapshot`, or `pickle.dump`
/// of `_snapshot()` at any protocol from 2 to 5) or one written by [`write_pickle`].
pub fn read_pickle(reader: impl Read) -> Result<Snapshot, AllocError> {
    let value = read_value_pickle(reader)?;
    from_value::snapshot_from_value(value, "pickle")
}

/// Writes any [`Value`] as a protocol-4 pickle that uses only [`VIEWER_OPCODES`].
///
/// Fails with [`AllocError::Format`] for a string of 4 GiB or more or nesting deeper than
/// [`MAX_DEPTH`].
#[cfg(test)]
pub(super) fn write_value_pickle(value: &Value, writer: impl Write) -> Result<(), AllocError> {
    write_with(writer, |pickler| sink::emit_value(value, pickler))
}

/// Reads a pickle of plain data (`None`, bools, ints, floats, strings, lists, tuples, dicts, sets)
/// into a [`Value`]; sets and frozensets become lists.
///
/// Integers outside `i64`, bytes, and anything that would build a Python object are
/// [`AllocError::Format`] errors, as is any truncated or malformed input.
pub(super) fn read_value_pickle(mut reader: impl Read) -> Result<Value, AllocError> {
    let mut bytes = Vec::new();
    reader.read_to_end(&mut bytes)?;
    Unpickler::run(&bytes)
}

/// The distinct opcodes of a pickle, in order of first appearance, up to and including `STOP`.
///
/// Walks the opcode stream only (it checks lengths, not meaning), so it lists what a reader such
/// as the viewer would have to support; an unknown opcode or a truncated argument is an error.
pub fn pickle_opcodes(bytes: &[u8]) -> Result<Vec<u8>, AllocError> {
    let mut seen = [false; 256];
    let mut res = Vec::new();
    let mut ops = Ops::new(bytes);
    while let Some(instr) = ops.next_op()? {
        if !seen[usize::from(instr.code)] {
            seen[usize::from(instr.code)] = true;
            res.push(instr.code);
        }
    }
    Ok(res)
}

fn format_error(reason: String) -> AllocError {
    AllocError::Format {
        format: "pickle",
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        write_value_pickle(value, &mut out).expect("writing to a Vec cannot fail");
        out
    }

    #[test]
    fn round_trips_every_kind_of_value() {
        let big_list = Value::List((0..2500).map(Value::Int).collect());
        let value = Value::Dict(vec![
            (Value::Str("none".into()), Value::None),
            (
                Value::Str("bools".into()),
                Value::Tuple(vec![Value::Bool(true), Value::Bool(false)]),
            ),
            (
                Value::Str("ints".into()),
                Value::List(
                    [
                        0,
                        1,
                        255,
                        256,
                        65535,
                        65536,
                        -1,
                        -128,
                        -129,
                        i32::MIN as i64,
                        i32::MAX as i64 + 1,
                        i64::MIN,
                        i64::MAX,
                    ]
                    .into_iter()
                    .map(Value::Int)
                    .collect(),
                ),
            ),
            (Value::Str("float".into()), Value::Float(-2.5e300)),
            (
                Value::Str("long string".into()),
                Value::Str("x".repeat(70_000)),
            ),
            (Value::Str("big".into()), big_list),
            (Value::Int(7), Value::Tuple(vec![Value::Int(1); 5])),
            (Value::Str("none".into()), Value::Str("none".into())),
        ]);
        let bytes = dump(&value);
        assert_eq!(&bytes[..2], &[op::PROTO, 4]);
        assert_eq!(read_value_pickle(&bytes[..]).expect("reads back"), value);
        let used = pickle_opcodes(&bytes).expect("walks");
        assert!(
            used.iter().all(|code| VIEWER_OPCODES.contains(code)),
            "{used:?}"
        );
        assert!(used.contains(&op::FRAME) && used.contains(&op::BINGET));
    }

    #[test]
    fn ints_use_pythons_encoding() {
        // Python 3.11's `pickle.dumps(x, 4)`, byte for byte (frames included).
        let cases: &[(i64, &[u8])] = &[
            (5, b"\x80\x04K\x05."),
            (300, b"\x80\x04\x95\x04\x00\x00\x00\x00\x00\x00\x00M,\x01."),
            (-1, b"\x80\x04\x95\x06\x00\x00\x00\x00\x00\x00\x00J\xff\xff\xff\xff."),
            (1 << 40, b"\x80\x04\x95\t\x00\x00\x00\x00\x00\x00\x00\x8a\x06\x00\x00\x00\x00\x00\x01."),
            (-(1 << 40), b"\x80\x04\x95\t\x00\x00\x00\x00\x00\x00\x00\x8a\x06\x00\x00\x00\x00\x00\xff."),
            (i64::MIN, b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80."),
        ];
        for &(int, expected) in cases {
            assert_eq!(dump(&Value::Int(int)), expected, "{int}");
            assert_eq!(read_value_pickle(expected).expect("reads"), Value::Int(int));
        }
    }

    #[test]
    fn reads_shared_containers_and_refuses_cycles() {
        // l = [1]; pickle.dumps((l, l), 2): a list memoized and fetched while still on the
        // stack.
        let shared = b"\x80\x02]q\x00K\x01ah\x00\x86q\x01.";
        let expected = Value::Tuple(vec![
            Value::List(vec![Value::Int(1)]),
            Value::List(vec![Value::Int(1)]),
        ]);
        assert_eq!(read_value_pickle(&shared[..]).expect("reads"), expected);
        // l = []; l.append(l)
        let cycle = [0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.'];
        assert!(read_value_pickle(&cycle[..]).is_err());
    }

    #[test]
    fn refuses_objects_with_opcode_and_offset() {
        let global = b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.";
        let err = read_value_pickle(&global[..])
            .expect_err("refused")
            .to_string();
        assert!(err.contains("STACK_GLOBAL at offset 18"), "{err}");
    }

    #[test]
    fn refuses_ints_beyond_64_bits() {
        // pickle.dumps(2**63, 4)
        let bytes = b"\x80\x04\x95\x0c\x00\x00\x00\x00\x00\x00\x00\x8a\t\x00\x00\x00\x00\x00\x00\x00\x80\x00.";
        assert!(read_value_pickle(&bytes[..]).is_err());
    }

    #[test]
    fn limits_nesting_and_copying() {
        let deep = [
            vec![0x80, 4],
            vec![b']'; MAX_DEPTH + 2],
            vec![b'a'; MAX_DEPTH + 1],
            vec![b'.'],
        ]
        .concat();
        assert!(read_value_pickle(&deep[..]).is_err());
        // Each level doubles a list through the memo: a billion laughs.
        let mut bomb = vec![0x80, 4, b']', op::MEMOIZE];
        for level in 0..40u8 {
            bomb.extend_from_slice(&[b'h', level, b'h', level, 0x86, op::MEMOIZE]);
        }
        bomb.push(b'.');
        let err = read_value_pickle(&bomb[..])
            .expect_err("refused")
            .to_string();
        assert!(err.contains("copy too much"), "{err}");
    }
}
