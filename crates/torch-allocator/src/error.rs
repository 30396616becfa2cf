//! The crate's one error type, [`PluginError`]: what a configuration or a call through the
//! plugin can get wrong. At the C ABI each becomes a status code and the message that
//! `headroom_last_error` returns; in Python, an exception with the same message.

use headroom_caching_allocator::AllocError;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The allocator was configured or chosen after it had already served an allocation.
    #[error(
        "the Headroom allocator already serves allocations; configure it before the first \
         CUDA allocation (call headroom.cuda.use_allocator() first thing in the program)"
    )]
    AlreadyInUse,
    /// The device ordinal is negative or beyond what the plugin keeps.
    #[error("device {device} is not a device the Headroom allocator can serve (0..{limit})")]
    BadDevice {
        /// The ordinal given.
        device: i64,
        /// One past the largest ordinal served.
        limit: usize,
    },
    /// A CUDA device was asked for in a build without the `cuda` feature.
    #[error(
        "this build of the Headroom allocator has no CUDA storage; rebuild with the `cuda` \
         feature or call headroom_use_host_memory() for host memory"
    )]
    NoCuda,
    /// `headroom_alloc` was asked for a negative number of bytes (PyTorch passes a `ssize_t`).
    #[error("cannot allocate a negative number of bytes ({size})")]
    NegativeSize {
        /// The size given.
        size: i64,
    },
    /// A string argument was not valid UTF-8 or was null.
    #[error("argument `{name}` must be a non-null UTF-8 C string")]
    BadString {
        /// The argument's name.
        name: &'static str,
    },
    /// The caching allocator refused the call: a bad setting, out of memory, an address it did
    /// not hand out, a storage or i/o failure. Its message says which.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}
