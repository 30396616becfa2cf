//! JSON snapshots: the structure of PyTorch's snapshot pickles, as JSON, which the newest memory
//! viewer parses before trying its unpickler.
//!
//! It sits on [`Value`] and the snapshot conversions of `sink` (writing is a `sink::Sink` that
//! streams) and `from_value`; it knows nothing of pickles.
//! Tuples become arrays; dict keys must be strings in JSON, so int, bool and `None` keys are
//! written as Python's `json` module writes them (`"7"`, `"true"`, `"null"`) and other keys are
//! an error, as are NaN and infinite floats (JSON has no spelling for them).
//!
//! serde_json escapes, unescapes and checks strings and numbers. The nesting of objects and
//! arrays is walked here, because serde_json's own map type sorts keys unless its
//! `preserve_order` feature is on, and a dict's order is part of a [`Value`].

use std::io::{BufWriter, Read, Write};

use super::from_value;
use super::pickle::MAX_DEPTH;
use super::sink::{self, Container, Scalar, Sink};
use super::{Snapshot, Value};
use crate::error::AllocError;

/// Writes a snapshot as JSON, in the same structure as [`write_pickle`](super::write_pickle).
///
/// Fails with [`AllocError::Format`] when an unsigned field is 2^63 or more or a float is not
/// finite, and with [`AllocError::Io`] when writing fails.
pub fn write_json(snapshot: &Snapshot, writer: impl Write) -> Result<(), AllocError> {
    write_with(writer, |json| sink::emit_snapshot(snapshot, json))
}

/// Reads a JSON snapshot: one written by [`write_json`], or PyTorch's snapshot dumped with
/// Python's `json` module.
pub fn read_json(reader: impl Read) -> Result<Snapshot, AllocError> {
    let value = read_value_json(reader)?;
    from_value::snapshot_from_value(value, "json")
}

/// Writes any [`Value`] as compact JSON.
#[cfg(test)]
pub(super) fn write_value_json(value: &Value, writer: impl Write) -> Result<(), AllocError> {
    write_with(writer, |json| sink::emit_value(value, json))
}

/// Reads one JSON document into a [`Value`]: objects become dicts with string keys (in the
/// document's order), arrays lists, numbers without a fraction or exponent ints (an error when
/// they do not fit `i64`), other numbers floats.
pub(super) fn read_value_json(mut reader: impl Read) -> Result<Value, AllocError> {
    let mut bytes = Vec::new();
    reader.read_to_end(&mut bytes)?;
    let mut parser = Parser {
        bytes: &bytes,
        pos: 0,
    };
    let value = parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != bytes.len() {
        return Err(parser.error("trailing characters after the document"));
    }
    Ok(value)
}

fn format_error(reason: String) -> AllocError {
    AllocError::Format {
        format: "json",
        reason,
    }
}

/// serde_json's errors while writing are I/O errors of the writer.
fn serde_error(err: serde_json::Error) -> AllocError {
    if err.is_io() {
        AllocError::Io(err.into())
    } else {
        format_error(err.to_string())
    }
}

/// Runs `body` on a JSON writer over `writer` and flushes it.
fn write_with<W: Write>(
    writer: W,
    body: impl FnOnce(&mut JsonWriter<W>) -> Result<(), AllocError>,
) -> Result<(), AllocError> {
    let mut json = JsonWriter {
        out: BufWriter::with_capacity(1 << 16, writer),
        levels: Vec::new(),
    };
    body(&mut json)?;
    json.out.flush()?;
    Ok(())
}

/// The JSON writer: a [`Sink`] that writes as it goes.
struct JsonWriter<W: Write> {
    out: BufWriter<W>,
    /// Open containers, each with the number of values written into it.
    levels: Vec<(Container, usize)>,
}

impl<W: Write> JsonWriter<W> {
    /// Writes the separator a value needs; returns whether the value is a dict key.
    fn separate(&mut self) -> Result<bool, AllocError> {
        let Some((container, n_values)) = self.levels.last_mut() else {
            return Ok(false);
        };
        let is_key = *container == Container::Dict && *n_values % 2 == 0;
        if *container == Container::Dict && !is_key {
            self.out.write_all(b":")?;
        } else if *n_values > 0 {
            self.out.write_all(b",")?;
        }
        *n_values += 1;
        Ok(is_key)
    }
}

