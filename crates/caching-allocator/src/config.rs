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
//! One default differs from PyTorch's: `expandable_segments` is on. PyTorch keeps it off for
//! CUDA IPC, which this kit does not use, and it removes most fragmentation. A storage that cannot
//! map pages ([`crate::HostStorage`]) runs the classic policy whatever this says.
//!
//! We are stricter than PyTorch where PyTorch silently fixes a value: `max_split_size_mb` and
//! `max_non_split_rounding_mb` below 20 are errors (PyTorch raises them to 20), numbers must be
//! plain decimal integers (PyTorch's `stoi` reads `20.5` as 20), and `backend:cudaMallocAsync` is
//! refused because there is no such backend here.

use crate::error::AllocError;
use crate::snapshot::Value;

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
    /// large pool's expandable segments (`large_segment_size_mb`, default 20 MiB; a multiple of
    /// 2 MiB and at least 10 MiB, so one segment holds any request it is used for).
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
        AllocatorConfig {
            expandable_segments: false,
            ..AllocatorConfig::default()
        }
    }

    /// Starts a builder from [`AllocatorConfig::default`].
    pub fn builder() -> AllocatorConfigBuilder {
        AllocatorConfigBuilder {
            config: AllocatorConfig::default(),
            overflowed: None,
        }
    }

    /// Reads a `PYTORCH_CUDA_ALLOC_CONF`-style string, starting from [`AllocatorConfig::default`]
    /// (so `expandable_segments` is on unless the string turns it off).
    ///
    /// The string is a comma-separated list of `key:value`; whitespace around tokens, empty items
    /// and a trailing comma are allowed, and a key given twice takes its last value. Keys:
    /// - `max_split_size_mb`, `max_non_split_rounding_mb`: MiB, at least 20;
    /// - `roundup_power2_divisions`: one power of two for every interval, or a list such as
    ///   `[256:1,512:2,1024:4,>:8]` read exactly as PyTorch does: each key is an interval's lower
    ///   bound in MiB (a power of two; 1 is the interval below 2 MiB, 32768 and above the last
    ///   one), the first key's value also fills every interval below it, `>` fills every interval
    ///   after the previous key's, other intervals keep 0; values are powers of two or 0;
    /// - `garbage_collection_threshold`: 0 < x < 1;
    /// - `per_process_memory_fraction`: 0 < x ≤ 1;
    /// - `expandable_segments`: `True`/`true` or `False`/`false`;
    /// - `large_segment_size_mb`: an even number of MiB, at least 10 (and at most
    ///   `max_split_size_mb` when that is set);
    /// - `backend`: only `native`; `cudaMallocAsync` is refused;
    /// - accepted and ignored, as they concern PyTorch's locking, pinned host memory or graph
    ///   capture: `release_lock_on_cudamalloc`, `throw_on_cudamalloc_oom`,
    ///   `graph_capture_record_stream_reuse`, `pinned_use_cuda_host_register`,
    ///   `pinned_num_register_threads`, `pinned_use_background_threads`,
    ///   `pinned_reserve_segment_size_mb`, `pinned_max_round_threshold_mb`,
    ///   `pinned_max_cached_size_mb`.
    ///
    /// Any other key, a missing value or a value out of range is
    /// [`AllocError::InvalidConfig`] naming the key. `raw` keeps `conf` as given.
    pub fn parse(conf: &str) -> Result<AllocatorConfig, AllocError> {
        let mut config = AllocatorConfig {
            raw: conf.to_owned(),
            ..AllocatorConfig::default()
        };
        for item in split_items(conf) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let Some((key, value)) = item.split_once(':') else {
                return Err(invalid(item, "expected `key:value`"));
            };
            let (key, value) = (key.trim(), value.trim());
            if value.is_empty() {
                return Err(invalid(key, "missing value"));
            }
            apply_option(&mut config, key, value)?;
        }
        config.validate()?;
        Ok(config)
    }

    /// Reads [`ALLOC_CONF_ENV`] (`HEADROOM_ALLOC_CONF`) with [`AllocatorConfig::parse`]; unset
    /// gives [`AllocatorConfig::default`]. A value that is not valid Unicode is
    /// [`AllocError::InvalidConfig`] with the variable's name as the key.
    pub fn from_env() -> Result<AllocatorConfig, AllocError> {
        from_env_value(std::env::var(ALLOC_CONF_ENV))
    }

    /// A string that [`AllocatorConfig::parse`] reads back to a config equal to this one, except
    /// for `raw`. Every setting is written out, so the result does not depend on defaults, except
    /// those that are unset (`max_split_size_mb`, `garbage_collection_threshold`,
    /// `per_process_memory_fraction`) or all zero (`roundup_power2_divisions`).
    ///
    /// Sizes are written in MiB: a config built by hand with a size that is not a whole number of
    /// MiB does not round-trip (`parse` and the builder only make whole MiB).
    pub fn to_conf_string(&self) -> String {
        let mut items = Vec::new();
        if let Some(max_split_size) = self.max_split_size {
            items.push(format!("max_split_size_mb:{}", max_split_size >> 20));
        }
        items.push(format!(
            "max_non_split_rounding_mb:{}",
            self.max_non_split_rounding >> 20
        ));
        let divisions = &self.roundup_power2_divisions;
        if divisions.iter().all(|&d| d == divisions[0]) {
            if divisions[0] != 0 {
                items.push(format!("roundup_power2_divisions:{}", divisions[0]));
            }
        } else {
            let list: Vec<String> = divisions
                .iter()
                .enumerate()
                .map(|(interval_idx, d)| format!("{}:{d}", 1u64 << interval_idx))
                .collect();
            items.push(format!("roundup_power2_divisions:[{}]", list.join(",")));
        }
        if let Some(threshold) = self.garbage_collection_threshold {
            items.push(format!("garbage_collection_threshold:{threshold}"));
        }
        if let Some(fraction) = self.per_process_memory_fraction {
            items.push(format!("per_process_memory_fraction:{fraction}"));
        }
        let expandable = if self.expandable_segments {
            "True"
        } else {
            "False"
        };
        items.push(format!("expandable_segments:{expandable}"));
        items.push(format!(
            "large_segment_size_mb:{}",
            self.large_segment_size >> 20
        ));
        items.join(",")
    }

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
        let large_segment_size = self.large_segment_size;
        if large_segment_size < MIN_LARGE_SEGMENT_SIZE
            || !large_segment_size.is_multiple_of(2 << 20)
        {
            let reason = format!(
                "must be an even number of MiB, at least 10, got {}",
                describe(large_segment_size)
            );
            return Err(invalid("large_segment_size_mb", reason));
        }
        Ok(())
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
/// assert_eq!(config.max_split_size, Some(256 << 20));
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

