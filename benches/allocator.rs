//! Latency of a cached allocate + free pair, on host and simulated storage, with classic and
//! expandable segments. The CUDA comparison (against cuMemAlloc and cuMemAllocAsync) lives in
//! `crates/caching-allocator/benches/cuda_alloc.rs`.

use criterion::{BenchmarkId, Criterion};
use headroom::caching_allocator::{
    AllocatorConfig, CachingAllocator, HostStorage, SimulatedStorage, Storage, StreamId,
};

const MIB: u64 = 1 << 20;

fn pair<S: Storage>(c: &mut Criterion, name: &str, allocator: CachingAllocator<S>) {
    let mut group = c.benchmark_group(format!("alloc_free_pair/{name}"));
    for size in [4096, MIB, 64 * MIB] {
        // Warm the cache so the pair is served from it.
        let warm = allocator.allocate(size, StreamId::DEFAULT).expect("memory");
        allocator.free(warm).expect("live");
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| {
                let block = allocator.allocate(size, StreamId::DEFAULT).expect("memory");
                allocator.free(block).expect("live");
            })
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    pair(
        c,
        "host_classic",
        CachingAllocator::new(HostStorage::new(), AllocatorConfig::default()),
    );
    pair(
        c,
        "simulated_classic",
        CachingAllocator::new(
            SimulatedStorage::new(1 << 40),
            AllocatorConfig::pytorch_defaults(),
        ),
    );
    pair(
        c,
        "simulated_expandable",
        CachingAllocator::new(SimulatedStorage::new(1 << 40), AllocatorConfig::default()),
    );
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    benches(&mut criterion);
    criterion.final_summary();
}
