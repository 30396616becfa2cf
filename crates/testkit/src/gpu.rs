//! The GPU gate. A CUDA test, bench or example asks for its device through [`cuda_or_skip`]:
//! without a device it prints `skipped: <test>: <why>` and passes, so `cargo test` runs anywhere;
//! with [`REQUIRE_GPU`] set (the GPU machine sets `HEADROOM_REQUIRE_GPU=1`) it fails instead,
//! so a GPU suite cannot pass by skipping.
//!
//! The gate is generic over what was opened (a `CudaBackend`, a `CudaStorage`, a
//! `PinnedHostStorage`) and over its error, so it needs no CUDA crate itself.

use std::fmt::Display;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The environment variable that turns a skip for lack of a GPU into a failure: set to anything
/// but `0` or the empty string.
pub const REQUIRE_GPU: &str = "HEADROOM_REQUIRE_GPU";

/// PTX of `spin_ns(u64 ns)`: one thread that returns once `ns` nanoseconds of the GPU's global
/// timer have passed. A test that queues it keeps a stream busy for a known time, so what it
/// asserts about copies and waits does not depend on how fast they are (load it with ops-cuda's
/// `CudaBackend::load_kernel`, launch one thread).
pub const SPIN_NS_PTX: &str = r#"
.version 7.0
.target sm_80
.address_size 64

.visible .entry spin_ns(.param .u64 spin_ns_param_0)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [spin_ns_param_0];
    mov.u64 %rd2, %globaltimer;
$L__spin:
    mov.u64 %rd3, %globaltimer;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $L__spin;
    ret;
}
"#;

/// Whether [`REQUIRE_GPU`] is set: a missing GPU is then a failure, not a skip.
pub fn gpu_required() -> bool {
    std::env::var_os(REQUIRE_GPU).is_some_and(|value| !value.is_empty() && value != "0")
}

/// What `made` opened, or `None` after printing `skipped: <test>: <err>` — unless
/// [`gpu_required`], when it panics naming the test and the error.
///
/// `<test>` is the running test's name (libtest names each test's thread after it), or the
/// executable's name in a bench or example.
#[track_caller]
pub fn cuda_or_skip<T, E: Display>(made: Result<T, E>) -> Option<T> {
    gate(made, gpu_required())
}

/// Holds the device for one test at a time within a test binary, for tests that reason about
/// free memory or about what runs when. A test that panicked while holding it does not stop the
/// others (the poison is cleared).
pub fn exclusive_device() -> MutexGuard<'static, ()> {
    static DEVICE: Mutex<()> = Mutex::new(());
    DEVICE.lock().unwrap_or_else(PoisonError::into_inner)
}

#[track_caller]
fn gate<T, E: Display>(made: Result<T, E>, required: bool) -> Option<T> {
    match made {
        Ok(opened) => Some(opened),
        Err(err) if required => panic!(
            "{}: {REQUIRE_GPU} is set, so a missing GPU is a failure: {err}",
            running()
        ),
        Err(err) => {
            println!("skipped: {}: {err}", running());
            None
        }
    }
}

/// The running test's name, or the executable's outside a test harness.
fn running() -> String {
    let thread = std::thread::current();
    match thread.name() {
        Some(name) if name != "main" => name.to_owned(),
        _ => std::env::args()
            .next()
            .as_deref()
            .map(std::path::Path::new)
            .and_then(|path| path.file_stem())
            .map_or_else(
                || "main".to_owned(),
                |stem| stem.to_string_lossy().into_owned(),
            ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_opened_device_passes_through() {
        assert_eq!(gate(Ok::<_, String>(3), false), Some(3));
        assert_eq!(gate(Ok::<_, String>(3), true), Some(3));
    }

    #[test]
    fn a_missing_device_skips_unless_required() {
        assert_eq!(gate(Err::<u8, _>("no CUDA driver"), false), None);
        let required = std::panic::catch_unwind(|| gate(Err::<u8, _>("no CUDA driver"), true));
        let message = required.expect_err("a required GPU must fail");
        let message = message.downcast_ref::<String>().expect("a formatted panic");
        assert_eq!(
            message,
            "gpu::tests::a_missing_device_skips_unless_required: HEADROOM_REQUIRE_GPU is set, so \
             a missing GPU is a failure: no CUDA driver"
        );
    }
}
