//! The C ABI's misuse suite, on host memory (no GPU needed): every function given what PyTorch
//! or a careless caller could pass — null and non-UTF-8 strings, device ordinals out of range,
//! negative and huge sizes, pointers it never handed out, calls after the settings froze,
//! unwritable paths — answers with its status (-1 or null) and a `headroom_last_error` that
//! names the culprit, and leaves the allocator's books exact.
//!
//! The allocator is process-wide state, so this is its own test binary with one test, and the
//! cases run in table order: first those before anything is frozen, then the first allocation,
//! then those on a live allocator. One checker runs them all (each under `catch_unwind`),
//! collects every failure and panics once listing them; [`KNOWN_BUGS`] lists cases that fail
//! because of a bug not fixed yet (the checker asserts that exactly those fail). Only values
//! within each function's safety contract are passed: misuse here is wrong values, not
//! undefined behaviour.

use std::ffi::{c_char, c_void, CStr, CString};

use headroom_testkit::misuse::{check_misuse, MisuseCase};
use headroom_testkit::misuse_cases;
use headroom_torch_allocator::abi::*;
use headroom_torch_allocator::{last_error, MAX_DEVICES};

/// `Ok` when the call answered as it must, else what it did instead.
type Outcome = Result<(), OutcomeError>;

/// Why a case failed.
type OutcomeError = String;

/// A named misuse and the check of the C function's answer.
type Case = MisuseCase<OutcomeError>;

/// Cases that fail today because of a bug in the library (described in each entry's comment);
/// the checker asserts that exactly these fail, so a fix must remove its entry.
const KNOWN_BUGS: &[&str] = &[];

/// Today's count of cases, so that a case lost from the table fails the test.
const MIN_CASES: usize = 43;

/// Host memory the allocator may use (64 MiB).
const CAPACITY: u64 = 64 << 20;

/// An ordinal that no case uses: [`sentinel`] fails with it, so a stale message never passes
/// for the one a case expects.
const SENTINEL_DEVICE: i32 = 777;

/// Sets `headroom_last_error` to a message no case expects ("device 777 ...").
fn sentinel() {
    assert_eq!(headroom_empty_cache(SENTINEL_DEVICE), -1);
}

/// Runs `call` after [`sentinel`] and returns its result with the last error message then.
fn with_last_error<T>(call: impl FnOnce() -> T) -> (T, String) {
    sentinel();
    let res = call();
    (res, last_error().unwrap_or_default())
}

/// `Ok` when `message` contains every one of `texts` and is not the sentinel's.
fn names(message: &str, texts: &[&str]) -> Outcome {
    if message.contains(&format!("device {SENTINEL_DEVICE}")) {
        return Err(format!(
            "the call set no error (still the sentinel's: {message})"
        ));
    }
    match texts.iter().find(|text| !message.contains(**text)) {
        None => Ok(()),
        Some(text) => Err(format!("the error does not name {text:?}: {message}")),
    }
}

/// `Ok` when `call` returns -1 and sets an error naming every one of `texts`.
fn refused_naming(call: impl FnOnce() -> i32, texts: &[&str]) -> Outcome {
    let (status, message) = with_last_error(call);
    expect_eq(status, -1, "status")?;
    names(&message, texts)
}

/// `Ok` when `call` returns null and sets an error naming every one of `texts`.
fn null_naming(call: impl FnOnce() -> *mut c_void, texts: &[&str]) -> Outcome {
    let (ptr, message) = with_last_error(call);
    expect_eq(ptr.is_null(), true, "null")?;
    names(&message, texts)
}

/// `Ok` when `headroom_record_stream` of `ptr` on device 0 is refused naming every one of
/// `texts`.
fn record_stream_refused(ptr: *mut c_void, texts: &[&str]) -> Outcome {
    // SAFETY: the null stream; host memory never dereferences it, nor `ptr`.
    refused_naming(
        || unsafe { headroom_record_stream(ptr, 0, std::ptr::null_mut()) },
        texts,
    )
}

