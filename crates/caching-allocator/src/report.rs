//! Human-readable reports: `memory_summary()` in PyTorch's table layout and the OOM message.
//!
//! [`memory_summary`] renders [`MemoryStats`] exactly as `torch.cuda.memory_summary()` renders
//! PyTorch's, character for character, and appends a section with the figures of
//! [`FragmentationStats`] that PyTorch lacks. [`format_size`] is the C++ `format_size` of
//! PyTorch's OOM message, and the `Display` of [`OutOfMemoryReport`] is that message, adapted.
//! This module only formats numbers; it computes none.

use std::fmt;

use crate::error::OutOfMemoryReport;
use crate::stats::{FragmentationStats, MemoryStats, Stat, StatArray};

/// Formats a byte count as PyTorch's C++ `format_size` does (used in its OOM message).
///
/// Up to 1024: "N bytes"; up to 1 MiB (inclusive): KiB; up to 1 GiB (inclusive): MiB; above:
/// GiB; always with two decimals, rounded half to even on the exact value as C++ streams do.
///
/// ```
/// use headroom_caching_allocator::format_size;
///
/// assert_eq!(format_size(1024), "1024 bytes");
/// assert_eq!(format_size(20 << 20), "20.00 MiB");
/// assert_eq!(format_size(1 << 20), "1024.00 KiB");
/// ```
pub fn format_size(bytes: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes <= KIB {
        format!("{bytes} bytes")
    } else if bytes <= MIB {
        format!("{:.2} KiB", bytes as f64 / KIB as f64)
    } else if bytes <= GIB {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    }
}

/// PyTorch's `torch.cuda.memory_summary()` table for `stats`, followed by a section of the same
/// style with the figures of `fragmentation`.
///
/// The PyTorch part matches `torch/cuda/memory.py` to the character, wording included ("PyTorch
/// CUDA memory summary", "CUDA OOMs", "cudaMalloc retries"), so that tools and eyes used to
/// PyTorch's table read this one unchanged. Every line is 75 characters between its `|` bars
/// and ends with a newline. `abbreviated` drops the per-pool rows.
///
/// The extra section lists "Largest free block (small pool)", "Largest free block (large
/// pool)", "Stranded free memory" (free bytes that `empty_cache` cannot release) and "Internal
/// waste" (bytes handed out beyond the requests), each in bytes and in [`format_size`] form.
pub fn memory_summary(
    stats: &MemoryStats,
    fragmentation: &FragmentationStats,
    device: i64,
    abbreviated: bool,
) -> String {
    let mut lines: Vec<String> = Vec::new();
    let double_rule = "=".repeat(LINE_WIDTH);
    let rule = "-".repeat(LINE_WIDTH);

    lines.push(double_rule.clone());
    lines.push(format!(
        " {:16} PyTorch CUDA memory summary, device ID {device:<17} ",
        ""
    ));
    lines.push(rule.clone());
    lines.push(format!(
        "  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ",
        "", stats.num_ooms, "", stats.num_alloc_retries
    ));
    lines.push(double_rule.clone());
    lines
        .push("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".into());

    let metrics: [(&StatArray, &str, CellFormat); 9] = [
        (
            &stats.allocated_bytes,
            "Allocated memory",
            CellFormat::Bytes,
        ),
        (&stats.active_bytes, "Active memory", CellFormat::Bytes),
        (
            &stats.requested_bytes,
            "Requested memory",
            CellFormat::Bytes,
        ),
        (
            &stats.reserved_bytes,
            "GPU reserved memory",
            CellFormat::Bytes,
        ),
        (
            &stats.inactive_split_bytes,
            "Non-releasable memory",
            CellFormat::Bytes,
        ),
        (&stats.allocation, "Allocations", CellFormat::Count),
        (&stats.active, "Active allocs", CellFormat::Count),
        (&stats.segment, "GPU reserved segments", CellFormat::Count),
        (
            &stats.inactive_split,
            "Non-releasable allocs",
            CellFormat::Count,
        ),
    ];
    for (array, name, cell_format) in metrics {
        lines.push(rule.clone());
        // Every row of a metric uses the units chosen for its "all" row.
        let units = &array.all;
        lines.push(stat_row(name, &array.all, units, cell_format));
        if !abbreviated {
            lines.push(stat_row(
                "      from large pool",
                &array.large_pool,
                units,
                cell_format,
            ));
            lines.push(stat_row(
                "      from small pool",
                &array.small_pool,
                units,
                cell_format,
            ));
        }
    }
    for (stat, name) in [
        (&stats.oversize_allocations, "Oversize allocations"),
        (&stats.oversize_segments, "Oversize GPU segments"),
    ] {
        lines.push(rule.clone());
        lines.push(stat_row(name, stat, stat, CellFormat::Count));
    }
    lines.push(double_rule.clone());

    // Headroom's section: the figures PyTorch does not report.
    lines.push(format!(
        " {:^33} | {:^22} | {:^12} ",
        "Headroom metric", "Bytes", "Size"
    ));
    lines.push(rule);
    for (name, bytes) in [
        (
            "Largest free block (small pool)",
            fragmentation.largest_free_small,
        ),
        (
            "Largest free block (large pool)",
            fragmentation.largest_free_large,
        ),
        ("Stranded free memory", fragmentation.stranded_free_bytes),
        ("Internal waste", fragmentation.internal_waste_bytes),
    ] {
        lines.push(format!(
            " {name:<33} | {bytes:>22} | {:>12} ",
            format_size(bytes)
        ));
    }
    lines.push(double_rule);

    let mut summary = String::new();
    for line in &lines {
        summary.push('|');
        summary.push_str(line);
        summary.push_str("|\n");
    }
    summary
}

