//! Pickle files: a protocol-4 writer that uses only the opcodes PyTorch's memory viewer reads, and
//! a reader for the plain-data pickles Python writes at protocols 2–5.
//!
//! It sits on [`Value`] alone; the snapshot's structure belongs to `convert`, so nothing here
//! knows about segments or traces. It must not know Python classes either: opcodes that would
//! import or call Python code on load (`GLOBAL`, `STACK_GLOBAL`, `REDUCE`, `NEWOBJ`, `BUILD`, ...)
//! are refused with a typed error naming the opcode and its offset, never interpreted.
//!
//! The writer follows Python's `pickle` for the same data: `PROTO 4`, 64 KiB `FRAME`s, the
//! smallest integer opcode that fits, `APPENDS`/`SETITEMS` in batches of 1000, and strings
//! memoized so that repeated keys and frame names cost a `BINGET` each. Each [`Frames`]
//! allocation is written once and referred back to with `BINGET`, which is how Python's pickle
//! writes any shared object, so every unpickler (the viewer's included) reads it; no other
//! container is shared.
//!
//! The reader checks every length against the bytes left, limits nesting to [`MAX_DEPTH`] and
//! the work done copying memoized values to a multiple of the input size, so truncated or
//! hostile input gives [`AllocError::Format`] rather than a panic or an unbounded allocation.
//! Memoized values are copied on `BINGET` (a [`Value`] cannot share), which is exact for
//! everything `pickle` writes except self-referencing containers; those are refused.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{Read, Write};
use std::sync::Arc;

use super::convert::{self, value_kind, Container, Scalar, Sink};
use super::{Frame, Frames, Snapshot, Value};
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
    write_with(writer, |pickler| convert::emit_snapshot(snapshot, pickler))
}

/// Reads a snapshot pickle: PyTorch's own (`torch.cuda.memory._dump_snapshot`, or `pickle.dump`
/// of `_snapshot()` at any protocol from 2 to 5) or one written by [`write_pickle`].
pub fn read_pickle(reader: impl Read) -> Result<Snapshot, AllocError> {
    let value = read_value_pickle(reader)?;
    convert::snapshot_from_value(value, "pickle")
}

