//! JSON snapshots (being written).

use std::io::{Read, Write};

use super::Snapshot;
use crate::error::AllocError;

/// Writes a snapshot as JSON.
pub fn write_json(snapshot: &Snapshot, writer: impl Write) -> Result<(), AllocError> {
    let _ = (snapshot, writer);
    unimplemented!()
}

/// Reads a JSON snapshot.
pub fn read_json(reader: impl Read) -> Result<Snapshot, AllocError> {
    let _ = reader;
    unimplemented!()
}
