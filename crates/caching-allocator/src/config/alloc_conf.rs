//! The `PYTORCH_CUDA_ALLOC_CONF` syntax: reading a settings string into a config, writing a
//! config back as one, and reading `HEADROOM_ALLOC_CONF` from the environment.
//!
//! The string is a comma-separated list of `key:value`, where `roundup_power2_divisions` may be
//! a bracketed list read exactly as PyTorch's `parseRoundUpPower2Divisions` reads it. Keys PyTorch
//! knows that mean nothing here are accepted and ignored; any other key or value is a typed error
//! naming the key.
//!
//! It sits on the config type and the one validation of the parent module, which every parsed
//! string goes through. It must not know what the settings do to the policy, nor the builder.

use super::{invalid, AllocatorConfig, ALLOC_CONF_ENV, NO_CACHING_ENV, ROUNDUP_INTERVALS};
use crate::error::AllocError;

impl AllocatorConfig {
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
    /// - `large_segment_size_mb`: an even number of MiB, 10 to 1,048,576 (1 TiB; and at most
    ///   `max_split_size_mb` when that is set);
    /// - `expandable_page_size_mb`: an even number of MiB, 2 to 1,048,576 (Headroom's; PyTorch
    ///   maps 20 MiB pages);
    /// - `expandable_handle_size_mb`: an even number of MiB, 2 to 1,048,576 (Headroom's: the most
    ///   one physical handle backs in the large pool; larger map faster and unmap only whole);
    /// - `reclaim_free_pages`: `True`/`true` or `False`/`false` (Headroom's; PyTorch does not
    ///   reclaim);
    /// - `reclaim_settles`: `True`/`true` or `False`/`false` (Headroom's: whether reclaiming
    ///   leaves slack and backs off so that repeated steps stop moving pages);
    /// - `caching`: `True`/`true` or `False`/`false` (Headroom's spelling of PyTorch's
    ///   `PYTORCH_NO_CUDA_MEMORY_CACHING=1`: off, every request gets a segment of its own, freed
    ///   as soon as its free completes, and `expandable_segments` is not used);
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
        AllocatorConfig::default().with_conf(conf)
    }

    /// `conf`'s settings ([`AllocatorConfig::parse`]'s syntax and checks) over these ones rather
    /// than over the defaults: how a program with defaults of its own (the PyTorch plugin's)
    /// reads a user's string. `raw` keeps `conf` as given.
    pub fn with_conf(&self, conf: &str) -> Result<AllocatorConfig, AllocError> {
        let mut config = AllocatorConfig {
            raw: conf.to_owned(),
            ..self.clone()
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
    /// gives [`AllocatorConfig::default`]. [`NO_CACHING_ENV`] (`HEADROOM_NO_CUDA_MEMORY_CACHING`)
    /// set to `1` then turns caching off, as if the string ended in `caching:False`; set to
    /// anything else but `0` or the empty string, it is an error. A value that is not valid
    /// Unicode is [`AllocError::InvalidConfig`] with the variable's name as the key.
    pub fn from_env() -> Result<AllocatorConfig, AllocError> {
        from_env_value(std::env::var(ALLOC_CONF_ENV), std::env::var(NO_CACHING_ENV))
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
        items.push(format!(
            "expandable_page_size_mb:{}",
            self.expandable_page_size >> 20
        ));
        items.push(format!(
            "expandable_handle_size_mb:{}",
            self.expandable_handle_size >> 20
        ));
        items.push(format!(
            "reclaim_free_pages:{}",
            if self.reclaim_free_pages {
                "True"
            } else {
                "False"
            }
        ));
        items.push(format!(
            "reclaim_settles:{}",
            if self.reclaim_settles {
                "True"
            } else {
                "False"
            }
        ));
        if !self.caching {
            items.push("caching:False".to_owned());
        }
        items.join(",")
    }
}

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

/// [`AllocatorConfig::from_env`] on the variables' values, apart so tests need not touch the
/// process environment.
pub(super) fn from_env_value(
    value: Result<String, std::env::VarError>,
    no_caching: Result<String, std::env::VarError>,
) -> Result<AllocatorConfig, AllocError> {
    let config = match value {
        Ok(conf) => AllocatorConfig::parse(&conf)?,
        Err(std::env::VarError::NotPresent) => AllocatorConfig::default(),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(invalid(ALLOC_CONF_ENV, "the value is not valid Unicode"))
        }
    };
    match no_caching.as_deref() {
        Ok("1") => {
            let raw = match config.raw.as_str() {
                "" => "caching:False".to_owned(),
                conf => format!("{conf},caching:False"),
            };
            Ok(AllocatorConfig {
                caching: false,
                raw,
                ..config
            })
        }
        Ok("0" | "") | Err(std::env::VarError::NotPresent) => Ok(config),
        Ok(other) => Err(invalid(
            NO_CACHING_ENV,
            format!("expected `1` (caching off) or `0`, got `{other}`"),
        )),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(invalid(NO_CACHING_ENV, "the value is not valid Unicode"))
        }
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
        "expandable_page_size_mb" => config.expandable_page_size = parse_mib(key, value)?,
        "expandable_handle_size_mb" => config.expandable_handle_size = parse_mib(key, value)?,
        "reclaim_free_pages" => config.reclaim_free_pages = parse_bool(key, value)?,
        "reclaim_settles" => config.reclaim_settles = parse_bool(key, value)?,
        "roundup_power2_divisions" => {
            parse_roundup_power2_divisions(value, &mut config.roundup_power2_divisions)?
        }
        "garbage_collection_threshold" => {
            config.garbage_collection_threshold = Some(parse_f64(key, value)?)
        }
        "per_process_memory_fraction" => {
            config.per_process_memory_fraction = Some(parse_f64(key, value)?)
        }
        "expandable_segments" => config.expandable_segments = parse_bool(key, value)?,
        "caching" => config.caching = parse_bool(key, value)?,
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

fn parse_bool(key: &str, value: &str) -> Result<bool, AllocError> {
    match value {
        "True" | "true" => Ok(true),
        "False" | "false" => Ok(false),
        _ => Err(invalid(
            key,
            format!("expected True or False, got `{value}`"),
        )),
    }
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
