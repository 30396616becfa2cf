//! The protocol-4 writer, streaming from `sink`'s [`Sink`] into pickle opcodes.
//!
//! The writer follows Python's `pickle` for the same data: `PROTO 4`, 64 KiB `FRAME`s, the
//! smallest integer opcode that fits, `APPENDS`/`SETITEMS` in batches of 1000, and strings
//! memoized so that repeated keys and frame names cost a `BINGET` each. Each [`Frames`]
//! allocation is written once and referred back to with `BINGET`, which is how Python's pickle
//! writes any shared object, so every unpickler (the viewer's included) reads it; no other
//! container is shared. It writes only the viewer's opcodes.
//!
//! It sits on the opcodes of `op` and on `sink`'s [`Sink`]. It must not know the snapshot's
//! structure, which `sink` streams into it, nor how pickles are read.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::Write;
use std::sync::Arc;

use super::{format_error, op, MAX_DEPTH};
use crate::error::AllocError;
use crate::snapshot::sink::{self, Container, Scalar, Sink};
use crate::snapshot::{Frame, Frames};

/// Python's framer commits a frame once it holds this many bytes.
const FRAME_TARGET: usize = 64 * 1024;

/// Python's batch size for `APPENDS` and `SETITEMS`.
const BATCH: usize = 1000;

/// Writes `PROTO 4`, what `body` streams into the pickler, and `STOP`.
pub(super) fn write_with<'v, W: Write>(
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
pub(super) struct Pickler<'v, W: Write> {
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
            return sink::emit_frames(frames, self);
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
            sink::emit_frame(frame, self)?;
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
