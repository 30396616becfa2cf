//! Snapshot <-> Value (being written).