/// Writes any [`Value`] as a protocol-4 pickle that uses only [`VIEWER_OPCODES`].
///
/// Fails with [`AllocError::Format`] for a string of 4 GiB or more or nesting deeper than
/// [`MAX_DEPTH`].
#[cfg(test)]
pub(super) fn write_value_pickle(value: &Value, writer: impl Write) -> Result<(), AllocError> {
    write_with(writer, |pickler| convert::emit_value(value, pickler))
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

/// Python's pickle opcodes (`Lib/pickle.py`).
mod op {
    pub(super) const MARK: u8 = b'(';
    pub(super) const STOP: u8 = b'.';
    pub(super) const POP: u8 = b'0';
    pub(super) const POP_MARK: u8 = b'1';
    pub(super) const DUP: u8 = b'2';
    pub(super) const FLOAT: u8 = b'F';
    pub(super) const INT: u8 = b'I';
    pub(super) const BININT: u8 = b'J';
    pub(super) const BININT1: u8 = b'K';
    pub(super) const LONG: u8 = b'L';
    pub(super) const BININT2: u8 = b'M';
    pub(super) const NONE: u8 = b'N';
    pub(super) const PERSID: u8 = b'P';
    pub(super) const BINPERSID: u8 = b'Q';
    pub(super) const REDUCE: u8 = b'R';
    pub(super) const STRING: u8 = b'S';
    pub(super) const BINSTRING: u8 = b'T';
    pub(super) const SHORT_BINSTRING: u8 = b'U';
    pub(super) const UNICODE: u8 = b'V';
    pub(super) const BINUNICODE: u8 = b'X';
    pub(super) const APPEND: u8 = b'a';
    pub(super) const BUILD: u8 = b'b';
    pub(super) const GLOBAL: u8 = b'c';
    pub(super) const DICT: u8 = b'd';
    pub(super) const EMPTY_DICT: u8 = b'}';
    pub(super) const APPENDS: u8 = b'e';
    pub(super) const GET: u8 = b'g';
    pub(super) const BINGET: u8 = b'h';
    pub(super) const INST: u8 = b'i';
    pub(super) const LONG_BINGET: u8 = b'j';
    pub(super) const LIST: u8 = b'l';
    pub(super) const EMPTY_LIST: u8 = b']';
    pub(super) const OBJ: u8 = b'o';
    pub(super) const PUT: u8 = b'p';
    pub(super) const BINPUT: u8 = b'q';
    pub(super) const LONG_BINPUT: u8 = b'r';
    pub(super) const SETITEM: u8 = b's';
    pub(super) const TUPLE: u8 = b't';
    pub(super) const EMPTY_TUPLE: u8 = b')';
    pub(super) const SETITEMS: u8 = b'u';
    pub(super) const BINFLOAT: u8 = b'G';
    pub(super) const PROTO: u8 = 0x80;
    pub(super) const NEWOBJ: u8 = 0x81;
    pub(super) const EXT1: u8 = 0x82;
    pub(super) const EXT2: u8 = 0x83;
    pub(super) const EXT4: u8 = 0x84;
    pub(super) const TUPLE1: u8 = 0x85;
    pub(super) const TUPLE2: u8 = 0x86;
    pub(super) const TUPLE3: u8 = 0x87;
    pub(super) const NEWTRUE: u8 = 0x88;
    pub(super) const NEWFALSE: u8 = 0x89;
    pub(super) const LONG1: u8 = 0x8a;
    pub(super) const LONG4: u8 = 0x8b;
    pub(super) const BINBYTES: u8 = b'B';
    pub(super) const SHORT_BINBYTES: u8 = b'C';
    pub(super) const SHORT_BINUNICODE: u8 = 0x8c;
    pub(super) const BINUNICODE8: u8 = 0x8d;
    pub(super) const BINBYTES8: u8 = 0x8e;
    pub(super) const EMPTY_SET: u8 = 0x8f;
    pub(super) const ADDITEMS: u8 = 0x90;
    pub(super) const FROZENSET: u8 = 0x91;
    pub(super) const NEWOBJ_EX: u8 = 0x92;
    pub(super) const STACK_GLOBAL: u8 = 0x93;
    pub(super) const MEMOIZE: u8 = 0x94;
    pub(super) const FRAME: u8 = 0x95;
    pub(super) const BYTEARRAY8: u8 = 0x96;
    pub(super) const NEXT_BUFFER: u8 = 0x97;
    pub(super) const READONLY_BUFFER: u8 = 0x98;
}

/// Python's framer commits a frame once it holds this many bytes.
const FRAME_TARGET: usize = 64 * 1024;

/// Python's batch size for `APPENDS` and `SETITEMS`.
const BATCH: usize = 1000;

/// How an opcode's argument is laid out after the opcode byte.
#[derive(Debug, Clone, Copy)]
enum ArgShape {
    /// No argument.
    Empty,
    /// A fixed number of bytes.
    Fixed(usize),
    /// A little-endian unsigned length of this many bytes, then that many bytes.
    Counted(usize),
    /// A little-endian signed 4-byte length (negative is an error), then that many bytes.
    CountedSigned4,
    /// Text up to a newline.
    Line,
    /// Two lines of text (`GLOBAL`, `INST`).
    TwoLines,
}

/// Name and argument layout of every opcode Python knows; `None` for any other byte.
fn opcode_info(code: u8) -> Option<(&'static str, ArgShape)> {
    use ArgShape::{Counted, CountedSigned4, Empty, Fixed, Line, TwoLines};
    Some(match code {
        op::MARK => ("MARK", Empty),
        op::STOP => ("STOP", Empty),
        op::POP => ("POP", Empty),
        op::POP_MARK => ("POP_MARK", Empty),
        op::DUP => ("DUP", Empty),
        op::FLOAT => ("FLOAT", Line),
        op::INT => ("INT", Line),
        op::BININT => ("BININT", Fixed(4)),
        op::BININT1 => ("BININT1", Fixed(1)),
        op::LONG => ("LONG", Line),
        op::BININT2 => ("BININT2", Fixed(2)),
        op::NONE => ("NONE", Empty),
        op::PERSID => ("PERSID", Line),
        op::BINPERSID => ("BINPERSID", Empty),
        op::REDUCE => ("REDUCE", Empty),
        op::STRING => ("STRING", Line),
        op::BINSTRING => ("BINSTRING", CountedSigned4),
        op::SHORT_BINSTRING => ("SHORT_BINSTRING", Counted(1)),
        op::UNICODE => ("UNICODE", Line),
        op::BINUNICODE => ("BINUNICODE", Counted(4)),
        op::APPEND => ("APPEND", Empty),
        op::BUILD => ("BUILD", Empty),
        op::GLOBAL => ("GLOBAL", TwoLines),
        op::DICT => ("DICT", Empty),
        op::EMPTY_DICT => ("EMPTY_DICT", Empty),
        op::APPENDS => ("APPENDS", Empty),
        op::GET => ("GET", Line),
        op::BINGET => ("BINGET", Fixed(1)),
        op::INST => ("INST", TwoLines),
        op::LONG_BINGET => ("LONG_BINGET", Fixed(4)),
        op::LIST => ("LIST", Empty),
        op::EMPTY_LIST => ("EMPTY_LIST", Empty),
        op::OBJ => ("OBJ", Empty),
        op::PUT => ("PUT", Line),
        op::BINPUT => ("BINPUT", Fixed(1)),
        op::LONG_BINPUT => ("LONG_BINPUT", Fixed(4)),
        op::SETITEM => ("SETITEM", Empty),
        op::TUPLE => ("TUPLE", Empty),
        op::EMPTY_TUPLE => ("EMPTY_TUPLE", Empty),
        op::SETITEMS => ("SETITEMS", Empty),
        op::BINFLOAT => ("BINFLOAT", Fixed(8)),
        op::PROTO => ("PROTO", Fixed(1)),
        op::NEWOBJ => ("NEWOBJ", Empty),
        op::EXT1 => ("EXT1", Fixed(1)),
        op::EXT2 => ("EXT2", Fixed(2)),
        op::EXT4 => ("EXT4", Fixed(4)),
        op::TUPLE1 => ("TUPLE1", Empty),
        op::TUPLE2 => ("TUPLE2", Empty),
        op::TUPLE3 => ("TUPLE3", Empty),
        op::NEWTRUE => ("NEWTRUE", Empty),
        op::NEWFALSE => ("NEWFALSE", Empty),
        op::LONG1 => ("LONG1", Counted(1)),
        op::LONG4 => ("LONG4", CountedSigned4),
        op::BINBYTES => ("BINBYTES", Counted(4)),
        op::SHORT_BINBYTES => ("SHORT_BINBYTES", Counted(1)),
        op::SHORT_BINUNICODE => ("SHORT_BINUNICODE", Counted(1)),
        op::BINUNICODE8 => ("BINUNICODE8", Counted(8)),
        op::BINBYTES8 => ("BINBYTES8", Counted(8)),
        op::EMPTY_SET => ("EMPTY_SET", Empty),
        op::ADDITEMS => ("ADDITEMS", Empty),
        op::FROZENSET => ("FROZENSET", Empty),
        op::NEWOBJ_EX => ("NEWOBJ_EX", Empty),
        op::STACK_GLOBAL => ("STACK_GLOBAL", Empty),
        op::MEMOIZE => ("MEMOIZE", Empty),
        op::FRAME => ("FRAME", Fixed(8)),
        op::BYTEARRAY8 => ("BYTEARRAY8", Counted(8)),
        op::NEXT_BUFFER => ("NEXT_BUFFER", Empty),
        op::READONLY_BUFFER => ("READONLY_BUFFER", Empty),
        _ => return None,
    })
}

fn format_error(reason: String) -> AllocError {
    AllocError::Format {
        format: "pickle",
        reason,
    }
}

/// Writes `PROTO 4`, what `body` streams into the pickler, and `STOP`.
fn write_with<'v, W: Write>(
    mut writer: W,
    body: impl FnOnce(&mut Pickler<'v, &mut W>) -> Result<(), AllocError>,
) -> Result<(), AllocError> {
    writer.write_all(&[op::PROTO, 4])?;
    let mut pickler = Pickler {
        writer: &mut writer,
        frame: Vec::with_capacity(FRAME_TARGET + 1024),
        strings: FastMap::default(),
        shared_frames: FastMap::default(),
        n_memo: 0,
        levels: Vec::new(),
    };
    body(&mut pickler)?;
    if !pickler.levels.is_empty() {
        return Err(format_error("a container was left open".to_owned()));
    }
    pickler.frame.push(op::STOP);
    pickler.commit_frame()?;
    writer.flush()?;
    Ok(())
}

/// The writer's state: the frame being filled, the memo, and the open containers.
struct Pickler<'v, W: Write> {
    writer: W,
    frame: Vec<u8>,
    /// Memo indices of the strings written so far.
    strings: FastMap<&'v str, u32>,
    /// Memo indices of frame lists written so far, by the address of their [`Frames`]
    /// allocation (which the borrowed snapshot keeps alive).
    shared_frames: FastMap<usize, u32>,
    /// Memo entries so far.
    n_memo: u32,
    levels: Vec<Level>,
}