impl fmt::Display for OutOfMemoryReport {
    /// PyTorch's OOM message, adapted: what was tried, the device's capacity and free memory,
    /// the per-process limit if any, what this allocator holds, the largest free cached block,
    /// and the expandable-segments hint when it applies. Like every error message of this crate
    /// it does not end with a period.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.storage == PINNED_STORAGE {
            return self.fmt_pinned(f);
        }
        write!(
            f,
            "out of memory: tried to allocate {} (request of {} bytes). {} device has a total \
             capacity of {} of which {} is free. ",
            format_size(self.attempted),
            self.requested,
            self.storage,
            format_size(self.capacity),
            format_size(self.free)
        )?;
        if let Some(allowed) = self.allowed {
            write!(
                f,
                "{} allowed by per_process_memory_fraction; ",
                format_size(allowed)
            )?;
        }
        write!(
            f,
            "Of the allocated memory {} is allocated by Headroom, and {} is reserved but \
             unallocated. The largest free cached block is {}",
            format_size(self.allocated),
            format_size(self.reserved_unallocated),
            format_size(self.largest_free_block)
        )?;
        if self.suggest_expandable_segments {
            f.write_str(
                ". If reserved but unallocated memory is large try setting \
                 expandable_segments:True in HEADROOM_ALLOC_CONF to avoid fragmentation",
            )?;
        }
        Ok(())
    }
}

/// The name of the pinned host storage, whose capacity is the budget it was given.
const PINNED_STORAGE: &str = "pinned";

impl OutOfMemoryReport {
    /// Pinned host memory: the budget it was given (its storage's capacity; none when the
    /// capacity is unbounded and the driver refused) and what to do.
    fn fmt_pinned(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of pinned host memory: tried to allocate {} (request of {} bytes). ",
            format_size(self.attempted),
            self.requested
        )?;
        if self.capacity == u64::MAX {
            f.write_str(
                "No pinned budget is set and the driver refused: page-locked memory is bounded by \
                 the host's RAM and its locked-memory limit. ",
            )?;
        } else {
            write!(
                f,
                "The pinned budget is {} of which {} is free. ",
                format_size(self.capacity),
                format_size(self.free)
            )?;
        }
        write!(
            f,
            "{} is allocated by Headroom, and {} is reserved but unallocated. Raise the budget \
             (the CUDA backend's pinned_budget option) or keep less in host memory",
            format_size(self.allocated),
            format_size(self.reserved_unallocated)
        )
    }
}

/// Width of every line between its bars.
const LINE_WIDTH: usize = 75;

/// How `memory_summary` writes one cell.
#[derive(Debug, Clone, Copy)]
enum CellFormat {
    /// `_format_size`: width 6, a space and a 3-character binary unit.
    Bytes,
    /// `_format_count`: width 7, a space, a 1-character decimal unit and a space.
    Count,
}

