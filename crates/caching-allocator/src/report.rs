//! Human-readable reports: `memory_summary()` in PyTorch's table layout and the OOM message.
//! (Being written.)

use crate::stats::MemoryStats;

/// Formats a byte count as PyTorch's `format_size` does.
pub fn format_size(bytes: u64) -> String {
    format!("{bytes} bytes")
}

/// PyTorch's `memory_summary()` table.
pub fn memory_summary(stats: &MemoryStats, device: i64, abbreviated: bool) -> String {
    let _ = (stats, device, abbreviated);
    String::new()
}

impl std::fmt::Display for crate::error::OutOfMemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out of memory: tried to allocate {}", format_size(self.attempted))
    }
}