/// An open container: its kind, its item count, and how many values it has received.
struct Level {
    container: Container,
    len: usize,
    n_values: usize,
}

impl<'v, W: Write> Sink<'v> for Pickler<'v, W> {
    fn format(&self) -> &'static str {
        "pickle"
    }

    fn scalar(&mut self, scalar: Scalar<'v>) -> Result<(), AllocError> {
        self.start_value()?;
        match scalar {
            Scalar::None => self.frame.push(op::NONE),
            Scalar::Bool(true) => self.frame.push(op::NEWTRUE),
            Scalar::Bool(false) => self.frame.push(op::NEWFALSE),
            Scalar::Int(int) => self.save_int(int),
            Scalar::Float(float) => {
                self.frame.push(op::BINFLOAT);
                self.frame.extend_from_slice(&float.to_be_bytes());
            }
            Scalar::Str(text) => self.save_str(text)?,
        }
        self.value_done();
        Ok(())
    }

    fn begin(&mut self, container: Container, len: usize) -> Result<(), AllocError> {
        self.open(container, len, false)
    }

    fn end(&mut self) -> Result<(), AllocError> {
        let Some(level) = self.levels.pop() else {
            return Err(format_error("a container was closed twice".to_owned()));
        };
        if level.container == Container::Tuple {
            self.frame.push(match level.len {
                0 => op::EMPTY_TUPLE,
                1 => op::TUPLE1,
                2 => op::TUPLE2,
                3 => op::TUPLE3,
                _ => op::TUPLE,
            });
        }
        self.value_done();
        Ok(())
    }

    /// Writes each [`Frames`] allocation once and refers back to it with a `BINGET` after, as
    /// Python's pickle does for any object it meets twice.
    fn frames(&mut self, frames: &'v Frames) -> Result<(), AllocError> {
        if frames.is_empty() {
            return convert::emit_frames(frames, self);
        }
        let address = Arc::as_ptr(frames).cast::<Frame>() as usize;
        if let Some(&idx) = self.shared_frames.get(&address) {
            self.start_value()?;
            self.save_get(idx);
            self.value_done();
            return Ok(());
        }
        let memoize = self.n_memo < u32::MAX;
        if memoize {
            self.shared_frames.insert(address, self.n_memo);
        }
        self.open(Container::List, frames.len(), memoize)?;
        for frame in frames.iter() {
            convert::emit_frame(frame, self)?;
        }
        self.end()
    }
}