/// The sentinel's message and an 8-byte buffer of 0x55 after `headroom_last_error` wrote into
/// its first `writable` bytes (at most 8), once the length it returned is checked.
fn last_error_into(writable: usize) -> Result<(String, [u8; 8]), String> {
    sentinel();
    let full = last_error().unwrap_or_default();
    let mut buf = [0x55u8; 8];
    assert!(writable <= buf.len());
    // SAFETY: `buf` has `writable` writable bytes (of 8).
    let len = unsafe { headroom_last_error(buf.as_mut_ptr().cast(), writable) };
    expect_eq(len, full.len(), "returned length")?;
    Ok((full, buf))
}

/// `Ok` when the call left the sentinel's message in place: it reported no error.
fn no_error(message: &str) -> Outcome {
    if message.contains(&format!("device {SENTINEL_DEVICE}")) {
        Ok(())
    } else {
        Err(format!("the call set an error: {message}"))
    }
}

/// `Ok` when `got == expected`.
fn expect_eq<T: PartialEq + std::fmt::Debug>(got: T, expected: T, what: &str) -> Outcome {
    if got == expected {
        Ok(())
    } else {
        Err(format!("{what}: expected {expected:?}, got {got:?}"))
    }
}

/// `headroom_configure(text)`.
fn configure(text: &str) -> i32 {
    let text = CString::new(text).expect("no NUL inside");
    // SAFETY: a NUL-terminated string.
    unsafe { headroom_configure(text.as_ptr()) }
}

/// `headroom_configure(conf)` of a raw pointer: null or a NUL-terminated string.
fn configure_raw(conf: *const c_char) -> i32 {
    // SAFETY: null (the one non-string it reads, as an error) or a NUL-terminated string.
    unsafe { headroom_configure(conf) }
}

/// `headroom_snapshot(0, path)` of a raw pointer: null or a NUL-terminated string.
fn snapshot_raw(path: *const c_char) -> i32 {
    // SAFETY: null (the one non-string it reads, as an error) or a NUL-terminated string.
    unsafe { headroom_snapshot(0, path) }
}

/// `Ok` when `call` of `bytes` (NUL-terminated, maybe not UTF-8; `None`: null) returns -1 and
/// sets an error naming every one of `texts`.
fn string_refused(call: fn(*const c_char) -> i32, bytes: Option<&[u8]>, texts: &[&str]) -> Outcome {
    let ptr = match bytes {
        Some(bytes) => {
            assert_eq!(bytes.last(), Some(&0), "NUL-terminated");
            bytes.as_ptr().cast::<c_char>()
        }
        None => std::ptr::null(),
    };
    refused_naming(|| call(ptr), texts)
}

/// `headroom_alloc(size, device, null)`.
fn alloc(size: isize, device: i32) -> *mut c_void {
    // SAFETY: the null stream is the legacy default stream; host memory never dereferences it.
    unsafe { headroom_alloc(size, device, std::ptr::null_mut()) }
}

/// A live allocation of 4096 bytes on device 0.
fn live_alloc() -> Result<*mut c_void, String> {
    let ptr = alloc(4096, 0);
    if ptr.is_null() {
        return Err(format!("setup: {:?}", last_error()));
    }
    Ok(ptr)
}

/// `headroom_snapshot(device, path)` for a Rust path string.
fn snapshot(device: i32, path: &str) -> i32 {
    let path = CString::new(path).expect("no NUL inside");
    // SAFETY: a NUL-terminated string.
    unsafe { headroom_snapshot(device, path.as_ptr()) }
}

/// Device 0's statistic `key` from `headroom_memory_stats_json`.
fn stat(key: &str) -> Result<i64, String> {
    let text = headroom_memory_stats_json(0);
    if text.is_null() {
        return Err(format!("no statistics: {:?}", last_error()));
    }
    // SAFETY: a string this library returned, freed once below.
    let json = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: returned by `headroom_memory_stats_json`, not freed before.
    unsafe { headroom_string_free(text) };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&json).map_err(|err| err.to_string())?;
    map.get(key)
        .and_then(serde_json::Value::as_i64)
        .ok_or_else(|| format!("no statistic {key}"))
}

