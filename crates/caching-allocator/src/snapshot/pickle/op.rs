//! Python's pickle opcodes: each opcode's byte, its name, and how its argument is laid out.
//!
//! The constants carry Python's own names (`Lib/pickle.py`), so the writer and reader read like
//! Python's; [`opcode_info`] is the table both the instruction walker and error messages use.
//!
//! It sits on nothing. It must not know what an opcode does: building values is the reader's,
//! choosing opcodes the writer's.

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

/// How an opcode's argument is laid out after the opcode byte.
#[derive(Debug, Clone, Copy)]
pub(super) enum ArgShape {
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
pub(super) fn opcode_info(code: u8) -> Option<(&'static str, ArgShape)> {
    use ArgShape::{Counted, CountedSigned4, Empty, Fixed, Line, TwoLines};
    Some(match code {
        MARK => ("MARK", Empty),
        STOP => ("STOP", Empty),
        POP => ("POP", Empty),
        POP_MARK => ("POP_MARK", Empty),
        DUP => ("DUP", Empty),
        FLOAT => ("FLOAT", Line),
        INT => ("INT", Line),
        BININT => ("BININT", Fixed(4)),
        BININT1 => ("BININT1", Fixed(1)),
        LONG => ("LONG", Line),
        BININT2 => ("BININT2", Fixed(2)),
        NONE => ("NONE", Empty),
        PERSID => ("PERSID", Line),
        BINPERSID => ("BINPERSID", Empty),
        REDUCE => ("REDUCE", Empty),
        STRING => ("STRING", Line),
        BINSTRING => ("BINSTRING", CountedSigned4),
        SHORT_BINSTRING => ("SHORT_BINSTRING", Counted(1)),
        UNICODE => ("UNICODE", Line),
        BINUNICODE => ("BINUNICODE", Counted(4)),
        APPEND => ("APPEND", Empty),
        BUILD => ("BUILD", Empty),
        GLOBAL => ("GLOBAL", TwoLines),
        DICT => ("DICT", Empty),
        EMPTY_DICT => ("EMPTY_DICT", Empty),
        APPENDS => ("APPENDS", Empty),
        GET => ("GET", Line),
        BINGET => ("BINGET", Fixed(1)),
        INST => ("INST", TwoLines),
        LONG_BINGET => ("LONG_BINGET", Fixed(4)),
        LIST => ("LIST", Empty),
        EMPTY_LIST => ("EMPTY_LIST", Empty),
        OBJ => ("OBJ", Empty),
        PUT => ("PUT", Line),
        BINPUT => ("BINPUT", Fixed(1)),
        LONG_BINPUT => ("LONG_BINPUT", Fixed(4)),
        SETITEM => ("SETITEM", Empty),
        TUPLE => ("TUPLE", Empty),
        EMPTY_TUPLE => ("EMPTY_TUPLE", Empty),
        SETITEMS => ("SETITEMS", Empty),
        BINFLOAT => ("BINFLOAT", Fixed(8)),
        PROTO => ("PROTO", Fixed(1)),
        NEWOBJ => ("NEWOBJ", Empty),
        EXT1 => ("EXT1", Fixed(1)),
        EXT2 => ("EXT2", Fixed(2)),
        EXT4 => ("EXT4", Fixed(4)),
        TUPLE1 => ("TUPLE1", Empty),
        TUPLE2 => ("TUPLE2", Empty),
        TUPLE3 => ("TUPLE3", Empty),
        NEWTRUE => ("NEWTRUE", Empty),
        NEWFALSE => ("NEWFALSE", Empty),
        LONG1 => ("LONG1", Counted(1)),
        LONG4 => ("LONG4", CountedSigned4),
        BINBYTES => ("BINBYTES", Counted(4)),
        SHORT_BINBYTES => ("SHORT_BINBYTES", Counted(1)),
        SHORT_BINUNICODE => ("SHORT_BINUNICODE", Counted(1)),
        BINUNICODE8 => ("BINUNICODE8", Counted(8)),
        BINBYTES8 => ("BINBYTES8", Counted(8)),
        EMPTY_SET => ("EMPTY_SET", Empty),
        ADDITEMS => ("ADDITEMS", Empty),
        FROZENSET => ("FROZENSET", Empty),
        NEWOBJ_EX => ("NEWOBJ_EX", Empty),
        STACK_GLOBAL => ("STACK_GLOBAL", Empty),
        MEMOIZE => ("MEMOIZE", Empty),
        FRAME => ("FRAME", Fixed(8)),
        BYTEARRAY8 => ("BYTEARRAY8", Counted(8)),
        NEXT_BUFFER => ("NEXT_BUFFER", Empty),
        READONLY_BUFFER => ("READONLY_BUFFER", Empty),
        _ => return None,
    })
}