impl<'v, W: Write> Pickler<'v, W> {
    /// Commits the frame when it is full; called before each value, as Python does.
    fn start_value(&mut self) -> Result<(), AllocError> {
        if self.frame.len() >= FRAME_TARGET {
            self.commit_frame()?;
        }
        Ok(())
    }

    /// Opens a container (Python's `EMPTY_*`, then `MARK` before a batch of more than one
    /// item), memoizing it when asked.
    fn open(&mut self, container: Container, len: usize, memoize: bool) -> Result<(), AllocError> {
        self.start_value()?;
        if self.levels.len() >= MAX_DEPTH {
            return Err(format_error(format!(
                "values nest deeper than {MAX_DEPTH} levels"
            )));
        }
        match container {
            Container::List | Container::Dict => {
                self.frame.push(if container == Container::List {
                    op::EMPTY_LIST
                } else {
                    op::EMPTY_DICT
                });
                if memoize {
                    self.frame.push(op::MEMOIZE);
                    self.n_memo += 1;
                }
                if len > 1 {
                    self.frame.push(op::MARK);
                }
            }
            Container::Tuple => {
                if len > 3 {
                    self.frame.push(op::MARK);
                }
            }
        }
        self.levels.push(Level {
            container,
            len,
            n_values: 0,
        });
        Ok(())
    }

    /// Counts a finished value in its container, closing a batch of `APPENDS`/`SETITEMS` every
    /// 1000 items and at the end (`APPEND`/`SETITEM` for a batch of one).
    fn value_done(&mut self) {
        let Some(level) = self.levels.last_mut() else {
            return;
        };
        level.n_values += 1;
        let (per_item, one, many) = match level.container {
            Container::Tuple => return,
            Container::List => (1, op::APPEND, op::APPENDS),
            Container::Dict => (2, op::SETITEM, op::SETITEMS),
        };
        if level.n_values % per_item != 0 {
            return;
        }
        let n_items = level.n_values / per_item;
        if n_items % BATCH == 0 || n_items == level.len {
            let batch = (n_items - 1) % BATCH + 1;
            self.frame.push(if batch > 1 { many } else { one });
            if level.len.saturating_sub(n_items) > 1 {
                self.frame.push(op::MARK);
            }
        }
    }

    /// Python's `save_long` for protocol 2 and up.
    fn save_int(&mut self, int: i64) {
        if let Ok(small) = u8::try_from(int) {
            self.frame.extend_from_slice(&[op::BININT1, small]);
        } else if let Ok(medium) = u16::try_from(int) {
            self.frame.push(op::BININT2);
            self.frame.extend_from_slice(&medium.to_le_bytes());
        } else if let Ok(word) = i32::try_from(int) {
            self.frame.push(op::BININT);
            self.frame.extend_from_slice(&word.to_le_bytes());
        } else {
            // Minimal two's complement, little endian, as Python's `encode_long`.
            let bytes = int.to_le_bytes();
            let mut len = bytes.len();
            while len > 1 {
                let (top, next) = (bytes[len - 1], bytes[len - 2]);
                let redundant =
                    (top == 0x00 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
                if !redundant {
                    break;
                }
                len -= 1;
            }
            // `len` is at most 8, so it fits the one-byte count.
            self.frame.extend_from_slice(&[op::LONG1, len as u8]);
            self.frame.extend_from_slice(&bytes[..len]);
        }
    }

    /// A string, or a `BINGET` of the same string written before.
    fn save_str(&mut self, text: &'v str) -> Result<(), AllocError> {
        if let Some(&idx) = self.strings.get(text) {
            self.save_get(idx);
            return Ok(());
        }
        let bytes = text.as_bytes();
        if let Ok(short) = u8::try_from(bytes.len()) {
            self.frame.extend_from_slice(&[op::SHORT_BINUNICODE, short]);
        } else if let Ok(len) = u32::try_from(bytes.len()) {
            self.frame.push(op::BINUNICODE);
            self.frame.extend_from_slice(&len.to_le_bytes());
        } else {
            return Err(format_error(format!(
                "a string of {} bytes does not fit BINUNICODE (the viewer reads no BINUNICODE8)",
                bytes.len()
            )));
        }
        self.frame.extend_from_slice(bytes);
        // Memo indices are 4 bytes; past that, strings are simply written again.
        if self.n_memo < u32::MAX {
            self.frame.push(op::MEMOIZE);
            self.strings.insert(text, self.n_memo);
            self.n_memo += 1;
        }
        Ok(())
    }

    fn save_get(&mut self, idx: u32) {
        if let Ok(short) = u8::try_from(idx) {
            self.frame.extend_from_slice(&[op::BINGET, short]);
        } else {
            self.frame.push(op::LONG_BINGET);
            self.frame.extend_from_slice(&idx.to_le_bytes());
        }
    }

    /// Writes the frame (with a `FRAME` header unless it is tiny, as Python does) and empties it.
    fn commit_frame(&mut self) -> Result<(), AllocError> {
        if self.frame.is_empty() {
            return Ok(());
        }
        if self.frame.len() >= 4 {
            let mut header = [0u8; 9];
            header[0] = op::FRAME;
            header[1..].copy_from_slice(&(self.frame.len() as u64).to_le_bytes());
            self.writer.write_all(&header)?;
        }
        self.writer.write_all(&self.frame)?;
        self.frame.clear();
        Ok(())
    }
}

/// FxHash (rustc's hasher): the writer's memo hashes millions of short strings it wrote itself,
/// so speed matters and flooding does not.
#[derive(Debug, Default, Clone, Copy)]
struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.add(u64::from(byte));
    }

    fn write_usize(&mut self, word: usize) {
        self.add(word as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// One decoded instruction: the opcode, where it starts, and its argument bytes (the payload
/// after the count for counted arguments, the text without the newline for line arguments).
#[derive(Debug, Clone, Copy)]
struct Instr<'a> {
    code: u8,
    offset: usize,
    arg: &'a [u8],
}

impl Instr<'_> {
    fn name(&self) -> &'static str {
        opcode_info(self.code).map_or("?", |(name, _)| name)
    }

    fn error(&self, what: &str) -> AllocError {
        format_error(format!("{} at offset {}: {what}", self.name(), self.offset))
    }

    /// The argument as text.
    fn text(&self) -> Result<&str, AllocError> {
        std::str::from_utf8(self.arg).map_err(|_| self.error("argument is not valid UTF-8"))
    }

    /// A fixed little-endian unsigned argument of up to 8 bytes.
    fn uint(&self) -> u64 {
        let mut buf = [0u8; 8];
        let n = self.arg.len().min(8);
        buf[..n].copy_from_slice(&self.arg[..n]);
        u64::from_le_bytes(buf)
    }
}

