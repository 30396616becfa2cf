//! Allocator settings: PyTorch's `PYTORCH_CUDA_ALLOC_CONF` options, from a string or a builder.
//!
//! [`AllocatorConfig::parse`] reads the syntax of `PYTORCH_CUDA_ALLOC_CONF`
//! (`key:value,key:value`, with `roundup_power2_divisions` also as a list like
//! `[256:1,512:2,1024:4,>:8]`), [`AllocatorConfig::from_env`] reads `HEADROOM_ALLOC_CONF`, and
//! [`AllocatorConfigBuilder`] sets the same fields from code. Both go through one validation, so a
//! config that exists is a valid one. [`AllocatorConfig::round_size`] is PyTorch's request
//! rounding, and [`AllocatorConfig::allocator_settings`] the `allocator_settings` dict of a
//! snapshot. The policy reads a finished config; this module knows nothing about blocks or
//! storages.
//!
//! This module holds the config type, its defaults, the one validation and the snapshot's
//! settings dict. Its submodules add to the same type, one concept each: `alloc_conf` (the
//! string syntax, read and written back, and the environment variable), `builder` (the
//! builder) and `rounding` (`round_size`). They use the type and the validation here; the
//! builder also writes `raw` with `alloc_conf`'s `to_conf_string`, and no other call crosses
//! between them.
//!
//! Defaults that differ from PyTorch's: `expandable_segments` is on (PyTorch keeps it off for
//! CUDA IPC, which this kit does not use, and it removes most fragmentation), with three settings
//! of Headroom's own, 2 MiB pages in the large pool (`expandable_page_size_mb`; PyTorch maps
//! 20 MiB), `reclaim_free_pages` on and `reclaim_settles` on (PyTorch has no such step).
//! [`AllocatorConfig::pytorch_defaults`] and [`AllocatorConfig::pytorch_expandable`] are
//! PyTorch's two policies. A storage that cannot map pages ([`crate::HostStorage`]) runs the
//! classic policy whatever this says.
//!
//! We are stricter than PyTorch where PyTorch silently fixes a value: `max_split_size_mb` and
//! `max_non_split_rounding_mb` below 20 are errors (PyTorch raises them to 20), numbers must be
//! plain decimal integers (PyTorch's `stoi` reads `20.5` as 20), and `backend:cudaMallocAsync` is
//! refused because there is no such backend here.

mod alloc_conf;
mod builder;
mod rounding;
#[cfg(test)]
mod tests;

use crate::error::AllocError;
use crate::snapshot::Value;

pub use builder::AllocatorConfigBuilder;

/// Name of the environment variable read by [`AllocatorConfig::from_env`].
pub const ALLOC_CONF_ENV: &str = "HEADROOM_ALLOC_CONF";

/// The environment variable that, set to `1`, turns caching off in [`AllocatorConfig::from_env`]
/// (`caching:False`), as `PYTORCH_NO_CUDA_MEMORY_CACHING=1` does PyTorch's.
pub const NO_CACHING_ENV: &str = "HEADROOM_NO_CUDA_MEMORY_CACHING";

/// Number of power-of-two intervals `roundup_power2_divisions` can set (1 MiB ... 64 GiB).
pub const ROUNDUP_INTERVALS: usize = 16;

