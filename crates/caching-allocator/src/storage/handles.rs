//! The physical handles behind a storage's mapped pages: how one [`Storage::map`] call is split
//! into handles, and which part of a range [`Storage::unmap`] can release.
//!
//! A GPU maps physical memory in handles (`cuMemCreate`) and unmaps only whole handles. One
//! handle per page lets the allocator unmap any page, but every handle costs a driver round trip
//! (about 40 µs on an H200, whatever its size), so a storage may back a map with fewer, larger
//! handles and accept that only whole handles come back. The table keeps runs of equal handles
//! (start → bytes and handle size), so a 2 GiB map of 2 MiB handles is one entry, not 1,024.
//!
//! It sits on nothing but `std`. It must not know about devices or blocks: the CUDA and the
//! simulated storages use it for the bookkeeping, and the allocator sees it only through
//! [`Storage::releasable_range`].
//!
//! [`Storage::map`]: super::Storage::map
//! [`Storage::unmap`]: super::Storage::unmap
//! [`Storage::releasable_range`]: super::Storage::releasable_range

use std::collections::BTreeMap;

use super::MappingUnits;

/// A run of mapped handles of `handle` bytes each, `bytes` in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HandleRun {
    pub(crate) start: u64,
    pub(crate) bytes: u64,
    pub(crate) handle: u64,
}

impl HandleRun {
    fn end(&self) -> u64 {
        self.start + self.bytes
    }

    /// The handles of this run, as (start, bytes).
    #[cfg_attr(
        not(feature = "cuda"),
        allow(dead_code, reason = "CudaStorage's, and the tests'")
    )]
    pub(crate) fn handles(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (self.start..self.end())
            .step_by(self.handle as usize)
            .map(|start| (start, self.handle))
    }
}

/// How a map of `size` bytes at `address`, in the reservation at `base` mapped in `units`, is
/// backed: the unit is the reservation's page where the map is made of whole pages of it, else
/// the storage's `granularity` (both divide `address - base` and `size`); then handles of the
/// largest multiple of the unit up to `units.max_handle`, and one handle for the rest (or, with
/// no maximum above the page, one handle per unit).
pub(crate) fn plan_handles(
    base: u64,
    units: MappingUnits,
    granularity: u64,
    address: u64,
    size: u64,
) -> Vec<HandleRun> {
    let page = units.page;
    let unit = if (address - base).is_multiple_of(page) && size.is_multiple_of(page) {
        page
    } else {
        granularity
    };
    let coalesce = units.max_handle > page;
    let large = if coalesce {
        units.max_handle / unit * unit
    } else {
        unit
    };
    let whole = size / large * large;
    let mut runs = Vec::with_capacity(2);
    if whole > 0 {
        runs.push(HandleRun {
            start: address,
            bytes: whole,
            handle: large,
        });
    }
    if size > whole {
        let rest = size - whole;
        runs.push(HandleRun {
            start: address + whole,
            bytes: rest,
            handle: if coalesce { rest } else { unit },
        });
    }
    runs
}

/// Mapped handles, as runs of equal handles by start address.
#[derive(Debug, Default)]
pub(crate) struct HandleTable {
    runs: BTreeMap<u64, HandleRun>,
}

impl HandleTable {
    /// Whether any mapped byte lies in `[address, end)`.
    pub(crate) fn overlaps(&self, address: u64, end: u64) -> bool {
        self.runs
            .range(..end)
            .next_back()
            .is_some_and(|(_, run)| run.end() > address)
    }

