//! What one allocate + free pair costs on a CUDA device, three ways: the driver's synchronous
//! `cuMemAlloc` + `cuMemFree`, its stream-ordered pool (`cuMemAllocAsync` + `cuMemFreeAsync` on
//! one stream), and the caching allocator over `CudaStorage`. Before the criterion groups it
//! prints what mapping and unmapping pages costs (the expandable-segment path) for 2 MiB, 20 MiB
//! and 2 GiB, with one handle per granularity chunk (what `CudaStorage` does) and with one handle
//! for the whole range (the lower bound); then what each driver call of a map costs, and whether
//! threads that map in parallel go faster.
//!
//! Run: `cargo bench -p headroom-caching-allocator --features cuda --bench cuda_alloc`.
//! Without a CUDA device, or with one that cannot map pages, it prints the gate's skip notice
//! and exits with success (with `HEADROOM_REQUIRE_GPU=1` it fails instead); a driver call that
//! fails on the device is a failure.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use cudarc::driver::{result, sys, CudaContext};
use headroom_caching_allocator::{
    AllocatorConfig, CachingAllocator, CudaStorage, MappingUnits, Storage, StorageError, StreamId,
};
use headroom_testkit::gpu::{cuda_or_skip, skip};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAIR_SIZES: [u64; 2] = [MIB, 64 * MIB];

fn main() {
    let Some(mut storage) = cuda_or_skip(CudaStorage::new(0)) else {
        return;
    };
    println!("device: {}", storage.device_name());
    if !storage.supports_expandable_segments() {
        skip("the device cannot map pages");
        return;
    }
    print_map_costs(&mut storage).expect("map/unmap timing");
    drop(storage);
    let mut storage = cuda_or_skip(CudaStorage::new(0)).expect("the device answered above");
    print_large_handle_costs(&mut storage).expect("20 MiB-handle timing");
    drop(storage);
    print_handle_phase_costs().expect("handle phase timing");

    let mut criterion = Criterion::default().configure_from_args();
    bench_driver_pairs(&mut criterion);
    bench_cached_pairs(&mut criterion);
    criterion.final_summary();
}

/// Median of `samples`, in microseconds.
fn median_us(samples: &mut [Duration]) -> f64 {
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e6
}

/// Times `map` + `unmap` of 2 MiB, 20 MiB and 2 GiB through the storage, and through a single
/// handle per range, and prints a table.
fn print_map_costs(storage: &mut CudaStorage) -> Result<(), StorageError> {
    let granularity = storage.page_granularity();
    let reserved = 4 * GIB;
    let base = storage.reserve_address_space(reserved, MappingUnits::pages(granularity))?;
    println!("granularity: {granularity} bytes");
    println!(
        "{:>8} {:>8} {:>14} {:>14} {:>16} {:>16}",
        "size", "handles", "map us", "unmap us", "1-handle map us", "1-handle unmap us"
    );
    for (size, reps) in [(2 * MIB, 50), (20 * MIB, 30), (2 * GIB, 5)] {
        let mut maps = Vec::new();
        let mut unmaps = Vec::new();
        for _ in 0..reps {
            let start = Instant::now();
            storage.map(base, size)?;
            maps.push(start.elapsed());
            storage.synchronize_device()?;
            let start = Instant::now();
            storage.unmap(base, size)?;
            unmaps.push(start.elapsed());
        }
        let (mut single_maps, mut single_unmaps) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let (map, unmap) = single_handle_map_unmap(storage.device_ordinal(), base, size)?;
            single_maps.push(map);
            single_unmaps.push(unmap);
        }
        println!(
            "{:>8} {:>8} {:>14.1} {:>14.1} {:>16.1} {:>16.1}",
            format!("{}M", size / MIB),
            size / granularity,
            median_us(&mut maps),
            median_us(&mut unmaps),
            median_us(&mut single_maps),
            median_us(&mut single_unmaps),
        );
    }
    storage.release_address_space(base, reserved)
}

/// Times `map` + `unmap` of a reservation mapped in 20 MiB pages (PyTorch's large-pool page),
/// one handle each.
fn print_large_handle_costs(storage: &mut CudaStorage) -> Result<(), StorageError> {
    let reserved = 4 * GIB;
    let base = storage.reserve_address_space(reserved, MappingUnits::pages(20 * MIB))?;
    println!(
        "{:>8} {:>8} {:>14} {:>14}  (20 MiB pages, one handle each)",
        "size", "handles", "map us", "unmap us"
    );
    for (size, reps) in [(20 * MIB, 30), (2040 * MIB, 5)] {
        let (mut maps, mut unmaps) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let start = Instant::now();
            storage.map(base, size)?;
            maps.push(start.elapsed());
            storage.synchronize_device()?;
            let start = Instant::now();
            storage.unmap(base, size)?;
            unmaps.push(start.elapsed());
        }
        println!(
            "{:>8} {:>8} {:>14.1} {:>14.1}",
            format!("{}M", size / MIB),
            size / (20 * MIB),
            median_us(&mut maps),
            median_us(&mut unmaps),
        );
    }
    storage.release_address_space(base, reserved)
}

