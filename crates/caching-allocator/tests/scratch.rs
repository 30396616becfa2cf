use std::fs::File;
use std::io::BufReader;
use headroom_caching_allocator::*;
#[test]
fn scratch() {
    for name in ["vit_l16_b8_adam_3steps", "vit_l16_b32_adam_3steps", "vit_b16_batch_change_adamw", "llama_bf16_ckpt_adamw_8steps"] {
    let path = format!("{}/../../testdata/traces/{name}.tsv.gz", env!("CARGO_MANIFEST_DIR"));
    let trace = RecordedTrace::from_events(read_trace_tsv(BufReader::new(File::open(path).unwrap())).unwrap());
    let allocator = CachingAllocator::new(SimulatedStorage::new(150_754_820_096), AllocatorConfig::default());
    let r = replay_trace(&allocator, &trace).unwrap();
    let s = allocator.memory_stats();
    println!("{name}: reserved peak {} live {} | small reserved peak {} small alloc peak {} | large reserved peak {} large alloc peak {}",
      r.peak_reserved_bytes, r.peak_requested_rounded_bytes,
      s.reserved_bytes.small_pool.peak, s.allocated_bytes.small_pool.peak, s.reserved_bytes.large_pool.peak, s.allocated_bytes.large_pool.peak);
    }
}
