//! The builder: [`AllocatorConfigBuilder`] sets a config's fields from code, in the string
//! form's units.
//!
//! It sits on the config type and the one validation of the parent module, and on
//! `to_conf_string` to fill in `raw`. It must not know the string syntax beyond that, nor what
//! the settings do to the policy.

use super::{invalid, AllocatorConfig, ROUNDUP_INTERVALS};
use crate::error::AllocError;

impl AllocatorConfig {
    /// Starts a builder from [`AllocatorConfig::default`].
    pub fn builder() -> AllocatorConfigBuilder {
        AllocatorConfigBuilder {
            config: AllocatorConfig::default(),
            overflowed: None,
        }
    }
}

/// Sets [`AllocatorConfig`] fields from code, with the same checks as the string form.
///
/// Sizes are in MiB, as in the string form. Nothing is checked until
/// [`AllocatorConfigBuilder::build`], which runs the same validation as
/// [`AllocatorConfig::parse`]; `raw` is set to the equivalent string
/// ([`AllocatorConfig::to_conf_string`]).
///
/// ```
/// use headroom_caching_allocator::AllocatorConfig;
///
/// let config = AllocatorConfig::builder().max_split_size_mb(256).expandable_segments(false).build()?;
/// assert_eq!(config.max_split_size(), Some(256 << 20));
/// assert!(AllocatorConfig::builder().garbage_collection_threshold(1.5).build().is_err());
/// # Ok::<(), headroom_caching_allocator::AllocError>(())
/// ```
#[derive(Debug, Clone)]
pub struct AllocatorConfigBuilder {
    config: AllocatorConfig,
    /// The key of a size whose MiB count did not fit in bytes; `build` reports it.
    overflowed: Option<&'static str>,
}

impl AllocatorConfigBuilder {
    /// Sets `max_split_size_mb` (at least 20).
    pub fn max_split_size_mb(mut self, mib: u64) -> Self {
        self.config.max_split_size = self.mib_to_bytes("max_split_size_mb", mib);
        self
    }

    /// Sets `max_non_split_rounding_mb` (at least 20).
    pub fn max_non_split_rounding_mb(mut self, mib: u64) -> Self {
        if let Some(bytes) = self.mib_to_bytes("max_non_split_rounding_mb", mib) {
            self.config.max_non_split_rounding = bytes;
        }
        self
    }

    /// Sets the same `roundup_power2_divisions` for every interval (a power of two, or 0 or 1
    /// for plain 512-byte rounding).
    pub fn roundup_power2_divisions(mut self, divisions: u64) -> Self {
        self.config.roundup_power2_divisions = [divisions; ROUNDUP_INTERVALS];
        self
    }

    /// Sets `roundup_power2_divisions` per interval: index 0 for sizes below 2 MiB, `i` for
    /// [2^i, 2^(i+1)) MiB, 15 for 32 GiB and above.
    pub fn roundup_power2_divisions_per_interval(
        mut self,
        divisions: [u64; ROUNDUP_INTERVALS],
    ) -> Self {
        self.config.roundup_power2_divisions = divisions;
        self
    }

    /// Sets `garbage_collection_threshold` (0 < x < 1).
    pub fn garbage_collection_threshold(mut self, threshold: f64) -> Self {
        self.config.garbage_collection_threshold = Some(threshold);
        self
    }

    /// Sets `per_process_memory_fraction` (0 < x ≤ 1).
    pub fn per_process_memory_fraction(mut self, fraction: f64) -> Self {
        self.config.per_process_memory_fraction = Some(fraction);
        self
    }

    /// Turns expandable segments on or off.
    pub fn expandable_segments(mut self, on: bool) -> Self {
        self.config.expandable_segments = on;
        self
    }

    /// Sets `large_segment_size_mb` (an even number, at least 10).
    pub fn large_segment_size_mb(mut self, mib: u64) -> Self {
        if let Some(bytes) = self.mib_to_bytes("large_segment_size_mb", mib) {
            self.config.large_segment_size = bytes;
        }
        self
    }

    /// Sets `expandable_page_size_mb`, the large pool's expandable page size (an even number,
    /// at least 2).
    pub fn expandable_page_size_mb(mut self, mib: u64) -> Self {
        if let Some(bytes) = self.mib_to_bytes("expandable_page_size_mb", mib) {
            self.config.expandable_page_size = bytes;
        }
        self
    }

    /// Sets `expandable_handle_size_mb`, the most one physical handle backs in the large pool's
    /// expandable segments (an even number, at least 2).
    pub fn expandable_handle_size_mb(mut self, mib: u64) -> Self {
        if let Some(bytes) = self.mib_to_bytes("expandable_handle_size_mb", mib) {
            self.config.expandable_handle_size = bytes;
        }
        self
    }

    /// Turns `reclaim_free_pages` on or off: whether expandable segments move free pages out of
    /// the holes between live blocks before reserved memory passes its ceiling.
    pub fn reclaim_free_pages(mut self, on: bool) -> Self {
        self.config.reclaim_free_pages = on;
        self
    }

    /// Turns `reclaim_settles` on or off: whether reclaiming leaves slack and backs off, so that
    /// a loop of identical steps stops moving pages.
    pub fn reclaim_settles(mut self, on: bool) -> Self {
        self.config.reclaim_settles = on;
        self
    }

    /// Turns `caching` on or off: off, every request gets a segment of its own, returned to the
    /// storage as soon as its free completes (PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING=1`).
    pub fn caching(mut self, on: bool) -> Self {
        self.config.caching = on;
        self
    }

    /// Checks the settings as [`AllocatorConfig::parse`] does and returns the config.
    pub fn build(self) -> Result<AllocatorConfig, AllocError> {
        if let Some(key) = self.overflowed {
            return Err(invalid(key, "too large to count in bytes"));
        }
        let mut config = self.config;
        config.validate()?;
        config.raw = config.to_conf_string();
        Ok(config)
    }

    fn mib_to_bytes(&mut self, key: &'static str, mib: u64) -> Option<u64> {
        let bytes = mib.checked_mul(1 << 20);
        if bytes.is_none() {
            self.overflowed = Some(key);
        }
        bytes
    }
}