/// The smallest `max_split_size_mb` and `max_non_split_rounding_mb` (PyTorch's kLargeBuffer).
const MIN_SPLIT_ROUNDING: u64 = 20 << 20;

/// The smallest `large_segment_size_mb`: requests below 10 MiB (PyTorch's kMinLargeAlloc) are
/// served from one segment of this size, so it must hold them.
const MIN_LARGE_SEGMENT_SIZE: u64 = 10 << 20;

/// Keys PyTorch knows that have no meaning here; they are accepted and ignored.
const IGNORED_KEYS: [&str; 9] = [
    "release_lock_on_cudamalloc",
    "throw_on_cudamalloc_oom",
    "graph_capture_record_stream_reuse",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
];

/// [`AllocatorConfig::from_env`] on the variable's value, apart so tests need not touch the
/// process environment.
fn from_env_value(
    value: Result<String, std::env::VarError>,
) -> Result<AllocatorConfig, AllocError> {
    match value {
        Ok(conf) => AllocatorConfig::parse(&conf),
        Err(std::env::VarError::NotPresent) => Ok(AllocatorConfig::default()),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(invalid(ALLOC_CONF_ENV, "the value is not valid Unicode"))
        }
    }
}

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

/// Splits at the commas outside brackets, so a `roundup_power2_divisions` list stays whole. An
/// unclosed `[` runs to the end, where the list's parser reports it.
fn split_items(conf: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (idx, ch) in conf.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&conf[start..idx]);
                start = idx + 1;
            }
            _ => {}
        }
    }
    items.push(&conf[start..]);
    items
}