/// Maps `[base, base + size)` with one `cuMemCreate` handle, then unmaps it; returns both times.
/// The storage's context is current on this thread (the caller just used it).
fn single_handle_map_unmap(
    ordinal: usize,
    base: u64,
    size: u64,
) -> Result<(Duration, Duration), StorageError> {
    let check = |call: &str, outcome: sys::CUresult| {
        outcome
            .result()
            .map_err(|err| StorageError::Device(format!("{call}: {err}")))
    };
    let location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    };
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location,
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    let access = sys::CUmemAccessDesc {
        location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    let start = Instant::now();
    // SAFETY: `handle`, `prop` and `access` are valid for each call; `base..base + size` lies in a
    // reservation of the current context with nothing mapped (the storage just unmapped it).
    unsafe {
        check(
            "cuMemCreate",
            sys::cuMemCreate(&mut handle, size as usize, &prop, 0),
        )?;
        check("cuMemMap", sys::cuMemMap(base, size as usize, 0, handle, 0))?;
        check(
            "cuMemSetAccess",
            sys::cuMemSetAccess(base, size as usize, &access, 1),
        )?;
    }
    let map = start.elapsed();
    let start = Instant::now();
    // SAFETY: the range was mapped above with `handle`, which is live.
    unsafe {
        check("cuMemUnmap", sys::cuMemUnmap(base, size as usize))?;
        check("cuMemRelease", sys::cuMemRelease(handle))?;
    }
    Ok((map, start.elapsed()))
}

/// What each driver call of a 2 GiB map in 2 MiB handles costs (all `cuMemCreate`s, then all
/// `cuMemMap`s, all `cuMemRelease`s, one `cuMemSetAccess`, all `cuMemUnmap`s), and the same map
/// done by 1, 2, 4 and 8 threads that each create, map and release their share: whether the
/// driver serves handles in parallel.
fn print_handle_phase_costs() -> Result<(), StorageError> {
    const HANDLES: usize = 1024;
    const HANDLE: usize = 2 << 20;
    let device =
        |what: &str, err: &dyn std::fmt::Display| StorageError::Device(format!("{what}: {err}"));
    let context = CudaContext::new(0).map_err(|e| device("context", &e))?;
    context.bind_to_thread().map_err(|e| device("bind", &e))?;
    let check = |call: &str, outcome: sys::CUresult| outcome.result().map_err(|e| device(call, &e));
    let location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: 0,
    };
    let prop = device_prop();
    let access = sys::CUmemAccessDesc {
        location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let bytes = HANDLES * HANDLE;
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: `base` is valid for the call; the size is a multiple of the granularity.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut base, bytes, 0, 0, 0)
    })?;
    let per_handle = |start: Instant| start.elapsed().as_secs_f64() * 1e6 / HANDLES as f64;
    for round in 0..2 {
        let mut handles = vec![0 as sys::CUmemGenericAllocationHandle; HANDLES];
        let start = Instant::now();
        for handle in &mut handles {
            // SAFETY: `handle` and `prop` are valid for the call.
            check("cuMemCreate", unsafe {
                sys::cuMemCreate(handle, HANDLE, &prop, 0)
            })?;
        }
        let create = per_handle(start);
        let start = Instant::now();
        for (i, &handle) in handles.iter().enumerate() {
            let chunk = base + (i * HANDLE) as u64;
            // SAFETY: the chunk lies in the reservation above, unmapped; the handle is live.
            check("cuMemMap", unsafe {
                sys::cuMemMap(chunk, HANDLE, 0, handle, 0)
            })?;
        }
        let map = per_handle(start);
        let start = Instant::now();
        for &handle in &handles {
            // SAFETY: each handle is live and mapped; the mapping keeps its memory.
            check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })?;
        }
        let release = per_handle(start);
        let start = Instant::now();
        // SAFETY: the whole range is mapped above.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(base, bytes, &access, 1)
        })?;
        let set_access = per_handle(start);
        context.synchronize().map_err(|e| device("sync", &e))?;
        let start = Instant::now();
        for i in 0..HANDLES {
            // SAFETY: each chunk is one whole mapping made above.
            check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(base + (i * HANDLE) as u64, HANDLE)
            })?;
        }
        let unmap = per_handle(start);
        println!(
            "2 MiB handles x{HANDLES} (round {round}), us per handle: create {create:.1}, map \
             {map:.1}, release {release:.1}, set access (once) {set_access:.2}, unmap {unmap:.1}"
        );
    }
    for threads in [1usize, 2, 4, 8] {
        let start = Instant::now();
        let outcome: Result<(), StorageError> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let context = context.clone();
                    scope.spawn(move || -> Result<(), StorageError> {
                        context.bind_to_thread().map_err(|e| device("bind", &e))?;
                        let prop = device_prop();
                        for i in (t..HANDLES).step_by(threads) {
                            let chunk = base + (i * HANDLE) as u64;
                            let mut handle: sys::CUmemGenericAllocationHandle = 0;
                            // SAFETY: as above: a fresh handle mapped into an unmapped chunk of
                            // the reservation, released once mapped.
                            unsafe {
                                check(
                                    "cuMemCreate",
                                    sys::cuMemCreate(&mut handle, HANDLE, &prop, 0),
                                )?;
                                check("cuMemMap", sys::cuMemMap(chunk, HANDLE, 0, handle, 0))?;
                                check("cuMemRelease", sys::cuMemRelease(handle))?;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("worker panicked"))
        });
        outcome?;
        // SAFETY: the whole range is mapped by the workers.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(base, bytes, &access, 1)
        })?;
        let total = start.elapsed().as_secs_f64() * 1e3;
        context.synchronize().map_err(|e| device("sync", &e))?;
        let start = Instant::now();
        for i in 0..HANDLES {
            // SAFETY: each chunk is one whole mapping made by a worker.
            check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(base + (i * HANDLE) as u64, HANDLE)
            })?;
        }
        println!(
            "2 GiB as {HANDLES} handles by {threads} thread(s): map {total:.1} ms, unmap {:.1} ms",
            start.elapsed().as_secs_f64() * 1e3
        );
    }
    // SAFETY: the reservation was made above and nothing in it is mapped.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(base, bytes)
    })
}