/// One row: the label left-aligned in 21 columns, then current, peak, allocated and freed, each
/// in the unit that the matching value of `units` (the metric's "all" row) calls for.
fn stat_row(name: &str, stat: &Stat, units: &Stat, cell_format: CellFormat) -> String {
    let mut row = format!(" {name:<21} ");
    for (value, unit_value) in [
        (stat.current, units.current),
        (stat.peak, units.peak),
        (stat.allocated, units.allocated),
        (stat.freed, units.freed),
    ] {
        row.push_str("| ");
        match cell_format {
            CellFormat::Bytes => row.push_str(&size_cell(value, unit_value)),
            CellFormat::Count => row.push_str(&count_cell(value, unit_value)),
        }
        row.push(' ');
    }
    row
}

/// torch's `_format_size(sz, pref_sz)`: divides by 1024 while the preferred value is at least
/// 768 KiB of the current unit.
fn size_cell(value: i64, unit_value: i64) -> String {
    let (value, prefix) = scale(
        value,
        unit_value,
        1024,
        768.0 * 1024.0,
        &["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"],
    );
    format!("{value:6} {prefix}")
}

/// torch's `_format_count(cnt, pref_cnt)`: divides by 1000 while the preferred value is at least
/// 750 000 of the current unit.
fn count_cell(value: i64, unit_value: i64) -> String {
    let (value, prefix) = scale(value, unit_value, 1000, 750.0 * 1000.0, &[" ", "K", "M"]);
    format!("{value:7} {prefix} ")
}