fn apply_option(config: &mut AllocatorConfig, key: &str, value: &str) -> Result<(), AllocError> {
    match key {
        "max_split_size_mb" => config.max_split_size = Some(parse_mib(key, value)?),
        "max_non_split_rounding_mb" => config.max_non_split_rounding = parse_mib(key, value)?,
        "large_segment_size_mb" => config.large_segment_size = parse_mib(key, value)?,
        "roundup_power2_divisions" => {
            parse_roundup_power2_divisions(value, &mut config.roundup_power2_divisions)?
        }
        "garbage_collection_threshold" => {
            config.garbage_collection_threshold = Some(parse_f64(key, value)?)
        }
        "per_process_memory_fraction" => {
            config.per_process_memory_fraction = Some(parse_f64(key, value)?)
        }
        "expandable_segments" => {
            config.expandable_segments = match value {
                "True" | "true" => true,
                "False" | "false" => false,
                _ => {
                    let reason = format!("expected True or False, got `{value}`");
                    return Err(invalid(key, reason));
                }
            }
        }
        "backend" => match value {
            "native" => {}
            "cudaMallocAsync" => {
                let reason = "cudaMallocAsync is not supported; Headroom has only its own \
                              caching allocator (`native`)";
                return Err(invalid(key, reason));
            }
            _ => return Err(invalid(key, format!("expected `native`, got `{value}`"))),
        },
        _ if IGNORED_KEYS.contains(&key) => {}
        _ => return Err(invalid(key, "unknown option")),
    }
    Ok(())
}

fn parse_u64(key: &str, value: &str) -> Result<u64, AllocError> {
    value
        .parse()
        .map_err(|_| invalid(key, format!("expected a whole number, got `{value}`")))
}

fn parse_f64(key: &str, value: &str) -> Result<f64, AllocError> {
    value
        .parse()
        .map_err(|_| invalid(key, format!("expected a number, got `{value}`")))
}

/// A count of MiB, returned in bytes.
fn parse_mib(key: &str, value: &str) -> Result<u64, AllocError> {
    let mib = parse_u64(key, value)?;
    mib.checked_mul(1 << 20)
        .ok_or_else(|| invalid(key, "too large to count in bytes"))
}

/// PyTorch's `parseRoundUpPower2Divisions`, on top of the current `divisions` (so a key given
/// twice in list form merges, as in PyTorch).
fn parse_roundup_power2_divisions(
    value: &str,
    divisions: &mut [u64; ROUNDUP_INTERVALS],
) -> Result<(), AllocError> {
    const KEY: &str = "roundup_power2_divisions";
    let Some(list) = value.strip_prefix('[') else {
        let d = parse_u64(KEY, value)?;
        if !d.is_power_of_two() {
            return Err(invalid(
                KEY,
                format!("a single value must be a power of two, got {d}"),
            ));
        }
        *divisions = [d; ROUNDUP_INTERVALS];
        return Ok(());
    };
    let Some(list) = list.strip_suffix(']') else {
        return Err(invalid(KEY, "the list has no closing `]`"));
    };
    let mut first_value = true;
    let mut last_idx = 0;
    for entry in list.split(',') {
        let entry = entry.trim();
        if entry.is_empty() {
            continue;
        }
        let Some((boundary, d)) = entry.split_once(':') else {
            return Err(invalid(
                KEY,
                format!("expected `size_mb:divisions`, got `{entry}`"),
            ));
        };
        let (boundary, d) = (boundary.trim(), parse_u64(KEY, d.trim())?);
        if d != 0 && !d.is_power_of_two() {
            return Err(invalid(
                KEY,
                format!("divisions must be a power of two or 0, got {d}"),
            ));
        }
        if boundary == ">" {
            // PyTorch fills after the previous key's interval, even when `>` comes first.
            divisions[last_idx + 1..].fill(d);
            continue;
        }
        let boundary: u64 = boundary.parse().map_err(|_| {
            invalid(
                KEY,
                format!("expected a size in MiB or `>`, got `{boundary}`"),
            )
        })?;
        if !boundary.is_power_of_two() {
            let reason = format!("interval sizes must be powers of two, got {boundary}");
            return Err(invalid(KEY, reason));
        }
        let interval_idx = (boundary.ilog2() as usize).min(ROUNDUP_INTERVALS - 1);
        if first_value {
            divisions[..interval_idx].fill(d);
            first_value = false;
        }
        divisions[interval_idx] = d;
        last_idx = interval_idx;
    }
    Ok(())
}