/// Pinned device memory of device 0, as `CudaStorage` asks for it.
fn device_prop() -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Benchmarks `pair` (an allocation of the size it is given and its free) as `name` at each of
/// [`PAIR_SIZES`].
fn bench_at_pair_sizes(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, pair: impl Fn(u64)) {
    for size in PAIR_SIZES {
        group.bench_with_input(BenchmarkId::new(name, size), &size, |b, &size| {
            b.iter(|| pair(size))
        });
    }
}

/// `cuMemAlloc` + `cuMemFree`, and `cuMemAllocAsync` + `cuMemFreeAsync` on one stream.
fn bench_driver_pairs(criterion: &mut Criterion) {
    let Some(context) = cuda_or_skip(CudaContext::new(0)) else {
        return;
    };
    context.bind_to_thread().expect("binding the context");
    let mut group = criterion.benchmark_group("driver_pair");
    group.throughput(Throughput::Elements(1));
    bench_at_pair_sizes(&mut group, "cuMemAlloc_cuMemFree", |size| {
        // SAFETY: a plain allocation of the current context, freed at once, never used.
        unsafe {
            let address = result::malloc_sync(size as usize).expect("cuMemAlloc");
            result::free_sync(black_box(address)).expect("cuMemFree");
        }
    });
    let stream =
        result::stream::create(result::stream::StreamKind::NonBlocking).expect("cuStreamCreate");
    bench_at_pair_sizes(&mut group, "cuMemAllocAsync_cuMemFreeAsync", |size| {
        // SAFETY: a stream-ordered allocation on a live stream of the current context, freed on
        // the same stream, never used.
        unsafe {
            let address = result::malloc_async(stream, size as usize).expect("cuMemAllocAsync");
            result::free_async(black_box(address), stream).expect("cuMemFreeAsync");
        }
    });
    // SAFETY: the stream was created above; nothing uses it after this.
    unsafe {
        result::stream::synchronize(stream).expect("cuStreamSynchronize");
        result::stream::destroy(stream).expect("cuStreamDestroy");
    }
    group.finish();
}

/// `CachingAllocator<CudaStorage>` allocate + free, after one warm-up pair has filled the cache,
/// with classic and expandable segments.
fn bench_cached_pairs(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("cached_pair");
    group.throughput(Throughput::Elements(1));
    for (name, config) in [
        ("classic", AllocatorConfig::pytorch_defaults()),
        ("expandable", AllocatorConfig::default()),
    ] {
        let Some(storage) = cuda_or_skip(CudaStorage::new(0)) else {
            return;
        };
        let allocator = CachingAllocator::new(storage, config);
        for size in PAIR_SIZES {
            let warm = allocator
                .allocate(size, StreamId::DEFAULT)
                .expect("allocate");
            allocator.free(warm).expect("free");
            group.bench_with_input(
                BenchmarkId::new(format!("CachingAllocator_{name}"), size),
                &size,
                |b, &size| {
                    b.iter(|| {
                        let allocation = allocator
                            .allocate(black_box(size), StreamId::DEFAULT)
                            .expect("allocate");
                        allocator.free(allocation).expect("free");
                    })
                },
            );
        }
    }
    group.finish();
}