/// Walks the opcode stream, checking that every argument lies inside the input.
struct Ops<'a> {
    bytes: &'a [u8],
    pos: usize,
    stopped: bool,
}

impl<'a> Ops<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Ops {
            bytes,
            pos: 0,
            stopped: false,
        }
    }

    /// The next instruction; `None` after `STOP`.
    fn next_op(&mut self) -> Result<Option<Instr<'a>>, AllocError> {
        if self.stopped {
            return Ok(None);
        }
        let offset = self.pos;
        let Some(&code) = self.bytes.get(offset) else {
            return Err(format_error(format!(
                "input ends at offset {offset} without STOP"
            )));
        };
        let Some((name, shape)) = opcode_info(code) else {
            return Err(format_error(format!(
                "unknown opcode {code:#04x} at offset {offset}"
            )));
        };
        let start = offset + 1;
        let (arg_start, arg_len) = match shape {
            ArgShape::Empty => (start, 0),
            ArgShape::Fixed(n) => (start, n),
            ArgShape::Counted(width) => {
                let count = self.take(name, offset, start, width)?;
                let mut buf = [0u8; 8];
                buf[..width].copy_from_slice(count);
                let len = usize::try_from(u64::from_le_bytes(buf)).unwrap_or(usize::MAX);
                (start + width, len)
            }
            ArgShape::CountedSigned4 => {
                let count = self.take(name, offset, start, 4)?;
                let len = i32::from_le_bytes([count[0], count[1], count[2], count[3]]);
                let len = usize::try_from(len).map_err(|_| {
                    format_error(format!("{name} at offset {offset}: negative length {len}"))
                })?;
                (start + 4, len)
            }
            ArgShape::Line | ArgShape::TwoLines => {
                let lines = if matches!(shape, ArgShape::TwoLines) {
                    2
                } else {
                    1
                };
                let mut end = start;
                for _ in 0..lines {
                    let rest = self.bytes.get(end..).unwrap_or_default();
                    let Some(newline) = rest.iter().position(|&b| b == b'\n') else {
                        return Err(format_error(format!(
                            "{name} at offset {offset}: argument has no terminating newline"
                        )));
                    };
                    end += newline + 1;
                }
                self.pos = end;
                let arg = &self.bytes[start..end - 1];
                return Ok(Some(self.finish(code, offset, arg)?));
            }
        };
        let arg = self.take(name, offset, arg_start, arg_len)?;
        self.pos = arg_start + arg_len;
        Ok(Some(self.finish(code, offset, arg)?))
    }

    /// `len` bytes from `start`, or a truncation error.
    fn take(
        &self,
        name: &str,
        offset: usize,
        start: usize,
        len: usize,
    ) -> Result<&'a [u8], AllocError> {
        let left = self.bytes.len().saturating_sub(start);
        if len > left {
            return Err(format_error(format!(
                "{name} at offset {offset} needs {len} bytes but {left} are left"
            )));
        }
        Ok(&self.bytes[start..start + len])
    }

    /// Checks what can be checked without meaning: frame lengths and the end.
    fn finish(&mut self, code: u8, offset: usize, arg: &'a [u8]) -> Result<Instr<'a>, AllocError> {
        let instr = Instr { code, offset, arg };
        match code {
            op::STOP => self.stopped = true,
            op::FRAME => {
                let left = (self.bytes.len() - self.pos) as u64;
                if instr.uint() > left {
                    return Err(instr.error(&format!(
                        "frame of {} bytes but {left} are left",
                        instr.uint()
                    )));
                }
            }
            _ => {}
        }
        Ok(instr)
    }
}