/// The `roundup_power2_divisions` interval of a size of at least 1 byte: ⌊log2 size⌋ − 20,
/// clamped to 0..=15.
fn interval_index(size: u64) -> usize {
    let log_size = size.max(1).ilog2() as usize;
    log_size.saturating_sub(20).min(ROUNDUP_INTERVALS - 1)
}

/// PyTorch's `roundup_power2_next_division`, for `size > 0` and `divisions >= 2`.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn parse_ok(conf: &str) -> AllocatorConfig {
        match AllocatorConfig::parse(conf) {
            Ok(config) => config,
            Err(error) => panic!("`{conf}` should parse: {error}"),
        }
    }

    /// The key of the `InvalidConfig` error `conf` gives, or a description of what it gave.
    fn error_key(conf: &str) -> String {
        match AllocatorConfig::parse(conf) {
            Err(AllocError::InvalidConfig { key, .. }) => key,
            Err(other) => format!("other error: {other}"),
            Ok(config) => format!("parsed: {config:?}"),
        }
    }

    fn with_divisions(divisions: [u64; ROUNDUP_INTERVALS]) -> AllocatorConfig {
        AllocatorConfig {
            roundup_power2_divisions: divisions,
            ..AllocatorConfig::default()
        }
    }

    #[test]
    fn empty_string_gives_defaults() {
        assert_eq!(parse_ok(""), AllocatorConfig::default());
        assert_eq!(
            parse_ok("  "),
            AllocatorConfig {
                raw: "  ".into(),
                ..AllocatorConfig::default()
            }
        );
        assert!(AllocatorConfig::default().expandable_segments);
    }

    #[test]
    fn parses_every_option() {
        let conf = " max_split_size_mb : 128 , max_non_split_rounding_mb:64,\
                    roundup_power2_divisions:4, garbage_collection_threshold:0.6,\
                    per_process_memory_fraction:0.5,expandable_segments:False,\
                    large_segment_size_mb:12,backend:native,";
        let config = parse_ok(conf);
        assert_eq!(
            config,
            AllocatorConfig {
                max_split_size: Some(128 * MIB),
                max_non_split_rounding: 64 * MIB,
                roundup_power2_divisions: [4; ROUNDUP_INTERVALS],
                garbage_collection_threshold: Some(0.6),
                per_process_memory_fraction: Some(0.5),
                expandable_segments: false,
                large_segment_size: 12 * MIB,
                raw: conf.to_owned(),
            }
        );
        assert!(parse_ok("expandable_segments:true").expandable_segments);
        assert!(parse_ok("expandable_segments:True").expandable_segments);
        assert!(!parse_ok("expandable_segments:false").expandable_segments);
        assert_eq!(
            parse_ok("per_process_memory_fraction:1").per_process_memory_fraction,
            Some(1.0)
        );
        assert_eq!(
            parse_ok("max_split_size_mb:20").max_split_size,
            Some(20 * MIB)
        );
        // A key given twice takes its last value, as in PyTorch.
        assert_eq!(
            parse_ok("max_split_size_mb:40,max_split_size_mb:30").max_split_size,
            Some(30 * MIB)
        );
    }

    #[test]
    fn ignored_pytorch_keys_are_accepted() {
        let conf = "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,\
                    pinned_num_register_threads:8,pinned_use_background_threads:True,\
                    graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:True";
        assert_eq!(
            parse_ok(conf),
            AllocatorConfig {
                raw: conf.to_owned(),
                ..AllocatorConfig::default()
            }
        );
    }

    #[test]
    fn invalid_values_name_their_key() {
        let cases = [
            ("max_split_size_mb:19", "max_split_size_mb"),
            ("max_split_size_mb:-5", "max_split_size_mb"),
            ("max_split_size_mb:20.5", "max_split_size_mb"),
            (
                "max_split_size_mb:99999999999999999999",
                "max_split_size_mb",
            ),
            (
                "max_split_size_mb:18446744073709551615",
                "max_split_size_mb",
            ),
            (
                "max_split_size_mb:30,large_segment_size_mb:40",
                "max_split_size_mb",
            ),
            ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb"),
            ("roundup_power2_divisions:3", "roundup_power2_divisions"),
            ("roundup_power2_divisions:0", "roundup_power2_divisions"),
            (
                "roundup_power2_divisions:[256:3]",
                "roundup_power2_divisions",
            ),
            (
                "roundup_power2_divisions:[300:2]",
                "roundup_power2_divisions",
            ),
            ("roundup_power2_divisions:[0:2]", "roundup_power2_divisions"),
            (
                "roundup_power2_divisions:[256:2",
                "roundup_power2_divisions",
            ),
            ("roundup_power2_divisions:[256]", "roundup_power2_divisions"),
            ("roundup_power2_divisions:[x:2]", "roundup_power2_divisions"),
            (
                "garbage_collection_threshold:0",
                "garbage_collection_threshold",
            ),
            (
                "garbage_collection_threshold:1",
                "garbage_collection_threshold",
            ),
            (
                "garbage_collection_threshold:NaN",
                "garbage_collection_threshold",
            ),
            (
                "garbage_collection_threshold:high",
                "garbage_collection_threshold",
            ),
            (
                "per_process_memory_fraction:0",
                "per_process_memory_fraction",
            ),
            (
                "per_process_memory_fraction:1.01",
                "per_process_memory_fraction",
            ),
            ("expandable_segments:yes", "expandable_segments"),
            ("expandable_segments:", "expandable_segments"),
            ("large_segment_size_mb:8", "large_segment_size_mb"),
            ("large_segment_size_mb:21", "large_segment_size_mb"),
            ("backend:cudaMallocAsync", "backend"),
            ("backend:other", "backend"),
            ("expandable_segments", "expandable_segments"),
            ("max_split_size_mb:128,no_such_option:1", "no_such_option"),
        ];
        for (conf, key) in cases {
            assert_eq!(error_key(conf), key, "parsing `{conf}`");
        }
    }

    #[test]
    fn error_messages_explain() {
        let Err(error) = AllocatorConfig::parse("backend:cudaMallocAsync") else {
            panic!("cudaMallocAsync must be refused");
        };
        assert_eq!(
            error.to_string(),
            "invalid allocator setting `backend`: cudaMallocAsync is not supported; Headroom has \
             only its own caching allocator (`native`)"
        );
        let Err(error) = AllocatorConfig::parse("max_split_size_mb:10") else {
            panic!("10 MiB is below the minimum");
        };
        assert_eq!(
            error.to_string(),
            "invalid allocator setting `max_split_size_mb`: must be at least 20 MiB, got 10 MiB"
        );
    }

    #[test]
    fn roundup_list_follows_pytorch() {
        // The first key also fills the intervals below it; `>` fills those after the last key.
        assert_eq!(
            parse_ok("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions,
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]
        );
        // Gaps between keys keep 0, as in PyTorch.
        assert_eq!(
            parse_ok("roundup_power2_divisions:[ 2 : 4 , 64:2 ]").roundup_power2_divisions,
            [4, 4, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        // `>` first fills from interval 1 on, then the first key fills below itself.
        assert_eq!(
            parse_ok("roundup_power2_divisions:[>:8,4:2]").roundup_power2_divisions,
            [2, 2, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]
        );
        // Keys beyond 32 GiB clamp to the last interval; 1 MiB is the first.
        assert_eq!(
            parse_ok("roundup_power2_divisions:[1:16,65536:2]").roundup_power2_divisions,
            [16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]
        );
        assert_eq!(
            parse_ok("roundup_power2_divisions:[1:0]").roundup_power2_divisions,
            [0; 16]
        );
        // Commas inside the list do not end the option.
        let config = parse_ok("roundup_power2_divisions:[256:1,>:4],expandable_segments:False");
        assert!(!config.expandable_segments);
        assert_eq!(config.roundup_power2_divisions[9], 4);
    }

    #[test]
    fn conf_string_round_trips() {
        let configs = [
            AllocatorConfig::default(),
            AllocatorConfig::pytorch_defaults(),
            parse_ok("max_split_size_mb:512,garbage_collection_threshold:0.8,per_process_memory_fraction:0.3333333333333333"),
            parse_ok("roundup_power2_divisions:[256:1,512:2,1024:4,>:8],large_segment_size_mb:32"),
            parse_ok("roundup_power2_divisions:[2:4,64:2]"),
            parse_ok("roundup_power2_divisions:2,max_non_split_rounding_mb:100"),
        ];
        for config in configs {
            let conf = config.to_conf_string();
            let back = parse_ok(&conf);
            assert_eq!(back.raw, conf);
            assert_eq!(
                AllocatorConfig {
                    raw: String::new(),
                    ..back
                },
                AllocatorConfig {
                    raw: String::new(),
                    ..config
                },
                "{conf}"
            );
        }
        assert_eq!(
            AllocatorConfig::default().to_conf_string(),
            "max_non_split_rounding_mb:20,expandable_segments:True,large_segment_size_mb:20"
        );
    }

    #[test]
    fn builder_matches_parse() {
        let built = AllocatorConfig::builder()
            .max_split_size_mb(128)
            .max_non_split_rounding_mb(64)
            .roundup_power2_divisions(4)
            .garbage_collection_threshold(0.6)
            .per_process_memory_fraction(0.5)
            .expandable_segments(false)
            .large_segment_size_mb(12)
            .build();
        let built = match built {
            Ok(config) => config,
            Err(error) => panic!("{error}"),
        };
        let parsed = parse_ok(&built.raw);
        assert_eq!(built, parsed);
        assert_eq!(built.max_split_size, Some(128 * MIB));

        let per_interval = [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8];
        let built = AllocatorConfig::builder()
            .roundup_power2_divisions_per_interval(per_interval)
            .build();
        assert_eq!(
            built.ok().map(|c| c.roundup_power2_divisions),
            Some(per_interval)
        );
    }

    #[test]
    fn builder_applies_the_same_validation() {
        let cases = [
            (
                AllocatorConfig::builder().max_split_size_mb(19),
                "max_split_size_mb",
            ),
            (
                AllocatorConfig::builder().max_split_size_mb(u64::MAX),
                "max_split_size_mb",
            ),
            (
                AllocatorConfig::builder().max_non_split_rounding_mb(1),
                "max_non_split_rounding_mb",
            ),
            (
                AllocatorConfig::builder().roundup_power2_divisions(6),
                "roundup_power2_divisions",
            ),
            (
                AllocatorConfig::builder().garbage_collection_threshold(1.5),
                "garbage_collection_threshold",
            ),
            (
                AllocatorConfig::builder().garbage_collection_threshold(f64::NAN),
                "garbage_collection_threshold",
            ),
            (
                AllocatorConfig::builder().per_process_memory_fraction(0.0),
                "per_process_memory_fraction",
            ),
            (
                AllocatorConfig::builder().large_segment_size_mb(3),
                "large_segment_size_mb",
            ),
            (
                AllocatorConfig::builder().large_segment_size_mb(u64::MAX),
                "large_segment_size_mb",
            ),
        ];
        for (builder, expected_key) in cases {
            match builder.build() {
                Err(AllocError::InvalidConfig { key, .. }) => assert_eq!(key, expected_key),
                other => panic!("expected an error for {expected_key}, got {other:?}"),
            }
        }
        // 0 (off) is allowed for all intervals from the builder.
        assert!(AllocatorConfig::builder()
            .roundup_power2_divisions(0)
            .build()
            .is_ok());
    }

    #[test]
    fn round_size_without_divisions() {
        let config = AllocatorConfig::default();
        let cases = [
            (0, 512),
            (1, 512),
            (511, 512),
            (512, 512),
            (513, 1024),
            (1200, 1536),
            (1048575, 1048576),
            (10485761, 10486272),
            (26214401, 26214912),
            (u64::MAX - 511, u64::MAX - 511),
            (u64::MAX - 510, u64::MAX),
            (u64::MAX, u64::MAX),
        ];
        for (size, expected) in cases {
            assert_eq!(config.round_size(size), expected, "round_size({size})");
        }
    }

    #[test]
    fn round_size_with_power2_divisions() {
        let config = with_divisions([4; ROUNDUP_INTERVALS]);
        let cases = [
            // At most 512·4 bytes: plain 512-byte rounding.
            (1200, 1536),
            (2048, 2048),
            // Above: quarters of the power-of-two interval.
            (2049, 2560),
            (3000, 3072),
            (4097, 5120),
            (1 << 20, 1 << 20),
            ((1 << 20) + 1, 1280 << 10),
            (5 * MIB, 5 * MIB),
            (5 * MIB + 1, 6 * MIB),
            (7 * MIB + 1, 8 * MIB),
            (8 * MIB, 8 * MIB),
            (1 << 40, 1 << 40),
            ((1 << 40) + 1, (5 << 40) / 4),
            ((1u64 << 63) + 1, (1u64 << 63) + (1u64 << 61)),
            (u64::MAX, u64::MAX),
        ];
        for (size, expected) in cases {
            assert_eq!(config.round_size(size), expected, "round_size({size})");
        }
    }

    #[test]
    fn round_size_uses_the_interval_of_the_size() {
        // 2 divisions from 64 MiB up, none below (PyTorch's `[32:1,>:2]`).
        let config = parse_ok("roundup_power2_divisions:[32:1,>:2]");
        assert_eq!(config.round_size(40 * MIB + 1), 40 * MIB + 512);
        assert_eq!(config.round_size(65 * MIB), 96 * MIB);
        assert_eq!(config.round_size(100 * MIB), 128 * MIB);
        // Sizes below 2 MiB all use interval 0.
        let config = parse_ok("roundup_power2_divisions:[1:8]");
        assert_eq!(config.round_size(1000 * 1024 + 1), 1024 * 1024);
        assert_eq!(config.round_size(3 * MIB + 1), 3 * MIB + 512);
        // Divisions too fine for the interval fall back on the next power of two.
        let config = with_divisions([1 << 40; ROUNDUP_INTERVALS]);
        assert_eq!(config.round_size(3 * MIB), 3 * MIB);
        assert_eq!(roundup_power2_next_division(3 * MIB, 1 << 40), 4 * MIB);
    }

    #[test]
    fn allocator_settings_as_pytorch_reports_them() {
        let config = parse_ok("max_split_size_mb:256,roundup_power2_divisions:[256:1,>:4]");
        let settings = config.allocator_settings();
        let keys: Vec<&str> = settings.iter().map(|(key, _)| key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "PYTORCH_CUDA_ALLOC_CONF",
                "max_split_size",
                "garbage_collection_threshold",
                "expandable_segments",
                "pinned_num_register_threads",
                "release_lock_on_cudamalloc",
                "pinned_use_cuda_host_register",
                "roundup_power2_divisions",
            ]
        );
        assert_eq!(settings[0].1, Value::Str(config.raw.clone()));
        assert_eq!(settings[1].1, Value::Int(256 << 20));
        assert_eq!(settings[2].1, Value::Float(0.0));
        assert_eq!(settings[3].1, Value::Bool(true));
        assert_eq!(settings[4].1, Value::Int(1));
        assert_eq!(settings[5].1, Value::Bool(false));
        assert_eq!(settings[6].1, Value::Bool(false));
        let Value::Dict(roundup) = &settings[7].1 else {
            panic!("roundup_power2_divisions must be a dict");
        };
        assert_eq!(roundup.len(), ROUNDUP_INTERVALS);
        assert_eq!(roundup[0], (Value::Str("1".into()), Value::Int(1)));
        assert_eq!(roundup[8], (Value::Str("256".into()), Value::Int(1)));
        assert_eq!(roundup[9], (Value::Str("512".into()), Value::Int(4)));
        assert_eq!(roundup[15], (Value::Str("32768".into()), Value::Int(4)));

        let unlimited = AllocatorConfig::default().allocator_settings();
        assert_eq!(unlimited[1].1, Value::Int(-1));
    }

    #[test]
    fn from_env_reads_headroom_alloc_conf() {
        use std::env::VarError;

        assert_eq!(ALLOC_CONF_ENV, "HEADROOM_ALLOC_CONF");
        let unset = from_env_value(Err(VarError::NotPresent));
        assert_eq!(unset.ok(), Some(AllocatorConfig::default()));
        let set = from_env_value(Ok("expandable_segments:False".to_owned()));
        let expected = AllocatorConfig {
            raw: "expandable_segments:False".into(),
            ..AllocatorConfig::pytorch_defaults()
        };
        assert_eq!(set.ok(), Some(expected));
        let bogus = from_env_value(Ok("bogus:1".to_owned()));
        assert!(matches!(bogus, Err(AllocError::InvalidConfig { key, .. }) if key == "bogus"));
        let not_unicode = from_env_value(Err(VarError::NotUnicode("\u{fffd}".into())));
        assert!(
            matches!(not_unicode, Err(AllocError::InvalidConfig { key, .. }) if key == ALLOC_CONF_ENV)
        );
    }
}
