//! Request rounding: PyTorch's `round_size`, with `roundup_power2_divisions`.
//!
//! A request is rounded to 512 bytes, or, where its interval has divisions, to the next of that
//! many equal steps between powers of two. The policy calls this for every request.
//!
//! It sits on the config's `roundup_power2_divisions` alone. It must not know pools, segments or
//! how the divisions were set.

use super::{AllocatorConfig, ROUNDUP_INTERVALS};

impl AllocatorConfig {
    /// The size a request of `size` bytes is served with: PyTorch's `round_size`.
    ///
    /// Below 512 bytes: 512. Otherwise, with `d` the divisions of the size's interval (interval
    /// index ⌊log2 size⌋ − 20, clamped to 0..=15): if `d > 1` and `size > 512·d`, the next of `d`
    /// equal steps between the power of two at or below `size` and the next one (a power of two
    /// stays as it is); else the next multiple of 512. Sizes within a step of `u64::MAX`
    /// saturate to `u64::MAX`, which no storage can serve.
    pub fn round_size(&self, size: u64) -> u64 {
        const MIN_BLOCK_SIZE: u64 = 512;
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let divisions = self.roundup_power2_divisions[interval_index(size)];
        if divisions > 1 && size > MIN_BLOCK_SIZE.saturating_mul(divisions) {
            roundup_power2_next_division(size, divisions)
        } else {
            size.div_ceil(MIN_BLOCK_SIZE).saturating_mul(MIN_BLOCK_SIZE)
        }
    }
}

/// The `roundup_power2_divisions` interval of a size of at least 1 byte: ⌊log2 size⌋ − 20,
/// clamped to 0..=15.
fn interval_index(size: u64) -> usize {
    let log_size = size.max(1).ilog2() as usize;
    log_size.saturating_sub(20).min(ROUNDUP_INTERVALS - 1)
}

/// PyTorch's `roundup_power2_next_division`, for `size > 0` and `divisions >= 2`.
pub(super) fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let power2_floor = 1u64 << size.ilog2();
    let step = power2_floor >> divisions.ilog2();
    if step == 0 {
        return power2_floor.saturating_mul(2);
    }
    let round_floor = size & !(step - 1);
    if round_floor == size {
        size
    } else {
        round_floor.saturating_add(step)
    }
}