/// Divides `value` by `base` and moves to the next prefix while `unit_value` (the row's
/// reference value, scaled alike) is at least `threshold`.
fn scale(
    value: i64,
    unit_value: i64,
    base: i64,
    threshold: f64,
    prefixes: &[&'static str],
) -> (i64, &'static str) {
    let mut value = value;
    let mut unit_value = unit_value as f64;
    let mut prefix = prefixes[0];
    for next_prefix in &prefixes[1..] {
        if unit_value < threshold {
            break;
        }
        prefix = next_prefix;
        value = value.div_euclid(base);
        unit_value /= base as f64;
    }
    (value, prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Statistics whose table exercises every unit switch of PyTorch's formatters.
    fn sample_stats() -> MemoryStats {
        MemoryStats {
            allocated_bytes: StatArray {
                all: Stat {
                    current: 5368709120,
                    peak: 7516192768,
                    allocated: 966367641600,
                    freed: 960998932480,
                },
                large_pool: Stat {
                    current: 5365563392,
                    peak: 7510949888,
                    allocated: 944892805120,
                    freed: 939524096000,
                },
                small_pool: Stat {
                    current: 3145728,
                    peak: 5242880,
                    allocated: 21474836480,
                    freed: 21474836480,
                },
            },
            active_bytes: StatArray {
                all: Stat {
                    current: 5368710656,
                    peak: 7516192768,
                    allocated: 2199023255552,
                    freed: 2193654546432,
                },
                large_pool: Stat {
                    current: 5368709120,
                    peak: 7516192256,
                    allocated: 2147483648000,
                    freed: 2136746229760,
                },
                small_pool: Stat {
                    current: 1536,
                    peak: 512,
                    allocated: 51539607552,
                    freed: 51539606016,
                },
            },
            requested_bytes: StatArray {
                all: Stat {
                    current: 786431,
                    peak: 786432,
                    allocated: 786431,
                    freed: 12345,
                },
                large_pool: Stat {
                    current: 716800,
                    peak: 785432,
                    allocated: 786431,
                    freed: 12000,
                },
                small_pool: Stat {
                    current: 69631,
                    peak: 1000,
                    allocated: 0,
                    freed: 345,
                },
            },
            reserved_bytes: StatArray {
                all: Stat {
                    current: 6442450944,
                    peak: 8589934592,
                    allocated: 1319413953331200,
                    freed: 1319407510880256,
                },
                large_pool: Stat {
                    current: 6440353792,
                    peak: 8587837440,
                    allocated: 1209462790553600,
                    freed: 1209462790553600,
                },
                small_pool: Stat {
                    current: 2097152,
                    peak: 2097152,
                    allocated: 109951162777600,
                    freed: 109951162777600,
                },
            },
            inactive_split_bytes: StatArray {
                all: Stat {
                    current: 0,
                    peak: 0,
                    allocated: 0,
                    freed: 0,
                },
                large_pool: Stat {
                    current: 0,
                    peak: 0,
                    allocated: 0,
                    freed: 0,
                },
                small_pool: Stat {
                    current: 0,
                    peak: 0,
                    allocated: 0,
                    freed: 0,
                },
            },
            allocation: StatArray {
                all: Stat {
                    current: 812,
                    peak: 1400,
                    allocated: 2100000,
                    freed: 2099188,
                },
                large_pool: Stat {
                    current: 500,
                    peak: 900,
                    allocated: 1500000,
                    freed: 1499500,
                },
                small_pool: Stat {
                    current: 312,
                    peak: 500,
                    allocated: 600000,
                    freed: 599688,
                },
            },
            active: StatArray {
                all: Stat {
                    current: 749999,
                    peak: 750000,
                    allocated: 1000000000,
                    freed: 999250001,
                },
                large_pool: Stat {
                    current: 749000,
                    peak: 749999,
                    allocated: 999000000,
                    freed: 998250000,
                },
                small_pool: Stat {
                    current: 999,
                    peak: 1,
                    allocated: 1000000,
                    freed: 1000001,
                },
            },
            segment: StatArray {
                all: Stat {
                    current: 7,
                    peak: 9,
                    allocated: 20,
                    freed: 13,
                },
                large_pool: Stat {
                    current: 6,
                    peak: 8,
                    allocated: 15,
                    freed: 9,
                },
                small_pool: Stat {
                    current: 1,
                    peak: 1,
                    allocated: 5,
                    freed: 4,
                },
            },
            inactive_split: StatArray {
                all: Stat {
                    current: 3,
                    peak: 4,
                    allocated: 70,
                    freed: 67,
                },
                large_pool: Stat {
                    current: 2,
                    peak: 3,
                    allocated: 50,
                    freed: 48,
                },
                small_pool: Stat {
                    current: 1,
                    peak: 1,
                    allocated: 20,
                    freed: 19,
                },
            },
            oversize_allocations: Stat {
                current: 2,
                peak: 3,
                allocated: 10,
                freed: 8,
            },
            oversize_segments: Stat {
                current: 1,
                peak: 2,
                allocated: 4,
                freed: 3,
            },
            num_ooms: 1,
            num_alloc_retries: 3,
            ..MemoryStats::default()
        }
    }

    fn sample_fragmentation() -> FragmentationStats {
        FragmentationStats {
            largest_free_small: 1536 << 10,
            largest_free_large: (18 << 20) + 512,
            stranded_free_bytes: 1000,
            cached_free_bytes: 20 << 20,
            internal_waste_bytes: (5 << 30) + 123,
        }
    }

    /// The PyTorch part was produced by torch's `memory_summary` code (torch/cuda/memory.py),
    /// run in Python on the same numbers.
    const FULL_SUMMARY: &str = "\
|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 0                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 1            |        cudaMalloc retries: 3         |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      |   5120 MiB |   7168 MiB |    900 GiB |    895 GiB |
|       from large pool |   5117 MiB |   7163 MiB |    880 GiB |    875 GiB |
|       from small pool |      3 MiB |      5 MiB |     20 GiB |     20 GiB |
|---------------------------------------------------------------------------|
| Active memory         |   5120 MiB |   7168 MiB |   2048 GiB |   2043 GiB |
|       from large pool |   5120 MiB |   7167 MiB |   2000 GiB |   1990 GiB |
|       from small pool |      0 MiB |      0 MiB |     48 GiB |     47 GiB |
|---------------------------------------------------------------------------|
| Requested memory      | 786431 B   |    768 KiB | 786431 B   |  12345 B   |
|       from large pool | 716800 B   |    767 KiB | 786431 B   |  12000 B   |
|       from small pool |  69631 B   |      0 KiB |      0 B   |    345 B   |
|---------------------------------------------------------------------------|
| GPU reserved memory   |   6144 MiB |   8192 MiB |   1200 TiB |   1199 TiB |
|       from large pool |   6142 MiB |   8190 MiB |   1100 TiB |   1100 TiB |
|       from small pool |      2 MiB |      2 MiB |    100 TiB |    100 TiB |
|---------------------------------------------------------------------------|
| Non-releasable memory |      0 B   |      0 B   |      0 B   |      0 B   |
|       from large pool |      0 B   |      0 B   |      0 B   |      0 B   |
|       from small pool |      0 B   |      0 B   |      0 B   |      0 B   |
|---------------------------------------------------------------------------|
| Allocations           |     812    |    1400    |    2100 K  |    2099 K  |
|       from large pool |     500    |     900    |    1500 K  |    1499 K  |
|       from small pool |     312    |     500    |     600 K  |     599 K  |
|---------------------------------------------------------------------------|
| Active allocs         |  749999    |     750 K  |    1000 M  |     999 M  |
|       from large pool |  749000    |     749 K  |     999 M  |     998 M  |
|       from small pool |     999    |       0 K  |       1 M  |       1 M  |
|---------------------------------------------------------------------------|
| GPU reserved segments |       7    |       9    |      20    |      13    |
|       from large pool |       6    |       8    |      15    |       9    |
|       from small pool |       1    |       1    |       5    |       4    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       3    |       4    |      70    |      67    |
|       from large pool |       2    |       3    |      50    |      48    |
|       from small pool |       1    |       1    |      20    |      19    |
|---------------------------------------------------------------------------|
| Oversize allocations  |       2    |       3    |      10    |       8    |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       1    |       2    |       4    |       3    |
|===========================================================================|
|          Headroom metric          |         Bytes          |     Size     |
|---------------------------------------------------------------------------|
| Largest free block (small pool)   |                1572864 |     1.50 MiB |
| Largest free block (large pool)   |               18874880 |    18.00 MiB |
| Stranded free memory              |                   1000 |   1000 bytes |
| Internal waste                    |             5368709243 |     5.00 GiB |
|===========================================================================|
";

    const ABBREVIATED_SUMMARY: &str = "\
|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 3                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 1            |        cudaMalloc retries: 3         |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      |   5120 MiB |   7168 MiB |    900 GiB |    895 GiB |
|---------------------------------------------------------------------------|
| Active memory         |   5120 MiB |   7168 MiB |   2048 GiB |   2043 GiB |
|---------------------------------------------------------------------------|
| Requested memory      | 786431 B   |    768 KiB | 786431 B   |  12345 B   |
|---------------------------------------------------------------------------|
| GPU reserved memory   |   6144 MiB |   8192 MiB |   1200 TiB |   1199 TiB |
|---------------------------------------------------------------------------|
| Non-releasable memory |      0 B   |      0 B   |      0 B   |      0 B   |
|---------------------------------------------------------------------------|
| Allocations           |     812    |    1400    |    2100 K  |    2099 K  |
|---------------------------------------------------------------------------|
| Active allocs         |  749999    |     750 K  |    1000 M  |     999 M  |
|---------------------------------------------------------------------------|
| GPU reserved segments |       7    |       9    |      20    |      13    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       3    |       4    |      70    |      67    |
|---------------------------------------------------------------------------|
| Oversize allocations  |       2    |       3    |      10    |       8    |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       1    |       2    |       4    |       3    |
|===========================================================================|
|          Headroom metric          |         Bytes          |     Size     |
|---------------------------------------------------------------------------|
| Largest free block (small pool)   |                      0 |      0 bytes |
| Largest free block (large pool)   |                      0 |      0 bytes |
| Stranded free memory              |                      0 |      0 bytes |
| Internal waste                    |                      0 |      0 bytes |
|===========================================================================|
";

    #[test]
    fn summary_matches_pytorch_layout() {
        let summary = memory_summary(&sample_stats(), &sample_fragmentation(), 0, false);
        assert_eq!(summary, FULL_SUMMARY);
        assert!(summary
            .lines()
            .all(|line| line.chars().count() == LINE_WIDTH + 2));
    }

    #[test]
    fn abbreviated_summary_drops_pool_rows() {
        let summary = memory_summary(&sample_stats(), &FragmentationStats::default(), 3, true);
        assert_eq!(summary, ABBREVIATED_SUMMARY);
    }

    #[test]
    fn empty_summary_uses_smallest_units() {
        let summary = memory_summary(
            &MemoryStats::default(),
            &FragmentationStats::default(),
            0,
            false,
        );
        assert!(summary.contains(
            "| Allocated memory      |      0 B   |      0 B   |      0 B   |      0 B   |"
        ));
        assert!(summary.contains(
            "| Allocations           |       0    |       0    |       0    |       0    |"
        ));
    }

    #[test]
    fn format_size_cases() {
        let cases: [(u64, &str); 12] = [
            (0, "0 bytes"),
            (512, "512 bytes"),
            (1024, "1024 bytes"),
            (1025, "1.00 KiB"),
            (1152, "1.12 KiB"),
            (1536, "1.50 KiB"),
            (1 << 20, "1024.00 KiB"),
            ((1 << 20) + 1, "1.00 MiB"),
            (20 << 20, "20.00 MiB"),
            (1 << 30, "1024.00 MiB"),
            ((3 << 30) / 2, "1.50 GiB"),
            (80 << 30, "80.00 GiB"),
        ];
        for (bytes, expected) in cases {
            assert_eq!(format_size(bytes), expected, "format_size({bytes})");
        }
    }

    fn sample_report() -> OutOfMemoryReport {
        OutOfMemoryReport {
            requested: 5 << 20,
            attempted: 20 << 20,
            capacity: 80 << 30,
            free: 10 << 20,
            allowed: None,
            allocated: 70 << 30,
            reserved_unallocated: 9 << 30,
            largest_free_block: 18 << 20,
            suggest_expandable_segments: false,
            storage: "cuda",
        }
    }

    #[test]
    fn oom_message_without_hint() {
        let message = sample_report().to_string();
        assert_eq!(
            message,
            "out of memory: tried to allocate 20.00 MiB (request of 5242880 bytes). cuda device \
             has a total capacity of 80.00 GiB of which 10.00 MiB is free. Of the allocated \
             memory 70.00 GiB is allocated by Headroom, and 9.00 GiB is reserved but \
             unallocated. The largest free cached block is 18.00 MiB"
        );
    }

    #[test]
    fn oom_message_with_limit_and_hint() {
        let report = OutOfMemoryReport {
            allowed: Some(40 << 30),
            suggest_expandable_segments: true,
            storage: "simulated",
            ..sample_report()
        };
        assert_eq!(
            report.to_string(),
            "out of memory: tried to allocate 20.00 MiB (request of 5242880 bytes). simulated \
             device has a total capacity of 80.00 GiB of which 10.00 MiB is free. 40.00 GiB \
             allowed by per_process_memory_fraction; Of the allocated memory 70.00 GiB is \
             allocated by Headroom, and 9.00 GiB is reserved but unallocated. The largest free \
             cached block is 18.00 MiB. If reserved but unallocated memory is large try setting \
             expandable_segments:True in HEADROOM_ALLOC_CONF to avoid fragmentation"
        );
    }

    #[test]
    fn pinned_oom_names_the_budget_or_its_absence() {
        let report = OutOfMemoryReport {
            capacity: 64 << 20,
            free: 10 << 20,
            allocated: 50 << 20,
            reserved_unallocated: 4 << 20,
            storage: "pinned",
            ..sample_report()
        };
        assert_eq!(
            report.to_string(),
            "out of pinned host memory: tried to allocate 20.00 MiB (request of 5242880 bytes). \
             The pinned budget is 64.00 MiB of which 10.00 MiB is free. 50.00 MiB is allocated \
             by Headroom, and 4.00 MiB is reserved but unallocated. Raise the budget \
             (the CUDA backend's pinned_budget option) or keep less in host memory"
        );
        let unbounded = OutOfMemoryReport {
            capacity: u64::MAX,
            ..report
        };
        assert!(unbounded
            .to_string()
            .contains("No pinned budget is set and the driver refused"));
    }

    #[test]
    fn oom_message_through_alloc_error() {
        let error = crate::error::AllocError::OutOfMemory(Box::new(sample_report()));
        assert_eq!(error.to_string(), sample_report().to_string());
    }
}
