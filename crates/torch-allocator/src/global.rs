//! The process-wide allocator that PyTorch's pluggable interface reaches: its settings, chosen
//! before the first allocation, and one [`Plugin`] per device, created on first use.
//!
//! PyTorch calls the C functions with nothing but a size, a device ordinal and a stream, so the
//! state they reach is global. [`configure`] and [`use_host_memory`] choose it; the first call
//! that reaches a device ([`with_device`]) freezes that choice. Device plugins are created once
//! and live for the rest of the process, as PyTorch's own allocator does.
//!
//! This module sits on `plugin.rs`; it knows nothing about C strings or Python.

use std::path::Path;
use std::sync::OnceLock;

use headroom_caching_allocator::{AllocatorConfig, HistoryOptions, HostStorage};
use parking_lot::Mutex;

use crate::error::PluginError;
use crate::plugin::Plugin;

/// Devices a process can serve (ordinals `0..MAX_DEVICES`).
pub const MAX_DEVICES: usize = 64;

/// Where the allocator's memory comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// Device memory of the ordinal PyTorch names (feature `cuda`).
    Cuda,
    /// Host memory, with an optional capacity, for every ordinal (tests, CPU-only runs).
    Host(Option<u64>),
}

#[derive(Debug)]
struct Settings {
    config: AllocatorConfig,
    source: Source,
}

/// The state once frozen. One value per process (a static), so the variants' sizes do not matter.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Backend {
    Host(Plugin<HostStorage>),
    #[cfg(feature = "cuda")]
    Cuda {
        config: AllocatorConfig,
        devices: Box<[OnceLock<Plugin<headroom_caching_allocator::CudaStorage>>]>,
        creating: Mutex<()>,
    },
}

static SETTINGS: Mutex<Option<Settings>> = Mutex::new(None);
static BACKEND: OnceLock<Backend> = OnceLock::new();

/// The plugin's settings before [`configure`]: Headroom's allocator defaults, with the large
/// pool's pages mapped in physical handles of up to 8 MiB (`expandable_handle_size_mb:8`)
/// instead of one per 2 MiB page.
///
/// Each handle costs about 90 µs of driver calls on an H200 (create, set access, unmap), so a
/// training run that grows to 15 GB in its first steps spent about 130 ms more than PyTorch's
/// native allocator on each of those steps with 2 MiB handles, and about 400 ms in the reclaims
/// that move pages (GPT-2 small on variable-length batches, `crates/python/bench`). Only whole
/// handles unmap, so reclaims find less: replayed, the trace corpus reserves up to 0.9% more
/// with 8 MiB handles than with 2 MiB ones and up to 2.9% more with 32 MiB ones
/// (`caching-allocator/tests/trace_corpus.rs`); on the H200, ViT-L/16 at batch 32 reserved more
/// than PyTorch's expandable segments with 32 MiB handles. `expandable_handle_size_mb:2` gives
/// the rest back.
pub fn plugin_defaults() -> AllocatorConfig {
    AllocatorConfig::builder()
        .expandable_handle_size_mb(8)
        .build()
        .expect("8 MiB is a valid handle size")
}

/// Sets the allocator's settings from `PYTORCH_CUDA_ALLOC_CONF`'s syntax (e.g.
/// `"expandable_segments:False,max_split_size_mb:512"`), over [`plugin_defaults`] (empty: those).
/// Fails with [`PluginError::AlreadyInUse`] once the allocator has been reached, and names a bad
/// key.
pub fn configure(conf: &str) -> Result<(), PluginError> {
    let config = plugin_defaults().with_conf(conf)?;
    set(|settings| settings.config = config)
}

/// Serves every device ordinal from host memory (at most `capacity` bytes when given) instead
/// of CUDA: the same policy and statistics, for tests and machines without a GPU. Fails with
/// [`PluginError::AlreadyInUse`] once the allocator has been reached.
pub fn use_host_memory(capacity: Option<u64>) -> Result<(), PluginError> {
    set(|settings| settings.source = Source::Host(capacity))
}

/// Whether the settings are frozen: some call has reached the allocator.
pub fn is_in_use() -> bool {
    BACKEND.get().is_some()
}

/// The settings string in force or to be used (`PYTORCH_CUDA_ALLOC_CONF`'s syntax, every
/// setting written out).
pub fn settings() -> String {
    match BACKEND.get() {
        Some(Backend::Host(plugin)) => plugin.allocator().config().to_conf_string(),
        #[cfg(feature = "cuda")]
        Some(Backend::Cuda { config, .. }) => config.to_conf_string(),
        None => SETTINGS
            .lock()
            .as_ref()
            .map_or_else(plugin_defaults, |s| s.config.clone())
            .to_conf_string(),
    }
}

fn set(change: impl FnOnce(&mut Settings)) -> Result<(), PluginError> {
    let mut settings = SETTINGS.lock();
    if is_in_use() {
        return Err(PluginError::AlreadyInUse);
    }
    let current = settings.get_or_insert_with(default_settings);
    change(current);
    Ok(())
}

fn default_settings() -> Settings {
    Settings {
        config: plugin_defaults(),
        source: Source::Cuda,
    }
}

