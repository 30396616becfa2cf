//! The gate: the one way a test, bench or example skips. It asks for its device through
//! [`cuda_or_skip`], for what else it needs through [`skip`] (a device capability such as
//! mapping pages, a tool such as python3) and for more than one GPU through [`gpus_or_skip`].
//!
//! A test that asks for a device is marked `#[ignore = "needs a CUDA device"]`
//! ([`IGNORE_REASON`]), so `cargo test` on a machine without one counts it ignored, with that
//! reason, instead of passing it; the GPU machine runs it with `--include-ignored`. xtask's tidy
//! holds that every test that asks for a device carries the mark and no other test does, and
//! that no harness code prints a skip line of its own or matches on a device opener's error.
//!
//! Without what it needs, the gate prints `skipped: <test>: <why>` and the test passes: in a run
//! with `--include-ignored` on a machine without a device, in a bench or an example, and for
//! [`skip`]'s reasons anywhere. Two runs fail instead:
//! - with [`REQUIRE_GPU`] set (the GPU machine sets `HEADROOM_REQUIRE_GPU=1`), so a GPU suite
//!   cannot pass by skipping;
//! - a test that finds no device in a run that left the ignored tests out: it asked for a device
//!   without the mark, and would otherwise pass as `ok` (what tidy's reading missed).
//!
//! The rules on the GPU machine:
//! - Test binaries run with `--include-ignored`, and a run that reports an ignored test fails
//!   (the scripts check libtest's `test result` line), so no GPU test is left out unseen.
//! - Under [`REQUIRE_GPU`] nothing skips, for any reason: a capability the device lacks is a
//!   failure too (an H200 maps 2 MiB pages, so a test that needs them must run there), and so is
//!   a missing tool.
//! - A test that needs N GPUs asks [`gpus_or_skip`]: with fewer visible it skips, or fails under
//!   [`REQUIRE_GPU`]. So a run on one GPU with [`REQUIRE_GPU`] set must leave the multi-GPU test
//!   binaries out, by name and visibly, never by letting them skip: `scripts/gpu-measure.sh`
//!   runs the one-GPU suite and names what it leaves out (distributed's `nccl`, the one
//!   multi-GPU test binary), and `scripts/gpu-data-parallel.sh` runs `nccl` on two GPUs.
//! - The scripts fail a run whose output holds the word `skipped` at all (a skip line that did
//!   not come through the gate), so harness code never prints that word itself.
//!
//! The gate is generic over what was opened (a `CudaBackend`, a `CudaStorage`, a
//! `PinnedHostStorage`) and over its error, so it needs no CUDA crate itself. A test asks for
//! its backend in one call: [`backend_or_skip`] gives the `BackendRef` tensors take,
//! [`shared_or_skip`] a device opened once per test binary.

use std::any::{Any, TypeId};
use std::fmt::Display;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use headroom_autograd_core::{Backend, BackendRef};

/// The environment variable that turns a skip into a failure: set to anything but `0` or the
/// empty string.
pub const REQUIRE_GPU: &str = "HEADROOM_REQUIRE_GPU";

/// The reason of the one `ignore` attribute of the workspace, on every test that asks for a
/// device: `#[ignore = "needs a CUDA device"]` (an attribute cannot take a constant; xtask's tidy
/// checks the literal).
pub const IGNORE_REASON: &str = "needs a CUDA device";

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

/// Whether [`REQUIRE_GPU`] is set: a skip is then a failure.
pub fn gpu_required() -> bool {
    std::env::var_os(REQUIRE_GPU).is_some_and(|value| !value.is_empty() && value != "0")
}

/// What `made` opened, or `None` after printing `skipped: <test>: <err>` — unless
/// [`gpu_required`], or in a test run that left the ignored tests out (the test is not marked
/// `#[ignore = "needs a CUDA device"]`), when it panics naming the test and the error.
///
/// `<test>` is the running test's name (libtest names each test's thread after it), or the
/// executable's name in a bench or example.
#[track_caller]
pub fn cuda_or_skip<T, E: Display>(made: Result<T, E>) -> Option<T> {
    match made {
        Ok(opened) => Some(opened),
        Err(err) => {
            no_device(&err);
            None
        }
    }
}

/// [`cuda_or_skip`] of a backend, as the `BackendRef` tensors take:
/// `backend_or_skip(CudaBackend::new(0))`.
#[track_caller]
pub fn backend_or_skip<B: Backend + 'static, E: Display>(
    made: Result<Arc<B>, E>,
) -> Option<BackendRef> {
    cuda_or_skip(made).map(|backend| backend as BackendRef)
}