/// The allocator's settings.
///
/// Its fields are private: a config comes from [`AllocatorConfig::default`],
/// [`AllocatorConfig::pytorch_defaults`], [`AllocatorConfig::parse`] / [`AllocatorConfig::from_env`]
/// or [`AllocatorConfig::builder`], each of which validates it, so a config that exists is a
/// valid one (no zero-sized segment pages, no division by a zero step). The accessors read it.
///
/// ```
/// use headroom_caching_allocator::AllocatorConfig;
///
/// assert!(AllocatorConfig::builder().large_segment_size_mb(0).build().is_err());
/// assert_eq!(AllocatorConfig::default().large_segment_size(), 20 << 20);
/// ```
///
/// A hand-built config, which could hold a zero page size, does not compile:
///
/// ```compile_fail
/// use headroom_caching_allocator::AllocatorConfig;
///
/// let config = AllocatorConfig {
///     large_segment_size: 0,
///     ..AllocatorConfig::default()
/// };
/// ```
///
/// ```compile_fail
/// use headroom_caching_allocator::AllocatorConfig;
///
/// let mut config = AllocatorConfig::default();
/// config.large_segment_size = 0;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct AllocatorConfig {
    /// Blocks at least this large are never split, and requests below it never take them
    /// (`max_split_size_mb`, at least 20 MiB when set). `None`: unlimited.
    pub(crate) max_split_size: Option<u64>,
    /// How far past the request an oversize block may be and still be handed out whole
    /// (`max_non_split_rounding_mb`, default 20 MiB).
    pub(crate) max_non_split_rounding: u64,
    /// Divisions per power-of-two interval, index 0 for sizes below 2 MiB, 1 for [2, 4) MiB, ...;
    /// 0 or 1 means plain 512-byte rounding (`roundup_power2_divisions`).
    pub(crate) roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// Free old cached blocks once reserved memory exceeds this fraction of the allowed memory
    /// (`garbage_collection_threshold`, 0 < x < 1; needs `per_process_memory_fraction`).
    pub(crate) garbage_collection_threshold: Option<f64>,
    /// The fraction of device memory this allocator may reserve (`per_process_memory_fraction`).
    pub(crate) per_process_memory_fraction: Option<f64>,
    /// Grow segments by mapping pages instead of allocating new segments (`expandable_segments`).
    pub(crate) expandable_segments: bool,
    /// Size of the segment for requests between 1 MiB and 10 MiB with classic segments
    /// (`large_segment_size_mb`, default 20 MiB; a multiple of 2 MiB and at least 10 MiB, so one
    /// segment holds any request it is used for).
    pub(crate) large_segment_size: u64,
    /// Page size of the large pool's expandable segments (`expandable_page_size_mb`, default
    /// 2 MiB, the CUDA mapping granularity; PyTorch maps 20 MiB pages). The small pool's pages
    /// are 2 MiB.
    pub(crate) expandable_page_size: u64,
    /// The most bytes one physical handle backs in the large pool's expandable segments
    /// (`expandable_handle_size_mb`, default 2 MiB: one handle per page). Larger handles take
    /// fewer driver calls to map (each costs about 40 µs on an H200, whatever its size), but
    /// only whole handles can be unmapped, so reclaims and `empty_cache` give back less.
    pub(crate) expandable_handle_size: u64,
    /// With expandable segments, a request that would raise reserved memory above its ceiling is
    /// first given the whole free pages between live blocks, unmapped and mapped where it needs
    /// them (`reclaim_free_pages`, default on; PyTorch has no such step).
    pub(crate) reclaim_free_pages: bool,
    /// Whether reclaiming settles (`reclaim_settles`, default on): the reclaim ceiling is at
    /// least the live peak plus 0.5%, each reclaim raises it by half the bytes it had to find
    /// (at least two pages), and a pool gets back the pages reclaims took from it for the other
    /// pool without a reclaim, so a loop of identical steps stops moving pages after a few
    /// steps. Off, the ceiling is the most ever reserved, at every request
    /// ([`AllocatorConfig::reclaiming`]).
    pub(crate) reclaim_settles: bool,
    /// Whether freed memory is kept for reuse (`caching`, default on). Off, every request gets a
    /// segment of its own, of its rounded size, returned to the storage as soon as its free
    /// completes: the counterpart of PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING=1`, so that
    /// compute-sanitizer's memcheck sees each allocation's true bounds.
    pub(crate) caching: bool,
    /// The string this config was parsed from, as snapshots report it.
    pub(crate) raw: String,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: None,
            max_non_split_rounding: 20 << 20,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: None,
            per_process_memory_fraction: None,
            expandable_segments: true,
            large_segment_size: 20 << 20,
            expandable_page_size: 2 << 20,
            expandable_handle_size: 2 << 20,
            reclaim_free_pages: true,
            reclaim_settles: true,
            caching: true,
            raw: String::new(),
        }
    }
}

impl AllocatorConfig {
    /// Blocks at least this large are never split, and requests below it never take them
    /// (`max_split_size_mb`). `None`: unlimited.
    pub fn max_split_size(&self) -> Option<u64> {
        self.max_split_size
    }

    /// How far past the request an oversize block may be and still be handed out whole
    /// (`max_non_split_rounding_mb`), in bytes.
    pub fn max_non_split_rounding(&self) -> u64 {
        self.max_non_split_rounding
    }

    /// Divisions per power-of-two interval (`roundup_power2_divisions`; index 0 for sizes below
    /// 2 MiB, 1 for [2, 4) MiB, ...).
    pub fn roundup_power2_divisions(&self) -> &[u64; ROUNDUP_INTERVALS] {
        &self.roundup_power2_divisions
    }

    /// `garbage_collection_threshold`, if set.
    pub fn garbage_collection_threshold(&self) -> Option<f64> {
        self.garbage_collection_threshold
    }