/// A path in the temporary directory, unique to this process and `name`.
fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "headroom_c_abi_misuse_{}_{name}",
        std::process::id()
    ))
}

#[test]
fn the_c_abi_refuses_misuse_with_a_status_and_a_message() {
    let cases = cases();
    check_misuse(&cases, KNOWN_BUGS, MIN_CASES);
}

/// Each device-taking function with ordinal `device`: fails (-1 or null) and names the ordinal.
fn bad_ordinal(device: i32, call: fn(i32) -> bool) -> Outcome {
    let (failed, message) = with_last_error(|| call(device));
    if !failed {
        return Err(format!("device {device} was accepted"));
    }
    names(&message, &[&format!("device {device} ")])
}

/// [`bad_ordinal`] with ordinals -1 and 1000, in turn.
fn bad_ordinals(call: fn(i32) -> bool) -> Outcome {
    for device in [-1, 1000] {
        bad_ordinal(device, call)?;
    }
    Ok(())
}

fn alloc_on(device: i32) -> bool {
    alloc(1024, device).is_null()
}

fn free_on(device: i32) -> bool {
    headroom_free(0x1000 as *mut c_void, 1024, device, std::ptr::null_mut());
    true
}

fn record_stream_on(device: i32) -> bool {
    // SAFETY: the null stream; host memory never dereferences it.
    unsafe { headroom_record_stream(0x1000 as *mut c_void, device, std::ptr::null_mut()) == -1 }
}

fn empty_cache_on(device: i32) -> bool {
    headroom_empty_cache(device) == -1
}

fn reset_peak_stats_on(device: i32) -> bool {
    headroom_reset_peak_stats(device) == -1
}

fn memory_stats_on(device: i32) -> bool {
    headroom_memory_stats_json(device).is_null()
}

fn memory_summary_on(device: i32) -> bool {
    headroom_memory_summary(device, 1).is_null()
}

fn record_history_on(device: i32) -> bool {
    headroom_record_history(device, 1, 0) == -1
}

fn snapshot_on(device: i32) -> bool {
    snapshot(device, &temp_path("bad_device.pickle").to_string_lossy()) == -1
}