impl<'v, W: Write> Sink<'v> for JsonWriter<W> {
    fn format(&self) -> &'static str {
        "json"
    }

    fn scalar(&mut self, scalar: Scalar<'v>) -> Result<(), AllocError> {
        let is_key = self.separate()?;
        let out = &mut self.out;
        match (scalar, is_key) {
            (Scalar::Str(text), _) => serde_json::to_writer(out, text).map_err(serde_error)?,
            (Scalar::None, false) => out.write_all(b"null")?,
            (Scalar::None, true) => out.write_all(b"\"null\"")?,
            (Scalar::Bool(flag), false) => write!(out, "{flag}")?,
            (Scalar::Bool(flag), true) => write!(out, "\"{flag}\"")?,
            (Scalar::Int(int), false) => write!(out, "{int}")?,
            (Scalar::Int(int), true) => write!(out, "\"{int}\"")?,
            (Scalar::Float(float), false) => {
                if !float.is_finite() {
                    return Err(format_error(format!("JSON cannot hold the float {float}")));
                }
                serde_json::to_writer(out, &float).map_err(serde_error)?;
            }
            (Scalar::Float(_), true) => {
                return Err(format_error(
                    "a dict key is a float; JSON keys are strings".to_owned(),
                ))
            }
        }
        Ok(())
    }

    fn begin(&mut self, container: Container, _len: usize) -> Result<(), AllocError> {
        if self.separate()? {
            return Err(format_error(
                "a dict key is a container; JSON keys are strings".to_owned(),
            ));
        }
        if self.levels.len() >= MAX_DEPTH {
            return Err(format_error(format!(
                "values nest deeper than {MAX_DEPTH} levels"
            )));
        }
        self.out.write_all(if container == Container::Dict {
            b"{"
        } else {
            b"["
        })?;
        self.levels.push((container, 0));
        Ok(())
    }

    fn end(&mut self) -> Result<(), AllocError> {
        let Some((container, _)) = self.levels.pop() else {
            return Err(format_error("a container was closed twice".to_owned()));
        };
        self.out.write_all(if container == Container::Dict {
            b"}"
        } else {
            b"]"
        })?;
        Ok(())
    }
}

fn nested(depth: usize) -> Result<usize, AllocError> {
    if depth >= MAX_DEPTH {
        return Err(format_error(format!(
            "values nest deeper than {MAX_DEPTH} levels"
        )));
    }
    Ok(depth + 1)
}

