//! An ordered index of free blocks by (size, address), built for best-fit lookups.
//!
//! PyTorch keeps free blocks in a `std::set` ordered by (stream, size, address) and best fit is a
//! `lower_bound`. A balanced tree spends most of an allocation in pointer chasing, so this index
//! splits the key space into size bins in the manner of TLSF (a power-of-two "first level" cut
//! into 32 linear "second level" bins; sizes below 32 KiB get one bin per 512-byte step) and keeps
//! each bin as a sorted vector. Bins are ordered like the sizes they hold, and a two-level bitmap
//! finds the next non-empty bin in a few instructions, so the answer is exactly the `lower_bound`
//! of the ordered set: the smallest size at least the request, lowest address among equals.
//!
//! The index knows nothing about blocks beyond their id, size and address.

/// Bits of the second level: 32 bins per power of two.
const SECOND_LEVEL_BITS: u32 = 5;
const SECOND_LEVEL: u64 = 1 << SECOND_LEVEL_BITS;
/// Sizes are counted in 512-byte units (every block size is a multiple of 512).
const UNIT_SHIFT: u32 = 9;
const N_BINS: usize = (SECOND_LEVEL + (64 - SECOND_LEVEL_BITS as u64) * SECOND_LEVEL) as usize;
const N_WORDS: usize = N_BINS.div_ceil(64);

/// Identifies a block in the allocator's arena.
pub(crate) type BlockId = u32;

/// Free blocks of one (pool, stream), ordered by (size, address).
#[derive(Debug)]
pub(crate) struct FreeIndex {
    /// Entries (size, address, id) per bin, sorted; grown to the highest bin used.
    bins: Vec<Vec<(u64, u64, BlockId)>>,
    /// Bit `b` set when bin `b` is non-empty.
    occupied: [u64; N_WORDS],
    /// Bit `w` set when word `w` of `occupied` is non-zero.
    summary: u64,
    len: usize,
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex {
            bins: Vec::new(),
            occupied: [0; N_WORDS],
            summary: 0,
            len: 0,
        }
    }
}

/// The bin of a size: monotonic in the size, so bins are ordered like the sizes they hold.
fn bin_of(size: u64) -> usize {
    let units = size >> UNIT_SHIFT;
    if units < SECOND_LEVEL {
        return units as usize;
    }
    let first_level = 63 - units.leading_zeros();
    let second_level = (units >> (first_level - SECOND_LEVEL_BITS)) - SECOND_LEVEL;
    (SECOND_LEVEL + u64::from(first_level - SECOND_LEVEL_BITS) * SECOND_LEVEL + second_level)
        as usize
}

impl FreeIndex {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn insert(&mut self, size: u64, address: u64, id: BlockId) {
        let bin = bin_of(size);
        if bin >= self.bins.len() {
            self.bins.resize_with(bin + 1, Vec::new);
        }
        let entries = &mut self.bins[bin];
        let at = entries.partition_point(|&(s, a, _)| (s, a) < (size, address));
        entries.insert(at, (size, address, id));
        self.occupied[bin / 64] |= 1 << (bin % 64);
        self.summary |= 1 << (bin / 64);
        self.len += 1;
    }

    /// Removes the entry of (size, address); returns its id.
    pub(crate) fn remove(&mut self, size: u64, address: u64) -> Option<BlockId> {
        let bin = bin_of(size);
        let entries = self.bins.get_mut(bin)?;
        let at = entries
            .binary_search_by(|&(s, a, _)| (s, a).cmp(&(size, address)))
            .ok()?;
        let (_, _, id) = entries.remove(at);
        if entries.is_empty() {
            self.occupied[bin / 64] &= !(1 << (bin % 64));
            if self.occupied[bin / 64] == 0 {
                self.summary &= !(1 << (bin / 64));
            }
        }
        self.len -= 1;
        Some(id)
    }

    /// Whether (size, address) is present with this id.
    pub(crate) fn contains(&self, size: u64, address: u64, id: BlockId) -> bool {
        self.bins.get(bin_of(size)).is_some_and(|entries| {
            entries
                .binary_search_by(|&(s, a, _)| (s, a).cmp(&(size, address)))
                .is_ok_and(|at| entries[at].2 == id)
        })
    }