/// What `open` opens, opened once per test binary (one per type `T`) and shared by every test
/// that asks: the first call opens it and keeps the result, later calls get a clone. Without it,
/// each call passes the kept error through [`cuda_or_skip`] (a skip line per test, or under
/// [`REQUIRE_GPU`] a failure). For tests that may share a device's backend; one that counts its
/// allocator's bytes opens a backend of its own.
#[track_caller]
pub fn shared_or_skip<T, E>(open: impl FnOnce() -> Result<T, E>) -> Option<T>
where
    T: Clone + Send + Sync + 'static,
    E: Display,
{
    type Opened = (TypeId, Box<dyn Any + Send + Sync>);
    static OPENED: Mutex<Vec<Opened>> = Mutex::new(Vec::new());
    let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
    let at = match opened.iter().position(|(id, _)| *id == TypeId::of::<T>()) {
        Some(at) => at,
        None => {
            let result: Result<T, String> = open().map_err(|err| err.to_string());
            opened.push((TypeId::of::<T>(), Box::new(result)));
            opened.len() - 1
        }
    };
    let result = opened[at]
        .1
        .downcast_ref::<Result<T, String>>()
        .expect("kept under its type's id")
        .clone();
    drop(opened);
    cuda_or_skip(result)
}

/// Skips for any other reason the test cannot run (`why`: "the device cannot map pages",
/// "python3 is not on PATH"): prints `skipped: <test>: <why>`, after which the caller returns —
/// unless [`gpu_required`], when it panics naming the test and `why`.
#[track_caller]
pub fn skip(why: impl Display) {
    let strictness = if gpu_required() {
        Strictness::GpuRequired
    } else {
        Strictness::Skips
    };
    skip_or_fail(&why, strictness);
}

/// Whether `visible` GPUs are enough for a test that needs `needed`; if not, after printing
/// `skipped: <test>: needs <needed> GPUs, <visible> visible` — unless [`gpu_required`] (a run on
/// fewer GPUs must leave the test out, see the module header) or the run left the ignored tests
/// out, when it panics instead.
#[track_caller]
pub fn gpus_or_skip(needed: usize, visible: usize) -> bool {
    match gpus_shortfall(needed, visible) {
        Some(why) => {
            no_device(&why);
            false
        }
        None => true,
    }
}

/// Holds the device for one test at a time within a test binary, for tests that reason about
/// free memory or about what runs when. A test that panicked while holding it does not stop the
/// others (the poison is cleared).
pub fn exclusive_device() -> MutexGuard<'static, ()> {
    static DEVICE: Mutex<()> = Mutex::new(());
    DEVICE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why `visible` GPUs are too few for a test that needs `needed`, or `None`.
fn gpus_shortfall(needed: usize, visible: usize) -> Option<String> {
    (visible < needed).then(|| format!("needs {needed} GPUs, {visible} visible"))
}

/// What a skip is in this run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strictness {
    /// It prints its line and the caller passes.
    Skips,
    /// [`REQUIRE_GPU`] is set: it fails.
    GpuRequired,
    /// A test asked for a device in a run that left the ignored tests out: it is not marked, and
    /// fails.
    Unmarked,
}

/// Prints the skip line for a missing device, or panics where a skip is a failure: under
/// [`REQUIRE_GPU`], or in a test of a run that left the ignored tests out.
#[track_caller]
fn no_device(why: &dyn Display) {
    let strictness = if gpu_required() {
        Strictness::GpuRequired
    } else if in_a_test() && !includes_ignored(std::env::args_os()) {
        Strictness::Unmarked
    } else {
        Strictness::Skips
    };
    skip_or_fail(why, strictness);
}

/// Prints the skip line for `why`, or panics where a skip is a failure.
#[track_caller]
fn skip_or_fail(why: &dyn Display, strictness: Strictness) {
    match skip_line_or_failure(why, strictness) {
        Ok(line) => println!("{line}"),
        Err(failure) => panic!("{failure}"),
    }
}