/// The cases, in the order they must run: the allocator's state carries from one to the next.
fn cases() -> Vec<Case> {
    misuse_cases![
        // Before anything is frozen: bad settings and bad arguments change nothing.
        configure_null_is_refused_naming_conf =>
            string_refused(configure_raw, None, &["`conf`", "non-null UTF-8"]),
        configure_invalid_utf8_is_refused_naming_conf =>
            string_refused(configure_raw, Some(&[0xff, 0xfe, b'x', 0]), &["`conf`"]),
        configure_misspelt_key_is_refused_naming_it =>
            refused_naming(|| configure("max_split_sise_mb:64"), &["max_split_sise_mb"]),
        configure_page_size_above_1_tib_is_refused_naming_its_key => refused_naming(
            || configure("expandable_page_size_mb:1048578"),
            &["expandable_page_size_mb", "1048578"],
        ),
        configure_memory_fraction_of_2_is_refused_naming_its_key => refused_naming(
            || configure("per_process_memory_fraction:2"),
            &["per_process_memory_fraction"],
        ),
        configure_cuda_malloc_async_is_refused_naming_backend =>
            refused_naming(|| configure("backend:cudaMallocAsync"), &["backend"]),
        alloc_of_a_negative_size_is_null_naming_the_size =>
            null_naming(|| alloc(-1, 0), &["negative", "(-1)"]),
        alloc_of_isize_min_bytes_is_null_naming_the_size =>
            null_naming(|| alloc(isize::MIN, 0), &["negative", &isize::MIN.to_string()]),
        alloc_on_device_minus_1_or_1000_is_null_naming_it => bad_ordinals(alloc_on),
        alloc_on_device_max_devices_is_null_naming_it => bad_ordinal(MAX_DEVICES as i32, alloc_on),
        free_on_device_minus_1_or_1000_is_an_error_naming_it => bad_ordinals(free_on),
        record_stream_on_device_minus_1_or_1000_is_refused_naming_it =>
            bad_ordinals(record_stream_on),
        empty_cache_on_device_minus_1_or_1000_is_refused_naming_it => bad_ordinals(empty_cache_on),
        reset_peak_stats_on_device_minus_1_or_1000_is_refused_naming_it =>
            bad_ordinals(reset_peak_stats_on),
        memory_stats_on_device_minus_1_or_1000_is_null_naming_it => bad_ordinals(memory_stats_on),
        memory_summary_on_device_minus_1_or_1000_is_null_naming_it =>
            bad_ordinals(memory_summary_on),
        record_history_on_device_minus_1_or_1000_is_refused_naming_it =>
            bad_ordinals(record_history_on),
        snapshot_on_device_minus_1_or_1000_is_refused_naming_it => bad_ordinals(snapshot_on),
        snapshot_to_a_null_path_is_refused_naming_path =>
            string_refused(snapshot_raw, None, &["`path`"]),
        snapshot_to_an_invalid_utf8_path_is_refused_naming_path =>
            string_refused(snapshot_raw, Some(&[0xc3, 0x28, 0]), &["`path`"]),
        string_free_of_null_is_harmless => {
            // SAFETY: null is allowed (a no-op).
            let ((), message) =
                with_last_error(|| unsafe { headroom_string_free(std::ptr::null_mut()) });
            no_error(&message)
        },
        last_error_into_a_1_byte_buffer_writes_only_the_nul_and_returns_the_length => {
            let (_, buf) = last_error_into(1)?;
            expect_eq(buf, [0, 0x55, 0x55, 0x55, 0x55, 0x55, 0x55, 0x55], "buffer")
        },
        last_error_into_a_short_buffer_is_cut_and_nul_terminated => {
            let (full, buf) = last_error_into(7)?;
            let mut expected = [0x55u8; 8];
            expected[..6].copy_from_slice(&full.as_bytes()[..6]);
            expected[6] = 0;
            expect_eq(buf, expected, "buffer")
        },
        bad_calls_before_the_first_allocation_freeze_nothing =>
            expect_eq(headroom_is_in_use(), 0, "headroom_is_in_use"),
        host_memory_and_classic_segments_are_accepted_before_the_first_allocation => {
            expect_eq(headroom_use_host_memory(CAPACITY), 0, "use_host_memory")?;
            expect_eq(configure("expandable_segments:False"), 0, "configure")?;
            expect_eq(headroom_is_in_use(), 0, "headroom_is_in_use")
        },
        // The first allocation freezes the settings.
        alloc_of_0_bytes_is_null_without_an_error => {
            let (ptr, message) = with_last_error(|| alloc(0, 0));
            expect_eq(ptr.is_null(), true, "null")?;
            no_error(&message)?;
            expect_eq(headroom_is_in_use(), 1, "headroom_is_in_use")
        },
        configure_after_the_first_allocation_is_already_in_use => refused_naming(
            || configure("expandable_segments:True"),
            &["already serves allocations", "before the first"],
        ),
        use_host_memory_after_the_first_allocation_is_already_in_use => refused_naming(
            || headroom_use_host_memory(1 << 20),
            &["already serves allocations"],
        ),
        a_refused_configure_after_freezing_keeps_the_settings => {
            let settings = headroom_torch_allocator::settings();
            if settings.contains("expandable_segments:False") {
                Ok(())
            } else {
                Err(format!("the settings changed: {settings}"))
            }
        },
        alloc_past_the_host_capacity_is_null_naming_out_of_memory => {
            null_naming(|| alloc(128 << 20, 0), &["out of memory", "128.00 MiB"])?;
            expect_eq(stat("allocated_bytes.all.current")?, 0, "allocated bytes")
        },
        alloc_of_isize_max_bytes_is_null_naming_out_of_memory =>
            null_naming(|| alloc(isize::MAX, 0), &["out of memory"]),
        alloc_on_the_last_device_ordinal_is_served => {
            let ptr = alloc(4096, MAX_DEVICES as i32 - 1);
            if ptr.is_null() {
                return Err(format!("refused: {:?}", last_error()));
            }
            headroom_free(ptr, 4096, MAX_DEVICES as i32 - 1, std::ptr::null_mut());
            expect_eq(stat("allocated_bytes.all.current")?, 0, "allocated bytes")
        },
        free_of_a_pointer_never_handed_out_is_an_error_naming_it => {
            let ((), message) = with_last_error(|| {
                headroom_free(0x10 as *mut c_void, 16, 0, std::ptr::null_mut())
            });
            names(&message, &["0x10", "not a live allocation"])
        },
        free_of_null_is_a_no_op => {
            let ((), message) = with_last_error(|| {
                headroom_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut())
            });
            no_error(&message)
        },
        free_inside_a_live_allocation_is_an_error_and_frees_nothing => {
            let ptr = live_alloc()?;
            let inside = ptr.cast::<u8>().wrapping_add(256).cast::<c_void>();
            let ((), message) =
                with_last_error(|| headroom_free(inside, 4096, 0, std::ptr::null_mut()));
            let res = names(&message, &["not a live allocation"]).and_then(|()| {
                expect_eq(
                    stat("allocated_bytes.all.current")?,
                    4096,
                    "allocated bytes",
                )
            });
            headroom_free(ptr, 4096, 0, std::ptr::null_mut());
            res
        },
        free_twice_is_an_error_the_second_time_and_counts_one_free => {
            let ptr = live_alloc()?;
            let ((), first) =
                with_last_error(|| headroom_free(ptr, 4096, 0, std::ptr::null_mut()));
            no_error(&first)?;
            let ((), second) =
                with_last_error(|| headroom_free(ptr, 4096, 0, std::ptr::null_mut()));
            names(&second, &["not a live allocation"])?;
            expect_eq(stat("allocated_bytes.all.current")?, 0, "allocated bytes")?;
            expect_eq(
                stat("allocation.all.freed")?,
                stat("allocation.all.allocated")?,
                "frees",
            )
        },
        record_stream_on_a_pointer_never_handed_out_is_refused_naming_it =>
            record_stream_refused(0x20 as *mut c_void, &["0x20"]),
        record_stream_on_null_is_refused =>
            record_stream_refused(std::ptr::null_mut(), &["not a live allocation"]),
        record_stream_on_a_freed_pointer_is_refused => {
            let ptr = live_alloc()?;
            headroom_free(ptr, 4096, 0, std::ptr::null_mut());
            record_stream_refused(ptr, &["not a live allocation"])
        },
        snapshot_into_a_missing_directory_is_refused_as_io => {
            let path = temp_path("no_such_dir").join("snapshot.pickle");
            refused_naming(|| snapshot(0, &path.to_string_lossy()), &["i/o error"])
        },
        snapshot_onto_a_directory_is_refused_as_io => refused_naming(
            || snapshot(0, &std::env::temp_dir().to_string_lossy()),
            &["i/o error"],
        ),
        record_history_of_u64_max_entries_is_accepted_and_stops => {
            expect_eq(headroom_record_history(0, 1, u64::MAX), 0, "start")?;
            let ptr = alloc(1000, 0);
            headroom_free(ptr, 1000, 0, std::ptr::null_mut());
            expect_eq(headroom_record_history(0, 0, 0), 0, "stop")
        },
        after_all_misuse_the_books_are_exact => {
            expect_eq(stat("allocated_bytes.all.current")?, 0, "allocated bytes")?;
            expect_eq(stat("allocation.all.current")?, 0, "allocations")?;
            expect_eq(headroom_empty_cache(0), 0, "empty_cache")?;
            expect_eq(stat("reserved_bytes.all.current")?, 0, "reserved bytes")
        },
    ]
}