/// One stack entry of the reader.
#[derive(Debug)]
struct Slot {
    value: Value,
    /// Height of the value's tree (0 for a scalar).
    depth: usize,
    /// Nodes in the value's tree; what copying it costs.
    nodes: u64,
    /// Memo keys that refer to this entry and are read later by a `GET`.
    memo_keys: Vec<u32>,
    /// Whether a `GET` already copied this container, so changing it now would be lost.
    copied: bool,
}

impl Slot {
    fn new(value: Value) -> Self {
        let container = matches!(value, Value::List(_) | Value::Tuple(_) | Value::Dict(_));
        Slot {
            value,
            depth: usize::from(container),
            nodes: 1,
            memo_keys: Vec::new(),
            copied: false,
        }
    }

    /// A container made of `items`.
    fn container(
        items: Vec<Slot>,
        make: impl FnOnce(Vec<Value>) -> Value,
    ) -> Result<Self, AllocError> {
        let depth = items.iter().map(|item| item.depth).max().unwrap_or(0) + 1;
        let nodes = 1 + items.iter().map(|item| item.nodes).sum::<u64>();
        let value = make(items.into_iter().map(|item| item.value).collect());
        let slot = Slot {
            value,
            depth,
            nodes,
            memo_keys: Vec::new(),
            copied: false,
        };
        slot.check_depth()?;
        Ok(slot)
    }

    fn check_depth(&self) -> Result<(), AllocError> {
        if self.depth > MAX_DEPTH {
            return Err(format_error(format!(
                "values nest deeper than {MAX_DEPTH} levels"
            )));
        }
        Ok(())
    }

    /// Accounts for `item` having been added to this container.
    fn grow(&mut self, item: &Slot) -> Result<(), AllocError> {
        self.depth = self.depth.max(item.depth + 1);
        self.nodes += item.nodes;
        self.check_depth()
    }
}

/// Where a memo entry's value is.
#[derive(Debug)]
enum MemoEntry {
    /// Still on the stack at this index; it may grow until it is taken off.
    OnStack(usize),
    /// Taken off the stack: a copy, with its depth and node count.
    Done(Value, usize, u64),
}

/// The reader's state: Python's stack, mark stack and memo.
#[derive(Debug)]
struct Unpickler {
    stack: Vec<Slot>,
    marks: Vec<usize>,
    memo: HashMap<u32, MemoEntry>,
    /// Every memo key assigned so far (`MEMOIZE` uses their count as the next key).
    assigned: HashSet<u32>,
    /// The memo keys some `GET` reads; only these are kept.
    fetched: HashSet<u32>,
    /// Nodes `GET` and `DUP` may still copy before the input counts as hostile.
    copy_budget: u64,
}

impl Unpickler {
    fn run(bytes: &[u8]) -> Result<Value, AllocError> {
        let mut fetched = HashSet::new();
        let mut ops = Ops::new(bytes);
        while let Some(instr) = ops.next_op()? {
            if matches!(instr.code, op::BINGET | op::LONG_BINGET | op::GET) {
                fetched.insert(memo_key(&instr)?);
            }
        }
        let mut unpickler = Unpickler {
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            assigned: HashSet::new(),
            fetched,
            copy_budget: 16 * bytes.len() as u64 + (1 << 20),
        };
        let mut ops = Ops::new(bytes);
        while let Some(instr) = ops.next_op()? {
            if let Some(value) = unpickler.step(&instr)? {
                return Ok(value);
            }
        }
        Err(format_error("input ends without STOP".to_owned()))
    }