/// A device's plugin, as a host-memory or CUDA one.
#[derive(Debug, Clone, Copy)]
pub enum DevicePlugin<'a> {
    /// Host memory (every ordinal shares it).
    Host(&'a Plugin<HostStorage>),
    /// Device memory of one ordinal.
    #[cfg(feature = "cuda")]
    Cuda(&'a Plugin<headroom_caching_allocator::CudaStorage>),
}

/// Calls `$body` with `$plugin` bound to the device's plugin, whichever its storage.
macro_rules! on_plugin {
    ($device:expr, $plugin:ident => $body:expr) => {
        match $device {
            DevicePlugin::Host($plugin) => $body,
            #[cfg(feature = "cuda")]
            DevicePlugin::Cuda($plugin) => $body,
        }
    };
}

impl DevicePlugin<'_> {
    /// [`Plugin::allocate`].
    ///
    /// # Safety
    /// As [`Plugin::allocate`]: the raw stream must outlive the allocator.
    pub unsafe fn allocate(self, size: u64, raw_stream: usize) -> Result<u64, PluginError> {
        // SAFETY: forwarded from the caller.
        on_plugin!(self, p => unsafe { p.allocate(size, raw_stream) })
    }

    /// [`Plugin::free`].
    pub fn free(self, address: u64) -> Result<(), PluginError> {
        on_plugin!(self, p => p.free(address))
    }

    /// [`Plugin::record_stream`].
    ///
    /// # Safety
    /// As [`Plugin::record_stream`]: the raw stream must outlive the allocator.
    pub unsafe fn record_stream(self, address: u64, raw_stream: usize) -> Result<(), PluginError> {
        // SAFETY: forwarded from the caller.
        on_plugin!(self, p => unsafe { p.record_stream(address, raw_stream) })
    }

    /// [`Plugin::memory_stats_json`].
    pub fn memory_stats_json(self) -> String {
        on_plugin!(self, p => p.memory_stats_json())
    }

    /// [`Plugin::memory_summary`].
    pub fn memory_summary(self, abbreviated: bool) -> String {
        on_plugin!(self, p => p.memory_summary(abbreviated))
    }

    /// [`Plugin::record_history`].
    pub fn record_history(self, options: Option<HistoryOptions>) {
        on_plugin!(self, p => p.record_history(options))
    }

    /// [`Plugin::write_snapshot`].
    pub fn write_snapshot(self, path: &Path) -> Result<(), PluginError> {
        on_plugin!(self, p => p.write_snapshot(path))
    }

    /// The caching allocator's `empty_cache`.
    pub fn empty_cache(self) -> Result<(), PluginError> {
        on_plugin!(self, p => p.allocator().empty_cache().map_err(PluginError::from))
    }

    /// The caching allocator's `reset_peak_stats`.
    pub fn reset_peak_stats(self) {
        on_plugin!(self, p => p.allocator().reset_peak_stats())
    }

    /// Allocations handed out and not yet freed.
    pub fn live_allocations(self) -> usize {
        on_plugin!(self, p => p.live_allocations())
    }
}

/// The plugin of device `ordinal`, freezing the settings on the first call and creating the
/// device's allocator on its first use (a CUDA device with no driver is an error here).
pub fn with_device(ordinal: i64) -> Result<DevicePlugin<'static>, PluginError> {
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let index = usize::try_from(ordinal)
        .ok()
        .filter(|&i| i < MAX_DEVICES)
        .ok_or(PluginError::BadDevice {
            device: ordinal,
            limit: MAX_DEVICES,
        })?;
    let backend = match BACKEND.get() {
        Some(backend) => backend,
        None => freeze()?,
    };
    match backend {
        Backend::Host(plugin) => Ok(DevicePlugin::Host(plugin)),
        #[cfg(feature = "cuda")]
        Backend::Cuda {
            config,
            devices,
            creating,
        } => {
            if let Some(plugin) = devices[index].get() {
                return Ok(DevicePlugin::Cuda(plugin));
            }
            let _creating = creating.lock();
            if devices[index].get().is_none() {
                let storage = headroom_caching_allocator::CudaStorage::new(index)
                    .map_err(headroom_caching_allocator::AllocError::from)?;
                let _ = devices[index].set(Plugin::new(storage, config.clone()));
            }
            Ok(DevicePlugin::Cuda(
                devices[index].get().expect("set above under the lock"),
            ))
        }
    }
}

/// Freezes the settings into the backend (once; later callers get the same one).
fn freeze() -> Result<&'static Backend, PluginError> {
    let mut settings = SETTINGS.lock();
    if let Some(backend) = BACKEND.get() {
        return Ok(backend);
    }
    let Settings { config, source } = settings.take().unwrap_or_else(default_settings);
    let backend = match source {
        Source::Host(capacity) => {
            let storage = capacity.map_or_else(HostStorage::new, HostStorage::with_capacity);
            Backend::Host(Plugin::new(storage, config))
        }
        #[cfg(feature = "cuda")]
        Source::Cuda => Backend::Cuda {
            config,
            devices: (0..MAX_DEVICES).map(|_| OnceLock::new()).collect(),
            creating: Mutex::new(()),
        },
        #[cfg(not(feature = "cuda"))]
        Source::Cuda => {
            *settings = Some(Settings { config, source });
            return Err(PluginError::NoCuda);
        }
    };
    Ok(BACKEND.get_or_init(|| backend))
}