    /// The smallest entry with a size of at least `size` (lowest address among equal sizes).
    pub(crate) fn first_at_least(&self, size: u64) -> Option<(u64, u64, BlockId)> {
        let bin = bin_of(size);
        if let Some(entries) = self.bins.get(bin) {
            let at = entries.partition_point(|&(s, _, _)| s < size);
            if let Some(&entry) = entries.get(at) {
                return Some(entry);
            }
        }
        let next = self.next_occupied(bin + 1)?;
        self.bins[next].first().copied()
    }

    /// The entries with a size of at least `size`, in (size, address) order: the first is
    /// [`FreeIndex::first_at_least`]'s.
    pub(crate) fn iter_at_least(
        &self,
        size: u64,
    ) -> impl Iterator<Item = (u64, u64, BlockId)> + '_ {
        let bin = bin_of(size);
        let first = self.bins.get(bin).map_or(&[][..], |entries| {
            &entries[entries.partition_point(|&(s, _, _)| s < size)..]
        });
        let later = std::iter::successors(self.next_occupied(bin + 1), |&at| {
            self.next_occupied(at + 1)
        });
        first
            .iter()
            .copied()
            .chain(later.flat_map(|at| self.bins[at].iter().copied()))
    }

    /// The largest entry.
    pub(crate) fn last(&self) -> Option<(u64, u64, BlockId)> {
        let word = self.summary.checked_ilog2()? as usize;
        let bit = self.occupied[word].ilog2() as usize;
        self.bins[word * 64 + bit].last().copied()
    }

    /// All entries in (size, address) order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64, BlockId)> + '_ {
        self.bins.iter().flatten().copied()
    }

    fn next_occupied(&self, from: usize) -> Option<usize> {
        if from >= N_BINS {
            return None;
        }
        let word = from / 64;
        let in_word = self.occupied[word] & (!0u64 << (from % 64));
        if in_word != 0 {
            return Some(word * 64 + in_word.trailing_zeros() as usize);
        }
        let later_words = self.summary & (!0u64).checked_shl(word as u32 + 1).unwrap_or(0);
        if later_words == 0 {
            return None;
        }
        let word = later_words.trailing_zeros() as usize;
        Some(word * 64 + self.occupied[word].trailing_zeros() as usize)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn bins_are_monotonic_in_size() {
        let mut previous = 0;
        for units in 1..200_000u64 {
            let bin = bin_of(units << UNIT_SHIFT);
            assert!(bin >= previous, "bin of {units} units went down");
            previous = bin;
        }
        assert!(bin_of(!511) < N_BINS);
    }

    proptest! {
        /// The index answers exactly like an ordered set's lower bound.
        #[test]
        fn matches_an_ordered_set(
            ops in prop::collection::vec((any::<bool>(), 1u64..1 << 22, 0u64..64, 1u64..1 << 22), 1..200),
        ) {
            let mut index = FreeIndex::default();
            let mut reference = BTreeSet::new();
            for (insert, units, address, query_units) in ops {
                let size = units << UNIT_SHIFT;
                if insert {
                    if reference.insert((size, address)) {
                        index.insert(size, address, address as BlockId);
                    }
                } else if reference.remove(&(size, address)) {
                    prop_assert_eq!(index.remove(size, address), Some(address as BlockId));
                }
                let query = query_units << UNIT_SHIFT;
                let want = reference.range((query, 0)..).next().copied();
                let have = index.first_at_least(query).map(|(s, a, _)| (s, a));
                prop_assert_eq!(have, want);
                let have_all: Vec<(u64, u64)> =
                    index.iter_at_least(query).map(|(s, a, _)| (s, a)).collect();
                let want_all: Vec<(u64, u64)> = reference.range((query, 0)..).copied().collect();
                prop_assert_eq!(have_all, want_all);
                prop_assert_eq!(index.last().map(|(s, a, _)| (s, a)), reference.last().copied());
                prop_assert_eq!(index.len(), reference.len());
            }
            let all: Vec<(u64, u64)> = index.iter().map(|(s, a, _)| (s, a)).collect();
            let want: Vec<(u64, u64)> = reference.into_iter().collect();
            prop_assert_eq!(all, want);
        }
    }
}