    /// `per_process_memory_fraction`, if set.
    pub fn per_process_memory_fraction(&self) -> Option<f64> {
        self.per_process_memory_fraction
    }

    /// Whether expandable segments are asked for (`expandable_segments`).
    pub fn expandable_segments(&self) -> bool {
        self.expandable_segments
    }

    /// The large pool's classic segment size in bytes (`large_segment_size_mb`).
    pub fn large_segment_size(&self) -> u64 {
        self.large_segment_size
    }

    /// The page size of the large pool's expandable segments in bytes
    /// (`expandable_page_size_mb`).
    pub fn expandable_page_size(&self) -> u64 {
        self.expandable_page_size
    }

    /// The most bytes one physical handle backs in the large pool's expandable segments
    /// (`expandable_handle_size_mb`).
    pub fn expandable_handle_size(&self) -> u64 {
        self.expandable_handle_size
    }

    /// Whether expandable segments move free pages out of the holes between live blocks before
    /// reserved memory passes its ceiling (`reclaim_free_pages`).
    pub fn reclaim_free_pages(&self) -> bool {
        self.reclaim_free_pages
    }

    /// Whether reclaiming settles in a loop of identical steps: a ceiling with slack over the
    /// live peak, raised by every reclaim and by the pages a pool takes back from the other
    /// (`reclaim_settles`).
    pub fn reclaim_settles(&self) -> bool {
        self.reclaim_settles
    }

    /// Whether freed memory is kept for reuse (`caching`; off: a segment per allocation,
    /// returned as soon as its free completes, and expandable segments are not used).
    pub fn caching(&self) -> bool {
        self.caching
    }

    /// The string this config was parsed from (or its builder's equivalent), as snapshots report
    /// it.
    pub fn raw(&self) -> &str {
        &self.raw
    }

    /// PyTorch's defaults exactly: classic segments, everything else as in [`Default`].
    pub fn pytorch_defaults() -> Self {
        AllocatorConfig {
            expandable_segments: false,
            ..AllocatorConfig::default()
        }
    }

    /// The default with reclaiming that never settles (`reclaim_settles:False`): every request
    /// that would raise reserved memory above the most it has ever been waits for the device and
    /// moves free pages first. The least reserved memory of the policies here (at most 1.0093×
    /// the peak of live requests on the trace corpus, where PyTorch's expandable segments reach
    /// 1.0353×), paid for in device waits and page moves: in a training loop whose steps keep
    /// moving pages between the same holes, that is several waits every step (ViT-L/16 fused
    /// Adam on an H200: 53.79 ms a step at batch 1, against 21.58 ms without reclaiming), so it
    /// is an opt-in for runs bound by memory, not the default.
    pub fn reclaiming() -> Self {
        AllocatorConfig {
            reclaim_free_pages: true,
            reclaim_settles: false,
            ..AllocatorConfig::default()
        }
    }

    /// PyTorch's policy with `expandable_segments:True`: large-pool pages of 20 MiB and no
    /// reclaiming of free pages (`expandable_page_size_mb:20,reclaim_free_pages:False`).
    pub fn pytorch_expandable() -> Self {
        AllocatorConfig {
            expandable_segments: true,
            expandable_page_size: 20 << 20,
            reclaim_free_pages: false,
            ..AllocatorConfig::default()
        }
    }

    /// The `allocator_settings` dict of a PyTorch snapshot, in PyTorch's key order.
    ///
    /// `max_split_size` is in bytes, or −1 when unlimited (PyTorch stores `SIZE_MAX` and casts
    /// it to a signed 64-bit integer, which gives −1). `garbage_collection_threshold` is 0.0 when
    /// off. The three pinned-memory and locking settings have PyTorch's default values, since
    /// they mean nothing here. `roundup_power2_divisions` maps each interval's lower bound in MiB
    /// ("1", "2", "4", ... "32768") to its divisions.
    pub fn allocator_settings(&self) -> Vec<(String, Value)> {
        let max_split_size = match self.max_split_size {
            Some(bytes) => i64::try_from(bytes).unwrap_or(i64::MAX),
            None => -1,
        };
        let roundup = self
            .roundup_power2_divisions
            .iter()
            .enumerate()
            .map(|(interval_idx, &d)| {
                let lower_bound_mib = 1u64 << interval_idx;
                let divisions = i64::try_from(d).unwrap_or(i64::MAX);
                (
                    Value::Str(lower_bound_mib.to_string()),
                    Value::Int(divisions),
                )
            })
            .collect();
        vec![
            (
                "PYTORCH_CUDA_ALLOC_CONF".to_owned(),
                Value::Str(self.raw.clone()),
            ),
            ("max_split_size".to_owned(), Value::Int(max_split_size)),
            (
                "garbage_collection_threshold".to_owned(),
                Value::Float(self.garbage_collection_threshold.unwrap_or(0.0)),
            ),
            (
                "expandable_segments".to_owned(),
                Value::Bool(self.expandable_segments),
            ),
            ("pinned_num_register_threads".to_owned(), Value::Int(1)),
            ("release_lock_on_cudamalloc".to_owned(), Value::Bool(false)),
            (
                "pinned_use_cuda_host_register".to_owned(),
                Value::Bool(false),
            ),
            ("roundup_power2_divisions".to_owned(), Value::Dict(roundup)),
        ]
    }

