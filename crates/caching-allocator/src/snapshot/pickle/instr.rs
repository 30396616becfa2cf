//! The opcode stream: decoding a pickle's bytes into instructions, one opcode and its argument
//! at a time.
//!
//! Every argument's length is checked against the bytes left, so a truncated or malformed input
//! is a typed error naming the opcode and its offset; an instruction's argument is a slice of
//! the input, never a copy. Frame headers are checked, then walked through like any opcode.
//!
//! It sits on the opcode table of `op`. It must not give an opcode meaning: values and the memo
//! belong to the reader.

use super::format_error;
use super::op::{self, opcode_info, ArgShape};
use crate::error::AllocError;

/// One decoded instruction: the opcode, where it starts, and its argument bytes (the payload
/// after the count for counted arguments, the text without the newline for line arguments).
#[derive(Debug, Clone, Copy)]
pub(super) struct Instr<'a> {
    pub(super) code: u8,
    pub(super) offset: usize,
    pub(super) arg: &'a [u8],
}

impl Instr<'_> {
    pub(super) fn name(&self) -> &'static str {
        opcode_info(self.code).map_or("?", |(name, _)| name)
    }

    pub(super) fn error(&self, what: &str) -> AllocError {
        format_error(format!("{} at offset {}: {what}", self.name(), self.offset))
    }

    /// The argument as text.
    pub(super) fn text(&self) -> Result<&str, AllocError> {
        std::str::from_utf8(self.arg).map_err(|_| self.error("argument is not valid UTF-8"))
    }

    /// A fixed little-endian unsigned argument of up to 8 bytes.
    pub(super) fn uint(&self) -> u64 {
        let mut buf = [0u8; 8];
        let n = self.arg.len().min(8);
        buf[..n].copy_from_slice(&self.arg[..n]);
        u64::from_le_bytes(buf)
    }
}

/// Walks the opcode stream, checking that every argument lies inside the input.
pub(super) struct Ops<'a> {
    bytes: &'a [u8],
    pos: usize,
    stopped: bool,
}

impl<'a> Ops<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Ops {
            bytes,
            pos: 0,
            stopped: false,
        }
    }

    /// The next instruction; `None` after `STOP`.
    pub(super) fn next_op(&mut self) -> Result<Option<Instr<'a>>, AllocError> {
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