/// A recursive-descent walk over objects and arrays; leaves go to serde_json.
struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> AllocError {
        format_error(format!("{what} at byte {}", self.pos))
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_whitespace();
        self.bytes.get(self.pos).copied()
    }

    /// Consumes `byte` (after whitespace) or fails.
    fn expect(&mut self, byte: u8) -> Result<(), AllocError> {
        if self.peek() != Some(byte) {
            return Err(self.error(&format!("expected `{}`", char::from(byte))));
        }
        self.pos += 1;
        Ok(())
    }

    fn value(&mut self, depth: usize) -> Result<Value, AllocError> {
        match self.peek() {
            Some(b'{') => {
                let depth = nested(depth)?;
                self.pos += 1;
                let mut pairs = Vec::new();
                if self.peek() == Some(b'}') {
                    self.pos += 1;
                    return Ok(Value::Dict(pairs));
                }
                loop {
                    if self.peek() != Some(b'"') {
                        return Err(self.error("expected a string key"));
                    }
                    let key = self.string()?;
                    self.expect(b':')?;
                    let item = self.value(depth)?;
                    pairs.push((Value::Str(key), item));
                    match self.peek() {
                        Some(b',') => self.pos += 1,
                        Some(b'}') => {
                            self.pos += 1;
                            return Ok(Value::Dict(pairs));
                        }
                        _ => return Err(self.error("expected `,` or `}`")),
                    }
                }
            }
            Some(b'[') => {
                let depth = nested(depth)?;
                self.pos += 1;
                let mut items = Vec::new();
                if self.peek() == Some(b']') {
                    self.pos += 1;
                    return Ok(Value::List(items));
                }
                loop {
                    items.push(self.value(depth)?);
                    match self.peek() {
                        Some(b',') => self.pos += 1,
                        Some(b']') => {
                            self.pos += 1;
                            return Ok(Value::List(items));
                        }
                        _ => return Err(self.error("expected `,` or `]`")),
                    }
                }
            }
            Some(b'"') => Ok(Value::Str(self.string()?)),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::None),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.error("expected a value")),
            None => Err(self.error("input ends where a value should be")),
        }
    }

    fn literal(&mut self, word: &str, value: Value) -> Result<Value, AllocError> {
        if !self.bytes[self.pos..].starts_with(word.as_bytes()) {
            return Err(self.error("expected a value"));
        }
        self.pos += word.len();
        Ok(value)
    }

    /// The string starting at `pos` (a `"`); serde_json unescapes and checks it.
    fn string(&mut self) -> Result<String, AllocError> {
        let start = self.pos;
        let mut end = start + 1;
        let mut escaped = false;
        loop {
            match self.bytes.get(end) {
                None => return Err(self.error("unterminated string")),
                Some(b'"') => break,
                Some(b'\\') => {
                    escaped = true;
                    end += 2;
                }
                Some(_) => end += 1,
            }
        }
        let raw = &self.bytes[start..=end];
        let text = match std::str::from_utf8(&raw[1..raw.len() - 1]) {
            Ok(text) if !escaped && !text.bytes().any(|b| b < 0x20) => text.to_owned(),
            _ => serde_json::from_slice::<String>(raw)
                .map_err(|err| self.error(&format!("bad string ({err})")))?,
        };
        self.pos = end + 1;
        Ok(text)
    }

    fn number(&mut self) -> Result<Value, AllocError> {
        let start = self.pos;
        let mut end = start;
        let mut integral = true;
        while let Some(&byte) = self.bytes.get(end) {
            match byte {
                b'0'..=b'9' | b'-' | b'+' => {}
                b'.' | b'e' | b'E' => integral = false,
                _ => break,
            }
            end += 1;
        }
        let raw = &self.bytes[start..end];
        let value = if integral {
            serde_json::from_slice::<i64>(raw)
                .map(Value::Int)
                .map_err(|err| {
                    self.error(&format!("bad integer or one that does not fit i64 ({err})"))
                })?
        } else {
            // serde_json checks the grammar; its fast float parsing can be one ulp off without
            // its `float_roundtrip` feature, so the value comes from the correctly rounded std
            // parser.
            let checked = serde_json::from_slice::<f64>(raw)
                .map_err(|err| self.error(&format!("bad number ({err})")))?;
            let exact = std::str::from_utf8(raw)
                .ok()
                .and_then(|text| text.parse::<f64>().ok())
                .unwrap_or(checked);
            Value::Float(exact)
        };
        self.pos = end;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Value, AllocError> {
        read_value_json(text.as_bytes())
    }

    #[test]
    fn round_trips_values_in_order() {
        let value = Value::Dict(vec![
            (Value::Str("z \"quoted\"\n\u{e9}".into()), Value::Float(0.0)),
            (
                Value::Str("a".into()),
                Value::List(vec![Value::None, Value::Bool(false)]),
            ),
            (Value::Str("m".into()), Value::Int(i64::MIN)),
            (Value::Str("f".into()), Value::Float(-1.5e-300)),
        ]);
        let mut out = Vec::new();
        write_value_json(&value, &mut out).expect("writes");
        assert_eq!(
            parse(std::str::from_utf8(&out).expect("utf-8")).expect("reads"),
            value
        );
    }

    #[test]
    fn keys_and_tuples_follow_pythons_json() {
        let value = Value::Dict(vec![
            (
                Value::Int(7),
                Value::Tuple(vec![Value::Int(1), Value::Int(2)]),
            ),
            (Value::None, Value::Bool(true)),
        ]);
        let mut out = Vec::new();
        write_value_json(&value, &mut out).expect("writes");
        assert_eq!(out, br#"{"7":[1,2],"null":true}"#);
        let bad = Value::Dict(vec![(Value::Tuple(Vec::new()), Value::None)]);
        assert!(write_value_json(&bad, Vec::new()).is_err());
        assert!(write_value_json(&Value::Float(f64::NAN), Vec::new()).is_err());
    }

    #[test]
    fn rejects_malformed_documents() {
        for text in [
            "",
            "{",
            "[1,]",
            "{\"a\" 1}",
            "[1] x",
            "9223372036854775808",
            "\"\\x\"",
            "nul",
            "[\"\u{1}\"]",
            "01",
        ] {
            assert!(parse(text).is_err(), "{text:?}");
        }
        assert_eq!(parse(" -12 ").expect("int"), Value::Int(-12));
        assert_eq!(
            parse("\"\\u00e9\\n\"").expect("str"),
            Value::Str("\u{e9}\n".into())
        );
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert!(parse(&deep).is_err());
    }
}
