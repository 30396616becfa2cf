//! The C ABI on a real device (feature `cuda`): PyTorch's calls served from device memory with
//! Headroom's default settings (expandable segments), on the legacy default stream. Marked
//! `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

use std::ffi::{c_void, CStr};

use headroom_caching_allocator::CudaStorage;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_torch_allocator::abi::*;
use headroom_torch_allocator::last_error;

#[test]
#[ignore = "needs a CUDA device"]
fn the_c_abi_serves_device_memory() {
    if cuda_or_skip(CudaStorage::new(0)).is_none() {
        return;
    }
    // SAFETY: the null stream is the legacy default stream, valid for the process.
    let ptr = unsafe { headroom_alloc(5 << 20, 0, std::ptr::null_mut()) };
    assert!(!ptr.is_null(), "{:?}", last_error());
    let text = headroom_memory_stats_json(0);
    // SAFETY: a string this library returned, freed once below.
    let json = unsafe { CStr::from_ptr(text) }.to_str().unwrap().to_owned();
    // SAFETY: returned by `headroom_memory_stats_json`, not freed before.
    unsafe { headroom_string_free(text) };
    let stats: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(stats["allocated_bytes.all.current"], 5 << 20);
    // Expandable segments map only the pages needed: 5 MiB round up to three of the default's
    // 2 MiB large-pool pages.
    let page = headroom_caching_allocator::AllocatorConfig::default().expandable_page_size();
    assert_eq!(
        stats["reserved_bytes.all.current"],
        (5u64 << 20).div_ceil(page) * page
    );
    headroom_free(ptr, 5 << 20, 0, std::ptr::null_mut::<c_void>());
    assert_eq!(headroom_empty_cache(0), 0);
}