    /// Executes one instruction; returns the result at `STOP`.
    fn step(&mut self, instr: &Instr<'_>) -> Result<Option<Value>, AllocError> {
        match instr.code {
            op::PROTO => {
                let version = instr.arg[0];
                if version > 5 {
                    return Err(instr.error(&format!("unsupported protocol {version}")));
                }
            }
            op::FRAME => {}
            op::STOP => {
                if !self.marks.is_empty() || self.stack.len() != 1 {
                    return Err(instr.error(&format!(
                        "{} values and {} marks are left on the stack, expected one value",
                        self.stack.len(),
                        self.marks.len()
                    )));
                }
                let slot = self.pop(instr)?;
                return Ok(Some(slot.value));
            }
            op::NONE => self.push(Value::None),
            op::NEWTRUE => self.push(Value::Bool(true)),
            op::NEWFALSE => self.push(Value::Bool(false)),
            op::BININT => {
                let arg = instr.arg;
                self.push(Value::Int(i64::from(i32::from_le_bytes([
                    arg[0], arg[1], arg[2], arg[3],
                ]))));
            }
            op::BININT1 | op::BININT2 => self.push(Value::Int(instr.uint() as i64)),
            op::LONG1 | op::LONG4 => self.push(Value::Int(decode_long(instr)?)),
            op::INT => {
                let text = instr.text()?;
                let value = match text {
                    "00" => Value::Bool(false),
                    "01" => Value::Bool(true),
                    _ => Value::Int(parse_int(instr, text)?),
                };
                self.push(value);
            }
            op::LONG => {
                let text = instr.text()?;
                let digits = text.strip_suffix('L').unwrap_or(text);
                self.push(Value::Int(parse_int(instr, digits)?));
            }
            op::BINFLOAT => {
                let mut buf = [0u8; 8];
                buf.copy_from_slice(instr.arg);
                self.push(Value::Float(f64::from_be_bytes(buf)));
            }
            op::FLOAT => {
                let text = instr.text()?;
                let float = text
                    .trim()
                    .parse::<f64>()
                    .map_err(|_| instr.error(&format!("`{text}` is not a float")))?;
                self.push(Value::Float(float));
            }
            op::SHORT_BINUNICODE
            | op::BINUNICODE
            | op::BINUNICODE8
            | op::SHORT_BINSTRING
            | op::BINSTRING => self.push(Value::Str(instr.text()?.to_owned())),
            op::EMPTY_LIST | op::EMPTY_SET => self.push(Value::List(Vec::new())),
            op::EMPTY_DICT => self.push(Value::Dict(Vec::new())),
            op::EMPTY_TUPLE => self.push(Value::Tuple(Vec::new())),
            op::MARK => self.marks.push(self.stack.len()),
            op::LIST | op::FROZENSET => {
                let items = self.pop_mark(instr)?;
                self.stack.push(Slot::container(items, Value::List)?);
            }
            op::TUPLE => {
                let items = self.pop_mark(instr)?;
                self.stack.push(Slot::container(items, Value::Tuple)?);
            }
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                let n = usize::from(instr.code - op::TUPLE1) + 1;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop(instr)?);
                }
                items.reverse();
                self.stack.push(Slot::container(items, Value::Tuple)?);
            }
            op::DICT => {
                let items = self.pop_mark(instr)?;
                if items.len() % 2 != 0 {
                    return Err(instr.error("odd number of items for keys and values"));
                }
                let mut slot = Slot::new(Value::Dict(Vec::new()));
                let pairs = pair_up(&mut slot, items)?;
                slot.value = Value::Dict(pairs);
                self.stack.push(slot);
            }
            op::APPEND => {
                let item = self.pop(instr)?;
                self.extend_list(instr, vec![item])?;
            }
            op::APPENDS | op::ADDITEMS => {
                let items = self.pop_mark(instr)?;
                self.extend_list(instr, items)?;
            }
            op::SETITEM => {
                let item = self.pop(instr)?;
                let key = self.pop(instr)?;
                self.extend_dict(instr, vec![key, item])?;
            }
            op::SETITEMS => {
                let items = self.pop_mark(instr)?;
                if items.len() % 2 != 0 {
                    return Err(instr.error("odd number of items for keys and values"));
                }
                self.extend_dict(instr, items)?;
            }
            op::POP => {
                if self.stack.len() > self.floor() {
                    self.pop(instr)?;
                } else {
                    self.pop_mark(instr)?;
                }
            }
            op::POP_MARK => {
                self.pop_mark(instr)?;
            }
            op::DUP => {
                let top = self.top(instr)?;
                let (value, depth, nodes) = (top.value.clone(), top.depth, top.nodes);
                self.charge(instr, nodes)?;
                self.stack.push(Slot {
                    depth,
                    nodes,
                    ..Slot::new(value)
                });
            }
            op::MEMOIZE => {
                let key =
                    u32::try_from(self.assigned.len()).map_err(|_| instr.error("memo is full"))?;
                self.memoize(instr, key)?;
            }
            op::BINPUT | op::LONG_BINPUT | op::PUT => {
                let key = memo_key(instr)?;
                self.memoize(instr, key)?;
            }
            op::BINGET | op::LONG_BINGET | op::GET => {
                let key = memo_key(instr)?;
                self.fetch(instr, key)?;
            }
            op::SHORT_BINBYTES | op::BINBYTES | op::BINBYTES8 | op::BYTEARRAY8 => {
                return Err(instr.error("bytes values are not supported"));
            }
            op::STRING | op::UNICODE => {
                return Err(instr.error("protocol-0 text strings are not supported"));
            }
            _ => {
                return Err(instr
                    .error("builds or refers to a Python object; only plain data is supported"));
            }
        }
        Ok(None)
    }

    /// The stack length at the innermost mark; nothing below it may be popped.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn push(&mut self, value: Value) {
        self.stack.push(Slot::new(value));
    }

    fn top(&mut self, instr: &Instr<'_>) -> Result<&mut Slot, AllocError> {
        if self.stack.len() <= self.floor() {
            return Err(instr.error("stack is empty"));
        }
        self.stack
            .last_mut()
            .ok_or_else(|| instr.error("stack is empty"))
    }

    fn pop(&mut self, instr: &Instr<'_>) -> Result<Slot, AllocError> {
        if self.stack.len() <= self.floor() {
            return Err(instr.error("stack is empty"));
        }
        let pos = self.stack.len() - 1;
        match self.stack.pop() {
            Some(slot) => {
                self.settle(&slot, pos);
                Ok(slot)
            }
            None => Err(instr.error("stack is empty")),
        }
    }

    /// The values pushed since the innermost mark, which is removed.
    fn pop_mark(&mut self, instr: &Instr<'_>) -> Result<Vec<Slot>, AllocError> {
        let Some(mark) = self.marks.pop() else {
            return Err(instr.error("no MARK to pop to"));
        };
        let items = self.stack.split_off(mark);
        for (idx, slot) in items.iter().enumerate() {
            self.settle(slot, mark + idx);
        }
        Ok(items)
    }

    /// Keeps a copy of a value leaving the stack for the memo keys that still refer to it.
    fn settle(&mut self, slot: &Slot, pos: usize) {
        for key in &slot.memo_keys {
            if let Some(entry) = self.memo.get_mut(key) {
                if matches!(entry, MemoEntry::OnStack(at) if *at == pos) {
                    *entry = MemoEntry::Done(slot.value.clone(), slot.depth, slot.nodes);
                }
            }
        }
    }

    fn memoize(&mut self, instr: &Instr<'_>, key: u32) -> Result<(), AllocError> {
        let pos = self.stack.len().wrapping_sub(1);
        let fetched = self.fetched.contains(&key);
        let top = self.top(instr)?;
        if fetched {
            if !top.memo_keys.contains(&key) {
                top.memo_keys.push(key);
            }
            self.memo.insert(key, MemoEntry::OnStack(pos));
        }
        self.assigned.insert(key);
        Ok(())
    }

    fn fetch(&mut self, instr: &Instr<'_>, key: u32) -> Result<(), AllocError> {
        let (value, depth, nodes) = match self.memo.get(&key) {
            Some(MemoEntry::Done(value, depth, nodes)) => (value.clone(), *depth, *nodes),
            Some(MemoEntry::OnStack(pos)) => match self.stack.get_mut(*pos) {
                Some(slot) => {
                    slot.copied = true;
                    (slot.value.clone(), slot.depth, slot.nodes)
                }
                None => return Err(instr.error(&format!("memo key {key} is stale"))),
            },
            None => return Err(instr.error(&format!("memo key {key} was never set"))),
        };
        self.charge(instr, nodes)?;
        self.stack.push(Slot {
            depth,
            nodes,
            ..Slot::new(value)
        });
        Ok(())
    }

    /// Spends copy budget, failing on input that copies far more than it holds.
    fn charge(&mut self, instr: &Instr<'_>, nodes: u64) -> Result<(), AllocError> {
        self.copy_budget = self.copy_budget.checked_sub(nodes).ok_or_else(|| {
            instr.error("memo references copy too much data for the input's size")
        })?;
        Ok(())
    }

    fn extend_list(&mut self, instr: &Instr<'_>, items: Vec<Slot>) -> Result<(), AllocError> {
        let target = self.top(instr)?;
        if target.copied {
            return Err(instr.error("a container refers to itself"));
        }
        for item in &items {
            target.grow(item)?;
        }
        match &mut target.value {
            Value::List(list) => {
                list.extend(items.into_iter().map(|item| item.value));
                Ok(())
            }
            other => Err(instr.error(&format!("target is a {}, not a list", value_kind(other)))),
        }
    }

    fn extend_dict(&mut self, instr: &Instr<'_>, items: Vec<Slot>) -> Result<(), AllocError> {
        let target = self.top(instr)?;
        if target.copied {
            return Err(instr.error("a container refers to itself"));
        }
        let pairs = pair_up(target, items)?;
        match &mut target.value {
            Value::Dict(dict) => {
                dict.extend(pairs);
                Ok(())
            }
            other => Err(instr.error(&format!("target is a {}, not a dict", value_kind(other)))),
        }
    }
}

