//! The reader: Python's unpickler for plain data, building a [`Value`].
//!
//! The reader checks every length against the bytes left, limits nesting to `MAX_DEPTH` and
//! the work done copying memoized values to a multiple of the input size, so truncated or
//! hostile input gives [`AllocError::Format`] rather than a panic or an unbounded allocation.
//! Memoized values are copied on `BINGET` (a [`Value`] cannot share), which is exact for
//! everything `pickle` writes except self-referencing containers; those are refused.
//!
//! It sits on the instruction walker of `instr` and the opcodes of `op`. It must not know the
//! snapshot's structure, which `from_value` reads from the value, nor how pickles are written.

use std::collections::{HashMap, HashSet};

use super::instr::{Instr, Ops};
use super::{format_error, op, MAX_DEPTH};
use crate::error::AllocError;
use crate::snapshot::from_value::value_kind;
use crate::snapshot::Value;

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
pub(super) struct Unpickler {
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
    pub(super) fn run(bytes: &[u8]) -> Result<Value, AllocError> {
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
