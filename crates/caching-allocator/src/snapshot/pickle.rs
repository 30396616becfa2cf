//! Pickle files (being written).

use std::io::{Read, Write};

use super::Snapshot;
use crate::error::AllocError;

/// Opcodes the viewer reads.
pub const VIEWER_OPCODES: &[u8] = &[];

/// Writes a snapshot as a protocol-4 pickle.
pub fn write_pickle(snapshot: &Snapshot, writer: impl Write) -> Result<(), AllocError> {
    let _ = (snapshot, writer);
    unimplemented!()
}

/// Reads a snapshot pickle.
pub fn read_pickle(reader: impl Read) -> Result<Snapshot, AllocError> {
    let _ = reader;
    unimplemented!()
}