/// Pairs up keys and values, accounting for them in `target`.
fn pair_up(target: &mut Slot, items: Vec<Slot>) -> Result<Vec<(Value, Value)>, AllocError> {
    let mut pairs = Vec::with_capacity(items.len() / 2);
    let mut items = items.into_iter();
    while let (Some(key), Some(item)) = (items.next(), items.next()) {
        target.grow(&key)?;
        target.grow(&item)?;
        pairs.push((key.value, item.value));
    }
    Ok(pairs)
}

/// A memo key from a `GET`/`PUT` instruction (binary or text).
fn memo_key(instr: &Instr<'_>) -> Result<u32, AllocError> {
    match instr.code {
        op::GET | op::PUT => {
            let text = instr.text()?;
            text.trim()
                .parse::<u32>()
                .map_err(|_| instr.error(&format!("`{text}` is not a memo key")))
        }
        // One or four bytes, so the value fits.
        _ => Ok(instr.uint() as u32),
    }
}

/// A `LONG1`/`LONG4` payload: two's complement, little endian, any length.
fn decode_long(instr: &Instr<'_>) -> Result<i64, AllocError> {
    let bytes = instr.arg;
    let Some(&last) = bytes.last() else {
        return Ok(0);
    };
    let negative = last & 0x80 != 0;
    let fill = if negative { 0xff } else { 0x00 };
    let (low, high) = bytes.split_at(bytes.len().min(8));
    let low_top_negative = low.last().is_some_and(|b| b & 0x80 != 0);
    if high.iter().any(|&b| b != fill) || (!high.is_empty() && low_top_negative != negative) {
        return Err(instr.error("integer does not fit in 64 bits"));
    }
    let mut buf = [fill; 8];
    buf[..low.len()].copy_from_slice(low);
    Ok(i64::from_le_bytes(buf))
}

fn parse_int(instr: &Instr<'_>, text: &str) -> Result<i64, AllocError> {
    text.trim()
        .parse::<i64>()
        .map_err(|_| instr.error(&format!("`{text}` is not an integer that fits in 64 bits")))
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