    /// The one validation behind [`AllocatorConfig::parse`] and [`AllocatorConfigBuilder::build`].
    fn validate(&self) -> Result<(), AllocError> {
        if let Some(max_split_size) = self.max_split_size {
            if max_split_size < MIN_SPLIT_ROUNDING {
                let reason = format!("must be at least 20 MiB, got {}", describe(max_split_size));
                return Err(invalid("max_split_size_mb", reason));
            }
            if max_split_size < self.large_segment_size {
                let reason = format!(
                    "must be at least large_segment_size_mb ({}), got {}",
                    describe(self.large_segment_size),
                    describe(max_split_size)
                );
                return Err(invalid("max_split_size_mb", reason));
            }
        }
        if self.max_non_split_rounding < MIN_SPLIT_ROUNDING {
            let reason = format!(
                "must be at least 20 MiB, got {}",
                describe(self.max_non_split_rounding)
            );
            return Err(invalid("max_non_split_rounding_mb", reason));
        }
        for (interval_idx, &d) in self.roundup_power2_divisions.iter().enumerate() {
            if d != 0 && !d.is_power_of_two() {
                let reason = format!(
                    "divisions must be a power of two or 0, got {d} for the interval from {} MiB",
                    1u64 << interval_idx
                );
                return Err(invalid("roundup_power2_divisions", reason));
            }
        }
        if let Some(threshold) = self.garbage_collection_threshold {
            if !(threshold > 0.0 && threshold < 1.0) {
                let reason = format!("must be between 0 and 1 (exclusive), got {threshold}");
                return Err(invalid("garbage_collection_threshold", reason));
            }
        }
        if let Some(fraction) = self.per_process_memory_fraction {
            if !(fraction > 0.0 && fraction <= 1.0) {
                let reason = format!("must be above 0 and at most 1, got {fraction}");
                return Err(invalid("per_process_memory_fraction", reason));
            }
        }
        let sizes = [
            (
                "large_segment_size_mb",
                self.large_segment_size,
                MIN_LARGE_SEGMENT_SIZE,
            ),
            (
                "expandable_page_size_mb",
                self.expandable_page_size,
                2 << 20,
            ),
            (
                "expandable_handle_size_mb",
                self.expandable_handle_size,
                2 << 20,
            ),
        ];
        for (key, size, least) in sizes {
            if size < least || size > MAX_UNIT_SIZE || !size.is_multiple_of(2 << 20) {
                let reason = format!(
                    "must be an even number of MiB, at least {} and at most {}, got {}",
                    least >> 20,
                    MAX_UNIT_SIZE >> 20,
                    describe(size)
                );
                return Err(invalid(key, reason));
            }
        }
        Ok(())
    }
}

/// The smallest `max_split_size_mb` and `max_non_split_rounding_mb` (PyTorch's kLargeBuffer).
const MIN_SPLIT_ROUNDING: u64 = 20 << 20;

/// The largest `large_segment_size_mb`, `expandable_page_size_mb` and
/// `expandable_handle_size_mb`: 1 TiB, above any GPU's memory, so that every sum and round-up of
/// sizes the policy computes stays far inside `u64` (a larger page overflowed the round-up of a
/// request: a panic in a debug build, a meaningless storage error in release).
const MAX_UNIT_SIZE: u64 = 1 << 40;

/// The smallest `large_segment_size_mb`: requests below 10 MiB (PyTorch's kMinLargeAlloc) are
/// served from one segment of this size, so it must hold them.
const MIN_LARGE_SEGMENT_SIZE: u64 = 10 << 20;

fn invalid(key: &str, reason: impl Into<String>) -> AllocError {
    AllocError::InvalidConfig {
        key: key.to_owned(),
        reason: reason.into(),
    }
}

/// A size for an error message: whole MiB as "N MiB", anything else in bytes.
fn describe(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}
