//! The C ABI as PyTorch drives it, on host memory (no GPU needed): configuration before and
//! after the first allocation, allocations on two streams, statistics as JSON with exact byte
//! counts, `record_stream`, the summary, `empty_cache`, peak reset and a snapshot pickle read
//! back. One test: the allocator is process-wide state.

use std::ffi::{c_void, CStr, CString};

use headroom_caching_allocator::read_pickle;
use headroom_torch_allocator::abi::*;
use headroom_torch_allocator::last_error;

fn stats(device: i32) -> serde_json::Map<String, serde_json::Value> {
    let text = headroom_memory_stats_json(device);
    assert!(!text.is_null(), "{:?}", last_error());
    // SAFETY: a string this library returned, freed once below.
    let json = unsafe { CStr::from_ptr(text) }.to_str().unwrap().to_owned();
    // SAFETY: returned by `headroom_memory_stats_json`, not freed before.
    unsafe { headroom_string_free(text) };
    match serde_json::from_str(&json).unwrap() {
        serde_json::Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

fn stat(map: &serde_json::Map<String, serde_json::Value>, key: &str) -> i64 {
    map[key].as_i64().unwrap()
}

#[test]
fn the_c_abi_serves_pytorchs_calls_on_host_memory() {
    let conf = |text: &str| {
        let text = CString::new(text).unwrap();
        // SAFETY: a NUL-terminated string.
        unsafe { headroom_configure(text.as_ptr()) }
    };
    // A bad key is refused with its name, before anything is frozen.
    assert_eq!(conf("max_split_sise_mb:64"), -1);
    assert!(
        last_error().unwrap().contains("max_split_sise_mb"),
        "{:?}",
        last_error()
    );
    assert_eq!(headroom_is_in_use(), 0);
    assert_eq!(conf("expandable_segments:False"), 0);
    assert_eq!(headroom_use_host_memory(1 << 30), 0);

    // Two streams, as PyTorch passes them: the null stream and a handle.
    let side = 0x5eed as *mut c_void;
    // SAFETY: host memory ignores the stream handles; they are never dereferenced.
    let (a, b, c) = unsafe {
        (
            headroom_alloc(1000, 0, std::ptr::null_mut()),
            headroom_alloc(3 << 20, 0, std::ptr::null_mut()),
            headroom_alloc(4096, 0, side),
        )
    };
    assert!(!a.is_null() && !b.is_null() && !c.is_null());
    assert_eq!(headroom_is_in_use(), 1);
    // SAFETY: 0 bytes allocate nothing.
    assert!(unsafe { headroom_alloc(0, 0, std::ptr::null_mut()) }.is_null());
    // The memory is real and writable.
    // SAFETY: `b` is a live host allocation of at least 3 MiB.
    unsafe { std::ptr::write_bytes(b.cast::<u8>(), 7, 3 << 20) };

    let s = stats(0);
    // 1000 → 1024 (512-rounded), 3 MiB, 4096: exact bytes, three blocks.
    assert_eq!(
        stat(&s, "allocated_bytes.all.current"),
        1024 + (3 << 20) + 4096
    );
    assert_eq!(
        stat(&s, "requested_bytes.all.current"),
        1000 + (3 << 20) + 4096
    );
    assert_eq!(stat(&s, "allocation.all.current"), 3);
    // Small pool: one 2 MiB segment per stream; large: one 20 MiB segment (classic policy).
    assert_eq!(
        stat(&s, "reserved_bytes.all.current"),
        2 * (2 << 20) + (20 << 20)
    );

    // Settings are frozen now.
    assert_eq!(conf("expandable_segments:True"), -1);
    assert!(
        last_error().unwrap().contains("before the first"),
        "{:?}",
        last_error()
    );

    // `record_stream` on a live block; an unknown address is an error naming it.
    // SAFETY: host memory ignores the stream handle.
    assert_eq!(unsafe { headroom_record_stream(a, 0, side) }, 0);
    // SAFETY: as above.
    let unknown = unsafe { headroom_record_stream(0x10 as *mut c_void, 0, side) };
    assert_eq!(unknown, -1);
    assert!(last_error().unwrap().contains("0x10"), "{:?}", last_error());

    assert_eq!(headroom_record_history(0, 1, 0), 0);
    headroom_free(b, 3 << 20, 0, std::ptr::null_mut());
    headroom_free(c, 4096, 0, side);
    let s = stats(0);
    assert_eq!(stat(&s, "allocated_bytes.all.current"), 1024);
    assert_eq!(
        stat(&s, "allocated_bytes.all.peak"),
        1024 + (3 << 20) + 4096
    );
    assert_eq!(headroom_reset_peak_stats(0), 0);
    assert_eq!(stat(&stats(0), "allocated_bytes.all.peak"), 1024);
    // Freeing twice is an error, not a crash.
    headroom_free(b, 3 << 20, 0, std::ptr::null_mut());
    assert!(
        last_error().unwrap().contains("not a live allocation"),
        "{:?}",
        last_error()
    );

    let summary = headroom_memory_summary(0, 0);
    assert!(!summary.is_null());
    // SAFETY: a string this library returned, freed once below.
    let text = unsafe { CStr::from_ptr(summary) }
        .to_str()
        .unwrap()
        .to_owned();
    // SAFETY: returned by `headroom_memory_summary`, not freed before.
    unsafe { headroom_string_free(summary) };
    assert!(text.contains("PyTorch CUDA memory summary"), "{text}");

    // The snapshot holds the history: the two frees recorded after history started.
    let path = std::env::temp_dir().join(format!("headroom_c_abi_{}.pickle", std::process::id()));
    let c_path = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    let written = unsafe { headroom_snapshot(0, c_path.as_ptr()) };
    assert_eq!(written, 0, "{:?}", last_error());
    let snapshot = read_pickle(std::fs::File::open(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let frees = snapshot.device_traces[0]
        .iter()
        .filter(|e| e.action == headroom_caching_allocator::TraceAction::FreeRequested)
        .count();
    assert_eq!(frees, 2);

    // `empty_cache` returns the segments nothing uses: the 20 MiB one and the side stream's.
    assert_eq!(headroom_empty_cache(0), 0);
    assert_eq!(stat(&stats(0), "reserved_bytes.all.current"), 2 << 20);
    headroom_free(a, 1000, 0, std::ptr::null_mut());
    assert_eq!(stat(&stats(0), "allocated_bytes.all.current"), 0);

    // A device ordinal out of range is an error naming it.
    assert!(headroom_memory_stats_json(-1).is_null());
    assert!(
        last_error().unwrap().contains("device -1"),
        "{:?}",
        last_error()
    );
}