    /// Whether every byte of `[address, end)` is mapped.
    #[cfg_attr(
        not(feature = "cuda"),
        allow(dead_code, reason = "CudaStorage's, and the tests'")
    )]
    pub(crate) fn covers(&self, address: u64, end: u64) -> bool {
        let mut cursor = address;
        while cursor < end {
            match self.run_at(cursor) {
                Some(run) => cursor = run.end(),
                None => return false,
            }
        }
        true
    }

    /// Records a run; the caller checked it overlaps nothing.
    pub(crate) fn insert(&mut self, run: HandleRun) {
        self.runs.insert(run.start, run);
    }

    /// The largest part of `[address, end)` made of whole handles: the range shrunk to the
    /// handle edges inside it. Empty (`start >= end`) when no whole handle lies inside.
    pub(crate) fn releasable(&self, address: u64, end: u64) -> (u64, u64) {
        let start = match self.run_at(address) {
            Some(run) => run.start + (address - run.start).div_ceil(run.handle) * run.handle,
            None => address,
        };
        let end = match end.checked_sub(1).and_then(|last| self.run_at(last)) {
            Some(run) => run.start + (end - run.start) / run.handle * run.handle,
            None => end,
        };
        (start, end.max(start))
    }

    /// The handles that make up `[address, end)` exactly, as runs clipped to it, in address
    /// order. `Err` with the reason when a byte of it is not mapped or the range cuts through a
    /// handle.
    pub(crate) fn whole_handles(&self, address: u64, end: u64) -> Result<Vec<HandleRun>, String> {
        let mut pieces = Vec::new();
        let mut cursor = address;
        while cursor < end {
            let run = self
                .run_at(cursor)
                .ok_or_else(|| format!("{cursor:#x} is not mapped"))?;
            if !(cursor - run.start).is_multiple_of(run.handle) {
                return Err(format!("{cursor:#x} is inside a handle"));
            }
            let piece_end = run.end().min(end);
            if !(piece_end - run.start).is_multiple_of(run.handle) {
                return Err(format!("{piece_end:#x} is inside a handle"));
            }
            pieces.push(HandleRun {
                start: cursor,
                bytes: piece_end - cursor,
                handle: run.handle,
            });
            cursor = piece_end;
        }
        Ok(pieces)
    }

    /// Forgets `[address, end)`, which [`HandleTable::whole_handles`] accepted: the runs around
    /// it keep their handles on either side.
    pub(crate) fn remove(&mut self, address: u64, end: u64) {
        let touched: Vec<HandleRun> = self
            .runs
            .range(..end)
            .rev()
            .map(|(_, run)| *run)
            .take_while(|run| run.end() > address)
            .collect();
        for run in touched {
            self.runs.remove(&run.start);
            if run.start < address {
                self.insert(HandleRun {
                    bytes: address - run.start,
                    ..run
                });
            }
            if run.end() > end {
                self.insert(HandleRun {
                    start: end,
                    bytes: run.end() - end,
                    handle: run.handle,
                });
            }
        }
    }

    /// Every run, emptying the table.
    #[cfg_attr(
        not(feature = "cuda"),
        allow(dead_code, reason = "CudaStorage's, and the tests'")
    )]
    pub(crate) fn take_all(&mut self) -> Vec<HandleRun> {
        std::mem::take(&mut self.runs).into_values().collect()
    }

    /// The run holding the byte at `address`.
    fn run_at(&self, address: u64) -> Option<&HandleRun> {
        self.runs
            .range(..=address)
            .next_back()
            .map(|(_, run)| run)
            .filter(|run| run.end() > address)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(runs: &[HandleRun]) -> HandleTable {
        let mut table = HandleTable::default();
        for &run in runs {
            table.insert(run);
        }
        table
    }

    #[test]
    fn plans_large_handles_then_one_for_the_rest() {
        let run = |start, bytes, handle| HandleRun {
            start,
            bytes,
            handle,
        };
        let units = |page, max_handle| MappingUnits { page, max_handle };
        let plan = |units, address, size| plan_handles(0, units, 2, address, size);
        assert_eq!(plan(units(2, 2), 100, 70), vec![run(100, 70, 2)]);
        assert_eq!(
            plan(units(2, 32), 100, 70),
            vec![run(100, 64, 32), run(164, 6, 6)]
        );
        assert_eq!(plan(units(2, 32), 0, 20), vec![run(0, 20, 20)]);
        // A maximum that is not a multiple of the page rounds down to one.
        assert_eq!(plan(units(20, 32), 0, 60), vec![run(0, 60, 20)]);
        assert_eq!(
            plan(units(20, 40), 0, 60),
            vec![run(0, 40, 40), run(40, 20, 20)]
        );
        // A map that is not whole pages of the reservation's goes by the granularity.
        assert_eq!(plan(units(20, 20), 0, 6), vec![run(0, 6, 2)]);
        assert_eq!(
            plan(units(20, 40), 10, 60),
            vec![run(10, 40, 40), run(50, 20, 20)]
        );
    }

    #[test]
    fn releases_only_whole_handles() {
        // Handles: 0..32, 32..64 (one run), 64..70 (one handle), 80..90 in 2-byte pages.
        let t = table(&[
            HandleRun {
                start: 0,
                bytes: 64,
                handle: 32,
            },
            HandleRun {
                start: 64,
                bytes: 6,
                handle: 6,
            },
            HandleRun {
                start: 80,
                bytes: 10,
                handle: 2,
            },
        ]);
        assert_eq!(t.releasable(0, 70), (0, 70));
        assert_eq!(t.releasable(2, 70), (32, 70));
        assert_eq!(t.releasable(2, 62), (32, 32));
        assert_eq!(t.releasable(40, 68), (64, 64));
        assert_eq!(t.releasable(82, 88), (82, 88));
        let handles = |start, end| -> Vec<(u64, u64)> {
            let pieces = t.whole_handles(start, end).unwrap();
            pieces
                .iter()
                .flat_map(|p| p.handles().collect::<Vec<_>>())
                .collect()
        };
        assert_eq!(handles(32, 70), vec![(32, 32), (64, 6)]);
        assert_eq!(handles(84, 88), vec![(84, 2), (86, 2)]);
        assert!(t.whole_handles(2, 32).is_err());
        assert!(t.whole_handles(0, 40).is_err());
        assert!(t.whole_handles(64, 72).is_err(), "70..72 is not mapped");
        assert!(t.overlaps(69, 75) && !t.overlaps(70, 80) && t.overlaps(89, 100));
        assert!(t.covers(3, 70) && t.covers(81, 82) && !t.covers(60, 72) && !t.covers(70, 71));
    }

    #[test]
    fn removing_keeps_the_handles_around_the_range() {
        let mut t = table(&[HandleRun {
            start: 0,
            bytes: 128,
            handle: 32,
        }]);
        t.remove(32, 64);
        assert!(t.whole_handles(0, 32).is_ok() && t.whole_handles(64, 128).is_ok());
        assert!(t.whole_handles(0, 64).is_err() && t.whole_handles(48, 64).is_err());
        assert!(!t.overlaps(32, 64));
        let mut pages = table(&[HandleRun {
            start: 0,
            bytes: 10,
            handle: 2,
        }]);
        pages.remove(4, 6);
        pages.remove(0, 2);
        assert!(pages.whole_handles(2, 4).is_ok() && pages.whole_handles(6, 10).is_ok());
        assert!(pages.whole_handles(2, 6).is_err());
        assert_eq!(pages.take_all().len(), 2);
        assert!(!pages.overlaps(0, 10));
    }
}
