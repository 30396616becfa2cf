//! Recording allocator history, reading the summary, and exporting a snapshot that PyTorch's
//! memory viewer (<https://pytorch.org/memory_viz>) opens.
//!
//! A toy "training step" allocates activations under context labels on simulated device memory,
//! so the example needs no GPU. Run it with
//! `cargo run --example memory_snapshot -- /tmp/headroom_snapshot.pickle`.

use anyhow::Result;
use headroom::caching_allocator::{
    write_json, write_pickle, AllocatorConfig, CachingAllocator, HistoryOptions, SimulatedStorage,
    StreamId,
};

const MIB: u64 = 1 << 20;

fn main() -> Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "headroom_snapshot.pickle".into());
    // 80 GB of simulated device memory, default settings (expandable segments on).
    let allocator = CachingAllocator::new(
        SimulatedStorage::new(80_000 * MIB),
        AllocatorConfig::default(),
    );
    allocator.record_history(Some(HistoryOptions::default()));

    let weights: Vec<_> = (0..4)
        .map(|_| allocator.allocate(64 * MIB, StreamId::DEFAULT))
        .collect::<Result<_, _>>()?;
    for step in 0..2 {
        let _step = allocator.push_context(&format!("step.{step}"));
        let mut activations = Vec::new();
        {
            let _forward = allocator.push_context("forward");
            for layer in 0..4 {
                let _layer = allocator.push_context(&format!("encoder.{layer}"));
                activations.push(allocator.allocate(24 * MIB + 4096 * layer, StreamId::DEFAULT)?);
                let scratch = allocator.allocate(300 * 1024, StreamId::DEFAULT)?;
                allocator.free(scratch)?;
            }
        }
        let _backward = allocator.push_context("backward");
        while let Some(activation) = activations.pop() {
            allocator.free(activation)?;
        }
    }

    println!("{}", allocator.memory_summary(false));
    let snapshot = allocator.snapshot();
    write_pickle(
        &snapshot,
        std::io::BufWriter::new(std::fs::File::create(&out)?),
    )?;
    let json_path = format!("{out}.json");
    write_json(
        &snapshot,
        std::io::BufWriter::new(std::fs::File::create(&json_path)?),
    )?;
    println!(
        "{} segments, {} trace entries; wrote {out} (open it at https://pytorch.org/memory_viz) and {json_path}",
        snapshot.segments.len(),
        snapshot.device_traces[0].len()
    );
    for weight in weights {
        allocator.free(weight)?;
    }
    Ok(())
}
