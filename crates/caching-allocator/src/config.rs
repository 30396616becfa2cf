//! Allocator settings: PyTorch's `PYTORCH_CUDA_ALLOC_CONF` options, from a string or a builder.
//!
//! [`AllocatorConfig::parse`] reads the syntax of `PYTORCH_CUDA_ALLOC_CONF`
//! (`key:value,key:value`, with `roundup_power2_divisions` also as a list like
//! `[256:1,512:2,1024:4,>:8]`), [`AllocatorConfig::from_env`] reads `HEADROOM_ALLOC_CONF`, and
//! [`AllocatorConfigBuilder`] sets the same fields from code. The policy reads a finished config;
//! this module knows nothing about blocks or storages.
//!
//! One default differs from PyTorch's: `expandable_segments` is on. PyTorch keeps it off for
//! CUDA IPC, which this kit does not use, and it removes most fragmentation. A storage that cannot
//! map pages ([`crate::HostStorage`]) runs the classic policy whatever this says.

/// Name of the environment variable read by [`AllocatorConfig::from_env`].
pub const ALLOC_CONF_ENV: &str = "HEADROOM_ALLOC_CONF";

/// Number of power-of-two intervals `roundup_power2_divisions` can set (1 MiB ... 64 GiB).
pub const ROUNDUP_INTERVALS: usize = 16;

/// The allocator's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocatorConfig {
    /// Blocks at least this large are never split, and requests below it never take them
    /// (`max_split_size_mb`, at least 20 MiB when set). `None`: unlimited.
    pub max_split_size: Option<u64>,
    /// How far past the request an oversize block may be and still be handed out whole
    /// (`max_non_split_rounding_mb`, default 20 MiB).
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval, index 0 for sizes below 2 MiB, 1 for [2, 4) MiB, ...;
    /// 0 or 1 means plain 512-byte rounding (`roundup_power2_divisions`).
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// Free old cached blocks once reserved memory exceeds this fraction of the allowed memory
    /// (`garbage_collection_threshold`, 0 < x < 1; needs `per_process_memory_fraction`).
    pub garbage_collection_threshold: Option<f64>,
    /// The fraction of device memory this allocator may reserve (`per_process_memory_fraction`).
    pub per_process_memory_fraction: Option<f64>,
    /// Grow segments by mapping pages instead of allocating new segments (`expandable_segments`).
    pub expandable_segments: bool,
    /// Size of the segment for requests between 1 MiB and 10 MiB, and the page size of the
    /// large pool's expandable segments (`large_segment_size_mb`, default 20 MiB).
    pub large_segment_size: u64,
    /// The string this config was parsed from, as snapshots report it.
    pub raw: String,
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
            raw: String::new(),
        }
    }
}

impl AllocatorConfig {
    /// PyTorch's defaults exactly: classic segments, everything else as in [`Default`].
    pub fn pytorch_defaults() -> Self {
        AllocatorConfig { expandable_segments: false, ..AllocatorConfig::default() }
    }

    /// Starts a builder from [`AllocatorConfig::default`].
    pub fn builder() -> AllocatorConfigBuilder {
        AllocatorConfigBuilder { config: AllocatorConfig::default() }
    }
}

/// Sets [`AllocatorConfig`] fields from code, with the same checks as the string form.
#[derive(Debug, Clone)]
pub struct AllocatorConfigBuilder {
    config: AllocatorConfig,
}