/// `skipped: <test>: <why>`, the one skip line of the workspace; or the message of the failure
/// that replaces it.
fn skip_line_or_failure(why: &dyn Display, strictness: Strictness) -> Result<String, String> {
    let test = running();
    match strictness {
        Strictness::Skips => Ok(format!("skipped: {test}: {why}")),
        Strictness::GpuRequired => Err(format!(
            "{test}: {REQUIRE_GPU} is set, so a skip is a failure: {why}"
        )),
        Strictness::Unmarked => Err(format!(
            "{test} asks for a CUDA device but is not marked #[ignore = \"{IGNORE_REASON}\"]: \
             without a device it would pass as ok; mark it (the GPU machine runs it with \
             --include-ignored): {why}"
        )),
    }
}

/// Whether a test binary's arguments include the ignored tests (`--include-ignored`,
/// `--ignored`).
fn includes_ignored<A: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = A>) -> bool {
    args.into_iter()
        .any(|arg| arg.as_ref() == "--include-ignored" || arg.as_ref() == "--ignored")
}

/// Whether a test harness runs this thread: libtest names each test's thread after the test.
fn in_a_test() -> bool {
    std::thread::current()
        .name()
        .is_some_and(|name| name != "main")
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
    //! What the gate prints or fails with, computed without printing: a skip line in a passing
    //! test's output would fail the GPU scripts, which read it (`--show-output`).

    use super::*;

    #[test]
    fn an_opened_device_passes_through() {
        assert_eq!(cuda_or_skip(Ok::<_, String>(3)), Some(3));
    }

    #[test]
    fn a_shared_device_is_opened_once_per_type() {
        let opened = std::sync::atomic::AtomicU32::new(0);
        let open = || {
            opened.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, String>(7u16)
        };
        assert_eq!(shared_or_skip(open), Some(7));
        assert_eq!(shared_or_skip(open), Some(7));
        assert_eq!(shared_or_skip(|| Ok::<_, String>(8u8)), Some(8));
        assert_eq!(opened.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn a_skip_prints_its_line_or_fails_when_required_or_unmarked() {
        assert_eq!(
            skip_line_or_failure(&"no CUDA driver", Strictness::Skips),
            Ok(
                "skipped: gpu::tests::a_skip_prints_its_line_or_fails_when_required_or_unmarked: \
                 no CUDA driver"
                    .to_owned()
            )
        );
        assert_eq!(
            skip_line_or_failure(&"the device cannot map pages", Strictness::GpuRequired),
            Err(
                "gpu::tests::a_skip_prints_its_line_or_fails_when_required_or_unmarked: \
                 HEADROOM_REQUIRE_GPU is set, so a skip is a failure: the device cannot map pages"
                    .to_owned()
            )
        );
        assert_eq!(
            skip_line_or_failure(&"no CUDA driver", Strictness::Unmarked),
            Err(
                "gpu::tests::a_skip_prints_its_line_or_fails_when_required_or_unmarked asks for \
                 a CUDA device but is not marked #[ignore = \"needs a CUDA device\"]: without a \
                 device it would pass as ok; mark it (the GPU machine runs it with \
                 --include-ignored): no CUDA driver"
                    .to_owned()
            )
        );
    }

    /// A run includes the ignored tests with `--include-ignored` or `--ignored`, wherever they
    /// stand among the other arguments; a test filter that merely contains the word does not.
    #[test]
    fn a_run_includes_the_ignored_tests_by_its_flags() {
        assert!(includes_ignored(["binary", "--include-ignored"]));
        assert!(includes_ignored([
            "binary",
            "filter",
            "--show-output",
            "--ignored"
        ]));
        assert!(!includes_ignored(["binary"]));
        assert!(!includes_ignored(["binary", "include-ignored", "--exact"]));
    }

    /// libtest names each test's thread after the test, which is how the gate knows a test asked.
    #[test]
    fn a_test_runs_on_a_thread_named_after_it() {
        assert!(in_a_test());
        let name = std::thread::current().name().map(str::to_owned);
        assert_eq!(
            name.as_deref(),
            Some("gpu::tests::a_test_runs_on_a_thread_named_after_it")
        );
    }

    #[test]
    fn fewer_gpus_than_needed_are_a_shortfall() {
        assert_eq!(gpus_shortfall(2, 2), None);
        assert_eq!(gpus_shortfall(2, 8), None);
        assert_eq!(gpus_shortfall(1, 1), None);
        assert_eq!(
            gpus_shortfall(2, 1).as_deref(),
            Some("needs 2 GPUs, 1 visible")
        );
        assert_eq!(
            gpus_shortfall(2, 0).as_deref(),
            Some("needs 2 GPUs, 0 visible")
        );
        assert!(gpus_or_skip(2, 2));
    }
}
