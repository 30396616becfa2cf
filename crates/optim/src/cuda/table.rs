//! Piece tables: the bytes a multi-tensor launch reads, one entry per tensor (or range of one)
//! in the layout of the kernels' structs (`kernels/*.cu`, each with a `static_assert` on its
//! size), little-endian as the GPU reads them.
//!
//! Every entry starts with `PieceHead` (`kernels/optim.cuh`): length, first block, skip-counter
//! address and step. A rule's CUDA module writes the rest field by field in struct order and
//! closes the entry with the struct's size, which is checked here.

/// The header every piece struct starts with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PieceHead {
    /// Elements.
    pub(crate) len: u64,
    /// Its first block in the launch.
    pub(crate) first_block: u64,
    /// The parameter's skip counter (0: none).
    pub(crate) skipped: u64,
    /// The host's step number.
    pub(crate) step: u64,
}

/// One writer per field type: `table.u64(value)` appends `value` as the kernels read it (its
/// little-endian bytes) and returns the table for the next field.
macro_rules! field_writers {
    ($($ty:ident),*) => {
        $(
            #[doc = concat!("Appends a `", stringify!($ty), "` field.")]
            pub(crate) fn $ty(&mut self, value: $ty) -> &mut Table {
                self.bytes.extend(value.to_le_bytes());
                self
            }
        )*
    };
}

/// The bytes of one launch's table (or of several launches' tables back to back).
#[derive(Debug, Default)]
pub(crate) struct Table {
    bytes: Vec<u8>,
    entry_start: usize,
}

impl Table {
    /// Starts an entry with its header.
    pub(crate) fn entry(&mut self, head: PieceHead) -> &mut Table {
        self.entry_start = self.bytes.len();
        self.u64(head.len)
            .u64(head.first_block)
            .u64(head.skipped)
            .u64(head.step)
    }

    field_writers!(u64, f64, u32, f32);

    /// Appends `values` as `u64` fields, in order (a piece's buffer addresses).
    pub(crate) fn u64s(&mut self, values: &[u64]) -> &mut Table {
        for &value in values {
            self.u64(value);
        }
        self
    }

    /// Ends the entry, which must have the kernel struct's `size`.
    pub(crate) fn end(&mut self, size: usize) {
        assert_eq!(
            self.bytes.len() - self.entry_start,
            size,
            "piece table entry does not match its kernel struct"
        );
    }

    /// Bytes written so far (the offset of the next entry).
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Flags of the piece structs (`kernels/optim.cuh`).
pub(crate) mod flags {
    pub(crate) const HOST_SCALED: u32 = 1;
    pub(crate) const MAXIMIZE: u32 = 2;
    pub(crate) const L2: u32 = 4;
    pub(crate) const DECAY: u32 = 8;
    pub(crate) const CHANGES_GRAD: u32 = 16;
    pub(crate) const MOMENTUM: u32 = 32;
    pub(crate) const NESTEROV: u32 = 64;
    /// 8-bit Adam in bitsandbytes' own (fast-math) arithmetic (`Adam8bitMath::Bitsandbytes`).
    pub(crate) const BNB_ARITH: u32 = 128;
    /// 8- and 4-bit Adam: a bf16 parameter rounded stochastically (`Bf16Rounding::Stochastic`).
    pub(crate) const STOCHASTIC: u32 = 256;

    /// `flag` when `on`, else 0.
    pub(crate) fn when(on: bool, flag: u32) -> u32 {
        if on {
            flag
        } else {
            0
        }
    }
}
